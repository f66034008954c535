#!/usr/bin/env python3
"""PyTorch / transformers reference numbers for Baton's GPU checks.

Every subcommand prints exactly one JSON object on stdout; progress and notes go to stderr.

    logits --model DIR --dtype bf16|f32 --ids FILE [--device cuda|cpu]
                                    last-position logits of each prompt in FILE (a JSON list of
                                    lists of token ids), one prompt at a time, eager attention
    hf-decode --shape 1b|8b [--batch 32 --context 512 --new-tokens 64 --device cuda]
                                    transformers' greedy decode speed on a random-weight Llama of
                                    Llama-3.2-1B / Llama-3.1-8B shape in bf16
    checkpoint --shape 1b|8b --out DIR --tokenizer-from DIR [--device cuda]
                                    writes a random-weight Llama of that shape (bf16 safetensors)
                                    with another checkpoint's tokenizer and vocabulary, for
                                    `baton serve` on real sizes where no weights can travel

Decode speed is batch * (N - 1) / (t_N - t_1): a run with N new tokens less a run with one (the
prefill alone), so prefill and generate() overhead cancel. transformers auto-compiles decoding
with a static cache on CUDA; that is off unless `--compile auto` (compiling an 8B model takes
minutes and needs a working Triton toolchain), so the number is eager transformers.

Needs torch and transformers (written against torch 2.11, transformers 5.17) and numpy.
"""

import argparse
import json
import sys
import time


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def emit(obj):
    print(json.dumps(obj), flush=True)


def need_cuda(torch):
    if not torch.cuda.is_available():
        sys.exit("error: this subcommand needs a CUDA device, and torch.cuda.is_available() is False")
    log(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")


def torch_dtype(torch, name):
    return {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[name]


def cmd_logits(args):
    import torch
    from transformers import AutoModelForCausalLM

    if args.device == "cuda":
        need_cuda(torch)
    with open(args.ids) as f:
        prompts = json.load(f)
    if not (isinstance(prompts, list) and all(isinstance(p, list) and p for p in prompts)):
        sys.exit("error: --ids must hold a JSON list of non-empty lists of token ids")
    dtype = torch_dtype(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="eager")
    model.to(args.device).eval()
    log(f"loaded {type(model).__name__} from {args.model} ({args.dtype}, {args.device})")
    out = {"logits": [], "argmax": [], "top2_margin": []}
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([ids], dtype=torch.long, device=args.device)
            last = model(input_ids=input_ids, use_cache=False).logits[0, -1].float().cpu()
            top = torch.topk(last, 2).values
            out["logits"].append(last.tolist())
            out["argmax"].append(int(last.argmax()))
            out["top2_margin"].append(float(top[0] - top[1]))
    log(f"{len(prompts)} prompts, argmax {out['argmax']}")
    emit(out)


LLAMA_SHAPES = {
    # Llama-3.2-1B
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               head_dim=64, intermediate_size=8192, tie_word_embeddings=True),
    # Llama-3.1-8B
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, intermediate_size=14336, tie_word_embeddings=False),
}


