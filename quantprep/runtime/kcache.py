"""The kernel cache (`kcache/`): its key, trust, environment, runtime copy and activation.

`warm` (build side) fills it; `load` and `quantprep exec` use it. Both go through this module,
which never imports the build side.

A kcache is code: Inductor's cache holds `.so`, `.cpp` and `.py` files it executes, AOTInductor
packages are shared libraries, Triton's cache holds host launcher libraries it dlopens, and the
mega-cache and Inductor artifacts are unpickled (docs/artifact-format.md lists each file kind and
when it is read). The manifest's digests prove only that nothing changed since the manifest was
written, and anyone can write a manifest. So a kcache is used only when trusted:
- warmed here: `warm` records the digest of the kcache it published in this user's trust store;
- signed: the artifact's signature verifies against a key the user configured (publishing adds
  signatures; `trusted_by_signature` is the hook);
- the user says so: `load(..., trust_kcache=True)`, `--trust-kcache`, `QUANTPREP_TRUST_KCACHE=1`.
Otherwise it is ignored with one warning, and no runtime is pointed at any of its files.

A trusted kcache whose key matches this machine is copied once to a private per-user directory
(the runtimes write into their caches; the artifact stays read-only and verifiable) and the
runtimes are pointed at that copy.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import stat
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from quantprep import settings
from quantprep._io.userdirs import private_dir, user_dir
from quantprep.distribution.signing import configured_key, verify
from quantprep.errors import ArtifactError, QuantprepError
from quantprep.format.artifact import SIGNATURE, read_manifest, sha256_file, write_hashed
from quantprep.targets import device_target

KCACHE = "kcache"
MEGACACHE = "torch-compile.bin"  # torch.compiler.save_cache_artifacts() output
PLAN = "plan.json"  # the kernel plan (runtime/plan.py): plain JSON, used without compile too
TRUST_ENV = settings.TRUST_KCACHE
COMPLETE = ".complete"  # marks a finished runtime copy


def cache_env(root: Path) -> dict[str, str]:
    """Environment that points every kernel cache of torch and the Intel runtime under `root`,
    with each directory created: Intel's compute-runtime switches its cache off when an explicitly
    set NEO_CACHE_DIR does not exist. NEO/SYCL are read when the device initialises, so they must
    be set before it starts."""
    env = {
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        # Every Triton kernel, Inductor's and the eager ones (quantprep's cuda GEMM, JIT-compiled at
        # first call). Left to Inductor, the eager kernels that ran before its first compile went to
        # ~/.triton, outside the artifact.
        "TRITON_CACHE_DIR": str(root / "triton"),
        "NEO_CACHE_PERSISTENT": "1",
        "NEO_CACHE_DIR": str(root / "neo"),
        "NEO_CACHE_MAX_SIZE": "0",  # no eviction (the driver's default is 1 GB): the dir is quantprep's own
        "SYCL_CACHE_PERSISTENT": "1",
        "SYCL_CACHE_DIR": str(root / "sycl"),
    }
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "NEO_CACHE_DIR", "SYCL_CACHE_DIR"):
        os.makedirs(env[var], mode=0o700, exist_ok=True)
    return env


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_key(device_type: str, device_fields: bool = True) -> dict:
    """What a compiled kernel depends on: a cache built under another key is not used.
    device_fields=False leaves out what only a started device can say (name, driver)."""
    import torch  # here: an openvino artifact's load reads its kcache without torch

    key = {"device": device_type, "torch": torch.__version__, "python": platform.python_version(),
           "triton": _version("triton") or _version("pytorch-triton-xpu")}
    return key | device_target(device_type).cache_key_fields(started=device_fields)


def kcache_problem(path: Path, manifest: dict, full_hash: bool = False) -> str | None:
    """Why the shipped kcache/ does not match its manifest entry (missing, extra or truncated file;
    with `full_hash`, altered), else None. Loading hashes each file as it copies it (materialize)."""
    entry = manifest["kcache"]
    root = path / KCACHE
    listed = set(entry["files"])
    if root.is_dir():
        for p in root.rglob("*"):
            if p.is_file() and p.relative_to(root).as_posix() not in listed:
                return f"{p}: unknown file in kcache/ (not in manifest.json)"
    for rel, f in entry["files"].items():
        p = root / rel
        if not p.is_file() or p.is_symlink():
            return f"{p}: missing (listed in manifest.json kcache)"
        if p.stat().st_size != f["size"] or (full_hash and sha256_file(p) != f["sha256"]):
            return f"{p}: {'sha256' if p.stat().st_size == f['size'] else 'size'} does not match manifest.json; the kernel cache is corrupted"
    return None


def key_mismatch(built: dict, here: dict, partial: bool = False) -> str | None:
    """The first key field that differs; `partial`: only the fields `here` has (cache_key without device fields)."""
    diff = [k for k in sorted(set(here) if partial else set(built) | set(here)) if built.get(k) != here.get(k)]
    if diff:
        k = diff[0]
        return f"kernel cache built for {k}={built.get(k)!r}, this machine has {k}={here.get(k)!r}"
    return None


# --- trust ----------------------------------------------------------------------------------------

def kcache_digest(entry: dict) -> str:
    """sha256 of the manifest's kcache entry, which lists every file's sha256: names exactly the
    cache content that kcache_problem then checks file by file."""
    return hashlib.sha256(json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def trust_dir() -> Path:
    """This user's trust store: one empty file per trusted kcache digest."""
    return user_dir(settings.TRUST_DIR, "data", "trusted-kcache")


