"""Load-to-first-token, fresh processes, side by side (issue: core).

For each model, each in a new Python process, medians of --runs runs:
  (a) GPTQModel.load (backend TORCH) + 1 generated token
  (b) quantprep.load of the artifact + 1 generated token
  (a0) the same with an empty Inductor cache (GPTQModel's TORCH kernels go through
      torch.compile, which caches compiled code on disk between processes: (a) is a warm start)
  (c) floor: python + import torch + every byte of the artifact read through safetensors
      (mmap, each page touched) + one forward of a dense bf16 model of the same shapes (pure
      torch, weights reused across layers so the floor pays no allocation)
  (ct) the floor plus importing transformers' modeling code for this model: the part of (b)
      that is transformers' own start-up, which quantprep cannot avoid while it returns a
      transformers model
Times run from process spawn (time.time() in the parent) to the first token in the child.
Models: the real SmolLM2 build (artifacts/.cache, made by `make build`), a Qwen2.5-1.5B-shaped
GPTQ checkpoint with random codes (written once under artifacts/.cache/bench; also reports its
prepack time, median of 3, in-process) and `qwen-coder-1.5b`, the real Qwen2.5-Coder-1.5B build
(`make real`: artifacts/qwen2.5-coder-1.5b/cpu and the GPTQ checkpoint it was built from).
`--plot FILE.png` draws the phases (imports, load, first token) per loader as stacked bars.

    python benchmarks/load.py [--runs 3] [--models smollm2,qwen1.5b,qwen-coder-1.5b] [--out benchmarks/results.json]
    python benchmarks/load.py --plot benchmarks/results/load.png benchmarks/results/load-cpu-avx2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from common import QWEN_1_5B, REPO, RESULTS, child_env, machine, median_and_runs, run_child, save

BENCH_CACHE = REPO / "artifacts" / ".cache" / "bench"

CHILD_GPTQMODEL = """
import time, sys, json, torch
t0 = time.time()
from gptqmodel import BACKEND, GPTQModel
t1 = time.time()
m = GPTQModel.load(sys.argv[1], backend=BACKEND.TORCH, device="cpu")
t2 = time.time()
ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
print(json.dumps({"import": t1, "load": t2, "first": time.time()}))
"""

CHILD_QUANTPREP = """
import time, sys, json, torch
t0 = time.time()
import quantprep
t1 = time.time()
m = quantprep.load(sys.argv[1])
t2 = time.time()
ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
print(json.dumps({"import": t1, "load": t2, "first": time.time()}))
"""

CHILD_FLOOR = """
import time, sys, json
import torch
art = sys.argv[1]
if len(sys.argv) > 2:
    from transformers import AutoConfig, AutoModelForCausalLM
    AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(art))]  # imports the modeling code
t1 = time.time()
from safetensors.torch import load_file
manifest = json.load(open(art + "/manifest.json"))
tensors = {}
for shard in manifest["shards"]:
    tensors.update(load_file(art + "/" + shard))
touched = sum(int(t.view(-1).view(torch.uint8)[::4096].sum()) for t in tensors.values())  # fault in every page
t2 = time.time()
c = json.load(open(art + "/config.json"))
h, i, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
kv = c["num_key_value_heads"] * c.get("head_dim", h // c["num_attention_heads"])
# bf16 as the artifact's matmuls run, except where the CPU has no fast bf16 GEMM (below AVX512, 100x
# slower): quantprep's cpu kernels then run their dense matmuls in float32, and so does the floor
dt = torch.bfloat16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else torch.float32
w = {n: torch.empty(k, o, dtype=dt) for n, (k, o) in
     {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h), "g": (h, i), "u": (h, i), "d": (i, h)}.items()}
emb = tensors["model.embed_tokens.weight"]
with torch.no_grad():
    x = emb[torch.arange(8)].to(dt)
    for _ in range(L):
        a = x @ w["q"]; x @ w["k"]; x @ w["v"]; x = x + a @ w["o"]
        x = x + (torch.nn.functional.silu(x @ w["g"]) * (x @ w["u"])) @ w["d"]
    (x[-1:] @ emb.T.to(dt)).argmax()
print(json.dumps({"import": t1, "load": t2, "first": time.time()}))
"""


def fresh_process(code: str, args: list[str], cold_inductor: bool = False) -> dict:
    env = child_env(GPTQMODEL_CPU_WORKERS=os.environ.get("GPTQMODEL_CPU_WORKERS", "2"))
    if cold_inductor:
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    try:
        start, t = run_child(code, args, env)
    finally:
        if cold_inductor:
            shutil.rmtree(env["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    return {"import_s": t["import"] - start, "load_s": t["load"] - t["import"], "first_s": t["first"] - t["load"],
            "total_s": t["first"] - start}


def median_runs(code: str, args: list[str], runs: int, cold_inductor: bool = False) -> dict:
    return medians([fresh_process(code, args, cold_inductor) for _ in range(runs)])


def medians(rows: list[dict]) -> dict:
    """fresh_process rows -> the median of each phase, and every run's total."""
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {"runs": [r["total_s"] for r in rows]}


def built_paths(recipe: str, make: str) -> tuple[Path, Path]:
    """(the GPTQ checkpoint, the cpu artifact built from it) of a recipe built here."""
    art = REPO / "artifacts" / recipe / "cpu"
    if not (art / "manifest.json").is_file():
        sys.exit(f"run `{make}` first: it builds artifacts/{recipe}/cpu")
    from quantprep.build.pipeline import cached_checkpoint

    gptq = cached_checkpoint(json.loads((art / "manifest.json").read_text())["source"]["sha256"])
    if gptq is None:
        sys.exit(f"the GPTQ checkpoint {art} was built from is not in the build cache: run `{make}` again")
    return gptq, art


