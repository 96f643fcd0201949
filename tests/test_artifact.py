"""The artifact on disk: atomic publish, and every kind of damage refused with a typed one-line error."""

import json

import pytest
import torch
from conftest import edit_manifest, leftovers

import quantprep
from quantprep.build.pipeline import build_artifacts, prepack
from quantprep.errors import ArtifactError, ArtifactMismatch, SourceError
from quantprep.format.artifact import MANIFEST, read_manifest, write_json_durably
from quantprep.tools.verify import verify_artifact


def _rewrite_manifest(art, fn, fix_digest=True):
    if fix_digest:
        edit_manifest(art, fn)
        return
    m = json.loads((art / MANIFEST).read_text())
    fn(m)
    write_json_durably(art / MANIFEST, m)


def _shard(art):
    return art / read_manifest(art)["shards"][0]


def test_artifact_layout_and_manifest(random_artifact):
    m = read_manifest(random_artifact)
    assert m["target"]["name"] == "cpu" and m["target"]["act_dtype"] == "bfloat16"
    assert m["compat"] == {"torch": torch.__version__.split("+")[0], "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    assert set(m["files"]) == {p.name for p in random_artifact.iterdir()} - {MANIFEST}
    assert {"config.json", "probes.safetensors", *m["shards"]} <= set(m["files"])
    assert len(m["modules"]) == 4 and m["source"]["sha256"]  # q/k/v and gate/up fused: 7 Linears, 4 modules
    assert not list(random_artifact.parent.glob(".*partial*"))


def test_verify_passes_and_runs_numeric_probes(random_artifact):
    report = verify_artifact(random_artifact)
    assert report["hashes"] == "ok" and report["numeric"] == "passed" and len(report["probes"]) == 9  # 3 layers x 3 sizes
    assert all(r["ok"] and r["rel_err"] < r["tol"] for r in report["probes"])


def test_verify_catches_a_numerically_wrong_artifact(random_artifact):
    """Swap two layers' scales (hashes re-signed, so only the numeric probe can notice)."""
    from safetensors.torch import load_file, save_file

    from quantprep.format.artifact import sha256_file

    shard = _shard(random_artifact)
    t = load_file(shard)
    key = "model.layers.0.mlp.down_proj.scales_and_zeros"
    t[key] = t[key] * 1.5
    save_file(t, str(shard), metadata={"format": "pt"})
    _rewrite_manifest(random_artifact, lambda m: m["files"][shard.name].update(sha256=sha256_file(shard), size=shard.stat().st_size))
    with pytest.raises(ArtifactError, match="differs from the dense reference"):
        verify_artifact(random_artifact)
    assert verify_artifact(random_artifact, strict=False)["numeric"] == "failed"


def test_flipped_byte_is_caught_by_hash(random_artifact):
    shard = _shard(random_artifact)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(data)
    with pytest.raises(ArtifactError, match="sha256") as e:
        verify_artifact(random_artifact)
    assert shard.name in str(e.value)
    with pytest.raises(ArtifactError, match="sha256"):
        quantprep.load(random_artifact, verify="always")
    with pytest.raises(ValueError, match="verify=True: choose one of 'once', 'always', 'sizes'"):
        quantprep.load(random_artifact, verify=True)  # the old flag: a mode has a name now


@pytest.mark.parametrize("damage,needle", [
    ("truncate", "size"), ("delete", "missing"), ("extra", "unknown file"),
])
def test_damaged_files_refused_at_load(random_artifact, damage, needle):
    shard = _shard(random_artifact)
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "delete":
        shard.unlink()
    else:
        (random_artifact / "notes.txt").write_text("hi")
    with pytest.raises(ArtifactError, match=needle):
        quantprep.load(random_artifact)


@pytest.mark.parametrize("edit,needle", [
    (lambda m: m["quant"].update(bits=8), "manifest_sha256"),
    (lambda m: m["target"].update(act_dtype="float16"), "manifest_sha256"),
    (lambda m: m.update(format_version=99), "format_version"),
])
def test_edited_manifest_refused(random_artifact, edit, needle):
    _rewrite_manifest(random_artifact, edit, fix_digest=False)
    with pytest.raises(ArtifactError, match=needle):
        quantprep.load(random_artifact)


def test_unknown_format_version_refused_even_if_signed(random_artifact):
    _rewrite_manifest(random_artifact, lambda m: m.update(format_version=2))
    with pytest.raises(ArtifactError, match="format_version 2 is not supported"):
        quantprep.load(random_artifact)


@pytest.mark.parametrize("key,value", [("cpu_capability", "NOT-THIS-ISA"), ("torch", "2.9.0")])
def test_compat_mismatch_refused_with_rebuild_command(random_artifact, key, value):
    """Values no machine has (this test once named AVX2 as the foreign ISA, and failed on AVX2 machines)."""
    _rewrite_manifest(random_artifact, lambda m: m["compat"].update({key: value}))
    with pytest.raises(ArtifactMismatch) as e:
        quantprep.load(random_artifact)
    assert f"{key}={value}" in str(e.value) and "quantprep prepack" in str(e.value)


def test_wrong_tensor_dtype_refused(random_artifact):
    from safetensors.torch import load_file, save_file

    from quantprep.format.artifact import sha256_file

    shard = _shard(random_artifact)
    t = load_file(shard)
    t["model.layers.0.self_attn.o_proj.qweight"] = t["model.layers.0.self_attn.o_proj.qweight"].to(torch.int32)
    save_file(t, str(shard), metadata={"format": "pt"})
    _rewrite_manifest(random_artifact, lambda m: m["files"][shard.name].update(sha256=sha256_file(shard), size=shard.stat().st_size))
    with pytest.raises(ArtifactError, match="o_proj.qweight is torch.int32"):
        quantprep.load(random_artifact)


def test_failed_build_keeps_previous_artifact(random_gptq, random_artifact):
    before = read_manifest(random_artifact)["manifest_sha256"]
    (random_gptq / "config.json").write_text("{ not json")  # the rebuild fails while reading the source
    with pytest.raises(SourceError):
        prepack(random_gptq, "cpu", random_artifact)
    assert read_manifest(random_artifact)["manifest_sha256"] == before
    verify_artifact(random_artifact)
    assert leftovers(random_artifact) == []


def test_rebuild_replaces_atomically(random_gptq, random_artifact):
    before = read_manifest(random_artifact)["created"]
    prepack(random_gptq, "cpu", random_artifact, "float32")
    m = read_manifest(random_artifact)
    assert m["target"]["act_dtype"] == "float32" and m["created"] >= before
    verify_artifact(random_artifact)
    assert leftovers(random_artifact) == []


def test_loading_on_another_device_type_is_refused(random_artifact):
    with pytest.raises(ArtifactMismatch, match="packed for cpu kernels, cannot run on cuda"):
        quantprep.load(random_artifact, device="cuda")


def test_second_writer_waits_for_the_lock(random_gptq, tmp_path):
    """Hold the publish lock; a concurrent `quantprep prepack` to the same path must wait, then
    finish once it is released, leaving an artifact that verifies."""
    import fcntl
    import subprocess
    import sys
    import time

    out, err = tmp_path / "art", tmp_path / "stderr.txt"
    with open(tmp_path / ".art.lock", "a+") as lock, open(err, "w") as err_file:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, "-m", "quantprep", "prepack", str(random_gptq), "--target", "cpu",
                                 "--out", str(out), "--json"], stdout=subprocess.DEVNULL, stderr=err_file)
        deadline = time.time() + 120
        while "waiting for another quantprep" not in err.read_text() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(1)
        assert proc.poll() is None and not out.exists(), err.read_text()  # blocked on the lock, nothing published
        fcntl.flock(lock, fcntl.LOCK_UN)
        assert proc.wait(timeout=120) == 0, err.read_text()
    verify_artifact(out)
    assert leftovers(out) == []