def record_trust(entry: dict) -> None:
    """`warm` calls this for the kcache it just built: this user's own processes made that code."""
    store = private_dir(trust_dir())
    (store / kcache_digest(entry)).touch()


def trusted_by_signature(path: Path) -> bool:
    """The artifact carries a signature that verifies against the key the user configured
    (QUANTPREP_VERIFY_KEY; signing.py)."""
    key = configured_key()
    if key is None or not (path / SIGNATURE).is_file():
        return False
    try:
        verify(path, key)
    except QuantprepError as e:
        warnings.warn(f"kernel cache not trusted by signature: {e}", stacklevel=3)
        return False
    return True


def trust_reason(path: Path, manifest: dict, trust: bool = False, signed: bool = False) -> str | None:
    """Why this kcache may run here, or None. signed: the caller verified the artifact's signature."""
    if trust:
        return "trust_kcache"
    if signed:
        return "signature"
    if os.environ.get(TRUST_ENV) == "1":
        return TRUST_ENV
    try:
        if (private_dir(trust_dir()) / kcache_digest(manifest["kcache"])).is_file():
            return "warmed here"
    except ArtifactError as e:
        warnings.warn(f"trust store ignored: {e}", stacklevel=3)
    if trusted_by_signature(path):
        return "signature"
    return None


def untrusted_message(path: Path) -> str:
    return (f"{path}: kcache/ (compiled code, or a kernel plan timed elsewhere) was not built here and is not trusted here, so it is not "
            f"used; trust it with load(..., trust_kcache=True), --trust-kcache or {TRUST_ENV}=1, or re-run `quantprep warm {path}` here")


class Kcache:
    """An artifact's kcache/ as load (or exec) opened it, once: its manifest entry (None: the artifact
    has none), whether its files are the ones listed (`problem`), and why its code may run here
    (`trusted`: trust_reason, decided the first time it is asked and then carried; None: it may not).
    activate, runtime/openvino.py's cache_status and exec_env read these instead of deriving them."""

    def __init__(self, path: Path, manifest: dict, trust: bool = False, signed: bool = False):
        self.path, self.manifest, self.entry = path, manifest, manifest.get("kcache")
        self._trust, self._signed = trust, signed  # signed: the caller verified the artifact's signature

    @functools.cached_property
    def problem(self) -> str | None:
        """kcache_problem, when first asked: a load that will not use the kcache never lists its files."""
        return kcache_problem(self.path, self.manifest) if self.entry is not None else None

    @functools.cached_property
    def trusted(self) -> str | None:
        return trust_reason(self.path, self.manifest, self._trust, self._signed)

    def mismatch(self, here: dict, partial: bool = False) -> str | None:
        """key_mismatch of its key against `here` (this machine's)."""
        return key_mismatch(self.entry["key"], here, partial)

    def runtime_copy(self) -> Path:
        """The private writable copy (materialize); ArtifactError when a file does not match."""
        return materialize(self.path, self.manifest)


# --- the runtime copy -----------------------------------------------------------------------------

def runtime_dir(manifest: dict) -> Path:
    """Private per-user writable copy of kcache/, one per kcache content (its digest names it)."""
    base = user_dir(settings.KCACHE_DIR, "cache", "kcache")
    return private_dir(base) / kcache_digest(manifest["kcache"])[:16]


def _triton_group(rel: str) -> bool:
    parts = rel.split("/")
    return len(parts) == 3 and parts[0] == "triton" and parts[2].startswith("__grp__") and parts[2].endswith(".json")


