"""The checks every artifact gets before any of it is read, whatever runs it (runtime/torch_model.py with
torch, runtime/openvino.py and runtime/engine.py without): the manifest and every file's sha256
(verified.py: `verify` "once" per file as it is, "always", or "sizes" only), no code
named by its configs, the signature when a verify key is configured, a target this quantprep has
and this machine's compatibility key. Torch-free."""

from __future__ import annotations

from pathlib import Path

from quantprep.distribution.signing import verify as verify_signature
from quantprep.errors import ArtifactError, ArtifactMismatch, RecipeError
from quantprep.format.artifact import read_checked, refuse_code
from quantprep.format.verified import check_hashed, check_verify_mode, hash_and_mark
from quantprep.targets import Target, get_target


def checked_manifest(path: Path, verify: str, key: str | None) -> dict:
    """The artifact's manifest, after those checks (`verify`: one of verified.VERIFY; `key`: a verify key, or None)."""
    check_verify_mode(verify)
    manifest = read_checked(path)
    if verify == "once":
        check_hashed(path, manifest)
    elif verify == "always":
        hash_and_mark(path, manifest)
    refuse_code(path, ArtifactError)
    if key is not None:
        verify_signature(path, key)  # unsigned or wrongly signed: refused before anything is read
    return manifest


def checked_artifact(path: Path, verify: str, key) -> tuple[dict, Target]:
    """checked.checked_manifest's checks, and a target this quantprep has."""
    manifest = checked_manifest(path, verify, key)
    try:
        target = get_target(manifest["target"]["name"])
    except RecipeError:  # a name this quantprep has no target for
        raise ArtifactMismatch(f"{path}: target {manifest['target'].get('name')!r} is not supported by this quantprep") from None
    return manifest, target


def rebuild_command(manifest: dict, target: str | None = None) -> str:
    src = manifest["source"]
    source = src.get("id") or f"<the GPTQ checkpoint with sha256 {str(src.get('sha256', '?'))[:16]}...>"
    return f"quantprep prepack {source} --target {target or manifest['target']['name']} --out <dir>"


def check_compat(path: Path, manifest: dict, target, emulate: bool = False) -> None:
    """Refuse an artifact whose layout this machine's kernels would read differently, or whose
    device is missing (unless `emulate` and the target has a CPU emulator)."""
    here = target.compat_key()
    for key, built in manifest["compat"].items():
        if here.get(key) != built:
            raise ArtifactMismatch(f"{path}: built for {key}={built}, this machine has {key}={here.get(key)}; "
                                   f"build a matching artifact here: {rebuild_command(manifest)}")
    problem = target.runtime_problem()
    if problem and not (emulate and target.cpu_emulator):
        raise ArtifactMismatch(f"{path}: {problem}; build one for this machine: {rebuild_command(manifest)}")
