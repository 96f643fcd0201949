"""Kernel targets: one module per target, each exposing `TARGET`. Adding a target = one file here
and its name in TARGET_NAMES (docs/adding-a-target.md).

A target turns an `PrepackLayer` into its kernel's tensors (`pack`), rebuilds the matching
`nn.Module` at load (`make_module`), and says what the packed layout depends on (`compat_key`),
so an artifact is refused on a machine whose kernels would read it differently; `act_dtypes`
lists the activation dtypes its kernels run. It also answers what the rest of quantprep asks of
its device (synchronize, the kernel cache's key, a description, ...: `base.Target`), so nothing
outside this package branches on a target's or a device's name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from quantprep.errors import RecipeError

if TYPE_CHECKING:  # not imported here: targets.c_library and c_abi are torch-free (runtime/engine.py)
    from quantprep.targets.base import Target

TARGET_NAMES = ("cpu", "xpu", "cuda", "openvino")
# The int4 kernels' group sizes, largest first (packed.regroup): one home, torch-free for runtime/engine.py.
KERNEL_GROUP_SIZES = (256, 128, 64, 32)


def get_target(name: str) -> Target:
    if name not in TARGET_NAMES:
        raise RecipeError(f"unknown target {name!r}; choose from {', '.join(TARGET_NAMES)}")
    return importlib.import_module(f"{__name__}.{name}").TARGET


def device_target(device_type: str) -> Target:
    """The target that speaks for torch device `device_type` (its synchronize, kernel cache key,
    description): the first of TARGET_NAMES whose kernels run there. An emulated artifact runs on
    the CPU, so the cpu target's facts are the ones that apply to it."""
    for name in TARGET_NAMES:
        if (target := get_target(name)).device == device_type:
            return target
    raise RecipeError(f"no target runs on device {device_type!r}")


def devices_here() -> list[str]:
    """The torch devices of this machine that targets run on, the preferred first (an accelerator
    before the CPU): gptqmodel's and selftest's default device."""
    targets = [t for t in map(get_target, TARGET_NAMES) if t.preference is not None and t.present()]
    return list(dict.fromkeys(t.device for t in sorted(targets, key=lambda t: t.preference)))


def act_dtype_problem(target, dtype) -> str | None:
    """Why `target`'s kernels cannot run activations of `dtype`, else None."""
    if dtype in target.act_dtypes:
        return None
    names = " or ".join(str(d).removeprefix("torch.") for d in target.act_dtypes)
    return f"the {target.name} target runs {names} activations only, not {str(dtype).removeprefix('torch.')}" + target.act_dtype_note


def __getattr__(name: str):
    if name == "Target":
        from quantprep.targets.base import Target

        return Target
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
