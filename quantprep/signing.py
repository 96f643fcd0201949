"""Artifact signatures with OpenSSF's model_signing: a signed in-toto statement of every file's
sha256, in `DIR/model.sig` beside the files it covers (key mode: an elliptic-curve PEM key pair,
offline). A signature that verifies against a key the user configured is what lets a pulled
artifact's kcache run (kcache.trust_reason). model_signing is optional: `pip install
quantprep[publish]`; it needs pyopenssl, which it does not declare.
"""

from __future__ import annotations

import os
from pathlib import Path

from .artifact import SIGNATURE
from .errors import ArtifactError, QuantprepError

VERIFY_KEY_ENV = "QUANTPREP_VERIFY_KEY"


def _model_signing():
    try:
        from model_signing import hashing, signing, verifying
    except ImportError:
        raise QuantprepError("signatures need model_signing and pyopenssl: pip install 'quantprep[publish]'") from None
    return hashing, signing, verifying


def _hashing(path: Path):
    hashing, _, _ = _model_signing()
    config = hashing.Config()
    config.add_ignored_paths(model_path=path, paths=[SIGNATURE])
    return config


def sign(path: str | os.PathLike, key: str | os.PathLike) -> Path:
    """Sign every file of the artifact at `path` with the private key `key`; writes path/model.sig."""
    path, key = Path(path), Path(key)
    if not key.is_file():
        raise QuantprepError(f"{key}: no such key file; pass a PEM elliptic-curve private key (openssl ecparam -genkey)")
    _, signing, _ = _model_signing()
    try:
        signing.Config().use_elliptic_key_signer(private_key=key).set_hashing_config(_hashing(path)).sign(path, path / SIGNATURE)
    except ValueError as e:
        raise QuantprepError(f"{key}: cannot sign with it ({e}); pass a PEM elliptic-curve private key") from None
    return path / SIGNATURE


def configured_key(key: str | os.PathLike | None = None) -> Path | None:
    """The verify key: the one given, else QUANTPREP_VERIFY_KEY, else None."""
    key = key or os.environ.get(VERIFY_KEY_ENV)
    return Path(key) if key else None


def verify(path: str | os.PathLike, key: str | os.PathLike) -> None:
    """Refuse (one line) an artifact that is unsigned, or whose signature does not verify with the
    public key `key` against the files as they are now."""
    path, key = Path(path), Path(key)
    if not key.is_file():
        raise QuantprepError(f"{key}: no such public key file; pass the PEM public key the artifact was signed for")
    if not (path / SIGNATURE).is_file():
        raise ArtifactError(f"{path}: unsigned (no {SIGNATURE}), and a verify key is configured ({key}); refusing it")
    _, _, verifying = _model_signing()
    try:
        verifying.Config().use_elliptic_key_verifier(public_key=key).set_hashing_config(_hashing(path)).verify(path, path / SIGNATURE)
    except Exception as e:  # model_signing raises ValueError and its dependencies' own errors
        reason = " ".join(str(e).split())[:200]
        raise ArtifactError(f"{path}: the signature does not verify with {key} ({reason}); refusing it") from None
