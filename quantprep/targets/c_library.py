"""quantprep's own C kernels: quantprep/csrc, one .c file per kernel family and the header they share
(quantprep.h, the ABI; targets/c_abi.py mirrors it for ctypes). `library(name)` compiles csrc/<name>.c
with this machine's C compiler (`cc -O3 -march=native`) on first use, keeps the library in this user's
private cache under a name made of the sha256 of the file and the header, the compiler's version, the
flags and this CPU's flags, and loads it with its functions' signatures set. They are quantprep's
sources, never an artifact's.

Without a compiler, with QUANTPREP_NATIVE=0, or where the cache is not this user's alone, `library`
returns None (unavailable_reason says which) and callers take their tensor-op paths. A file that does
not compile, or a library that does not load, is a bug in quantprep, never a reason to run slower
unnoticed: CompileError, carrying the compiler's stderr.

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
from quantprep.errors import ArtifactError, CompileError
from quantprep.targets.c_abi import declare

CSRC = Path(__file__).resolve().parent.parent / "csrc"
HEADER = CSRC / "quantprep.h"
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]
TIMEOUT = 300  # seconds: the largest file takes a few on a slow core


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
def library(name: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """csrc/<name>.c compiled with FLAGS + flags as a shared library (cached, see above) and loaded
    with its signatures (c_abi.SIGNATURES), or None: no compiler, the variable set, or a cache
    directory that is not this user's alone. Raises CompileError when the file does not compile or
    the library does not load."""
    cc = _compiler()
    if cc is None or turned_off():
        return None
    source = CSRC / f"{name}.c"
    text = HEADER.read_text() + "\0" + source.read_text()
    digest = hashlib.sha256("\0".join([text, cc[1], *FLAGS, *flags, cpuinfo("flags") or ""]).encode()).hexdigest()[:32]
    try:
        root = private_dir(cache_dir())
        lib = root / f"{digest}.so"
        if not lib.exists() and not build(cc[0], source, flags, root, lib):
            return library(name, tuple(f for f in flags if f != "-fopenmp"))  # this compiler has no OpenMP
        st = os.lstat(lib)
    except (ArtifactError, OSError):
        return None  # unavailable_reason names the directory
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return None  # not a file this user made and alone can change
    try:
        return declare(ctypes.CDLL(str(lib)), name)  # ctypes lets go of the GIL during each call
    except OSError as e:  # an undefined symbol (ctypes binds them all at load), a damaged file
        raise CompileError(f"{source}: its library {lib} does not load ({e}); remove {lib}, and report it if it persists") from e


def build(cc: str, source: Path, flags: tuple[str, ...], root: Path, lib: Path) -> bool:
    """Compiles source into lib (atomically: a racing process loads a whole library or compiles its
    own). False where -fopenmp is in flags and this compiler cannot build OpenMP (Apple's clang, clang
    without libomp): then the caller builds without it. Raises CompileError for any other failure."""
    with tempfile.TemporaryDirectory(prefix="build-", dir=root) as tmp:
        out = Path(tmp, "kernel.so")
        command = [cc, *FLAGS, *flags, str(source), "-o", str(out)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=TIMEOUT)
        except subprocess.TimeoutExpired as e:
            raise CompileError(f"{source}: `{cc}` did not finish compiling it in {TIMEOUT} s; set {settings.NATIVE}=0 to run "
                               f"torch's ops instead") from e
        if done.returncode:
            if "-fopenmp" in flags and not openmp(cc):
                return False
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            first = next((line for line in lines if "error:" in line), lines[-1] if lines else f"exit status {done.returncode}")
            raise CompileError(f"{source}: does not compile with `{' '.join(command[:-3])}` ({first.strip()}); report it with "
                               f"the compiler's output (a bug in quantprep or in this compiler's setup), or set {settings.NATIVE}=0 "
                               f"to run torch's ops instead", done.stderr)
        with open(out, "rb") as f:
            os.fsync(f.fileno())  # whole on disk before it has its name: a crash leaves no empty library
        os.replace(out, lib)
    return True


@functools.cache
def openmp(cc: str) -> bool:
    """Whether `cc -fopenmp` builds a library that calls OpenMP (asked only after a build with it failed)."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "omp.c").write_text("#include <omp.h>\nint threads(void) { return omp_get_max_threads(); }\n")
        try:
            return subprocess.run([cc, "-fopenmp", "-shared", "-fPIC", "omp.c", "-o", "omp.so"], cwd=tmp, capture_output=True,
                                  timeout=TIMEOUT).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


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
    return f"a library in {root} that is not a file of this user's alone; remove {root} to compile again"


def library_with_torch_openmp(name: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """csrc/<name>.c compiled with -fopenmp where torch's OpenMP runtime is libgomp (torch_openmp: the
    library's threads are then torch's), else without OpenMP; None and CompileError as `library`."""
    return library(name, ("-fopenmp", *flags) if torch_openmp() else flags)
