"""`quantprep selftest`: runs on cpu here (cuda on the GPU machine); its checks can fail; the xpu
cache report reads the environment the way the Intel runtimes do."""

import pytest
import torch

from quantprep.cli import main
from quantprep.targets import get_target
from quantprep.tools.selftest import _module, check_case, xpu_cache_report


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
