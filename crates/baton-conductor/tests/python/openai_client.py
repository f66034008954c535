"""Drives a Baton server with the official `openai` client: a streaming chat completion, a
completion (streamed and not), the model list, structured output (`response_format`) and tool
calls, and errors. Exits non-zero on any mismatch.

Usage: openai_client.py BASE_URL MODEL_ID
"""
import json
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

# n = 3 with a seed: three different samples (choice i samples with seed + i), indexed, usage
# summed; streamed, each chunk names its choice.
kwargs = dict(model=model, prompt="Mooncake", max_tokens=8, temperature=1.0, seed=7, n=3, extra_body={"ignore_eos": True})
many = client.completions.create(**kwargs)
assert sorted(c.index for c in many.choices) == [0, 1, 2], many
texts = [c.text for c in sorted(many.choices, key=lambda c: c.index)]
assert len(set(texts)) == 3, texts
assert many.usage.completion_tokens == 24, many.usage
# Reproducible: a seeded request alone gets the same sample twice. (The n = 3 choices above
# run beside each other, batched in ways that vary with timing, and a seeded sample depends on
# the batching: ARCHITECTURE.md, "batch variance".)
alone = dict(kwargs, n=1)
first = client.completions.create(**alone).choices[0].text
assert client.completions.create(**alone).choices[0].text == first, first
parts = {}
for c in client.completions.create(stream=True, **kwargs):
    for choice in c.choices:
        parts[choice.index] = parts.get(choice.index, "") + choice.text
# Streamed, the choices may be batched differently from the run above, and a quantized
# matmul's kernel depends on the batch's rows (ARCHITECTURE.md, "batch variance"): a sample at
# temperature 1 may then differ. What streaming must keep: three indexed, distinct choices.
assert sorted(parts) == [0, 1, 2], parts
assert len(set(parts.values())) == 3, parts
chat_many = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=1.0, seed=3, n=2,
    extra_body={"ignore_eos": True},
)
assert [c.index for c in chat_many.choices] == [0, 1], chat_many

# Structured output: a json_schema answer parses and validates against its schema, streamed or
# not (the schema bounds every value, so any model's answer ends).
schema = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "is_capital": {"type": "boolean"},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 1000},
    },
    "required": ["city", "country", "is_capital", "population_millions"],
    "additionalProperties": False,
}


def check_city(text):
    v = json.loads(text)
    assert isinstance(v, dict) and set(v) == set(schema["required"]), v
    assert isinstance(v["city"], str) and len(v["city"]) <= 40, v
    assert isinstance(v["country"], str) and len(v["country"]) <= 40, v
    assert isinstance(v["is_capital"], bool), v
    assert isinstance(v["population_millions"], int) and not isinstance(v["population_millions"], bool), v
    assert 0 <= v["population_millions"] <= 1000, v


city = dict(
    model=model,
    messages=[{"role": "user", "content": "Describe Paris as JSON: city, country, is it a capital, population in millions."}],
    max_tokens=120,
    temperature=0,
    response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
)
answer = client.chat.completions.create(**city)
assert answer.choices[0].finish_reason == "stop", answer
check_city(answer.choices[0].message.content)
pieces, finish = [], None
for chunk in client.chat.completions.create(stream=True, **city):
    for choice in chunk.choices:
        if choice.delta.content:
            pieces.append(choice.delta.content)
        finish = choice.finish_reason or finish
assert finish == "stop", finish
assert "".join(pieces) == answer.choices[0].message.content, (pieces, answer)
obj = client.chat.completions.create(**{**city, "response_format": {"type": "json_object"}})
if obj.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(obj.choices[0].message.content), dict), obj
else:
    assert obj.choices[0].message.content.startswith("{"), obj

# Tool calls: a forced call (required, or a named function) comes back in `tool_calls`, its
# arguments valid under the function's parameters; streamed as `delta.tool_calls`. (Closed
# parameter schemas, so that even the tiny fixture's random weights end their call.)
tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"], "additionalProperties": False}}},
]


def check_call(name, arguments):
    args = json.loads(arguments)
    assert isinstance(args.get("city"), str) and len(args["city"]) <= 40, args
    if name == "get_weather":
        assert args.get("unit") in ("celsius", "fahrenheit"), args
    else:
        assert name == "get_time", name


ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
for tool_choice, expect in [("required", None), ({"type": "function", "function": {"name": "get_weather"}}, "get_weather")]:
    kwargs = dict(model=model, messages=ask, tools=tools, tool_choice=tool_choice, max_tokens=120, temperature=0)
    called = client.chat.completions.create(**kwargs)
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls", called
    assert choice.message.content is None, called
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_"), call
    assert expect is None or call.function.name == expect, call
    check_call(call.function.name, call.function.arguments)
    deltas, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            deltas.extend(c.delta.tool_calls or [])
            assert not c.delta.content, chunk
            finish = c.finish_reason or finish
    assert finish == "tool_calls", finish
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(call.function.name, call.function.arguments)], deltas

# The call and its result in the history are accepted.
history = ask + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function",
        "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
]
after = client.chat.completions.create(model=model, messages=history, tools=tools, max_tokens=8, temperature=0)
assert after.choices[0].finish_reason in ("stop", "length", "tool_calls"), after

# Invalid combinations are 400s naming the parameter.
for bad, param in [
    (dict(messages=ask, tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(messages=ask, tool_choice="required"), "tool_choice"),
    (dict(messages=ask, response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
    (dict(messages=ask, response_format={"type": "yaml"}), "response_format"),
]:
    try:
        client.chat.completions.create(model=model, max_tokens=4, **bad)
        raise AssertionError(f"accepted: {bad}")
    except openai.BadRequestError as e:
        err = e.body.get("error", e.body) if isinstance(e.body, dict) else {}
        assert err.get("param") == param, (e.body, param)

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
