"""Decode's layers on the CPU: quantprep's C (runtime/cpu_layers.py) against the transformers and torch ops it replaces.

Per call, at one decode row, bfloat16, Qwen2.5-1.5B's sizes (medians of --reps timings, each the
mean of --calls calls): transformers' RMSNorm module against CpuRMSNorm; the MLP's SiLU product
(torch's silu and mul against silu_mul); and, from the artifact, its float lm_head (nn.Linear,
torch's bfloat16 matrix-vector product, against CpuLinear's gemv_bf16; GB/s of the weight read),
and the same lm_head at several rows up to 512 (a prefill's logits at every position): CpuLinear's
float32 tiles against torch's bfloat16 GEMM, medians of 3 calls; "used": whether CpuLinear takes the
tiles at that many rows on this machine.
Then the whole model: greedy decode tok/s after a 16-token prompt (transformers' generate, --new
tokens, a streamer's timestamps after the first) in three ways, interleaved, medians of --runs, for
each --artifacts: as loaded (the replaced modules; where a plan runs int4_a8 at one row, each
decoder layer one decode_layer call), module by module (the replaced modules, each decoder layer
its own forward calling them), and with each module's own transformers or torch forward again.
Where the int8-activation kernels are AVX2's, a fourth: as loaded with int4_a8 and int8_a8 built
without their software prefetch (-DA8_AHEAD=0).
`benchmarks/tables.py` renders the JSON into BENCHMARKS.md ("CPU decode layers").

    python benchmarks/cpu_layers.py [--artifacts artifacts/qwen2.5-coder-1.5b/cpu,artifacts/qwen2.5-coder-1.5b-int8-head/cpu,artifacts/qwen2.5-coder-1.5b-int4-head/cpu]
        [--out benchmarks/results/cpu-layers-avx512.json]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.nn.functional as F
from common import artifact_codes, greedy_decode, machine, per_call_us, save

from quantprep.runtime import cpu_layers
from quantprep.targets import c_library, cpu

REPLACED = (cpu_layers.CpuRMSNorm, cpu_layers.CpuGatedMLP, cpu_layers.CpuDecodeAttention, cpu_layers.CpuLinear,
            cpu_layers.CpuDecoderLayer)
ROWS = (4, 8, 16, 32, 512)  # the float lm_head's rows in float32 tiles against torch's bfloat16 GEMM
MODES = ("c", "c_modules", "torch")  # as loaded; the decoder layers' own forward; every module's own forward
NO_PREFETCH = "c_no_prefetch"  # as loaded, the int8-activation kernels built without their prefetch (AVX2's only)
AS_BUILT = (cpu.native_int4_a8, cpu.native_int8_a8)


@functools.cache
def without_prefetch() -> tuple:
    """Stand-ins for AS_BUILT: int4_a8 and int8_a8 from a build with -DA8_AHEAD=0."""
    lib = c_library.library_with_torch_openmp("a8", ("-DA8_AHEAD=0",))
    four, eight = lib.int4_a8_cpu, lib.int8_a8_cpu
    return (lambda: four), (lambda: eight)


def a8_kernels(model: torch.nn.Module, prefetch: bool) -> None:
    """int4_a8 and int8_a8 as built, or built with -DA8_AHEAD=0: the names their callers look up are
    pointed at them, and each decoder layer's decode_layer arguments (which hold int4_a8's address)
    are built again at its next call (in every mode: a few ms in a timed run of seconds)."""
    four, eight = AS_BUILT if prefetch else without_prefetch()
    cpu.native_int4_a8 = cpu_layers.native_int4_a8 = four
    cpu.native_int8_a8 = eight
    for m in model.modules():
        vars(m).pop("_decode_layer", None)


def with_c(model: torch.nn.Module, mode: str) -> None:
    """Each replaced module's forward: its own (C where it runs), or the replaced class's again (mode
    "torch"; "c_modules": the decoder layers only)."""
    a8_kernels(model, mode != NO_PREFETCH)
    for m in model.modules():
        if isinstance(m, REPLACED):
            if mode in ("c", NO_PREFETCH) or (mode == "c_modules" and not isinstance(m, cpu_layers.CpuDecoderLayer)):
                vars(m).pop("forward", None)
            else:
                base = torch.nn.Linear if isinstance(m, cpu_layers.CpuLinear) else m.replaced
                m.forward = base.forward.__get__(m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifacts", default="artifacts/qwen2.5-coder-1.5b/cpu,artifacts/qwen2.5-coder-1.5b-int8-head/cpu,"
                                            "artifacts/qwen2.5-coder-1.5b-int4-head/cpu")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out")
    args = ap.parse_args()
    if cpu_layers.library() is None:
        raise SystemExit("no C compiler here: the kernels are not built")
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    import quantprep

    g = torch.Generator().manual_seed(0)
    calls = {}
    with torch.inference_mode():
        norm = Qwen2RMSNorm(1536, eps=1e-6).to(torch.bfloat16)
        ours = cpu_layers.replace(Qwen2RMSNorm(1536, eps=1e-6).to(torch.bfloat16))  # the same module, its class swapped
        x = torch.randn(1, 1, 1536, generator=g).to(torch.bfloat16)
        calls["rms_norm_1536"] = {"transformers": per_call_us(lambda: norm(x), args.calls, args.reps),
                                  "quantprep": per_call_us(lambda: ours(x), args.calls, args.reps)}
        gu, y = torch.randn(1, 2 * 8960, generator=g).to(torch.bfloat16), torch.empty(1, 8960, dtype=torch.bfloat16)
        lib = cpu_layers.library()
        calls["silu_mul_8960"] = {
            "transformers": per_call_us(lambda: F.silu(gu[:, :8960]) * gu[:, 8960:], args.calls, args.reps),
            "quantprep": per_call_us(lambda: lib.silu_mul(gu.data_ptr(), 2 * 8960, y.data_ptr(), 8960, 1, 8960), args.calls, args.reps)}
    models = {path: quantprep.load(path) for path in args.artifacts.split(",")}
    for model in models.values():
        head = model.get_output_embeddings()
        if isinstance(head, cpu_layers.CpuLinear):
            row = torch.randn(1, 1, head.in_features, generator=g).to(torch.bfloat16)
            with torch.inference_mode():
                c = {"torch": per_call_us(lambda: F.linear(row, head.weight), 5, args.reps),
                     "quantprep": per_call_us(lambda: head(row), 5, args.reps)}
            gb = head.weight.numel() * 2 / 1e9
            calls[f"lm_head_{head.out_features}x{head.in_features}"] = c | {"gb_s": {k: gb / (v / 1e6) for k, v in c.items()}}
            for n in ROWS:  # batched decode rows up to a prefill's logits at every position
                rows = torch.randn(1, n, head.in_features, generator=g).to(torch.bfloat16)
                with torch.inference_mode():
                    calls[f"lm_head_{head.out_features}x{head.in_features}_{n}_rows_float32_tiles"] = {
                        "torch": per_call_us(lambda: F.linear(rows, head.weight), 1, 3),  # noqa: B023  called at once
                        "quantprep": per_call_us(lambda: head.float32_tiles(rows), 1, 3),  # noqa: B023
                        "used": cpu_layers.SLOW_HALF_GEMM and n >= cpu_layers.FLOAT32_MIN_ROWS}
    print(calls, flush=True)

    prompt = torch.randint(0, 1000, (1, 16), generator=g)
    modes = MODES + ((NO_PREFETCH,) if cpu.native_a8_block() == 32 else ())
    tok_s = {(path, mode): [] for path in models for mode in modes}
    with torch.inference_mode():
        for (path, mode) in tok_s:  # warm-up
            with_c(models[path], mode)
            greedy_decode(models[path], prompt, 8, eos_token_id=None)
        for _ in range(args.runs):
            for (path, mode), v in tok_s.items():
                with_c(models[path], mode)
                v.append(greedy_decode(models[path], prompt, args.new, eos_token_id=None)[0])
            print({f"{p} {mode}": round(v[-1], 2) for (p, mode), v in tok_s.items()}, flush=True)

    def ratio(path: str, a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(tok_s[(path, a)], tok_s[(path, b)], strict=True))

    decode = [{"artifact": path, **artifact_codes(path), **{m: statistics.median(tok_s[(path, m)]) for m in modes},
               **{f"{m}_runs": tok_s[(path, m)] for m in modes},
               "c_over_torch": ratio(path, "c", "torch"), "c_over_c_modules": ratio(path, "c", "c_modules"),
               **({"c_over_c_no_prefetch": ratio(path, "c", NO_PREFETCH)} if NO_PREFETCH in modes else {})}
              for path in models]
    result = machine() | {"threads": torch.get_num_threads(), "dtype": "bfloat16", "reps": args.reps, "calls": args.calls,
                          "us_per_call": calls, "new_tokens": args.new, "runs": args.runs, "decode_tok_s": decode}
    print(save(result, args.out))


if __name__ == "__main__":
    main()
