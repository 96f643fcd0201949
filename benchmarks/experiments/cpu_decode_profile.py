"""Where a cpu artifact's decode time goes, op by op, and what a smaller lm_head would save.

Greedy decode of --new tokens after a 16-token prompt (transformers' generate) under torch.profiler:
each op's self time and share, and the wall time (the rest: quantprep's C kernels, which are not
aten ops, and Python). Then the lm_head alone at one row, as the artifact runs it (bf16)
and as per-channel int8 (`aten._weight_int8pack_mm`, round to nearest: a quantization of our own,
not the checkpoint's), as int4 in groups of 128 (the cpu target's kernel, random codes: its time
only, what a GPTQ-quantized lm_head would take), and this machine's memory read speed (a sum over
1 GiB), medians.
`benchmarks/tables.py` renders the JSON into BENCHMARKS.md ("llama.cpp, the CPU anchor").

    python benchmarks/cpu_decode_profile.py artifacts/qwen2.5-coder-1.5b/cpu [--out benchmarks/results/cpu-decode-profile-....json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import machine, median_time, save
from torch.profiler import ProfilerActivity, profile

import quantprep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--new", type=int, default=32, help="tokens to decode")
    ap.add_argument("--out")
    args = ap.parse_args()
    model = quantprep.load(args.artifact).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    generate = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            model.generate(ids, **generate)
            runs.append(args.new / (time.perf_counter() - t))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            model.generate(ids, **generate)
            wall = time.perf_counter() - t
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    ops = [{"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2),
            "share": round(e.self_cpu_time_total / total, 4)} for e in events[:12]]

    out = model.get_output_embeddings()
    # [vocab, hidden] bf16, what each token reads; an int8 lm_head (--lm-head int8) is timed from its tied embedding's weight
    head = (out.weight if hasattr(out, "weight") else model.get_input_embeddings().weight).detach()
    x = torch.randn(1, head.shape[1], dtype=head.dtype)
    scale = head.float().abs().amax(1).clamp_min(1e-12) / 127
    q = torch.round(head.float() / scale[:, None]).to(torch.int8)
    scale = scale.to(head.dtype)
    codes = torch.randint(0, 16, head.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    sz4 = (torch.rand(head.shape[1] // 128, head.shape[0], 2) * 0.01).to(head.dtype)
    big = torch.ones(1 << 28)  # 1 GiB of float32
    with torch.inference_mode():
        bf16_ms = median_time(lambda: torch.nn.functional.linear(x, head), reps=15) * 1e3
        int8_ms = median_time(lambda: torch.ops.aten._weight_int8pack_mm(x, q, scale), reps=15) * 1e3
        int4_ms = median_time(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed4, 128, sz4), reps=15) * 1e3
        read_s = median_time(lambda: big.sum(), reps=5)
    result = {**machine(), "threads": torch.get_num_threads(), "artifact": args.artifact, "new_tokens": args.new,
              "decode_tok_s": {"median": statistics.median(runs), "runs": runs},
              "profiled_ms_per_token": round(total / 1e3 / args.new, 2), "profiled_wall_ms_per_token": round(wall * 1e3 / args.new, 2),
              "ops": ops,
              "lm_head": {"module": type(out).__name__, "shape": list(head.shape), "bf16_ms": round(bf16_ms, 2), "int8_per_channel_ms": round(int8_ms, 2),
                          "int4_g128_ms": round(int4_ms, 2),
                          "bf16_mb": round(head.numel() * 2 / 1e6, 1)},
              "memory_read_gb_s": round((1 << 30) / read_s / 1e9, 1)}
    print(save(result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
