"""Every file of an artifact is hashed before its first load here, once.

An artifact that was pulled, copied, mounted or served from elsewhere may hold a shard changed
to other bytes of the same size, which the size check at load cannot see. So `load` (and
from_pretrained and serve) hash every file against the manifest unless this user's cache holds
a mark saying these very files were hashed: the mark is named by the files' identity and change
stamps (device, inode, size, mtime_ns, ctime_ns) and the manifest's digest. Any write to a file
changes its ctime, which no one can set back, so an unchanged stamp means unchanged bytes.
quantprep marks what it wrote or hashed itself (a build, a pull, verify, a first load). The
first-load cost is measured in BENCHMARKS.md (benchmarks/hash_cost.py).

`load(..., verify=...)` names how much is hashed (VERIFY): "once" (the default), "always" (every
file at every load), or "sizes" (the explicit opt-out: sizes only).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from quantprep import settings
from quantprep._io.userdirs import private_dir, user_dir
from quantprep.errors import ArtifactError
from quantprep.format.artifact import MANIFEST, SIGNED, check_files

VERIFY = ("once", "always", "sizes")  # load's verify modes, described above


def check_verify_mode(verify) -> None:
    if verify not in VERIFY:
        raise ValueError(f"verify={verify!r}: choose one of {', '.join(map(repr, VERIFY))}")


def marks_dir() -> Path:
    return user_dir(settings.VERIFIED_DIR, "cache", "verified")


def stamp(path: Path, manifest: dict) -> str:
    """What names these files as they are now: each listed file's identity and change stamps."""
    rows = [manifest["manifest_sha256"]]
    for name in sorted([MANIFEST, *manifest["files"]] + [s for s in SIGNED if (path / s).is_file()]):
        st = os.stat(path / name)
        rows.append([name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def is_marked(path: Path, manifest: dict) -> bool:
    try:
        return (private_dir(marks_dir()) / stamp(path, manifest)).is_file()
    except (OSError, ArtifactError):  # no usable cache (a read-only home): hash every time
        return False


def mark(path: Path, manifest: dict) -> None:
    """Record that these files, as they are now, were hashed (or written) by quantprep."""
    try:
        (private_dir(marks_dir()) / stamp(path, manifest)).touch()
    except (OSError, ArtifactError):
        pass


def hash_and_mark(path: Path, manifest: dict) -> None:
    """Every file's sha256 against the manifest (ArtifactError naming the first that does not), then
    the mark, only if no file changed while they were hashed (the stamps before and after agree)."""
    before = stamp(path, manifest)
    check_files(path, manifest, full_hash=True)
    if stamp(path, manifest) == before:
        mark(path, manifest)


def check_hashed(path: Path, manifest: dict) -> None:
    """hash_and_mark, unless these very files are marked already."""
    if not is_marked(path, manifest):
        hash_and_mark(path, manifest)
