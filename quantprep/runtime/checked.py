"""The checks every artifact gets before any of it is read, whatever runs it (runtime/load.py with
torch, runtime/engine.py without): the manifest and every file's sha256 (verified.py: once
per file as it is; `verify` True: every time, False: sizes only), no code named by its configs,
and the signature when a verify key is configured. Torch-free."""

from __future__ import annotations

from pathlib import Path

from quantprep.distribution.signing import verify as verify_signature
from quantprep.errors import ArtifactError
from quantprep.format.artifact import read_checked, refuse_code
from quantprep.format.verified import check_hashed, hash_and_mark


def checked_manifest(path: Path, verify: bool | None, key: str | None) -> dict:
    """The artifact's manifest, after those checks (`key`: a verify key, or None)."""
    manifest = read_checked(path)
    if verify is None:
        check_hashed(path, manifest)
    elif verify:
        hash_and_mark(path, manifest)
    refuse_code(path, ArtifactError)
    if key is not None:
        verify_signature(path, key)  # unsigned or wrongly signed: refused before anything is read
    return manifest
