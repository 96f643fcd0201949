"""Pulling a published artifact: `quantprep.load(REF)` to the first token, fresh processes, side by
side in one run, medians. Modes:
  local   quantprep.load(<the artifact directory>)
  filled  quantprep.load("oci://127.0.0.1:PORT/...") with the pull cache already holding it
  empty   the same with an empty pull cache: pulled from the registry, verified, then loaded
The registry is Debian's docker-registry (CNCF distribution) on loopback, started here. Goals
(issue 15): filled <= 1.1x local; empty <= local + bytes / 500 MB/s.

    python benchmarks/pull.py [--artifact artifacts/smollm2-135m/cpu] [--runs 3] [--out benchmarks/results/pull-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from common import machine, run_child, save

CHILD = """
import sys, time, json, torch
import quantprep
t1 = time.time()
m = quantprep.load(sys.argv[1])
t2 = time.time()
ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
print(json.dumps({"imported": t1, "loaded": t2, "first": time.time()}))
"""


def start_registry(root: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (root / "registry.yml").write_text(f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {root / 'storage'}\n"
                                      f"http:\n  addr: 127.0.0.1:{port}\n")
    proc = subprocess.Popen(["/usr/bin/docker-registry", "serve", str(root / "registry.yml")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1)
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the registry did not start")


def run(source: str, env: dict) -> dict:
    t0, r = run_child(CHILD, [source], env)
    return {"total_s": r["first"] - t0, "load_s": r["loaded"] - r["imported"], "imports_s": r["imported"] - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", type=Path, default=Path("artifacts/smollm2-135m/cpu"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from quantprep.distribution.publish import publish

    nbytes = sum(p.stat().st_size for p in args.artifact.rglob("*") if p.is_file())
    with tempfile.TemporaryDirectory(prefix="quantprep-pull-bench-") as tmp:
        tmp = Path(tmp)
        proc, host = start_registry(tmp)
        try:
            ref = f"oci://{host}/bench/model:v1"
            publish([args.artifact], ref)
            cache = tmp / "pull-cache"
            env = dict(os.environ, QUANTPREP_PULL_CACHE=str(cache), QUANTPREP_TRUST_KCACHE="0")
            runs: dict[str, list[dict]] = {"local": [], "filled": [], "empty": []}
            run(ref, env)  # fill the cache once (and warm the OS page cache for every mode)
            for _ in range(args.runs):
                runs["local"].append(run(str(args.artifact.resolve()), env))
                runs["filled"].append(run(ref, env))
                shutil.rmtree(cache)
                runs["empty"].append(run(ref, env))
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    med = {k: statistics.median(r["total_s"] for r in v) for k, v in runs.items()}
    budget = med["local"] + nbytes / 500e6
    res = machine() | {"artifact": str(args.artifact), "bytes": nbytes, "runs": args.runs, "median_s": med,
           "filled_over_local": med["filled"] / med["local"], "empty_budget_s": budget, "empty_within_budget": med["empty"] <= budget,
           "raw": runs}
    print(json.dumps({k: v for k, v in res.items() if k != "raw"}, indent=2))
    save(res, args.out)


if __name__ == "__main__":
    main()
