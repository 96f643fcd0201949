"""publish / pull through a directory reference (publish.py): the variant that fits, every file
verified before anything is loadable, one-line refusals that leave nothing behind."""

import json
import os
import shutil

import pytest
import torch

import quantprep
from quantprep.artifact import MANIFEST
from quantprep.cli import main
from quantprep.errors import ArtifactError, ArtifactMismatch, QuantprepError
from quantprep.publish import INDEX, publish, pull


@pytest.fixture
def built(random_gptq, tmp_path):
    from quantprep.build import build_artifacts

    for target in ("cpu", "xpu"):
        build_artifacts(random_gptq, {"path": str(random_gptq)}, [target], lambda t: tmp_path / "art" / t, progress=False)
    return tmp_path / "art"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTPREP_PULL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _leftovers(root):
    """What a refused pull left in the cache: nothing but empty dirs and the (empty) publish lock."""
    return [p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock")] if root.exists() else []


def test_publish_then_pull_the_variant_that_fits(built, cache, tmp_path):
    ref = tmp_path / "ref"
    plan = publish([built / "cpu", built / "xpu"], str(ref))
    cpu_name = f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"
    assert sorted(v["name"] for v in plan["variants"]) == sorted([cpu_name, "xpu"])
    index = json.loads((ref / INDEX).read_text())
    assert {v["name"] for v in index["variants"]} == {cpu_name, "xpu"}
    got = pull(str(ref))
    assert got.parent.parent == cache and got.name == cpu_name  # no XPU here: the cpu variant
    for p in (built / "cpu").rglob("*"):
        if p.is_file():
            assert (got / p.relative_to(built / "cpu")).read_bytes() == p.read_bytes()
    stamp = (got / MANIFEST).stat().st_ino
    assert pull(f"file://{ref}") == got and (got / MANIFEST).stat().st_ino == stamp  # the cache, not a new copy
    ids = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        local = quantprep.load(built / "cpu")(input_ids=ids).logits
        for source in (str(ref), f"file://{ref}"):
            assert torch.equal(quantprep.load(source)(input_ids=ids).logits, local)
    xpu = pull(str(ref), out=tmp_path / "mine", target="xpu")  # forced; checked on the CPU emulator
    assert xpu == tmp_path / "mine" and quantprep.load(xpu, device="cpu").config is not None


def test_no_fitting_variant_says_what_is_on_offer(built, cache, tmp_path, capsys):
    publish([built / "xpu"], str(tmp_path / "ref"))
    with pytest.raises(ArtifactMismatch, match=r"no variant fits this machine; on offer: xpu \(torch=.*this machine has: cpu"):
        pull(str(tmp_path / "ref"))
    assert main(["pull", str(tmp_path / "ref")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not _leftovers(cache)


@pytest.mark.parametrize("damage", ["same-size bytes", "truncated", "missing", "index lies", "bad variant name"])
def test_a_damaged_reference_is_refused_and_leaves_nothing(built, cache, tmp_path, capsys, damage):
    ref = tmp_path / "ref"
    publish([built / "cpu"], str(ref))
    [variant] = json.loads((ref / INDEX).read_text())["variants"]
    shard = ref / variant["name"] / json.loads((ref / variant["name"] / MANIFEST).read_text())["shards"][0]
    if damage == "same-size bytes":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncated":
        os.truncate(shard, shard.stat().st_size - 1)
    elif damage == "missing":
        shard.unlink()
    else:
        index = json.loads((ref / INDEX).read_text())
        if damage == "index lies":
            index["variants"][0]["manifest_sha256"] = "0" * 64
        else:
            index["variants"][0]["name"] = "../../escape"
        (ref / INDEX).write_text(json.dumps(index))
    with pytest.raises(ArtifactError):
        pull(str(ref))
    assert main(["pull", str(ref)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert not _leftovers(cache), _leftovers(cache)
    assert not (tmp_path / "escape").exists()


def test_bad_references_and_destinations(built, cache, tmp_path, capsys):
    with pytest.raises(QuantprepError, match="unsupported reference scheme 's3'"):
        pull("s3://bucket/model")
    with pytest.raises(QuantprepError, match="no index.json"):
        pull(str(built))  # an artifact, not a published reference
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(["publish", str(built / "cpu"), "--to", str(mine)]) == 2
    assert (mine / "notes.txt").read_text() == "keep me"
    assert main(["publish", str(built / "cpu"), "--to", str(tmp_path / "dry"), "--dry-run"]) == 0
    assert not (tmp_path / "dry").exists()
    broken = tmp_path / "broken"
    shutil.copytree(built / "cpu", broken)
    (broken / "config.json").write_text((broken / "config.json").read_text().replace("{", "{ ", 1))  # same file, other bytes
    with pytest.raises(ArtifactError):
        publish([broken], str(tmp_path / "ref2"))  # a corrupt artifact is never published
    assert not (tmp_path / "ref2").exists()
    capsys.readouterr()
