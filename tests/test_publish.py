"""publish / pull through a directory reference (publish.py): the variant that fits, every file
verified before anything is loadable, one-line refusals that leave nothing behind."""

import json
import os
import shutil

import pytest
import torch
from conftest import free_port, serve

import quantprep
from quantprep.cli import main
from quantprep.distribution.publish import INDEX, publish, pull
from quantprep.errors import ArtifactError, ArtifactMismatch, QuantprepError
from quantprep.format.artifact import MANIFEST


@pytest.fixture
def built(random_gptq, tmp_path):
    from quantprep.build.pipeline import prepack

    for target in ("cpu", "xpu"):
        prepack(random_gptq, target, tmp_path / "art" / target)
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


def _keypair(path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path.mkdir(parents=True, exist_ok=True)
    (path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    (path / "pub.pem").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                 serialization.PublicFormat.SubjectPublicKeyInfo))
    return path / "key.pem", path / "pub.pem"


def test_signed_publish_pull_and_load(built, cache, tmp_path, capsys, monkeypatch):
    """Issue 15 item 3: publish --sign-key signs each variant; pull/load with a verify key refuse
    unsigned and wrongly signed artifacts and a file changed after signing (its manifest re-signed
    as anyone can, so every sha256 check passes but the signature's)."""
    key, pub = _keypair(tmp_path / "keys")
    _, other_pub = _keypair(tmp_path / "other")
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
    key, pub = _keypair(tmp_path / "keys")
    art = tmp_path / "signed-art"
    shutil.copytree(built / "cpu", art)
    assert main(["sign", str(art), "--key", str(key), "--for", str(tmp_path / "ref")]) == 0
    publish([art], str(tmp_path / "ref"))  # no --sign-key: the signature it has travels with it
    [entry] = json.loads((tmp_path / "ref" / INDEX).read_text())["variants"]
    assert "signature_sha256" in entry
    assert (pull(str(tmp_path / "ref"), verify_key=pub) / "model.sig").read_bytes() == (art / "model.sig").read_bytes()


def test_a_verified_signature_trusts_the_kcache(cache, tmp_path, monkeypatch):
    """Rule (b) of the trust boundary: a pulled kcache runs when its signature verifies with the
    user's key, and not otherwise (another user: an empty trust store)."""
    from test_warm import _build

    from quantprep.runtime.warm import warm

    key, pub = _keypair(tmp_path / "keys")
    art = _build(tmp_path / "b")
    warm(art, shapes=[1, 4], progress=False)
    publish([art], str(tmp_path / "ref"), sign_key=key)
    monkeypatch.setenv("QUANTPREP_TRUST_DIR", str(tmp_path / "elsewhere-trust"))  # another user/machine
    with pytest.warns(UserWarning, match="not trusted"):
        assert quantprep.load(str(tmp_path / "ref"), compile=True).quantprep_kcache["status"] == "untrusted"
    model = quantprep.load(str(tmp_path / "ref"), compile=True, verify_key=pub)
    assert model.quantprep_kcache["status"] == "used" and model.quantprep_kcache["trusted"] == "signature"


# --- OCI: a real registry (CNCF distribution from Debian) on a loopback port, started by the test ---

REGISTRY_BIN = "/usr/bin/docker-registry"


@pytest.fixture
def registry(tmp_path):
    yield from _registry(tmp_path)


def _registry(tmp_path, auth: str = ""):
    if not os.path.exists(REGISTRY_BIN):
        if os.environ.get("CI") == "true":
            pytest.fail(f"{REGISTRY_BIN} missing: `make setup` installs Debian's docker-registry when run as root")
        pytest.skip(f"{REGISTRY_BIN} missing (apt-get install docker-registry)")
    port = free_port()
    storage = tmp_path / "registry-storage"
    config = tmp_path / "registry.yml"
    config.write_text(f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {storage}\n"
                      f"  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n{auth.format(port=port)}")
    stop = serve([REGISTRY_BIN, "serve", str(config)], f"http://127.0.0.1:{port}/v2/", "the registry", timeout=20)
    try:
        yield f"127.0.0.1:{port}", storage
    finally:
        stop()


