"""Stage 4, warm (issue 4): kcache/ is built in a fresh process, ships with the artifact, is used
by the next process (Inductor cache hits, no misses), and a foreign or corrupted cache is ignored
with a warning, never trusted. Real torch.compile on CPU (Inductor compiles C++ here)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import cli_paused_at, edit_manifest, fresh_process

import quantprep
from quantprep.format.artifact import MANIFEST, read_manifest, sha256_file
from quantprep.runtime.kcache import KCACHE, MEGACACHE, Kcache, activate, cache_key
from quantprep.runtime.warm import warm
from quantprep.tools.verify import verify_artifact

SHAPES = [1, 8]


def _build(root, name="art"):
    from conftest import TINY_LLAMA

    from quantprep.build.pipeline import build_artifacts
    from quantprep.build.synthetic import write_random_checkpoint

    gptq = write_random_checkpoint(root / "gptq", dict(TINY_LLAMA, num_hidden_layers=2), bits=4, group_size=64,
                                   desc_act=True, sym=False)
    build_artifacts(gptq, {"path": str(gptq)}, ["cpu"], lambda t: root / name, progress=False,
                    serving={"shapes": SHAPES, "compile": True})
    return root / name


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    art = _build(tmp_path_factory.mktemp("warm"))
    report = warm(art, aot=False, progress=False)  # the torch.compile + mega-cache path (AOT: test_aot.py)
    return art, report


# A fresh process: load with compile, run the warmed shapes, report Inductor's cache counters.
CHILD = """
import json, sys, torch
import quantprep
from quantprep.runtime.torch_model import run_shapes
from torch._dynamo.utils import counters
model = quantprep.load(sys.argv[1], compile=sys.argv[2] == "1", kcache=sys.argv[2] == "1")
if sys.argv[2] == "0":  # the control runs the kcache's kernel plan too, compiled afresh
    from pathlib import Path
    from quantprep.format.artifact import read_manifest
    from quantprep.runtime import plan
    from quantprep.runtime.aot import compile_regions
    kcache = read_manifest(Path(sys.argv[1]))["kcache"]
    plan.apply(model, plan.read(Path(sys.argv[1]) / "kcache", kcache), "cpu")
    compile_regions(model)
ids = torch.arange(8).view(1, 8) % model.config.vocab_size
with torch.inference_mode():
    logits = model(ids).logits[0, -1]
run_shapes(model, [1, 8])
print(json.dumps({"kcache": model.quantprep_kcache, "hit": counters["inductor"]["fxgraph_cache_hit"],
                  "miss": counters["inductor"]["fxgraph_cache_miss"], "logits": logits.float().tolist()}))
