"""Publishing artifacts and pulling the variant that fits this machine (docs/publishing.md).

A publish holds several artifacts of one model, the variants (one per target and compatibility
key: cpu AVX2, cpu AVX512, xpu, cuda...), under one reference, with an index:

    REF/index.json          {"format": "quantprep-index", "format_version": 1, "variants": [...]}
    REF/<variant>/...        the artifact's files, as built (manifest.json, shards, kcache/, ...)

`pull` reads the index, picks the variant this machine can run the way pip picks a wheel (device
present, compatibility key equal; an accelerator before the CPU), copies its files while hashing
them, checks every one against the manifest's sha256 (and the manifest against the index), and
only then publishes the copy atomically into the local cache: nothing unverified is ever loadable,
and a second pull of the same reference reads the cache, offline. The index is untrusted input
like everything pulled: parsed with limits, every path checked, every file hashed.

Destinations: a directory or a file:// URL (a shared filesystem or an object-store mount), OCI
registries (oci://HOST/REPO:TAG, registry.py) and the Hugging Face Hub (hf://ORG/REPO[@REV], hub.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from quantprep import settings
from quantprep._io.jsonfile import MAX_JSON_BYTES, read_json_object
from quantprep._io.staging import staging
from quantprep._io.userdirs import user_dir
from quantprep.distribution import hub, registry
from quantprep.distribution.policy import check_signature, signature_policy
from quantprep.distribution.signing import sign
from quantprep.errors import ArtifactError, ArtifactMismatch, QuantprepError
from quantprep.format.artifact import MANIFEST, SIGNED, is_artifact, read_checked, read_manifest, write_hashed
from quantprep.format.verified import mark

INDEX = "index.json"
INDEX_FORMAT = "quantprep-index"
INDEX_VERSION = 1
MAX_INDEX_BYTES = 1 << 20


def variant_name(manifest: dict) -> str:
    """cpu-avx2, cpu-avx512, xpu, cuda[-sm_90]: the target, plus what its packed layout or kcache depends on (Target.variant_name)."""
    from quantprep.targets import get_target

    return get_target(manifest["target"]["name"]).variant_name(manifest)


def destination(ref: str) -> Path:
    """A directory or file:// reference -> its path; any other scheme is refused in one line."""
    parsed = urlparse(ref)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise QuantprepError(f"{ref}: file:// URLs name a local path (file:///srv/models/x), not host {parsed.netloc!r}")
        return Path(parsed.path)
    if "://" in ref:
        raise QuantprepError(f"{ref}: unsupported reference scheme {parsed.scheme!r}; use a directory, file:///path, "
                             "oci://HOST/REPO:TAG or hf://ORG/REPO")
    return Path(ref)


def publish(dirs: list[str | os.PathLike], to: str, dry_run: bool = False, sign_key: str | os.PathLike | None = None,
            plain_http: bool = False, tag: str | None = None, force: bool = False) -> dict:
    """Publish the artifacts in `dirs` as the variants of one reference. Each is verified first
    (every file's sha256). The reference is replaced as a whole and atomically. sign_key: sign
    each published variant (signing.py; the source directories are not modified); a variant
    signed before (quantprep sign) carries its signature. tag: the Hub's release tag (hf:// only).
    force: replace a destination directory that is not a published reference."""
    if tag is not None and not to.startswith("hf://"):
        raise QuantprepError(f"{to}: --tag is for hf:// references; an OCI reference carries its tag (oci://HOST/REPO:TAG)")
    store = store_for(to, plain_http)  # a malformed reference fails before any work
    variants, names = [], set()
    for d in map(Path, dirs):
        manifest = read_checked(d, full_hash=True)
        name = variant_name(manifest)
        if name in names:
            raise QuantprepError(f"{d}: a second {name} variant in one publish; pass one artifact per target and compatibility key")
        names.add(name)
        variants.append((d, manifest, name))
    index = {"format": INDEX_FORMAT, "format_version": INDEX_VERSION, "variants": [
        {"name": name, "target": m["target"]["name"], "device": m["target"]["device"], "compat": m["compat"],
         "manifest_sha256": hashlib.sha256((d / MANIFEST).read_bytes()).hexdigest(),
         "kcache_key": m.get("kcache", {}).get("key")} for d, m, name in variants]}
    if sign_key is not None and str(sign_key) != "sigstore" and not Path(sign_key).is_file():
        raise QuantprepError(f"{sign_key}: no such key file; pass a PEM elliptic-curve private key")
    # a Hub publish's release tag, known before signing (the signatures name it): --tag, else the unsigned index's digest
    release = (tag or f"quantprep-{hashlib.sha256(_index_bytes(index)).hexdigest()[:12]}") if isinstance(store, HubStore) else None
    signing = _Signing(sign_key, signed_identity(store.identity(release)))
    plan = {"to": store.where, "variants": [{"name": n, "from": str(d), "files": len(_files(m)), "bytes": sum(f["size"] for f in _files(m).values())}
                                           for d, m, n in variants]}
    if dry_run:
        return plan
    return plan | store.push(variants, index, signing, release=release, tag_given=tag is not None, force=force)