def test_oci_publish_and_pull_through_a_real_registry(built, cache, registry, tmp_path):
    host, storage = registry
    ref = f"oci://{host}/models/tiny:v1"
    key, pub = _keypair(tmp_path / "keys")
    publish([built / "cpu", built / "xpu"], ref, sign_key=key)
    got = pull(ref, verify_key=pub)
    assert got.parent.parent == cache and got.name.startswith("cpu-")
    for p in (built / "cpu").rglob("*"):
        if p.is_file():
            assert (got / p.relative_to(built / "cpu")).read_bytes() == p.read_bytes()
    assert pull(ref) == got  # unchanged: the cache
    ids = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        assert torch.equal(quantprep.load(ref)(input_ids=ids).logits, quantprep.load(built / "cpu")(input_ids=ids).logits)
    xpu = pull(ref, out=tmp_path / "xpu", target="xpu")
    assert (xpu / "manifest.json").read_bytes() == (built / "xpu" / "manifest.json").read_bytes()
    # The image index and the ModelPack artifact manifests, as the registry holds them.
    import urllib.request

    req = urllib.request.Request(f"http://{host}/v2/models/tiny/manifests/v1", headers={"Accept": "application/vnd.oci.image.index.v1+json"})
    index = json.loads(urllib.request.urlopen(req).read())
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json" and len(index["manifests"]) == 2
    req = urllib.request.Request(f"http://{host}/v2/models/tiny/manifests/{index['manifests'][0]['digest']}",
                                 headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    manifest = json.loads(urllib.request.urlopen(req).read())
    assert manifest["artifactType"] == "application/vnd.cncf.model.manifest.v1+json"
    assert manifest["config"]["mediaType"] == "application/vnd.cncf.model.config.v1+json"
    paths = {x["annotations"]["org.cncf.model.filepath"]: x["mediaType"] for x in manifest["layers"]}
    assert paths["config.json"] == "application/vnd.cncf.model.weight.config.v1.raw" and "model.sig" in paths
    assert any(p.endswith(".safetensors") and t == "application/vnd.cncf.model.weight.v1.raw" for p, t in paths.items())


def test_a_tampered_registry_blob_is_refused(built, cache, registry, tmp_path, capsys):
    """Same-size bytes written over a blob in the registry's own storage: oras would not notice."""
    host, storage = registry
    ref = f"oci://{host}/models/tiny:v1"
    publish([built / "cpu"], ref)
    shard = max((p for p in storage.rglob("data") if "/blobs/" in str(p)), key=lambda p: p.stat().st_size)  # the weights
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="does not match its digest"):
        pull(ref)
    assert main(["pull", ref]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not _leftovers(cache)


def test_registry_errors_are_one_line(built, cache, registry, tmp_path, capsys):
    host, _ = registry
    for ref, needle in ((f"oci://{host}/models/tiny:nope", "no such tag"),
                        ("oci://127.0.0.1:9/models/tiny:v1", "unreachable"),
                        (f"oci://{host}/Models/tiny:v1", "lowercase"),
                        ("ftp://x/y", "unsupported reference scheme")):
        assert main(["pull", ref]) == 2, ref
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (ref, err)
    assert not _leftovers(cache)


def test_a_registry_that_wants_credentials_is_one_line(built, cache, tmp_path, capsys):
    """distribution's `silly` auth answers 401 to every request without credentials."""
    gen = _registry(tmp_path, "auth:\n  silly:\n    realm: http://127.0.0.1:{port}/token\n    service: test\n")
    host, _ = next(gen)
    try:
        for argv in (["pull", f"oci://{host}/models/tiny:v1"], ["publish", str(built / "cpu"), "--to", f"oci://{host}/models/tiny:v1"]):
            assert main(argv) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "HTTP 401" in err[0] and "docker login" in err[0], err
        assert not _leftovers(cache)
    finally:
        gen.close()


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
    key, _ = _keypair(tmp_path / "keys")
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
