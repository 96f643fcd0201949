"""Killed builds (issue 5, item 3): SIGKILL `quantprep prepack` at each stage of a rebuild over a
published artifact. Afterwards the path holds a complete artifact that verifies (the old one,
or the new one once the atomic swap happened), nothing half-written loads, and a rerun cleans
the leftovers and succeeds. A test-only seam (conftest.cli_paused_at) stops the process at a stage so the kill lands
there deterministically."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import cli_paused_at, leftovers

import quantprep
from quantprep.format.artifact import read_manifest
from quantprep.tools.verify import verify_artifact


def _prepack(gptq, out, *extra, pause_at=None, stderr=None):
    args = ["prepack", str(gptq), "--target", "cpu", "--out", str(out), *extra]
    cmd = cli_paused_at(pause_at, *args) if pause_at else [sys.executable, "-m", "quantprep", *args]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)


@pytest.mark.parametrize("stage", ["prepack", "write", "publish"])
def test_sigkill_during_rebuild(random_gptq, tmp_path, stage):
    from quantprep.build.pipeline import prepack

    out = tmp_path / "art"
    prepack(random_gptq, "cpu", out)  # the published artifact the killed rebuild replaces (in this process: it is not what is tested)
    before = read_manifest(out)

    err = tmp_path / "stderr.txt"
    with open(err, "w") as err_file:
        proc = _prepack(random_gptq, out, "--act-dtype", "float32", pause_at=stage, stderr=err_file)
        deadline = time.time() + 120
        while f"paused at {stage}" not in err.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, err.read_text()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    after = read_manifest(out)  # a complete artifact is at the path, old or new
    if stage == "publish":
        assert after["target"]["act_dtype"] == "float32"  # killed after the atomic swap: the new one
    else:
        assert after == before  # killed before publishing: the old one, untouched
    verify_artifact(out)
    quantprep.load(out)
    # Prepacking streams into a temporary sibling: a kill at any stage leaves one, which the next build removes.
    assert [p.split(".partial-")[0] for p in leftovers(out)] == [".art"], leftovers(out)

    assert _prepack(random_gptq, out, "--act-dtype", "float32").wait(timeout=120) == 0  # rerun
    assert leftovers(out) == []
    assert read_manifest(out)["target"]["act_dtype"] == "float32"
    verify_artifact(out)


def test_sigkill_first_build_leaves_nothing_loadable(random_gptq, tmp_path):
    out = tmp_path / "art"
    err = tmp_path / "stderr.txt"
    with open(err, "w") as err_file:
        proc = _prepack(random_gptq, out, pause_at="write", stderr=err_file)
        deadline = time.time() + 120
        while "paused at write" not in err.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not out.exists()
    with pytest.raises(quantprep.ArtifactError):
        quantprep.load(out)
    assert _prepack(random_gptq, out).wait(timeout=120) == 0
    assert leftovers(out) == []
    verify_artifact(out)


def test_sigkill_during_quantize(tiny_float, tmp_path):
    """Kill `quantprep build` in the quantize stage, after gptqmodel saved the checkpoint but
    before it was published to the cache: no artifact and no cached checkpoint appear, and a
    rerun cleans the partial directory and builds an artifact that verifies."""
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(f'[source]\npath = "{tiny_float}"\n[quantize]\nbits = 4\ngroup_size = 128\nsamples = 4\n')
    cache, out = tmp_path / "cache", tmp_path / "out"
    env = dict(os.environ, QUANTPREP_CACHE=str(cache))
    args = ["build", str(recipe), "--out", str(out), "--no-check"]
    cmd = cli_paused_at("quantize", *args)
    err = tmp_path / "stderr.txt"
    with open(err, "w") as err_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_file, start_new_session=True,
                                env=env)
        deadline = time.time() + 300

        def paused():  # gptqmodel's output, the pause's line with it, goes to its log in the build cache
            return any("paused at quantize" in p.read_text(errors="replace") for p in (err, *cache.glob("gptq/*.log")))

        while not paused() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, err.read_text()[-2000:]
        assert list(cache.glob("gptq/.*partial*"))  # the quantized checkpoint, saved but not published
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not out.exists()
    assert [p for p in (cache / "gptq").iterdir() if not p.name.startswith(".") and p.suffix != ".log"] == []  # no half checkpoint is cached

    rerun = subprocess.run([sys.executable, "-m", "quantprep", *args], capture_output=True, text=True, env=env, timeout=600)
    assert rerun.returncode == 0 and "quantized by gptqmodel on cpu" in rerun.stderr  # the device it ran on, said
    assert not list(cache.glob("gptq/.*partial*"))
    assert verify_artifact(out / "cpu") and read_manifest(out / "cpu")["source"]["quantized_on"] == "cpu"  # and recorded
