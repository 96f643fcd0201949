"""Log the parts of every Triton cache key a process computes, to find why a kernel that warm
compiled is compiled again at load (a different key means a different kcache/triton entry).

Diagnostic for throwaway machines only: it is activated in every Python process by a .pth file
in site-packages, so Inductor's compile workers and quantprep's warm children are logged too:
    python3 benchmarks/triton_keylog.py install     # writes the .pth; then
    TRITON_KEYLOG=/tmp/keys.jsonl python3 ...       # one JSON line per key: see `record`
    python3 benchmarks/triton_keylog.py diff WARM.jsonl LOAD.jsonl   # keys of LOAD not in WARM, and how they differ
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import json
import os
import sys
import sysconfig
from pathlib import Path

MODULE = "triton.compiler.compiler"  # imports get_cache_key by name: patch it there
KEY_PARTS = ("fn_key", "attrs", "signature", "constants", "backend", "options", "env", "key_prefix")


def record(src, backend, options, env_vars, key: str) -> dict:
    fn = getattr(src, "fn", None)
    return {"pid": os.getpid(), "argv": sys.argv[:3], "name": getattr(fn, "__name__", None),
            "fn_key": getattr(fn, "cache_key", None), "attrs": str(getattr(src, "attrs", None)),
            "signature": str(getattr(src, "signature", None)), "constants": str(getattr(src, "constants", None)),
            "src_hash": src.hash(), "backend": backend.hash(), "options": str(options),
            "env": sorted(env_vars.items()), "key_prefix": key.split("-")[0][:40],
            "dir_hash": hashlib.sha256(key.encode()).hexdigest()}


def _patch(module) -> None:
    original = module.get_cache_key

    def get_cache_key(src, backend, options, env_vars):
        key = original(src, backend, options, env_vars)
        try:
            line = json.dumps(record(src, backend, options, env_vars, key))
        except Exception as e:  # never break a compile for a log line
            line = json.dumps({"pid": os.getpid(), "error": repr(e)})
        with open(os.environ["TRITON_KEYLOG"], "a") as f:
            f.write(line + "\n")
        return key

    module.get_cache_key = get_cache_key


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def activate() -> None:
    if os.environ.get("TRITON_KEYLOG") and MODULE not in sys.modules:
        sys.meta_path.insert(0, _Finder())


def install() -> Path:
    pth = Path(sysconfig.get_paths()["purelib"]) / "zz_triton_keylog.pth"
    here = Path(__file__).resolve().parent
    pth.write_text(f"import sys; sys.path.append({str(here)!r}); import triton_keylog; triton_keylog.activate()\n")
    return pth


def diff(warm: Path, load: Path) -> None:
    def read(p):
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    before, after = read(warm), read(load)
    known = {r["dir_hash"] for r in before}
    for r in after:
        if r.get("dir_hash") in known:
            continue
        twins = [w for w in before if w.get("name") == r.get("name")]
        print(f"{r.get('name')}: key not seen in warm ({len(twins)} warm keys of that name)")
        for w in twins:
            print("   differs in", [k for k in KEY_PARTS if w.get(k) != r.get(k)])
        if twins:
            w = twins[0]
            for k in KEY_PARTS:
                if w.get(k) != r.get(k):
                    print(f"   {k}:\n     warm {w.get(k)}\n     load {r.get(k)}")


if __name__ == "__main__":
    if sys.argv[1] == "install":
        print(install())
    elif sys.argv[1] == "diff":
        diff(Path(sys.argv[2]), Path(sys.argv[3]))
