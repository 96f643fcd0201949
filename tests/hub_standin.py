"""A stand-in for the Hugging Face Hub's *write* API, for tests. It is not the Hub.

No open-source server accepts Hub uploads, so this implements the requests huggingface_hub's
`create_repo`, `repo_info`, `create_branch`, `create_commit` (preupload, the git-LFS batch API with
the "basic" transfer, the NDJSON commit), `create_tag` and `list_repo_refs` send, as the Hub answers
them (status codes and X-Error-Code headers that huggingface_hub maps to its exceptions), and
writes each commit into a plain git repository with git's own plumbing: a commit is built in a
scratch index and the branch moved with `git update-ref NEW OLD`, a compare-and-swap, so it lands
whole or not at all, and a `parentCommit` that is not the head is refused with 412 as the Hub does.
LFS objects go to `.git/lfs/objects/`, checked against their oid on upload. Reads are not served
here: olah (a real Hub-API mirror) serves the same repository to huggingface_hub's downloads.

What it does not do: xet storage, pull requests, multi-part LFS uploads, access rules beyond one
bearer token. Which files are LFS follows the Hub's rule in simplified form: *.safetensors, a
binary sample, or 10 MiB and more.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

GIT_ENV = {"GIT_AUTHOR_NAME": "hub", "GIT_AUTHOR_EMAIL": "hub@localhost", "GIT_COMMITTER_NAME": "hub",
           "GIT_COMMITTER_EMAIL": "hub@localhost", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
LFS_MIN_SIZE = 10 << 20
ZERO = "0" * 40


def git(repo: Path, *args: str, data: bytes | None = None, env: dict | None = None) -> str:
    out = subprocess.run(["git", *args], cwd=repo, input=data, capture_output=True, timeout=60,
                         env={**os.environ, **GIT_ENV, **(env or {})})
    if out.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {out.stderr.decode()}")
    return out.stdout.decode().strip()


def lfs_path(repo: Path, oid: str) -> Path:
    return repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


class HubStandIn:
    """Serves repositories under `root/models/ORG/REPO` (the layout olah's mirrors-path reads)."""

    def __init__(self, root: Path, token: str | None = None):
        self.root, self.token = Path(root), token
        self.lock = threading.Lock()
        self.secret = os.urandom(16).hex()  # signs upload URLs
        self.before_commit = None  # a callable run just before a commit is applied: a concurrent writer
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def repo(self, repo_id: str) -> Path:
        return self.root / "models" / repo_id

    def create(self, repo_id: str) -> bool:
        path = self.repo(repo_id)
        if path.exists():
            return False
        path.mkdir(parents=True)
        git(path, "init", "-q", "-b", "main")
        self.commit(repo_id, "main", {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}, [], "initial commit")
        return True

    def commit(self, repo_id: str, branch: str, files: dict[str, bytes], deleted: list[str], summary: str,
               parent: str | None = None) -> str:
        """Write `files` (path -> blob bytes, LFS pointers included) and remove `deleted` on `branch`
        in one commit; refuses (ValueError) when `parent` is given and is not the branch's head."""
        repo = self.repo(repo_id)
        with self.lock:
            head = _rev(repo, f"refs/heads/{branch}")
            if parent is not None and parent != head:
                raise ValueError(f"parent commit {parent} is not the head of {branch} ({head})")
            env = {"GIT_INDEX_FILE": str(repo / ".git" / "standin-index")}
            git(repo, "read-tree", *([head] if head else ["--empty"]), env=env)
            listed = set(git(repo, "ls-files", env=env).splitlines())
            for path in deleted:
                gone = [p for p in listed if p == path or p.startswith(path.rstrip("/") + "/")]
                if gone:
                    git(repo, "update-index", "--force-remove", "--", *gone, env=env)
            for path, blob in files.items():
                sha = git(repo, "hash-object", "-w", "--stdin", data=blob)
                git(repo, "update-index", "--add", "--cacheinfo", f"100644,{sha},{path}", env=env)
            tree = git(repo, "write-tree", env=env)
            new = git(repo, "commit-tree", tree, *(["-p", head] if head else []), "-m", summary)
            git(repo, "update-ref", f"refs/heads/{branch}", new, head or ZERO)
            return new


def _rev(repo: Path, rev: str) -> str | None:
    out = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=repo, capture_output=True,
                         timeout=60, env={**os.environ, **GIT_ENV})
    return out.stdout.decode().strip() or None


