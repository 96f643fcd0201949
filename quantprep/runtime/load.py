"""`quantprep.load`: an artifact directory or a published reference -> a model ready to `generate`.

load opens and checks the artifact once (runtime/checked.py), then hands it to what runs it: OpenVINO
for a graph artifact (runtime/openvino.py), else a transformers model of the target's torch modules
(runtime/torch_model.py). This module never imports gptqmodel, nor torch itself: an openvino
artifact's load imports torch and transformers only for its IR's one-time check, and while a
published reference is pulled (for a torch artifact's sake, the pull overlaps their import).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from quantprep._io.background import in_thread
from quantprep.distribution.signing import configured_key
from quantprep.format.verified import check_verify_mode
from quantprep.runtime.checked import checked_artifact
from quantprep.runtime.kcache import Kcache

if TYPE_CHECKING:
    import torch


def is_reference(path: str | os.PathLike) -> bool:
    """A URL, or a directory that `quantprep publish` wrote (an index, no manifest)."""
    text = str(path)
    return "://" in text or (Path(text, "index.json").is_file() and not Path(text, "manifest.json").exists())


def load(path: str | os.PathLike, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
         verify: str = "once", compile: bool = False, warmup: bool = False, kcache: bool = True,
         trust_kcache: bool = False, verify_key: str | os.PathLike | None = None):
    """Load an artifact as a transformers `PreTrainedModel` in eval mode.

    path: an artifact directory, or a published reference (a directory `quantprep publish` wrote, or
    a file:// URL): the variant that fits this machine is pulled into the local cache first, every
    file checked against its sha256 (publish.py); a second load reads the cache.

    device: defaults to the target's device; `device="cpu"` for an xpu artifact runs it through
    the CPU emulator of the XPU kernel (slow; for checking, not serving). dtype: activation dtype
    (defaults to the one the artifact was packed for). verify: "once" (default): every file's sha256 is
    checked the first time these files load here (verified.py; later loads of the unchanged files
    check sizes); "always": every time; "sizes": sizes only, an explicit opt-out. compile: run the decoder layers' MLPs compiled: from the kcache's
    compiled MLP packages where they fit (aot.py; no dynamo), else torch.compile
    (aot.compile_regions), restoring the artifact's compile cache first (see warm.py). warmup: run the warmed serving
    shapes once in this process (per-process state such as oneDNN primitives on XPU; run it in the
    thread that will serve, since PyTorch's oneDNN primitive cache is per thread).
    kcache: use the artifact's kernel cache when it is trusted and matches this machine (kcache.py:
    warmed here by this user, or `trust_kcache=True` / QUANTPREP_TRUST_KCACHE=1; an untrusted,
    foreign or corrupt one is ignored with a warning); using it sets TRITON_CACHE_DIR and
    TORCHINDUCTOR_CACHE_DIR (with compile) while this model compiles and runs, not for the
    process; on xpu NEO_/SYCL_CACHE_* stay set, since the driver reads them when the device starts
    (cpu without compile: nothing to use). `model.quantprep_kcache` says what happened.
    verify_key: a PEM public key (default: QUANTPREP_VERIFY_KEY): the artifact must carry a
    signature (`quantprep sign`) that verifies with it, and its kcache is then trusted.
    An openvino artifact comes back as runtime.openvino.OpenVINOModel (openvino.genai's pipeline and
    the IR's logits), device "CPU" (default) or "GPU"; dtype=torch.float32 runs the plugin exactly
    (f32, no dynamic quantization, f32 KV cache), None keeps the plugin's defaults; its kcache is
    OpenVINO's model cache.
    Raises ArtifactMismatch for an artifact built for another machine, ArtifactError if corrupt.
    """
    # 1. open and check once: pull a reference, the manifest and every file, the signature, the target
    check_verify_mode(verify)  # before a reference is pulled
    key = configured_key(verify_key)
    pulled = is_reference(path)
    if pulled:  # a published reference: pull the variant that fits (verified, its signature too) into the cache first,
        # while transformers' modeling code imports (seconds of Python, which the download and hashing overlap)
        from quantprep.distribution.publish import pull_checked

        job = in_thread(pull_checked, str(path), verify_key=verify_key)  # the reference's signature policy applies
        import transformers.modeling_utils  # noqa: F401

        path, signed = job.result()
    else:
        signed = key is not None
    path = Path(path)
    manifest, target = checked_artifact(path, verify, None if pulled else key)
    kernel_cache = Kcache(path, manifest, trust_kcache, signed) if kcache else None  # its trust decided once, carried
    if target.kind == "graph":  # OpenVINO runs it (runtime/openvino.py): no torch, no transformers model
        from quantprep.runtime import openvino

        return openvino.load(path, (manifest, target), None if device is None else str(device), exact=str(dtype) == "torch.float32",
                             kcache=kernel_cache)
    # 2-5. its modules run in torch: skeleton, modules, tensors, finish (runtime/torch_model.py)
    from quantprep.runtime.torch_model import load_model

    return load_model(path, (manifest, target), kernel_cache, device, dtype, compile=compile, warmup=warmup)
