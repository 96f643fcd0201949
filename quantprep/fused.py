"""Fused projections at load: one prepacked matmul serves several Linears of the same input.

The model code (transformers) still calls q_proj, k_proj and v_proj (or gate_proj and up_proj)
one by one. A forward pre-hook on their parent runs the fused module once on the parent's input
and each member returns its slice. A member called with any other tensor (some model that
transforms the input first) computes the fused matmul itself and slices it: slower, never wrong.
"""

from __future__ import annotations

import torch
from torch import nn


class FusedGroup:
    """Holds the fused module (not as a registered submodule of the members: its tensors are
    registered once, on the parent) and the outputs of the latest parent call."""

    def __init__(self, fused: nn.Module, sizes: list[int]):
        self.fused, self.sizes = fused, sizes
        self.input: torch.Tensor | None = None
        self.outputs: list[torch.Tensor | None] = []

    def pre_hook(self, parent: nn.Module, args: tuple, kwargs: dict) -> None:
        x = kwargs.get("hidden_states", args[0] if args else kwargs.get("x"))
        if isinstance(x, torch.Tensor):
            self.input = x
            # Contiguous, like any Linear's output: attention kernels pick slower paths for
            # strided q/k/v (measured on an H200), and some model code calls .view() on them.
            self.outputs = [o.contiguous() for o in self.fused(x).split(self.sizes, -1)]

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is self.input and self.outputs[index] is not None:
            y, self.outputs[index] = self.outputs[index], None
            if all(o is None for o in self.outputs):
                self.input = None  # every member took its slice: hold no activations between calls
            return y
        return self.fused(x).split(self.sizes, -1)[index].contiguous()


class FusedMember(nn.Module):
    """Stands in for one of the fused Linears (no tensors of its own)."""

    def __init__(self, group: FusedGroup, index: int, in_features: int):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = in_features, group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.index, x)

    def extra_repr(self) -> str:
        return f"slice {self.index} of a fused projection, in={self.in_features}, out={self.out_features}"


def install(parent: nn.Module, fused_name: str, fused: nn.Module, members: list[str], sizes: list[int]) -> None:
    group = FusedGroup(fused, sizes)
    parent.add_module(fused_name, fused)
    for i, member in enumerate(members):
        setattr(parent, member, FusedMember(group, i, fused.in_features))
    parent.register_forward_pre_hook(group.pre_hook, with_kwargs=True)
