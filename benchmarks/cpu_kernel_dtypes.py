"""cpu kernels: int4 (`_weight_int4pack_mm_for_cpu`) by activation dtype vs a dense bf16 matmul, and
the two exact int8 paths (`_weight_int8pack_mm` per-channel vs dequantize + matmul).

Medians of 20 calls after 3 warm-up calls, group size 64, random codes; shapes of SmolLM2
(576 x 1536) and Qwen2.5-1.5B's MLP (1536 x 8960). Decides the cpu target's default dtype.

    python benchmarks/cpu_kernel_dtypes.py
"""

import statistics
import time

import torch


def median_us(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    for K, N in ((576, 1536), (1536, 8960)):
        w = torch.randint(0, 16, (N, K), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 1)
        for M in (1, 128):
            row = {}
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                sz, x = torch.randn(K // 64, N, 2, dtype=dt), torch.randn(M, K, dtype=dt)
                row[str(dt).removeprefix("torch.")] = median_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 64, sz))
            wd, xd = torch.randn(K, N, dtype=torch.bfloat16), torch.randn(M, K, dtype=torch.bfloat16)
            row["dense_bf16"] = median_us(lambda: xd @ wd)
            print(f"K={K} N={N} M={M}: " + ", ".join(f"{k} {v:.0f} us" for k, v in row.items()))
    from quantprep.targets.common import DequantInt8Linear, Int8PerChannelLinear

    K, N = 1536, 8960
    meta = {"in_features": K, "out_features": N, "group_size": K, "act_order": False, "bias": False}
    per_channel, dequant = Int8PerChannelLinear(meta, torch.bfloat16), DequantInt8Linear(meta, torch.bfloat16)
    per_channel.load_state_dict({"qweight": torch.randint(-128, 128, (N, K), dtype=torch.int8),
                                 "scales": torch.rand(N, dtype=torch.bfloat16)}, assign=True)
    dequant.load_state_dict({"qweight": torch.randint(0, 256, (K, N), dtype=torch.uint8), "scales": torch.rand(1, N, dtype=torch.bfloat16),
                             "qzeros": torch.full((1, N), 128, dtype=torch.uint8)}, assign=True)
    for M in (1, 128):
        x = torch.randn(M, K, dtype=torch.bfloat16)
        with torch.no_grad():
            a, b = median_us(lambda: per_channel(x), 5), median_us(lambda: dequant(x), 5)
        print(f"int8 K={K} N={N} M={M}: _weight_int8pack_mm {a:.0f} us, dequantize+matmul {b:.0f} us")


if __name__ == "__main__":
    main()
