"""OCI registries (registry.py): publish and pull through a real registry (CNCF distribution from
Debian) started on a loopback port, its manifests as other tools read them, tampered blobs, and
its errors in one line. The hostile registry's cases are in test_trust_boundary.py."""

import json

import pytest
import torch
from conftest import files_left_in, keypair, start_registry

import quantprep
from quantprep.cli import main
from quantprep.distribution.publish import publish, pull
from quantprep.errors import ArtifactError


def test_oci_publish_and_pull_through_a_real_registry(built, cache, registry, tmp_path):
    host, storage = registry
    ref = f"oci://{host}/models/tiny:v1"
    key, pub = keypair(tmp_path / "keys")
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
    assert not files_left_in(cache)


def test_registry_errors_are_one_line(built, cache, registry, tmp_path, capsys):
    host, _ = registry
    for ref, needle in ((f"oci://{host}/models/tiny:nope", "no such tag"),
                        ("oci://127.0.0.1:9/models/tiny:v1", "unreachable"),
                        (f"oci://{host}/Models/tiny:v1", "lowercase"),
                        ("ftp://x/y", "unsupported reference scheme")):
        assert main(["pull", ref]) == 2, ref
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (ref, err)
    assert not files_left_in(cache)


def test_a_registry_that_wants_credentials_is_one_line(built, cache, tmp_path, capsys):
    """distribution's `silly` auth answers 401 to every request without credentials."""
    gen = start_registry(tmp_path, "auth:\n  silly:\n    realm: http://127.0.0.1:{port}/token\n    service: test\n")
    host, _ = next(gen)
    try:
        for argv in (["pull", f"oci://{host}/models/tiny:v1"], ["publish", str(built / "cpu"), "--to", f"oci://{host}/models/tiny:v1"]):
            assert main(argv) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "HTTP 401" in err[0] and "docker login" in err[0], err
        assert not files_left_in(cache)
    finally:
        gen.close()


def test_an_openvino_variant_goes_through_a_real_registry(built, random_gptq, cache, registry, tmp_path):
    """The openvino target's IR files as ModelPack layers (the .bin as weights, format openvino), and
    `pull --target openvino` takes exactly that variant back; a plain pull still takes the cpu one."""
    pytest.importorskip("openvino", reason="the openvino extra (make setup installs it)")
    import urllib.request

    from quantprep.build.pipeline import prepack

    host, _ = registry
    ref = f"oci://{host}/models/tiny:ov"
    prepack(random_gptq, "openvino", tmp_path / "openvino")
    publish([built / "cpu", tmp_path / "openvino"], ref)
    assert pull(ref).name.startswith("cpu-")
    got = pull(ref, out=tmp_path / "pulled", target="openvino")
    for name in ("openvino_model.xml", "openvino_model.bin", "manifest.json"):
        assert (got / name).read_bytes() == (tmp_path / "openvino" / name).read_bytes()
    index = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://{host}/v2/models/tiny/manifests/ov", headers={"Accept": "application/vnd.oci.image.index.v1+json"})).read())
    kinds = {}
    for entry in index["manifests"]:
        manifest = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"http://{host}/v2/models/tiny/manifests/{entry['digest']}", headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})).read())
        config = json.loads(urllib.request.urlopen(f"http://{host}/v2/models/tiny/blobs/{manifest['config']['digest']}").read())
        kinds[config["config"]["format"]] = {x["annotations"]["org.cncf.model.filepath"]: x["mediaType"] for x in manifest["layers"]}
    assert kinds["openvino"]["openvino_model.bin"] == "application/vnd.cncf.model.weight.v1.raw"
    assert kinds["openvino"]["openvino_model.xml"] == "application/vnd.cncf.model.weight.config.v1.raw" and "safetensors" in kinds
