"""Where quantprep keeps this user's state: one home for the XDG directory rules and for the
check that such a directory is private (another user could plant a cache or a trust entry in
one they can write).

    trust store       $XDG_DATA_HOME/quantprep/trusted-kcache   (QUANTPREP_TRUST_DIR)     kcache.py
    kcache copies     $XDG_CACHE_HOME/quantprep/kcache          (QUANTPREP_KCACHE_DIR)    kcache.py
    verified marks    $XDG_CACHE_HOME/quantprep/verified        (QUANTPREP_VERIFIED_DIR)  verified.py
    pulled artifacts  $XDG_CACHE_HOME/quantprep/pulled          (QUANTPREP_PULL_CACHE)    publish.py
    trust policy      $XDG_CONFIG_HOME/quantprep/policy.toml    (QUANTPREP_POLICY)        policy.py
    C kernels         $XDG_CACHE_HOME/quantprep/native          (QUANTPREP_NATIVE_DIR)    targets/c_library.py
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from quantprep.errors import ArtifactError

KINDS = {"data": ("XDG_DATA_HOME", "~/.local/share"), "cache": ("XDG_CACHE_HOME", "~/.cache"),
         "config": ("XDG_CONFIG_HOME", "~/.config")}


def user_dir(env: str, kind: str, *parts: str) -> Path:
    """`$env` when set, else the XDG directory of `kind` (data, cache, config) / quantprep / parts."""
    if base := os.environ.get(env):
        return Path(base)
    xdg, default = KINDS[kind]
    return Path(os.environ.get(xdg) or os.path.expanduser(default), "quantprep", *parts)


def private_dir(path: Path) -> Path:
    """Create `path` 0700 if missing; refuse it unless it is a real directory owned by this user
    that nobody else can write to."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ArtifactError(f"{path}: not a private directory of this user (owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); "
                            "remove it or point the variable that names it elsewhere")
    return path
