"""Stage 4, warm: run the serving shapes once and ship every kernel cache inside the artifact.

`warm(dir)` runs the artifact in a fresh child process whose caches all point into an empty
scratch directory (Inductor/Triton, and on xpu the driver and SYCL caches), optionally compiles,
runs each recorded prefill length plus decode steps, saves torch.compile's mega-cache, and then
republishes the artifact with that directory as `kcache/` and a `kcache` manifest entry (cache
key, shapes, file hashes; docs/artifact-format.md). The swap is atomic and every other file is a
hard link, so a killed warm leaves the published artifact as it was. The kcache's digest goes into
this user's trust store: the code in it was made here (kcache.py says how load uses it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from quantprep.errors import QuantprepError
from quantprep.format.artifact import DEFAULT_SHAPES, read_checked, republish, sha256_file
from quantprep.runtime import plan
from quantprep.runtime.aot import compile_regions
from quantprep.runtime.kcache import KCACHE, MEGACACHE, cache_env, cache_key, record_trust
from quantprep.runtime.torch_model import DECODE_STEPS, run_shapes, usable_shapes
from quantprep.targets import device_target, get_target

STEP_DONE = "quantprep-warm: step done"  # the child's line on stderr for each shape it ran (warm's bar)
AOT_TIMEOUT_S = 1800  # per phase of warm that builds or checks compiled MLP packages
# Inductor's FX-graph and AOT entries come back from the mega-cache; locks are per process.
NOT_SHIPPED = {"inductor/fxgraph", "inductor/aotautograd", "inductor/locks"}


def _child_main() -> None:
    """Runs in the fresh process that `warm` starts, with cache_env() already in its environment."""
    args = json.loads(sys.argv[1])
    from quantprep.runtime.load import load

    t0 = time.perf_counter()
    model = load(args["path"], device=args["device"], kcache=False)
    decided = None
    if args.get("plan") == "decide":  # the first child times the kernel paths; later ones get its plan
        decided = plan.decide(model, usable_shapes(model, args["shapes"]), args.get("int8_activations", False))
        plan.write(decided, Path(args["scratch"]))
        plan.apply(model, decided, model.device.type)
    elif args.get("plan"):
        plan.apply(model, args["plan"], model.device.type)
    if args["phase"] == "aot":
        # A process of its own: export leaves global state behind that changes torch.compile's
        # cache keys (the mega-cache then missed at load). Same Inductor dir as the compile phase:
        # its CPU ISA probes (compiled once per dir, seconds on 2 cores) are needed at load too.
        # AOTInductor's build directories (a wrapper.cpp in each) are not shipped: the packages
        # hold what they built.
        from quantprep.runtime.aot import build_packages

        entries = build_packages(model, Path(args["scratch"]), next(model.parameters()).dtype, args["format"])
        for d in (Path(args["scratch"]) / "inductor").iterdir():
            if d.is_dir() and any(d.glob("*.wrapper.cpp")):
                shutil.rmtree(d)
        print(json.dumps({"aot": entries, "plan": decided, "s": round(time.perf_counter() - t0, 3)}))
        return
    if args["phase"] == "aot_check":  # yet another process: what load will do, before shipping
        from quantprep.runtime.aot import check_packages

        bad = check_packages(model, Path(args["scratch"]), args["entries"], next(model.parameters()).dtype)
        print(json.dumps({"bad": bad}))
        return
    regions = compile_regions(model) if args["compile"] else 0
    shapes = usable_shapes(model, args["shapes"])
    timings = run_shapes(model, shapes, each=lambda _: print(STEP_DONE, file=sys.stderr, flush=True))
    report = {"shapes": shapes, "timings": timings, "compiled_regions": regions, "plan": decided,
              "s": round(time.perf_counter() - t0, 3)}
    if args["compile"]:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            raise QuantprepError("torch.compile produced no cache artifacts to save")
        blob, info = saved
        (Path(args["scratch"]) / MEGACACHE).write_bytes(blob)
        report["megacache"] = {kind: len(items) for kind, items in info.artifacts.items()}
    print(json.dumps(report))


# --- warm: build kcache/ and republish the artifact ----------------------------------------------

def _collect(scratch: Path) -> dict[str, dict]:
    files = {}
    for p in sorted(scratch.rglob("*")):
        rel = p.relative_to(scratch).as_posix()
        if any(rel == d or rel.startswith(d + "/") for d in NOT_SHIPPED):
            continue
        if p.is_file() and not p.is_symlink() and not p.name.endswith(".lock"):
            files[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return files


def warm(path: str | os.PathLike, device: str | None = None, shapes: list[int] | None = None,
         compile: bool | None = None, aot: bool | None = None, progress: bool = True, int8_activations: bool = False) -> dict:
    """Run the serving shapes in a fresh process and publish the artifact again with kcache/.
    With compile, also build compiled packages of the MLPs (aot.py: AOTInductor, else Inductor artifacts) unless `aot` is False.
    int8_activations: the kernel plan may also pick paths that round the activations to int8 (plan.py).
    Defaults come from the manifest's `serving` entry (written from the recipe at build)."""
    path = Path(path).absolute()
    manifest = read_checked(path)
    if get_target(manifest["target"]["name"]).kind == "graph":
        return warm_openvino(path, manifest, device, progress)
    serving = manifest.get("serving", {})
    device = device or manifest["target"]["device"]
    shapes = list(shapes or serving.get("shapes", DEFAULT_SHAPES))
    compile = serving.get("compile", False) if compile is None else compile
    aot = serving.get("aot", True) if aot is None else aot
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in shapes):
        raise QuantprepError(f"--shapes must be positive prefill lengths, got {shapes}")

    with tempfile.TemporaryDirectory(prefix="quantprep-warm-") as tmp:
        scratch = Path(tmp)
        env = dict(os.environ, **cache_env(scratch))
        target = device_target(device)
        env.update(target.warm_env(manifest, env))
        if msg := target.cache_warning(env):
            print(f"quantprep: warning: {msg}; kcache/ keeps none of the driver's kernels", file=sys.stderr)
        if progress:
            print(f"warm {path} on {device}: prefill {shapes} + {DECODE_STEPS} decode steps"
                  f"{', torch.compile' if compile else ''}{' + compiled MLP packages' if compile and aot else ''} (fresh processes)",
                  file=sys.stderr, flush=True)
        # one bar: each compiled-package build and check, then each shape
        with tqdm(total=(2 if compile and aot else 0) + len(shapes), desc="  warm", unit="step", disable=not progress,
                  file=sys.stderr) as bar:
            aot_report = {"aot": [], "plan": None, "s": 0.0}
            if compile and aot:
                aot_report = _aot_phases(path, device, env, scratch, bar, shapes=shapes, compile=compile, plan="decide",
                                         int8_activations=int8_activations)
            report = _run_child(path, device, "compile", env, step=lambda: bar.update(1), shapes=shapes, compile=compile,
                                scratch=str(scratch), plan=aot_report["plan"] or "decide", int8_activations=int8_activations)
            bar.update(bar.total - bar.n)  # shapes too long for the model were skipped
        report.update(aot=aot_report["aot"], plan=aot_report["plan"] or report["plan"], s=report["s"] + aot_report["s"])
        key = cache_key(device)  # this process may touch the device: the child had its own caches
        files = _collect(scratch)
        entry = {"key": key, "shapes": report["shapes"], "compile": compile, "files": files,
                 "megacache": report.get("megacache", {}), "aot": report["aot"]}
        if env.get("TRITON_XPU_GEN_NATIVE_CODE") == "1":  # part of Triton's cache key: load must set it too
            entry["triton_native_code"] = True
        republish(path, scratch, KCACHE, [*files], {"kcache": entry})
        record_trust(entry)
    return dict(report, path=str(path), files=len(files), bytes=sum(f["size"] for f in files.values()), key=key)