def _index_bytes(index: dict) -> bytes:
    return (json.dumps(index, indent=2) + "\n").encode()


def reference_identity(ref: str, release: str | None = None) -> dict:
    """What a reference names, without where it is (a mirror keeps it): the OCI repository and tag,
    the Hub repository and revision (and the release tag a publish adds), a directory's name. A
    signature is for this identity; a pull asks for its own ref's: {"name", "version"}, and
    "versions" as published."""
    return store_for(ref).identity(release)


def signed_identity(identity: dict) -> dict:
    """What a signature names of a reference's identity: its name and every version it is published under."""
    return {"name": identity["name"], "versions": identity["versions"]}


def _record_signature(d: Path, entry: dict) -> None:
    """The index names the signature and identity that travel with a variant, so a pull fetches exactly them."""
    for name, what in SIGNED.items():
        if (d / name).is_file():
            entry[f"{what}_sha256"] = hashlib.sha256((d / name).read_bytes()).hexdigest()


@dataclass(frozen=True)
class _Signing:
    """A publish's signing: the key (None: each variant keeps the signature it carries) and the identity it signs for."""

    key: str | os.PathLike | None
    identity: dict


def _stage_variant(src: Path, manifest: dict, dest: Path, signing: _Signing, link: bool) -> Path:
    """Copy (or hard-link, where the source must only be read) an artifact's files, and its
    signature and identity when it has them, to `dest`; with a key, sign the copy there."""
    rels = [MANIFEST, *_files(manifest)] + ([s for s in SIGNED if (src / s).is_file()] if signing.key is None else [])
    for rel in rels:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        if link:
            try:
                os.link(src / rel, dest / rel)
                continue
            except OSError:  # a filesystem without hard links
                pass
        shutil.copyfile(src / rel, dest / rel)
    if signing.key is not None:
        sign(dest, signing.key, signing.identity)
    return dest


def _files(manifest: dict) -> dict[str, dict]:
    """Every file of an artifact but the manifest: path relative to the artifact -> {sha256, size}."""
    files = dict(manifest["files"])
    files.update({f"kcache/{rel}": f for rel, f in manifest.get("kcache", {}).get("files", {}).items()})
    return files


def read_index(root: Path, ref: str) -> dict:
    path = root / INDEX
    if not path.is_file():
        raise QuantprepError(f"{ref}: no {INDEX}; not a published reference (quantprep publish writes one)")
    index = read_json_object(path, ArtifactError, "the published reference is corrupt", MAX_INDEX_BYTES)
    ok = (index.get("format") == INDEX_FORMAT and isinstance(index.get("variants"), list)
          and all(isinstance(v, dict) and isinstance(v.get("name"), str) and _safe_name(v["name"])
                  and isinstance(v.get("target"), str) and isinstance(v.get("compat"), dict)
                  and isinstance(v.get("manifest_sha256"), str) for v in index["variants"]))
    if not ok:
        raise ArtifactError(f"{path}: not a quantprep index (format {INDEX_FORMAT!r} with a list of variants)")
    if index.get("format_version") != INDEX_VERSION:
        raise ArtifactError(f"{path}: index format_version {index.get('format_version')!r}; this quantprep reads {INDEX_VERSION}: upgrade it")
    return index


def is_published(path: Path) -> bool:
    """`path` is provably a reference `publish` wrote: its index parses, and every other entry is
    a variant folder the index names (staging may replace it)."""
    try:
        names = {v["name"] for v in read_index(path, str(path))["variants"]}
    except (QuantprepError, OSError):
        return False
    return all(p.name == INDEX or (p.name in names and p.is_dir() and not p.is_symlink()) for p in path.iterdir())


def _safe_name(name: str) -> bool:
    return bool(name) and all(c.isalnum() or c in "-_." for c in name) and name not in (".", "..")


def machine_summary() -> str:
    from quantprep.targets import TARGET_NAMES, get_target

    have = []
    for t in map(get_target, TARGET_NAMES):
        if t.runtime_problem() is None:
            have.append(f"{t.name} {', '.join(f'{k}={v}' for k, v in t.compat_key().items())}")
    return "; ".join(have)


