"""Artifact signatures with OpenSSF's model_signing: a signed in-toto statement of every file's
sha256, in `DIR/model.sig` beside the files it covers. A signature that verifies against a key the
user configured is what lets a pulled artifact's kcache run (kcache.trust_reason). model_signing
is optional: `pip install quantprep[publish]`; it needs pyopenssl, which it does not declare.

Two modes. Key mode (offline): an elliptic-curve PEM key pair; the key is a file path. Sigstore
keyless: signing key "sigstore" (a short-lived certificate for the OIDC identity at hand, such as
a GitHub Actions workflow with `id-token: write`); verifying key "sigstore:IDENTITY" (the
certificate's identity, e.g. the workflow's URL), with the issuer from QUANTPREP_VERIFY_ISSUER
(default GitHub Actions'). Keyless needs Sigstore's public services (Fulcio, Rekor, its TUF root):
it cannot run, nor be tested, offline.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from quantprep import settings
from quantprep._io.jsonfile import read_json_object
from quantprep._io.staging import MARKER
from quantprep.errors import ArtifactError, QuantprepError
from quantprep.format.artifact import IDENTITY, SIGNATURE

VERIFY_KEY_ENV = settings.VERIFY_KEY
VERIFY_ISSUER_ENV = settings.VERIFY_ISSUER
GITHUB_ISSUER = "https://token.actions.githubusercontent.com"
SIGSTORE = "sigstore"

# Signatures this process verified, by what identifies the files without reading them: a pull, serve's
# pre-check and transformers' load each ask for the same artifact. Any write changes a file's ctime,
# which no one can set back, so an unchanged fingerprint means unchanged bytes; a rename keeps it.
_verified: set[tuple] = set()


def _fingerprint(path: Path, key: str) -> tuple:
    files = []
    for f in sorted(path.rglob("*")):
        if f.name == MARKER:
            continue
        st = f.lstat()
        files.append((str(f.relative_to(path)), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode))
    key_bytes = b"" if key.startswith(f"{SIGSTORE}:") else Path(key).read_bytes()
    return key, key_bytes, tuple(files)


def _model_signing():
    try:
        from model_signing import hashing, signing, verifying
    except ImportError:
        raise QuantprepError("signatures need model_signing and pyopenssl: pip install 'quantprep[publish]'") from None
    return hashing, signing, verifying


def _hashing(path: Path):
    hashing, _, _ = _model_signing()
    config = hashing.Config()
    config.add_ignored_paths(model_path=path, paths=[SIGNATURE, MARKER])  # MARKER: a pull verifies its staging copy
    return config


def write_identity(path: Path, identity: dict) -> None:
    """What the signature will be for: {"name": the reference's name, "versions": [the tags or
    branches it is published under]} (publish.reference_identity), in path/identity.json."""
    (path / IDENTITY).write_text(json.dumps(identity, sort_keys=True) + "\n")


def check_identity(path: Path, asked: dict) -> None:
    """The signed identity names what was asked for (a name, and a version when the reference has
    one): a registry serving another model, or an older version, signed by the same key, is refused."""
    if not (path / IDENTITY).is_file():
        raise ArtifactError(f"{path}: signed without an identity ({IDENTITY}), so the signature does not say which model and "
                            f"version it is for; refusing it: publish with --sign-key, or sign with `quantprep sign --for REF`")
    signed = read_json_object(path / IDENTITY, ArtifactError, "refusing it")
    versions = signed.get("versions")
    if signed.get("name") != asked["name"] or not isinstance(versions, list) or (asked.get("version") is not None
                                                                              and asked["version"] not in versions):
        raise ArtifactError(f"{path}: signed for {signed.get('name')!r} versions {versions!r}, but {asked['name']!r}"
                            f"{' version ' + repr(asked['version']) if asked.get('version') is not None else ''} was asked for; "
                            "refusing it (another model, or another version, under this reference)")


def sign(path: str | os.PathLike, key: str | os.PathLike, identity: dict | None = None) -> Path:
    """Sign every file of the artifact at `path` with the private key `key` (or "sigstore":
    keyless, ambient OIDC credentials); writes path/model.sig. identity: the reference the
    signature is for (write_identity), signed with the files."""
    path = Path(path)
    if identity is not None:
        write_identity(path, identity)
    if str(key) == SIGSTORE:
        _, signing, _ = _model_signing()
        try:
            signing.Config().use_sigstore_signer(use_ambient_credentials=True).set_hashing_config(_hashing(path)).sign(
                path, path / SIGNATURE)
        except Exception as e:  # no OIDC identity, Sigstore unreachable: model_signing and sigstore raise many kinds
            raise QuantprepError(f"{path}: Sigstore keyless signing failed ({type(e).__name__}: {' '.join(str(e).split())[:160]}); "
                                 "it needs an OIDC identity (CI: permissions id-token: write) and network access") from None
        return path / SIGNATURE
    key = Path(key)
    if not key.is_file():
        raise QuantprepError(f"{key}: no such key file; pass a PEM elliptic-curve private key (openssl ecparam -genkey)")
    _, signing, _ = _model_signing()
    try:
        signing.Config().use_elliptic_key_signer(private_key=key).set_hashing_config(_hashing(path)).sign(path, path / SIGNATURE)
    except ValueError as e:
        raise QuantprepError(f"{key}: cannot sign with it ({e}); pass a PEM elliptic-curve private key") from None
    return path / SIGNATURE


def configured_key(key: str | os.PathLike | None = None) -> str | None:
    """The verify key: the one given, else QUANTPREP_VERIFY_KEY, else None. A PEM public key's
    path, or "sigstore:IDENTITY"."""
    key = key or os.environ.get(VERIFY_KEY_ENV)
    return str(key) if key else None


def verify(path: str | os.PathLike, key: str | os.PathLike, asked: dict | None = None) -> None:
    """Refuse (one line) an artifact that is unsigned, or whose signature does not verify with the
    public key `key` (or the Sigstore identity of "sigstore:IDENTITY") against the files as they are now,
    or (`asked`: the reference pulled, publish.reference_identity) whose signed identity is another.
    Files unchanged since this process verified them with this key are not hashed again."""
    path = Path(path)
    _verify_files(path, key)
    if asked is not None:
        check_identity(path, asked)


def _verify_files(path: Path, key: str | os.PathLike) -> None:
    sigstore = str(key).startswith(f"{SIGSTORE}:")
    if sigstore and not str(key)[len(SIGSTORE) + 1:]:
        raise QuantprepError(f"{key}: name the signer's identity after sigstore: (e.g. the signing workflow's URL)")
    if not sigstore and not Path(key).is_file():
        raise QuantprepError(f"{key}: no such public key file; pass the PEM public key the artifact was signed for")
    if not (path / SIGNATURE).is_file():
        raise ArtifactError(f"{path}: unsigned (no {SIGNATURE}), and a verify key is configured ({key}); refusing it")
    fingerprint = _fingerprint(path, str(key))
    if fingerprint in _verified:
        return
    _, _, verifying = _model_signing()
    try:
        config = verifying.Config()
        if sigstore:  # fetches Sigstore's trust root (TUF) first: offline, that fails and refuses
            config.use_sigstore_verifier(identity=str(key)[len(SIGSTORE) + 1:],
                                         oidc_issuer=os.environ.get(VERIFY_ISSUER_ENV, GITHUB_ISSUER))
        else:
            config.use_elliptic_key_verifier(public_key=Path(key))
        config.set_hashing_config(_hashing(path)).verify(path, path / SIGNATURE)
    except Exception as e:  # model_signing raises ValueError and its dependencies' own errors
        reason = " ".join(str(e).split())[:200]
        raise ArtifactError(f"{path}: the signature does not verify with {key} ({reason}); refusing it") from None
    _verified.add(fingerprint)
