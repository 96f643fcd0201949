"""OCI registries (oci://HOST[:PORT]/REPO:TAG): a publish is an image index whose entries are the
variants, each an artifact manifest with the CNCF ModelPack media types (modelpack/model-spec
docs/spec.md): one raw layer per file with its path in `org.cncf.model.filepath`, `kcache/` as one
tar layer, quantprep's manifest as a layer of its own media type. The registry protocol is oras's
client (requests, auth from docker's config); the manifests are built here, since oras flattens
nested paths, has no `artifactType` argument, and does not check digests on download. Every blob
pulled is checked against its digest here, and every file against quantprep's manifest by
publish.py before anything is published locally.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from urllib.parse import urlparse

from quantprep._io.jsonfile import parse_json_object
from quantprep.errors import ArtifactError, QuantprepError
from quantprep.format.artifact import MANIFEST, SIGNED, write_hashed
from quantprep.targets import get_target

INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE = "application/vnd.cncf.model.manifest.v1+json"
CONFIG_MEDIA_TYPE = "application/vnd.cncf.model.config.v1+json"
WEIGHT = "application/vnd.cncf.model.weight.v1.raw"
WEIGHT_CONFIG = "application/vnd.cncf.model.weight.config.v1.raw"
CODE_TAR = "application/vnd.cncf.model.code.v1.tar"  # kcache/: compiled kernels
QUANTPREP_MANIFEST = "application/vnd.quantprep.manifest.v1+json"
SIGNATURE_MEDIA_TYPE = "application/vnd.quantprep.signature.v1+json"
FILEPATH = "org.cncf.model.filepath"
VARIANT = "org.quantprep.variant"
ENTRY = "org.quantprep.entry"  # publish.py's index entry of the variant, as JSON text
MAX_MANIFEST_BYTES = 4 << 20
PROBE_BYTES = 4 << 10  # the /v2/ probe's body is read only this far: a registry's answer is untrusted
ERROR_BYTES = 512  # of an error answer, quoted in the one-line message


def parse_ref(ref: str, plain_http: bool = False) -> tuple[str, str, str, bool]:
    """oci://HOST[:PORT]/REPO[:TAG] -> (host, repo, tag, plain http). Loopback hosts speak plain
    HTTP, as docker does; others only with plain_http."""
    parsed = urlparse(ref)
    path = parsed.path.lstrip("/")
    if parsed.scheme != "oci" or not parsed.netloc or not path:
        raise QuantprepError(f"{ref}: not an OCI reference; write oci://HOST[:PORT]/REPOSITORY[:TAG]")
    repo, _, tag = path.partition(":")
    if not repo or any(c not in "abcdefghijklmnopqrstuvwxyz0123456789._-/" for c in repo):
        raise QuantprepError(f"{ref}: repository {repo!r} must be lowercase letters, digits, '.', '_', '-' and '/'")
    host = parsed.netloc
    loopback = (parsed.hostname or "") in ("127.0.0.1", "localhost", "::1")
    return host, repo, tag or "latest", plain_http or loopback


class Registry:
    """One repository on one registry, through oras's client."""

    def __init__(self, ref: str, plain_http: bool = False):
        import logging

        try:
            import oras.provider
        except ImportError:
            raise QuantprepError("OCI references need oras: pip install 'quantprep[publish]'") from None

        logging.getLogger("oras").setLevel(logging.CRITICAL)  # its errors are reported here, in one line
        self.ref = ref
        self.host, self.repo, self.tag, insecure = parse_ref(ref, plain_http)
        self.client = oras.provider.Registry(hostname=self.host, insecure=insecure)
        self.base = f"{'http' if insecure else 'https'}://{self.host}/v2/{self.repo}"
        self._probe(f"{'http' if insecure else 'https'}://{self.host}/v2/")

    def _probe(self, url: str) -> None:
        """Fail fast, in one line, when nothing answers: oras retries a dead address for minutes."""
        import requests

        try:
            with requests.get(url, timeout=10, verify=self.client._tls_verify, stream=True) as r:
                r.raw.read(PROBE_BYTES)  # never the whole body: it is the registry's to make endless
        except requests.RequestException as e:
            raise QuantprepError(f"{self.ref}: registry {self.host} unreachable ({type(e).__name__}); check the address and that it runs") from None

    def _request(self, method: str, url: str, **kw):
        import requests

        # oras's do_request without its retry decorator, which sleeps ~2 minutes over five tries
        # before a refused login or a dead address gives up; the probe above covers the address.
        do_request = getattr(type(self.client).do_request, "__wrapped__", type(self.client).do_request)
        kw.setdefault("stream", True)  # every body is read bounded (_text, get_manifest, get_blob)
        try:
            response = do_request(self.client, url, method, **kw)
        except requests.RequestException as e:
            raise QuantprepError(f"{self.ref}: lost the registry {self.host} or its token service ({type(e).__name__}); "
                                 f"check the address, that it runs, and its auth realm") from None
        except ValueError:  # oras: "Cannot respond to request for authentication."
            raise QuantprepError(f"{self.ref}: the registry asks for credentials that were not accepted (HTTP 401); "
                                 f"log in (docker login {self.host}) or check the repository's permissions") from None
        if response.status_code in (401, 403):
            raise QuantprepError(f"{self.ref}: the registry refused access (HTTP {response.status_code}); log in "
                                 f"(docker login {self.host}) or check the repository's permissions")
        return response

    @staticmethod
    def _text(response) -> str:
        """The start of an error answer's body, for a message (never the whole body)."""
        return response.raw.read(ERROR_BYTES, decode_content=True).decode(errors="replace").replace("\n", " ")

    # --- push ---------------------------------------------------------------------------------

    def push_blob(self, data_or_path: bytes | Path, media_type: str, annotations: dict | None = None) -> dict:
        if isinstance(data_or_path, Path):
            h = hashlib.sha256()
            with open(data_or_path, "rb") as f:
                while chunk := f.read(8 << 20):
                    h.update(chunk)
            size, path = data_or_path.stat().st_size, data_or_path
        else:
            h, size, path = hashlib.sha256(data_or_path), len(data_or_path), None
        desc = {"mediaType": media_type, "digest": f"sha256:{h.hexdigest()}", "size": size}
        if annotations:
            desc["annotations"] = annotations
        if self._request("HEAD", f"{self.base}/blobs/{desc['digest']}").status_code == 200:
            return desc
        start = self._request("POST", f"{self.base}/blobs/uploads/")
        if start.status_code != 202:
            raise QuantprepError(f"{self.ref}: the registry would not start an upload (HTTP {start.status_code})")
        location = start.headers["Location"]
        if location.startswith("/"):
            location = f"{self.base.split('/v2/')[0]}{location}"
        url = f"{location}{'&' if '?' in location else '?'}digest={desc['digest']}"
        if path is not None:
            with open(path, "rb") as f:
                done = self._request("PUT", url, data=f, headers={"Content-Type": "application/octet-stream"})
        else:
            done = self._request("PUT", url, data=data_or_path, headers={"Content-Type": "application/octet-stream"})
        if done.status_code != 201:
            raise QuantprepError(f"{self.ref}: the registry refused a blob (HTTP {done.status_code}: {self._text(done)[:200]})")
        return desc

    def push_manifest(self, body: bytes, media_type: str, reference: str) -> None:
        r = self._request("PUT", f"{self.base}/manifests/{reference}", data=body, headers={"Content-Type": media_type})
        if r.status_code != 201:
            raise QuantprepError(f"{self.ref}: the registry refused a manifest (HTTP {r.status_code}: {self._text(r)[:200]})")

    # --- pull ---------------------------------------------------------------------------------

    def get_manifest(self, reference: str, media_type: str) -> tuple[dict, bytes]:
        r = self._request("GET", f"{self.base}/manifests/{reference}", headers={"Accept": media_type}, stream=True)
        if r.status_code == 404:
            raise QuantprepError(f"{self.ref}: no such tag or manifest {reference!r} in {self.repo}")
        if r.status_code != 200:
            raise QuantprepError(f"{self.ref}: the registry answered HTTP {r.status_code} for manifest {reference!r}")
        body = r.raw.read(MAX_MANIFEST_BYTES + 1, decode_content=True)
        if len(body) > MAX_MANIFEST_BYTES:
            raise ArtifactError(f"{self.ref}: manifest {reference!r} is larger than {MAX_MANIFEST_BYTES} bytes; refusing it")
        if reference.startswith("sha256:") and f"sha256:{hashlib.sha256(body).hexdigest()}" != reference:
            raise ArtifactError(f"{self.ref}: manifest {reference} does not match its digest; the registry's copy is corrupt or altered")
        return parse_json_object(body, f"{self.ref}: manifest {reference!r}", ArtifactError, "refusing it", MAX_MANIFEST_BYTES), body

    def get_blob(self, desc: dict, dest: Path, max_size: int) -> None:
        """Download a blob to `dest`, checking its size and digest (oras checks neither). A blob
        whose descriptor says more than `max_size` bytes (what quantprep's manifest allows for
        that file) is refused before any byte is fetched."""
        digest, size = desc.get("digest", ""), desc.get("size")
        if not (isinstance(digest, str) and digest.startswith("sha256:") and isinstance(size, int) and size >= 0):
            raise ArtifactError(f"{self.ref}: a layer descriptor without a sha256 digest and size; refusing it")
        if size > max_size:
            raise ArtifactError(f"{self.ref}: layer {digest[:19]}... says {size} bytes, more than the {max_size} its file may have; refusing it")
        r = self._request("GET", f"{self.base}/blobs/{digest}", stream=True)
        if r.status_code != 200:
            raise ArtifactError(f"{self.ref}: blob {digest[:19]}... is missing from the registry (HTTP {r.status_code})")
        with open(dest, "wb") as f:
            got, n = write_hashed(r.iter_content(8 << 20), f, size)
        if n != size or f"sha256:{got}" != digest:
            raise ArtifactError(f"{self.ref}: blob {_filepath(desc) or digest[:19]} does not match its "
                                f"digest and size; the registry's copy is corrupt or altered")