def fits(variant: dict) -> bool:
    """This machine can run the variant: its device is present and its compatibility key is ours."""
    from quantprep.targets import TARGET_NAMES, get_target

    if variant["target"] not in TARGET_NAMES:
        return False
    target = get_target(variant["target"])
    return target.runtime_problem() is None and target.compat_key() == variant["compat"]


def choose_variant(index: dict, ref: str, target: str | None = None) -> dict:
    variants = index["variants"]
    if target:
        chosen = [v for v in variants if v["target"] == target]
        if not chosen:
            raise ArtifactMismatch(f"{ref}: no {target} variant; on offer: {', '.join(v['name'] for v in variants) or 'none'}")
        return next((v for v in chosen if fits(v)), chosen[0])
    from quantprep.targets import TARGET_NAMES, get_target

    ranked = [(get_target(v["target"]).preference, i) for i, v in enumerate(variants) if v["target"] in TARGET_NAMES]
    for _, i in sorted(r for r in ranked if r[0] is not None):  # an accelerator's variant before the CPU's
        if fits(variants[i]):
            return variants[i]
    offer = ", ".join(f"{v['name']} ({', '.join(f'{k}={x}' for k, x in v['compat'].items())})" for v in variants) or "none"
    raise ArtifactMismatch(f"{ref}: no variant fits this machine; on offer: {offer}; this machine has: {machine_summary()}")


def cache_root() -> Path:
    return user_dir(settings.PULL_CACHE, "cache", "pulled")


def pull(ref: str, out: str | os.PathLike | None = None, target: str | None = None,
         verify_key: str | os.PathLike | None = None, plain_http: bool = False, force: bool = False) -> Path:
    """pull_checked's path."""
    return pull_checked(ref, out, target, verify_key, plain_http, force)[0]


def pull_checked(ref: str, out: str | os.PathLike | None = None, target: str | None = None,
                 verify_key: str | os.PathLike | None = None, plain_http: bool = False, force: bool = False) -> tuple[Path, bool]:
    """The variant of `ref` that fits this machine (or `target`), verified, in the local cache or
    `out`. Returns the artifact's directory. An unchanged reference is not copied again.
    verify_key: the variant must be signed for `ref` and verify with it; without one, the signature
    policy for `ref` decides (policy.py: the user's policy file, QUANTPREP_SIGNATURES,
    QUANTPREP_VERIFY_KEY). force: replace an `out` that is not an artifact. Also returns whether
    the signature verified (what lets its kcache run, kcache.trust_reason)."""
    mode, key = signature_policy(ref, verify_key)
    store = store_for(ref, plain_http)
    index, cache_id = store.read_index()
    variant = choose_variant(index, ref, target)
    dest = Path(out).absolute() if out else cache_root() / hashlib.sha256(cache_id.encode()).hexdigest()[:16] / variant["name"]
    asked = store.identity()
    if _is_copy_of(dest, variant):  # a finished pull of this very variant: nothing to fetch (offline)
        return dest, check_signature(dest, mode, key, ref, asked)
    with staging(dest, is_artifact, "quantprep artifact", force, mode=0o700) as tmp:
        source = store.variant(variant)
        source.copy(MANIFEST, tmp / MANIFEST, variant["manifest_sha256"], None)
        manifest = read_manifest(tmp)  # structure and self-digest; names every file with its sha256
        for rel, f in manifest["files"].items():
            source.copy(rel, tmp / rel, f["sha256"], f["size"])
        if manifest.get("kcache", {}).get("files"):
            source.kcache(tmp, manifest["kcache"]["files"])
        for name, what in SIGNED.items():
            if f"{what}_sha256" in variant:
                source.copy(name, tmp / name, variant[f"{what}_sha256"], None)
        read_checked(tmp, staged=True)  # nothing unlisted, every size right
        signed = check_signature(tmp, mode, key, ref, asked)
    mark(dest, manifest)  # every file was hashed as it was copied
    return dest, signed


def _valid_entry(v: dict) -> bool:
    return (isinstance(v.get("name"), str) and _safe_name(v["name"]) and isinstance(v.get("target"), str)
            and isinstance(v.get("compat"), dict) and isinstance(v.get("manifest_sha256"), str) and isinstance(v.get("digest"), str))


# Stores: where a reference's variants are, one class per scheme behind one protocol (Store);
# store_for picks it. What a store hands over is untrusted until pull_checked has hashed it.


class VariantSource(Protocol):
    def copy(self, rel: str, dest: Path, sha256: str, size: int | None) -> None: ...  # hashed while copied, size-bounded
    def kcache(self, tmp: Path, files: dict) -> None: ...


