#!/usr/bin/env python3
"""An independent float32 reference for SmolLM2-135M-Instruct (GGUF Q4_1), written to a fixture.

Baton's own loader, tokenizer and kernels are checked against this, so it shares none of them:
the weights are dequantised by llama.cpp's `gguf` Python package, the forward pass is plain
numpy in float32 (Llama: RMSNorm, RoPE on adjacent pairs as llama.cpp's converter permutes Q and
K for, GQA, SwiGLU, tied embeddings), the tokeniser is a byte-level BPE written here from the
file's vocabulary and merges with llama.cpp's `smollm` pre-tokeniser (each digit apart, then the
GPT-2 split), and the chat template is rendered by jinja2 as transformers renders it.

For each prompt it records the prompt's token ids, up to 16 greedy tokens (first maximum, stopping
after end-of-sequence), the gap between the best and second-best logit at each step (a small gap is
a near-tie that a coarser computation may flip), and the decoded answer.

    scripts/install-python-deps.sh && scripts/fetch-model.sh
    .venv/bin/python scripts/reference-smollm2.py   # writes fixtures/smollm2-135m/reference.json
"""

import argparse
import json
import pathlib

import gguf
import jinja2
import numpy as np
import regex

REPO = pathlib.Path(__file__).resolve().parent.parent
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GREEDY_TOKENS = 16

PLAIN_PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little",
    "In 2024, the town had 1234567 people and",
    "def fibonacci(n):\n    ",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
]

# llama.cpp's pre-tokeniser `smollm` (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM): every digit
# is its own piece, then the GPT-2 split. Each regex splits every piece of the previous one into
# its matches and the text between them.
SMOLLM_SPLITS = [
    regex.compile(r"\p{N}"),
    regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"),
]


def field(reader, name):
    return reader.fields[name].contents()


