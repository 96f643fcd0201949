"""cpu dense path: dequantizing one column tile at a time into cache against the whole weight.

Per linear shape of Qwen2.5-1.5B (random act-order GPTQ weights: the time does not depend on the
values) at M rows: the dense bf16 model's F.linear ([N, K] weight), the whole weight dequantized
(every core) then one matmul, the tiled path (CpuInt4Linear's "dequant") and the int4 kernel;
then the dequantization alone, tile by tile, with the AVX512-BF16 block and with the compiler's
portable loop, and the tiles' GEMMs alone. One process, interleaved rounds, medians. `benchmarks/tables.py`
renders the JSON into BENCHMARKS.md ("Kernel plans").

    python benchmarks/cpu_dense_tiles.py [--m 512] [--out benchmarks/results/cpu-dequant-tiles-avx512-epyc.json]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import machine, save, timed

from quantprep.build.prepack import prepare_layer
from quantprep.build.source import QuantConfig, _validate_layer
from quantprep.build.synthetic import random_gptq_tensors
from quantprep.targets import c_library, cpu, get_target
from quantprep.targets.packed import dense_matmul

# per layer: fused q/k/v, o, fused gate/up, down
SHAPES = {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536)}


def portable_dequantizer():
    """csrc/dequant.c without its AVX512-BF16 block: the compiler's loop alone (built as cpu.py builds it)."""
    return c_library.library_with_torch_openmp("dequant", ("-DBF16_BLOCK64=0",)).dequant_int4_cpu


def module(K: int, N: int):
    t = get_target("cpu")
    q = QuantConfig(4, 128, True, True, "gptq")
    layer = prepare_layer(_validate_layer("bench", random_gptq_tensors(K, N, 4, 128, True, True, True), q))
    tensors, meta = t.pack(layer, torch.bfloat16)
    m = t.make_module(meta, torch.bfloat16)
    m.load_state_dict(tensors, assign=True)
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=512, help="activation rows (prompt tokens)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    if cpu.native_dequantizer() is None:
        raise SystemExit("no native dequantizer here (no C compiler, or QUANTPREP_NATIVE=0)")
    fast, portable = cpu.native_dequantizer(), portable_dequantizer()
    rows = []
    for name, (K, N) in SHAPES.items():
        m = module(K, N)
        x = torch.randn(args.m, K).bfloat16()
        dense_w = m.dequantize().T.contiguous()  # the dense model's [N, K] weight
        weight = m.native_weight()
        tile = cpu.tile_buffer(K, cpu.tile_columns(weight, torch.bfloat16, N), torch.bfloat16)  # the tiled path's width

        def dequant_tiles():  # the tiled path's tiles alone
            for n0 in range(0, N, tile.shape[1]):
                weight.write(tile, n0, min(n0 + tile.shape[1], N))

        y = torch.empty(args.m, N, dtype=torch.bfloat16)

        def tiles_gemm_only():  # the tiled path's GEMMs alone, on a tile dequantized once
            for n0 in range(0, N, tile.shape[1]):
                n1 = min(n0 + tile.shape[1], N)
                torch.mm(x, tile[:, : n1 - n0], out=y[:, n0:n1])

        def dequant_tiles_portable():
            weight.fn = portable
            try:
                dequant_tiles()
            finally:
                weight.fn = fast

        paths = {"dense_linear": lambda: torch.nn.functional.linear(x, dense_w),
                 "whole_dequant_matmul": lambda: dense_matmul(x, m.dequantize()),
                 "tiled": lambda: m.run(x, "dequant"),
                 "int4_kernel": lambda: m.run(x, "int4"),
                 "dequant_tiles": dequant_tiles,
                 "tiles_gemm_only": tiles_gemm_only,
                 "dequant_tiles_portable": dequant_tiles_portable}
        times = {k: [] for k in paths}
        with torch.inference_mode():
            for f in paths.values():
                f()
            for _ in range(args.rounds):
                for k, f in paths.items():
                    times[k].append(timed(f) * 1e3)
        med = {k: round(statistics.median(v), 3) for k, v in times.items()}
        rows.append({"shape": name, "K": K, "N": N, "M": args.m, "ms": med,
                     "tiled_over_dense": round(med["tiled"] / med["dense_linear"], 3),
                     "whole_over_dense": round(med["whole_dequant_matmul"] / med["dense_linear"], 3)})
        print(rows[-1], flush=True)
    layer = {k: round(sum(r["ms"][k] for r in rows), 3) for k in rows[0]["ms"]}
    result = {**machine(), "threads": torch.get_num_threads(), "M": args.m, "rounds": args.rounds, "rows": rows, "layer_ms": layer,
              "layer_tiled_over_dense": round(layer["tiled"] / layer["dense_linear"], 3),
              "layer_whole_over_dense": round(layer["whole_dequant_matmul"] / layer["dense_linear"], 3),
              "bf16_block_speedup": round(layer["dequant_tiles_portable"] / layer["dequant_tiles"], 2)}
    print(save(result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
