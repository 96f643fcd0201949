"""`quantprep selftest`: on the user's own machine, run every kernel of a device on small random
problems against the dense reference, time them at M=1 and M=512, and report what makes first
runs slow there (for xpu: AOT arch coverage and the driver/SYCL kernel caches).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from .errors import QuantprepError
from .prepack import unpack_layer
from .source import QuantConfig, _validate_layer
from .synthetic import random_gptq_tensors
from .targets import get_target
from .targets.xpu import XPU_ARCH_NAMES, arch_warning
from .verify import REL_TOL

CASES = [(bits, gs, act) for bits in (4, 8) for gs in (128, -1) for act in (True, False)]
CHECK_ROWS = (1, 8, 520)  # decode, small prefill, and past every kernel switch by row count (verify.PROBE_SIZES)


def _module(target, K: int, N: int, bits: int, gs: int, act: bool, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    raw = random_gptq_tensors(K, N, bits, gs, False, act, True, bias=False, generator=gen)
    layer = unpack_layer(_validate_layer(f"selftest.int{bits}", raw, QuantConfig(bits, gs, False, act, "gptq")))
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


def xpu_cache_report(env: dict[str, str], arch_list: list[str], device_name: str) -> list[str]:
    """What will make first runs slow on this XPU machine, and how to fix it."""
    notes = []
    card = next((c for c in XPU_ARCH_NAMES if c in device_name), None)
    if card is None:
        notes.append(f"device {device_name!r} is not an A770 or B580; arch coverage not checked")
    elif warning := arch_warning(device_name, arch_list):
        notes.append(warning)
    else:
        notes.append(f"torch has AOT kernels for the {card} ({', '.join(a for a in arch_list if a in XPU_ARCH_NAMES[card])})")
    igc = sorted(k for k in env if k.startswith("IGC_"))
    if igc:
        notes.append(f"driver kernel cache DISABLED: {', '.join(igc)} set (any IGC_* variable turns it off); unset them")
    elif env.get("NEO_CACHE_PERSISTENT") == "0":
        notes.append("driver kernel cache DISABLED: NEO_CACHE_PERSISTENT=0; unset it")
    else:
        where = env.get("NEO_CACHE_DIR") or os.path.join(env.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "neo_compiler_cache")
        notes.append(f"driver kernel cache on (NEO_CACHE_PERSISTENT default 1), at {where}")
    if env.get("SYCL_CACHE_PERSISTENT") != "1":
        notes.append("SYCL program cache off: set SYCL_CACHE_PERSISTENT=1 (and SYCL_CACHE_DIR) to keep JIT results across processes")
    else:
        notes.append(f"SYCL program cache on, at {env.get('SYCL_CACHE_DIR', '~/.cache/libsycl_cache')}")
    notes.append("oneDNN primitives are not cached across processes: warm the serving shapes in-process after load")
    return notes


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
        arch = torch.xpu.get_arch_list()
        info.update(name=props.name, driver=getattr(props, "driver_version", "?"), arch_list=arch,
                    notes=xpu_cache_report(dict(os.environ), arch, props.name))
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
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report
