"""The peer on the same card: transformers' `generate` with a static KV cache, which it compiles
(torch.compile of the decode step, CUDA graphs), on the shapes runner.tools.bench measures.

    python benchmarks/hf_generate_peer.py --model=llama:llama3.1-8b --batch_sizes=1,64 \
        --prompt_len=128 --new_tokens=128 [--reps=3] [--output=hf.json]

The model is podrun's preset, built as a transformers LlamaForCausalLM with random bfloat16
weights made on the GPU (nothing is read). Greedy, and no end-of-sequence id, so every row
decodes all new_tokens. Per batch size: a warm-up generation (compiling), then the median T of
`reps` generations: tokens_per_s = B * N / T, the whole generate (prefill included), as
runner.tools.bench's e2e_tokens_per_s. A generation of another length would size the static cache
anew and compile again, so the decode alone is not timed apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def hf_config(spec: str):
    """A transformers LlamaConfig of podrun's `llama:<preset>`."""
    import transformers

    from models.registry import Model

    model = Model.named(spec)
    c = model.config
    if model.family != "llama" or c.qkv_bias:
        raise SystemExit(f"hf_generate_peer: error: {spec}: only Llama presets are built here")
    scaling = dict(c.rope_scaling) or None
    return transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, rope_scaling=scaling, max_position_embeddings=c.max_position,
        tie_word_embeddings=c.tie_embeddings, mlp_bias=c.mlp_bias,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama:llama3.1-8b")
    ap.add_argument("--batch_sizes", default="1,64")
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--output", default="")
    args = ap.parse_args()

    import torch
    import transformers

    if not torch.cuda.is_available():
        raise SystemExit("hf_generate_peer: error: no CUDA device for torch")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(hf_config(args.model)).eval()
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    gen = dict(do_sample=False, cache_implementation="static", eos_token_id=None, pad_token_id=0)
    N, P = args.new_tokens, args.prompt_len
    records = []

    def timed(ids, n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, **gen)
        torch.cuda.synchronize()
        if out.shape[1] != P + n:
            raise SystemExit(f"hf_generate_peer: error: generated {out.shape[1] - P} tokens, not {n}")
        return time.perf_counter() - start

    for B in (int(b) for b in args.batch_sizes.split(",")):
        ids = torch.randint(0, model.config.vocab_size, (B, P), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(B))
        t = time.perf_counter()
        timed(ids, N)
        warmup = time.perf_counter() - t
        full = [timed(ids, N) for _ in range(args.reps)]
        tn = statistics.median(full)
        records.append({
            "engine": f"transformers-{transformers.__version__}-static-compiled",
            "torch": torch.__version__, "device": torch.cuda.get_device_name(),
            "model": args.model, "batch_size": B, "prompt_len": P, "new_tokens": N,
            "reps": args.reps, "warmup_s": warmup, "build_s": build_s,
            "total_s": tn, "total_all_s": full, "tokens_per_s": B * N / tn,
            "compiled": hasattr(model, "_compiled_call"),
        })
        r = records[-1]
        print(f"transformers B={B}: {r['tokens_per_s']:.1f} tokens/s whole generate "
              f"(warm-up {warmup:.1f} s)", flush=True)
        if args.output:  # after each batch size, so a run stopped later keeps what it measured
            with open(args.output, "w") as f:
                json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