def _filepath(desc) -> str | None:
    """A layer descriptor's file path annotation; None when it has none or is malformed."""
    annotations = desc.get("annotations") if isinstance(desc, dict) else None
    path = annotations.get(FILEPATH) if isinstance(annotations, dict) else None
    return path if isinstance(path, str) else None


def _media_type(rel: str) -> str:
    return WEIGHT if rel.endswith(".safetensors") or rel == "openvino_model.bin" else WEIGHT_CONFIG


def _kcache_tar(root: Path, files: list[str]) -> bytes:
    """kcache/ as one reproducible tar: sorted names, no owners, no times."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted(files):
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = (root / rel).stat().st_size, 0o644, 0
            with open(root / rel, "rb") as f:
                tar.addfile(info, f)
    return buf.getvalue()


def push(variants: list[tuple[Path, dict, str, dict]], ref: str, plain_http: bool = False) -> None:
    """variants: (artifact dir, quantprep manifest, variant name, index entry). Blobs, then one
    manifest per variant by digest, then the index under the tag: a reader of the tag sees the
    old publish or the complete new one."""
    reg = Registry(ref, plain_http)
    entries = []
    for d, m, name, entry in variants:
        layers = [reg.push_blob(d / MANIFEST, QUANTPREP_MANIFEST, {FILEPATH: MANIFEST})]
        layers += [reg.push_blob(d / rel, _media_type(rel), {FILEPATH: rel}) for rel in sorted(m["files"])]
        if m.get("kcache", {}).get("files"):
            layers.append(reg.push_blob(_kcache_tar(d / "kcache", list(m["kcache"]["files"])), CODE_TAR, {FILEPATH: "kcache"}))
        layers += [reg.push_blob(d / name, SIGNATURE_MEDIA_TYPE, {FILEPATH: name}) for name in SIGNED if (d / name).is_file()]
        bits = "/".join(map(str, sorted({x["bits"] for x in m["modules"].values()})))
        config = {"descriptor": {"name": name, "createdAt": m["created"]},  # modelpack/model-spec docs/config.md
                  "config": {"format": get_target(m["target"]["name"]).model_format,
                             "quantization": f"gptq-int{bits}"},
                  "modelfs": {"type": "layers", "diffIds": [x["digest"] for x in layers]}}
        config_desc = reg.push_blob(json.dumps(config, sort_keys=True).encode(), CONFIG_MEDIA_TYPE)
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE, "artifactType": ARTIFACT_TYPE,
                    "config": config_desc, "layers": layers, "annotations": {VARIANT: name}}
        body = json.dumps(manifest, sort_keys=True).encode()
        digest = f"sha256:{hashlib.sha256(body).hexdigest()}"
        reg.push_manifest(body, MANIFEST_MEDIA_TYPE, digest)
        entries.append({"mediaType": MANIFEST_MEDIA_TYPE, "artifactType": ARTIFACT_TYPE, "digest": digest, "size": len(body),
                        "annotations": {VARIANT: name, ENTRY: json.dumps(entry, sort_keys=True)}})
    index = {"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "manifests": entries}
    reg.push_manifest(json.dumps(index, sort_keys=True).encode(), INDEX_MEDIA_TYPE, reg.tag)


def read_index(ref: str, plain_http: bool = False) -> tuple[Registry, list[dict]]:
    """The variants on offer, as publish.py's index entries, each with its manifest `digest`."""
    reg = Registry(ref, plain_http)
    index, _ = reg.get_manifest(reg.tag, INDEX_MEDIA_TYPE)
    variants = []
    manifests = index.get("manifests")
    if not isinstance(manifests, list):
        raise ArtifactError(f"{ref}: the image index has no list of manifests; not a quantprep publish")
    for m in manifests:
        annotations = m.get("annotations") if isinstance(m, dict) else None
        raw = annotations.get(ENTRY) if isinstance(annotations, dict) else None
        if not isinstance(raw, str):
            continue  # not a quantprep variant
        entry = parse_json_object(raw, f"{ref}: the index entry of {m.get('digest')!r}", ArtifactError, "refusing the publish")
        variants.append(dict(entry, digest=m.get("digest")))
    return reg, variants


