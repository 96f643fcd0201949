"""Kernel targets: one module per target, each exposing `TARGET`. Adding a target = one file here.

A target turns an `PrepackLayer` into its kernel's tensors (`pack`), rebuilds the matching
`nn.Module` at load (`make_module`), and says what the packed layout depends on (`compat_key`),
so an artifact is refused on a machine whose kernels would read it differently; `act_dtypes`
lists the activation dtypes its kernels run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from quantprep.errors import RecipeError

if TYPE_CHECKING:  # not imported here: targets.native and cpu_c are torch-free (runtime/native_model.py)
    from quantprep.targets.common import Target

TARGET_NAMES = ("cpu", "xpu", "cuda", "openvino")


def get_target(name: str) -> Target:
    if name not in TARGET_NAMES:
        raise RecipeError(f"unknown target {name!r}; choose from {', '.join(TARGET_NAMES)}")
    return importlib.import_module(f"{__name__}.{name}").TARGET


def act_dtype_problem(target, dtype) -> str | None:
    """Why `target`'s kernels cannot run activations of `dtype`, else None."""
    if dtype in target.act_dtypes:
        return None
    names = " or ".join(str(d).removeprefix("torch.") for d in target.act_dtypes)
    why = {"xpu": " (oneDNN has no float32 int4 matmul; docs/xpu.md)", "cuda": " (tinygemm, its decode kernel, is bf16-only)"}
    return f"the {target.name} target runs {names} activations only, not {str(dtype).removeprefix('torch.')}" + why.get(target.name, "")


def __getattr__(name: str):
    if name == "Target":
        from quantprep.targets.common import Target

        return Target
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