def smollm2_paths() -> tuple[Path, Path]:
    return built_paths("smollm2-135m", "make build")


def qwen_paths() -> tuple[Path, Path, list[float]]:
    from quantprep.build.pipeline import prepack
    from quantprep.build.synthetic import write_random_checkpoint

    gptq = BENCH_CACHE / "qwen2.5-1.5b-random-gptq"
    if not (gptq / "quantize_config.json").is_file():
        print("writing a Qwen2.5-1.5B-shaped random GPTQ checkpoint (once)...", file=sys.stderr)
        tmp = gptq.with_name(gptq.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        write_random_checkpoint(tmp, QWEN_1_5B, bits=4, group_size=128, desc_act=True, sym=True)
        smol_gptq, _ = smollm2_paths()  # a tokenizer, so GPTQModel.load finds one
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(smol_gptq / f, tmp / f)
        tmp.rename(gptq)
    art = BENCH_CACHE / "qwen2.5-1.5b-artifact"
    prepack_s = []
    for _ in range(3):
        prepack_s.append(prepack(gptq, "cpu", art)["prepack_s"])
    return gptq, art, prepack_s


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--models", default="smollm2,qwen1.5b")
    p.add_argument("--out", default=str(RESULTS / "load-cpu.json"))
    p.add_argument("--variants", help="comma-separated subset of a_gptqmodel,a0_gptqmodel_cold_inductor,b_quantprep,c_floor,"
                                      "ct_floor_with_transformers (default: all)")
    p.add_argument("--plot", help="draw FILE.png from the result files given as arguments, then stop")
    p.add_argument("results", nargs="*")
    args = p.parse_args()
    if args.plot:
        return plot([json.loads(Path(f).read_text()) for f in args.results], args.plot)
    results = machine() | {"python": platform.python_version(), "models": {}}
    for model in args.models.split(","):
        extra = {}
        if model == "smollm2":
            gptq, art = smollm2_paths()
        elif model == "qwen-coder-1.5b":
            gptq, art = built_paths("qwen2.5-coder-1.5b", "make real")
        else:
            gptq, art, prepack = qwen_paths()
            extra["prepack_s"] = median_and_runs(prepack)
        row = {"artifact_mib": sum(f.stat().st_size for f in art.iterdir()) / 2**20, **extra}
        variants = {"a_gptqmodel": (CHILD_GPTQMODEL, [str(gptq)], False),
                    "a0_gptqmodel_cold_inductor": (CHILD_GPTQMODEL, [str(gptq)], True),
                    "b_quantprep": (CHILD_QUANTPREP, [str(art)], False),
                    "c_floor": (CHILD_FLOOR, [str(art)], False),
                    "ct_floor_with_transformers": (CHILD_FLOOR, [str(art), "transformers"], False)}
        if args.variants:
            variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
        for name, (code, child_args, cold) in variants.items():
            print(f"{model}: {name} x{args.runs}...", file=sys.stderr, flush=True)
            row[name] = median_runs(code, child_args, args.runs, cold)
        b = row["b_quantprep"]["total_s"]
        for ratio, other in (("b_over_a", "a_gptqmodel"), ("b_over_a0", "a0_gptqmodel_cold_inductor"), ("b_over_c", "c_floor"),
                             ("b_over_ct", "ct_floor_with_transformers")):
            if other in row:
                row[ratio] = b / row[other]["total_s"]
        results["models"][model] = row
        print(json.dumps({model: row}, indent=2), flush=True)
    save(results, args.out)


PHASES = [("import_s", "imports"), ("load_s", "load"), ("first_s", "first token")]
LOADERS = [("a_gptqmodel", "GPTQModel"), ("a0_gptqmodel_cold_inductor", "GPTQModel,\nempty Inductor cache"),
           ("b_quantprep", "quantprep"), ("c_floor", "floor")]


def plot(results: list[dict], out: str) -> None:
    """One panel per model of the first file: per loader, the median phases stacked (spawn to
    first token), the median total on top. A loader measured in several files is taken from the last."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models: dict[str, dict] = {name: {} for name in results[0]["models"]}  # the first file's models
    for r in results:
        for name, row in r["models"].items():
            if name in models:
                models[name].update({k: v for k, v in row.items() if k in dict(LOADERS)})
    fig, axes = plt.subplots(1, len(models), figsize=(max(5.0, 4.2 * len(models)), 4.2), sharey=True, squeeze=False)
    for ax, (name, row) in zip(axes[0], models.items(), strict=True):
        loaders = [(k, label) for k, label in LOADERS if k in row]
        bottom = [0.0] * len(loaders)
        for (phase, label), color in zip(PHASES, ("#9aa5b1", "#4c78a8", "#f58518"), strict=True):
            vals = [row[k][phase] for k, _ in loaders]
            ax.bar(range(len(loaders)), vals, bottom=bottom, color=color, label=label)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        for i, (k, _) in enumerate(loaders):
            ax.text(i, bottom[i], f"{row[k]['total_s']:.1f} s", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(loaders)), [label for _, label in loaders], fontsize=8)
        ax.set_title(name, fontsize=9)
    axes[0][0].set_ylabel("seconds from process spawn (medians)")
    axes[0][0].legend(fontsize=8)
    r = results[-1]
    fig.suptitle(f"Load to first token, CPU ({r['cpu_capability']}), fresh processes\n{r['machine']}, {r['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")

if __name__ == "__main__":
    main()
