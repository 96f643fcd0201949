"""cpu int4 kernel (`_weight_int4pack_mm_for_cpu`) by activation dtype, against dense bf16 and fp32 matmuls.

Medians of 20 calls after 3 warm-up calls, group size 64, random codes; shapes of SmolLM2
(576 x 1536) and Qwen2.5-1.5B's MLP (1536 x 8960). Decides the cpu target's default dtype. (int8
and int4 against their dequantize paths across M: benchmarks/cpu_prefill.py.)

    python benchmarks/cpu_kernel_dtypes.py [--out benchmarks/results/cpu-kernel-dtypes.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def median_us(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def measure() -> list[dict]:
    rows = []
    for K, N in ((576, 1536), (1536, 8960)):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32), 1)
        for M in (1, 128):
            row = {"K": K, "N": N, "M": M, "us": {}}
            for dt in DTYPES:
                sz, x = torch.randn(K // 64, N, 2, dtype=dt), torch.randn(M, K, dtype=dt)
                row["us"][str(dt).removeprefix("torch.")] = median_us(
                    lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 64, sz))
            for dt in (torch.bfloat16, torch.float32):  # CPUs without AVX512 have no fast bf16 GEMM
                wd, xd = torch.randn(K, N, dtype=dt), torch.randn(M, K, dtype=dt)
                row["us"]["dense_" + str(dt).removeprefix("torch.")] = median_us(lambda: xd @ wd)
            print(f"K={K} N={N} M={M}: " + ", ".join(f"{k} {v:.0f} us" for k, v in row["us"].items()), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": torch.get_num_threads(),
           "torch": torch.__version__, "group_size": 64, "calls": 20, "rows": measure()}
    if args.out:
        args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
