"""publish / pull through a directory reference (publish.py): the variant that fits, every file
verified before anything is loadable, one-line refusals that leave nothing behind."""

import json
import os
import shutil

import pytest
import torch
from conftest import files_left_in, keypair

import quantprep
from quantprep.cli import main
from quantprep.distribution.publish import INDEX, publish, pull
from quantprep.errors import ArtifactError, ArtifactMismatch, QuantprepError
from quantprep.format.artifact import MANIFEST


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
    assert not files_left_in(cache)


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
    assert not files_left_in(cache), files_left_in(cache)
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


def test_signed_publish_pull_and_load(built, cache, tmp_path, capsys, monkeypatch):
    """Issue 15 item 3: publish --sign-key signs each variant; pull/load with a verify key refuse
    unsigned and wrongly signed artifacts and a file changed after signing (its manifest re-signed
    as anyone can, so every sha256 check passes but the signature's)."""
    key, pub = keypair(tmp_path / "keys")
    _, other_pub = keypair(tmp_path / "other")
    signed, unsigned = tmp_path / "signed", tmp_path / "unsigned"
    assert main(["publish", str(built / "cpu"), "--to", str(signed), "--sign-key", str(key)]) == 0
    publish([built / "cpu"], str(unsigned))
    assert not (built / "cpu" / "model.sig").exists()  # the source directory is not modified
    got = pull(str(signed), verify_key=pub)
    assert (got / "model.sig").is_file()
    from quantprep.distribution import signing

    with monkeypatch.context() as m:  # the pull verified these very files: the load does not hash them again
        m.setattr(signing, "_model_signing", lambda: pytest.fail("verified twice"))
        quantprep.load(got, verify_key=pub)
    for ref, pubkey, needle in ((unsigned, pub, "unsigned"), (signed, other_pub, "does not verify")):
        with pytest.raises(ArtifactError, match=needle):
            pull(str(ref), out=tmp_path / "x", verify_key=pubkey)
        assert not (tmp_path / "x").exists()
    monkeypatch.setenv("QUANTPREP_VERIFY_KEY", str(other_pub))
    assert main(["pull", str(signed), "--out", str(tmp_path / "y")]) == 2  # the environment's key applies
    assert len(capsys.readouterr().err.strip().splitlines()) == 1 and not (tmp_path / "y").exists()
    with pytest.raises(ArtifactError, match="does not verify"):
        quantprep.load(got)  # load checks the key too
    monkeypatch.delenv("QUANTPREP_VERIFY_KEY")
    # Tampering after signing: change a file, re-sign the manifest's digests (what an attacker can do).
    from quantprep.format.artifact import manifest_digest, sha256_file

    [variant] = json.loads((signed / INDEX).read_text())["variants"]
    vdir = signed / variant["name"]
    (vdir / "config.json").write_text((vdir / "config.json").read_text() + "\n")
    m = json.loads((vdir / MANIFEST).read_text())
    m["files"]["config.json"] = {"sha256": sha256_file(vdir / "config.json"),
                                            "size": (vdir / "config.json").stat().st_size}
    m["manifest_sha256"] = manifest_digest(m)
    (vdir / MANIFEST).write_text(json.dumps(m))
    index = json.loads((signed / INDEX).read_text())
    index["variants"][0]["manifest_sha256"] = __import__("hashlib").sha256((vdir / MANIFEST).read_bytes()).hexdigest()
    (signed / INDEX).write_text(json.dumps(index))
    pull(str(signed), out=tmp_path / "no-key")  # without a key, hashes are all it can check
    with pytest.raises(ArtifactError, match="does not verify"):
        pull(str(signed), out=tmp_path / "z", verify_key=pub)
    assert not (tmp_path / "z").exists()


def test_an_artifact_signed_before_publish_carries_its_signature(built, cache, tmp_path):
    key, pub = keypair(tmp_path / "keys")
    art = tmp_path / "signed-art"
    shutil.copytree(built / "cpu", art)
    assert main(["sign", str(art), "--key", str(key), "--for", str(tmp_path / "ref")]) == 0
    publish([art], str(tmp_path / "ref"))  # no --sign-key: the signature it has travels with it
    [entry] = json.loads((tmp_path / "ref" / INDEX).read_text())["variants"]
    assert "signature_sha256" in entry
    assert (pull(str(tmp_path / "ref"), verify_key=pub) / "model.sig").read_bytes() == (art / "model.sig").read_bytes()


def test_a_verified_signature_trusts_the_kcache(cache, warmed_aot, copy_of, tmp_path, monkeypatch):
    """Rule (b) of the trust boundary: a pulled kcache runs when its signature verifies with the
    user's key, and not otherwise (another user: an empty trust store). The artifact: a copy of the
    session's warmed one (its warm is shared with test_aot.py)."""
    key, pub = keypair(tmp_path / "keys")
    art = copy_of(warmed_aot[0])
    publish([art], str(tmp_path / "ref"), sign_key=key)
    monkeypatch.setenv("QUANTPREP_TRUST_DIR", str(tmp_path / "elsewhere-trust"))  # another user/machine
    with pytest.warns(UserWarning, match="not trusted"):
        assert quantprep.load(str(tmp_path / "ref"), compile=True).quantprep_kcache["status"] == "untrusted"
    model = quantprep.load(str(tmp_path / "ref"), compile=True, verify_key=pub)
    assert model.quantprep_kcache["status"] == "used" and model.quantprep_kcache["trusted"] == "signature"


def test_a_full_disk_mid_pull_is_one_line_and_leaves_nothing(built, tmp_path):
    """The pull's writes fail part-way (RLIMIT_FSIZE: each file may grow to 64 KiB only, as on a
    disk that fills up): one line, exit 2, no directory left to load."""
    import resource
    import signal
    import subprocess
    import sys

    publish([built / "cpu"], str(tmp_path / "ref"))

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    proc = subprocess.run([sys.executable, "-m", "quantprep", "pull", str(tmp_path / "ref"), "--out", str(tmp_path / "got")],
                          capture_output=True, text=True, preexec_fn=small_disk, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "free space" in err[0], proc.stderr[-2000:]
    assert not (tmp_path / "got").exists()
    assert not [p for p in tmp_path.glob(".got*") if not p.name.endswith(".lock")]


def test_sigstore_keyless_offline_is_one_line(built, cache, tmp_path, capsys, monkeypatch):
    """Keyless signing and verification need Sigstore's services, which no test here can reach: what
    is checked is that they fail in one line and refuse, never pass. A key-signed variant is not a
    Sigstore bundle: verifying it against an identity refuses it."""
    key, _ = keypair(tmp_path / "keys")
    art = tmp_path / "to-sign"
    shutil.copytree(built / "cpu", art)
    monkeypatch.setenv("NO_PROXY", "*")
    for var in ("ACTIONS_ID_TOKEN_REQUEST_URL", "ACTIONS_ID_TOKEN_REQUEST_TOKEN", "SIGSTORE_ID_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    assert main(["sign", str(art), "--key", "sigstore"]) == 2  # no OIDC identity here
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Sigstore keyless signing failed" in err[0], err
    assert not (art / "model.sig").exists()
    assert main(["sign", str(art), "--key", str(key)]) == 0
    publish([art], str(tmp_path / "ref"))
    for spec, needle in (("sigstore:", "name the signer's identity"),
                         ("sigstore:https://github.com/org/repo/.github/workflows/artifacts.yml@refs/tags/v1", "does not verify")):
        assert main(["pull", str(tmp_path / "ref"), "--out", str(tmp_path / "x"), "--verify-key", spec]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (spec, err)
        assert not (tmp_path / "x").exists()
