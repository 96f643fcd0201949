"""What calibration buys: perplexity ratio and KL divergence against the float model (quantprep
eval) for calibration samples 17 / 64 / 256, act-order on and off, group 128 and 32.

Each configuration is a fresh `quantprep build` (gptqmodel on the CPU, a temporary recipe with the
model recipe's source and these quantize settings) and a fresh `quantprep eval` of the cpu
artifact against the float model the build dequantized from the GGUF. The calibration text for
64 and 256 samples is Python's language reference after the part quantprep's held-out text uses
(pydoc_data topics 27 on; disjoint from it), cut into windows of SEQ_LEN tokens; "builtin" is
quantprep's 17 paragraphs (the recipes' default so far).

    python benchmarks/calibration.py --recipe smollm2-135m [--max-tokens 8192] [--out results/calibration-smollm2.json]
    python benchmarks/calibration.py --plot benchmarks/results/calibration.png results/calibration-*.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, cpu_name, machine, save, timed

SEQ_LEN = 256
# (calibration, samples, desc_act, group_size): samples at act-order g128, then act-order off and g32 at each.
CONFIGS = [(cal, n, act, g) for g in (128, 32) for act in (True, False) for cal, n in
           (("builtin", 17), ("pydoc", 17), ("pydoc", 64), ("pydoc", 256)) if (g, act) == (128, True) or cal == "pydoc"]


def calibration_file(dest: Path) -> Path:
    """Python's language reference from pydoc_data: the topics quantprep/heldout.txt does not hold,
    less every paragraph of more than 80 characters that it holds (topics repeat each other: the
    "compound" topic holds "if", "for", "def"...; 99 such paragraphs were left in at first)."""
    import pydoc_data.topics as t

    held = (REPO / "quantprep" / "tools" / "heldout.txt").read_text()
    topics = [re.sub(r"\n{3,}", "\n\n", t.topics[k].strip()) for k in sorted(t.topics)]
    rest = [x for x in topics if x not in held]
    paragraphs = [p for x in rest for p in x.split("\n\n") if not (len(p) > 80 and p in held)]
    dest.write_text("\n\n".join(paragraphs) + "\n")
    return dest


def toml_value(v) -> str:
    return json.dumps(v) if not isinstance(v, bool) else str(v).lower()


def run_config(recipe, cal: str, samples: int, desc_act: bool, group: int, calib_txt: Path, work: Path, max_tokens: int) -> dict:
    name = f"{recipe.name}-{cal}{samples}-{'act' if desc_act else 'noact'}-g{group}"
    toml = work / f"{name}.toml"
    src = "\n".join(f"{k} = {toml_value(v)}" for k, v in recipe.source.items())
    quant = {"bits": 4, "group_size": group, "desc_act": desc_act, "sym": True, "samples": samples,
             "calibration": "builtin" if cal == "builtin" else str(calib_txt), **({} if cal == "builtin" else {"seq_len": SEQ_LEN})}
    toml.write_text(f'name = "{name}"\n[source]\n{src}\n[quantize]\n' + "\n".join(f"{k} = {toml_value(v)}" for k, v in quant.items())
                    + '\n[build]\ntargets = ["cpu"]\n')
    qp = [sys.executable, "-m", "quantprep"]
    build_s = timed(lambda: subprocess.run(qp + ["build", str(toml), "--out", str(work / name), "--no-warm", "--no-check"], check=True,
                                           stdout=subprocess.DEVNULL))
    out = subprocess.run(qp + ["eval", str(work / name / "cpu"), "--json", "--no-store", "--max-tokens", str(max_tokens)],
                         check=True, capture_output=True, text=True)
    r = json.loads(out.stdout)
    gptq = json.loads((work / name / "cpu" / "manifest.json").read_text())["source"]
    row = {"calibration": cal, "samples": samples, "seq_len": None if cal == "builtin" else SEQ_LEN, "desc_act": desc_act,
           "group_size": group, "ppl": r["ppl"], "ref_ppl": r["reference"]["ppl"], "ppl_ratio": r["ppl_ratio"],
           "kld_mean": r["kld"]["mean"], "kld_p99": r["kld"]["p99"], "top1_agree": r["top1_agree"], "tokens": r["tokens"],
           "build_s": round(build_s, 1), "quantized_on": gptq.get("quantized_on"), "reference": r["reference"]["kind"]}
    print(json.dumps(row), flush=True)
    return row


def plot(files: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(f.read_text()) for f in files]
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        for act, g, style, color in ((True, 128, "o-", "C0"), (False, 128, "s--", "C1"), (True, 32, "^-", "C2"), (False, 32, "v--", "C3")):
            pts = sorted((x["samples"], x["kld_mean"]) for x in r["rows"]
                         if x["calibration"] == "pydoc" and x["desc_act"] == act and x["group_size"] == g)
            if pts:
                ax.plot(*zip(*pts, strict=True), style, color=color, label=f"act-order {'on' if act else 'off'}, group {g}")
        for x in r["rows"]:
            if x["calibration"] == "builtin":
                ax.plot([x["samples"]], [x["kld_mean"]], "k*", markersize=11, label="builtin texts (17), act-order, g128")
        ax.set_ylim(bottom=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks([17, 64, 256], ["17", "64", "256"])
        ax.set_xlabel(f"calibration samples ({r['seq_len']} tokens each, Python reference text)")
        ax.set_ylabel("mean KL divergence vs the float model")
        ax.set_title(f"{r['model']} int4, {r['eval_tokens']} held-out tokens, text {r['calibration_text_sha256'][:8]}\n"
                     f"{r['date'][:10]}, {r['machine']}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"GPTQ calibration (gptqmodel {results[0]['gptqmodel']} on the CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--only", help="comma-separated config indexes to run (default: all)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path, help="make the PNG from the JSON files given as arguments")
    ap.add_argument("files", nargs="*", type=Path)
    args = ap.parse_args()
    if args.plot:
        return plot(args.files, args.plot)
    import importlib.metadata

    from quantprep.build.recipes import find_recipe

    recipe = find_recipe(args.recipe)
    configs = [c for i, c in enumerate(CONFIGS) if not args.only or str(i) in args.only.split(",")]
    # The quantprep cache keeps the float model between configs; every GPTQ checkpoint is new.
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    with tempfile.TemporaryDirectory(prefix="quantprep-calib-") as tmp:
        work = Path(tmp)
        calib = calibration_file(work / "calibration-pydoc.txt")
        rows = [run_config(recipe, *c, calib, work, args.max_tokens) for c in configs]
        info = machine()  # machine: "CPU (N cores, ISA)", as the calibration table prints it
        result = info | {"machine": f"{cpu_name()} ({info['cores']} cores, {info['cpu_capability']})", "model": recipe.name,
                         "gptqmodel": importlib.metadata.version("gptqmodel"), "seq_len": SEQ_LEN, "eval_tokens": rows[0]["tokens"],
                         "calibration_text_sha256": hashlib.sha256(calib.read_bytes()).hexdigest(), "rows": rows}
    save(result, args.out)


if __name__ == "__main__":
    main()
