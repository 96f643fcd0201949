"""Quantized experts: a layer's mixture of experts as one prepacked module per expert projection.

transformers 5 runs a mixture-of-experts layer as its own router (softmax or sigmoid, top-k,
norm_topk_prob, group-limited choice, the routed scaling factor), then
`experts(hidden_states, top_k_index, top_k_weights)`: one module holding every expert as 3-D float
tensors. load replaces only that module, by a QuantizedExperts with the same call, so the router,
the shared experts and which layers are sparse at all (first_k_dense_replace, decoder_sparse_step,
mlp_only_layers) stay transformers' own code. Its children are the experts, `<index>`, each with the
target's modules for gate_up_proj (or gate_proj and up_proj) and down_proj: the tensor names are the
artifact's (format/expert_names.py), so load's module and tensor checks apply to them unchanged.

forward sorts the (token, expert) pairs by expert and runs each expert that was hit once, on all of
its tokens; an expert no token chose costs nothing. A single token (decode) runs its top-k experts
in turn, without the sort.
The outputs are weighted and summed over the top-k as transformers' default (grouped_mm) does:
the product in the routing weights' dtype, the sum over a token's k experts, then its dtype.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from quantprep.errors import ArtifactError
from quantprep.format.expert_names import PROJECTIONS, ExpertLinear, expert_linear
from quantprep.targets.packed import CountedModule

EXPERTS_CALL = ("hidden_states", "top_k_index", "top_k_weights")


def experts_layout(module: nn.Module) -> tuple[int, int, int]:
    """(experts, hidden size, intermediate size) of a transformers experts module, from its 3-D
    tensors; ValueError saying why QuantizedExperts cannot stand in for it."""
    kind = type(module).__name__
    gate_up, down = module._parameters.get("gate_up_proj"), module._parameters.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"{kind} is not an experts module of 3-D gate_up_proj and down_proj tensors")
    params = list(inspect.signature(type(module).forward).parameters)[1:]
    if tuple(params[:3]) != EXPERTS_CALL or getattr(module, "has_bias", False) or getattr(module, "has_post_expert_norm", False) \
            or not getattr(module, "has_gate", True) or getattr(type(module), "_apply_gate", None) is not _default_gate():
        raise ValueError(f"{kind} is not called as experts({', '.join(EXPERTS_CALL)}) or has biases, a post-expert norm or its own "
                         "gating, which quantized experts do not run")
    E = gate_up.shape[0]
    if getattr(module, "is_transposed", False):  # [E, H, 2I] and [E, I, H]
        H, I2 = gate_up.shape[1:]
        down_shape = (E, I2 // 2, H)
    else:  # [E, 2I, H] and [E, H, I]
        I2, H = gate_up.shape[1:]
        down_shape = (E, H, I2 // 2)
    if not getattr(module, "is_concatenated", True):
        raise ValueError(f"{kind} interleaves gate and up in gate_up_proj; quantized experts run them concatenated")
    if I2 % 2 or tuple(down.shape) != down_shape or getattr(module, "num_experts", E) != E:
        raise ValueError(f"{kind}'s gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} disagree")
    return E, H, I2 // 2


def stacked_expert(model: nn.Module, name: str) -> ExpertLinear | None:
    """The expert linear a layer or module `name` is, where the model holds its experts stacked in 3-D
    tensors; None for any other name, and for one that is the model's own Linear (transformers 4's
    experts were a list of modules: such a layer is replaced like any other)."""
    if (e := expert_linear(name)) is None:
        return None
    try:
        model.get_submodule(name)
    except AttributeError:
        return e
    return None


def expert_weight(module: nn.Module, index: int, projection: str) -> torch.Tensor:
    """The view of a transformers experts module's 3-D tensors that holds expert `index`'s `projection`
    (gate_proj, up_proj or down_proj) as a Linear's weight [out, in]: gate is the first half of
    gate_up_proj, as its forward chunks it. (A dense model from dequantized experts: tools/eval.py.)"""
    _, _, intermediate = experts_layout(module)
    transposed = getattr(module, "is_transposed", False)
    if projection == "down_proj":
        w = module.down_proj[index]
    else:
        half = slice(0, intermediate) if projection == "gate_proj" else slice(intermediate, 2 * intermediate)
        w = module.gate_up_proj[index][:, half] if transposed else module.gate_up_proj[index][half]
    return w.T if transposed else w


def _default_gate():
    from transformers.integrations.moe import _default_apply_gate

    return _default_apply_gate


class ExpertLinearSlot(nn.Module):
    """Where one expert projection's quantized module goes: its sizes, which load checks the
    manifest's against, and no tensors. A slot still there after load is a missing module."""

    bias = None

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this expert projection was never given its quantized module")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, empty"


class Expert(CountedModule):
    """One expert's projections (QuantizedExperts' child)."""


