"""llama.cpp as the CPU anchor (issue 32): the very GGUF a recipe starts from (Qwen2.5-Coder-1.5B: Q4_K_M),
run by llama.cpp (llama-cpp-python, built here with -march=native and OpenMP: `make bench-llamacpp`), beside quantprep's
cpu artifact and GPTQModel (--gptqmodel-backend, default TORCH, its portable CPU kernel; AUTO: what
GPTQModel.load picks on this machine) on the GPTQ checkpoint that artifact was built from (found in
the build cache by content), and, where they exist beside the cpu artifact, the
same checkpoint's cpu artifacts built with `--lm-head int8` and `--lm-head int4` (RECIPE-int8-head/cpu,
RECIPE-int4-head/cpu: quantprep_int8_head, quantprep_int4_head; opted-into changes of the model), and
the same three artifacts run by runtime/engine.py (native, native_int8_head, native_int4_head:
quantprep's C without torch or transformers, int4_a8 at every length, the same threads). One
run, on the same threads: llama.cpp gets n_threads = n_threads_batch = torch.get_num_threads(). Measured:

  - decode: greedy tokens/s after a 16-token prompt, and after the 512-token prompt (a long context's
    attention), over the --new tokens after the first (the first comes from the prompt's forward):
    (new - 1) one-token forwards and their argmax, timed token by token (llama.cpp: eval + argmax of
    the last logits; torch: generate, a streamer's timestamps, with no end-of-sequence token, so that
    like llama.cpp's loop it stops at --new and runs no stopping check or logits processor);
  - 512-token prefill: seconds for one forward of the first 512 held-out tokens, logits of the last
    position only (llama.cpp computes no others; torch: logits_to_keep=1), llama.cpp's KV cache
    cleared before each (reset) and the prompt one batch (n_batch = n_ubatch = 512);
  - time to first token: spawn of a fresh process to the first greedy token of the 16-token prompt
    (imports, load, prefill), medians of --loads after one untimed start each (page cache and
    GPTQModel's Inductor cache warm).

Prefill and decode are medians of --runs after one untimed warm-up each. All three get the same
token ids: the artifact's (HF) tokenizer on quantprep's held-out text, as vs_gptqmodel.py; whether
llama.cpp's own tokenizer (the GGUF's) gives the same ids for that text is recorded. llama.cpp's
throughput runs in a child process of its own (torch and llama.cpp link two OpenMP runtimes whose
spinning workers would share the cores if both ran in this process), driven by this one so that each
run is llama.cpp's round, then each torch model's: this VM's memory bandwidth changes over tens of
seconds, and a ratio of runs far apart in time measured that. Each ratio's per-run values
(`NAME_over_llamacpp_runs`) are kept beside the ratio of medians.

    python benchmarks/vs_llamacpp.py qwen2.5-coder-1.5b [--artifact artifacts/qwen2.5-coder-1.5b/cpu]
        [--runtimes llamacpp,quantprep,gptqmodel] [--gptqmodel-backend AUTO] [--runs 5] [--loads 3] [--new 32]
        [--out benchmarks/results/vs-llamacpp-qwen2.5-coder-1.5b-cpu-avx512.json]

--runtimes llamacpp measures llama.cpp alone (no artifact needed: a smoke run, token ids from the GGUF).
OMP_NUM_THREADS=N sets the threads of all three. Run it on an idle machine: llama.cpp's threads meet at
a spinning barrier after every op, so one that shares its core with another process stalls the rest
(2 threads beside a busy process on 2 cores: decode 41 tok/s in one run, 1.6 in the next).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import (
    REPO,
    checkpoint_codes,
    gptqmodel_kernels,
    greedy_decode,
    is_gptqmodel_backend,
    machine,
    median_and_runs,
    rtn_record,
    save,
    timed,
)
from load import fresh_process, medians

RUNTIMES = ("llamacpp", "quantprep", "quantprep_int8_head", "quantprep_int4_head", "native", "native_int8_head", "native_int4_head",
            "gptqmodel")
NATIVE = ("native", "native_int8_head", "native_int4_head")  # runtime/engine.py on the same three artifacts
HEADS = ("int8", "int4")  # --lm-head variants of the cpu artifact, at artifacts/RECIPE-<head>-head/cpu
PROMPT, PREFILL = 16, 512
# llama.cpp's settings: the context holds the prefill and the decode; one batch holds the prefill
LLAMA_KW = {"n_ctx": 1024, "n_batch": PREFILL, "n_ubatch": PREFILL, "logits_all": False, "verbose": False}

CHILD_LLAMACPP_FIRST = """
import time, sys, json
t0 = time.time()
import numpy as np
from llama_cpp import Llama, llama_get_logits_ith
t1 = time.time()
n = int(sys.argv[3])
llm = Llama(model_path=sys.argv[1], n_threads=n, n_threads_batch=n, **json.loads(sys.argv[4]))
t2 = time.time()
llm.eval(json.loads(sys.argv[2]))
np.ctypeslib.as_array(llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).argmax()
print(json.dumps({"import": t1, "load": t2, "first": time.time()}))
"""

CHILD_NATIVE_FIRST = """
import time, sys, json
t0 = time.time()
from quantprep.runtime import engine
t1 = time.time()
m = engine.load(sys.argv[1], threads=int(sys.argv[3]))
t2 = time.time()
m.forward(json.loads(sys.argv[2])).argmax()
print(json.dumps({"import": t1, "load": t2, "first": time.time()}))
"""

CHILD_TORCH_FIRST = """
import time, sys, json
t0 = time.time()
import torch
if sys.argv[3] == "gptqmodel":
    from gptqmodel import BACKEND, GPTQModel
