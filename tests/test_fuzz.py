"""Fuzzing the readers of untrusted artifact files (issue 5, item 7): whatever the bytes, only the
typed errors may escape. Thousands of manifest cases; tens of whole loads with broken
safetensors headers (each load builds a model, so those are slower)."""

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import quantprep
from quantprep.errors import ArtifactError
from quantprep.format.artifact import MANIFEST, check_files, manifest_digest, read_manifest, sha256_file

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(string.printable, max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(string.ascii_letters, max_size=8), inner, max_size=4),
    max_leaves=12,
)
FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from conftest import TINY_LLAMA

    from quantprep.build.pipeline import prepack
    from quantprep.build.synthetic import write_random_checkpoint

    root = tmp_path_factory.mktemp("fuzz")
    gptq = write_random_checkpoint(root / "gptq", TINY_LLAMA, bits=4, group_size=64, desc_act=True, sym=False)
    prepack(gptq, "cpu", root / "art")
    return root / "art"


def _with_manifest(artifact, tmp_path_factory, manifest: dict):
    """A copy of `artifact` (files symlinked) whose manifest.json is `manifest`."""
    d = tmp_path_factory.mktemp("m")
    for f in artifact.iterdir():
        if f.name != MANIFEST:
            (d / f.name).symlink_to(f)
    (d / MANIFEST).write_text(json.dumps(manifest))
    return d


def _read(art):
    try:
        m = read_manifest(art)
        check_files(art, m, full_hash=False)
    except ArtifactError as e:
        assert "\n" not in str(e)


@FUZZ
@given(data=st.binary(max_size=400))
def test_manifest_bytes(artifact, tmp_path_factory, data):
    d = tmp_path_factory.mktemp("m")
    (d / MANIFEST).write_bytes(data)
    _read(d)


@FUZZ
@given(path=st.lists(st.sampled_from(["target", "quant", "compat", "modules", "files", "shards", "source", "format_version",
                                      "name", "act_dtype", "size", "sha256", "bits", "in_features", "act_order", 0]),
                     min_size=1, max_size=3), value=json_values, resign=st.booleans())
def test_manifest_field_edits(artifact, tmp_path_factory, path, value, resign):
    """Replace a (nested) field of a valid manifest by arbitrary JSON, re-signed or not."""
    m = json.loads((artifact / MANIFEST).read_text())
    node = m
    for key in path[:-1]:
        if isinstance(node, dict) and node:
            node = node.get(key) if key in node else node[next(iter(node))]
        elif isinstance(node, list) and node:
            node = node[0]
    last = path[-1]
    if isinstance(node, dict):
        node[last if last in node or not node else next(iter(node))] = value
    elif isinstance(node, list) and node:
        node[0] = value
    if resign:
        m["manifest_sha256"] = manifest_digest(m)
    _read(_with_manifest(artifact, tmp_path_factory, m))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(cut=st.integers(0, 200), junk=st.binary(min_size=0, max_size=64))
def test_safetensors_header_damage_only_raises_artifact_error(artifact, tmp_path_factory, cut, junk):
    """Overwrite the start of the shard (its 8-byte header length and JSON header), keep the
    size, re-sign the manifest so only the safetensors reader can notice."""
    import shutil

    d = tmp_path_factory.mktemp("h") / "art"
    shutil.copytree(artifact, d)
    m = json.loads((d / MANIFEST).read_text())
    shard = d / m["shards"][0]
    data = bytearray(shard.read_bytes())
    data[cut:cut + len(junk)] = junk
    data = data[:shard.stat().st_size] if len(data) >= shard.stat().st_size else data + bytes(shard.stat().st_size - len(data))
    shard.write_bytes(bytes(data))
    m["files"][shard.name] = {"sha256": sha256_file(shard), "size": shard.stat().st_size}
    m["manifest_sha256"] = manifest_digest(m)
    (d / MANIFEST).write_text(json.dumps(m))
    try:
        quantprep.load(d)
    except ArtifactError as e:
        assert "\n" not in str(e)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(module_key=st.sampled_from(["kernel_group_size", "padded_in", "padded_out", "in_features", "group_size", "bits"]),
       value=json_values)
def test_load_with_edited_module_metadata(artifact, tmp_path_factory, module_key, value):
    """A re-signed manifest whose module metadata is edited: load may only raise ArtifactError."""
    m = json.loads((artifact / MANIFEST).read_text())
    first = sorted(m["modules"])[0]
    m["modules"][first][module_key] = value
    m["manifest_sha256"] = manifest_digest(m)
    try:
        quantprep.load(_with_manifest(artifact, tmp_path_factory, m))
    except ArtifactError as e:
        assert "\n" not in str(e)