def bytes_to_unicode():
    """GPT-2's reversible map from bytes to printable characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Tokenizer:
    def __init__(self, reader):
        self.tokens = field(reader, "tokenizer.ggml.tokens")
        types = field(reader, "tokenizer.ggml.token_type")
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ")): i for i, m in enumerate(field(reader, "tokenizer.ggml.merges"))}
        assert field(reader, "tokenizer.ggml.pre") == "smollm", "this tokeniser implements the smollm pre-tokeniser"
        # Control and user-defined tokens are matched in the text as they are (longest first).
        specials = sorted((t for t, ty in zip(self.tokens, types) if ty in (3, 4)), key=len, reverse=True)
        self.special_re = regex.compile("(" + "|".join(regex.escape(s) for s in specials) + ")")
        self.specials = set(specials)
        self.byte_map = bytes_to_unicode()
        self.unbyte = {c: b for b, c in self.byte_map.items()}
        self.add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token"))
        self.bos = int(field(reader, "tokenizer.ggml.bos_token_id"))
        self.eos = int(field(reader, "tokenizer.ggml.eos_token_id"))

    def pieces(self, text):
        chunks = [text]
        for pattern in SMOLLM_SPLITS:
            out = []
            for chunk in chunks:
                at = 0
                for m in pattern.finditer(chunk):
                    if m.start() > at:
                        out.append(chunk[at : m.start()])
                    out.append(m.group())
                    at = m.end()
                if at < len(chunk):
                    out.append(chunk[at:])
            chunks = out
        return chunks

    def bpe(self, piece):
        word = [self.byte_map[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            best = min(range(len(word) - 1), key=lambda i: self.ranks.get((word[i], word[i + 1]), float("inf")))
            if (word[best], word[best + 1]) not in self.ranks:
                break
            word = word[:best] + [word[best] + word[best + 1]] + word[best + 2 :]
        return [self.vocab[w] for w in word]

    def encode(self, text):
        ids = [self.bos] if self.add_bos else []
        for part in self.special_re.split(text):
            if not part:
                continue
            if part in self.specials:
                ids.append(self.vocab[part])
                continue
            for piece in self.pieces(part):
                ids.extend(self.bpe(piece))
        return ids

    def decode(self, ids):
        out = bytearray()
        for i in ids:
            t = self.tokens[i]
            if t in self.specials:
                out.extend(t.encode("utf-8"))
            else:
                out.extend(self.unbyte[c] for c in t)
        return out.decode("utf-8", errors="replace")


class Model:
    def __init__(self, reader):
        arch = field(reader, "general.architecture")
        assert arch == "llama", arch
        self.n_layers = int(field(reader, "llama.block_count"))
        self.n_heads = int(field(reader, "llama.attention.head_count"))
        self.n_kv = int(field(reader, "llama.attention.head_count_kv"))
        self.dim = int(field(reader, "llama.embedding_length"))
        self.head_dim = self.dim // self.n_heads
        self.eps = float(field(reader, "llama.attention.layer_norm_rms_epsilon"))
        self.theta = float(field(reader, "llama.rope.freq_base"))
        self.w = {}
        for t in reader.tensors:
            # `dequantize` gives rows of ne0 values: the shape is GGUF's reversed, [out][in].
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            self.w[t.name] = w.reshape([int(d) for d in reversed(t.shape)] if len(t.shape) > 1 else [-1])
        # Tied embeddings when the file has no output matrix.
        self.out = self.w.get("output.weight", self.w["token_embd.weight"])

    def rms(self, x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(self.eps)) * g

    def rope(self, x, positions):
        # x: [T][heads][head_dim]; rotate adjacent pairs (2i, 2i+1) by pos * theta^(-2i/d).
        half = self.head_dim // 2
        freqs = self.theta ** (-np.arange(half, dtype=np.float64) * 2.0 / self.head_dim)
        angles = np.outer(np.asarray(positions, dtype=np.float64), freqs)  # [T][half]
        cos = np.cos(angles).astype(np.float32)[:, None, :]
        sin = np.sin(angles).astype(np.float32)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    def forward(self, ids, cache):
        """Logits of the last of `ids`, appending their K/V to `cache` (a list per layer)."""
        start = len(cache[0][0]) if cache[0] else 0
        positions = list(range(start, start + len(ids)))
        x = self.w["token_embd.weight"][ids]
        group = self.n_heads // self.n_kv
        scale = np.float32(1.0 / np.sqrt(self.head_dim))
        for layer in range(self.n_layers):
            p = f"blk.{layer}."
            h = self.rms(x, self.w[p + "attn_norm.weight"])
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(len(ids), self.n_heads, self.head_dim)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(len(ids), self.n_kv, self.head_dim)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(len(ids), self.n_kv, self.head_dim)
            q, k = self.rope(q, positions), self.rope(k, positions)
            if not cache[layer]:
                cache[layer] = [k, v]
            else:
                cache[layer] = [np.concatenate([cache[layer][0], k]), np.concatenate([cache[layer][1], v])]
            keys, values = cache[layer]
            attn = np.empty((len(ids), self.n_heads, self.head_dim), dtype=np.float32)
            for head in range(self.n_heads):
                kv = head // group
                scores = (q[:, head, :] @ keys[:, kv, :].T) * scale  # [T][S]
                causal = np.arange(keys.shape[0])[None, :] > np.asarray(positions)[:, None]
                scores = np.where(causal, np.float32(-np.inf), scores)
                scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
                scores /= scores.sum(axis=-1, keepdims=True)
                attn[:, head, :] = scores @ values[:, kv, :]
            x = x + attn.reshape(len(ids), self.dim) @ self.w[p + "attn_output.weight"].T
            h = self.rms(x, self.w[p + "ffn_norm.weight"])
            gate = h @ self.w[p + "ffn_gate.weight"].T
            up = h @ self.w[p + "ffn_up.weight"].T
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ self.w[p + "ffn_down.weight"].T
        last = self.rms(x[-1:], self.w["output_norm.weight"])
        return (last @ self.out.T)[0]


def greedy(model, tok, prompt_ids):
    cache = [[] for _ in range(model.n_layers)]
    logits = model.forward(prompt_ids, cache)
    ids, gaps = [], []
    for _ in range(GREEDY_TOKENS):
        best = int(np.argmax(logits))  # the first maximum, as torch.argmax
        top2 = np.sort(logits)[-2:]
        ids.append(best)
        gaps.append(round(float(top2[1] - top2[0]), 4))
        if best == tok.eos:
            break
        logits = model.forward([best], cache)
    return ids, gaps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / ".models" / MODEL_FILE))
    parser.add_argument("--out", default=str(REPO / "fixtures" / "smollm2-135m" / "reference.json"))
    args = parser.parse_args()

    reader = gguf.GGUFReader(args.model)
    tok = Tokenizer(reader)
    model = Model(reader)
    template = jinja2.Environment(loader=jinja2.BaseLoader()).from_string(field(reader, "tokenizer.chat_template"))

    cases = []
    prompts = [("plain", p, p) for p in PLAIN_PROMPTS]
    for q in CHAT_PROMPTS:
        text = template.render(messages=[{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(("chat", q, text))
    for kind, prompt, text in prompts:
        prompt_ids = tok.encode(text)
        ids, gaps = greedy(model, tok, prompt_ids)
        answer = tok.decode(ids)
        print(f"{kind:5} {prompt!r} -> {answer!r} (smallest gap {min(gaps):.3f})")
        cases.append(
            {
                "kind": kind,
                "prompt": prompt,
                "text": text,
                "prompt_ids": prompt_ids,
                "greedy_ids": ids,
                "top2_gaps": gaps,
                "answer": answer,
            }
        )

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    reference = {
        "model_file": MODEL_FILE,
        "model_sha256": MODEL_SHA256,
        "made_by": "scripts/reference-smollm2.py: gguf dequantisation, numpy float32 forward pass, its own BPE",
        "eos_id": tok.eos,
        "cases": cases,
    }
    out.write_text(json.dumps(reference, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