else:
    import quantprep
t1 = time.time()
if sys.argv[3] == "gptqmodel":
    m = GPTQModel.load(sys.argv[1], backend=getattr(BACKEND, sys.argv[4]), device="cpu")
else:
    m = quantprep.load(sys.argv[1])
t2 = time.time()
ids = torch.tensor([json.loads(sys.argv[2])])
m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
print(json.dumps({"import": t1, "load": t2, "first": time.time()}))
"""

# llama.cpp's prefill and decode, in a process without torch that the parent drives, so that its runs
# interleave in time with torch's (this VM's memory bandwidth changes over tens of seconds: BENCHMARKS.md,
# "llama.cpp, the CPU anchor"). argv: gguf, threads, new, JSON {"ids": 512 prefill ids, "prompt": 16 ids,
# "kw": Llama's settings}. After a warm-up it prints its greedy tokens; then one run per line on stdin.
CHILD_LLAMACPP_RUNS = """
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
gguf, n, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
a = json.loads(sys.argv[4])
llm = Llama(model_path=gguf, n_threads=n, n_threads_batch=n, **a["kw"])

def argmax():
    return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).argmax())

def prefill():
    llm.reset()  # n_tokens = 0: the next eval first clears the KV cache past it
    t = time.perf_counter()
    llm.eval(a["ids"])
    argmax()
    return time.perf_counter() - t

def decode(prompt):
    llm.reset()
    llm.eval(prompt)
    tokens = [argmax()]
    t = time.perf_counter()
    for _ in range(new - 1):
        llm.eval(tokens[-1:])
        tokens.append(argmax())
    return (new - 1) / (time.perf_counter() - t), tokens

prefill()
print("RUN " + json.dumps({"tokens": decode(a["prompt"])[1]}), flush=True)  # tagged: the C library may print too
for _ in sys.stdin:
    print("RUN " + json.dumps({"prefill": prefill(), "decode": decode(a["prompt"])[0], "decode_long": decode(a["ids"])[0]}), flush=True)
