"""Cold start of a server: process spawn to the first streamed token of its first request (issue 17).

For each model, fresh processes, medians of --runs, interleaved (a, b, c, a, b, c, ...):
  (a) `quantprep serve ARTIFACT`: quantprep's OpenAI-compatible server with the artifact preloaded (measured
      when it was transformers' own server: benchmarks/results/serve-*.json)
  (b) `transformers serve GPTQ_DIR`: the same server loading the GPTQ checkpoint the artifact was
      built from, through transformers' GPTQ integration (GPTQModel's kernels)
  (c) floor for (a): a script that imports quantprep, loads the artifact and streams `generate`
For (a) and (b) the parent polls GET /v1/models every 20 ms from the spawn on and, at the first
answer, sends one streaming chat completion (the same prompt, greedy, 8 tokens) with a raw HTTP
client; the time is taken at the first SSE chunk that carries text. (c) prints the time its
streamer receives the first generated token. Times: spawn -> ready (a, b) and spawn -> first token.

    python benchmarks/serve.py [--models smollm2,qwen-coder-0.5b] [--runs 3] [--out benchmarks/results/serve-cpu-avx2.json]
    python benchmarks/serve.py --artifact NAME=DIR [--variants a,c]   # an artifact elsewhere (the GPU machine: no GPTQModel there)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, child_env, machine, run_child, save

PROMPT = "Write a haiku about the sea."
NEW_TOKENS = 8
ARTIFACTS = {"smollm2": "smollm2-135m", "qwen-coder-0.5b": "qwen2.5-coder-0.5b", "qwen-coder-1.5b": "qwen2.5-coder-1.5b"}

FLOOR = """
import json, sys, time
import torch
import quantprep
from transformers import AutoTokenizer
from transformers.generation.streamers import BaseStreamer
art = sys.argv[1]
model = quantprep.load(art)
tok = AutoTokenizer.from_pretrained(art)
enc = tok.apply_chat_template([{"role": "user", "content": sys.argv[2]}], add_generation_prompt=True, return_tensors="pt", return_dict=True)

class First(BaseStreamer):
    calls = 0
    def put(self, value):
        self.calls += 1
        if self.calls == 2:  # the first call is the prompt
            print(json.dumps({"first": time.time()}), flush=True)
    def end(self):
        pass

with torch.inference_mode():
    model.generate(**enc, max_new_tokens=int(sys.argv[3]), do_sample=False, streamer=First())
"""


def artifact_and_checkpoint(model: str, where: dict[str, str]) -> tuple[Path, Path]:
    art = Path(where[model]) if model in where else REPO / "artifacts" / ARTIFACTS[model] / "cpu"
    if not (art / "manifest.json").is_file():
        sys.exit(f"no {art}: run `make build` (smollm2) or `make real` (Qwen) first")
    from quantprep.build.pipeline import cached_checkpoint

    source = json.loads((art / "manifest.json").read_text())["source"]
    # the checkpoint it was built from: in the build cache by content, or the directory prepack was given
    return art, cached_checkpoint(source["sha256"]) or Path(source.get("path") or "?")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_streamed_token(port: int, model_id: str) -> float:
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": NEW_TOKENS,
                       "temperature": 0, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    seen = []
    for line in resp:
        seen.append(line)
        if line.startswith(b"data: {"):
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                t = time.time()
                conn.close()
                return t
    raise RuntimeError(f"the stream ended without text: {b''.join(seen[-5:])[-1500:]!r}")


def server_run(argv: list[str], model_id: str, port: int, env: dict) -> dict:
    start = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=REPO)
    try:
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/v1/models")
                conn.getresponse().read()
                ready = time.time()
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(proc.stderr.read().decode()[-2000:]) from None
                time.sleep(0.02)
        first = first_streamed_token(port, model_id)
        return {"ready_s": ready - start, "first_token_s": first - start}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def floor_run(art: Path, env: dict) -> dict:
    start, out = run_child(FLOOR, [str(art), PROMPT, str(NEW_TOKENS)], env)
    return {"first_token_s": out["first"] - start}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="smollm2,qwen-coder-0.5b")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--artifact", action="append", default=[], metavar="NAME=DIR", help="measure this artifact as model NAME")
    p.add_argument("--variants", default="a,b,c")
    p.add_argument("--out")
    args = p.parse_args()
    where = dict(a.split("=", 1) for a in args.artifact)
    models = list(where) if where else args.models.split(",")
    variants = set(args.variants.split(","))
    env = child_env(GPTQMODEL_CPU_WORKERS=str(os.cpu_count()))
    transformers_cli = str(Path(sys.executable).with_name("transformers"))
    result = machine() | {"transformers": __import__("transformers").__version__, "prompt": PROMPT, "new_tokens": NEW_TOKENS, "models": {}}
    for model in models:
        art, gptq = artifact_and_checkpoint(model, where)
        names = {"a": "a_quantprep_serve", "b": "b_transformers_serve_gptqmodel", "c": "c_quantprep_load_generate"}
        runs = {names[v]: [] for v in sorted(variants)}
        errors: dict[str, str] = {}
        for i in range(args.runs):
            if "a" in variants:
                port = free_port()
                runs[names["a"]].append(server_run([sys.executable, "-m", "quantprep", "serve", str(art), "--port", str(port)],
                                                   str(art.absolute()), port, env))
            if "b" in variants and names["b"] not in errors:
                port = free_port()
                try:
                    runs[names["b"]].append(server_run([transformers_cli, "serve", str(gptq), "--port", str(port), "--host", "127.0.0.1",
                                                        "--device", "cpu"], str(gptq), port, env))
                except RuntimeError as e:  # recorded, not fatal: e.g. GPTQModel's CPU kernel needs K % group_size == 0
                    errors[names["b"]] = str(e)[-600:]
                    del runs[names["b"]]
            if "c" in variants:
                runs[names["c"]].append(floor_run(art, env))
            print(f"{model} run {i + 1}: " + ", ".join(f"{k} {v[-1]['first_token_s']:.2f} s" for k, v in runs.items())
                  + "".join(f"; {k} failed: {e[-200:]}" for k, e in errors.items()), flush=True)
        row = {k: {"first_token_s": statistics.median(r["first_token_s"] for r in v),
                   **({"ready_s": statistics.median(r["ready_s"] for r in v)} if "ready_s" in v[0] else {}), "runs": v}
               for k, v in runs.items()}
        t = {v: row[names[v]]["first_token_s"] for v in variants if names[v] in row}
        row["errors"] = errors
        if {"a", "b"} <= set(t):
            row["b_over_a"] = t["b"] / t["a"]
        if {"a", "c"} <= set(t):
            row["a_over_c"] = t["a"] / t["c"]
        row.update(artifact=str(art), gptq_checkpoint=gptq.name, device=json.loads((art / "manifest.json").read_text())["target"]["name"])
        result["models"][model] = row
    print(save(result, args.out))


if __name__ == "__main__":
    main()
