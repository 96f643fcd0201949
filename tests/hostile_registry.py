"""A hand-made OCI registry on loopback that serves whatever a test puts in it: the real
docker-registry checks digests and media types, so hostile answers (deep JSON, a lying layer
size, an endless body, a sparse tar) need this one. It records each request and how many body
bytes it sent, and stops with the test."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from quantprep.distribution import registry as oci
from quantprep.format.artifact import MANIFEST, SIGNED


def digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


class HostileRegistry:
    def __init__(self):
        self.routes: dict[str, bytes | object] = {"/v2/": b"{}"}  # path -> body, or a callable yielding chunks
        self.requests: list[str] = []
        self.sent = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.do_GET(head=True)

            def do_GET(self, head=False):
                owner.requests.append(self.path)
                body = owner.routes.get(self.path)
                if body is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                if callable(body):  # an endless or huge answer: chunks until the client hangs up
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    try:
                        for chunk in body():
                            self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                            owner.sent += len(chunk)
                    except OSError:
                        pass
                    return
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)
                    owner.sent += len(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def ref(self, repo: str = "models/x", tag: str = "v1") -> str:
        return f"oci://{self.host}/{repo}:{tag}"

    def manifest(self, repo: str, reference: str, body: bytes) -> None:
        self.routes[f"/v2/{repo}/manifests/{reference}"] = body

    def blob(self, repo: str, data: bytes) -> dict:
        d = digest(data)
        self.routes[f"/v2/{repo}/blobs/{d}"] = data
        return {"digest": d, "size": len(data)}

    def publish(self, variant_dir: Path, name: str, entry: dict, repo: str = "models/x", tag: str = "v1",
                kcache_tar: bytes | None = None, layer_edit=None) -> None:
        """What registry.push would put there for one variant (one raw layer per file, kcache/ as one
        tar: `kcache_tar` replaces the honest one); `layer_edit(layers)` may change the descriptors."""
        m = json.loads((variant_dir / MANIFEST).read_text())
        layers = []
        for rel in [MANIFEST, *sorted(m["files"])] + [s for s in SIGNED if (variant_dir / s).is_file()]:
            layers.append(dict(self.blob(repo, (variant_dir / rel).read_bytes()), mediaType=oci.WEIGHT_CONFIG,
                               annotations={oci.FILEPATH: rel}))
        if m.get("kcache", {}).get("files"):
            tar = kcache_tar if kcache_tar is not None else oci._kcache_tar(variant_dir / "kcache", list(m["kcache"]["files"]))
            layers.append(dict(self.blob(repo, tar), mediaType=oci.CODE_TAR, annotations={oci.FILEPATH: "kcache"}))
        if layer_edit:
            layer_edit(layers)
        body = json.dumps({"schemaVersion": 2, "mediaType": oci.MANIFEST_MEDIA_TYPE, "layers": layers}).encode()
        self.manifest(repo, digest(body), body)
        index = {"schemaVersion": 2, "mediaType": oci.INDEX_MEDIA_TYPE, "manifests": [
            {"mediaType": oci.MANIFEST_MEDIA_TYPE, "digest": digest(body), "size": len(body),
             "annotations": {oci.VARIANT: name, "org.quantprep.entry": json.dumps(entry)}}]}
        self.manifest(repo, tag, json.dumps(index).encode())