def warm_openvino(path: Path, manifest: dict, device: str | None, progress: bool) -> dict:
    """An openvino artifact: openvino.genai compiles it once on `device` (CPU, GPU) with OpenVINO's
    model cache in a scratch directory, which ships as kcache/openvino/ (runtime/openvino.py)."""
    from quantprep.distribution.signing import configured_key
    from quantprep.runtime import openvino
    from quantprep.runtime.checked import check_compat, checked_artifact

    # what OpenVINO compiles here becomes trusted: the checks of a load first (hashes, signature policy,
    # no remote code, the compatibility key, the IR's files and bounds)
    manifest, target = checked_artifact(path, "once", configured_key())
    check_compat(path, manifest, target)
    openvino.check_files(path, manifest)
    if progress:
        print(f"warm {path} on OpenVINO {openvino.device_name(device)}: compile and generate one token", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="quantprep-warm-") as tmp:
        scratch = Path(tmp)
        report = openvino.warm(path, manifest, device, scratch)
        if not report["reused"]:  # a cache OpenVINO would only write again, each start: none ships
            print(f"quantprep: warning: OpenVINO {report['key']['openvino']} compiles this model again at every start, its "
                  "cache unused (docs/openvino.md); kcache/ unchanged", file=sys.stderr)
            return dict(report, path=str(path), files=0, bytes=0, what="nothing (OpenVINO does not reuse its cache of this model)")
        files = _collect(scratch)
        entry = {"key": report["key"], "shapes": report["shapes"], "compile": False, "files": files}
        republish(path, scratch, KCACHE, [*files], {"kcache": entry})
        record_trust(entry)
    return dict(report, path=str(path), files=len(files), bytes=sum(f["size"] for f in files.values()), what="OpenVINO's model cache")


