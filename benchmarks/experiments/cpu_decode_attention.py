"""Decode attention on the CPU: quantprep's kernel (runtime/cpu_attention.py) against torch's SDPA.

One query token against S cached ones, Qwen2.5-1.5B's heads (12 query, 2 key/value, head dim 128),
bfloat16 as a cpu artifact runs: microseconds per layer (medians of --reps timings, each the mean of
--calls calls), and each one's relative error against float64. torch's SDPA is also timed in float32
(a float32 cache would double its memory).

With --artifact, the whole model too: greedy decode tok/s (transformers' generate, --new tokens, a
streamer's timestamps after the first) after a 16-token and a 512-token prompt, interleaved, medians
of --runs: with the kernel and the growing KV cache (what a loaded artifact runs), with the kernel on
transformers' concatenating cache, and with transformers' SDPA on its concatenating cache (what ran
before); and after the 16-token prompt once more with `min_new_tokens` (generate then runs a logits
processor over the whole vocabulary and a stopping check at every token), as vs_llamacpp.py
measured decode before 2026-11-26's second run.
`benchmarks/tables.py` renders the JSON into BENCHMARKS.md ("CPU decode attention").

    python benchmarks/cpu_decode_attention.py [--artifact artifacts/qwen2.5-coder-1.5b-int4-head/cpu]
        [--out benchmarks/results/cpu-decode-attention-avx512.json]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from common import greedy_decode, machine, per_call_us, save

from quantprep.runtime import cpu_attention

HEADS, KV_HEADS, HEAD_DIM = 12, 2, 128
CONTEXTS = (48, 512, 2048, 8192)


def model_decode(path: str, runs: int, new: int) -> dict:
    """tok/s per (attention, KV cache, prompt length, min_new_tokens) on one loaded artifact, interleaved."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    import quantprep

    model = quantprep.load(path)
    if model.quantprep_attention != cpu_attention.NAME:
        raise SystemExit(f"{path}: loaded with attention {model.quantprep_attention!r}, not {cpu_attention.NAME!r}")
    g = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, model.config.vocab_size, (1, n), generator=g) for n in (16, 512)}

    class Concatenating(DynamicLayer):  # transformers' own update; the model's hook converts exactly DynamicLayer
        pass

    cases = [(cpu_attention.NAME, n, "growing", False) for n in prompts] + [(cpu_attention.NAME, 512, "concatenating", False)]
    cases += [("sdpa", n, "concatenating", False) for n in prompts] + [(cpu_attention.NAME, 16, "growing", True)]

    def decode(attention: str, n: int, cache: str, min_new: bool) -> float:
        model.set_attn_implementation(attention)
        kv = DynamicCache(config=model.config)
        if cache == "concatenating":
            kv.layers = [Concatenating() for _ in kv.layers]
        stop = {"min_new_tokens": new} if min_new else {"eos_token_id": None}
        tok_s, _ = greedy_decode(model, prompts[n], new, past_key_values=kv, **stop)
        assert {type(x).__name__ for x in kv.layers} == {"GrowingLayer" if cache == "growing" else "Concatenating"}
        return tok_s

    tok_s = {c: [] for c in cases}
    with torch.inference_mode():
        for c in cases:
            decode(*c)
        for _ in range(runs):
            for c in cases:
                tok_s[c].append(decode(*c))
            print({f"{a} {n} {c}{' min_new_tokens' if m else ''}": round(v[-1], 2) for (a, n, c, m), v in tok_s.items()}, flush=True)
    return {"artifact": path, "new_tokens": new, "runs": runs,
            "decode_tok_s": [{"attention": a, "prompt": n, "cache": c, "min_new_tokens": m, "median": statistics.median(v), "runs": v}
                             for (a, n, c, m), v in tok_s.items()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--artifact", help="a cpu artifact: decode with the kernel and with SDPA")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out")
    args = ap.parse_args()
    if cpu_attention.kernel() is None:
        raise SystemExit("no C compiler here: the kernel is not built")
    g = torch.Generator().manual_seed(0)
    rows = []
    for S in CONTEXTS:
        q = torch.randn(1, HEADS, 1, HEAD_DIM, generator=g).to(torch.bfloat16)
        k, v = (torch.randn(1, KV_HEADS, S, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(2))
        q32, k32, v32 = q.float(), k.float(), v.float()
        groups = HEADS // KV_HEADS
        ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(groups, 1),
                                             v.double().repeat_interleave(groups, 1)).transpose(1, 2)

        def err(out: torch.Tensor) -> float:
            return ((out.double() - ref).norm() / ref.norm()).item()

        with torch.inference_mode():
            def quantprep_kernel():
                return cpu_attention.attention(None, q, k, v, None)[0]

            def sdpa():
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            def sdpa_f32():
                return F.scaled_dot_product_attention(q32, k32, v32, enable_gqa=True)

            us = {name: per_call_us(fn, args.calls, args.reps) for name, fn in
                  (("quantprep", quantprep_kernel), ("sdpa_bf16", sdpa), ("sdpa_f32", sdpa_f32))}
            rows.append({"context": S, "us_per_layer": us, "sdpa_bf16_over_quantprep": us["sdpa_bf16"] / us["quantprep"],
                         "rel_err_vs_float64": {"quantprep": err(quantprep_kernel()), "sdpa_bf16": err(sdpa().transpose(1, 2)),
                                                "sdpa_f32": err(sdpa_f32().transpose(1, 2))}})
        print(rows[-1], flush=True)
    result = machine() | {"threads": torch.get_num_threads(), "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                          "dtype": "bfloat16", "reps": args.reps, "calls": args.calls, "rows": rows}
    if args.artifact:
        result["model"] = model_decode(args.artifact, args.runs, args.new)
    print(save(result, args.out))


if __name__ == "__main__":
    main()