def cmd_hf_decode(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.device == "cuda":
        need_cuda(torch)
    shape = dict(LLAMA_SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    config = LlamaConfig(
        vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        bos_token_id=128000, eos_token_id=128001, pad_token_id=0, **shape,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).eval()
    with torch.no_grad():  # small random weights, norms left at one
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    torch.set_default_dtype(torch.float32)
    params = sum(p.numel() for p in model.parameters())
    log(f"built {args.shape} Llama ({params / 1e9:.2f} B params, {shape['num_hidden_layers']} layers) "
        f"in {time.perf_counter() - t0:.1f} s")

    gen = torch.Generator(device="cpu").manual_seed(1)
    input_ids = torch.randint(1, 128000, (args.batch, args.context), generator=gen).to(args.device)
    attention_mask = torch.ones_like(input_ids)
    model.generation_config.disable_compile = args.compile == "off"

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def run(n, cache):
        kwargs = dict(cache_implementation="static") if cache == "static" else {}
        sync()
        t = time.perf_counter()
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, **kwargs)
        sync()
        assert out.shape == (args.batch, args.context + n), out.shape
        return time.perf_counter() - t

    cache = "static"
    with torch.inference_mode():
        try:
            # Warm up with the full N so that a compiled decode (--compile auto) is compiled here.
            log(f"warm-up, static cache: {run(args.new_tokens, cache):.2f} s")
        except Exception as e:  # noqa: BLE001 - any failure of the static path falls back
            log(f"static cache failed ({type(e).__name__}: {e}); falling back to the dynamic cache")
            cache = "dynamic"
            log(f"warm-up, dynamic cache: {run(args.new_tokens, cache):.2f} s")
        run(1, cache)
        t_n = run(args.new_tokens, cache)
        t_1 = run(1, cache)
    decode = args.batch * (args.new_tokens - 1) / (t_n - t_1)
    log(f"t_{args.new_tokens} = {t_n:.3f} s, t_1 = {t_1:.3f} s: {decode:.0f} decode tok/s")
    emit({"shape": args.shape, "batch": args.batch, "context": args.context, "new_tokens": args.new_tokens,
          "layers": shape["num_hidden_layers"], "decode_tok_s": decode, "prefill_s": t_1, "total_s": t_n,
          "cache": cache, "compile": args.compile, "device": args.device,
          "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None})


def cmd_checkpoint(args):
    import os
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with open(os.path.join(args.tokenizer_from, "config.json")) as f:
        base = json.load(f)
    shape = dict(LLAMA_SHAPES[args.shape])
    config = LlamaConfig(
        vocab_size=base["vocab_size"], max_position_embeddings=args.max_position, rms_norm_eps=1e-5,
        hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        bos_token_id=base.get("bos_token_id"), eos_token_id=base.get("eos_token_id"),
        pad_token_id=base.get("pad_token_id"), **shape,
    )
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(args.out)
    for name in os.listdir(args.tokenizer_from):
        if name.startswith("tokenizer") or name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(os.path.join(args.tokenizer_from, name), args.out)
    params = sum(p.numel() for p in model.parameters())
    log(f"wrote a random {args.shape} Llama ({params / 1e9:.2f} B params) to {args.out} in {time.perf_counter() - t0:.1f} s")
    emit({"shape": args.shape, "out": args.out, "params": params, "vocab_size": base["vocab_size"]})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("logits", help="last-position logits of each prompt")
    s.add_argument("--model", required=True)
    s.add_argument("--dtype", choices=["bf16", "f16", "f32"], default="f32")
    s.add_argument("--ids", required=True, help="JSON file: a list of lists of token ids")
    s.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    s.set_defaults(fn=cmd_logits)

    s = sub.add_parser("hf-decode", help="transformers decode tokens/s on a random Llama")
    s.add_argument("--shape", choices=sorted(LLAMA_SHAPES), required=True)
    s.add_argument("--batch", type=int, default=32)
    s.add_argument("--context", type=int, default=512)
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    s.add_argument("--compile", choices=["off", "auto"], default="off",
                   help="auto: let generate() torch.compile the static-cache decode (default off)")
    s.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)  # shrink for smoke tests
    s.set_defaults(fn=cmd_hf_decode)

    s = sub.add_parser("checkpoint", help="a random-weight Llama checkpoint of a real shape")
    s.add_argument("--shape", choices=sorted(LLAMA_SHAPES), required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--tokenizer-from", required=True, help="a checkpoint directory whose tokenizer to use")
    s.add_argument("--max-position", type=int, default=16384)
    s.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    s.set_defaults(fn=cmd_checkpoint)

    args = p.parse_args()
    if args.cmd == "hf-decode" and args.new_tokens < 2:
        p.error("--new-tokens must be at least 2")
    args.fn(args)


if __name__ == "__main__":
    main()
