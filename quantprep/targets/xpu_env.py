"""What Intel's GPU runtime does, read from its source (docs/xpu.md cites each fact): which AOT
build of torch covers a card, when the driver's kernel cache is off, and what oneDNN's verbose
output says about the int4 matmul. Nothing here ran on a card: no Arc GPU is reachable from where
quantprep is built. Pure functions of their inputs, so they are tested on any machine.
"""

from __future__ import annotations

import os
import re

# SYCL's `architecture` enum (intel/llvm sycl/include/sycl/ext/oneapi/experimental/device_architecture.def),
# which torch.xpu.get_device_properties().architecture returns as an int (torch >= 2.6), mapped to the
# AOT names of torch.xpu.get_arch_list() (intel/torch-xpu-ops cmake/BuildFlags.cmake). Aliases share a
# value: dg2_g10 = acm_g10, and mtl_u = mtl_s = arl_u = arl_s.
ARCHITECTURES = {
    0x030DC00800: ("acm_g10", "dg2"),  # Arc A770, A750, A580
    0x030E000500: ("acm_g11", "dg2"),  # Arc A380, A310; Arc Pro A40, A50
    0x030E400000: ("acm_g12", "dg2"),  # Arc Pro A60
    0x030F000700: ("pvc", "pvc"),
    0x030F400700: ("pvc_vg", "pvc"),
    0x0311800400: ("mtl_u", "mtl-u"),  # Meteor Lake U/S, Arrow Lake U/S
    0x0311C00400: ("mtl_h", "mtl-h"),  # Meteor Lake H
    0x0312800400: ("arl_h", "arl-h"),  # Arrow Lake H
    0x0500400400: ("bmg_g21", "bmg"),  # Arc B580, B570; Arc Pro B50, B60
    0x0500800000: ("bmg_g31", "bmg"),
    0x0501000400: ("lnl_m", "lnl-m"),  # Lunar Lake (Arc 130V / 140V)
    0x0780000400: ("ptl_h", "ptl-h"),
    0x0780400100: ("ptl_u", "ptl-u"),
}

# Fallback when torch has no `architecture` (< 2.6): the marketing name. Integrated GPUs named just
# "Intel(R) Arc(TM) Graphics" are Meteor Lake or Arrow Lake H: the name cannot tell which.
CARD_NAMES = [
    (re.compile(r"Arc\(TM\) (Pro )?A\d+"), "dg2"),
    (re.compile(r"Arc\(TM\) (Pro )?B\d+"), "bmg"),
    (re.compile(r"Arc\(TM\) 1[34]0V"), "lnl-m"),
    (re.compile(r"Data Center GPU Max"), "pvc"),
]


def aot_name(architecture: int | None, device_name: str) -> str | None:
    """The torch AOT target name that covers this device, or None when it cannot be told."""
    if architecture is not None and architecture in ARCHITECTURES:
        return ARCHITECTURES[architecture][1]
    return next((aot for pattern, aot in CARD_NAMES if pattern.search(device_name)), None)


def arch_warning(device_name: str, arch_list: list[str], architecture: int | None = None) -> str | None:
    """A warning when torch has no AOT kernels for this device (every kernel JIT-compiles on first use)."""
    aot = aot_name(architecture, device_name)
    if aot is None:
        return (f"cannot tell which torch AOT build covers {device_name!r} (architecture {architecture}); "
                f"if it is not in torch.xpu.get_arch_list() = {arch_list}, every kernel JIT-compiles on first use")
    if aot in arch_list:
        return None
    return (f"torch.xpu.get_arch_list() = {arch_list} has no AOT build for {device_name!r} ({aot}): every kernel "
            f"is JIT-compiled on first use (minutes). Install a torch XPU wheel built for it, and keep the driver cache on so it happens once")


