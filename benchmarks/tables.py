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
                ("c_floor", "(c) floor: python + torch + read the artifact's bytes + dense forward (bf16; float32 below AVX512 since 2026-11-23)"),
                ("ct_floor_with_transformers", "(ct) floor + importing transformers' modeling code")]
    out = [f"{r['machine']}, {r['date']}, Python {r['python']}; median of {len(models[names[0]]['b_quantprep']['runs'])} fresh "
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


KCACHE_MODES = {
    "a_compile_no_cache": "(a) compile, no cache",
    "b_compile_kcache": "(b) compile + kcache",
    "b_pre": "(b, pre-import)",
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


def cpu_kernel_dtypes(r: dict) -> str:
    """int4 cpu kernel by activation dtype against dense bf16 (benchmarks/cpu_kernel_dtypes.py)."""
    def t(us: float) -> str:
        return f"{us:.0f} us" if us < 1000 else f"{us / 1e3:.1f} ms"
    out = [f"{_machine(r)}, torch {r['torch']}; median of {r['calls']} calls, group {r['group_size']}", "",
           "| K x N, M | float32 | bfloat16 | float16 | dense bf16 matmul | dense fp32 matmul | bf16 int4 / fastest dense |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    out += [f"| {x['K']} x {x['N']}, M={x['M']} | {t(x['us']['float32'])} | {t(x['us']['bfloat16'])} | {t(x['us']['float16'])} "
            f"| {t(x['us']['dense_bfloat16'])} | {t(x['us']['dense_float32'])} "
            f"| {x['us']['bfloat16'] / min(x['us']['dense_bfloat16'], x['us']['dense_float32']):.2f} |" for x in r["rows"]]
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


def bucketing(r: dict) -> str:
    """Prefill padded to its bucket against unpadded, per prompt length (benchmarks/bucketing.py)."""
    sets = list(r["bucket_sets"])
    cell = {(x["length"], x["buckets"]): x for x in r["rows"]}
    lengths = sorted({x["length"] for x in r["rows"]})
    out = [f"{_machine(r)}, torch {r['torch']}, {r['artifact']} ({r['act_dtype']}); median of {r['rounds']} interleaved rounds", "",
           "| prompt | unpadded | " + " | ".join(sets) + " |", "| --- | --- |" + " --- |" * len(sets)]
    for n in lengths:
        out.append(f"| {n} | {cell[n, sets[0]]['unpadded_ms']:.0f} ms | " + " | ".join(
            f"-> {cell[n, b]['padded_to']}: {cell[n, b]['overhead'] * 100:+.1f}%" for b in sets) + " |")
    med = r["median_prompt"]
    out.append("| median over lengths | | " + " | ".join(
        f"{statistics.median(cell[n, b]['overhead'] for n in lengths) * 100:+.1f}%" for b in sets) + " |")
    out += ["", f"The median prompt of these lengths is {med:g} tokens."]
    return "\n".join(out)


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
    out += ["", "int4, sym; quantprep eval of the cpu artifact against the float model, ctx 512, the first scored tokens of "
            "the held-out text", "",
            "| model | calibration | samples | act-order | group | ppl (float) | ppl ratio | KLD mean | KLD p99 | top-1 | scored tokens | build |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        for x in r["rows"]:
            cal = ("builtin texts" if x["calibration"] == "builtin"
                   else f"Python reference {r['calibration_text_sha256'][:8]}, {x['seq_len']}-token windows")
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
                out.append(f"| {r['machine']} ({r['cpu_capability']}), torch {r['torch']}, transformers {r['transformers']}, {r['date'][:10]} "
                           f"| {name} ({row['device']}) | {label} | {ready} | {x['first_token_s']:.2f} s | {goal} |")
            for key, error in row.get("errors", {}).items():
                reason = error.split('"error": "')[-1].split('"')[0] if '"error"' in error else error[-160:]
                out.append(f"| | {name} ({row['device']}) | {labels[key]} | | failed | {reason} |")
    return "\n".join(out)


def vs_gptqmodel(*runs: dict) -> str:
    """GPTQModel's CPU kernel against quantprep's artifact of the same checkpoint (benchmarks/vs_gptqmodel.py)."""
    out = ["| model, machine, date | | GPTQModel (TORCH backend) | quantprep (cpu artifact) | quantprep / GPTQModel |", "| --- | --- | --- | --- | --- |"]
    for r in runs:
        q, head = r["quality"], f"{r['model']}, {r['machine']} ({r['cpu_capability']}), {r['date'][:10]}"
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


def target_ppl(*runs: dict) -> str:
    """The same checkpoint's perplexity per target, against its dequantized model (quantprep eval --json files)."""
    out = ["| target (device) | ppl | reference ppl (kind) | ratio | KLD mean | top-1 | scored tokens | vs the cpu artifact |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    runs = [r.get("eval", r) for r in runs]  # a quantprep eval --json file, or a results file holding one
    cpu = next((r["ppl"] for r in runs if r["target"] == "cpu"), None)
    for r in runs:
        vs = f"{100 * (r['ppl'] / cpu - 1):+.3f}%" if cpu else ""
        out.append(f"| {r['target']} ({r['device']}) | {r['ppl']:.4f} | {r['reference']['ppl']:.4f} ({r['reference']['kind']}) | {r['ppl_ratio']:.5f} | "
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


def prepack_env(r: dict) -> str:
    """Prepack with an environment variable one way and the other, alternating, fresh processes
    (benchmarks/prepack_env.py; the THP file predates "var"/"values" and named its ratio off_over_on)."""
    var, (a, b) = r.get("var", "THP_MEM_ALLOC_ENABLE"), r.get("values", ["0", "1"])
    out = [f"{r['machine']} ({r['cpu_capability']}), torch {r['torch']}, THP mode `{r['thp_mode']}`, {r['date'][:10]}; "
           "`quantprep prepack --target cpu`, page cache dropped before each run", "",
           f"| size | source | {var}={a}: median (runs) | {var}={b}: median (runs) | {a} / {b} | peak RSS {a} / {b} (max) |",
           "| --- | --- | --- | --- | --- | --- |"]
    for size, x in r["sizes"].items():
        ra, rb = x["runs"][a], x["runs"][b]
        a_runs, b_runs = (", ".join(f"{v['s']:.1f}" for v in rows) for rows in (ra, rb))
        out.append(f"| {size} | {x['source_bytes'] / 2**30:.2f} GiB | {x['median_s'][a]:.1f} s ({a_runs}) "
                   f"| {x['median_s'][b]:.1f} s ({b_runs}) | {x.get('ratio', x.get('off_over_on')):.2f} "
                   f"| {max(v['peak_rss_gib'] for v in ra):.2f} / {max(v['peak_rss_gib'] for v in rb):.2f} GiB |")
    return "\n".join(out)


def cpu_pack(r: dict) -> str:
    """The cpu target's int4 packing, tensor ops against the compiled packer, per layer (benchmarks/cpu_pack.py)."""
    out = [f"{_machine(r)}, torch {r['torch']} ({r['torch_threads']} threads; the compiled packer: 1); "
           "act-order, medians", "", "| size | layer (K x N) | GPTQ qweight | tensor ops | compiled packer | ratio |",
           "| --- | --- | --- | --- | --- | --- |"]
    for x in r["rows"]:
        out.append(f"| {x['size']} | {x['layer']} ({x['K']} x {x['N']}) | {x['qweight_mb']:.1f} MB | {x['tensor_ops_ms']:.1f} ms "
                   f"| {x['native_ms']:.1f} ms | {x['tensor_ops_over_native']:.2f}x |")
    return "\n".join(out)


GEMM_SHAPES = ("q_proj", "qkv_fused", "gate_up_fused", "down_proj")


def gemm_designs(*runs: dict) -> str:
    """Best Triton design per shape at M=512 against dense bf16, over sweeps (benchmarks/cuda_gemm_variants.py)."""
    out = [f"{runs[0]['device']}, torch {runs[0]['torch']}, Triton {runs[0]['triton']}, {runs[0]['date']}; M=512; "
           "each ratio against the same run's dense bf16 (`do_bench`; in a CUDA graph: against dense in a graph)", "",
           "| shape (K->N) | dense | best Triton (run, design, config) | best in a CUDA graph | dequantize + cuBLAS |",
           "| --- | --- | --- | --- | --- |"]
    for shape in GEMM_SHAPES:
        best = graph = deq = None
        dense = []
        for i, r in enumerate(runs, 1):
            rows = [x for x in r["rows"] if x["shape"] == shape and x["M"] == 512]
            d = {x["variant"]: x["ms"] for x in rows if x["variant"] in ("dense", "dense_graph")}
            dense.append(d["dense"])
            for x in rows:
                if x["variant"].startswith("v"):
                    cand = (x["ms"] / d["dense"], i, x["variant"], x["config"])
                    best = min(best or cand, cand)
                    if "graph_ms" in x:
                        g = (x["graph_ms"] / d["dense_graph"], i, x["variant"], x["config"])
                        graph = min(graph or g, g)
                elif x["variant"] == "deq":
                    dq = (x["ms"] / d["dense"], i)
                    deq = min(deq or dq, dq)
        k, n = next((x["K"], x["N"]) for x in runs[0]["rows"] if x["shape"] == shape)

        def cell(c):
            return "-" if c is None else f"{c[0]:.2f}x (run {c[1]}" + (f", {c[2]}, {'x'.join(map(str, c[3]))})" if len(c) > 2 else ")")
        out.append(f"| {shape} {k}->{n} | {' / '.join(f'{x * 1e3:.1f}' for x in dense)} us | {cell(best)} | {cell(graph)} | {cell(deq)} |")
    out += ["", "Config: BLOCK_M x BLOCK_N x BLOCK_K x warps x stages x split-K."]
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


RENDERERS = {
    "cuda-linears": cuda_linears,
    "load-to-first-token": load_to_first_token,
    "fusion-groups": fusion_groups,
    "cpu-int4-switch": lambda r: cpu_switch(r, "modules"),
    "cpu-int8-switch": lambda r: cpu_switch(r, "int8_modules"),
    "gemm-variants": gemm_variants,
    "gemm-designs": gemm_designs,
    "kcache-runs": kcache_runs,
    "cpu-kernel-dtypes": cpu_kernel_dtypes,
    "cuda-model": cuda_model,
    "fusion-cpu-model": fusion_cpu_model,
    "bucketing": bucketing,
    "pull": pull_times,
    "calibration": calibration,
    "eval": eval_results,
    "serve": serve_cold_start,
    "vs-gptqmodel": vs_gptqmodel,
    "target-ppl": target_ppl,
    "scale": scale,
    "prepack-env": prepack_env,
    "cpu-pack": cpu_pack,
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