def _stamps(dest: Path, files: dict) -> str:
    """The copy's listed files as they are now: identity and change stamps (format/verified.py's
    reasoning: a write changes ctime, which no one can set back)."""
    rows = []
    for rel in sorted(files):
        st = os.lstat(dest / rel)
        rows.append([rel, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    return json.dumps(rows)


def _copy_is_intact(path: Path, dest: Path, files: dict) -> bool:
    """The runtime copy still holds the artifact's files (Triton's group files as materialize
    rewrote them); the runtimes may have added files of their own. Files unchanged since they were
    hashed (their stamps in COMPLETE) are not hashed again: a compiled model is gigabytes."""
    st = os.lstat(dest)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return False
    try:
        unchanged = (dest / COMPLETE).read_text() == _stamps(dest, files)
    except (OSError, ValueError):
        unchanged = False
    for rel, f in files.items():
        p = dest / rel
        if _triton_group(rel):
            if not p.is_file() or p.is_symlink() or not _points_into(p, dest / Path(rel).parent):
                return False
        elif not p.is_file() or p.is_symlink() or p.stat().st_size != f["size"] or not (unchanged or sha256_file(p) == f["sha256"]):
            return False
    if not unchanged:
        with contextlib.suppress(OSError):
            (dest / COMPLETE).write_text(_stamps(dest, files))
    return True


def materialize(path: Path, manifest: dict) -> Path:
    """The kcache's runtime copy: an existing one is used after its files are checked against the
    manifest, else copied afresh into a new 0700 directory (then renamed into place), each file
    hashed as it is copied and compared there: what runs is what was hashed, and the artifact is
    read once (a file swapped in the artifact after a separate check would otherwise be what runs).
    ArtifactError when a file does not match."""
    dest = runtime_dir(manifest)
    files = manifest["kcache"]["files"]
    if (dest / COMPLETE).is_file():
        if _copy_is_intact(path, dest, files):
            return dest
        shutil.rmtree(dest, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))  # 0700
    try:
        for rel, f in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            _copy_hashed(path / KCACHE / rel, tmp / rel, f, dest / Path(rel).parent if _triton_group(rel) else None)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / COMPLETE).write_text(_stamps(tmp, files))  # hashed as copied
    try:
        os.rename(tmp, dest)
    except OSError:  # another process won the race: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _copy_hashed(src: Path, dest: Path, f: dict, repoint: Path | None) -> None:
    """Copy one kcache file while hashing it (at most its listed size); refuse a mismatch. A Triton
    group file (`repoint`: its final directory) is checked as shipped, then written repointed."""
    try:
        with open(src, "rb") as fin:
            if repoint is None:
                with open(dest, "wb") as fout:
                    got, n = write_hashed(iter(lambda: fin.read(8 << 20), b""), fout, f["size"])
            else:
                raw = fin.read(f["size"] + 1)
                got, n = hashlib.sha256(raw).hexdigest(), len(raw)
    except OSError as e:
        raise ArtifactError(f"{src}: cannot be read ({e.strerror or e}); re-run `quantprep warm`") from None
    if n != f["size"] or got != f["sha256"]:
        raise ArtifactError(f"{src}: does not match its sha256 and size in manifest.json; the kernel cache is corrupted or altered")
    if repoint is not None:
        dest.write_bytes(_repointed(raw, repoint))


