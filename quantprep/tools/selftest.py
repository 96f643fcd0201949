"""`quantprep selftest`: on the user's own machine, run every kernel of a device on small random
problems against the dense reference, time them at M=1 and M=512, and report what makes first
runs slow there (for xpu: AOT arch coverage, the driver/SYCL kernel caches, and which oneDNN
implementation runs the int4 matmul, from ONEDNN_VERBOSE).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch

from quantprep.build.prepack import prepare_layer
from quantprep.build.source import QuantConfig, _validate_layer
from quantprep.build.synthetic import random_gptq_tensors
from quantprep.errors import QuantprepError
from quantprep.targets import get_target
from quantprep.targets.intel_runtime import aot_name, arch_warning, int4_matmul_report, neo_cache_state
from quantprep.tools.verify import REL_TOL

CASES = [(bits, gs, act) for bits in (4, 8) for gs in (128, -1) for act in (True, False)]
CHECK_ROWS = (1, 8, 520)  # decode, small prefill, and past every kernel switch by row count (verify.PROBE_SIZES)


def _module(target, K: int, N: int, bits: int, gs: int, act: bool, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    raw = random_gptq_tensors(K, N, bits, gs, False, act, True, bias=False, generator=gen)
    layer = prepare_layer(_validate_layer(f"selftest.int{bits}", raw, QuantConfig(bits, gs, False, act, "gptq")))
    dtype = target.default_act_dtype
    tensors, meta = target.pack(layer, dtype)
    module = target.make_module(meta, dtype)
    module.load_state_dict({k: v.to(device) for k, v in tensors.items()}, assign=True)
    return layer, module, dtype


def check_case(module, layer, dtype: torch.dtype, device: str, M: int = 8) -> dict:
    x = torch.randn(M, layer.in_features)
    ref = x @ layer.dequantize()
    with torch.no_grad():
        y = module(x.to(device=device, dtype=dtype)).float().cpu()
    rel = ((y - ref).norm() / ref.norm()).item()
    tol = REL_TOL[str(dtype).removeprefix("torch.")]
    return {"rel_err": rel, "tol": tol, "ok": bool(rel <= tol)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "xpu":
        torch.xpu.synchronize()


def time_ms(module, K: int, M: int, dtype: torch.dtype, device: str, reps: int = 10) -> dict:
    x = torch.randn(M, K, device=device, dtype=dtype)
    with torch.no_grad():
        _sync(device)
        t = time.perf_counter()
        module(x)  # first call: includes any JIT compilation or kernel selection
        _sync(device)
        first = time.perf_counter() - t
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            module(x)
            _sync(device)
            times.append(time.perf_counter() - t)
    return {"first_ms": first * 1e3, "median_ms": statistics.median(times) * 1e3}


def xpu_cache_report(env: dict[str, str], arch_list: list[str], device_name: str, architecture: int | None = None,
                     driver_version: str | None = None) -> list[str]:
    """What will make first runs slow on this XPU machine, and how to fix it (intel_runtime.py)."""
    notes = []
    aot = aot_name(architecture, device_name)
    if warning := arch_warning(device_name, arch_list, architecture):
        notes.append(warning)
    else:
        notes.append(f"torch has AOT kernels for {device_name} ({aot})")
    cache = neo_cache_state(env, driver_version)
    if cache["enabled"]:
        notes.append(f"driver kernel cache {cache['why']}, at {cache['dir']} (driver {driver_version or 'version unknown'})")
    else:
        notes.append(f"driver kernel cache {'OFF' if cache['enabled'] is False else 'MAYBE OFF'}: {cache['why']}")
    if env.get("SYCL_CACHE_PERSISTENT") != "1":
        notes.append("SYCL program cache off: set SYCL_CACHE_PERSISTENT=1 (and SYCL_CACHE_DIR) to keep JIT results across processes")
    else:
        notes.append(f"SYCL program cache on, at {env.get('SYCL_CACHE_DIR', '~/.cache/libsycl_cache')}")
    notes.append("oneDNN builds one int4 primitive per prompt length, per thread, and keeps none across processes: "
                 "warm the serving lengths with load(warmup=True) in the serving thread, and pad prompts to them (quantprep.tools.serving)")
    return notes


def onednn_notes(problems: list[dict]) -> list[str]:
    """Plain words for intel_runtime.int4_matmul_report: which implementation ran each int4 matmul."""
    if not problems:
        return ["oneDNN verbose showed no int4 matmul (is ONEDNN_VERBOSE supported by this torch build?)"]
    notes = []
    for p in problems:
        create = f"created in {p['create_ms']:.1f} ms" if p["create_ms"] is not None else "creation not logged"
        run = f", runs in {sorted(p['exec_ms'])[len(p['exec_ms']) // 2]:.3f} ms" if p["exec_ms"] else ""
        slow = " -- a REFERENCE kernel: this card takes oneDNN's slow fallback path" if p["reference"] else ""
        notes.append(f"int4 matmul {p['problem']}: {p['impl']}, {create}{run}{slow}")
    return notes


def _onednn_child() -> None:
    """In a fresh process with ONEDNN_VERBOSE set: run the xpu int4 module at M = 1 and 512."""
    target = get_target("xpu")
    for M in (1, 512):
        _, module, dtype = _module(target, 1024, 1024, 4, 128, True, "xpu")
        time_ms(module, 1024, M, dtype, "xpu", reps=3)


def onednn_verbose_report() -> list[dict]:
    """Run the int4 matmuls in a fresh process with oneDNN's verbose output on (legacy level 2:
    creation and execution, understood by every oneDNN 3.x) and parse what it printed."""
    env = dict(os.environ, ONEDNN_VERBOSE="2")
    proc = subprocess.run([sys.executable, "-c", "from quantprep.tools.selftest import _onednn_child; _onednn_child()"],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise QuantprepError(f"selftest --device xpu: the oneDNN verbose run failed: {proc.stderr.strip().splitlines()[-1:]}")
    return int4_matmul_report(proc.stdout.splitlines())


def environment(device: str) -> dict:
    info: dict = {"torch": torch.__version__}
    if device == "cpu":
        info.update(cpu_capability=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads())
    elif device == "cuda":
        info.update(name=torch.cuda.get_device_name(), capability=".".join(map(str, torch.cuda.get_device_capability())),
                    cuda=torch.version.cuda)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    elif device == "xpu":
        props = torch.xpu.get_device_properties()
        arch, architecture, driver = torch.xpu.get_arch_list(), getattr(props, "architecture", None), getattr(props, "driver_version", None)
        info.update(name=props.name, driver=driver, architecture=architecture, aot_name=aot_name(architecture, props.name),
                    arch_list=arch, notes=xpu_cache_report(dict(os.environ), arch, props.name, architecture, driver))
    return info


def run_selftest(device: str, K: int = 1024, N: int = 1024) -> dict:
    target = get_target(device)
    problem = target.runtime_problem()
    if problem:
        raise QuantprepError(f"selftest --device {device}: {problem}")
    report = {"device": device, "environment": environment(device), "checks": [], "timings": []}
    for bits, gs, act in CASES:
        layer, module, dtype = _module(target, 512, 256, bits, gs, act, device)
        for M in CHECK_ROWS:
            row = {"bits": bits, "group_size": gs, "act_order": act, "M": M, "kernel": target.kernel(bits), "dtype": str(dtype)}
            report["checks"].append(row | check_case(module, layer, dtype, device, M))
    for bits in (4, 8):
        _, module, dtype = _module(target, K, N, bits, 128, True, device)
        for M in (1, 512):
            report["timings"].append({"bits": bits, "K": K, "N": N, "M": M} | time_ms(module, K, M, dtype, device))
    if device == "xpu":
        report["onednn"] = onednn_verbose_report()
        report["environment"]["notes"] += onednn_notes(report["onednn"])
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report
