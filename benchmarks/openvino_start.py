"""Start -> first token of an openvino artifact on this CPU, fresh processes (issue 31, item 5).

Each run is a new Python process; `first_token_s` runs from the spawn (time.time() in the parent)
to the first generated token (a greedy 1-token generate of the recipe's prompt, chat template
applied), and the child splits it into imports, pipeline construction (read + compile) and the
first generate (where OpenVINO's CPU plugin prepares the weights). Interleaved rounds, medians of --runs:
  pa-nocache        openvino_genai.LLMPipeline(DIR, "CPU") as genai defaults it: PagedAttention, no cache
  pa-cache          the same with CACHE_DIR warmed by one such run before the rounds
  sdpa-nocache      quantprep.load(DIR, kcache=False): the stateful pipeline (ATTENTION_BACKEND=SDPA)
  sdpa-kcache       quantprep.load(DIR) with the kcache `quantprep warm` shipped (its runtime copy kept
                    across rounds, as a server's second start finds it)
  sdpa-cache-size   as sdpa-kcache with CACHE_MODE=OPTIMIZE_SIZE (a weightless blob), its own warmed dir
  cpu-target        the cpu target's artifact of the same checkpoint (quantprep.load + transformers generate), if --cpu

    python benchmarks/openvino_start.py OPENVINO_DIR [--cpu CPU_DIR] [--runs 5] [--out benchmarks/results/openvino-start-....json]
OPENVINO_DIR must have been warmed here (`quantprep warm DIR`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import child_env, machine, run_child, save

PROMPT = "What is the capital of France?"

CHILD = """
import time
import json, sys
variant, path, cache = sys.argv[1], sys.argv[2], sys.argv[3]
prompt = {prompt!r}
t0 = time.perf_counter()
if variant == "cpu-target":
    import torch, quantprep
    from transformers import AutoTokenizer
    t1 = time.perf_counter()
    model = quantprep.load(path)
    tok = AutoTokenizer.from_pretrained(path)
    enc = tok.apply_chat_template([{{"role": "user", "content": prompt}}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    t2 = time.perf_counter()
    with torch.no_grad():
        model.generate(**enc, max_new_tokens=1, do_sample=False)
    status = model.quantprep_kcache.get("status")
elif variant.startswith("pa"):
    import openvino_genai
    t1 = time.perf_counter()
    pipe = openvino_genai.LLMPipeline(path, "CPU", **({{"CACHE_DIR": cache}} if cache else {{}}))
    t2 = time.perf_counter()
    pipe.generate(prompt, max_new_tokens=1, do_sample=False)
    status = "cache" if cache else "none"
else:
    import quantprep
    t1 = time.perf_counter()
    model = quantprep.load(path, kcache=variant != "sdpa-nocache")
    if variant == "sdpa-cache-size":
        model.config.update(CACHE_DIR=cache, CACHE_MODE="OPTIMIZE_SIZE")
    model.pipeline
    t2 = time.perf_counter()
    model.generate(prompt, max_new_tokens=1)
    status = model.quantprep_kcache.get("status") if variant != "sdpa-cache-size" else "own dir"
t3 = time.perf_counter()
print(json.dumps({{"done_at": time.time(), "import_s": t1 - t0, "construct_s": t2 - t1, "first_generate_s": t3 - t2,
                  "cache": status}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("art")
    ap.add_argument("--cpu", help="the cpu target's artifact of the same checkpoint")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    art = str(Path(args.art).absolute())
    manifest = json.loads(Path(art, "manifest.json").read_text())
    if "kcache" not in manifest:
        sys.exit(f"{art}: not warmed; run `quantprep warm {art}` first")
    code = CHILD.format(prompt=PROMPT)
    with tempfile.TemporaryDirectory() as tmp:
        caches = {"pa-cache": str(Path(tmp, "pa")), "sdpa-cache-size": str(Path(tmp, "size"))}
        variants = ["pa-nocache", "pa-cache", "sdpa-nocache", "sdpa-kcache", "sdpa-cache-size"] + (["cpu-target"] if args.cpu else [])
        for v in ("pa-cache", "sdpa-cache-size"):  # their caches warmed once, as quantprep warm does for sdpa-kcache
            Path(caches[v]).mkdir()
            run_child(code, [v, art, caches[v]], env=child_env())
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(args.runs):
            for v in variants:
                start, r = run_child(code, [v, args.cpu if v == "cpu-target" else art, caches.get(v, "")], env=child_env())
                r["first_token_s"] = r.pop("done_at") - start  # from the spawn: the interpreter's start included
                runs[v].append(r)
                print(v, {k: round(x, 3) if isinstance(x, float) else x for k, x in r.items()}, flush=True)
    summary = {v: {k: statistics.median(r[k] for r in rs) for k in ("first_token_s", "import_s", "construct_s", "first_generate_s")}
               for v, rs in runs.items()}
    result = machine() | {"benchmark": "openvino-start", "model": Path(art).parent.name, "artifact": Path(art).name,
                          "source": manifest["source"].get("id"),
                          "prompt": PROMPT, "runs": args.runs, "median": summary, "raw": runs,
                          "kcache_bytes": sum(f["size"] for f in manifest["kcache"]["files"].values())}
    print(json.dumps(summary, indent=2))
    if args.out:
        save(result, args.out)


if __name__ == "__main__":
    main()
