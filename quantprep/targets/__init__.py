"""Kernel targets: one module per target, each exposing `TARGET`. Adding a target = one file here.

A target turns an `UnpackedLayer` into its kernel's tensors (`pack`), rebuilds the matching
`nn.Module` at load (`make_module`), and says what the packed layout depends on (`compat_key`),
so an artifact is refused on a machine whose kernels would read it differently.
"""

from __future__ import annotations

import importlib

from ..errors import RecipeError

TARGET_NAMES = ("cpu", "xpu", "cuda")


def get_target(name: str):
    if name not in TARGET_NAMES:
        raise RecipeError(f"unknown target {name!r}; choose from {', '.join(TARGET_NAMES)}")
    return importlib.import_module(f"{__name__}.{name}").TARGET
