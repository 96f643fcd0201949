"""The cpu target's int4 packing, two ways side by side in one process, on Qwen2.5 layer shapes:
the tensor ops (unpack the codes, act-order gather, pack_int4) and the compiled packer straight
from GPTQ's int32 codes (pack_int4_from_gptq). Act-order on, as in benchmarks/scale.py's
checkpoints; fused q/k/v and gate/up as prepack fuses them. Medians of --reps calls after a warm-up, alternating,
torch at its default thread count (as prepack runs it); the compiled packer is one thread.

    python benchmarks/cpu_pack.py [--out benchmarks/results/cpu-pack-avx512.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.scale import SHAPES  # noqa: E402
from quantprep.prepack import prepare_layer  # noqa: E402
from quantprep.source import QuantConfig, _validate_layer  # noqa: E402
from quantprep.synthetic import random_gptq_tensors  # noqa: E402
from quantprep.targets.cpu import FAST_PACK_BLOCK_N, native_packer, pack_int4, pack_int4_from_gptq  # noqa: E402


def layer_shapes(size: str) -> dict[str, tuple[int, int]]:
    h, i, _, heads, kv, _, _ = SHAPES[size]
    return {"qkv": (h, h + 2 * kv * h // heads), "o": (h, h), "gate_up": (h, 2 * i), "down": (i, h)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="7b,14b,32b")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    cap = torch.backends.cpu.get_cpu_capability()
    assert native_packer() is not None, "no C compiler: nothing to compare"
    block = FAST_PACK_BLOCK_N[cap]
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
              "cpu_capability": cap, "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "rows": []}
    gen = torch.Generator().manual_seed(0)
    for size in args.sizes.split(","):
        for name, (K, N) in layer_shapes(size).items():
            raw = random_gptq_tensors(K, N, 4, 128, True, True, True, bias=False, generator=gen)
            gptq = _validate_layer(name, raw, QuantConfig(4, 128, True, True, "gptq"))

            def tensor_ops():
                return pack_int4(prepare_layer(gptq).codes, cap)

            def native():
                layer = prepare_layer(gptq)
                return pack_int4_from_gptq(layer.qweight, layer.perm, K, N, block)

            assert torch.equal(tensor_ops(), native())  # and a warm-up of both
            times = {"tensor_ops": [], "native": []}
            for _ in range(args.reps):
                for label, fn in (("tensor_ops", tensor_ops), ("native", native)):
                    t = time.perf_counter()
                    fn()
                    times[label].append(time.perf_counter() - t)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {"size": size, "layer": name, "K": K, "N": N, "qweight_mb": K * N / 2 / 1e6,
                   "tensor_ops_ms": med["tensor_ops"] * 1e3, "native_ms": med["native"] * 1e3,
                   "tensor_ops_over_native": med["tensor_ops"] / med["native"]}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
