"""Mixture-of-experts names: how a GPTQ checkpoint, and so an artifact, spells each expert's linears.

gptqmodel quantizes one Linear per expert and projection and writes it under
`<experts module>.<expert index>.<projection>` (`model.layers.3.mlp.experts.17.down_proj`; Mixtral
too, as transformers 5 names its modules), while transformers 5 holds a layer's experts as one
module of 3-D tensors (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]). This is the one home of
that naming; runtime/experts.py has the module that stands in for transformers' at load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The projections of one expert: gate/up read the layer's input (and may be prepacked fused as
# gate_up_proj, build/prepack.py), down_proj reads their product.
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_LINEAR = re.compile(r"^(?P<experts>(?:.+\.)?experts)\.(?P<index>0|[1-9][0-9]*)\.(?P<projection>gate_up_proj|gate_proj|up_proj|down_proj)$")


@dataclass(frozen=True)
class ExpertLinear:
    experts: str  # the experts module's name: model.layers.3.mlp.experts
    index: int  # which expert
    projection: str  # gate_proj, up_proj, down_proj, or gate_up_proj (fused)

    @property
    def expert(self) -> str:
        """The expert's own name: model.layers.3.mlp.experts.17."""
        return f"{self.experts}.{self.index}"


def expert_linear(name: str) -> ExpertLinear | None:
    """The expert linear `name` is (a checkpoint layer or an artifact module), else None."""
    m = _EXPERT_LINEAR.match(name)
    return None if m is None else ExpertLinear(m["experts"], int(m["index"]), m["projection"])


# Mixtral checkpoints of the transformers 4 era (most on the Hub) name a layer's block
# `block_sparse_moe` and its experts' projections w1 (gate), w3 (up), w2 (down); transformers 5
# renames them as it loads (its conversion_mapping.py), and so does read_checkpoint.
LEGACY_NAMES = {"mixtral": [(re.compile(r"\.block_sparse_moe\."), ".mlp."), (re.compile(r"(\.experts\.[0-9]+\.)w1\."), r"\1gate_proj."),
                            (re.compile(r"(\.experts\.[0-9]+\.)w3\."), r"\1up_proj."), (re.compile(r"(\.experts\.[0-9]+\.)w2\."), r"\1down_proj.")]}


def current_name(key: str, model_type: str | None) -> str:
    """A checkpoint tensor's name as transformers 5's model of `model_type` names it."""
    for pattern, replacement in LEGACY_NAMES.get(model_type or "", []):
        key = pattern.sub(replacement, key)
    return key


def count_experts(names) -> dict[str, int]:
    """What `inspect`, `verify` and `eval` report: experts modules (MoE layers), experts, and the
    quantized linears that belong to experts, among module names."""
    linears = [e for e in map(expert_linear, names) if e is not None]
    return {"moe_layers": len({e.experts for e in linears}), "experts": len({e.expert for e in linears}), "linears": len(linears)}