def test_not_enough_disk_space_is_refused_before_writing(random_gptq, tmp_path, monkeypatch):
    """The free-space check runs before anything is written (the disk itself cannot be filled
    safely in a test, so `shutil.disk_usage` reports 1 MiB free)."""
    import shutil
    from collections import namedtuple

    from quantprep.errors import QuantprepError

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, (1 << 30) - (1 << 20), 1 << 20))
    out = tmp_path / "art"
    with pytest.raises(QuantprepError, match=r"GiB free, the artifact needs .* GiB"):
        prepack(random_gptq, "cpu", out)
    assert not out.exists() and leftovers(out) == []


def test_a_shard_frees_each_tensor_once_written(tmp_path):
    """ShardWriter's writing shard shrinks as it is written (release=True), with the same bytes."""
    import weakref

    from safetensors.torch import load_file

    from quantprep.format.artifact import write_safetensors

    tensors = {"a": torch.randn(64, 8), "b": torch.arange(10, dtype=torch.int32), "c": torch.randn(3).half()}
    kept = write_safetensors(tmp_path / "kept.safetensors", dict(tensors), {"format": "pt"})
    given = {k: v.clone() for k, v in tensors.items()}
    alive = [weakref.ref(v) for v in given.values()]
    released = write_safetensors(tmp_path / "released.safetensors", given, {"format": "pt"}, release=True)
    assert released == kept and given == {}
    assert all(r() is None for r in alive)  # nothing else held them
    assert all(torch.equal(v, tensors[k]) for k, v in load_file(tmp_path / "released.safetensors").items())
    header_len = int.from_bytes((tmp_path / "kept.safetensors").read_bytes()[:8], "little")
    assert (8 + header_len) % 64 == 0  # the data starts 64-byte aligned: so does a mapped tensor at such an offset