def parse_driver_version(text: str | None) -> tuple[int, int | None] | None:
    """`driver_version` of torch.xpu.get_device_properties() -> (build, hotfix). Level Zero reports
    "1.6.33578+38" (zeIntelGetDriverVersionString: Major.Minor.Build+Hotfix, for compute-runtime
    25.18.33578.38) or, from older drivers, "1.3.29735" (no hotfix)."""
    m = re.fullmatch(r"\s*\d+\.\d+\.(\d+)(?:\+(\d+))?\s*", text or "")
    return (int(m.group(1)), int(m.group(2)) if m.group(2) else None) if m else None


def igc_disables_cache(driver: tuple[int, int | None] | None) -> bool | None:
    """Whether any IGC_* variable switches the driver cache off on this compute-runtime, None if unknown.
    From 25.18.33578.36 (commit 3ce96b2, a backport of 6975f7b) and 25.31.34666.3 on master, through
    26.31.39395.13 (the newest tag read); not in 25.22.33944 or 25.27.34303. Later master hashes the
    IGC keys instead (cf9c3a7, in no tag yet)."""
    if driver is None:
        return None
    build, hotfix = driver
    if build == 33578:
        return None if hotfix is None else hotfix >= 36
    return build >= 34666


def neo_cache_state(env: dict[str, str], driver_version: str | None = None) -> dict:
    """Where the driver's kernel cache lives and whether it is on, per compute-runtime's
    shared/source/compiler_interface/default_cache_config.cpp and linux/os_compiler_cache_helper.cpp.
    `enabled` is None when it depends on a driver version that could not be read."""
    def state(enabled: bool | None, where: str | None, why: str) -> dict:
        return {"enabled": enabled, "dir": where, "why": why}

    if env.get("NEO_CACHE_PERSISTENT", "1").strip() == "0":
        return state(False, None, "NEO_CACHE_PERSISTENT=0")
    if env.get("NEO_CACHE_DIR"):
        where = env["NEO_CACHE_DIR"]
        if not os.path.isdir(where):
            return state(False, where, f"NEO_CACHE_DIR={where} does not exist (the driver does not create it)")
    elif env.get("XDG_CACHE_HOME"):
        if not os.path.isdir(env["XDG_CACHE_HOME"]):
            return state(False, None, f"XDG_CACHE_HOME={env['XDG_CACHE_HOME']} does not exist (no fallback to HOME)")
        where = os.path.join(env["XDG_CACHE_HOME"], "neo_compiler_cache")
    elif env.get("HOME"):
        where = os.path.join(env["HOME"], ".cache", "neo_compiler_cache")
    else:
        return state(False, None, "neither NEO_CACHE_DIR, XDG_CACHE_HOME nor HOME is set")
    igc = sorted(k for k in env if k.startswith("IGC_"))
    if igc:
        off = igc_disables_cache(parse_driver_version(driver_version))
        names = ", ".join(igc)
        if off:
            return state(False, where, f"{names} set: this driver ({driver_version}) turns its cache off for any IGC_* variable; unset them")
        if off is None:
            return state(None, where, f"{names} set: drivers from 25.18.33578.36 turn their cache off for any IGC_* variable "
                                      f"and this one's version ({driver_version or 'unknown'}) cannot say; unset them to be sure")
    size = env.get("NEO_CACHE_MAX_SIZE")
    limit = "no size limit" if size == "0" else f"evicts past {size} bytes" if size else "evicts past 1 GiB (NEO_CACHE_MAX_SIZE)"
    return state(True, where, f"on, {limit}")


def cache_warning(env: dict[str, str], driver_version: str | None = None) -> str | None:
    """One line for when the driver cache is (or may be) off, else None."""
    s = neo_cache_state(env, driver_version)
    return None if s["enabled"] else f"the Intel driver's kernel cache is {'off' if s['enabled'] is False else 'maybe off'}: {s['why']}"


def xpu_cache_report(env: dict[str, str], arch_list: list[str], device_name: str, architecture: int | None = None,
                     driver_version: str | None = None) -> list[str]:
    """What will make first runs slow on this XPU machine, and how to fix it (selftest's notes)."""
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