class QuantizedExperts(CountedModule):
    """Stands in for transformers' experts module: forward(hidden_states [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H]. Expert e is child `e`: gate_up_proj (fused, load installs the
    members gate_proj and up_proj beside it) or gate_proj and up_proj, then down_proj."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act_fn: nn.Module):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, intermediate
        self.act_fn = act_fn
        sizes = {"gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}
        for e in range(num_experts):
            expert = Expert()
            for projection in PROJECTIONS:
                expert.add_module(projection, ExpertLinearSlot(*sizes[projection]))
            self.add_module(str(e), expert)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on its rows x [n, H]: down(act(gate(x)) * up(x)), in the activation dtype."""
        parts = self._modules[str(e)]._modules  # nn.Module's __getattr__ costs more than the lookup, per expert hit
        gate_up = parts.get("gate_up_proj")
        if gate_up is not None:
            hidden = self.gated(gate_up(x))
        else:
            hidden = self.act_fn(parts["gate_proj"](x)) * parts["up_proj"](x)
        return parts["down_proj"](hidden)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of a fused projection's output [n, 2 * intermediate] (gate first); cpu_layers
        computes it in C."""
        return self.act_fn(gate_up[:, : self.intermediate_dim]) * gate_up[:, self.intermediate_dim:]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        k = top_k_index.shape[-1]
        if x.shape[0] == 1 and k:  # decode: the token's k experts in turn, with none of the grouping below
            y = torch.cat([self.expert(e, x) if 0 <= e < self.num_experts else x.new_zeros(1, shape[-1])
                           for e in top_k_index.reshape(-1).tolist()])
            return self.combine(y, top_k_weights.reshape(-1, 1), 1, k).to(hidden_states.dtype).reshape(shape)
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # the (token, k) pairs grouped by expert
        hit, counts = torch.unique_consecutive(chosen[order], return_counts=True)
        rows = x[order // k]
        outputs, start = [], 0
        for e, n in zip(hit.tolist(), counts.tolist(), strict=True):  # one sync; the experts hit, ascending
            part = rows[start:start + n]
            start += n
            # an index past the experts (transformers' expert-parallel sentinel) contributes nothing
            outputs.append(self.expert(e, part) if 0 <= e < self.num_experts else part.new_zeros(n, shape[-1]))
        if not outputs:
            return torch.zeros_like(hidden_states)
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        back = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, k) order
        return self.combine(back, top_k_weights.reshape(-1, 1), x.shape[0], k).to(hidden_states.dtype).reshape(shape)

    @staticmethod
    def combine(y: torch.Tensor, weights: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
        """The k outputs of each token [tokens * k, H] ((token, k) order) weighted and summed as
        transformers' default (grouped_mm) does: the product in the routing weights' dtype, then the sum over k."""
        return (y * weights).view(tokens, k, -1).sum(1)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}"


def install_experts(model: nn.Module, path: Path, modules: dict[str, dict]) -> None:
    """Replace each transformers experts module whose experts manifest.json's `modules` holds by a
    QuantizedExperts of empty slots, which torch_model.install_modules then fills like any other Linear."""
    by_experts: dict[str, list[str]] = {}
    for name in modules:
        if (e := stacked_expert(model, name)) is not None:
            by_experts.setdefault(e.experts, []).append(name)
    model_type = model.config.model_type
    for experts_name, names in by_experts.items():
        try:
            old = model.get_submodule(experts_name)
            E, H, intermediate = experts_layout(old)
        except (AttributeError, ValueError) as e:
            why = str(e) if isinstance(e, ValueError) else f"the {model_type} model has no module {experts_name}"
            raise ArtifactError(f"{path}: module {names[0]} in manifest.json: {why}; the artifact does not match its "
                                "config.json: rebuild it") from None
        for name in names:
            if (index := expert_linear(name).index) >= E:
                raise ArtifactError(f"{path}: module {name} in manifest.json is expert {index}, the {model_type} model's "
                                    f"{experts_name} has {E}; the artifact is inconsistent: rebuild it")
        parent, _, child = experts_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, QuantizedExperts(E, H, intermediate, old.act_fn))


def check_experts_installed(model: nn.Module, path: Path) -> None:
    """Every expert projection of a QuantizedExperts got its module from the manifest."""
    for name, module in model.named_modules():
        if isinstance(module, ExpertLinearSlot):
            experts = name.rsplit(".", 2)[0]
            raise ArtifactError(f"{path}: module {name} is missing from manifest.json (every expert of {experts} must be "
                                "quantized); the artifact is incomplete: rebuild it")


@contextlib.contextmanager
def routed_tokens(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Inside the block, {experts module name: tokens routed to each expert} for every QuantizedExperts
    of `model` (eval reports how many experts its text reached)."""
    counts: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, QuantizedExperts):
            counts[name] = torch.zeros(module.num_experts, dtype=torch.int64)

            def count(mod, args, kwargs, name=name):
                index = (args[1] if len(args) > 1 else kwargs["top_k_index"]).reshape(-1)
                counts[name] += torch.bincount(index[index < mod.num_experts].cpu(), minlength=mod.num_experts)

            handles.append(module.register_forward_pre_hook(count, with_kwargs=True))
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()
