"""`quantprep selftest`: on the user's own machine, run every kernel of a device on small random
problems against the dense reference, time them at M=1 and M=512, and report what makes first
runs slow there (for xpu: the int4 op's schema and whether quantprep's call fits it, AOT arch
coverage, the driver/SYCL kernel caches, and which oneDNN implementation runs the int4 matmul,
from ONEDNN_VERBOSE).
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
from quantprep.targets import device_target, get_target
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


def time_ms(module, K: int, M: int, dtype: torch.dtype, device: str, reps: int = 10) -> dict:
    x = torch.randn(M, K, device=device, dtype=dtype)
    with torch.no_grad():
        sync = device_target(device).synchronize
        sync()
        t = time.perf_counter()
        module(x)  # first call: includes any JIT compilation or kernel selection
        sync()
        first = time.perf_counter() - t
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            module(x)
            sync()
            times.append(time.perf_counter() - t)
    return {"first_ms": first * 1e3, "median_ms": statistics.median(times) * 1e3}


def _log_child(device: str) -> None:
    """In a fresh process with the target's log_env set: run its int4 module at M = 1 and 512."""
    target = device_target(device)
    for M in (1, 512):
        _, module, dtype = _module(target, 1024, 1024, 4, 128, True, device)
        time_ms(module, 1024, M, dtype, device, reps=3)


