"""quantprep's own C kernels, compiled on this machine by its C compiler (`cc -O3 -march=native`)
once, and kept in this user's private cache under a name made of the sha256 of the source, the
compiler's version and this CPU's flags. They are quantprep's sources, never an artifact's. Without
a compiler, or with QUANTPREP_NATIVE=0, `library` returns None and callers take their tensor-op paths.

    $XDG_CACHE_HOME/quantprep/native/<digest>.so   (QUANTPREP_NATIVE_DIR)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from quantprep import settings
from quantprep._io.userdirs import private_dir, user_dir
from quantprep.errors import ArtifactError

FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]


@functools.cache
def _compiler() -> tuple[str, str] | None:
    """(path, version line) of `cc`, or None."""
    cc = shutil.which("cc")
    if cc is None:
        return None
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (cc, out.stdout.partition("\n")[0]) if out.returncode == 0 else None


def cpuinfo(field: str) -> str | None:
    """One field of this CPU's /proc/cpuinfo (Linux), e.g. "model name" or "flags"; None elsewhere."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            text = f.read(1 << 20).decode(errors="replace")
    except OSError:
        return None
    return next((line.partition(":")[2].strip() for line in text.splitlines() if line.partition(":")[0].strip() == field), None)


def torch_openmp() -> str | None:
    """The OpenMP runtime torch's threads come from, as a library name to link against, when it is
    GNU's libgomp.so.1 and already in this process (torch resolves omp_* to it): a library linked
    against that soname binds to the same runtime and the same threads. None otherwise (another
    runtime, or one this cannot tell)."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return None
    first = getattr(ctypes.CDLL(None), "omp_get_max_threads", None)  # the one torch's calls resolve to
    if first is None or ctypes.cast(first, ctypes.c_void_p).value != ctypes.cast(gomp.omp_get_max_threads, ctypes.c_void_p).value:
        return None
    return "libgomp.so.1"


def cache_dir() -> Path:
    """Where this user's compiled libraries are kept (the module docstring)."""
    return user_dir(settings.NATIVE_DIR, "cache", "native")


def turned_off() -> bool:
    """QUANTPREP_NATIVE=0: the user's choice of tensor ops, so nothing is compiled, loaded or warned about."""
    return os.environ.get(settings.NATIVE) == "0"


@functools.cache
def library(source: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """`source` compiled with FLAGS + flags as a shared library (cached, see above), or None: no
    compiler, the variable set, a cache directory that is not this user's alone, a compile that
    failed or hung, or a library that did not load."""
    cc = _compiler()
    if cc is None or turned_off():
        return None
    digest = hashlib.sha256("\0".join([source, cc[1], *FLAGS, *flags, cpuinfo("flags") or ""]).encode()).hexdigest()[:32]
    try:
        root = private_dir(cache_dir())
        lib = root / f"{digest}.so"
        if not lib.exists():
            with tempfile.TemporaryDirectory(prefix="build-", dir=root) as tmp:
                src, out = Path(tmp, "kernel.c"), Path(tmp, "kernel.so")
                src.write_text(source)
                if subprocess.run([cc[0], *FLAGS, *flags, str(src), "-o", str(out)], capture_output=True, timeout=300).returncode:
                    return None
                with open(out, "rb") as f:
                    os.fsync(f.fileno())  # whole on disk before it has its name: a crash leaves no empty library
                os.replace(out, lib)  # atomic: a racing process loads a whole library or compiles its own
        st = os.lstat(lib)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return None  # not a file this user made and alone can change
        return ctypes.CDLL(str(lib))  # ctypes lets go of the GIL during each call
    except (ArtifactError, OSError, subprocess.SubprocessError):
        return None


def unavailable_reason() -> str:
    """Why `library` returns None here, and what to do, as far as one can tell without compiling
    (for load's warning)."""
    if turned_off():
        return f"{settings.NATIVE}=0"
    if _compiler() is None:
        return "no C compiler: put `cc` on PATH"
    try:
        root = private_dir(cache_dir())
    except ArtifactError as e:  # names the directory and what to do
        return str(e)
    except OSError as e:
        return f"{cache_dir()}: cannot be created ({e.strerror or e}); point {settings.NATIVE_DIR} at a directory of this user's"
    return f"compiling with `{_compiler()[0]}` or loading the library in {root} failed; remove {root} to compile again"


def library_with_torch_openmp(source: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """`source` compiled with -fopenmp where torch's OpenMP runtime is libgomp (torch_openmp: the
    library's threads are then torch's), else without OpenMP; None as `library`."""
    return (library(source, ("-fopenmp", *flags)) if torch_openmp() else None) or library(source, flags)