def _handler(hub: HubStandIn):
    api = re.compile(r"^/api/models/([^/]+/[^/]+)/(revision|preupload|commit|tag|branch)/(.+)$")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _reply(self, status: int, body=None, headers: dict | None = None):
            data = json.dumps(body if body is not None else {}).encode()
            self.send_response(status)
            for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, code: str | None, message: str):
            self._reply(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message} if code else {"X-Error-Message": message})

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _authorized(self) -> bool:
            if hub.token is None or self.headers.get("Authorization") == f"Bearer {hub.token}":
                return True
            self._body()
            self._error(401, None, "Invalid credentials in Authorization header")
            return False

        def do_GET(self):
            if not self._authorized():
                return
            if m := re.match(r"^/api/models/([^/]+/[^/]+)/refs$", self.path.split("?")[0]):
                repo = hub.repo(m.group(1))
                if not repo.exists():
                    return self._error(404, "RepoNotFound", "Repository not found")
                refs = {"branches": [], "tags": [], "converts": []}
                for line in git(repo, "for-each-ref", "--format=%(refname) %(objectname)").splitlines():
                    name, sha = line.split()
                    for prefix, group in (("refs/heads/", "branches"), ("refs/tags/", "tags")):
                        if name.startswith(prefix):
                            refs[group].append({"name": name[len(prefix):], "ref": name, "targetCommit": sha})
                return self._reply(200, refs)
            m = api.match(self.path.split("?")[0])
            if not m or m.group(2) != "revision":
                return self._error(404, None, "not served by the stand-in (olah serves reads)")
            repo, rev = hub.repo(m.group(1)), unquote(m.group(3))
            if not repo.exists():
                return self._error(404, "RepoNotFound", "Repository not found")
            sha = _rev(repo, rev)
            if sha is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            siblings = [{"rfilename": p} for p in git(repo, "ls-tree", "-r", "--name-only", sha).splitlines()]
            self._reply(200, {"id": m.group(1), "modelId": m.group(1), "sha": sha, "private": False, "siblings": siblings})

        def do_PUT(self):
            # An upload URL is pre-signed, as the Hub's S3 URLs are: no Authorization header, a signature in the query.
            m = re.match(r"^/_lfs/([^/]+/[^/]+)/([0-9a-f]{64})\?sig=(\w+)$", self.path)
            data = self._body()
            if not m or m.group(3) != _sign(hub, m.group(1), m.group(2)):
                return self._error(403, None, "upload URL not signed")
            oid = m.group(2)
            if hashlib.sha256(data).hexdigest() != oid:  # the Hub refuses an object that is not its oid
                return self._error(400, None, "uploaded content does not match its oid")
            path = lfs_path(hub.repo(m.group(1)), oid)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{threading.get_ident()}.part")  # the same object may arrive twice at once
            tmp.write_bytes(data)
            os.replace(tmp, path)
            self._reply(200, {})

        def do_POST(self):
            if not self._authorized():
                return
            path = self.path.split("?")[0]
            body = self._body()
            if path == "/api/repos/create":
                req = json.loads(body)
                repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                if not hub.create(repo_id):  # the Hub's 409 names the repository, as huggingface_hub expects
                    return self._reply(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"})
                return self._reply(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})
            if m := re.match(r"^/([^/]+/[^/]+)\.git/info/lfs/objects/batch$", path):
                req, repo = json.loads(body), hub.repo(m.group(1))
                objects = []
                for o in req["objects"]:
                    entry = {"oid": o["oid"], "size": o["size"]}
                    if not lfs_path(repo, o["oid"]).is_file():
                        href = f"{hub.url}/_lfs/{m.group(1)}/{o['oid']}?sig={_sign(hub, m.group(1), o['oid'])}"
                        entry["actions"] = {"upload": {"href": href}}
                    objects.append(entry)
                return self._reply(200, {"transfer": "basic", "objects": objects}, {"Content-Type": "application/vnd.git-lfs+json"})
            m = api.match(path)
            if not m:
                return self._error(404, None, "not served by the stand-in")
            repo_id, kind, rev = m.group(1), m.group(2), unquote(m.group(3))
            repo = hub.repo(repo_id)
            if not repo.exists():
                return self._error(404, "RepoNotFound", "Repository not found")
            if kind == "preupload":
                files = json.loads(body)["files"]
                modes = [{"path": f["path"], "shouldIgnore": False,
                          "uploadMode": "lfs" if _is_lfs(f["path"], base64.b64decode(f["sample"]), f["size"]) else "regular"}
                         for f in files]
                return self._reply(200, {"files": modes})
            if kind == "branch":
                start = _rev(repo, (json.loads(body or b"{}").get("startingPoint")) or "main")
                if _rev(repo, f"refs/heads/{rev}"):
                    return self._error(409, None, "Branch already exists")
                git(repo, "update-ref", f"refs/heads/{rev}", start, ZERO)
                return self._reply(200, {})
            if kind == "tag":
                sha, tag = _rev(repo, rev), json.loads(body)["tag"]
                if sha is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                if _rev(repo, f"refs/tags/{tag}"):
                    return self._error(409, None, "Tag already exists")
                git(repo, "update-ref", f"refs/tags/{tag}", sha, ZERO)
                return self._reply(200, {})
            return self._commit(repo_id, repo, rev, body)

        def _commit(self, repo_id: str, repo: Path, branch: str, body: bytes):
            lines = [json.loads(x) for x in body.splitlines() if x.strip()]
            header = next(x["value"] for x in lines if x["key"] == "header")
            files, deleted = {}, []
            for x in lines:
                v = x["value"]
                if x["key"] == "file":
                    files[v["path"]] = base64.b64decode(v["content"])
                elif x["key"] == "lfsFile":
                    obj = lfs_path(repo, v["oid"])
                    if not obj.is_file():
                        return self._error(400, None, f"LFS object {v['oid']} for {v['path']} was never uploaded")
                    files[v["path"]] = lfs_pointer(v["oid"], obj.stat().st_size)
                elif x["key"] in ("deletedFile", "deletedFolder"):
                    deleted.append(v["path"])
            if hub.before_commit is not None:
                hub.before_commit()
            try:
                oid = hub.commit(repo_id, branch, files, deleted, header["summary"], header.get("parentCommit"))
            except ValueError as e:
                return self._error(412, None, str(e))
            self._reply(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None})

    return Handler


def _sign(hub: HubStandIn, repo_id: str, oid: str) -> str:
    return hashlib.sha256(f"{hub.secret}:{repo_id}:{oid}".encode()).hexdigest()


def _is_lfs(path: str, sample: bytes, size: int) -> bool:
    try:
        sample.decode("utf-8")
        binary = b"\0" in sample
    except UnicodeDecodeError:
        binary = True
    return path.endswith(".safetensors") or binary or size >= LFS_MIN_SIZE
