"""signing.py: a verified signature is remembered only while the files are unchanged."""

import os
import shutil

import pytest
from conftest import keypair

from quantprep.distribution import signing
from quantprep.errors import ArtifactError


def test_a_second_verify_of_unchanged_files_is_not_redone_and_any_write_undoes_that(random_artifact, tmp_path, monkeypatch):
    key, pub = keypair(tmp_path / "keys")
    art = tmp_path / "art"
    shutil.copytree(random_artifact, art)
    signing.sign(art, key)
    signing.verify(art, pub)
    moved = tmp_path / "moved"
    art.rename(moved)  # a pull verifies in its staging dir, then renames it into the cache
    # the second check (serve's pre-check, then transformers' load) does not hash again
    monkeypatch.setattr(signing, "_model_signing", lambda: pytest.fail("verified again"))
    signing.verify(moved, pub)
    monkeypatch.undo()
    # a same-size change with the mtime set back: the ctime still moves, so it is checked again
    victim = moved / "config.json"
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[-2:-1] = b" " if data[-2:-1] != b" " else b"\n"
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert victim.stat().st_size == st.st_size and victim.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(ArtifactError, match="does not verify"):
        signing.verify(moved, pub)