"""


def find_gguf(recipe) -> Path:
    """The GGUF the recipe starts from, as `quantprep build` finds it (the joined parts are cached by sha256)."""
    from quantprep.build.pipeline import cache_dir
    from quantprep.build.quantize import assemble_gguf
    from quantprep.build.quantize import find_gguf as package_gguf

    src = recipe.source
    if "gguf_parts" in src:
        return assemble_gguf(src["gguf_parts"], src["gguf_sha256"], cache_dir() / "gguf")
    if "gguf_package" in src:
        return package_gguf(src["gguf_package"], src.get("gguf_file"))
    sys.exit(f"recipe {recipe.name} does not start from a GGUF: llama.cpp has nothing to run")


def token_ids(gguf: Path, art: Path | None) -> tuple[list[int], dict]:
    """(the first 512 held-out token ids, how they were made): the artifact's HF tokenizer when there is
    an artifact, else the GGUF's; with both, whether llama.cpp's tokenizer gives the same ids."""
    from llama_cpp import Llama

    from quantprep.tools.eval import read_text, token_windows

    text, text_name = read_text()
    head = text[:16 * PREFILL]  # a prefix long enough for 512 tokens: both tokenizers see the same characters
    vocab = Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    theirs = vocab.tokenize(head.encode(), add_bos=False, special=False)[:PREFILL]
    info = {"text": text_name, "tokenizer": "the GGUF's (llama.cpp)"}
    if art is None:
        return theirs, info
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(art)
    ids = token_windows(tokenizer, text, PREFILL, PREFILL)[0].tolist()
    ours = tokenizer(head, add_special_tokens=False)["input_ids"][:PREFILL]
    same = same_prefix(ours, theirs)
    return ids, info | {"tokenizer": "the artifact's (transformers)", "gguf_tokenizer_same_ids": same == PREFILL,
                        "gguf_tokenizer_same_prefix": same}


def time_to_first_token(paths: dict[str, Path], prompt: list[int], threads: int, loads: int, backend: str) -> dict:
    """Spawn to the first token, each runtime in fresh processes, interleaved; one untimed start each first."""
    def start(name: str) -> dict:
        if name == "llamacpp":
            return fresh_process(CHILD_LLAMACPP_FIRST, [str(paths[name]), json.dumps(prompt), str(threads), json.dumps(LLAMA_KW)])
        if name in NATIVE:
            return fresh_process(CHILD_NATIVE_FIRST, [str(paths[name]), json.dumps(prompt), str(threads)])
        return fresh_process(CHILD_TORCH_FIRST, [str(paths[name]), json.dumps(prompt), name, backend])

    rows = {name: [] for name in paths}
    for name in paths:
        start(name)
    for _ in range(loads):
        for name in paths:
            rows[name].append(start(name))
        print(f"first token: {({k: round(v[-1]['total_s'], 2) for k, v in rows.items()})} s", flush=True)
    return {name: medians(r) for name, r in rows.items()}


class LlamaCppChild:
    """CHILD_LLAMACPP_RUNS, started and warmed up; run() times one round of prefill and decodes."""

    def __init__(self, gguf: Path, ids: list[int], threads: int, new: int):
        arg = json.dumps({"ids": ids, "prompt": ids[:PROMPT], "kw": LLAMA_KW})
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD_LLAMACPP_RUNS, str(gguf), str(threads), str(new), arg],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        self.tokens = self.reply()["tokens"]

    def reply(self) -> dict:
        """Its next tagged line (others: the library's own output)."""
        while line := self.proc.stdout.readline():
            if line.startswith("RUN "):
                return json.loads(line[4:])
        raise RuntimeError(f"llama.cpp child exited with {self.proc.wait()} (its stderr is above)")

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self.reply()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Native:
    """runtime/engine.py's model, measured as the torch models are: the prefill's last logits
    from an empty cache; greedy decode timed token by token after the first, which the prompt gives."""

    def __init__(self, path: Path, threads: int):
        from quantprep.runtime import engine

        self.model = engine.load(path, threads=threads)

    def prefill(self, ids: list[int]) -> float:
        self.model.reset(capacity=2 * PREFILL)
        return timed(lambda: self.model.forward(ids).argmax())

    def decode(self, ids: list[int], new: int) -> tuple[float, list[int]]:
        self.model.reset(capacity=2 * PREFILL)
        tokens, stamps, logits = [], [], self.model.forward(ids)
        while True:
            tokens.append(int(logits.argmax()))
            stamps.append(time.perf_counter())
            if len(tokens) == new:
                return (new - 1) / (stamps[-1] - stamps[0]), tokens
            logits = self.model.forward(tokens[-1:])


def interleaved_runs(models: dict, llama: LlamaCppChild | None, ids: list[int], runs: int, new: int) -> tuple[dict, ...]:
    """(prefill seconds, decode tok/s, decode tok/s after 512 tokens, greedy tokens) per runtime: each
    run takes llama.cpp's round, then each torch model's, after a warm-up each."""
    import torch

    full, prompt = torch.tensor([ids]), torch.tensor([ids[:PROMPT]])

    def prefill(m) -> float:
        if isinstance(m, Native):
            return m.prefill(ids)
        return timed(lambda: m(input_ids=full, logits_to_keep=1).logits[0, -1].argmax())

    def decode(m, ids: torch.Tensor) -> tuple[float, list[int]]:
        if isinstance(m, Native):
            return m.decode(ids[0].tolist(), new)
        # eos_token_id=None as an argument (a generation_config's None is filled from the model's)
        return greedy_decode(m, ids, new, eos_token_id=None)

    names = (["llamacpp"] if llama else []) + list(models)
    p, d, d_long = ({k: [] for k in names} for _ in range(3))
    tokens = {"llamacpp": llama.tokens} if llama else {}
    with torch.inference_mode():
        for name, m in models.items():  # warm-up: GPTQModel's TORCH kernel compiles each shape on first use
            prefill(m)
            tokens[name] = decode(m, prompt)[1]
        for _ in range(runs):
            if llama:
                r = llama.run()
                p["llamacpp"].append(r["prefill"])
                d["llamacpp"].append(r["decode"])
                d_long["llamacpp"].append(r["decode_long"])
            for name, m in models.items():
                p[name].append(prefill(m))
                d[name].append(decode(m, prompt)[0])
                d_long[name].append(decode(m, full)[0])
            print(f"run: prefill {({k: round(v[-1], 3) for k, v in p.items()})} s, "
                  f"decode {({k: round(v[-1], 2) for k, v in d.items()})} "
                  f"(after 512: {({k: round(v[-1], 2) for k, v in d_long.items()})}) tok/s", flush=True)
    return p, d, d_long, tokens


def same_prefix(a: list[int], b: list[int]) -> int:
    """Greedy tokens two runtimes produce before the first difference (after it, the contexts differ)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", help="a recipe that starts from a GGUF: qwen2.5-coder-1.5b, smollm2-135m")
    p.add_argument("--artifact", help="its cpu artifact (default artifacts/RECIPE/cpu)")
    p.add_argument("--runtimes", default=",".join(RUNTIMES), help=f"a comma list of {', '.join(RUNTIMES)}")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--loads", type=int, default=3)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--gptqmodel-backend", default="TORCH", help="GPTQModel's backend, a gptqmodel.BACKEND name (AUTO: its own pick)")
    p.add_argument("--out")
    args = p.parse_args()
    runtimes = [r for r in RUNTIMES if r in args.runtimes.split(",")]
    args.gptqmodel_backend = args.gptqmodel_backend.upper()
    if "gptqmodel" in runtimes and not is_gptqmodel_backend(args.gptqmodel_backend):
        p.error(f"--gptqmodel-backend {args.gptqmodel_backend!r}: not a gptqmodel.BACKEND name")
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(os.cpu_count()))

    import torch

    from quantprep.build.pipeline import cached_checkpoint
    from quantprep.build.recipes import find_recipe
    from quantprep.format.artifact import sha256_file

    threads = torch.get_num_threads()
    recipe = find_recipe(args.recipe)
    gguf = find_gguf(recipe)
    gguf_sha256 = recipe.source.get("gguf_sha256") or sha256_file(gguf)
    paths, manifest, art, rtn, codes = {"llamacpp": gguf}, None, None, {}, {}
    if {"quantprep", "gptqmodel", *NATIVE} & set(runtimes):
        art = Path(args.artifact or REPO / "artifacts" / recipe.name / "cpu")
        if not (art / "manifest.json").is_file():
            sys.exit(f"{art}: no artifact; run `quantprep build {recipe.name} --target cpu` first, or pass --runtimes llamacpp")
        manifest = json.loads((art / "manifest.json").read_text())
        gptq = cached_checkpoint(manifest["source"]["sha256"])  # the checkpoint the artifact was built from, by content
        if gptq is None:
            sys.exit(f"the GPTQ checkpoint {art} was built from is not in the build cache")
        rtn = rtn_record(gptq)  # or rounded to nearest from the same GGUF (benchmarks/rtn_gptq.py)
        codes = checkpoint_codes(gptq)
        if (manifest["source"].get("gguf_sha256") or rtn.get("gguf_sha256")) != gguf_sha256:
            sys.exit(f"{art} was not built from {gguf} (its source: {manifest['source'].get('gguf_sha256')})")
        paths["quantprep"] = paths["native"] = art
        paths["gptqmodel"] = gptq
        for h in HEADS:  # measured where built (make bench-llamacpp builds them)
            head = art.parent.parent / f"{recipe.name}-{h}-head" / "cpu"
            if (head / "manifest.json").is_file():
                if json.loads((head / "manifest.json").read_text())["source"]["sha256"] != manifest["source"]["sha256"]:
                    sys.exit(f"{head} was not built from the GPTQ checkpoint {art} was")
                paths[f"quantprep_{h}_head"] = paths[f"native_{h}_head"] = head
    runtimes = [r for r in runtimes if r in paths]
    paths = {k: paths[k] for k in runtimes}
    ids, tokens_info = token_ids(gguf, art)
    prompt = ids[:PROMPT]
    print(f"{recipe.name}: {', '.join(f'{k} {v}' for k, v in paths.items())}; {threads} threads", flush=True)

    first = time_to_first_token(paths, prompt, threads, args.loads, args.gptqmodel_backend)
    llama = LlamaCppChild(gguf, ids, threads, args.new) if "llamacpp" in runtimes else None
    models, load_in_process = {}, {}
    if art is not None:
        from gptqmodel import BACKEND, GPTQModel

        import quantprep

        for name in RUNTIMES[1:]:
            if name in runtimes:
                t0 = time.perf_counter()
                models[name] = (GPTQModel.load(str(paths[name]), backend=getattr(BACKEND, args.gptqmodel_backend), device="cpu").model.eval()
                                if name == "gptqmodel" else Native(paths[name], threads) if name in NATIVE else quantprep.load(paths[name]))
                load_in_process[name] = time.perf_counter() - t0
    try:
        prefill, decode, decode_long, tokens = interleaved_runs(models, llama, ids, args.runs, args.new)
    finally:
        if llama:
            llama.close()

    result = machine() | {
        "threads": threads,
        "versions": {m: sys.modules[m].__version__ for m in ("llama_cpp", "transformers", "quantprep", "gptqmodel") if m in sys.modules},
        # the CPU features llama.cpp was built with (GGML_NATIVE: this machine's) and its thread backend (OPENMP = 1)
        "llama_cpp_system_info": sys.modules["llama_cpp"].llama_print_system_info().decode().strip(),
        "model": recipe.name,
        "gguf": {"file": gguf.name, "sha256": gguf_sha256, "bytes": gguf.stat().st_size},
        "artifact": art and str(art.relative_to(REPO) if art.is_relative_to(REPO) else art),
        "head_artifacts": {k: str(v.relative_to(REPO) if v.is_relative_to(REPO) else v) for k, v in paths.items() if k.endswith("_head")},
        "native_threads": {k: m.model.threads for k, m in models.items() if isinstance(m, Native)},
        "gptqmodel_backend": args.gptqmodel_backend if "gptqmodel" in models else None,
        "gptqmodel_kernels": gptqmodel_kernels(models["gptqmodel"]) if "gptqmodel" in models else None,
        **(codes if art else {"gptq_checkpoint": None, "codes": None}),
        "llamacpp_settings": LLAMA_KW | {"n_threads": threads, "n_threads_batch": threads},
        "tokens": tokens_info | {"prefill": PREFILL, "prompt": PROMPT, "new": args.new},
        "decode_tok_s": {k: median_and_runs(v) for k, v in decode.items()},
        "decode_after_512_tok_s": {k: median_and_runs(v) for k, v in decode_long.items()},
        "prefill_512_s": {k: median_and_runs(v) for k, v in prefill.items()},
        "first_token_s": first,
        "load_in_process_s": load_in_process,
        "greedy_tokens": tokens,
        "same_greedy_prefix_as_llamacpp": {k: same_prefix(tokens["llamacpp"], v) for k, v in tokens.items()
                                           if k != "llamacpp" and "llamacpp" in tokens},
    }
    if "llamacpp" in runtimes:
        for k in ("decode_tok_s", "decode_after_512_tok_s", "prefill_512_s"):
            r = result[k]
            for name in runtimes[1:]:
                r[f"{name}_over_llamacpp"] = r[name]["median"] / r["llamacpp"]["median"]
                r[f"{name}_over_llamacpp_runs"] = [x / y for x, y in zip(r[name]["runs"], r["llamacpp"]["runs"], strict=True)]
        f = result["first_token_s"]
        f.update({f"{name}_over_llamacpp": f[name]["total_s"] / f["llamacpp"]["total_s"] for name in runtimes if name != "llamacpp"})
    print(save(result, args.out))


if __name__ == "__main__":
    main()
