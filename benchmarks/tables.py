"""BENCHMARKS.md's generated tables, from the raw JSON in benchmarks/results/.

A table in BENCHMARKS.md is a block

    <!-- table KIND results/FILE.json -->
    ...
    <!-- end table -->

whose body this script renders from that file with the renderer named KIND. `python
benchmarks/tables.py` rewrites every block; `--check` exits 1 when one differs from its JSON
(tests/test_benchmarks_doc.py runs it, so a figure in a table cannot drift from its source).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DOC = ROOT.parent / "BENCHMARKS.md"
BLOCK = re.compile(r"(<!-- table (\S+) (\S+) -->\n)(.*?)(<!-- end table -->)", re.S)


def _machine(r: dict) -> str:
    cores = f", {r['cores']} threads" if r.get("cores") else ""
    return f"{r['date'][:10]}, {r['cpu_capability']}{cores}, {r['machine']}"


def cpu_switch(r: dict, key: str, unit: str = "ms") -> str:
    """kernel vs dequantize + dense bf16 per module across M (benchmarks/cpu_prefill.py)."""
    rows = r[key]
    Ms = sorted({x["M"] for x in rows})
    shapes = list(dict.fromkeys(x["shape"] for x in rows))
    cell = {(x["shape"], x["M"]): x for x in rows}
    out = [f"kernel / dequantize time ({_machine(r)}; below 1: the kernel is faster)", "",
           "| module (K x N) | " + " | ".join(f"M={m}" for m in Ms) + " |", "| --- |" + " --- |" * len(Ms)]
    for s in shapes:
        k, n = next((x["K"], x["N"]) for x in rows if x["shape"] == s)
        out.append(f"| {s} ({k} x {n}) | " + " | ".join(
            f"{cell[s, m]['kernel_over_dequant']:.2f} ({cell[s, m]['kernel_' + unit]:g} / {cell[s, m]['dequant_' + unit]:g} {unit})"
            if (s, m) in cell else "" for m in Ms) + " |")
    if key == "modules" and r.get("smollm2_prefill512"):
        p = r["smollm2_prefill512"]
        out += ["", f"SmolLM2 prefill of 512 tokens, whole model: {p['switch_at_512']['median_ms']:g} ms with the switch, "
                    f"{p['kernel_only']['median_ms']:g} ms with the int4 kernel only (median of {len(p['kernel_only']['runs'])})."]
    return "\n".join(out)


def gemm_variants(r: dict) -> str:
    """Two variants of the cuda prefill GEMM side by side (benchmarks/cuda_gemm_specialize.py)."""
    first, second = r["rows"][0]["ratio"].split(" / ")
    out = [f"{r['device']}, torch {r['torch']}, Triton {r['triton']}; median of `do_bench` over the rounds", "",
           f"| linear (K x N) | M | {first} ms | {second} ms | ratio | same output |", "| --- | --- | --- | --- | --- | --- |"]
    for x in r["rows"]:
        out.append(f"| {x['linear']} ({x['K']} x {x['N']}) | {x['M']} | {x['ms'][first] * 1e3:.1f} us | {x['ms'][second] * 1e3:.1f} us "
                   f"| {x['first_over_second']:.3f} | {'yes' if x['same_output'] else 'NO'} |")
    out += ["", f"Ratio {first} / {second}: median {r['median_ratio']:.3f}, range {r['min_ratio']:.3f}-{r['max_ratio']:.3f}."]
    return "\n".join(out)


def load_to_first_token(r: dict) -> str:
    """Spawn to first token per variant, fresh processes (benchmarks/load.py)."""
    models = r["models"]
    names = list(models)
    variants = [("a_gptqmodel", "(a) GPTQModel.load (TORCH backend) + 1 token, Inductor cache warm"),
                ("a0_gptqmodel_cold_inductor", "(a0) same, empty Inductor cache"),
                ("b_quantprep", "(b) quantprep.load + 1 token"),
                ("c_floor", "(c) floor: python + torch + read the artifact's bytes + dense bf16 forward"),
                ("ct_floor_with_transformers", "(ct) floor + importing transformers' modeling code")]
    out = [f"{r['machine']}, {r['date']}, Python {r['python']}; median of {len(models[names[0]]['b_quantprep']['runs'])} fresh "
           "processes, seconds (imports / load / first forward)", "",
           "| variant | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for key, label in variants:
        out.append(f"| {label} | " + " | ".join(
            f"{models[n][key]['total_s']:.2f} s ({models[n][key]['import_s']:.2f} / {models[n][key]['load_s']:.2f} / "
            f"{models[n][key]['first_s']:.2f})" for n in names) + " |")
    for ratio in ("b_over_a", "b_over_a0", "b_over_c", "b_over_ct"):
        out.append(f"| {ratio.replace('_over_', ' / ')} | " + " | ".join(f"{models[n][ratio]:.2f}" for n in names) + " |")
    return "\n".join(out)


def fusion_groups(r: dict) -> str:
    """One fused matmul against the separate ones, per group and M (benchmarks/fusion.py)."""
    out = [f"{r['device']}, torch {r['torch']}, {r['date'][:10]}; microseconds per call", "",
           "| group | M | separate | fused | separate / fused |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {x['group']} | {x['M']} | {x['separate_us']:g} | {x['fused_us']:g} | {x['speedup']:.2f} |" for x in r["rows"]]
    return "\n".join(out)


def cuda_linears(r: dict) -> str:
    """Per linear: tinygemm, the Triton GEMM, the module and dense bf16 (benchmarks/cuda_kernels.py)."""
    out = [f"{r['device']}, torch {r['torch']}, {r['date'][:10]}; `do_bench` medians in us", "",
           "| layer (K->N) | M | tinygemm | triton | module | dense bf16 | module / dense | triton / dense |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for x in r["timings"]:
        us = {k: x[f"{k}_ms"] * 1e3 for k in ("tinygemm", "triton", "module", "dense_bf16")}
        out.append(f"| {x['layer']} ({x['K']}->{x['N']}) | {x['M']} | {us['tinygemm']:.1f} | {us['triton']:.1f} | {us['module']:.1f} "
                   f"| {us['dense_bf16']:.1f} | {us['module'] / us['dense_bf16']:.2f} | {us['triton'] / us['dense_bf16']:.2f} |")
    worst = max(p["rel_err"] for p in r["parity"])
    out += ["", f"Parity of the cuda modules vs the dense float32 reference in the same run: {len(r['parity'])} cases, "
                f"max relative error {worst:.1e}; `pack_tinygemm` equal to `_convert_weight_to_int4pack` in "
                f"{sum(x['equal'] for x in r['layout'])} of {len(r['layout'])} cases."]
    return "\n".join(out)


RENDERERS = {
    "cuda-linears": cuda_linears,
    "load-to-first-token": load_to_first_token,
    "fusion-groups": fusion_groups,
    "cpu-int4-switch": lambda r: cpu_switch(r, "modules"),
    "cpu-int8-switch": lambda r: cpu_switch(r, "int8_modules"),
    "gemm-variants": gemm_variants,
}


def render(doc: str) -> str:
    def block(m: re.Match) -> str:
        kind, rel = m.group(2), m.group(3)
        if kind not in RENDERERS:
            raise SystemExit(f"BENCHMARKS.md: unknown table kind {kind!r} (known: {', '.join(RENDERERS)})")
        data = json.loads((ROOT / rel).read_text())
        return m.group(1) + RENDERERS[kind](data) + "\n" + m.group(5)
    return BLOCK.sub(block, doc)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="exit 1 if a table differs from its JSON; write nothing")
    args = ap.parse_args()
    doc = DOC.read_text()
    new = render(doc)
    if args.check:
        if new != doc:
            print("BENCHMARKS.md: a generated table differs from its JSON; run python benchmarks/tables.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