def kernel_log_report(device: str) -> tuple[list[dict], list[str]]:
    """Run the int4 matmuls in a fresh process with the target's kernel log on (xpu: oneDNN's verbose
    output) and read what it printed (Target.read_log): rows and notes."""
    target = device_target(device)
    proc = subprocess.run([sys.executable, "-c", "import sys; from quantprep.tools.selftest import _log_child; _log_child(sys.argv[1])", device],
                          env=dict(os.environ, **target.log_env), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise QuantprepError(f"selftest --device {device}: the kernel log run failed: {proc.stderr.strip().splitlines()[-1:]}")
    return target.read_log(proc.stdout.splitlines())


def environment(device: str) -> dict:
    return {"torch": torch.__version__} | device_target(device).describe()


OPENVINO_DEVICES = ("CPU", "GPU")  # OpenVINO's names, upper case: `--device GPU` is an Arc through OpenVINO's GPU plugin
# Tolerance by the plugin's inference precision (its default: bf16 or f16 where the hardware has it),
# as verify.REL_TOL by activation dtype.
OPENVINO_TOL = {"f32": 1e-4, "f16": 5e-3, "bf16": 2e-2}
OPENVINO_DECODER = {"model_type": "qwen2", "vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
                    "num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": True}


def _property(core, device: str, name: str):
    """A device property as JSON can hold it (an element type by its short name: bf16), None where not reported."""
    try:
        value = core.get_property(device, name)
    except RuntimeError:  # a property this device or plugin version does not report
        return None
    if hasattr(value, "get_type_name"):
        return value.get_type_name()
    return value if isinstance(value, (str, int, float, bool)) else [str(v) for v in value] if isinstance(value, list) else str(value)


def openvino_environment(core, device: str) -> dict:
    import openvino as ov

    info = {"openvino": ov.get_version(), "device": device}
    for field, prop in (("name", "FULL_DEVICE_NAME"), ("architecture", "DEVICE_ARCHITECTURE"), ("uarch", "GPU_UARCH_VERSION"),
                        ("execution_units", "GPU_EXECUTION_UNITS_COUNT"), ("driver", "GPU_DRIVER_VERSION"),
                        ("precision", "INFERENCE_PRECISION_HINT"), ("capabilities", "OPTIMIZATION_CAPABILITIES")):
        if (value := _property(core, device, prop)) is not None:
            info[field] = value
    return info


def run_openvino_selftest(device: str) -> dict:
    """OpenVINO's `device` (CPU, GPU): every case of CASES as the openvino target's IR pieces against
    the dense reference at the plugin's default precision (dynamic quantization off), then a small
    stateful decoder: compile cold and again from the model cache (whether it hit), 512-token
    prefill and decode timings."""
    import tempfile
    from pathlib import Path

    import numpy as np
    try:
        import openvino as ov
        import openvino.opset13 as ops
    except ImportError:
        raise QuantprepError(f"selftest --device {device}: openvino is not installed: pip install 'quantprep[openvino]'") from None

    from quantprep.targets.openvino import constants, linear

    core = ov.Core()
    if device not in core.available_devices and not any(d.startswith(device + ".") for d in core.available_devices):
        raise QuantprepError(f"selftest --device {device}: OpenVINO sees no {device} device here (it sees "
                             f"{', '.join(core.available_devices) or 'none'}); on an Arc, install Intel's GPU driver (docs/openvino.md)")
    env = openvino_environment(core, device)
    precision = env.get("precision", "f32")
    report = {"device": f"openvino:{device}", "environment": env, "checks": [], "timings": []}
    target = get_target("openvino")
    for bits, gs, act in CASES:
        gen = torch.Generator().manual_seed(bits + gs + act)
        raw = random_gptq_tensors(512, 256, bits, gs, False, act, True, bias=False, generator=gen)
        layer = prepare_layer(_validate_layer(f"selftest.int{bits}", raw, QuantConfig(bits, gs, False, act, "gptq")))
        tensors, meta = target.pack(layer, torch.float32)
        x = ops.parameter([-1, 512], ov.Type.f32)
        compiled = core.compile_model(ov.Model([linear(x, constants(tensors, meta, "m"), meta)], [x]), device,
                                      {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"})
        for M in CHECK_ROWS:
            xs = torch.randn(M, 512, generator=gen)
            ref = xs @ layer.dequantize()
            y = torch.from_numpy(compiled(xs.numpy())[0])
            rel = ((y - ref).norm() / ref.norm()).item()
            tol = OPENVINO_TOL.get(precision, 2e-2)
            report["checks"].append({"bits": bits, "group_size": gs, "act_order": act, "M": M, "kernel": target.kernel(bits),
                                     "dtype": precision, "rel_err": rel, "tol": tol, "ok": bool(rel <= tol)})
    with tempfile.TemporaryDirectory(prefix="quantprep-selftest-") as tmp:
        from quantprep.build.pipeline import prepack
        from quantprep.build.synthetic import write_random_checkpoint

        gptq = write_random_checkpoint(Path(tmp) / "gptq", OPENVINO_DECODER, bits=4, group_size=128, desc_act=True, sym=True)
        prepack(gptq, "openvino", Path(tmp) / "ov")
        xml = str(Path(tmp) / "ov" / "openvino_model.xml")
        compile_s = {}
        for kind in ("cold", "warm"):  # the second from the model cache the first wrote
            t = time.perf_counter()
            model = ov.Core().compile_model(ov.Core().read_model(xml), device, {"CACHE_DIR": str(Path(tmp) / "cache")})
            compile_s[kind] = time.perf_counter() - t
            hit = bool(model.get_property("LOADED_FROM_CACHE"))
        report["compile"] = {"cold_s": compile_s["cold"], "warm_s": compile_s["warm"], "cache_hit": hit}
        request = model.create_infer_request()

        def step(ids, past: int) -> float:
            t = time.perf_counter()
            request.infer({"input_ids": ids, "attention_mask": np.ones((1, past + ids.shape[1]), np.int64),
                           "position_ids": np.arange(past, past + ids.shape[1])[None], "beam_idx": np.zeros(1, np.int32)})
            return time.perf_counter() - t

        ids = np.random.default_rng(0).integers(0, OPENVINO_DECODER["vocab_size"], (1, 512))
        for kind in ("first", "median"):
            prefills, decodes = [], []
            for _ in range(1 if kind == "first" else 3):
                request.reset_state()
                prefills.append(step(ids, 0))
                decodes += [step(ids[:, :1], 512 + i) for i in range(8)]
            report["timings"].append({"what": f"decoder {OPENVINO_DECODER['num_hidden_layers']}x{OPENVINO_DECODER['hidden_size']} "
                                              f"({kind} call)", "prefill_512_ms": statistics.median(prefills) * 1e3,
                                      "decode_ms": statistics.median(decodes) * 1e3})
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report


def run_selftest(device: str, K: int = 1024, N: int = 1024) -> dict:
    if device in OPENVINO_DEVICES:
        return run_openvino_selftest(device)
    target = device_target(device)
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
    if target.log_env:
        report["kernel_log"], notes = kernel_log_report(device)
        report["environment"]["notes"] = report["environment"].get("notes", []) + notes
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report


def summary_lines(report: dict) -> list[str]:
    """The report in plain lines: what `quantprep selftest` prints and what --report files carry."""
    env = report["environment"]
    lines = [f"selftest {report['device']}: " + ", ".join(f"{k}={v}" for k, v in env.items() if k != "notes")]
    for c in report["checks"]:
        lines.append(f"  {'PASS' if c['ok'] else 'FAIL'} int{c['bits']} group {c['group_size']} act_order={c['act_order']} M={c['M']} "
                     f"{c['kernel']} ({c['dtype']}): rel err {c['rel_err']:.2e} (tol {c['tol']:.0e})")
    if "compile" in report:
        c = report["compile"]
        lines.append(f"  compile cold {c['cold_s']:.2f} s, warm {c['warm_s']:.2f} s (model cache {'hit' if c['cache_hit'] else 'MISSED'})")
    for t in report["timings"]:
        if "what" in t:
            lines.append(f"  time {t['what']}: prefill 512 tokens {t['prefill_512_ms']:.1f} ms, decode {t['decode_ms']:.2f} ms/token")
        else:
            lines.append(f"  time int{t['bits']} {t['K']}x{t['N']} M={t['M']}: first call {t['first_ms']:.2f} ms, then {t['median_ms']:.3f} ms")
    lines += [f"  note: {note}" for note in env.get("notes", [])]
    return lines


def shareable(report: dict) -> dict:
    """The report as a file to post publicly: quantprep's version, the report, and its summary lines,
    with this machine's paths, user name and host name taken out of every string (keys included)."""
    import getpass
    import re
    import socket

    from quantprep.version import __version__

    home = os.path.expanduser("~")
    names = sorted({n for n in (getpass.getuser(), socket.gethostname()) if n and len(n) > 1}, key=len, reverse=True)
    paths = re.compile(r"(?<![\w.])(?:/|[A-Za-z]:\\)[^\s:,;'\"()]*")  # POSIX and Windows absolute paths
    words = [re.compile(rf"(?<!\w){re.escape(n)}(?!\w)") for n in names]

    def scrub(text: str) -> str:
        text = text.replace(home, "~") if len(home) > 1 else text
        text = paths.sub("<path>", text)
        for word in words:
            text = word.sub("<redacted>", text)
        return text

    def walk(value):
        if isinstance(value, str):
            return scrub(value)
        if isinstance(value, dict):
            return {scrub(str(k)): walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        return value

    return {"quantprep": __version__, "summary": walk(summary_lines(report)), "report": walk(report)}
