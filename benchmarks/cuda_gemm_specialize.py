"""Does leaving M unspecialized slow the cuda prefill GEMM? (run on the device machine)

`_int4_kn_gemm` is jitted with do_not_specialize=["M"] so one compiled variant serves every prompt
length (quantprep/targets/cuda.py). This times it against the same kernel with Triton's default
specialization (M % 16 == 0 gets its own variant), on Qwen2.5-1.5B's fused shapes, side by side,
interleaved, median of `triton.testing.do_bench` runs, and checks both give the same output.

    PYTHONPATH=. python3 benchmarks/cuda_gemm_specialize.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

from quantprep.targets.cuda import _int4_kn_gemm, int4_kn_gemm

SHAPES = {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536)}  # (K, N)
GROUP = 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    variants = {"M not specialized": _int4_kn_gemm, "M specialized": triton.jit(_int4_kn_gemm.fn)}
    rows = []
    for name, (K, N) in SHAPES.items():
        w = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device="cuda")
        sz = (torch.rand(K // GROUP, N, 2, device="cuda") * 0.01).to(torch.bfloat16)
        for M in (17, 37, 128, 512):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            outs = {v: int4_kn_gemm(x, w, GROUP, sz, launch=lambda k, fn=fn: fn) for v, fn in variants.items()}
            same = torch.equal(*outs.values())
            times = {v: [] for v in variants}
            for _ in range(args.rounds):
                for v, fn in variants.items():
                    times[v].append(triton.testing.do_bench(lambda fn=fn: int4_kn_gemm(x, w, GROUP, sz, launch=lambda k: fn),
                                                            warmup=25, rep=100))
            med = {v: statistics.median(t) for v, t in times.items()}
            rows.append({"linear": name, "M": M, "K": K, "N": N, "ms": med, "same_output": same,
                         "unspecialized_over_specialized": med["M not specialized"] / med["M specialized"]})
            print(json.dumps(rows[-1]), flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
