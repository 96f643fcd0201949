"""Fused projections at load: one prepacked matmul serves several Linears of the same input.

The model code (transformers) still calls q_proj, k_proj and v_proj (or gate_proj and up_proj)
one by one, with the same tensor. The first member call runs the fused module and keeps the other
slices; a member called with that same tensor object takes its slice. Any other call (another
input, a slice already taken) runs the fused matmul again: slower, never wrong. No hooks and no
state across frames, so torch.compile traces an MLP with its fused gate/up as one graph.
"""

from __future__ import annotations

import torch
from torch import nn

from quantprep.targets.packed import CountedModule, PackedLinear


class FusedGroup:
    """Holds the fused module (not registered on the members: its tensors are registered once,
    on the parent) and the slices of the latest input not yet taken.

    Thread-safe without a lock: the state is one (input, slices) pair that a call reads once and
    replaces whole, so a thread only ever takes slices computed from its own input; two threads
    serving one model interleave at worst into extra fused matmuls."""

    def __init__(self, fused: PackedLinear, sizes: list[int]):
        self.fused, self.sizes = fused, sizes
        self.state: tuple[torch.Tensor, list[torch.Tensor | None]] | None = None

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        state = self.state
        if state is None or state[0] is not x or state[1][index] is None:
            # Contiguous, like any Linear's output: attention kernels take slower paths for strided
            # q/k/v (measured on an H200), and model code may .view() them.
            state = (x, self.fused.forward_split(x, self.sizes))
            self.state = state
        outputs = state[1]
        y, outputs[index] = outputs[index], None
        if all(o is None for o in outputs) and self.state is state:
            self.state = None  # every slice taken: hold no activations between calls
        return y


class FusedMember(CountedModule):
    """Stands in for one of the fused Linears (no tensors of its own)."""

    def __init__(self, group: FusedGroup, index: int, in_features: int):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = in_features, group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.index, x)

    def extra_repr(self) -> str:
        return f"slice {self.index} of a fused projection, in={self.in_features}, out={self.out_features}"


def install(parent: nn.Module, fused_name: str, fused: PackedLinear, members: list[str], sizes: list[int]) -> None:
    group = FusedGroup(fused, sizes)
    fused.parts = tuple(sizes)
    parent.add_module(fused_name, fused)
    for i, member in enumerate(members):
        setattr(parent, member, FusedMember(group, i, fused.in_features))


# Models whose own modeling code has one Linear where GPTQ checkpoints store its members apart
# (gptqmodel 7.7's defuser splits the model's gate_up_proj into gate_proj and up_proj to quantize
# them, and writes them so): model_type -> {the model's fused Linear: its members, in the order the
# model's forward splits its output}. Read from transformers 5's modeling files: Phi3MLP and
# Glm4MLP chunk gate_up_proj as [gate; up], Phi3Attention slices qkv_proj as [q; k; v] (gptqmodel
# quantizes Phi-3's qkv_proj whole; a checkpoint with q/k/v apart is fused the same way). The
# prepacked fused module replaces the model's Linear itself: no members, no split at run time.
IN_MODEL = {
    "phi3": {"gate_up_proj": ("gate_proj", "up_proj"), "qkv_proj": ("q_proj", "k_proj", "v_proj")},
    "glm4": {"gate_up_proj": ("gate_proj", "up_proj")},
}


def in_model(model_type: str | None, fused_child: str) -> tuple[str, ...] | None:
    """The members, in the model's order, when this model type holds `fused_child` as one Linear."""
    return IN_MODEL.get(model_type or "", {}).get(fused_child)
