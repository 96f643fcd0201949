"""The command line: exit codes, one-line errors, JSON output, and the build -> inspect -> verify flow."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quantprep.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, needle):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and needle in lines[0], err


def test_list(capsys):
    code, out, _ = run(capsys, "list", "--json")
    assert code == 0
    assert {r["name"] for r in json.loads(out)} >= {"smollm2-135m", "qwen2.5-1.5b"}


def test_unknown_recipe(capsys):
    one_line_error(*run(capsys, "build", "nope")[::2], "unknown recipe 'nope'")


@pytest.mark.parametrize("text,needle", [
    ("name = \n", "malformed TOML"),
    ("[source]\npath = '/x'\n[quantize]\nbitz = 4\n", "unknown key [quantize] 'bitz'"),
    ("[source]\npath = '/x'\n[quantize]\nbits = 3\n", "quantize.bits"),
    ("[source]\npath = '/x'\nhub = 'a/b'\n", "exactly one of"),
    ("[source]\npath = '/x'\n[build]\ntargets = ['tpu']\n", "unknown target 'tpu'"),
    ("[source]\npath = '/does/not/exist'\n", "does not exist"),
    ("surprise = 1\n[source]\npath = '/x'\n", "unknown key 'surprise'"),
    ("[source]\npath = '/x'\n[warm]\nshape = [1]\n", "unknown key [warm] 'shape'"),
    ("[source]\npath = '/x'\n[warm]\nshapes = [0, 16]\n", "warm.shapes"),
    ("[source]\npath = '/x'\n[warm]\ncompile = 'yes'\n", "warm.compile must be a bool"),
])
def test_bad_recipes(capsys, tmp_path, text, needle):
    recipe = tmp_path / "r.toml"
    recipe.write_text(text)
    one_line_error(*run(capsys, "build", str(recipe))[::2], needle)


def test_unknown_target_and_missing_paths(capsys, random_gptq, tmp_path):
    one_line_error(*run(capsys, "prepack", str(random_gptq), "--target", "tpu", "--out", str(tmp_path / "o"))[::2], "unknown target 'tpu'")
    one_line_error(*run(capsys, "prepack", str(tmp_path / "nope"), "--target", "cpu", "--out", str(tmp_path / "o"))[::2], "no such directory")
    one_line_error(*run(capsys, "verify", str(tmp_path / "nope"))[::2], "not a directory")
    one_line_error(*run(capsys, "build", "smollm2-135m", "--source", str(tmp_path / "nope"))[::2], "no such directory")


def test_hub_id_offline_says_so(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    one_line_error(*run(capsys, "build", "qwen2.5-1.5b", "--no-check")[::2], "not in the local Hugging Face cache")


def test_prepack_inspect_verify(capsys, random_gptq, tmp_path):
    out = tmp_path / "art"
    code, stdout, _ = run(capsys, "prepack", str(random_gptq), "--target", "cpu", "--out", str(out), "--json")
    assert code == 0 and json.loads(stdout)["path"] == str(out.absolute())
    code, stdout, _ = run(capsys, "inspect", str(out))
    assert code == 0 and "4-bit, group 64, desc_act=True" in stdout
    code, stdout, _ = run(capsys, "verify", str(out), "--json")
    report = json.loads(stdout)
    assert code == 0 and report["hashes"] == "ok" and report["numeric"] == "passed" and all(r["ok"] for r in report["probes"])
    shard = next(out.glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(data)
    one_line_error(*run(capsys, "verify", str(out))[::2], shard.name)


def test_build_with_source_loads_in_fresh_process(tiny_gptq4, tmp_path):
    """The real console script: build from an existing GPTQ dir, then the fresh-process generate.
    --no-warm: the recipe's warm (torch.compile and compiled MLP packages, 100 s here) is tested by
    test_fused_mlp's build, test_warm and test_aot."""
    exe = [sys.executable, "-m", "quantprep"]
    proc = subprocess.run(exe + ["build", "smollm2-135m", "--source", str(tiny_gptq4), "--out", str(tmp_path), "--no-warm", "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [result] = json.loads(proc.stdout)
    assert result["target"] == "cpu" and result["check"]["load_s"] > 0
    assert (tmp_path / "cpu" / "manifest.json").is_file()
    bad = subprocess.run(exe + ["build", "smollm2-135m", "--target", "tpu"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "unknown target" in bad.stderr


def test_build_every_target_on_cpu_only_machine_and_verify_each(capsys, tmp_path):
    """`build qwen2.5-1.5b --source GPTQ_DIR` makes xpu, cuda and cpu artifacts without a GPU; each
    passes its own verify numerically: cpu on its kernels, xpu through the emulator, cuda through its
    CPU path (tinygemm's copy of the codes at decode sizes, the Triton GEMM's above 16 rows)."""
    from quantprep.build.synthetic import write_random_checkpoint

    cfg = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
    gptq = write_random_checkpoint(tmp_path / "gptq", cfg, bits=4, group_size=128, desc_act=True, sym=True)
    code, out, err = run(capsys, "build", "qwen2.5-1.5b", "--source", str(gptq), "--out", str(tmp_path / "art"), "--no-check", "--json")
    assert code == 0, err
    assert {r["target"] for r in json.loads(out)} == {"xpu", "cuda", "cpu"}
    reports = {}
    for target in ("xpu", "cuda", "cpu"):
        code, out, err = run(capsys, "verify", str(tmp_path / "art" / target), "--json")
        assert code == 0, err
        reports[target] = json.loads(out)
    import torch

    for target, emulated in (("cpu", False), ("xpu", True), ("cuda", not torch.cuda.is_available())):
        r = reports[target]
        assert r["numeric"] == "passed" and r["emulated"] == emulated, r
        assert {p["rows"] for p in r["probes"]} == {1, 4, 520} and all(p["ok"] for p in r["probes"])


def test_out_that_is_not_an_artifact_is_refused(capsys, random_gptq, tmp_path):
    """`--out` names a folder of the user's (or the source itself): refused, nothing touched;
    --force replaces a non-artifact folder but never the source or a folder holding it."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    one_line_error(*run(capsys, "prepack", str(random_gptq), "--target", "cpu", "--out", str(mine))[::2],
                   "is not a quantprep artifact")
    assert (mine / "notes.txt").read_text() == "keep me" and [p.name for p in mine.iterdir()] == ["notes.txt"]
    before = sorted(p.name for p in random_gptq.iterdir())
    for out in (random_gptq, tmp_path):  # the source, and the folder above it
        for force in ([], ["--force"]):
            one_line_error(*run(capsys, "prepack", str(random_gptq), "--target", "cpu", "--out", str(out), *force)[::2],
                           "holds the source checkpoint")
    assert sorted(p.name for p in random_gptq.iterdir()) == before
    (tmp_path / "b" / "cpu").mkdir(parents=True)
    (tmp_path / "b" / "cpu" / "notes.txt").write_text("keep me")  # build writes OUT/<target>
    one_line_error(*run(capsys, "build", "smollm2-135m", "--source", str(random_gptq), "--out", str(tmp_path / "b"),
                        "--no-check", "--no-warm")[::2], "is not a quantprep artifact")
    assert (tmp_path / "b" / "cpu" / "notes.txt").is_file()
    assert run(capsys, "prepack", str(random_gptq), "--target", "cpu", "--out", str(tmp_path / "art"))[0] == 0
    assert run(capsys, "prepack", str(random_gptq), "--target", "cpu", "--out", str(tmp_path / "art"))[0] == 0  # an artifact: replaced
    assert run(capsys, "prepack", str(random_gptq), "--target", "cpu", "--out", str(mine), "--force")[0] == 0
    assert not (mine / "notes.txt").exists() and (mine / "manifest.json").is_file()


def test_installed_wheel_ships_its_recipes(tmp_path):
    """`pip install .` (a real, non-editable build) run from elsewhere: the recipes come with the package."""
    from conftest import REPO

    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site),
                           str(REPO)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    code = "import json, quantprep, quantprep.cli as c; print(quantprep.__file__); c.main(['list', '--json'])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(site)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, listing = proc.stdout.split("\n", 1)
    assert where.startswith(str(site))  # the installed copy, not the checkout
    assert {r["name"] for r in json.loads(listing)} >= {"smollm2-135m", "qwen2.5-1.5b"}


def test_user_recipe_dirs(capsys, tmp_path, monkeypatch):
    mine = tmp_path / "recipes"
    mine.mkdir()
    (mine / "mine.toml").write_text("description = 'my model'\n[source]\npath = '/x'\n")
    (mine / "smollm2-135m.toml").write_text("description = 'my override'\n[source]\npath = '/x'\n")
    code, out, _ = run(capsys, "list", "--json", "--recipes", str(mine))
    rows = {r["name"]: r["description"] for r in json.loads(out)}
    assert code == 0 and rows["mine"] == "my model" and rows["smollm2-135m"] == "my override" and "qwen2.5-1.5b" in rows
    monkeypatch.setenv("QUANTPREP_RECIPES", str(mine))
    code, out, _ = run(capsys, "list", "--json")
    assert code == 0 and {r["name"] for r in json.loads(out)} >= {"mine", "qwen2.5-1.5b"}
    monkeypatch.setenv("QUANTPREP_RECIPES", str(tmp_path / "nope"))
    one_line_error(*run(capsys, "list")[::2], "recipe directory does not exist")


def test_relative_source_is_a_path_and_a_hub_like_miss_says_what_was_tried(capsys, random_gptq, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(random_gptq.parent)
    rel = f"{random_gptq.name}/."  # exists relative to the working directory: a path, never a hub id
    assert run(capsys, "build", "smollm2-135m", "--source", rel, "--out", str(tmp_path / "o"), "--no-check", "--no-warm")[0] == 0
    code, _, err = run(capsys, "build", "smollm2-135m", "--source", "someorg/somemodel", "--out", str(tmp_path / "o2"))
    one_line_error(code, err, "no such directory")
    assert str(random_gptq.parent / "someorg" / "somemodel") in err and "as a hub id" in err and "local Hugging Face cache" in err


def test_files_follow_the_umask(random_gptq, tmp_path):
    """safetensors writes 0600: an artifact built by CI or root must still be readable by the serving user."""
    import os
    import stat

    from quantprep.build.pipeline import prepack

    old = os.umask(0o022)
    try:
        prepack(random_gptq, "cpu", tmp_path / "art")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "art").iterdir()}
    assert set(modes.values()) == {0o644}, modes


@pytest.mark.parametrize("argv,needle", [
    (["warm", "{art}", "--shapes", "1,,2"], "--shapes '1,,2': expected comma-separated integers"),
    (["warm", "{art}", "--shapes", "a"], "--shapes 'a'"),
    (["prepack", "{gptq}", "--target", "cpu", "--out", "{file}/art"], "is a file, so"),
    # /proc refuses new entries even to root: a real OSError from deep inside the write
    (["prepack", "{gptq}", "--target", "cpu", "--out", "/proc/quantprep-test/art", "--json"], "/proc/quantprep-test"),
])
def test_bad_values_and_os_errors_are_one_line(capsys, random_gptq, tmp_path, argv, needle):
    (tmp_path / "file").write_text("a file, not a directory")
    art = tmp_path / "art"
    assert run(capsys, "prepack", str(random_gptq), "--target", "cpu", "--out", str(art))[0] == 0
    argv = [a.format(art=art, gptq=random_gptq, file=tmp_path / "file") for a in argv]
    one_line_error(*run(capsys, *argv)[::2], needle)


def test_verify_exit_codes_for_failed_and_skipped(capsys, random_artifact):
    """exit 0 only for "passed"; "skipped" (another CPU ISA: the kernels cannot run here) needs --allow-skip."""
    from test_artifact import _rewrite_manifest

    _rewrite_manifest(random_artifact, lambda m: m["compat"].update(cpu_capability="NOT-THIS-ISA"))
    code, out, err = run(capsys, "verify", str(random_artifact), "--json")
    assert json.loads(out)["numeric"] == "skipped"
    one_line_error(code, err, "--allow-skip")
    code, out, _ = run(capsys, "verify", str(random_artifact), "--json", "--allow-skip")
    assert code == 0 and json.loads(out)["numeric"] == "skipped"


def test_the_command_line_puts_torch_tensors_on_huge_pages():
    """cli.main sets THP_MEM_ALLOC_ENABLE before PyTorch's first allocation reads it (after every
    import the command line makes): a large tensor then lands on transparent huge pages."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.is_file() or "[madvise]" not in mode.read_text():
        pytest.skip("needs transparent huge pages in madvise mode (where only the allocator's request turns them on)")
    code = """
import contextlib, io, os, sys
os.environ.pop("THP_MEM_ALLOC_ENABLE", None)
import quantprep.cli as cli
if sys.argv[1] == "cli":
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(["list"])
import torch
x = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
print(next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:")))
"""
    huge = {how: int(subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, check=True).stdout.split()[-1])
            for how in ("cli", "plain")}
    assert huge["plain"] == 0, huge  # without the setting, no huge pages: the check below can fail
    assert huge["cli"] >= 2 << 10, huge  # KiB: at least one 2 MiB page (the kernel may not find more under fragmentation)