# oneDNN verbose lines (uxlfoundation/oneDNN doc/performance_considerations/verbose.md; src/common/verbose.cpp):
#   onednn_verbose[,v1][,timestamp],primitive,<exec|create:cache_miss|create:cache_hit|...>,<engine>,<primitive>,
#   <implementation>,<prop_kind>,<memory descriptors>,<attributes>,<auxiliary>,<problem>,<time ms>
# A creation line's time is the creation time. An implementation with "ref" in its name is a reference kernel.
def parse_onednn_verbose(lines) -> list[dict]:
    """The primitive lines of oneDNN verbose output, as dicts; other lines are skipped."""
    out = []
    for line in lines:
        parts = line.strip().split(",")
        if not parts or parts[0] != "onednn_verbose" or "primitive" not in parts[1:4]:
            continue
        rest = parts[parts.index("primitive", 1) + 1:]
        if len(rest) < 10 or rest[0] == "info":
            continue
        op, engine, kind, impl, prop, mds, attrs, aux, problem = rest[:9]
        try:
            ms = float(rest[-1])
        except ValueError:
            continue
        weights = next((d[4:].split(":")[0] if d.startswith("wei_") else d.split(":")[1]  # v0: wei_u4:..., v1: wei:u4:...
                        for d in mds.split() if d.startswith(("wei:", "wei_"))), None)
        out.append({"op": op, "engine": engine, "primitive": kind, "impl": impl, "prop_kind": prop,
                    "weights": weights, "attrs": attrs, "problem": problem, "ms": ms,
                    "reference": "ref" in re.split(r"[:_]", impl)})
    return out


def int4_matmul_report(lines) -> list[dict]:
    """Per int4 matmul problem: the implementation oneDNN picked, its creation time, execution times,
    and whether it is a reference (slow) kernel."""
    by_problem: dict[str, dict] = {}
    for r in parse_onednn_verbose(lines):
        if r["primitive"] != "matmul" or r["weights"] not in ("u4", "s4"):
            continue
        p = by_problem.setdefault(r["problem"], {"problem": r["problem"], "impl": r["impl"], "reference": r["reference"],
                                                 "create_ms": None, "exec_ms": []})
        if r["op"].startswith("create"):
            p["create_ms"] = (p["create_ms"] or 0.0) + r["ms"]
            p["create"] = r["op"].split(":", 1)[-1]
        else:
            p["exec_ms"].append(r["ms"])
        p["impl"], p["reference"] = r["impl"], r["reference"]
    return list(by_problem.values())


def onednn_notes(problems: list[dict]) -> list[str]:
    """Plain words for int4_matmul_report: which implementation ran each int4 matmul."""
    if not problems:
        return ["oneDNN verbose showed no int4 matmul (is ONEDNN_VERBOSE supported by this torch build?)"]
    notes = []
    for p in problems:
        create = f"created in {p['create_ms']:.1f} ms" if p["create_ms"] is not None else "creation not logged"
        run = f", runs in {sorted(p['exec_ms'])[len(p['exec_ms']) // 2]:.3f} ms" if p["exec_ms"] else ""
        slow = " -- a REFERENCE kernel: this card takes oneDNN's slow fallback path" if p["reference"] else ""
        notes.append(f"int4 matmul {p['problem']}: {p['impl']}, {create}{run}{slow}")
    return notes


# PyTorch's int4 primitive cache (aten/src/ATen/native/mkldnn/xpu/detail/DnnlExt.h) is keyed by M
# among others, thread_local, and holds 512 primitives per thread; oneDNN's own primitive cache holds
# ONEDNN_PRIMITIVE_CACHE_CAPACITY (default 1024) per process.
TORCH_INT4_CACHE = 512
ONEDNN_CACHE_DEFAULT = 1024


def primitive_cache_env(n_lengths: int, n_linear_shapes: int, env: dict[str, str]) -> dict[str, str]:
    """ONEDNN_PRIMITIVE_CACHE_CAPACITY to set so every warmed (prompt length x linear shape) primitive
    fits, unless the user set it; {} when the default holds them."""
    need = n_lengths * n_linear_shapes
    if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in env or need <= ONEDNN_CACHE_DEFAULT:
        return {}
    return {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(need)}
