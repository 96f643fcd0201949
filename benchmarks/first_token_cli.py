"""Prompt text to first token from the command line, fresh processes (issue 32, item 3): what a user
types, each tool's own tokenizer and chat template included. One run, round-robin, the same threads:

  - `quantprep generate ART --native --max-new-tokens 1`: runtime/engine.py with
    runtime/tokenizer.py, no torch or transformers;
  - `quantprep generate ART --max-new-tokens 1`: quantprep.load and transformers' tokenizer and generate;
  - llama.cpp on the GGUF the recipe starts from: `Llama(...).create_chat_completion(max_tokens=1)`
    with the GGUF's own chat template (llama-cpp-python, `make bench-llamacpp`).

Each figure is the wall time from the spawn to the process's exit (interpreter start, imports,
load, template, tokenizer, the prompt's forward, one token, exit), median of --loads after one
untimed start of each (page cache warm). The first token's text and the prompt's token count of
each are recorded: the same prompt should give the same count and, greedy, the same first token.

    python benchmarks/first_token_cli.py qwen2.5-coder-1.5b [--artifact artifacts/qwen2.5-coder-1.5b/cpu] [--loads 5]
        [--out benchmarks/results/first-token-cli-qwen2.5-coder-1.5b-cpu-avx2.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, artifact_codes, child_env, machine, save
from vs_llamacpp import find_gguf

PROMPT = "Write a Python function that reverses a string."
LLAMACPP = """
import json, sys
from llama_cpp import Llama
gguf, threads, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
m = Llama(gguf, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, n_ubatch=512, verbose=False)
r = m.create_chat_completion(messages=[{"role": "user", "content": prompt}], max_tokens=1, temperature=0.0)
print(json.dumps({"completion": r["choices"][0]["message"]["content"], "prompt_tokens": r["usage"]["prompt_tokens"]}))
"""


def commands(art: Path, gguf: Path, threads: int, prompt: str) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "quantprep", "generate", str(art), "--max-new-tokens", "1", "--json", "--prompt", prompt]
    return {"quantprep_native": cli + ["--native"], "quantprep": cli,
            "llamacpp": [sys.executable, "-c", LLAMACPP, str(gguf), str(threads), prompt]}


def spawn(cmd: list[str], env: dict) -> tuple[float, dict]:
    """Seconds from the spawn to the exit, and the JSON of the last line the process printed."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:6]} exited with {proc.returncode}: {proc.stderr[-3000:]}")
    out = proc.stdout.strip()
    return took, json.loads(out if out.startswith("{") else out.splitlines()[-1])  # the CLI's JSON is indented


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", help="a recipe that starts from a GGUF: qwen2.5-coder-1.5b, smollm2-135m")
    p.add_argument("--artifact", help="its cpu artifact (default artifacts/RECIPE/cpu)")
    p.add_argument("--loads", type=int, default=5)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--out")
    args = p.parse_args()
    from quantprep.build.recipes import find_recipe
    from quantprep.runtime.tokenizer import ArtifactTokenizer

    art = Path(args.artifact or REPO / "artifacts" / args.recipe / "cpu")
    threads = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
    env = child_env(OMP_NUM_THREADS=str(threads))
    cmds = commands(art, find_gguf(find_recipe(args.recipe)), threads, args.prompt)
    replies = {name: spawn(cmd, env)[1] for name, cmd in cmds.items()}  # untimed: the page cache filled
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for _ in range(args.loads):
        for name, cmd in cmds.items():
            took, replies[name] = spawn(cmd, env)
            times[name].append(took)
    files = json.loads((art / "manifest.json").read_text())["files"]
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = machine() | {
        "recipe": args.recipe, "artifact": str(art.relative_to(REPO)) if art.is_relative_to(REPO) else str(art), "threads": threads,
        **artifact_codes(art), "prompt": args.prompt, "loads": args.loads,
        "prompt_tokens": {"quantprep": len(ArtifactTokenizer(art, files).prompt_ids(args.prompt)),
                          "llamacpp": replies["llamacpp"]["prompt_tokens"]},
        "first_token": {name: r["completion"] for name, r in replies.items()},
        "spawn_to_first_token_s": {name: {"median": medians[name], "runs": times[name]} for name in cmds},
        "over_llamacpp": {name: medians[name] / medians["llamacpp"] for name in cmds if name != "llamacpp"},
        "over_llamacpp_runs": {name: [a / b for a, b in zip(times[name], times["llamacpp"], strict=True)] for name in cmds if name != "llamacpp"},
    }
    print(save(result, args.out))


if __name__ == "__main__":
    main()
