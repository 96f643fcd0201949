"""`quantprep selftest`: runs on cpu here (cuda on the GPU machine); its checks can fail; the xpu
cache report reads the environment the way the Intel runtimes do."""

import pytest
import torch

from quantprep.cli import main
from quantprep.targets import get_target
from quantprep.targets.xpu_env import xpu_cache_report
from quantprep.tools.selftest import _module, check_case


def test_selftest_cpu_passes_and_times(capsys):
    assert main(["selftest", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 24 and "FAIL" not in out  # 8 cases x M = 1, 8, 520
    assert "M=1:" in out and "M=512:" in out and "cpu_capability=" in out


def test_selftest_check_detects_a_broken_kernel():
    layer, module, dtype = _module(get_target("cpu"), 512, 256, 4, 128, True, "cpu")
    assert check_case(module, layer, dtype, "cpu")["ok"]
    module.scales_and_zeros[..., 0] *= 1.1  # scales 10% off
    assert not check_case(module, layer, dtype, "cpu")["ok"]


def test_selftest_refuses_a_missing_device(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present here")
    assert main(["selftest", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]


def test_xpu_cache_report(tmp_path):
    a770 = "Intel(R) Arc(TM) A770 Graphics"
    notes = xpu_cache_report({"HOME": str(tmp_path)}, ["pvc", "bmg"], a770)
    assert "JIT-compiled on first use" in notes[0] and "cache on" in notes[1] and "SYCL program cache off" in notes[2]
    notes = xpu_cache_report({"HOME": str(tmp_path), "IGC_ShaderDumpEnable": "1", "SYCL_CACHE_PERSISTENT": "1"}, ["dg2", "bmg"], a770,
                             driver_version="1.6.34666+3")
    assert "AOT kernels for" in notes[0] and "OFF: IGC_ShaderDumpEnable" in notes[1] and "SYCL program cache on" in notes[2]
    assert "(bmg)" in xpu_cache_report({}, ["bmg"], "Intel(R) Arc(TM) B580 Graphics")[0]


# --- OpenVINO's devices (the openvino target): CPU here, GPU on an Arc ---

def test_selftest_openvino_cpu_passes_times_and_hits_the_model_cache(capsys):
    pytest.importorskip("openvino", reason="the openvino extra (make setup installs it)")
    assert main(["selftest", "--device", "CPU"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 24 and "FAIL" not in out and "openvino=" in out
    assert "(model cache hit)" in out and "prefill 512 tokens" in out and "ms/token" in out


def test_selftest_openvino_check_detects_wrong_scales(monkeypatch):
    pytest.importorskip("openvino", reason="the openvino extra (make setup installs it)")
    from quantprep.targets import openvino
    from quantprep.tools.selftest import run_openvino_selftest

    pack = openvino.OpenVINOTarget.pack

    def off(self, layer, act_dtype):
        tensors, meta = pack(self, layer, act_dtype)
        return dict(tensors, scales=tensors["scales"] * 1.1), meta  # scales 10% off

    monkeypatch.setattr(openvino.OpenVINOTarget, "pack", off)
    report = run_openvino_selftest("CPU")
    assert not report["ok"] and all(not c["ok"] for c in report["checks"])


def test_selftest_openvino_gpu_is_refused_in_one_line_without_one(capsys):
    ov = pytest.importorskip("openvino", reason="the openvino extra (make setup installs it)")
    if "GPU" in ov.Core().available_devices:
        pytest.skip("OpenVINO sees a GPU here")
    assert main(["selftest", "--device", "GPU"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no GPU device" in err[0]


def test_the_report_file_names_no_path_user_or_host(tmp_path, capsys, monkeypatch):
    import getpass
    import json
    import os
    import socket

    from quantprep.tools import selftest

    home = os.path.expanduser("~")
    real = selftest.run_selftest

    def with_paths(device):  # an xpu report's notes name cache directories under the user's home
        report = real(device)
        report["environment"]["notes"] = [f"driver kernel cache on, at {home}/.cache/neo_compiler_cache",
                                          f"built by {getpass.getuser()} on {socket.gethostname()}"]
        return report

    monkeypatch.setattr(selftest, "run_selftest", with_paths)
    assert main(["selftest", "--device", "cpu", "--report", str(tmp_path / "r.json")]) == 0
    text = (tmp_path / "r.json").read_text()
    for secret in (home, getpass.getuser(), socket.gethostname(), str(tmp_path)):
        assert secret not in text, secret
    shared = json.loads(text)
    assert shared["report"]["ok"] and any("PASS" in line for line in shared["summary"]) and "<path>" in text


def test_the_hardware_report_form_asks_for_the_report_files():
    import yaml
    from conftest import REPO

    form = yaml.safe_load((REPO / ".github" / "ISSUE_TEMPLATE" / "hardware-report.yml").read_text())
    ids = {item.get("id") for item in form["body"]}
    assert {"device", "driver", "reports"} <= ids
    assert "--report" in form["body"][0]["attributes"]["value"] and "--device GPU" in form["body"][0]["attributes"]["value"]