def _repointed(raw: bytes, here: Path) -> bytes:
    """Triton's `__grp__<kernel>.json` names the kernel's files by absolute path, and a group whose
    paths are gone is a cache miss: without this, every Triton kernel that warm compiled outside
    Inductor's own cache (the cuda prefill GEMM, eager and inside compiled MLPs) was compiled
    again at load (3 kernels, ~1 s on an H100). The group file's bytes, its paths pointed at `here`."""
    try:
        data = json.loads(raw)
        data["child_paths"] = {name: str(here / Path(p).name) for name, p in data["child_paths"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):  # another Triton's format: leave it
        return raw
    return json.dumps(data).encode()


def _points_into(group: Path, here: Path) -> bool:
    """A runtime copy's group file names only files of its own directory (as _repointed wrote it)."""
    try:
        paths = json.loads(group.read_bytes()).get("child_paths", {})
        return all(Path(p).parent == here for p in paths.values())
    except (ValueError, AttributeError, TypeError, RecursionError):
        return True  # another Triton's format, copied as shipped


# --- activation -----------------------------------------------------------------------------------

def activate(kcache: Kcache, device_type: str, compile: bool) -> dict:
    """Point this process's kernel caches at the artifact's kcache when it is intact, trusted and
    built for this machine. Returns a status dict; never raises for a bad cache (it warns)."""
    path, entry = kcache.path, kcache.entry
    if entry is None:
        return {"status": "absent"}
    target = device_target(device_type)
    plan_only = not compile and not target.jit_kernels  # without compile only a plan is read
    if plan_only and PLAN not in entry.get("files", {}):
        return {"status": f"unused (no compile: the {target.name} target's eager kernels are not compiled at run time)"}
    if kcache.problem:
        return _ignored(f"{kcache.problem}; ignoring it (re-run `quantprep warm {path}`)")
    if entry["key"].get("device") != device_type:
        return _ignored(f"{path}: kernel cache was warmed on {entry['key'].get('device')}, loading on {device_type}; ignoring it")
    reason = kcache.trusted
    if reason is None:
        warnings.warn(untrusted_message(path), stacklevel=3)
        return {"status": "untrusted"}
    rewarm = f"ignoring it (re-run `quantprep warm {path}` on this machine)"
    late = bool(target.driver_cache)  # the key's device fields start the device: after its driver's variables
    if mismatch := kcache.mismatch(cache_key(device_type, device_fields=not late), partial=late):
        return _ignored(f"{path}: {mismatch}; {rewarm}")
    if plan_only:  # read from the artifact (runtime/plan.py checks its sha256): nothing to copy or point a runtime at
        return {"status": "used", "trusted": reason, "plan_dir": str(path / KCACHE)}
    try:
        root = kcache.runtime_copy()
    except (ArtifactError, OSError) as e:
        return _ignored(f"kernel cache not usable: {e}")
    env = cache_env(root)
    if late:
        # The driver reads its cache location when the device starts, and the device fields of the
        # key need a started device: so the device-free key first, then the variables, then the
        # rest. The driver checks its own entries against the device it finds.
        if target.started():
            warnings.warn(f"{path}: the {device_type} device was initialised before quantprep.load, so the driver caches in "
                          f"kcache/ are not used; start serving with `quantprep exec {path} -- CMD` instead", stacklevel=3)
        else:
            os.environ.update({k: v for k, v in env.items() if k.startswith(target.driver_cache)})
        if mismatch := kcache.mismatch(cache_key(device_type)):
            return _ignored(f"{path}: {mismatch}; {rewarm}")
    # Not set here: load holds these for its own duration only (scoped_env), so a second model or a
    # child process never writes into this artifact's copy.
    scoped = triton_native_env(entry, dict(os.environ))
    scoped["TRITON_CACHE_DIR"] = env["TRITON_CACHE_DIR"]  # also eager: the cuda prefill GEMM is a Triton kernel
    if compile:
        scoped["TORCHINDUCTOR_CACHE_DIR"] = env["TORCHINDUCTOR_CACHE_DIR"]
    return {"status": "used", "dir": str(root), "trusted": reason, "env": scoped, "plan_dir": str(root)}


@contextmanager
def scoped_env(env: dict[str, str]) -> Iterator[None]:
    """`env` in os.environ for the block only; what was there before is put back. Inductor memoizes
    paths under its cache directory: they are cleared on the way in and out, as torch's own
    temporary_cache_dir does."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _clear_inductor_paths(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _clear_inductor_paths(env)


def _clear_inductor_paths(env: dict[str, str]) -> None:
    if "TORCHINDUCTOR_CACHE_DIR" in env and "torch._inductor.utils" in sys.modules:
        sys.modules["torch._inductor.utils"].clear_caches()


def _ignored(msg: str) -> dict:
    warnings.warn(msg, stacklevel=3)
    return {"status": "ignored", "reason": msg}


def exec_env(path: str | os.PathLike, trust: bool = False) -> dict[str, str]:
    """Environment for `quantprep exec`: this process's, plus the artifact's caches when usable."""
    path = Path(path).absolute()
    manifest = read_manifest(path)
    kcache = Kcache(path, manifest, trust)
    if kcache.entry is None:
        raise ArtifactError(f"{path}: has no kcache/; run `quantprep warm {path}` first")
    if kcache.problem:
        raise ArtifactError(f"{kcache.problem}; re-run `quantprep warm {path}`")
    if kcache.trusted is None:
        raise ArtifactError(untrusted_message(path))
    device = kcache.entry["key"].get("device")
    mismatch = kcache.mismatch(cache_key(device))  # exec replaces this process: device state here is dropped
    if mismatch:
        raise ArtifactError(f"{path}: {mismatch}; re-run `quantprep warm {path}` on this machine")
    env = dict(os.environ, **cache_env(kcache.runtime_copy()))  # ArtifactError: a file does not match
    target = device_target(device)
    env.update(target.run_env(manifest, env) | triton_native_env(kcache.entry, env))
    if msg := target.cache_warning(env):
        print(f"quantprep: warning: {msg}", file=sys.stderr)
    return env


def triton_native_env(entry: dict, env: dict[str, str]) -> dict[str, str]:
    """TRITON_XPU_GEN_NATIVE_CODE=1 at load when warm compiled with it (Triton's cache key holds the
    option, so without it every shipped kernel misses) and ocloc is here for any kernel that still does."""
    if entry.get("triton_native_code") is True and shutil.which("ocloc", path=env.get("PATH")):
        return {"TRITON_XPU_GEN_NATIVE_CODE": "1"}
    return {}