class Store(Protocol):
    where: str  # what the user is shown: the reference, or a directory's absolute path

    def identity(self, release: str | None = None) -> dict: ...
    def read_index(self) -> tuple[dict, str]: ...  # the index, checked, and the id the pull cache is keyed by
    def variant(self, entry: dict) -> VariantSource: ...
    def push(self, variants: list, index: dict, signing: _Signing, release: str | None, tag_given: bool, force: bool) -> dict: ...


def store_for(ref: str, plain_http: bool = False) -> Store:
    """The store a reference names; a malformed reference fails here, in one line."""
    if ref.startswith("oci://"):
        return OciStore(ref, plain_http)
    if ref.startswith("hf://"):
        return HubStore(ref)
    return DirStore(ref)


class DirStore:
    """A directory or file:// URL: REF/index.json and one folder per variant."""

    def __init__(self, ref: str):
        self.ref, self.path = ref, destination(ref)
        self.where = str(self.path.absolute())

    def identity(self, release: str | None = None) -> dict:
        return {"name": f"dir:{self.path.absolute().name}", "version": None, "versions": []}

    def read_index(self) -> tuple[dict, str]:
        if not self.path.is_dir():
            raise QuantprepError(f"{self.ref}: no such directory; pass a published reference (quantprep publish ... --to DIR)")
        return read_index(self.path, self.ref), str(self.path.absolute())

    def variant(self, entry: dict) -> VariantSource:
        return _FolderSource(self.path / entry["name"], self.ref)

    def push(self, variants: list, index: dict, signing: _Signing, release: str | None, tag_given: bool, force: bool) -> dict:
        with staging(self.path.absolute(), is_published, "published quantprep reference", force) as tmp:
            for (d, m, name), entry in zip(variants, index["variants"], strict=True):
                _record_signature(_stage_variant(d, m, tmp / name, signing, link=False), entry)
            (tmp / INDEX).write_bytes(_index_bytes(index))
        return {}


class _FolderSource:
    """A variant's folder on a filesystem."""

    def __init__(self, vdir: Path, ref: str):
        self.vdir, self.ref = vdir, ref

    def copy(self, rel: str, dest: Path, sha256: str, size: int | None) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        _copy_verified(self.vdir / rel, dest, sha256, size, self.ref)

    def kcache(self, tmp: Path, files: dict) -> None:
        for rel, f in files.items():
            self.copy(f"kcache/{rel}", tmp / "kcache" / rel, f["sha256"], f["size"])


@contextmanager
def _signed_copies(variants: list, index: dict, signing: _Signing) -> Iterator[list]:
    """The variants as a remote push sends them: with a key, signed copies (hard links of the files:
    the sources are only read) in a temporary directory. Each index entry names its signature."""
    with tempfile.TemporaryDirectory(prefix="quantprep-publish-") as stage:
        ready = [(_stage_variant(d, m, Path(stage) / name, signing, link=True) if signing.key else d, m, name, entry)
                 for (d, m, name), entry in zip(variants, index["variants"], strict=True)]
        for d, _, _, entry in ready:
            _record_signature(d, entry)
        yield ready


class OciStore:
    """oci://HOST[:PORT]/REPO:TAG: an image index whose entries are the variants (registry.py)."""

    def __init__(self, ref: str, plain_http: bool = False):
        self.ref, self.where, self.plain_http = ref, ref, plain_http
        _, self.repo, self.tag, _ = registry.parse_ref(ref, plain_http)

    def identity(self, release: str | None = None) -> dict:
        return {"name": f"oci:{self.repo}", "version": self.tag, "versions": [self.tag]}

    def read_index(self) -> tuple[dict, str]:
        self.reg, variants = registry.read_index(self.ref, self.plain_http)
        return {"variants": [v for v in variants if _valid_entry(v)]}, self.ref

    def variant(self, entry: dict) -> VariantSource:
        return _OciSource(self.reg, entry, self.ref)

    def push(self, variants: list, index: dict, signing: _Signing, release: str | None, tag_given: bool, force: bool) -> dict:
        with _signed_copies(variants, index, signing) as ready:
            registry.push(ready, self.ref, self.plain_http)
        return {}


