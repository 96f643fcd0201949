"""Per-channel int8 (Int8PerChannelLinear): `aten._weight_int8pack_mm` against dequantize + dense
matmul, across M, on one device (the module switches at DEQUANT_MIN_M rows, on cpu and cuda).

cpu: medians of 7 calls; cuda: `triton.testing.do_bench` medians. Shapes of Qwen2.5-1.5B and SmolLM2.

    python benchmarks/int8_switch.py --device cuda [--out benchmarks/results/int8-switch-cuda-h100.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import machine, median_time, save

from quantprep.build.prepack import prepare_layer
from quantprep.build.source import QuantConfig, _validate_layer
from quantprep.build.synthetic import random_gptq_tensors
from quantprep.targets import get_target
from quantprep.targets.packed import Int8PerChannelLinear, dense_matmul

SHAPES = {"qwen gate/up": (1536, 8960), "qwen down": (8960, 1536), "qwen q/o": (1536, 1536),
          "smollm2 gate/up": (576, 1536), "smollm2 down": (1536, 576)}
ROWS = (1, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512)


def median_ms(fn, device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, return_mode="median")
    return median_time(fn) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev, target, rows = args.device, get_target(args.device), []
    for name, (K, N) in SHAPES.items():
        raw = random_gptq_tensors(K, N, 8, -1, True, False, True)
        layer = prepare_layer(_validate_layer(name, raw, QuantConfig(8, -1, True, False, "gptq")))
        tensors, meta = target.pack(layer, torch.bfloat16)
        m = target.make_module(meta, torch.bfloat16)
        m.load_state_dict({k: v.to(dev) for k, v in tensors.items()}, assign=True)
        assert isinstance(m, Int8PerChannelLinear)
        for M in ROWS:
            x = torch.randn(M, K, device=dev).bfloat16()
            with torch.inference_mode():
                kernel = median_ms(lambda: torch.ops.aten._weight_int8pack_mm(x, m.qweight, m.scales), dev)
                dequant = median_ms(lambda: dense_matmul(x, (m.qweight.to(torch.bfloat16) * m.scales[:, None]).T), dev)
            rows.append({"shape": name, "K": K, "N": N, "M": M, "kernel_ms": round(kernel, 4), "dequant_ms": round(dequant, 4),
                         "kernel_over_dequant": round(kernel / dequant, 2)})
            print(rows[-1], flush=True)
    # cpu_capability and cores name what ran the kernels (tables.py prints them): the GPU, or torch's CPU threads
    res = machine() | {"cpu_capability": torch.cuda.get_device_name() if dev == "cuda" else torch.backends.cpu.get_cpu_capability(),
                       "cores": None if dev == "cuda" else torch.get_num_threads(), "device": dev,
                       "threshold": Int8PerChannelLinear.DEQUANT_MIN_M, "int8_modules": rows}
    save(res, args.out)


if __name__ == "__main__":
    main()
