"""Replacing a directory: the one rule for every command that writes one (build, prepack, warm,
eval --store, pull, publish to a directory, the build cache's quantized checkpoints).

A destination is replaced only when it is missing, empty, or provably quantprep's own of the
right kind (the caller's `owned` test: an artifact whose manifest parses, a published reference
whose index parses and holds nothing but its variants); anything else is refused in one line
unless the user passes --force. Never, even with --force, the source being read.

The new content is written into a staging sibling `.<out>.partial-<pid>` and swapped in whole
(renameat2 RENAME_EXCHANGE where the kernel has it, else two renames through `.<out>.old`), after
every file and directory in it is fsynced, so a reader sees the old directory or the new one and
a crash leaves no half-written one at the path. Those siblings are quantprep's only while they
hold MARKER (JSON naming the pid and `out`): a later writer removes a dead writer's marked
leftovers, and never touches a directory that merely has such a name.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from quantprep.errors import QuantprepError

MARKER = ".quantprep-staging"


# Called at each stage boundary: quantize, prepack, write, publish, warm. Nothing happens unless a
# test sets it: the kill tests' child process (tests/conftest.py, cli_paused_at) sleeps there so
# that its SIGKILL lands at that stage deterministically.
stage_hook: Callable[[str], None] | None = None


def stage_reached(stage: str) -> None:
    if stage_hook is not None:
        stage_hook(stage)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file and directory under `root`, deepest first, then `root`: before the rename that
    publishes it, so a crash after the rename cannot leave the new name over unwritten data."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(dirpath, name))
        fsync_path(Path(dirpath))


def check_replaceable(out: Path, owned: Callable[[Path], bool], kind: str, force: bool = False, source: Path | None = None) -> None:
    """Refuse (one line) to replace `out` unless it is missing, empty or `owned(out)` (quantprep's
    own `kind`), or `force`; never when `out` is `source` or a folder above it."""
    out = Path(out).absolute()
    if source is not None:
        src = Path(source).resolve()
        if out.resolve() == src or out.resolve() in src.parents:
            raise QuantprepError(f"{out}: holds the source checkpoint {src}; writing there would delete it: choose another destination")
    ancestor = next(p for p in out.parents if p.exists())
    if not ancestor.is_dir():
        raise QuantprepError(f"{ancestor}: is a file, so {out} cannot be created; choose another destination")
    if out.is_symlink():  # even with --force: the swap would replace the link and write through it
        raise QuantprepError(f"{out}: is a symbolic link; pass the directory it points to, or another destination")
    if not os.path.lexists(out) or force:
        return
    if not out.is_dir():
        raise QuantprepError(f"{out}: exists and is not a directory; choose another destination")
    if not any(out.iterdir()) or owned(out):
        return
    raise QuantprepError(f"{out}: exists and is not a {kind}; writing there would delete its contents: "
                         "choose another destination, or pass --force to replace it")


def _mark(d: Path, out: Path) -> None:
    fd = os.open(d / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)  # never through a link
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"pid": os.getpid(), "out": out.name}) + "\n")


def _marked_for(d: Path, out: Path) -> int | None:
    """The pid in `d`'s marker when `d` is a real directory that quantprep staged for `out`, else None."""
    try:
        if d.is_symlink() or not d.is_dir() or (d / MARKER).is_symlink():
            return None
        with open(d / MARKER, "rb") as f:
            mark = json.loads(f.read(4096))
        pid = mark["pid"]
        return pid if mark["out"] == out.name and isinstance(pid, int) and pid > 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()


def clean_leftovers(out: Path) -> None:
    """Remove what killed writers of `out` left (marked siblings whose pid is gone); restore a
    marked `.<out>.old` when a kill fell between the two renames of a swap."""
    for p in out.parent.glob(f".{out.name}.partial-*"):
        pid = _marked_for(p, out)
        if pid is not None and not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)
    old = out.parent / f".{out.name}.old"
    if _marked_for(old, out) is not None:
        if not os.path.lexists(out):
            (old / MARKER).unlink()
            os.rename(old, out)
        else:
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def writer_lock(out: Path):
    """One writer per destination: a second waits here (flock on a sibling `.<name>.lock`, released
    by the OS if the holder dies)."""
    with open(out.parent / f".{out.name}.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"quantprep: waiting for another quantprep writing {out} to finish", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def swap_in(tmp: Path, out: Path) -> None:
    """Put the staged `tmp` at `out` in one step (the old `out`, if any, is removed after)."""
    fsync_tree(tmp)
    (tmp / MARKER).unlink(missing_ok=True)  # the published directory holds only what was staged
    fsync_path(tmp)
    if out.exists() and _exchange(tmp, out):
        _mark(tmp, out)  # tmp now holds the old directory: a kill from here on leaves a marked leftover
        fsync_path(out.parent)
        stage_reached("publish")
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if not out.exists():
        os.rename(tmp, out)
        fsync_path(out.parent)
        stage_reached("publish")
        return
    old = out.parent / f".{out.name}.old"
    if os.path.lexists(old):
        raise QuantprepError(f"{old}: in the way of replacing {out} (not left by quantprep); move it away")
    os.rename(out, old)
    _mark(old, out)
    os.rename(tmp, out)
    fsync_path(out.parent)
    stage_reached("publish")
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staging(out: Path, owned: Callable[[Path], bool], kind: str, force: bool = False, source: Path | None = None,
            mode: int = 0o777) -> Iterator[Path]:
    """A fresh staging directory for `out`, under its writer lock, after check_replaceable: what the
    block writes there replaces `out` whole when the block ends (swap_in); nothing changes at `out`
    when it raises."""
    out = Path(out).absolute()
    check_replaceable(out, owned, kind, force, source)  # a refusal creates nothing, not even the lock file
    out.parent.mkdir(parents=True, exist_ok=True)
    with writer_lock(out):
        check_replaceable(out, owned, kind, force, source)  # again: what another writer left is what counts
        clean_leftovers(out)
        tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
        if os.path.lexists(tmp):
            if _marked_for(tmp, out) is None:
                raise QuantprepError(f"{tmp}: in the way of staging {out} (not left by quantprep); move it away")
            shutil.rmtree(tmp)
        tmp.mkdir(mode=mode)
        try:
            _mark(tmp, out)
            yield tmp
            swap_in(tmp, out)
        except BaseException:
            if _marked_for(tmp, out) is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