def variant_layers(reg: Registry, variant: dict) -> dict:
    """The variant's layer descriptors by file path (its manifest fetched by digest and checked
    against it); the caller downloads and checks each against quantprep's manifest."""
    manifest, _ = reg.get_manifest(variant["digest"], MANIFEST_MEDIA_TYPE)
    layers = {}
    descs = manifest.get("layers")
    if not isinstance(descs, list):
        raise ArtifactError(f"{reg.ref}: variant {variant.get('name')} has no list of layers; not a quantprep publish")
    for desc in descs:
        rel = _filepath(desc)
        if not isinstance(rel, str) or "/" in rel or rel.startswith(".") or not rel:
            raise ArtifactError(f"{reg.ref}: a layer names {rel!r} as its file path; refusing the variant")
        layers[rel] = desc
    if MANIFEST not in layers:
        raise ArtifactError(f"{reg.ref}: variant {variant.get('name')} has no {MANIFEST} layer; not a quantprep publish")
    return layers


def _blocks(n: int) -> int:
    return -(-n // 512) * 512


def kcache_tar_bound(listed: dict) -> int:
    """The most bytes the kcache tar of these files can take (_kcache_tar's layout): per member a
    header, a PAX header with its records, the data padded to 512; then tar's closing record."""
    return tarfile.RECORDSIZE + sum(2 * 512 + _blocks(len(rel.encode()) + 512) + _blocks(f["size"]) for rel, f in listed.items())


def extract_kcache(tar_path: Path, dest: Path, listed: dict) -> None:
    """Unpack the kcache tar: regular, non-sparse members only, each named in the manifest's
    kcache entry with exactly its listed size, hashed while written and compared with its listed
    sha256 (so nothing larger than the manifest says is ever written, and nothing is read twice)."""
    seen = set()
    with tarfile.open(tar_path, mode="r:") as tar:
        for member in tar:
            f = listed.get(member.name)
            if not member.isfile() or member.issparse() or f is None or member.name in seen:
                raise ArtifactError(f"kcache layer: {member.name!r} is not a plain file listed once in the manifest; refusing the variant")
            if member.size != f["size"]:
                raise ArtifactError(f"kcache layer: {member.name!r} is {member.size} bytes, the manifest lists {f['size']}; refusing the variant")
            seen.add(member.name)
            target = dest / member.name
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as fin, open(target, "wb") as fout:
                got, n = write_hashed(iter(lambda: fin.read(8 << 20), b""), fout, f["size"])
            if n != f["size"] or got != f["sha256"]:
                raise ArtifactError(f"kcache layer: {member.name!r} does not match the sha256 and size the manifest lists; refusing the variant")
    if missing := sorted(set(listed) - seen):
        raise ArtifactError(f"kcache layer: {missing[0]!r} is listed in the manifest but missing; refusing the variant")