def test_the_digest_is_the_written_files_sha256_across_write_chunks(tmp_path):
    """write_safetensors hashes in a second thread while it writes, 16 MiB at a time: a tensor of
    several chunks with a partial last one, then small tensors of other dtypes: the digest is the file's sha256."""
    from safetensors.torch import load_file

    from quantprep.format.artifact import WRITE_CHUNK, sha256_file, write_safetensors

    gen = torch.Generator().manual_seed(0)
    tensors = {"big": torch.randn(WRITE_CHUNK // 4 * 2 + 12345, generator=gen), "ids": torch.arange(7, dtype=torch.int32),
               "h": torch.randn(5, 3, generator=gen).half()}
    digest = write_safetensors(tmp_path / "t.safetensors", dict(tensors), {"format": "pt"})
    assert digest == sha256_file(tmp_path / "t.safetensors")
    assert all(torch.equal(v, tensors[k]) for k, v in load_file(tmp_path / "t.safetensors").items())


def test_the_shard_index_lists_every_tensor_of_every_shard(random_gptq, tmp_path):
    """The writer frees a shard's tensors as it writes them; the index must still name them all (it
    once read the names from the dict the writer was emptying). One tensor per shard here."""
    from safetensors import safe_open

    from quantprep.format.artifact import WEIGHTS_INDEX

    out = tmp_path / "art"
    build_artifacts(random_gptq, {"path": str(random_gptq)}, ["cpu", "xpu"], lambda t: out / t, progress=False, shard_bytes=1)
    for target in ("cpu", "xpu"):
        art = out / target
        shards = sorted(art.glob("model-*.safetensors"))
        assert len(shards) > 3
        where = {}
        for shard in shards:
            with safe_open(shard, "pt") as f:
                where.update(dict.fromkeys(f.keys(), shard.name))
        assert json.loads((art / WEIGHTS_INDEX).read_text())["weight_map"] == where


@pytest.mark.parametrize("fused", [
    "x",
    {"members": ["gate_proj", "up_proj"], "sizes": [64.0, 64.0]},
    {"members": ["gate_proj", "up_proj"], "sizes": [True, 127]},
    {"members": ["gate_proj", "up_proj"], "sizes": [128]},
    {"members": "gate_proj", "sizes": [64, 64]},
    {"members": ["gate_proj", 3], "sizes": [64, 64]},
    {"members": ["gate_proj", "up_proj"], "sizes": [0, 128]},
    {"members": ["gate_proj", "up_proj"], "sizes": [64, 64], "extra": 1},
])
def test_malformed_fused_metadata_is_refused_in_one_line(random_artifact, fused):
    """A manifest's `fused` entry is shaped before anything reads it: a hostile one (a float or bool
    size, a string for a list) was a TypeError traceback at load or at the first forward."""
    name = next(n for n, m in read_manifest(random_artifact)["modules"].items() if "fused" in m)
    _rewrite_manifest(random_artifact, lambda m: m["modules"][name].update(fused=fused))
    for run in (lambda: quantprep.load(random_artifact), lambda: verify_artifact(random_artifact)):
        with pytest.raises(ArtifactError, match=rf"module {name!r} has malformed metadata"):
            run()


@pytest.mark.parametrize("target,field,value", [("xpu", "kernel_group_size", 7), ("xpu", "padded_in", "160"),
                                                ("cuda", "inner_k_tiles", 3), ("cuda", "padded_out", -1), ("cuda", "kernel_group_size", "64"),
                                                ("cpu", "padded_in", 1 << 40), ("cpu", "pack_block_n", 7), ("cpu", "padded_out", True)])
def test_target_metadata_is_checked_at_the_boundary(random_gptq, tmp_path, target, field, value):
    """Each target's layout fields are checked before its module is made (Target.meta_problem), in one
    line naming the module; a down_proj's (K=160, a partial group) edited to what pack never writes."""
    art = tmp_path / target
    prepack(random_gptq, target, art)
    edit_manifest(art, lambda m: m["modules"]["model.layers.0.mlp.down_proj"].update({field: value}))
    with pytest.raises(ArtifactError, match=f"module model.layers.0.mlp.down_proj has malformed {target} metadata") as e:
        quantprep.load(art, device="cpu")
    assert "\n" not in str(e.value)


def test_an_exception_inside_a_module_is_a_bug_not_a_damaged_artifact(random_artifact, monkeypatch):
    """Past the metadata check, a module's own exception reaches the caller as itself: it is not
    relabelled "rebuild the artifact" (issue 55, item 3)."""
    from quantprep.targets import cpu

    def broken(self, meta, act_dtype):
        raise TypeError("a bug in new code")

    monkeypatch.setattr(cpu.CpuInt4Linear, "__init__", broken)
    with pytest.raises(TypeError, match="a bug in new code"):
        quantprep.load(random_artifact)
