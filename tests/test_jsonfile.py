"""Bounded JSON reading (quantprep/_io/jsonfile.py): every untrusted JSON file goes through it."""

import pytest

from quantprep._io.jsonfile import read_json_object
from quantprep.errors import ArtifactError, SourceError


@pytest.mark.parametrize("raw, problem", [
    (b'{"a": 1}' + b" " * 100, "larger than 64 bytes"),
    (b'{"a": ', "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"[1, 2]", "expected a JSON object"),
])
def test_refuses_in_one_line_naming_the_file(tmp_path, raw, problem):
    path = tmp_path / "index.json"
    path.write_bytes(raw)
    with pytest.raises(SourceError) as e:
        read_json_object(path, SourceError, "re-export it", limit=64)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and problem in msg and msg.endswith("; re-export it") and "\n" not in msg


def test_reads_an_object_and_reports_a_missing_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 64}')
    assert read_json_object(path, SourceError, "fix it", limit=64) == {"hidden_size": 64}
    with pytest.raises(SourceError, match="cannot be read"):
        read_json_object(tmp_path / "nope.json", SourceError, "fix it")


def test_an_oversized_manifest_is_refused_before_parsing(tmp_path):
    from quantprep._io.jsonfile import MAX_JSON_BYTES
    from quantprep.format.artifact import MANIFEST, read_manifest

    with open(tmp_path / MANIFEST, "wb") as f:
        f.write(b"{")
        f.truncate(MAX_JSON_BYTES + 2)  # sparse: no 64 MiB written
    with pytest.raises(ArtifactError, match=f"larger than {MAX_JSON_BYTES} bytes"):
        read_manifest(tmp_path)