def _aot_phases(path: Path, device: str, env: dict, scratch: Path, bar, **args) -> dict:
    """Build the compiled MLPs in each of aot.FORMATS in turn, loading and checking them in
    another fresh process, until one format passes whole: a package that fails to load (AOTInductor
    crashed on every package under the GPU machine's torch 2.11) or disagrees with eager is not
    shipped. If none passes, the last format's good packages ship, and load(compile=True)
    torch.compiles what they do not cover. Never fails the warm."""
    from quantprep.runtime.aot import FORMATS

    t0 = time.perf_counter()
    entries: list[dict] = []
    decided = None
    for i, fmt in enumerate(FORMATS):
        shutil.rmtree(scratch / "aot", ignore_errors=True)
        if i:
            bar.total += 2
            bar.refresh()
        try:
            # Timeouts: a package load hung on the H200; generous for building on 2 cores.
            report = _run_child(path, device, "aot", env, timeout=AOT_TIMEOUT_S, scratch=str(scratch), format=fmt, **args)
            entries, decided = report["aot"], decided or report["plan"]
            args["plan"] = decided or args["plan"]  # the packages trace the planned paths: the same plan for every phase
            bar.update(1)
            bad = _run_child(path, device, "aot_check", env, timeout=AOT_TIMEOUT_S, scratch=str(scratch), entries=entries, **args)["bad"]
            bar.update(1)
        except QuantprepError as e:
            entries, bad = [], {"*": str(e)}
        for file, problem in bad.items():
            print(f"quantprep: warning: {fmt} package {file} not shipped: {problem}", file=sys.stderr)
        if not bad:
            break
        entries = [e for e in entries if e["file"] not in bad]
    for rel in bad:
        (scratch / rel).unlink(missing_ok=True)  # "*" (the phase failed) names no file
    if not entries:
        print("quantprep: warning: no compiled MLP packages; load(compile=True) will torch.compile", file=sys.stderr)
    return {"aot": entries, "plan": decided, "s": round(time.perf_counter() - t0, 3)}


def _run_child(path: Path, device: str, phase: str, env: dict, timeout: float | None = None, step=None, **args) -> dict:
    """Run one phase in a fresh process; its last stdout line is the JSON report. step(): called
    for each STEP_DONE line the child writes to stderr."""
    arg = json.dumps(dict(args, path=str(path), device=device, phase=phase))
    proc = subprocess.Popen([sys.executable, "-c", "from quantprep.runtime.warm import _child_main; _child_main()", arg],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
    out, err = [], []

    def read_stderr(step=step):  # drains to the end whatever step() does: a full pipe would block the child
        for line in proc.stderr:
            if line.rstrip("\n") != STEP_DONE:
                err.append(line)
            elif step:
                try:
                    step()
                except Exception:  # the bar (a closed terminal): the warm goes on without it
                    step = None

    readers = [threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True),
               threading.Thread(target=read_stderr, daemon=True)]
    for r in readers:
        r.start()
    try:
        proc.wait(timeout=timeout)
    except BaseException as e:  # a timeout, or an interrupt: the child goes too
        proc.kill()
        proc.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            raise QuantprepError(f"{path}: warm-up run ({phase}) on {device} did not finish in {timeout:.0f} s") from None
        raise
    for r in readers:
        r.join()
    if proc.returncode != 0:
        tail = ("".join(err).strip().splitlines() or ["no output"])[-1]
        raise QuantprepError(f"{path}: warm-up run ({phase}) failed on {device}: {tail}")
    return json.loads("".join(out).strip().splitlines()[-1])


