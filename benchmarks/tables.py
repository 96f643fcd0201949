"""BENCHMARKS.md's generated tables, from the raw JSON in benchmarks/results/.

A table in BENCHMARKS.md is a block

    <!-- table KIND results/FILE.json [results/FILE2.json ...] -->
    ...
    <!-- end table -->

whose body this script renders from those files with the renderer named KIND. `python
benchmarks/tables.py` rewrites every block; `--check` exits 1 when one differs from its JSON
(tests/test_benchmarks_doc.py runs it, so a figure in a table cannot drift from its source).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DOC = ROOT.parent / "BENCHMARKS.md"
BLOCK = re.compile(r"(<!-- table (\S+) (\S+(?: \S+)*?) -->\n)(.*?)(<!-- end table -->)", re.S)


def _machine(r: dict) -> str:
    cores = f", {r['cores']} threads" if r.get("cores") else ""
    return f"{r['date'][:10]}, {r['cpu_capability']}{cores}, {r['machine']}"


def cpu_switch(r: dict, key: str) -> str:
    """kernel / (dequantize + dense matmul) time per module across M (benchmarks/cpu_prefill.py, int8_switch.py)."""
    rows = r[key]
    Ms = sorted({x["M"] for x in rows})
    shapes = list(dict.fromkeys(x["shape"] for x in rows))
    cell = {(x["shape"], x["M"]): x for x in rows}
    out = [f"kernel / dequantize time ({_machine(r)}; below 1: the kernel is faster)", "",
           "| module (K x N) | " + " | ".join(f"M={m}" for m in Ms) + " |", "| --- |" + " --- |" * len(Ms)]
    for s in shapes:
        k, n = next((x["K"], x["N"]) for x in rows if x["shape"] == s)
        out.append(f"| {s} ({k} x {n}) | " + " | ".join(
            f"{cell[s, m]['kernel_over_dequant']:.2f}" if (s, m) in cell else "" for m in Ms) + " |")
    if key == "modules" and r.get("smollm2_prefill512"):
        p = r["smollm2_prefill512"]
        out += ["", f"SmolLM2 prefill of 512 tokens, whole model: {p['switch_at_512']['median_ms']:g} ms with the switch, "
                    f"{p['kernel_only']['median_ms']:g} ms with the int4 kernel only (median of {len(p['kernel_only']['runs'])})."]
    return "\n".join(out)


def load_to_first_token(r: dict) -> str:
    """Spawn to first token per variant, fresh processes (benchmarks/load.py)."""
    models = r["models"]
    names = list(models)
    variants = [("a_gptqmodel", "(a) GPTQModel, Inductor cache warm"), ("a0_gptqmodel_cold_inductor", "(a0) GPTQModel, empty Inductor cache"),
                ("b_quantprep", "(b) quantprep.load"), ("c_floor", "(c) floor (its dense forward in float32 below AVX512)"),
                ("ct_floor_with_transformers", "(ct) floor + transformers' modeling imports")]
    out = [f"{r['machine']}, {r['date'][:10]}, Python {r['python']}; median of {len(models[names[0]]['b_quantprep']['runs'])} fresh "
           "processes, seconds (imports / load / first forward)", "",
           "| variant | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for key, label in [(k, v) for k, v in variants if all(k in models[n] for n in names)]:
        out.append(f"| {label} | " + " | ".join(
            f"{models[n][key]['total_s']:.2f} s ({models[n][key]['import_s']:.2f} / {models[n][key]['load_s']:.2f} / "
            f"{models[n][key]['first_s']:.2f})" for n in names) + " |")
    for ratio in [r for r in ("b_over_a", "b_over_a0", "b_over_c", "b_over_ct") if all(r in models[n] for n in names)]:
        out.append(f"| {ratio.replace('_over_', ' / ')} | " + " | ".join(f"{models[n][ratio]:.2f}" for n in names) + " |")
    return "\n".join(out)


def fusion_groups(r: dict) -> str:
    """One fused matmul against the separate ones, per group and M (benchmarks/fusion.py)."""
    out = [f"{r['device']}, torch {r['torch']}, {r['date'][:10]}; microseconds per call", "",
           "| group | M | separate | fused | separate / fused |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {x['group']} | {x['M']} | {x['separate_us']:g} | {x['fused_us']:g} | {x['speedup']:.2f} |" for x in r["rows"]]
    return "\n".join(out)


def cuda_linears(r: dict) -> str:
    """Per linear and M: tinygemm, the Triton GEMM and the whole module, each over dense bf16 (benchmarks/cuda_kernels.py)."""
    Ms = sorted({x["M"] for x in r["timings"]})
    cell = {(x["layer"], x["M"]): x for x in r["timings"]}
    out = [f"{r['device']}, torch {r['torch']}, {r['date'][:10]}; `do_bench` medians; each cell: tinygemm / triton / module, "
           "as multiples of dense bf16's time (dense bf16 in us)", "",
           "| layer (K->N) | " + " | ".join(f"M={m}" for m in Ms) + " |", "| --- |" + " --- |" * len(Ms)]
    for layer, k, n in dict.fromkeys((x["layer"], x["K"], x["N"]) for x in r["timings"]):
        row = [cell[layer, m] for m in Ms]
        out.append(f"| {layer} ({k}->{n}) | " + " | ".join(
            f"{x['tinygemm_ms'] / x['dense_bf16_ms']:.2f} / {x['triton_ms'] / x['dense_bf16_ms']:.2f} / "
            f"{x['module_ms'] / x['dense_bf16_ms']:.2f} ({x['dense_bf16_ms'] * 1e3:.1f})" for x in row) + " |")
    worst = max(p["rel_err"] for p in r["parity"])
    out += ["", f"Parity of the cuda modules vs the dense float32 reference in the same run: {len(r['parity'])} cases, "
                f"max relative error {worst:.1e}; `pack_tinygemm` equal to `_convert_weight_to_int4pack` in "
                f"{sum(x['equal'] for x in r['layout'])} of {len(r['layout'])} cases."]
    return "\n".join(out)


KCACHE_MODES = {
    "a_compile_no_cache": "(a) compile, no cache",
    "b_compile_kcache": "(b) compile + kcache",
    "b2_compile_kcache_megacache_only": "(b2) torch.compile + mega-cache",
    "b3_compile_kcache_reused": "(b3) kept copy",
    "b4_compile_kcache_no_prefetch": "(b4) no thread",
    "c_eager": "(c) eager",
    "c2_eager_kcache": "(c2) eager + kcache",
}


def _load_first(runs: list[dict]) -> str:
    """median over runs of load + first token (the part a kcache can change), where phases were logged."""
    sums = sorted(r["phases_s"]["load"] + r["phases_s"]["first_token"] for r in runs if r.get("phases_s"))
    return f"{sums[len(sums) // 2]:.1f}" if sums else "-"


def _common_imports_ratio(r: dict) -> str:
    """b / c with every run's imports replaced by the median imports of all runs (as benchmarks/kcache.py
    computes `b_over_c_common_imports`); recomputed here so that runs logged before that field get it too."""
    raw = r.get("raw", {})
    if not all(raw.get(m) and all(x.get("phases_s") for x in raw[m]) for m in ("b_compile_kcache", "c_eager")):
        return ""
    imports = statistics.median(x["phases_s"]["imports"] for rs in raw.values() for x in rs if x.get("phases_s"))
    b, c = (imports + statistics.median(x["ttft_s"] - x["phases_s"]["imports"] for x in raw[m]) for m in ("b_compile_kcache", "c_eager"))
    return f"{b / c:.2f}"


def kcache_runs(*runs: dict) -> str:
    """Spawn to first token per mode, one row per run file (benchmarks/kcache.py)."""
    modes = [m for m in KCACHE_MODES if any(m in r["summary"] for r in runs)]
    ratios = [k for k in ("b_over_c", "b2_over_c", "a_over_b") if any(r.get(k) == r.get(k) and k in r for r in runs)]
    common = [_common_imports_ratio(r) for r in runs]
    out = ["Medians of fresh processes, spawn to first token; load + first token in brackets (median, where logged)", "",
           "| run | device | date | rounds | " + " | ".join(KCACHE_MODES[m] for m in modes) + " | "
           + " | ".join(k.replace("_over_", " / ") for k in ratios) + (" | b / c, common imports" if any(common) else "")
           + " | decode tok/s, b / c |", "| --- |" + " --- |" * (4 + len(modes) + len(ratios) + bool(any(common)) + 1)]
    for r, ci in zip(runs, common, strict=True):
        key = r["kcache_key"]
        device = key.get("name") or f"cpu {key.get('cpu_capability')}"
        cells = []
        for m in modes:
            s = r["summary"].get(m)
            cells.append(f"{s['ttft_s_median']:.2f} s ({_load_first(r['raw'][m])})" if s and r.get("raw", {}).get(m)
                         else f"{s['ttft_s_median']:.2f} s" if s else "")
        rat = [f"{r[k]:.2f}" if r.get(k) == r.get(k) and k in r else "" for k in ratios] + ([ci] if any(common) else [])
        s = r["summary"]
        dec = f"{s['b_compile_kcache']['tok_s_median']:.1f} / {s['c_eager']['tok_s_median']:.1f}" if "b_compile_kcache" in s and "c_eager" in s else ""
        out.append(f"| `{r['_file']}` | {device} | {r['date'][:10]} | {r['runs']} | " + " | ".join(cells + rat + [dec]) + " |")
    return "\n".join(out)


def cuda_model(*runs: dict) -> str:
    """Whole model, quantprep cuda int4 against dense bf16 (benchmarks/cuda_kernels.py --only-model)."""
    out = ["| run | decode 128 tokens, quantprep / dense bf16 | prefill 512 tokens, quantprep / dense bf16 "
           "| unfused decode / prefill | load to first token (fresh processes) | GPU memory of the weights |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        m = r["model"]
        unfused = (f"{m['quantprep_int4_unfused_decode_tok_s']:.1f} tok/s / {m['quantprep_int4_unfused_prefill512_ms']:.1f} ms"
                   if "quantprep_int4_unfused_decode_tok_s" in m else "-")
        lt = m["load_to_first_token_s"]
        out.append(f"| `{r['_file']}` ({r['device']}, torch {r['torch']}) | {m['quantprep_int4_decode_tok_s']:.1f} / "
                   f"{m['dense_bf16_decode_tok_s']:.1f} tok/s | {m['quantprep_int4_prefill512_ms']:.1f} / {m['dense_bf16_prefill512_ms']:.1f} ms "
                   f"| {unfused} | {lt['median']:.1f} s ({', '.join(f'{x:.1f}' for x in lt['runs'])}) | {m['gpu_memory_quantprep_mib']:.0f} MiB |")
    return "\n".join(out)


def fusion_cpu_model(r: dict) -> str:
    """Whole model on the CPU, fused against unfused (benchmarks/fusion.py)."""
    f, u = r["fused"], r["unfused"]
    return "\n".join([f"{r['date'][:10]}, {r['machine']}; median of {len(f['runs']['decode_tok_s'])} interleaved rounds", "",
                      "| SmolLM2, cpu | fused (default) | unfused |", "| --- | --- | --- |",
                      f"| decode 32 tokens | {f['decode_tok_s']:.1f} tok/s | {u['decode_tok_s']:.1f} tok/s |",
                      f"| prefill 128 tokens | {f['prefill128_ms']:.0f} ms | {u['prefill128_ms']:.0f} ms |"])


def pull_times(r: dict) -> str:
    """quantprep.load(REF) to the first token: local dir, filled pull cache, empty cache (benchmarks/pull.py)."""
    m = r["median_s"]
    out = [f"{r['date'][:10]}, {r['machine']}, {r['cores']} cores; {r['artifact']} ({r['bytes'] / 2**20:.0f} MiB); "
           f"fresh processes, median of {r['runs']}", "",
           "| mode | spawn to first token | load (of which pull) | goal |", "| --- | --- | --- | --- |"]
    load = {k: statistics.median(x["load_s"] for x in v) for k, v in r["raw"].items()}
    out += [f"| local directory | {m['local']:.2f} s | {load['local']:.2f} s | |",
            f"| oci://, pull cache filled | {m['filled']:.2f} s | {load['filled']:.2f} s | {r['filled_over_local']:.2f}x local (<= 1.1x) |",
            f"| oci://, empty cache (pull + verify) | {m['empty']:.2f} s | {load['empty']:.2f} s | "
            f"<= local + bytes / 500 MB/s = {r['empty_budget_s']:.2f} s: {'met' if r['empty_within_budget'] else 'NOT met'} |"]
    return "\n".join(out)


def calibration(*runs: dict) -> str:
    """Quality against the float model per calibration setting (benchmarks/calibration.py)."""
    out = []
    for r in runs:
        out.append(f"- {r['model']}: {r['date'][:10]}, {r['machine']}, gptqmodel {r['gptqmodel']} on the CPU")
    windows = "/".join(sorted({str(r["seq_len"]) for r in runs}))
    out += ["", f"int4, sym; a sample of the Python reference: a window of {windows} tokens; quantprep eval of the cpu artifact "
            "against the float model, ctx 512, the first scored tokens of the held-out text", "",
            "| model | calibration | samples | act-order | group | ppl (float) | ppl ratio | KLD mean | KLD p99 | top-1 | scored tokens | build |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        for x in r["rows"]:
            cal = "builtin texts" if x["calibration"] == "builtin" else f"Python reference {r['calibration_text_sha256'][:8]}"
            out.append(f"| {r['model']} | {cal} | {x['samples']} | {'on' if x['desc_act'] else 'off'} | {x['group_size']} | "
                       f"{x['ppl']:.3f} ({x['ref_ppl']:.3f}) | {x['ppl_ratio']:.4f} | {x['kld_mean']:.4f} | {x['kld_p99']:.3f} | "
                       f"{100 * x['top1_agree']:.1f}% | {x['tokens']} | {x['build_s']:.0f} s |")
    return "\n".join(out)


def eval_results(*runs: dict) -> str:
    """quantprep eval of real-weight artifacts, one row per result file (benchmarks/results/eval-*.json)."""
    out = ["| model | target (device) | calibration | ppl | float ppl | ratio (goal <= 1.05) | KLD mean (goal <= 0.05) | KLD p99 "
           "| top-1 | scored tokens | machine, date |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        e = r["eval"]
        out.append(f"| {r['model']} | {e['target']} ({e['device']}) | {r['calibration']} | {e['ppl']:.3f} | {e['reference']['ppl']:.3f} "
                   f"| {e['ppl_ratio']:.4f} | {e['kld']['mean']:.4f} | {e['kld']['p99']:.3f} | {100 * e['top1_agree']:.1f}% "
                   f"| {e['tokens']} | {r['machine']}, {r['date'][:10]} |")
    return "\n".join(out)


def serve_cold_start(*runs: dict) -> str:
    """Spawn to the first streamed token of a server's first request (benchmarks/serve.py)."""
    labels = {"a_quantprep_serve": "(a) quantprep serve ARTIFACT", "b_transformers_serve_gptqmodel": "(b) transformers serve GPTQ_DIR (GPTQModel)",
              "c_quantprep_load_generate": "(c) floor: quantprep.load + streamed generate"}
    out = ["| machine, date | model (target) | variant | ready | first token | goal |", "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        head = f"{r['machine']} ({r['cpu_capability']}), torch {r['torch']}, transformers {r['transformers']}, {r['date'][:10]}"
        for name, row in r["models"].items():
            for key, label in labels.items():
                if key not in row:
                    continue
                x = row[key]
                goal = ""
                if key == "a_quantprep_serve" and "b_over_a" in row:
                    goal = f"(b) / (a) = {row['b_over_a']:.2f} (>= 5: {'met' if row['b_over_a'] >= 5 else 'NOT met'}); "
                if key == "a_quantprep_serve" and "a_over_c" in row:
                    goal += f"(a) / (c) = {row['a_over_c']:.2f} (<= 1.2: {'met' if row['a_over_c'] <= 1.2 else 'NOT met'})"
                ready = f"{x['ready_s']:.2f} s" if "ready_s" in x else ""
                out.append(f"| {head} | {name} ({row['device']}) | {label} | {ready} | {x['first_token_s']:.2f} s | {goal} |")
                head = ""  # the machine once per results file
            for key, error in row.get("errors", {}).items():
                reason = error.split('"error": "')[-1].split('"')[0] if '"error"' in error else error[-160:]
                out.append(f"| | {name} ({row['device']}) | {labels[key]} | | failed | {reason} |")
    return "\n".join(out)


def vs_gptqmodel(*runs: dict) -> str:
    """GPTQModel's CPU kernel against quantprep's artifact of the same checkpoint (benchmarks/vs_gptqmodel.py)."""
    out = ["| model, machine, date | | GPTQModel (TORCH backend) | quantprep (cpu artifact) | quantprep / GPTQModel |", "| --- | --- | --- | --- | --- |"]
    for r in runs:
        q, head = r["quality"], f"{r['model']}, {r['machine']} ({r['cpu_capability']}), {r['date'][:10]}{_codes(r)}"
        pf, dc = r["prefill_512_s"], r["decode_tok_s"]
        out += [f"| {head} | activations | {r['dtypes']['gptqmodel']} | {r['dtypes']['quantprep']} | |",
                f"| | perplexity, held-out text, {q['windows']} x {q['ctx']} tokens | {q['ppl']['gptqmodel']:.3f} | {q['ppl']['quantprep']:.3f} "
                f"| {q['ppl']['quantprep'] / q['ppl']['gptqmodel']:.4f} |",
                f"| | KL(GPTQModel &#124;&#124; quantprep): mean, p99; top-1 agreement | | {q['kld_gptqmodel_quantprep']['mean']:.4f}, "
                f"{q['kld_gptqmodel_quantprep']['p99']:.4f}; {100 * q['top1_agree']:.1f}% | |",
                f"| | 512-token prefill (median of {len(pf['quantprep']['runs'])}) | {pf['gptqmodel']['median']:.2f} s | {pf['quantprep']['median']:.2f} s "
                f"| {pf['quantprep_over_gptqmodel']:.2f}x the time |",
                f"| | decode, {r['decode_new_tokens']} tokens after a 16-token prompt | {dc['gptqmodel']['median']:.2f} tok/s | "
                f"{dc['quantprep']['median']:.2f} tok/s | {dc['quantprep_over_gptqmodel']:.2f}x the speed |",
                f"| | greedy tokens equal before the first difference | | {r['same_greedy_prefix']} of {r['decode_new_tokens']} | |"]
    return "\n".join(out)


def vs_gptqmodel_openvino(*runs: dict) -> str:
    """The openvino artifact of the same checkpoint beside GPTQModel and the cpu artifact, in the same
    run (benchmarks/vs_gptqmodel.py --openvino)."""
    out = ["| model, machine, date | | GPTQModel (TORCH backend) | quantprep cpu artifact | quantprep openvino artifact | openvino / cpu artifact "
           "| openvino / GPTQModel |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        q, o, head = r["quality"], r["openvino"], f"{r['model']}, {r['machine']} ({r['cpu_capability']}), {r['date'][:10]}"
        pf, dc = r["prefill_512_s"], r["decode_tok_s"]
        out += [f"| {head} | activations | {r['dtypes']['gptqmodel']} | {r['dtypes']['quantprep']} | {r['dtypes']['openvino']} | | |",
                f"| | perplexity, held-out text, {q['windows']} x {q['ctx']} tokens | {q['ppl']['gptqmodel']:.3f} | {q['ppl']['quantprep']:.3f} "
                f"| {o['ppl']:.3f} | {o['ppl'] / q['ppl']['quantprep']:.4f} | {o['ppl'] / q['ppl']['gptqmodel']:.4f} |",
                f"| | KL(GPTQModel &#124;&#124; it): mean; top-1 agreement | | {q['kld_gptqmodel_quantprep']['mean']:.4f}; "
                f"{100 * q['top1_agree']:.1f}% | {o['kld_gptqmodel_openvino']['mean']:.4f}; {100 * o['top1_agree']:.1f}% | | |",
                f"| | 512-token prefill (median of {len(pf['openvino']['runs'])}) | {pf['gptqmodel']['median']:.2f} s | "
                f"{pf['quantprep']['median']:.2f} s | {pf['openvino']['median']:.2f} s | {pf['openvino_over_quantprep']:.2f}x the time "
                f"| {pf['openvino_over_gptqmodel']:.2f}x the time |",
                f"| | decode, {r['decode_new_tokens']} tokens after a 16-token prompt | {dc['gptqmodel']['median']:.2f} tok/s | "
                f"{dc['quantprep']['median']:.2f} tok/s | {dc['openvino']['median']:.2f} tok/s | {dc['openvino_over_quantprep']:.2f}x the speed "
                f"| {dc['openvino_over_gptqmodel']:.2f}x the speed |",
                f"| | greedy tokens equal to GPTQModel's before the first difference | | {r['same_greedy_prefix']} of {r['decode_new_tokens']} "
                f"| {o['same_greedy_prefix']} of {r['decode_new_tokens']} | | |"]
    return "\n".join(out)


def _gptqmodel_label(backend: str, kernels: list[str] | None, dtype: str = "default") -> str:
    """GPTQModel's name in a table: its backend, a dtype it was asked for, the kernel classes it loaded."""
    return (f"GPTQModel, BACKEND.{backend}" + ("" if dtype == "default" else f", {dtype}")
            + (f" ({', '.join(kernels)})" if kernels else ""))


def _runtime_label(r: dict, name: str) -> str:
    """A vs_gptqmodel model's name in a table: GPTQModel's with its backend, dtype and kernel (files
    before --gptqmodel ran BACKEND.TORCH, TorchLinear)."""
    if name.startswith("gptqmodel"):
        v = r.get("gptqmodel_variants", {}).get(name, {"backend": "TORCH", "dtype": "default", "kernels": ["TorchLinear"]})
        return _gptqmodel_label(v["backend"], v["kernels"], v["dtype"])
    return {"quantprep": "quantprep (cpu artifact, kernel plan)", "dense": "dense bf16", "dense_float32": "dense float32",
            "openvino": "openvino artifact"}.get(name, name)


def vs_gptqmodel_dense(*runs: dict) -> str:
    """quantprep's cpu artifact (its kernel plan applied), GPTQModel and the dense bfloat16 model of one
    checkpoint, in one run (benchmarks/vs_gptqmodel.py --dense --profile); below AVX512 also the dense
    float32 model (--dense-float32: torch's bfloat16 GEMM is slower than its float32 one there) and
    GPTQModel's other CPU backends (--gptqmodel)."""
    out = ["| model, machine, date | runtime | 512-token prefill | quantprep's time / its | decode | quantprep's speed / its |",
           "| --- |" + " --- |" * 5]
    for r in runs:
        pf, dc = r["prefill_512_s"], r["decode_tok_s"]
        head = (f"{r['model']}, {r['cpu']} ({r['cores']} cores, {r['cpu_capability']}, {r['threads']} threads), {r['date'][:10]}{_codes(r)}; "
                f"prefill: median of {len(pf['quantprep']['runs'])}; decode: {r['decode_new_tokens']} tokens after a 16-token prompt")
        for name in ["quantprep"] + [k for k, v in pf.items() if isinstance(v, dict) and k != "quantprep"]:
            ours = name == "quantprep"
            cells = [head, _runtime_label(r, name), f"{pf[name]['median']:.2f} s",
                     "" if ours else f"{pf['quantprep']['median'] / pf[name]['median']:.2f}x", f"{dc[name]['median']:.2f} tok/s",
                     "" if ours else f"{dc['quantprep']['median'] / dc[name]['median']:.2f}x"]
            out.append("| " + " | ".join(cells) + " |")
            head = ""
        out.append(f"| | kernel plan: {r['kcache'].get('plan', 'none')} modules planned ({r['kcache'].get('trusted', r['kcache']['status'])}) | | | | |")
    for r in runs:  # each run's profile under the table of all runs
        prof, n = r.get("prefill_profile_ms"), len(r["prefill_512_s"]["quantprep"]["runs"])
        if prof:
            prof = dict(sorted(prof.items(), key=lambda kv: kv[0] != "quantprep"))  # quantprep first, as in the table above
            kinds = [k for k in dict.fromkeys(k for p in prof.values() for k in p) if k != "total"]
            out += ["", f"`{r['_file']}`: 512-token prefill by module kind, ms, exclusive of children (forward hooks, median of {n}):", "",
                    "| module kind | " + " | ".join(_runtime_label(r, k) for k in prof) + " |", "| --- |" + " --- |" * len(prof)]
            out += [f"| {k} | " + " | ".join(f"{p[k]:.1f}" if k in p else "" for p in prof.values()) + " |" for k in kinds]
            out.append("| total | " + " | ".join(f"{p['total']:.1f}" for p in prof.values()) + " |")
    return "\n".join(out)


def cpu_dense_tiles(*runs: dict) -> str:
    """The cpu dense path per linear shape: tiled against the whole weight, the int4 kernel and dense
    bf16's F.linear (benchmarks/cpu_dense_tiles.py)."""
    out = []
    for r in runs:
        out += [f"{r['cpu']} ({r['cores']} cores, {r['cpu_capability']}, {r['threads']} threads), {r['date'][:10]}; M = {r['M']}, "
                f"Qwen2.5-1.5B shapes, medians of {r['rounds']} interleaved rounds, ms", "",
                "| linear | K x N | dense bf16 (F.linear) | whole weight, then matmul | tiled | int4 kernel | tiled / dense "
                "| dequantization alone: AVX512-BF16 block / compiler's loop | the tiles' GEMMs alone |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for x in r["rows"] + [{"shape": "one layer", "K": "", "N": "", "ms": r["layer_ms"], "tiled_over_dense": r["layer_tiled_over_dense"]}]:
            ms = x["ms"]
            size = f"{x['K']} x {x['N']}" if x["K"] else ""
            out.append(f"| {x['shape']} | {size} | {ms['dense_linear']:.2f} | {ms['whole_dequant_matmul']:.2f} | {ms['tiled']:.2f} | "
                       f"{ms['int4_kernel']:.2f} | {x['tiled_over_dense']:.2f}x | {ms['dequant_tiles']:.2f} / {ms['dequant_tiles_portable']:.2f} "
                       f"| {ms['tiles_gemm_only']:.2f} |")
    return "\n".join(out)


def cpu_decode_profile(*runs: dict) -> str:
    """A cpu artifact's decode op by op, and its lm_head in bf16 and per-channel int8 (benchmarks/cpu_decode_profile.py)."""
    out = []
    for r in runs:
        h = r["lm_head"]
        out += [f"{r['cpu']} ({r['cores']} cores, {r['cpu_capability']}, {r['threads']} threads), {r['date'][:10]}; decode "
                f"{r['decode_tok_s']['median']:.2f} tok/s (median of {len(r['decode_tok_s']['runs'])}), {r['new_tokens']} tokens profiled "
                + (f"({r['profiled_wall_ms_per_token']:.1f} ms a token under the profiler, {r['profiled_ms_per_token']:.1f} of them in "
                   "aten ops; the rest: quantprep's C kernels and Python)" if "profiled_wall_ms_per_token" in r else
                   f"({r['profiled_ms_per_token']:.1f} ms a token under the profiler)")
                + f"; lm_head: {h.get('module', 'bf16 Linear')}; memory read {r['memory_read_gb_s']:.0f} GB/s", "",
                "| op | calls | self time, ms | share |", "| --- | --- | --- | --- |"]
        out += [f"| {o['op']} | {o['calls']} | {o['self_ms']:.1f} | {o['share'] * 100:.1f}% |" for o in r["ops"][:8]]
        out += ["", f"lm_head {h['shape'][0]} x {h['shape'][1]} at one row: bf16 ({h['bf16_mb']:.0f} MB) {h['bf16_ms']:.2f} ms, "
                f"per-channel int8 {h['int8_per_channel_ms']:.2f} ms"
                + (f", int4 in groups of 128 {h['int4_g128_ms']:.2f} ms" if "int4_g128_ms" in h else "")]
    return "\n".join(out)


def vs_llamacpp(*runs: dict) -> str:
    """llama.cpp on the recipe's GGUF beside quantprep's cpu artifact and GPTQModel (benchmarks/vs_llamacpp.py)."""
    names = {"llamacpp": "llama.cpp (the recipe's Q4_K_M GGUF)", "quantprep": "quantprep (cpu artifact)",
             "quantprep_int8_head": "quantprep, built with `--lm-head int8`", "quantprep_int4_head": "quantprep, built with `--lm-head int4`",
             "native": "quantprep's native runtime (cpu artifact)", "native_int8_head": "native runtime, `--lm-head int8`",
             "native_int4_head": "native runtime, `--lm-head int4`"}
    out = []
    for r in runs:
        # files before --gptqmodel-backend ran BACKEND.TORCH and did not record the kernel
        names["gptqmodel"] = _gptqmodel_label(r.get("gptqmodel_backend") or "TORCH", r.get("gptqmodel_kernels"))
        dc, pf, ft = r["decode_tok_s"], r["prefill_512_s"], r["first_token_s"]
        dl = r["decode_after_512_tok_s"]
        out += [""] * bool(out) + [
                f"{r['_file']}: {r['model']}, {r['cpu']} ({r['cores']} cores, {r['cpu_capability']}), {r['threads']} threads each, {r['date'][:16]}; "
                f"llama-cpp-python {r['versions']['llama_cpp']}{_codes(r)}; medians of {len(dc['quantprep']['runs'])} (first token: "
                f"{len(ft['quantprep']['runs'])} fresh processes)", "",
                "| runtime | decode, tok/s | decode after 512 tokens, tok/s | 512-token prefill, s | spawn to first token, s "
                "(imports / load / first token) |",
                "| --- | --- | --- | --- | --- |"]
        for k, name in names.items():
            if k not in dc:
                continue
            f = ft[k]
            out.append(f"| {name} | {dc[k]['median']:.2f} | {dl[k]['median']:.2f} | {pf[k]['median']:.2f} | {f['total_s']:.2f} "
                       f"({f['import_s']:.2f} / {f['load_s']:.2f} / {f['first_s']:.2f}) |")
        for k in ("quantprep", "quantprep_int8_head", "quantprep_int4_head", "native", "native_int8_head", "native_int4_head", "gptqmodel"):
            if f"{k}_over_llamacpp" in dc:
                out.append(f"| {names[k].split(' (')[0]} / llama.cpp | {dc[f'{k}_over_llamacpp']:.2f}x the speed | "
                           f"{dl[f'{k}_over_llamacpp']:.2f}x the speed | {pf[f'{k}_over_llamacpp']:.2f}x the time | "
                           f"{ft[f'{k}_over_llamacpp']:.2f}x the time |")
    return "\n".join(out)


FIRST_TOKEN_CLI = {"quantprep_native": "`quantprep generate --native`", "quantprep": "`quantprep generate`",
                   "llamacpp": "llama.cpp, `create_chat_completion` (the recipe's Q4_K_M GGUF)"}


def first_token_cli(r: dict) -> str:
    """Prompt text to first token from the command line, fresh processes (benchmarks/first_token_cli.py)."""
    t = r["spawn_to_first_token_s"]
    out = [f"{r['_file']}: {r['artifact']}, {r['cpu']} ({r['cores']} cores, {r['cpu_capability']}), {r['threads']} threads each, "
           f"{r['date'][:16]}{_codes(r)}; spawn to exit after one token, median of {r['loads']} fresh processes; prompt tokens (each tool's "
           f"template and tokenizer): --native {r['prompt_tokens']['quantprep']}, llama.cpp {r['prompt_tokens']['llamacpp']}", "",
           "| command | spawn to first token, s | / llama.cpp | runs, s | first token |", "| --- | --- | --- | --- | --- |"]
    for k, name in FIRST_TOKEN_CLI.items():
        ratio = f"{r['over_llamacpp'][k]:.2f}x" if k in r["over_llamacpp"] else "1"
        out.append(f"| {name} | {t[k]['median']:.2f} | {ratio} | {', '.join(f'{x:.2f}' for x in t[k]['runs'])} | "
                   f"{json.dumps(r['first_token'][k])} |")
    return "\n".join(out)


def cpu_decode_attention(r: dict) -> str:
    """One decode token's attention per layer: quantprep's kernel against torch's SDPA (benchmarks/cpu_decode_attention.py)."""
    out = [f"{r['cpu']} ({r['cores']} cores, {r['cpu_capability']}, {r['threads']} threads), {r['date'][:10]}, torch {r['torch']}; "
           f"{r['heads']} query heads, {r['kv_heads']} key/value heads, head dim {r['head_dim']} (Qwen2.5-1.5B), {r['dtype']} cache; "
           f"medians of {r['reps']} x {r['calls']} calls", "",
           "| cached tokens | quantprep, µs | SDPA bf16, µs | SDPA f32, µs | SDPA bf16 / quantprep | "
           "rel. error vs float64: quantprep / SDPA bf16 |",
           "| --- | --- | --- | --- | --- | --- |"]
    for x in r["rows"]:
        us, e = x["us_per_layer"], x["rel_err_vs_float64"]
        out.append(f"| {x['context']} | {us['quantprep']:.1f} | {us['sdpa_bf16']:.1f} | {us['sdpa_f32']:.1f} | "
                   f"{x['sdpa_bf16_over_quantprep']:.1f}x | {e['quantprep']:.1e} / {e['sdpa_bf16']:.1e} |")
    if "model" in r:
        m = r["model"]
        out += ["", f"{m['artifact']}: greedy decode, tok/s, {m['new_tokens']} tokens, medians of {m['runs']}", "",
                "| attention | KV cache | prompt, tokens | generate's stopping | tok/s |", "| --- | --- | --- | --- | --- |"]
        out += [f"| {x['attention']} | {x['cache']} | {x['prompt']} | "
                f"{'min_new_tokens' if x['min_new_tokens'] else 'none (eos_token_id=None)'} | {x['median']:.2f} |" for x in m["decode_tok_s"]]
    return "\n".join(out)


def cpu_layers(*runs: dict) -> str:
    """Decode's RMSNorm, SiLU product and float lm_head in C against transformers' and torch's ops, and the model's decode with and without (benchmarks/cpu_layers.py)."""
    return "\n\n".join(_cpu_layers(r) for r in runs)


TILE_ROWS = " (\"_rows_float32_tiles\": that many rows through CpuLinear's float32 tiles against torch's bfloat16 GEMM, " \
    "medians of 3 calls; \"used\": where CpuLinear takes them)"


def _cpu_layers(r: dict) -> str:
    out = [f"`{r['_file']}`: {r['cpu']} ({r['cores']} cores, {r['cpu_capability']}, {r['threads']} threads), {r['date'][:10]}, torch {r['torch']}{_codes(r)}; "
           f"one decode row{TILE_ROWS if any(k.endswith('_float32_tiles') for k in r['us_per_call']) else ''}, {r['dtype']}; "
           f"medians of {r['reps']} timings", "",
           "| call | transformers / torch, µs | quantprep, µs | speed-up |", "| --- | --- | --- | --- |"]
    for name, c in r["us_per_call"].items():
        theirs = c.get("transformers", c.get("torch"))
        gb = f" ({c['gb_s']['torch']:.0f} / {c['gb_s']['quantprep']:.0f} GB/s)" if "gb_s" in c else ""
        used = {True: " (used)", False: " (not used here)"}.get(c.get("used"), "")
        out.append(f"| {name}{used} | {theirs:.1f} | {c['quantprep']:.1f} | {theirs / c['quantprep']:.2f}x{gb} |")
    prefetch = any("c_no_prefetch" in x for x in r["decode_tok_s"])
    out += ["", f"greedy decode after a 16-token prompt, tok/s, {r['new_tokens']} tokens, interleaved, medians of {r['runs']}", "",
            "| artifact | as loaded (C) | C module by module | their own forward (transformers, torch) | C / own | "
            "as loaded / module by module |" + (" int8-activation kernels without prefetch | prefetch / none |" if prefetch else ""),
            "| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if prefetch else "")]
    out += [f"| {x['artifact']} | {x['c']:.2f} | {_or_dash(x.get('c_modules'), '{:.2f}')} | {x['torch']:.2f} | "
            f"{x['c_over_torch']:.2f}x | {_or_dash(x.get('c_over_c_modules'), '{:.2f}x')} |"
            + (f" {_or_dash(x.get('c_no_prefetch'), '{:.2f}')} | {_or_dash(x.get('c_over_c_no_prefetch'), '{:.2f}x')} |" if prefetch else "")
            for x in r["decode_tok_s"]]
    out += ["", "Ratios: medians of the per-run ratios. Module by module: the decoder layers' own forward (before "
                "decode_layer; runs before 2026-11-27's afternoon had only that)."]
    return "\n".join(out)


def _or_dash(value, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def cpu_int4_a8(*runs: dict) -> str:
    """Every int4 module forced onto the int4 kernel, then onto int4_a8: decode and accuracy (benchmarks/cpu_int4_a8.py), per run."""
    return "\n\n".join(_cpu_int4_a8(r) for r in runs)


def _cpu_int4_a8(r: dict) -> str:
    a, d, x = r["accuracy"], r["decode_tok_s"], r["int4_a8_vs_int4"]
    out = [f"{r['artifact']}, {r['cpu']} ({r['cores']} cores, {r['cpu_capability']}, {r['threads']} threads), {r['date'][:10]}; "
           f"decode: medians of {len(d['int4']['runs'])}, {r['new_tokens']} tokens; accuracy: {r['text']['windows']} windows of "
           f"{r['text']['ctx']} held-out tokens against the {r['reference']} model (perplexity {a['int4']['reference_ppl']:.3f})", "",
           "| path | decode, tok/s | perplexity | KL mean | KL p99 | top-1 agreement |", "| --- | --- | --- | --- | --- | --- |"]
    out += [f"| {p} | {d[p]['median']:.2f} | {a[p]['ppl']:.3f} | {a[p]['kld_mean']:.4f} | {a[p]['kld_p99']:.3f} | "
            f"{a[p]['top1_agree'] * 100:.1f}% |" for p in ("int4", "int4_a8")]
    out += ["", f"int4_a8 against int4 itself: KL mean {x['kld_mean']:.4f}, p99 {x['kld_p99']:.4f}, top-1 agreement "
                f"{x['top1_agree'] * 100:.1f}%; decode {d['int4_a8']['median'] / d['int4']['median']:.2f}x the int4 kernel's speed"]
    return "\n".join(out)


def plan_prefill(*runs: dict) -> str:
    """A model's prefill and one-row forward with the kernel plan, each fixed rule and single path, and dense bf16 (benchmarks/plan_prefill.py)."""
    out = ["| machine, date | model shapes | warm (of it, the plan) | variant | 512-token prefill | / dense | one-row forward |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        head = f"{_where(r)}, {r['target']}, {r['date'][:10]}"
        for name, m in r["models"].items():
            cells = [head, f"Qwen2.5-{name.upper()}", f"{m['warm_s']:.1f} s ({m['plan_s']:.1f} s)"]
            for v, p in m["prefill512_ms"].items():
                out.append(f"| {' | '.join(cells)} | {v} | {p['median']:.2f} ms | {m['prefill512_over_dense'][v]:.2f}x | "
                           f"{m['forward_m1_ms'][v]['median']:.2f} ms |")
                cells = ["", "", ""]
            head = ""
    return "\n".join(out)


def cuda_gather(r: dict) -> str:
    """The act-order gather per K and M: torch's index_select, the shipped Triton pass and the tile
    shapes tried, microseconds (benchmarks/cuda_gather.py)."""
    variants = list(r["rows"][0]["us"])
    if not all(all(x["equal"].values()) for x in r["rows"]):
        raise SystemExit(f"{r['_file']}: a gather's output differs from index_select's")
    out = [f"{_where(r)}, torch {r['torch']}, {r['date'][:10]}: microseconds, CUDA graph replays; every output equal to "
           "index_select's; `triton_BM_BK`: tiles, `rows_W`: one program per row with W warps", "",
           "| K (layer) | M | " + " | ".join(variants) + " |", "| --- | --- |" + " --- |" * len(variants)]
    for x in r["rows"]:
        out.append(f"| {x['K']} ({x['shape']}) | {x['M']} | " + " | ".join(f"{x['us'][v]:.1f}" for v in variants) + " |")
    return "\n".join(out)


def cuda_dequant(r: dict) -> str:
    """The dequantize path's one Triton pass and its variants per fused linear, with the bytes they
    move per second (benchmarks/cuda_dequant.py)."""
    variants = list(dict.fromkeys(x["variant"] for x in r["rows"]))
    out = [f"{_where(r)}, torch {r['torch']}, {r['date'][:10]}: microseconds (TB/s of int4 read + bf16 written); "
           "every variant's output equal to the shipped one's", "",
           "| model | linear | K x N | " + " | ".join(variants) + " |", "| --- | --- | --- |" + " --- |" * len(variants)]
    for (model, linear), rows in itertools.groupby(r["rows"], key=lambda x: (x["model"], x["linear"])):
        rows = {x["variant"]: x for x in rows}
        if not all(x["equal_to_shipped"] in (True, None) for x in rows.values()):
            raise SystemExit(f"{r['_file']}: a variant's output differs from the shipped kernel's ({model} {linear})")
        first = next(iter(rows.values()))
        out.append(f"| {model} | {linear} | {first['K']} x {first['N']} | "
                   + " | ".join(f"{rows[v]['ms'] * 1e3:.1f} ({rows[v]['tb_per_s']:.2f})" for v in variants) + " |")
    return "\n".join(out)


def cuda_dequant_tiles(r: dict) -> str:
    """The dequantize path whole and in column tiles, per fused linear and M, time / dense bf16
    (benchmarks/cuda_dequant_tiles.py)."""
    variants = list(dict.fromkeys(x["variant"] for x in r["rows"]))
    out = [f"{_where(r)}, torch {r['torch']}, {r['date'][:10]}: time / dense bf16, CUDA graph replays; max relative error to the "
           f"shipped path {max(x['rel_err'] for x in r['rows']):.1e}", "",
           "| model | linear | K x N | M | " + " | ".join(variants) + " |", "| --- | --- | --- | --- |" + " --- |" * len(variants)]
    for (model, linear, m), rows in itertools.groupby(r["rows"], key=lambda x: (x["model"], x["linear"], x["M"])):
        rows = {x["variant"]: x for x in rows}
        dense = rows["dense"]["ms"]
        out.append(f"| {model} | {linear} | {rows['dense']['K']} x {rows['dense']['N']} | {m} | "
                   + " | ".join(f"{rows[v]['ms'] / dense:.2f}x" if v in rows else "" for v in variants) + " |")
    return "\n".join(out)


def cuda_overlap(*runs: dict) -> str:
    """The 512-token prefill gap experiments (benchmarks/cuda_overlap.py): whole-model variants over
    dense bf16 (CUDA graph replays and eager), then the transposed Triton GEMM per linear and M."""
    out = ["| machine, date | model shapes | variant | prefill / dense, CUDA graphs | eager |", "| --- | --- | --- | --- | --- |"]
    for r in runs:
        if not r.get("models") and not r.get("per_linear"):
            raise SystemExit(f"{r['_file']}: neither 'models' nor 'per_linear': not a cuda_overlap.py result")
        head = f"{_where(r)}, {r['date'][:10]}"
        for name, m in r.get("models", {}).items():
            cells = [head, f"Qwen2.5-{name.upper()}"]
            for v, ratio in m["graph_over_dense"].items():
                out.append(f"| {' | '.join(cells)} | {v} | {ratio:.3f}x | {m['eager_over_dense'][v]:.2f}x |")
                cells, head = ["", ""], ""
    for r in runs:
        if "per_linear" not in r:
            continue
        out += ["", f"{_where(r)}, triton {r['triton']}, {r['date'][:10]}: per linear, time / dense bf16 (CUDA graph replays); "
                "`t_BM_BN_BK_warps_stages`: the transposed GEMM's tiles", ""]
        variants = list(r["per_linear"][0]["us"])
        out += ["| model | linear | K x N | M | " + " | ".join(variants) + " |", "| --- | --- | --- | --- |" + " --- |" * len(variants)]
        for x in r["per_linear"]:
            errs = [e for e in x["rel_err"].values() if not isinstance(e, float) or e > 1e-2]
            if errs:
                raise SystemExit(f"{r['_file']}: {x['model']} {x['linear']}: a variant failed or differs from the reference: {errs}")
            out.append(f"| {x['model']} | {x['linear']} | {x['K']} x {x['N']} | {x['M']} | "
                       + " | ".join(f"{x['us'][v] / x['us']['dense']:.2f}x" for v in variants) + " |")
    return "\n".join(out)


def cuda_prefill(*runs: dict) -> str:
    """Per-linear kernel candidates on the GPU, the best per M against dense bf16 (benchmarks/cuda_prefill.py)."""
    out = []
    for r in runs:
        out += [f"{r['device']}, torch {r['torch']}, mslk-cuda {r['mslk']}, torchao {r['torchao']}, {r['date'][:10]}: time / dense bf16, "
                "one decoder layer's linears weighted by count", "",
                "| model | M | best path per linear | best single path | with the act-order gathers |", "| --- | --- | --- | --- | --- |"]
        for x in r["plan"]["summary"]:
            out.append(f"| {x['model']} | {x['M']} | {x['plan_over_dense']:.2f}x | {x['best_single_path']} {x['best_single_over_dense']:.2f}x "
                       f"| {x['plan_with_gather_over_dense']:.2f}x |")
        out += ["", "| model | whole-model 512-token prefill / dense (CUDA graphs) | " + " | ".join(
            next(iter(r["whole_model"].values()))["graph_prefill512_over_dense"]) + " |",
                "| --- | --- |" + " --- |" * len(next(iter(r["whole_model"].values()))["graph_prefill512_over_dense"])]
        for name, w in r["whole_model"].items():
            if "graph_prefill512_over_dense" in w:
                out.append(f"| {name} | dense {w['graph_prefill512_ms']['dense_bf16']:.2f} ms | "
                           + " | ".join(f"{v:.2f}x" for v in w["graph_prefill512_over_dense"].values()) + " |")
    return "\n".join(out)


def openvino_start(*runs: dict) -> str:
    """Spawn to first token of an openvino artifact per variant, fresh processes (benchmarks/openvino_start.py)."""
    labels = {"pa-nocache": "genai's default pipeline (PagedAttention), no cache", "pa-cache": "the same, CACHE_DIR warmed",
              "sdpa-nocache": "quantprep.load, stateful pipeline, no cache", "sdpa-kcache": "quantprep.load with the warmed kcache",
              "sdpa-cache-size": "the same, CACHE_MODE=OPTIMIZE_SIZE (weightless blob)", "cpu-target": "the cpu target's artifact (torch)"}
    out = ["| model, machine, date | variant | first token | imports | pipeline construction | first generate |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        head = f"{r['model']}, {_where(r)}, {r['date'][:10]}, median of {r['runs']}"
        for key, label in labels.items():
            if key in r["median"]:
                x = r["median"][key]
                out.append(f"| {head} | {label} | {x['first_token_s']:.2f} s | {x['import_s']:.2f} s | {x['construct_s']:.2f} s | "
                           f"{x['first_generate_s']:.2f} s |")
                head = ""
    return "\n".join(out)


def target_ppl(*runs: dict) -> str:
    """The same checkpoint's perplexity per target, against its dequantized model (quantprep eval --json files)."""
    out = ["| target (device) | ppl | reference ppl (kind) | ratio | KLD mean | top-1 | scored tokens | vs the cpu artifact |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    runs = [r.get("eval", r) | ({"variant": r["variant"]} if "variant" in r else {}) for r in runs]  # an eval --json file, or a results file holding one
    cpu = next((r["ppl"] for r in runs if r["target"] == "cpu"), None)  # the first cpu row: the others are against it
    for r in runs:
        vs = f"{100 * (r['ppl'] / cpu - 1):+.3f}%" if cpu else ""
        device = r["device"] + (f", {r['dtype']}" if r.get("dtype") else "") + (f", {r['variant']}" if r.get("variant") else "")
        out.append(f"| {r['target']} ({device}) | {r['ppl']:.4f} | {r['reference']['ppl']:.4f} ({r['reference']['kind']}) | {r['ppl_ratio']:.5f} | "
                   f"{r['kld']['mean']:.5f} | {100 * r['top1_agree']:.1f}% | {r['tokens']} | {vs} |")
    return "\n".join(out)


def scale(r: dict) -> str:
    """Prepack, verify and load per model size, fresh processes (benchmarks/scale.py)."""
    has_cold = any("cold" in x for x in r["sizes"].values())
    out = [f"{r['machine']} ({r['cpu_capability']}), {r['memory_gib']} GiB, torch {r['torch']}, {r['date'][:10]}; Qwen2.5 shapes, "
           "int4 g128 act-order, random codes, cpu target", "",
           "| size | parameters | source | copy (disk; median, range) | prepack (goal <= 2x copy) | prepack peak RSS | verify | verify peak RSS "
           "| load to first token | floor | load / floor | floor with transformers' imports | load / that floor (goal <= 1.25) |"
           + (" cold: load, floor with transformers' imports, ratio |" if has_cold else ""),
           "| --- " * (13 + has_cold) + "|"]
    for size, x in r["sizes"].items():
        with_tf = x.get("floor_with_transformers")
        cold = x.get("cold")
        runs = x.get("copy_runs_s")
        spread = f"; {min(runs):.1f}-{max(runs):.1f} s" if runs else ""
        out.append(f"| {size} | {x['params'] / 1e9:.2f} B | {x['source_bytes'] / 2**30:.2f} GiB | {x['copy_s']:.1f} s ({x['copy_mb_s']:.0f} MB/s{spread}) "
                   f"| {x['prepack']['s']:.1f} s ({x['prepack_over_copy']:.2f}x) | {x['prepack']['peak_rss_gib']:.2f} GiB "
                   f"| {x['verify']['s']:.1f} s | {x['verify']['peak_rss_gib']:.2f} GiB | {x['load_first_token']['total_s']:.2f} s "
                   f"| {x['floor']['total_s']:.2f} s | {x['load_over_floor']:.2f} "
                   + (f"| {with_tf['total_s']:.2f} s | {x['load_over_floor_with_transformers']:.2f} |" if with_tf else "| | |")
                   + ("" if cold is None else f" {cold} |" if isinstance(cold, str) else
                      f" {cold['load_first_token']['total_s']:.1f} s, {cold['floor_with_transformers']['total_s']:.1f} s, "
                      f"{cold['load_over_floor_with_transformers']:.2f} |"))
    for size, why in r["skipped"].items():
        out.append(f"| {size} | skipped: {why} | | | | | | | | | | | |")
    return "\n".join(out)


def first_load_hash(r: dict) -> str:
    """An artifact's first load here (every file hashed) against later, marked loads and the
    sizes-only opt-out, fresh processes (benchmarks/hash_cost.py)."""
    modes = list(r["rows"][0]["modes"])
    out = [f"{_machine(r)}; median of {len(r['rows'][0]['modes'][modes[0]]['runs'])} fresh processes, files in the page cache", "",
           "| artifact | MiB | " + " | ".join(modes) + " | first load / sizes only |", "| --- | --- |" + " --- |" * (len(modes) + 1)]
    for row in r["rows"]:
        m = {k: v["median_s"] for k, v in row["modes"].items()}
        out.append(f"| {row['artifact']} | {row['mib']:.0f} | " + " | ".join(f"{m[k]:.2f} s" for k in modes)
                   + f" | {m[modes[1]] / m[modes[0]]:.2f}x |")
    return "\n".join(out)


def _where(r: dict) -> str:
    """The machine a results file was measured on, in a few words, from what the file records."""
    gpu = next((v for v in (r.get("device"), r.get("cpu_capability"), r.get("kcache_key", {}).get("name")) if str(v).startswith("NVIDIA")), None)
    if gpu:
        return gpu.removeprefix("NVIDIA ").split()[0]
    if str(r.get("device", "")).startswith("cuda") or any(m.get("device") == "cuda" for m in r.get("models", {}).values()):
        return "cuda (the GPU: not in the JSON)"
    machine = r.get("machine", "")
    if "(" in machine:  # already "CPU (N cores, ISA)"
        return machine
    cores = r.get("cores") or r.get("cpus") or next(iter(re.findall(r"(\d+) cpus", machine)), None)
    name = r.get("cpu") or (machine if machine and not machine.startswith(("Linux-", "vm ")) else "")
    parts = [name, f"{cores} cores" if cores else "", r.get("cpu_capability") or r.get("kcache_key", {}).get("cpu_capability", "")]
    return ", ".join(x for x in parts if x) or (f"cpu ({machine.split('-x86_64')[0]})" if machine else "not in the JSON")


def _codes(r: dict) -> str:
    """'; codes rounded to nearest ...' for a run on benchmarks/rtn_gptq.py's checkpoint (speed only), else ''."""
    codes = {r.get("codes")} | {x.get("codes") for x in r.get("decode_tok_s", []) if isinstance(x, dict)}
    rtn = sorted(c for c in codes if c and c.startswith("round to nearest"))
    return f"; its shapes, codes {rtn[0]}" if rtn else ""


def _anchor(heading: str) -> str:
    """GitHub's link target for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _span(values, fmt: str = "{:.2f}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def _load_vs_gptqmodel(r: dict) -> str:
    m = next(iter(r["models"].values()))
    b, a, a0 = (m[k]["total_s"] for k in ("b_quantprep", "a_gptqmodel", "a0_gptqmodel_cold_inductor"))
    return f"{b:.2f} s against {a:.2f} s warm, {a0:.2f} s cold: {b / a:.2f}x, {b / a0:.2f}x"


def _scale_load(r: dict) -> str:
    warm = [x["load_over_floor_with_transformers"] for x in r["sizes"].values()]
    cold = [x["cold"]["load_over_floor_with_transformers"] for x in r["sizes"].values() if isinstance(x.get("cold"), dict)]
    return f"{_span(warm)}x warm" + (f", {_span(cold)}x cold" if cold else "")


def _scale_prepack(r: dict) -> str:
    return ", ".join(f"{x['prepack_over_copy']:.2f}x ({size})" for size, x in r["sizes"].items())


def _first_load(r: dict) -> str:
    m = [v["median_s"] for v in r["rows"][0]["modes"].values()]
    return f"{m[1]:.2f} s against {m[0]:.2f} s: {m[1] / m[0]:.2f}x"


def _pull(r: dict) -> str:
    return (f"filled cache {r['filled_over_local']:.2f}x local; empty cache {r['median_s']['empty']:.2f} s against a "
            f"{r['empty_budget_s']:.2f} s budget ({'met' if r['empty_within_budget'] else 'NOT met'})")


def _serve(r: dict) -> str:
    return ", ".join(f"{x['a_over_c']:.2f} ({name})" for name, x in r["models"].items() if "a_over_c" in x)


def _quality(r: dict) -> str:
    e = r["eval"]
    return f"ppl ratio {e['ppl_ratio']:.4f}, KLD mean {e['kld']['mean']:.4f}, top-1 {100 * e['top1_agree']:.1f}%"


def _vs_cpu(cpu: dict, *others: dict) -> str:
    base = cpu.get("eval", cpu)["ppl"]
    label = lambda e: e["target"] + (f" ({e['dtype']})" if e.get("dtype") else "")  # noqa: E731
    return ", ".join(f"{label(o.get('eval', o))} {100 * (o.get('eval', o)['ppl'] / base - 1):+.3f}%" for o in others)


def _openvino_quality(cpu: dict, *others: dict) -> str:
    c = cpu["eval"]
    return "; ".join(f"{'exact (float32)' if o['eval'].get('dtype') else 'plugin defaults'}: ppl {100 * (o['eval']['ppl'] / c['ppl'] - 1):+.2f}%, "
                     f"KLD mean {100 * (o['eval']['kld']['mean'] / c['kld']['mean'] - 1):+.1f}%" for o in others)


def _openvino_speed(r: dict) -> str:
    pf, dc = r["prefill_512_s"], r["decode_tok_s"]
    return (f"decode {dc['openvino_over_quantprep']:.2f}x the cpu artifact's speed ({dc['openvino_over_gptqmodel']:.1f}x GPTQModel's), "
            f"512-token prefill {pf['openvino_over_quantprep']:.2f}x its time ({pf['openvino_over_gptqmodel']:.2f}x GPTQModel's)")


def _openvino_start(r: dict) -> str:
    m = r["median"]
    return (f"{m['sdpa-kcache']['first_token_s']:.2f} s with the kcache, {m['sdpa-nocache']['first_token_s']:.2f} s without, "
            f"{m['pa-nocache']['first_token_s']:.2f} s genai's default; cpu target {m['cpu-target']['first_token_s']:.2f} s")


def _calibration(default: dict, builtin: dict) -> str:
    def kld(r, cal, samples):
        return next(x["kld_mean"] for x in r["rows"] if (x["calibration"], x["samples"], x["desc_act"], x["group_size"]) == (cal, samples, True, 128))
    return f"KLD mean {kld(default, 'pydoc', 64):.4f} against {kld(builtin, 'builtin', 17):.4f} ({default['model']})"


def _switch_prefill(r: dict) -> str:
    p = r["smollm2_prefill512"]
    return f"{p['switch_at_512']['median_ms'] / p['kernel_only']['median_ms']:.2f}x"


def _int8_cpu(r: dict) -> str:
    rows = r["int8_modules"]
    wins = max(m for m in {x["M"] for x in rows} if all(x["kernel_over_dequant"] < 1 for x in rows if x["M"] <= m))
    at = [x["kernel_over_dequant"] for x in rows if x["M"] == r["threshold"]]
    return f"the kernel faster through M={wins} on every shape; {_span(at)} at M={r['threshold']}, where the module switches"


def _int8_cuda(r: dict) -> str:
    rows = r["int8_modules"]
    above = min(m for m in {x["M"] for x in rows} if all(x["kernel_over_dequant"] > 1 for x in rows if x["M"] >= m))
    return (f"{_span([x['kernel_over_dequant'] for x in rows], '{:.1f}')}x at M=1-512, above 1 on every shape from M={above}: "
            "cuda always dequantizes")


def _triton_512(r: dict) -> str:
    return f"{_span([x['triton_ms'] / x['dense_bf16_ms'] for x in r['timings'] if x['M'] == 512], '{:.1f}')}x (goal <= 1.2x: not met)"


def _cuda_model(r: dict) -> str:
    m = r["model"]
    return (f"decode {m['quantprep_int4_decode_tok_s'] / m['dense_bf16_decode_tok_s']:.2f}x the speed, "
            f"512-token prefill {m['quantprep_int4_prefill512_ms'] / m['dense_bf16_prefill512_ms']:.2f}x the time")


def _fusion(groups: dict, model: dict) -> str:
    spans = ", ".join(f"{g} {_span([x['speedup'] for x in groups['rows'] if x['group'] == g])}x"
                      for g in dict.fromkeys(x["group"] for x in groups["rows"]))
    m = model.get("model", model)
    fused, unfused = ((m["quantprep_int4_decode_tok_s"], m["quantprep_int4_unfused_decode_tok_s"]) if "quantprep_int4_decode_tok_s" in m
                      else (m["fused"]["decode_tok_s"], m["unfused"]["decode_tok_s"]))
    return f"separate / fused time per call: {spans}; whole-model decode {fused / unfused:.2f}x the unfused speed"


def _met(met: bool, what: str = "") -> str:
    """'; met' or '; not met' after a summary figure, naming `what` where a row has several goals."""
    return "; " + " ".join(filter(None, [what, "met" if met else "not met"]))


def _vs_llamacpp(r: dict, name: str) -> str:
    """decode after 16 and 512 tokens, prefill, first token: each / llama.cpp's, and whether the goals are met."""
    k = f"{name}_over_llamacpp"
    decode = [r["decode_tok_s"][k], r["decode_after_512_tok_s"][k]]
    return (f"{decode[0]:.2f}x and {decode[1]:.2f}x, {r['prefill_512_s'][k]:.2f}x, {r['first_token_s'][k]:.2f}x"
            + _met(min(decode) >= 1, "decode") + _met(r["first_token_s"][k] <= 1, "first token"))


def _decode(r: dict, attention: str, prompt: int, cache: str) -> float:
    """cpu_decode_attention.py's whole-model decode, tok/s, without min_new_tokens."""
    return next(x["median"] for x in r["model"]["decode_tok_s"]
                if x["attention"] == attention and x["prompt"] == prompt and x["cache"] == cache and not x["min_new_tokens"])


def _m1_speed(r: dict, model: str) -> float:
    """A plan_prefill.py run's one-row forward: dense bf16's time / the plan's."""
    m1 = r["models"][model]["forward_m1_ms"]
    return m1["dense"]["median"] / m1["plan"]["median"]


def _vs_gptqmodel_each(r: dict) -> str:
    """quantprep's prefill time and decode speed over each other runtime's in one vs_gptqmodel run, named; the
    goals against GPTQModel (the first --gptqmodel) and the fastest dense model (below AVX512-BF16 dense bf16 is
    torch's reference loop, so the floor is the faster of the two)."""
    pf, dc = r["prefill_512_s"], r["decode_tok_s"]
    others = [k for k, v in pf.items() if isinstance(v, dict) and k != "quantprep"]
    ratios = "; ".join(f"{_runtime_label(r, k)}: {pf['quantprep']['median'] / pf[k]['median']:.2f}x, "
                       f"{dc['quantprep']['median'] / dc[k]['median']:.2f}x" for k in others)
    dense = min((k for k in ("dense", "dense_float32") if k in pf), key=lambda k: pf[k]["median"])
    return (ratios + _met(pf["quantprep_over_gptqmodel"] <= 1, "prefill vs GPTQModel")
            + _met(pf["quantprep"]["median"] / pf[dense]["median"] <= 1.1, f"vs {_runtime_label(r, dense)}")
            + _met(dc["quantprep_over_gptqmodel"] >= 10, "decode >= 10x GPTQModel"))


def _each(fn):
    """One figure on several machines in one row: fn of each results file, in order; the row's
    machine and date cells list each file's too."""
    def row(*runs: dict) -> str:
        return "; ".join(fn(r) for r in runs)
    row.each = True
    return row


def _kcache(*runs: dict) -> str:
    common = [c for c in (_common_imports_ratio(r) for r in runs) if c]
    return ", ".join(f"{r['b_over_c']:.2f}" for r in runs) + (f" ({', '.join(common)} with imports equalized)" if common else "")


# (section heading, the link's text in the summary)
LOAD, SCALE, HASH, PULL, SERVE = (("Load to first token", "load"), ("Every model size on one machine", "scale"),
                                  ("Hashing before the first load", "hashing"), ("Pulling a published artifact", "pull"),
                                  ("Serving cold start", "serve"))
QUALITY, VS, TARGETS, CALIBRATION = (("Quality on real weights", "quality"), ("GPTQModel's own runtime on the same checkpoint", "vs GPTQModel"),
                                     ("Every target's perplexity on the same checkpoint", "targets"), ("Calibration", "calibration"))
OPENVINO = ("OpenVINO target", "openvino")
PLANS, LLAMACPP = ("Kernel plans", "plans"), ("llama.cpp, the CPU anchor", "llama.cpp")
CPU, CUDA, FUSION, KCACHE = (("CPU int4 and int8 at large M", "CPU large M"), ("CUDA target", "CUDA"), ("Fusion of q/k/v and gate/up", "fusion"),
                             ("Kernel cache: time to first token with compile=True", "kcache"))
# AVX512, then AVX2 (Qwen2.5-Coder-1.5B's shapes with codes rounded to nearest: benchmarks/rtn_gptq.py)
LLAMACPP_RUNS = ["vs-llamacpp-qwen2.5-coder-1.5b-cpu-avx512.json", "vs-llamacpp-qwen2.5-coder-1.5b-cpu-avx2.json"]
# (figure, goal it serves, section, result files: the first gives machine and date, result(*files))
SUMMARY = [
    ("spawn to first token, `quantprep.load` / GPTQModel's BACKEND.TORCH (Inductor cache warm, cold), real Qwen2.5-Coder-1.5B", "load in seconds",
     LOAD, ["load-cpu-avx2-qwen-coder-1.5b.json"], _load_vs_gptqmodel),
    ("the same, SmolLM2-135M", "load in seconds", LOAD, ["load-cpu.json"], _load_vs_gptqmodel),
    ("load to first token / its floor with transformers' imports, 0.5B-32B shapes", "load in seconds (<= 1.25x)", SCALE,
     ["scale-cpu-avx512.json"], _scale_load),
    ("prepack peak RSS, 0.5B-32B shapes", "every size on a small machine (<= 1.90 GiB)", SCALE, ["scale-cpu-avx512.json"],
     lambda r: f"{_span([x['prepack']['peak_rss_gib'] for x in r['sizes'].values()])} GiB"),
    ("prepack time / copying the source", "prepack at disk speed (<= 2x)", SCALE, ["scale-cpu-avx512.json"], _scale_prepack),
    ("first load of an artifact not built here (every file hashed) / sizes only", "checked bytes at little cost", HASH,
     ["hash-cost-first-load-cpu-avx512.json"], _first_load),
    ("`quantprep.load(oci://...)` to first token", "publish/pull cost (<= 1.1x local)", PULL, ["pull-cpu-avx512.json"], _pull),
    ("`quantprep serve`, spawn to first streamed token / its floor", "serving cold start (<= 1.2x)", SERVE,
     ["serve-cpu-avx2.json", "serve-smollm2-cuda-h100.json"], _each(_serve)),
    ("`transformers serve` with GPTQModel / `quantprep serve`", "serving cold start vs GPTQModel (>= 5x)", SERVE, ["serve-cpu-avx2.json"],
     lambda r: ", ".join(f"{x['b_over_a']:.2f}x ({name})" for name, x in r["models"].items() if "b_over_a" in x)),
    ("Qwen2.5-Coder-1.5B int4 g128, recipe calibration, against the float model", "quality near the float model (<= 1.05, <= 0.05)",
     QUALITY, ["eval-qwen2.5-coder-1.5b-cpu-avx512.json"], _quality),
    ("perplexity of the other targets' artifacts / the cpu artifact's, Qwen2.5-Coder-1.5B", "same quality on every target (<= 0.5%)",
     TARGETS, ["eval-qwen2.5-coder-1.5b-xpu-emulated-avx512.json", "eval-qwen2.5-coder-1.5b-cpu-avx512.json"], lambda x, c: _vs_cpu(c, x)),
    ("the same, SmolLM2-135M", "same quality on every target (<= 0.5%)", TARGETS,
     ["eval-smollm2-cuda-h100.json", "eval-smollm2-cpu-avx2.json", "eval-smollm2-xpu-emulated-avx2.json"], lambda g, c, x: _vs_cpu(c, g, x)),
    ("openvino artifact / cpu artifact of the same checkpoint, Qwen2.5-Coder-1.5B: perplexity, KLD", "same quality on every target (<= 0.5%)",
     OPENVINO, ["eval-qwen2.5-coder-1.5b-cpu-avx512-2026-11-25.json", "eval-qwen2.5-coder-1.5b-openvino-avx512.json",
                "eval-qwen2.5-coder-1.5b-openvino-exact-avx512.json"], _openvino_quality),
    ("openvino artifact (OpenVINO's CPU plugin, its defaults) beside the cpu artifact and GPTQModel (BACKEND.TORCH), one run", "the openvino target on a CPU",
     OPENVINO, ["vs-gptqmodel-openvino-qwen2.5-coder-1.5b-cpu-avx512.json"], _openvino_speed),
    ("openvino artifact, spawn to first token, Qwen2.5-Coder-1.5B", "load in seconds", OPENVINO,
     ["openvino-start-qwen2.5-coder-1.5b-cpu-avx512.json"], _openvino_start),
    ("quantprep / GPTQModel (BACKEND.TORCH) on one checkpoint: decode speed, 512-token prefill time, perplexity", "CPU decode vs GPTQModel", VS,
     ["vs-gptqmodel-qwen2.5-coder-1.5b-cpu-avx512.json"],
     lambda r: f"{r['decode_tok_s']['quantprep_over_gptqmodel']:.2f}x, {r['prefill_512_s']['quantprep_over_gptqmodel']:.2f}x, "
               f"{r['quality']['ppl']['quantprep'] / r['quality']['ppl']['gptqmodel']:.4f}"),
    ("CPU 512-token prefill with the kernel plan / GPTQModel's (BACKEND.TORCH), / the dense bf16 model's, real Qwen2.5-Coder-1.5B, two runs",
     "CPU prefill (<= 1x GPTQModel, <= 1.1x dense)", PLANS,
     ["vs-gptqmodel-dense-qwen2.5-coder-1.5b-cpu-avx512.json", "vs-gptqmodel-dense-qwen2.5-coder-1.5b-cpu-avx512-run2.json"],
     _each(lambda r: f"{r['prefill_512_s']['quantprep_over_gptqmodel']:.2f}x, {r['prefill_512_s']['quantprep_over_dense']:.2f}x"
           + (" (dense: not met)" if r['prefill_512_s']['quantprep_over_dense'] > 1.1 else ""))),
    ("the same runs: decode speed / GPTQModel's (BACKEND.TORCH), / dense bf16's", "CPU decode (>= 10x GPTQModel)", PLANS,
     ["vs-gptqmodel-dense-qwen2.5-coder-1.5b-cpu-avx512.json", "vs-gptqmodel-dense-qwen2.5-coder-1.5b-cpu-avx512-run2.json"],
     _each(lambda r: f"{r['decode_tok_s']['quantprep_over_gptqmodel']:.2f}x, {r['decode_tok_s']['quantprep_over_dense']:.2f}x")),
    ("the same on AVX2, one run: quantprep's 512-token prefill time, its decode speed / each peer's; real "
     "Qwen2.5-Coder-1.5B's shapes (codes rounded to nearest)",
     "CPU prefill (<= 1x GPTQModel, <= 1.1x dense), decode (>= 10x GPTQModel)", PLANS,
     ["vs-gptqmodel-dense-qwen2.5-coder-1.5b-cpu-avx2.json"], _vs_gptqmodel_each),
    ("GPU 512-token prefill with the kernel plan / dense bf16, Qwen2.5-1.5B shapes, CUDA graphs, mslk-cuda installed",
     "GPU prefill (<= 1.2x dense)", PLANS, ["plan-prefill-cuda-h200.json", "plan-prefill-cuda-h100.json"],
     _each(lambda r: f"{r['models']['1.5b']['prefill512_over_dense']['plan']:.2f}x (the Triton GEMM alone: "
                     f"{r['models']['1.5b']['prefill512_over_dense']['triton']:.2f}x)" + _met(r['models']['1.5b']['prefill512_over_dense']['plan'] <= 1.2))),
    ("the same, one-row forward: dense bf16's time / the plan's", "GPU decode (>= dense)", PLANS,
     ["plan-prefill-cuda-h200.json", "plan-prefill-cuda-h100.json"],
     _each(lambda r: f"{_m1_speed(r, '1.5b'):.3f}x the speed" + _met(_m1_speed(r, '1.5b') >= 1))),
    ("the same two on Qwen2.5-7B shapes: prefill / dense (the fixed rule), one-row forward's speed / dense", "GPU prefill (<= 1.2x), decode (>= 1x)",
     PLANS, ["plan-prefill-7b-cuda-h200.json", "plan-prefill-7b-cuda-h100.json"],
     _each(lambda r: f"{r['models']['7b']['prefill512_over_dense']['plan']:.2f}x ({r['models']['7b']['prefill512_over_dense']['fixed rule']:.2f}x), "
                     f"{_m1_speed(r, '7b'):.2f}x" + _met(r['models']['7b']['prefill512_over_dense']['plan'] <= 1.2, "prefill")
                     + _met(_m1_speed(r, '7b') >= 1, "decode"))),
    ("best GPU kernel per linear (mslk-cuda's bf16i4 shuffled GEMM from M=64: now the optional `mslk` path) / dense, one layer at M=512",
     "GPU prefill (<= 1.2x dense)", PLANS, ["cuda-prefill-h100.json"],
     lambda r: ", ".join(f"{x['plan_over_dense']:.2f}x ({x['model']})" for x in r["plan"]["summary"] if x["M"] == 512)),
    ("quantprep (cpu artifact, kernel plan) / llama.cpp on the recipe's Q4_K_M GGUF, real Qwen2.5-Coder-1.5B: decode speed "
     "after 16 and after 512 tokens, 512-token prefill time, spawn to first token (AVX2: its shapes, codes rounded to nearest)", "at least llama.cpp (decode >= 1x, first token <= 1x)",
     LLAMACPP, LLAMACPP_RUNS, _each(lambda r: _vs_llamacpp(r, "quantprep"))),
    *[(f"the same run, the artifact built with `--lm-head {h}` (opted into: it changes the model; its quality in the section)",
       "at least llama.cpp (decode >= 1x, first token <= 1x)", LLAMACPP, LLAMACPP_RUNS,
       _each(lambda r, k=f"quantprep_{h}_head": _vs_llamacpp(r, k))) for h in ("int8", "int4")],
    ("quantprep's native runtime (runtime/native_model.py: the cpu artifact without torch or transformers, int4_a8 at every "
     "length) / llama.cpp, one run beside it: decode speed after 16 and after 512 tokens, 512-token prefill time, spawn to first "
     "token; real Qwen2.5-Coder-1.5B's shapes on AVX2 (codes rounded to nearest), the checkpoint's bf16 head, `--lm-head int8`, "
     "`--lm-head int4`", "at least llama.cpp (decode >= 1x, first token <= 1x)", LLAMACPP,
     ["vs-llamacpp-native-qwen2.5-coder-1.5b-cpu-avx2.json"],
     lambda r: "; ".join(f"{head}: {_vs_llamacpp(r, k)}" for head, k in (("bf16 head", "native"), ("int8 head", "native_int8_head"),
                                                                        ("int4 head", "native_int4_head")))),
    ("llama.cpp, quantprep and GPTQModel's own pick (AUTO: TorchAtenLinear) in one run, each / llama.cpp: decode speed after 16 "
     "and after 512 tokens, 512-token prefill time, spawn to first token; real Qwen2.5-Coder-1.5B's shapes on AVX2 (codes rounded "
     "to nearest), the checkpoint's bf16 head: the native runtime, the torch path (`quantprep.load`), GPTQModel",
     "at least llama.cpp (decode >= 1x, first token <= 1x)", LLAMACPP, ["vs-llamacpp-gptqmodel-qwen2.5-coder-1.5b-cpu-avx2.json"],
     lambda r: "; ".join(f"{who}: {_vs_llamacpp(r, k)}" for who, k in (("native", "native"), ("torch path", "quantprep"),
                                                                      ("GPTQModel", "gptqmodel")))),
    ("prompt text to first token from the command line, fresh processes, / llama.cpp's `create_chat_completion` (each with its "
     "own chat template and tokenizer): `quantprep generate --native`, `quantprep generate`; real Qwen2.5-Coder-1.5B's shapes on "
     "AVX2 (codes rounded to nearest), the checkpoint's bf16 head", "at least llama.cpp (first token <= 1x)", LLAMACPP,
     ["first-token-cli-qwen2.5-coder-1.5b-cpu-avx2.json"],
     lambda r: "; ".join(f"{who}: {r['over_llamacpp'][k]:.2f}x{_met(r['over_llamacpp'][k] <= 1)}"
                         for who, k in (("--native", "quantprep_native"), ("torch path", "quantprep")))),
    ("one decode token's attention per layer, Qwen2.5-1.5B's heads, bf16: torch's SDPA time / quantprep's C kernel's at 48, 512 "
     "and 2048 cached tokens; the int4-head model's decode after 512 tokens with the kernel and the growing KV cache / with SDPA "
     "and transformers' concatenating cache", "CPU decode speed",
     ("CPU decode attention", "attention"), ["cpu-decode-attention-avx512.json"],
     lambda r: ", ".join(f"{x['sdpa_bf16_over_quantprep']:.1f}x" for x in r["rows"] if x["context"] <= 2048) + "; "
               + f"{_decode(r, 'quantprep_cpu', 512, 'growing') / _decode(r, 'sdpa', 512, 'concatenating'):.2f}x the speed"),
    ("decode with RMSNorm, the SiLU product, the attention's rotary embedding and the float lm_head in quantprep's C / with "
     "transformers' and torch's modules, real Qwen2.5-Coder-1.5B (AVX2: its shapes, codes rounded to nearest): the cpu artifact, "
     "(AVX2 only: the `--lm-head int8` one,) the `--lm-head int4` one", "CPU decode speed",
     ("CPU decode layers", "layers"), ["cpu-layers-avx512.json", "cpu-layers-avx2.json"],
     _each(lambda r: ", ".join(f"{x['c_over_torch']:.2f}x" for x in r["decode_tok_s"]))),
    ("decode with each decoder layer one C call (decode_layer, where the plan runs int4_a8) / the same C module by module, "
     "real Qwen2.5-Coder-1.5B's shapes on AVX2 (codes rounded to nearest): the cpu artifact, the `--lm-head int8` one, the "
     "`--lm-head int4` one", "CPU decode speed", ("CPU decode layers", "layers"), ["cpu-layers-avx2.json"],
     lambda r: ", ".join(f"{x['c_over_c_modules']:.2f}x" for x in r["decode_tok_s"])),
    ("decode with AVX2's int4_a8 and int8_a8 prefetching their weight / the same kernels built without it (-DA8_AHEAD=0), "
     "the same artifacts", "CPU decode speed", ("CPU decode layers", "layers"), ["cpu-layers-avx2.json"],
     lambda r: ", ".join(_or_dash(x.get("c_over_c_no_prefetch"), "{:.2f}x") for x in r["decode_tok_s"])),
    ("int4_a8 (int8 activations; AVX512-VNNI here) / the int4 kernel, every module forced: decode speed; KL to the float model, each",
     "CPU decode speed at the same quality", LLAMACPP, ["cpu-int4-a8-qwen2.5-coder-1.5b-avx512.json"],
     lambda r: f"{r['decode_tok_s']['int4_a8']['median'] / r['decode_tok_s']['int4']['median']:.2f}x; "
               f"{r['accuracy']['int4_a8']['kld_mean']:.4f} vs {r['accuracy']['int4']['kld_mean']:.4f}"),
    ("recipe calibration (64 x 256 tokens of Python's reference) / the 17 built-in texts", "quality near the float model", CALIBRATION,
     ["calibration-qwen2.5-coder-0.5b-cpu-avx512.json", "calibration-qwen2.5-coder-0.5b-overlapping-text-cpu-avx512.json"], _calibration),
    ("SmolLM2 512-token prefill time, int4 switch to dequantize + dense at 384 rows / the kernel only", "CPU prefill speed", CPU,
     ["cpu-prefill.json", "cpu-prefill-avx2.json", "cpu-prefill-avx512-epyc.json"], _each(_switch_prefill)),
    ("int8 kernel / dequantize + dense, per module", "CPU int8 speed", CPU, ["int8-switch-cpu-avx512-xeon16.json"], _int8_cpu),
    ("the same on cuda", "GPU int8 speed", CPU, ["int8-switch-cuda-h100.json"], _int8_cuda),
    ("Triton prefill GEMM / dense bf16, per linear at M=512", "GPU prefill near dense", CUDA, ["cuda-h200.json"], _triton_512),
    ("whole model, quantprep int4 / dense bf16, Qwen2.5-1.5B shapes", "GPU speed near dense", CUDA, ["cuda-h200-model-fused.json"], _cuda_model),
    ("fused q/k/v and gate/up against separate matmuls", "GPU speed near dense", FUSION, ["fusion-cuda-h200.json", "cuda-h200-model-fused.json"], _fusion),
    ("the same on the CPU", "CPU decode speed", FUSION, ["fusion-cpu.json", "fusion-cpu-smollm2.json"], _fusion),
    ("spawn to first token, compile=True with the kcache / eager (the second: after the trust change)",
     "compile without a start-up cost (<= 1.2x)", KCACHE, ["kcache-cpu-smollm2-aot.json", "kcache-cpu-smollm2-trust.json"], _each(_kcache)),
    ("the same on cuda, three runs", "compile without a start-up cost (<= 1.2x)", KCACHE,
     ["kcache-cuda-h100-prefetch.json", "kcache-cuda-h100-prefetch-run2.json", "kcache-cuda-h100-prefetch-run3.json"], _kcache),
]


def _cells(values: list[str]) -> str:
    """One value per results file, in the row's order; once where they are all the same."""
    return values[0] if len(set(values)) == 1 else "; ".join(values)


def summary(*runs: dict) -> str:
    """Every headline figure in one table: what, the result, the goal it serves, machine, date, and its section."""
    by_file = {r["_file"]: r for r in runs}
    missing = sorted({f for *_, files, _ in SUMMARY for f in files} - set(by_file))
    if missing:
        raise SystemExit(f"BENCHMARKS.md: the summary table's block must name {', '.join('results/' + f for f in missing)}")
    out = ["| figure | result | goal | machine | date | section |", "| --- | --- | --- | --- | --- | --- |"]
    for figure, goal, section, files, result in SUMMARY:
        data = [by_file[f] for f in files]
        where = data if getattr(result, "each", False) else data[:1]
        machines, dates = ([f(r) for r in where] for f in (_where, lambda r: r.get("date", "")[:10] or "not in the JSON"))
        out.append(f"| {figure} | {result(*data)} | {goal} | {_cells(machines)} | {_cells(dates)} | [{section[1]}](#{_anchor(section[0])}) |")
    return "\n".join(out)


RENDERERS = {
    "summary": summary,
    "cuda-gather": cuda_gather,
    "cuda-linears": cuda_linears,
    "load-to-first-token": load_to_first_token,
    "fusion-groups": fusion_groups,
    "cpu-int4-switch": lambda r: cpu_switch(r, "modules"),
    "cpu-int8-switch": lambda r: cpu_switch(r, "int8_modules"),
    "kcache-runs": kcache_runs,
    "cuda-model": cuda_model,
    "fusion-cpu-model": fusion_cpu_model,
    "pull": pull_times,
    "calibration": calibration,
    "eval": eval_results,
    "serve": serve_cold_start,
    "vs-gptqmodel": vs_gptqmodel,
    "vs-gptqmodel-openvino": vs_gptqmodel_openvino,
    "openvino-start": openvino_start,
    "vs-gptqmodel-dense": vs_gptqmodel_dense,
    "vs-llamacpp": vs_llamacpp,
    "first-token-cli": first_token_cli,
    "cpu-dense-tiles": cpu_dense_tiles,
    "cpu-decode-profile": cpu_decode_profile,
    "cpu-int4-a8": cpu_int4_a8,
    "cpu-decode-attention": cpu_decode_attention,
    "cpu-layers": cpu_layers,
    "plan-prefill": plan_prefill,
    "cuda-prefill": cuda_prefill,
    "cuda-dequant": cuda_dequant,
    "cuda-dequant-tiles": cuda_dequant_tiles,
    "cuda-overlap": cuda_overlap,
    "target-ppl": target_ppl,
    "scale": scale,
    "first-load-hash": first_load_hash,
}


def render(doc: str) -> str:
    def block(m: re.Match) -> str:
        kind, rels = m.group(2), m.group(3).split()
        if kind not in RENDERERS:
            raise SystemExit(f"BENCHMARKS.md: unknown table kind {kind!r} (known: {', '.join(RENDERERS)})")
        data = [json.loads((ROOT / rel).read_text()) | {"_file": Path(rel).name} for rel in rels]
        return m.group(1) + RENDERERS[kind](*data) + "\n" + m.group(5)
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
