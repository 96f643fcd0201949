"""Variants of the cuda prefill GEMM against the shipped one (run on the device machine).

--compare specialize: `_int4_kn_gemm` is jitted with do_not_specialize=["M"] so one compiled
variant serves every prompt length (quantprep/targets/cuda.py); timed against the same kernel with
Triton's default specialization (M % 16 == 0 gets its own variant).
--compare offsets: the shipped kernel computes row offsets in int64 (M*N reaches 2**31); timed
against the same kernel with int32 offsets (the source with the cast removed).
On Qwen2.5-1.5B's fused shapes, side by side, interleaved, median of `triton.testing.do_bench`
runs; checks both give the same output.

    PYTHONPATH=. python3 benchmarks/cuda_gemm_specialize.py [--compare offsets] --out results.json
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
import tempfile
import textwrap

import torch
import triton

from quantprep.targets.cuda import _int4_kn_gemm, int4_kn_gemm

SHAPES = {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536)}  # (K, N)
GROUP = 128


def int32_offsets_kernel():
    """The shipped kernel's source without its int64 cast, jitted from a file (Triton reads the source)."""
    src = textwrap.dedent(inspect.getsource(_int4_kn_gemm.fn)).replace(".to(tl.int64)", "")
    assert ".to(tl.int64)" in inspect.getsource(_int4_kn_gemm.fn)
    path = tempfile.NamedTemporaryFile("w", suffix="_int32_gemm.py", delete=False)
    path.write("import triton\nimport triton.language as tl\n\n\n" + src)
    path.close()
    spec = importlib.util.spec_from_file_location("int32_gemm", path.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules["int32_gemm"] = module
    spec.loader.exec_module(module)
    return module._int4_kn_gemm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compare", choices=["specialize", "offsets"], default="specialize")
    args = ap.parse_args()
    if args.compare == "specialize":
        variants = {"M not specialized": _int4_kn_gemm, "M specialized": triton.jit(_int4_kn_gemm.fn)}
    else:
        variants = {"int64 offsets": _int4_kn_gemm, "int32 offsets": int32_offsets_kernel()}
    first, second = variants
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
                         "ratio": f"{first} / {second}", "first_over_second": med[first] / med[second]})
            print(json.dumps(rows[-1]), flush=True)
    ratios = [r["first_over_second"] for r in rows]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "compare": args.compare,
              "median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
