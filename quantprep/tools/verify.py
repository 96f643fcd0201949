"""Numeric spot check that travels with the artifact.

At build time, for a few layers (first, middle, last) prepack stores a random input and the output
of the dense float32 dequantized reference computed from the GPTQ source (`probes.safetensors`).
`quantprep verify` rebuilds just those modules from the artifact, runs the kernel and compares,
so an artifact can be checked on the serving machine without the source checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from quantprep.errors import ArtifactError
from quantprep.format.artifact import PROBES_FILE, read_checked
from quantprep.format.expert_names import count_experts, expert_linear
from quantprep.format.verified import hash_and_mark
from quantprep.runtime.torch_model import check_tensors, make_module

# Relative error bounds vs the float32 reference. The kernels round the activations and the
# folded zero (8 - z) * s to the activation dtype (bf16 has 8 mantissa bits: ~0.4% per element)
# and accumulate in float32; measured errors sit 3-10x below these bounds.
REL_TOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


# Probe sizes in rows (tokens): decode, the stored probe, and a prefill past every switch by row
# count (cpu int4 dequantizes from 384, cuda runs its Triton GEMM above 16, int8 dequantizes from 128).
PROBE_SIZES = (1, 4, 520)


def run_probes(path: Path, manifest: dict, target, device: str | None = None) -> list[dict]:
    """One row per probed layer and size: layer, rows, rel_err, tol, ok. Sizes past the stored
    rows repeat them (the reference rows repeat too), so one stored probe checks every kernel path."""
    dtype = getattr(torch, manifest["target"]["act_dtype"])
    tol = REL_TOL[manifest["target"]["act_dtype"]]
    device = device or target.device
    rows = []
    with safe_open(path / PROBES_FILE, framework="pt") as probes:
        names = sorted({k.rsplit(".", 1)[0] for k in probes.keys()})
        if unprobed := sorted(set(filter(expert_linear, manifest["modules"])) - set(names)):
            raise ArtifactError(f"{path / PROBES_FILE}: no probe for expert module {unprobed[0]} ({len(unprobed)} unprobed); every "
                                "expert is probed at build: rebuild the artifact")
        shard_handles = [safe_open(path / s, framework="pt", device=device) for s in manifest["shards"]]
        keys = [set(h.keys()) for h in shard_handles]
        for name in names:
            meta = manifest["modules"].get(name)
            if meta is None:
                raise ArtifactError(f"{path / PROBES_FILE}: probe {name} has no module in manifest.json; rebuild the artifact")
            module = make_module(path, target, name, meta, dtype)
            state = {}
            for part in list(module.state_dict(keep_vars=True)):
                key = f"{name}.{part}"
                h = next((h for h, k in zip(shard_handles, keys, strict=True) if key in k), None)
                if h is None:
                    raise ArtifactError(f"{path}: tensor {key} is missing from the artifact; rebuild it")
                state[part] = h.get_tensor(key)
            check_tensors(path, module, {part: (t.dtype, t.shape) for part, t in state.items()}, prefix=f"{name}.")  # as load does
            module.load_state_dict(state, assign=True)
            if problem := module.check_loaded():
                raise ArtifactError(f"{path}: tensor {name}.{problem}; the artifact is corrupt: rebuild it")
            x, y_ref = probes.get_tensor(f"{name}.x"), probes.get_tensor(f"{name}.y")
            for size in PROBE_SIZES:
                reps = -(-size // x.shape[0])
                xs, ys = x.repeat(reps, 1)[:size], y_ref.repeat(reps, 1)[:size]
                with torch.no_grad():
                    y = module(xs.to(device=device, dtype=dtype)).float().cpu()
                rel = ((y - ys).norm() / ys.norm()).item()
                rows.append({"layer": name, "rows": size, "rel_err": rel, "tol": tol, "ok": bool(rel <= tol)})
    return rows


def run_openvino_probes(path: Path, manifest: dict) -> list[dict]:
    """The openvino target's probes: each probed module rebuilt from the IR's own constants (the
    codes, zero points, scales, permutation and bias as written, found by name) and run in the CPU
    plugin computing exactly (f32, no dynamic quantization: runtime.openvino.EXACT)."""
    import openvino as ov
    import openvino.opset13 as ops

    from quantprep.format.artifact import OPENVINO_MODEL
    from quantprep.runtime.openvino import EXACT, check_files, checked_ir
    from quantprep.targets.openvino import ir_constants, linear

    check_files(path, manifest)
    core = ov.Core()
    model = checked_ir(path, manifest, marked=False)
    tol, rows = REL_TOL["float32"], []
    with safe_open(path / PROBES_FILE, framework="pt") as probes:
        for name in sorted({k.rsplit(".", 1)[0] for k in probes.keys()}):
            meta = manifest["modules"].get(name)
            consts = ir_constants(model, name, meta) if isinstance(meta, dict) else {}
            if not {"weight", "scales"} <= consts.keys():
                raise ArtifactError(f"{path / OPENVINO_MODEL}: module {name} (probed) is missing from the IR or manifest.json; rebuild the artifact")
            x = ops.parameter([-1, meta["in_features"]], ov.Type.f32)
            try:
                compiled = core.compile_model(ov.Model([linear(x, consts, meta)], [x]), "CPU",
                                              {k: v for k, v in EXACT.items() if k != "KV_CACHE_PRECISION"})
            except (KeyError, RuntimeError) as e:
                raise ArtifactError(f"{path / OPENVINO_MODEL}: module {name} does not match its metadata ({type(e).__name__}: "
                                    f"{str(e)[:200]}); rebuild the artifact") from None
            x_ref, y_ref = probes.get_tensor(f"{name}.x"), probes.get_tensor(f"{name}.y")
            for size in PROBE_SIZES:
                reps = -(-size // x_ref.shape[0])
                xs, ys = x_ref.repeat(reps, 1)[:size], y_ref.repeat(reps, 1)[:size]
                y = torch.from_numpy(compiled(xs.numpy())[0])
                rel = ((y - ys).norm() / ys.norm()).item()
                rows.append({"layer": name, "rows": size, "rel_err": rel, "tol": tol, "ok": bool(rel <= tol)})
    return rows


def verify_artifact(path: Path, strict: bool = True) -> dict:
    """Full check: manifest, every file's size and sha256, then the numeric probes, on the target's
    device or, where it is missing here, through the target's CPU path (emulated). `numeric` is
    "passed", "failed" or "skipped" (an artifact for another CPU ISA or torch: its kernels cannot run
    here); the rows are under `probes`. Raises ArtifactError on a damaged file, and with `strict` on
    a failed probe."""
    from quantprep.errors import ArtifactMismatch
    from quantprep.runtime.checked import check_compat
    from quantprep.targets import get_target

    path = Path(path)
    manifest = read_checked(path)
    hash_and_mark(path, manifest)
    report = {"path": str(path), "files": len(manifest["files"]), "hashes": "ok", "numeric": "skipped", "probes": [],
              "skipped": None, "target": manifest["target"]["name"]}
    if "kcache" in manifest:
        from quantprep.runtime.kcache import kcache_problem

        problem = kcache_problem(path, manifest, full_hash=True)
        if problem:  # load ignores such a cache (it is only speed); verify reports the damage
            raise ArtifactError(f"{problem}; re-run `quantprep warm {path}`")
        report["kcache_files"] = len(manifest["kcache"]["files"])
    target = get_target(manifest["target"]["name"])
    emulate = target.runtime_problem() is not None and target.cpu_emulator
    try:
        check_compat(path, manifest, target, emulate)
    except ArtifactMismatch as e:
        report["skipped"] = f"numeric check skipped: {e}"
        return report
    if target.kind == "graph":
        from quantprep.build.openvino_ir import tokenizer_difference

        report["probes"] = run_openvino_probes(path, manifest)
        if difference := tokenizer_difference(path, manifest["files"]):
            raise ArtifactError(f"{path}: the tokenizer IR is not what openvino-tokenizers converts here from the artifact's "
                                f"tokenizer files ({difference}); rebuild the artifact")
        report["tokenizer_ir"] = "rebuilt and equal" if "openvino_tokenizer.xml" in manifest["files"] else "none"
    else:
        report["probes"] = run_probes(path, manifest, target, "cpu" if emulate else None)
    report["emulated"] = emulate
    if (experts := count_experts(manifest["modules"]))["experts"]:
        report["experts"] = dict(experts, probed=count_experts({r["layer"] for r in report["probes"]})["experts"])
    bad = [r for r in report["probes"] if not r["ok"]]
    report["numeric"] = "failed" if bad else "passed"
    if bad:
        r = bad[0]
        report["error"] = (f"{path}: layer {r['layer']} at {r['rows']} rows differs from the dense reference (rel err "
                           f"{r['rel_err']:.2e} > {r['tol']:.0e}); the artifact is wrong: rebuild it")
        if strict:
            raise ArtifactError(report["error"])
    return report