"""


def _fresh_load(art, tmp_path, use_kcache: bool) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{use_kcache}"),
               QUANTPREP_KCACHE_DIR=str(tmp_path / f"kcache-{use_kcache}"))
    return fresh_process(CHILD, art, int(use_kcache), env=env, timeout=600)[0]


def test_warm_writes_a_verifiable_kcache(warmed):
    art, report = warmed
    m = read_manifest(art)
    kc = m["kcache"]
    assert kc["key"] == cache_key("cpu") and kc["compile"] is True and kc["shapes"] == SHAPES
    assert MEGACACHE in kc["files"] and report["megacache"]["inductor"] >= 1
    assert any(rel.startswith("inductor/") for rel in kc["files"])  # the compiled C++ kernels
    assert not any(rel.startswith(("inductor/fxgraph", "inductor/aotautograd")) for rel in kc["files"])
    assert report["compiled_regions"] == 2 and report["aot"] == [] and kc["aot"] == []  # one MLP per layer
    shipped = {p.relative_to(art / KCACHE).as_posix() for p in (art / KCACHE).rglob("*") if p.is_file()}
    assert shipped == set(kc["files"])
    assert verify_artifact(art)["kcache_files"] == len(kc["files"])


def test_second_process_uses_the_cache(warmed, tmp_path):
    """The control (same artifact, kcache=False) misses, so this test fails if the cache is unused."""
    art, _ = warmed
    with_cache = _fresh_load(art, tmp_path, use_kcache=True)
    assert with_cache["kcache"]["status"] == "used"
    assert with_cache["kcache"]["loaded"]["inductor"] >= 1
    assert with_cache["hit"] >= 2 and with_cache["miss"] == 0, with_cache

    without = _fresh_load(art, tmp_path, use_kcache=False)
    assert without["kcache"]["status"] == "off" and without["hit"] == 0 and without["miss"] >= 2
    assert with_cache["logits"] == without["logits"]  # the same compiled code: bit-identical


def test_eager_and_compiled_agree(warmed):
    """Compilation must not change the model: compiled (cache-restored) vs eager logits."""
    import torch

    art, _ = warmed
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        eager = quantprep.load(art)(ids).logits.float()
    with torch.inference_mode():
        compiled = quantprep.load(art, compile=True)(ids).logits.float()  # the kcache's directories: during load only
    rel = ((compiled - eager).norm() / eager.norm()).item()
    # bf16 activations; Inductor fuses silu*mul in float32 where eager rounds to bf16 in between.
    assert rel < 2e-2, rel
    assert (compiled.argmax(-1) == eager.argmax(-1)).float().mean().item() >= 0.85


def _resign(art, edit):
    edit_manifest(art, edit)
    return read_manifest(art)


def test_foreign_key_is_ignored_with_a_warning(warmed, copy_of, monkeypatch):
    art = copy_of(warmed[0])
    m = _resign(art, lambda m: m["kcache"]["key"].update(torch="0.0.0"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with pytest.warns(UserWarning, match="kernel cache built for torch='0.0.0'"):
        status = activate(Kcache(art, m, trust=True), "cpu", compile=True)  # the edit made it another, untrusted cache
    assert status["status"] == "ignored"
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # nothing pointed at the foreign cache
    verify_artifact(art)  # a foreign cache is not damage: the artifact still verifies


def test_cache_for_another_device_is_ignored(warmed, copy_of):
    art = copy_of(warmed[0])
    m = _resign(art, lambda m: m["kcache"]["key"].update(device="cuda"))
    with pytest.warns(UserWarning, match="warmed on cuda, loading on cpu"):
        assert activate(Kcache(art, m), "cpu", compile=True)["status"] == "ignored"


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "extra"])
def test_corrupted_kcache_is_ignored_by_load_and_reported_by_verify(warmed, copy_of, damage, capsys, monkeypatch, tmp_path):
    from quantprep.cli import main

    # a fresh runtime copy: one made before from the intact files would be used as it is (it was hashed then)
    monkeypatch.setenv("QUANTPREP_KCACHE_DIR", str(tmp_path / "fresh-runtime"))
    art = copy_of(warmed[0])
    blob = art / KCACHE / MEGACACHE
    if damage == "flip":
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
    elif damage == "truncate":
        blob.write_bytes(blob.read_bytes()[:-10])
    elif damage == "delete":
        blob.unlink()
    else:
        (art / KCACHE / "inductor" / "planted.so").write_bytes(b"\x7fELF")
    m = read_manifest(art)
    with pytest.warns(UserWarning, match="kcache|kernel cache"):
        assert activate(Kcache(art, m), "cpu", compile=True)["status"] == "ignored"
    assert main(["verify", str(art)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and KCACHE in err[0], err
    quantprep.load(art)  # the weights are intact: the model still loads


def test_exec_runs_a_command_with_the_caches_active(warmed, tmp_path):
    art, _ = warmed
    env = dict(os.environ, QUANTPREP_KCACHE_DIR=str(tmp_path / "rt"))
    code = ("import os, json; print(json.dumps({k: os.environ.get(k) for k in "
            "('TORCHINDUCTOR_CACHE_DIR', 'TRITON_CACHE_DIR', 'NEO_CACHE_DIR', 'SYCL_CACHE_PERSISTENT')}))")
    proc = subprocess.run([sys.executable, "-m", "quantprep", "exec", str(art), "--", sys.executable, "-c", code],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    inductor = seen["TORCHINDUCTOR_CACHE_DIR"]
    assert inductor.startswith(str(tmp_path / "rt")) and seen["SYCL_CACHE_PERSISTENT"] == "1"
    root = os.path.dirname(inductor)
    assert seen["TRITON_CACHE_DIR"] == os.path.join(root, "triton")  # Triton kernels, eager ones too
    for rel, f in read_manifest(art)["kcache"]["files"].items():  # the runtime copy is the shipped cache
        if "__grp__" in rel:  # Triton's group files (cuda/xpu) are repointed at the copy
            continue
        assert hashlib.sha256(open(os.path.join(root, rel), "rb").read()).hexdigest() == f["sha256"]

    rc = subprocess.run([sys.executable, "-m", "quantprep", "exec", str(art), "--", sys.executable, "-c",
                         "import sys; sys.exit(3)"], env=env, timeout=120).returncode
    assert rc == 3  # the command's exit code passes through


def test_moved_triton_kernels_still_hit_in_the_runtime_copy(tmp_path, monkeypatch):
    """Triton's `__grp__` files name a kernel's files by absolute path (warm's scratch dir), and a
    group whose paths are gone is a miss: found on an H100, where quantprep's prefill GEMM was
    compiled again at every load. Real Triton compile of that kernel for an sm_80 target (Triton
    ships ptxas, no GPU needed), cache moved as warm and load move it, compiled again: a hit."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from quantprep.runtime.kcache import materialize
    from quantprep.targets.cuda import _int4_kn_gemm

    signature = {"a_ptr": "*bf16", "w_ptr": "*i32", "sz_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                 "GROUP": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    src = triton.compiler.ASTSource(_int4_kn_gemm, signature=signature,
                                    constexprs={"GROUP": 32, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32})
    hits = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    scratch = tmp_path / "scratch"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(scratch / "triton"))  # as warm's child has it
    triton.compile(src, target=GPUTarget("cuda", 80, 32))
    art = tmp_path / "art"
    art.mkdir()
    scratch.rename(art / KCACHE)  # republish moves the scratch dir into the artifact
    files = {p.relative_to(art / KCACHE).as_posix(): {"sha256": sha256_file(p), "size": p.stat().st_size}
             for p in (art / KCACHE).rglob("*") if p.is_file()}
    assert any(name.startswith("triton/") and "__grp__" in name for name in files)
    monkeypatch.setenv("QUANTPREP_KCACHE_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(materialize(art, {"kcache": {"files": files}}) / "triton"))  # as activate does
    triton.compile(src, target=GPUTarget("cuda", 80, 32))
    assert hits == [False, True]


def test_exec_and_warm_refuse_bad_input(tmp_path, capsys):
    from quantprep.cli import main

    art = _build(tmp_path)
    assert main(["exec", str(art), "--", "true"]) == 2
    assert "run `quantprep warm" in capsys.readouterr().err
    assert main(["warm", str(art), "--shapes", "0,8"]) == 2
    assert "positive prefill lengths" in capsys.readouterr().err
    assert main(["warm", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert "kcache" not in read_manifest(art)  # refused before anything was written


def test_warmup_replays_the_shapes(warmed):
    art, _ = warmed
    model = quantprep.load(art, warmup=True)
    assert [t["prefill"] for t in model.quantprep_warmup] == SHAPES


def test_rewarm_replaces_the_cache(warmed, copy_of):
    art = copy_of(warmed[0])
    warm(art, shapes=[4], compile=False, progress=False)
    m = read_manifest(art)
    assert m["kcache"]["shapes"] == [4] and m["kcache"]["compile"] is False
    assert not (art / KCACHE / MEGACACHE).exists()  # nothing of the previous warm survives
    verify_artifact(art)


def test_sigkill_during_warm_keeps_the_published_artifact(tmp_path):
    """Issue 5, kill point "during warm": the published artifact is untouched, the partial
    sibling is cleaned by the rerun, and the rerun succeeds."""
    art = _build(tmp_path)
    before = (art / MANIFEST).read_bytes()
    err = tmp_path / "stderr.txt"
    with open(err, "w") as err_file:
        proc = subprocess.Popen(cli_paused_at("warm", "warm", str(art), "--no-compile"), stdout=subprocess.DEVNULL, stderr=err_file)
        deadline = time.time() + 300
        while "paused at warm" not in err.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, err.read_text()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (art / MANIFEST).read_bytes() == before and not (art / KCACHE).exists()
    leftovers = [p.name for p in tmp_path.glob(f".{art.name}.partial-*")]
    assert leftovers  # the kill landed with the new artifact half-assembled beside the old one
    verify_artifact(art)
    quantprep.load(art)

    warm(art, compile=False, progress=False)  # rerun
    assert not list(tmp_path.glob(f".{art.name}.partial-*"))
    assert read_manifest(art)["kcache"]["shapes"] == SHAPES
    verify_artifact(art)


def test_a_reader_racing_a_writer_sees_the_new_artifact_not_an_error(tmp_path):
    """A manifest read just before a writer republishes (warm adding kcache/, a rebuild) no longer
    matches the directory: check_files alone fails; read_checked reads the new manifest and passes."""
    from quantprep.build.pipeline import prepack
    from quantprep.errors import ArtifactError
    from quantprep.format.artifact import check_files, read_checked

    art = _build(tmp_path)
    stale = read_manifest(art)
    gptq = tmp_path / "gptq"  # where _build wrote the checkpoint
    prepack(gptq, "cpu", art, "float32")  # other shard sizes
    with pytest.raises(ArtifactError, match="size"):
        check_files(art, stale, full_hash=False)
    assert read_checked(art, manifest=stale)["target"]["act_dtype"] == "float32"


def test_warm_shows_one_bar_counting_the_shapes_its_child_ran(random_artifact):
    """Issue 30: a bar per build stage. The shapes run in warm's fresh process; each one it finishes
    advances the parent's bar (the child's STEP_DONE lines never reach the user)."""
    proc = subprocess.run([sys.executable, "-m", "quantprep", "warm", str(random_artifact), "--no-compile", "--shapes", "1,4,8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    states = [x for x in proc.stderr.replace("\r", "\n").splitlines() if x.strip().startswith("warm:")]
    assert states and "3/3" in states[-1] and any("1/3" in x or "2/3" in x for x in states), proc.stderr[-2000:]
    assert "step done" not in proc.stderr