class _OciSource:
    """A variant's artifact manifest in a registry: one layer per file, kcache/ as one tar."""

    def __init__(self, reg, variant: dict, ref: str):
        self.reg, self.ref = reg, ref
        self.layers = registry.variant_layers(reg, variant)

    def copy(self, rel: str, dest: Path, sha256: str, size: int | None) -> None:
        desc = self.layers.get(rel)
        if desc is None:
            raise ArtifactError(f"{self.ref}: {rel} is listed but has no layer in the published variant; it is incomplete: publish it again")
        if desc.get("digest") != f"sha256:{sha256}" or (size is not None and desc.get("size") != size):
            raise ArtifactError(f"{self.ref}: the layer for {rel} is not the file its manifest (or the index) lists; refusing it")
        self.reg.get_blob(desc, dest, MAX_JSON_BYTES if size is None else size)  # no size listed: the manifest or signature, JSON

    def kcache(self, tmp: Path, files: dict) -> None:
        desc = self.layers.get("kcache")
        if desc is None:
            raise ArtifactError(f"{self.ref}: the manifest lists kcache files but the variant has no kcache layer; publish it again")
        tar = tmp / ".kcache.tar"
        self.reg.get_blob(desc, tar, registry.kcache_tar_bound(files))  # the layer's digest; each file's sha256 as extracted
        try:
            registry.extract_kcache(tar, tmp / "kcache", files)
        except ArtifactError as e:
            raise ArtifactError(f"{self.ref}: {e}") from None
        finally:
            tar.unlink()


class HubStore:
    """hf://ORG/REPO[@REVISION]: the index and the variant folders, published in one commit and tagged (hub.py)."""

    def __init__(self, ref: str):
        self.ref, self.where = ref, ref
        self.repo_id, self.revision = hub.parse_ref(ref)

    def identity(self, release: str | None = None) -> dict:
        pinned = re.fullmatch(r"[0-9a-f]{40}", self.revision)  # a commit: made after signing, so no version to compare
        return {"name": f"hf:{self.repo_id}", "version": None if pinned else self.revision,
                "versions": [self.revision] + ([release] if release else [])}

    def read_index(self) -> tuple[dict, str]:
        from huggingface_hub import constants

        self.commit, index_dir = hub.download_index(self.ref, INDEX, MAX_INDEX_BYTES)
        return read_index(index_dir, self.ref), f"{constants.ENDPOINT}/{self.ref}"

    def variant(self, entry: dict) -> VariantSource:
        return _HubSource(self.ref, self.commit, entry["name"])

    def push(self, variants: list, index: dict, signing: _Signing, release: str | None, tag_given: bool, force: bool) -> dict:
        with _signed_copies(variants, index, signing) as ready:
            return {"release": hub.push(ready, (INDEX, _index_bytes(index)), self.ref, release, tag_given=tag_given)}


class _HubSource(_FolderSource):
    """A variant folder of a Hub reference: each file fetched (size-bounded) into huggingface_hub's
    cache, then copied out while hashed."""

    def __init__(self, ref: str, commit: str, name: str):
        self.ref, self.commit, self.name = ref, commit, name

    def copy(self, rel: str, dest: Path, sha256: str, size: int | None) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        src = hub.download_file(self.ref, self.commit, f"{self.name}/{rel}", MAX_JSON_BYTES if size is None else size)
        _copy_verified(src, dest, sha256, size, self.ref)


def _is_copy_of(dest: Path, variant: dict) -> bool:
    """A finished pull of this variant: its manifest (and signature) are the ones the index names and its files check."""
    try:
        if hashlib.sha256((dest / MANIFEST).read_bytes()).hexdigest() != variant["manifest_sha256"]:
            return False
        for name, what in SIGNED.items():
            if f"{what}_sha256" in variant and hashlib.sha256((dest / name).read_bytes()).hexdigest() != variant[f"{what}_sha256"]:
                return False
        read_checked(dest)
        return True
    except (OSError, ArtifactError):
        return False


def _copy_verified(src: Path, dest: Path, sha256: str, size: int | None, ref: str) -> None:
    """Copy while hashing; stop at one byte past the expected size. Refuses a missing, truncated,
    oversized or altered file in one line naming it."""
    limit = MAX_JSON_BYTES if size is None else size  # the manifest: at most what read_manifest reads
    try:
        with open(src, "rb") as fin, open(dest, "wb") as fout:
            got, n = write_hashed(iter(lambda: fin.read(8 << 20), b""), fout, limit)
    except FileNotFoundError:
        raise ArtifactError(f"{ref}: {src.name} is listed but missing from the published reference; it is incomplete: publish it again") from None
    if size is not None and n != size:
        raise ArtifactError(f"{ref}: {src} is {'larger' if n > size else 'smaller'} than the {size} bytes its manifest lists; refusing it")
    if got != sha256:
        raise ArtifactError(f"{ref}: {src} does not match the sha256 its manifest (or the index) lists; the published copy is corrupt or altered")
