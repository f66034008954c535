"""Drives a Baton server with the official `openai` client: a streaming chat completion, a
completion (streamed and not), the model list, and an error. Exits non-zero on any mismatch.

Usage: openai_client.py BASE_URL MODEL_ID
"""
import sys

import openai
from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)

models = [m.id for m in client.models.list().data]
assert models == [model], models

# Streaming chat completion.
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is prefill?"}],
    max_tokens=12,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
    extra_body={"ignore_eos": True},
)
pieces, finish, usage = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        if choice.delta.content:
            pieces.append(choice.delta.content)
        if choice.finish_reason:
            finish = choice.finish_reason
chat_text = "".join(pieces)
assert finish == "length", finish
assert usage is not None and usage.completion_tokens == 12, usage

full = client.chat.completions.create(
    model=model,
    messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is prefill?"}],
    max_tokens=12,
    temperature=0,
    extra_body={"ignore_eos": True},
)
assert full.choices[0].message.content == chat_text, (full.choices[0].message.content, chat_text)
assert full.choices[0].message.role == "assistant"

# Completions, plain and streamed, agree.
done = client.completions.create(model=model, prompt="Mooncake", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(
        model=model, prompt="Mooncake", max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    if c.choices
)
assert done.choices[0].text == streamed, (done.choices[0].text, streamed)
assert done.usage.completion_tokens == 10, done.usage

# n = 3 with a seed: three different samples (choice i samples with seed + i), reproducible,
# indexed, usage summed; streamed, each chunk names its choice.
kwargs = dict(model=model, prompt="Mooncake", max_tokens=8, temperature=1.0, seed=7, n=3, extra_body={"ignore_eos": True})
many = client.completions.create(**kwargs)
assert sorted(c.index for c in many.choices) == [0, 1, 2], many
texts = [c.text for c in sorted(many.choices, key=lambda c: c.index)]
assert len(set(texts)) == 3, texts
assert many.usage.completion_tokens == 24, many.usage
again = client.completions.create(**kwargs)
assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts, (again, texts)
parts = {}
for c in client.completions.create(stream=True, **kwargs):
    for choice in c.choices:
        parts[choice.index] = parts.get(choice.index, "") + choice.text
assert [parts[i] for i in range(3)] == texts, (parts, texts)
chat_many = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=1.0, seed=3, n=2,
    extra_body={"ignore_eos": True},
)
assert [c.index for c in chat_many.choices] == [0, 1], chat_many

# Errors come back as the client's typed exceptions.
try:
    client.completions.create(model=model, prompt="hi", max_tokens=-1)
    raise AssertionError("a negative max_tokens was accepted")
except openai.BadRequestError as e:
    assert "max_tokens" in str(e), e
try:
    client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError:
    pass

print("openai client: ok")
