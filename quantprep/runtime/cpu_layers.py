"""RMSNorm, the gated MLP, decode attention and the float lm_head on the CPU: quantprep's C in place of torch's ops.

At decode (one row) a token's time beside its matmuls is mostly dispatch: transformers' RMSNorm is
seven tensor ops, the MLP's act_fn(gate) * up two more, and the attention's views, rotary embedding
(ten ops) and member projections a dozen (benchmarks/experiments/results/cpu-layers-avx512.json).
Here each is one C call with the same arithmetic and the same roundings as transformers': RMSNorm
sums the squares in float32, rounds the normalized row, then multiplies by the weight and rounds again; the MLP rounds
SiLU(gate) before the product; the rotary embedding rounds each product and their sum. The float
lm_head a GPTQ checkpoint keeps is the largest read of a token, and torch's bfloat16 matrix-vector
product reads it at a fraction of the memory speed; gemv_bf16 (AVX512-BF16 or AVX2) sums exact products in
float32 as torch does.

`use(model)` (load calls it) swaps the classes of the RMSNorm, MLP, quantized experts, attention,
decoder layer and bias-free bfloat16 Linear modules of a bfloat16 CPU model for subclasses of them
and of CpuRMSNorm, CpuGatedMLP, CpuQuantizedExperts, CpuDecodeAttention, CpuDecoderLayer and CpuLinear: each module keeps its parameters,
submodules, hooks and tied weights, isinstance checks still hold, and its forward runs C where it
computes the same (`runs_here`: eager bfloat16 CPU rows, no autograd; attention: one token of a
"quantprep_cpu" model; no hooks on fused members) and the replaced
class's own forward everywhere else (torch.compile, export, other dtypes, prefill's attention, a
Linear's several rows where torch has a bfloat16 GEMM kernel). Where a decode token's projections
run int4 or int4_a8 at one row, a decoder layer is one C call (decode_layer) that makes its modules'
C calls in turn, without the Python between them; a Qwen3-MoE or Mixtral layer's sparse block too
(benchmarks/experiments/README.md, "CPU decode layers", "MoE decode on the CPU").
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import sys
import threading
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from quantprep.runtime import cpu_attention
from quantprep.runtime.architectures import ARCHITECTURES, Architecture
from quantprep.runtime.experts import QuantizedExperts
from quantprep.runtime.fused import FusedMember
from quantprep.targets import c_library
from quantprep.targets.c_abi import ROUTER_TIE, DecodeLayerArgs, QuantLinearArgs
from quantprep.targets.cpu import CpuInt4Linear, eager, gemv_library, native_dequantizer, native_int4_a8, native_int4_gemv
from quantprep.targets.packed import SLOW_HALF_GEMM, CountedModule, PackedLinear


@functools.cache
def library() -> ctypes.CDLL | None:
    """csrc/layers.c compiled (c_library.py, with torch's OpenMP where it can), or None without a C compiler."""
    # No code here reads floating-point exception flags, and without trapping math gcc vectorizes
    # exp_poly's selects with AVX2 too (with AVX512 it used masks; on AVX2 silu_mul stayed scalar and
    # slower than torch's: benchmarks/experiments/cpu_layers.py times the two). The results are the same.
    return c_library.library_with_torch_openmp("layers", ("-fno-trapping-math",))


def runs_here(x: torch.Tensor, weight: torch.Tensor | None = None, weight_shape: tuple[int, ...] | None = None) -> bool:
    """Whether C may compute on x (and a layer's weight, of weight_shape: default x's last dimension):
    eager, contiguous, bfloat16, on the CPU, not empty, no autograd. Checked in the order of what is
    cheapest to rule out: these run per layer and token."""
    if x.dtype is not torch.bfloat16 or not x.is_contiguous() or x.device.type != "cpu" or not eager(x) or x.numel() == 0:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return False
    return weight is None or weight_runs_here(weight, weight_shape or x.shape[-1:])


def weight_runs_here(weight: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether C may read a layer's weight of `shape`: a plain bfloat16 CPU tensor or parameter, contiguous, no autograd."""
    return type(weight) in (torch.Tensor, nn.Parameter) and weight.dtype is torch.bfloat16 and weight.device.type == "cpu" and \
        weight.is_contiguous() and weight.shape == shape and not (torch.is_grad_enabled() and weight.requires_grad)


class Replacement(CountedModule):
    """A transformers module whose class `replace` swapped for `replacement_class(base, its class)`: a
    subclass of both, so its parameters, submodules, attributes and hooks stay where they were and
    isinstance checks on the replaced class still hold (transformers records attentions by class).
    `replaced` is that class; its forward runs wherever C does not. Pickles and copies through
    `rebuild` (the combined class is made at run time). Its changes are counted (CountedModule):
    a decoder layer in C sees that its members did not change from the counts."""

    replaced: type

    def __reduce_ex__(self, protocol):
        return rebuild, (type(self).__bases__[0], self.replaced, self.__getstate__())


@functools.cache
def replacement_class(base: type, replaced: type) -> type:
    return type(f"Cpu{replaced.__name__}", (base, replaced), {"replaced": replaced, "__module__": __name__})


def rebuild(base: type, replaced: type, state: dict) -> nn.Module:
    module = object.__new__(replacement_class(base, replaced))
    module.__setstate__(state)
    return module


def fused_as_built(parent: nn.Module, fused: str, members: tuple[str, ...]) -> bool:
    """Whether `parent`'s fused projection and its members are the ones load installed (runtime/fused.py),
    in `members`' order (C reads the parts in that order), with no forward hooks on them or on every
    module: a hook, or a member put in its place, must see the member calls transformers' forward makes."""
    mods = parent._modules
    group = [mods.get(fused)] + [mods.get(m) for m in members]
    return (not torch_module._global_forward_hooks and not torch_module._global_forward_pre_hooks
            and all(type(m) is FusedMember and m.group.fused is group[0] and m.index == i for i, m in enumerate(group[1:]))
            and not any(m._forward_hooks or m._forward_pre_hooks for m in group))


class CpuRMSNorm(Replacement):
    """transformers' RMSNorm (`weight * normalize(x)`, `variance_epsilon`) with its forward in C."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not runs_here(x, w) or (lib := library()) is None:  # runs_here first: traced code never calls into ctypes
            return self.replaced.forward(self, x)
        y, n = torch.empty_like(x), x.shape[-1]
        lib.rms_norm(x.data_ptr(), n, w.data_ptr(), y.data_ptr(), n, x.numel() // n, n, self.variance_epsilon)
        return y


class CpuGatedMLP(Replacement):
    """transformers' gated MLP, down(silu(gate(x)) * up(x)), whose gate and up quantprep fused into
    gate_up_proj (runtime/fused.py): one fused matmul, the SiLU product in C, down_proj."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not runs_here(x) or not fused_as_built(self, "gate_up_proj", ("gate_proj", "up_proj")) or (lib := library()) is None:
            return self.replaced.forward(self, x)
        gu = self.gate_up_proj(x)
        if not runs_here(gu):
            return self.replaced.forward(self, x)
        return self.down_proj(silu_mul(lib, gu))


def silu_mul(lib: ctypes.CDLL, gu: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a contiguous bfloat16 gu [..., 2n] (gate first), in csrc/layers.c's silu_mul."""
    n = gu.shape[-1] // 2
    y = gu.new_empty(*gu.shape[:-1], n)
    lib.silu_mul(gu.data_ptr(), 2 * n, y.data_ptr(), n, gu.numel() // (2 * n), n)
    return y


class CpuDecodeAttention(Replacement):
    """transformers' attention of an architecture of runtime/architectures.py (Llama's, Qwen2's, Qwen3's,
    Mistral's), whose q/k/v quantprep fused into qkv_proj, with one decode token in fewer steps: the
    fused matmul, Qwen3's q/k norms and the rotary embedding in C in place on its output, the cache's
    own update, the attention function (cpu_attention: its kernel, or SDPA where the mask hides keys),
    o_proj. A sliding window is the mask's and the cache's, as in the replaced forward (the window it
    passes, SDPA's and the kernel's do not read). What is not one token of a "quantprep_cpu" model
    takes the replaced class's forward."""

    def architecture(self) -> Architecture:
        return attention_architecture(self.replaced)  # a replaced class is one is_fused_decode_attention took

    def norms_as_built(self) -> bool:
        """Qwen3's q_norm and k_norm as use() replaced them, weights of head_dim that C reads, no hooks or forward of their own."""
        norms = [self._modules.get(n) for n in ("q_norm", "k_norm")]
        return all(isinstance(m, Replacement) and type(m) is replacement_class(CpuRMSNorm, m.replaced) and "forward" not in vars(m)
                   and not (m._forward_hooks or m._forward_pre_hooks) and (w := m._parameters.get("weight")) is not None
                   and weight_runs_here(w, (self.head_dim,)) for m in norms)

    def decodes_as_built(self) -> bool:
        """This module's own conditions for the decode steps (its inputs': decodes_here): not training,
        the "quantprep_cpu" attention, q/k/v fused as load built them, Qwen3's norms as built."""
        return not self.training and self.config._attn_implementation == cpu_attention.NAME and \
            fused_as_built(self, "qkv_proj", ("q_proj", "k_proj", "v_proj")) and (not self.architecture().qk_norm or self.norms_as_built())

    def decodes_here(self, x: torch.Tensor, position_embeddings, attention_mask, cache, kwargs: dict) -> bool:
        if cache is None or position_embeddings is None or x.dim() != 3 or x.shape[1] != 1 or \
                kwargs.get("output_attentions") or not runs_here(x) or not self.decodes_as_built():
            return False
        cos, sin = position_embeddings
        return all(runs_here(t) and t.shape == (x.shape[0], 1, self.head_dim) for t in (cos, sin))

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        cache = kwargs.pop("past_key_values", cache)  # its name before transformers 5.40
        if not self.decodes_here(hidden_states, position_embeddings, attention_mask, cache, kwargs) or (lib := library()) is None:
            return self.replaced.forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        B, D = hidden_states.shape[0], self.head_dim
        q_size, kv_size = self.qkv_proj.parts[0], self.qkv_proj.parts[1]
        qkv = self.qkv_proj(hidden_states).contiguous()  # [B, 1, q + 2 kv]
        if self.architecture().qk_norm:  # as q_norm(q.view(..., D)), k_norm(k.view(..., D)): the same C, per head
            qn, kn = self.q_norm, self.k_norm
            lib.qk_norm(qkv.data_ptr(), qkv.shape[-1], B, q_size // D, kv_size // D, D, qn.weight.data_ptr(), kn.weight.data_ptr(),
                        qn.variance_epsilon, kn.variance_epsilon)
        cos, sin = position_embeddings
        lib.rotary(qkv.data_ptr(), qkv.shape[-1], B, (q_size + kv_size) // D, D, cos.data_ptr(), sin.data_ptr())
        q = qkv[..., :q_size].view(B, 1, -1, D).transpose(1, 2)
        k = qkv[..., q_size:q_size + kv_size].view(B, 1, -1, D).transpose(1, 2)
        v = qkv[..., q_size + kv_size:].view(B, 1, -1, D).transpose(1, 2)
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        out, _ = cpu_attention.attention(self, q, k, v, attention_mask, scaling=self.scaling)
        return self.o_proj(out.reshape(B, 1, q_size)), None


class CpuQuantizedExperts(Replacement):
    """runtime/experts.py's QuantizedExperts with act SiLU: each expert's SiLU product in C, as CpuGatedMLP's.
    A decode token whose k experts each run the int4 path at one row (int4_gemv_cpu, as the default plan) takes two C calls
    (int4_gemv_rows: the k gate_up projections, then the k down ones) with the SiLU product between:
    the replaced forward's arithmetic, without its 2k calls through Python and torch."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = self.decode(hidden_states, top_k_index, top_k_weights)
        return self.replaced.forward(self, hidden_states, top_k_index, top_k_weights) if out is None else out

    def decode(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor | None:
        H, inter = self.hidden_dim, self.intermediate_dim
        if hidden_states.numel() != H or not runs_here(hidden_states) or (gemv := gemv_library()) is None or \
                (lib := library()) is None or torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return None  # a global hook must see each projection's call
        k = top_k_index.shape[-1]
        if not k or top_k_index.numel() != k or top_k_weights.numel() != k:
            return None  # not one token's k experts: the replaced forward's to take (or refuse)
        experts = top_k_index.reshape(-1).tolist()
        if not all(0 <= e < self.num_experts for e in experts):
            return None  # transformers' expert-parallel sentinel: the replaced forward's zeros
        projections = [self.expert_args(e) for e in experts]
        if None in projections:
            return None
        gate_up = (ctypes.c_void_p * k)(*(ctypes.addressof(p[0]) for p in projections))
        down = (ctypes.c_void_p * k)(*(ctypes.addressof(p[1]) for p in projections))
        gu = hidden_states.new_empty(k, 2 * inter)
        y = hidden_states.new_empty(k, H)
        gemv_rows(gemv, gate_up, hidden_states, 0, k, gu, 2 * inter)
        act = silu_mul(lib, gu)  # held here: C reads it
        gemv_rows(gemv, down, act, inter, k, y, H)
        return self.combine(y, top_k_weights.reshape(-1, 1), 1, k).to(hidden_states.dtype).reshape(hidden_states.shape)

    def expert_args(self, e: int) -> tuple[QuantLinearArgs, QuantLinearArgs] | None:
        """Expert e's fused gate_up and down projections as int4_gemv_rows reads them, where both are
        plain CpuInt4Linear modules that run the int4 path at one row; else None."""
        parts = self._modules[str(e)]._modules
        gate_up, down = parts.get("gate_up_proj"), parts.get("down_proj")
        if gate_up is None or down is None or (gate_up.in_features, gate_up.out_features, down.in_features, down.out_features) != \
                (self.hidden_dim, 2 * self.intermediate_dim, self.intermediate_dim, self.hidden_dim):
            return None  # C reads the row and the SiLU product by these sizes
        args = quant_linear_args(gate_up, "int4"), quant_linear_args(down, "int4")
        return None if None in args else args

    def expert_state(self, e: int) -> tuple:
        """What expert e's C arguments (expert_args) depend on: its modules, their classes, forwards set on
        them, hooks and plans, and their tensors' ids, addresses, shapes, strides and dtypes. A decoder
        layer that runs it in C compares it with the state it was built from (SparseState.as_built)."""
        expert = self._modules.get(str(e))
        parts = getattr(expert, "_modules", {})
        out = [expert]
        for m in (parts.get("gate_up_proj"), parts.get("down_proj")):
            d = vars(m) if m is not None else {}
            out += [m, type(m), d.get("forward"), bool(d.get("_forward_hooks") or d.get("_forward_pre_hooks")), d.get("plan"),
                    d.get("plan_max_m")]
            out += [(id(t), t.data_ptr(), t.shape, t.stride(), t.dtype) for kind in ("_buffers", "_parameters")
                    for t in d.get(kind, {}).values() if t is not None]
        return tuple(out)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not runs_here(gate_up) or gate_up.dim() != 2 or gate_up.shape[1] != 2 * self.intermediate_dim or (lib := library()) is None:
            return self.replaced.gated(self, gate_up)
        return silu_mul(lib, gate_up)


def gemv_rows(lib: ctypes.CDLL, weights, x: torch.Tensor, ldx: int, rows: int, out: torch.Tensor, ldo: int) -> None:
    """int4_gemv_rows on torch's threads; its refusals raised."""
    status = lib.int4_gemv_rows(weights, x.data_ptr(), ldx, rows, out.data_ptr(), ldo, torch.get_num_threads())
    if status == -1:
        raise MemoryError("int4_gemv_rows could not allocate its activations")
    if status:
        raise ValueError(f"int4_gemv_rows refused these projections ({status})")


def quant_linear_args(linear: nn.Module, path: str = "int4_a8") -> QuantLinearArgs | None:
    """The C arguments of a projection whose plan runs `path` at one row (int4_a8, or int4: int4_gemv_cpu
    where the block is one it reads) and that writes its outputs unpadded, with a bfloat16 bias if any; else None."""
    if type(linear) is not CpuInt4Linear or linear.path_for(1) != path or linear.padded_out != linear.out_features or \
            linear._forward_hooks or linear._forward_pre_hooks or "forward" in vars(linear) or \
            (path == "int4" and not linear.gemv_reads()):
        return None
    bias = linear.bias
    if bias is not None and not runs_here(bias, bias, (linear.out_features,)):
        return None
    perm, qweight, sz, K, N, group = linear.c_weight(path)
    return QuantLinearArgs(perm, qweight, sz, None if bias is None else bias.data_ptr(), linear.in_features, K, N, group,
                           linear.pack_block_n)


ATTENTION_MEMBERS, MLP_MEMBERS = ("qkv_proj", "o_proj", "q_proj", "k_proj", "v_proj"), ("gate_up_proj", "down_proj", "gate_proj", "up_proj")
SPARSE_MEMBERS = ("gate", "experts")  # a sparse block's router and experts
QK_NORMS = ("q_norm", "k_norm")  # Qwen3's (Architecture.qk_norm)
ROUTER_SETTINGS = ("top_k", "num_experts", "hidden_dim", "norm_topk_prob")  # the routers' attributes sparse_routing reads


def layer_kernel(path: str):
    """decode_layer's kernel for the projections of a layer whose plans run `path` at one row: int4_a8_cpu, or
    int4_gemv_cpu for int4 (the same arguments); None for another path or where it did not build."""
    return native_int4_a8() if path == "int4_a8" else native_int4_gemv() if path == "int4" else None


def sparse_routing(mlp: nn.Module) -> tuple[nn.Module, nn.Module, bool, bool] | None:
    """(router, experts, renormalize, round_weights) of a sparse block whose forward and router's are
    transformers' Qwen3-MoE's or Mixtral's, instruction for instruction (decode_layer's sparse_block
    computes theirs: Qwen3-MoE's router renormalizes where norm_topk_prob and returns bfloat16
    weights, Mixtral's always renormalizes and returns float32 ones), else None."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

    gate, experts = mlp._modules.get("gate"), mlp._modules.get("experts")
    if gate is None or experts is None or mlp.training or \
            not (same_forward(mlp, Qwen3MoeSparseMoeBlock) or same_forward(mlp, MixtralSparseMoeBlock)):
        return None  # a training Mixtral block adds jitter
    if same_forward(gate, Qwen3MoeTopKRouter):
        return gate, experts, bool(getattr(gate, "norm_topk_prob", None)), True
    if same_forward(gate, MixtralTopKRouter):
        return gate, experts, True, False
    return None


class LayerState(NamedTuple):
    """A decoder layer's C arguments and what they were checked against (CpuDecoderLayer.decode_args)."""

    watched: tuple  # CpuDecoderLayer.watched() at the build, or at the last check
    stamp: tuple  # changes_stamp() then
    args: DecodeLayerArgs | None  # None: this layer does not run C
    layer_idx: int | None
    kept: list | None  # what keeps the memory the arguments point into alive
    sparse: SparseState | None
    slots: list  # module_slots and tensor_slots of what C reads outside the experts
    uncounted: tuple  # CpuDecoderLayer.uncounted() then


class CpuDecoderLayer(Replacement):
    """transformers' Llama-style decoder layer (is_decoder_layer). At one decode token of a layer whose norms, attention and
    MLP (or Qwen3-MoE's or Mixtral's sparse block, its experts this file's) are this file's and whose projections
    run int4_a8 (a plan's choice, after `warm --int8-activations`) or int4 at one row, the whole layer
    is one C call (decode_layer): the calls those modules' forwards make, in their order, without
    Python between them. Everything else (prefill, batches, autograd, hooks on a member, another cache
    or kernel) takes the replaced forward, which calls the modules."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        # transformers calls a layer with keywords; Llama's and Mixtral's forwards order them differently
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # its name before transformers 5.40
        position_embeddings = kwargs.get("position_embeddings")
        decode = None if args else self.decode_args(hidden_states, kwargs.get("attention_mask"), cache, position_embeddings, kwargs)
        if decode is not None:
            state, layer = decode  # held until C returns: what the arguments point into stays alive (kept) if
            args_c, sparse = state.args, state.sparse  # another thread builds the layer again meanwhile
            if sparse is not None:
                args_c = sparse.thread_args(args_c)
            room = layer.room((1, args_c.kv_heads, 1, args_c.head_dim), torch.bfloat16, hidden_states.device)
            if room is not None and room[0].is_contiguous() and room[1].is_contiguous():  # C writes row n of each head
                keys, values, n = room
                out = torch.empty_like(hidden_states)
                cos, sin = position_embeddings
                status = library().decode_layer(ctypes.byref(args_c), hidden_states.data_ptr(), out.data_ptr(), cos.data_ptr(),
                                                sin.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.shape[2], n,
                                                torch.get_num_threads())
                if sparse is not None and status in (0, ROUTER_TIE):  # the router chose: C reads those experts where they are now
                    if status == ROUTER_TIE:
                        sparse.router_chooses()
                    if not sparse.chosen_in_place():
                        vars(self).pop("_decode_layer", None)  # the row written past the cache's end: the modules write it again
                        return self.replaced.forward(self, hidden_states, *args, **kwargs)
                    status = library().sparse_experts(ctypes.byref(args_c), out.data_ptr(), torch.get_num_threads())
                if status == -1:
                    raise MemoryError("decode_layer could not allocate its buffers")
                if status:
                    raise ValueError(f"decode_layer's kernels refused this layer ({status})")
                layer.written(keys, values, n + 1)
                return out
        return self.replaced.forward(self, hidden_states, *args, **kwargs)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_decode_layer", None)  # addresses in this process's memory: built again at the next call
        return state

    def _apply(self, fn, recurse: bool = True):
        vars(self).pop("_decode_layer", None)  # .to(), .float(), ...: the old tensors are not kept
        return super()._apply(fn, recurse)

    def decode_args(self, x: torch.Tensor, attention_mask, cache, position_embeddings, kwargs: dict) -> tuple | None:
        """(the LayerState whose arguments decode_layer takes, this layer's cache) where it computes what
        the replaced forward would, else None.

        The inputs and the cache are checked at every call. The layer's modules, hooks, plans and
        tensors are checked whole (layer_args) when `watched` changes (or a sparse block's experts,
        SparseState.as_built), and those are compared only when the counts of changes and hooks
        (changes_stamp) or what they do not count (uncounted, in_place) moved: after a layer
        that streamed its weights through the caches, each Python object a check touches comes from
        memory, and checking everything at every call cost a measurable share of a token
        (benchmarks/experiments/README.md, "CPU decode layers", "MoE decode on the CPU")."""
        qkv = getattr(self._modules.get("self_attn"), "_modules", {}).get("qkv_proj")
        if type(qkv) is not CpuInt4Linear or layer_kernel(qkv.path_for(1)) is None:  # nothing more to check
            vars(self).pop("_decode_layer", None)  # nor anything kept from before
            return None
        if attention_mask is not None or position_embeddings is None or torch.is_grad_enabled() or x.dim() != 3 or \
                x.shape[:2] != (1, 1) or not runs_here(x) or kwargs.get("output_attentions") or \
                torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return None
        stamp, uncounted, state = changes_stamp(), self.uncounted(), vars(self).get("_decode_layer")
        if state is None or state.args is None or state.stamp != stamp or state.uncounted != uncounted or \
                not in_place(state.slots):
            # (a layer C does not run is checked whole at every call: a hook's removal is counted on quantprep's modules only)
            watched = self.watched()
            if state is None or state.watched != watched or (state.args is None and state.stamp != stamp) or \
                    (state.sparse is not None and not state.sparse.as_built()):  # (a refused build is tried again when the counts move)
                built = self.layer_args(x) or (None, None, None, None, [])
                state = LayerState(self.watched(), changes_stamp(), *built, uncounted)  # as it stands after the build
            else:
                state = state._replace(watched=watched, stamp=stamp, uncounted=uncounted)
            vars(self)["_decode_layer"] = state  # this layer's own cache: not a change to count
        args, layer_idx = state.args, state.layer_idx
        layers = getattr(cache, "layers", None)
        if args is None or x.shape[2] != args.hidden or layers is None or not 0 <= layer_idx < len(layers) or \
                getattr(cache, "offloading", False) or type(cache).update is not cache_update():
            return None
        cos, sin = position_embeddings
        D, kv_heads, layer = args.head_dim, args.kv_heads, layers[layer_idx]
        if not (checked_rotary(cos, sin, D) and type(layer) is cpu_attention.growing_layer_class() and layer.is_initialized
                and all(type(t) is torch.Tensor and t.dim() == 4 and t.dtype == torch.bfloat16 and t.shape[0] == 1
                        and t.shape[1] == kv_heads and t.shape[3] == D for t in (layer.keys, layer.values))):
            return None
        return state, layer

    def uncounted(self) -> tuple:
        """What `watched` reads that changes_stamp does not count, but for the members and tensors (in_place):
        the attention's implementation (the model's config), and a sparse block with its router and
        experts (transformers' block: its members, class, forward, hooks, training, the router's settings)."""
        mods = self._modules
        attn, mlp = mods.get("self_attn"), mods.get("mlp")
        out = [getattr(vars(attn).get("config") if attn is not None else None, "_attn_implementation", None)]
        if mlp is not None and not isinstance(mlp, CountedModule):
            gate, experts = map(mlp._modules.get, SPARSE_MEMBERS)
            for m in (mlp, gate):
                d = vars(m) if m is not None else {}
                out += [m, type(m), d.get("forward"), bool(d.get("_forward_hooks") or d.get("_forward_pre_hooks")), d.get("training")]
            out += [experts, *(vars(gate).get(k) for k in ROUTER_SETTINGS)] if gate is not None else [experts]
        return tuple(out)

    def watched(self) -> tuple:
        """What layer_args' result depends on, compared at each call: the member modules themselves (a
        tuple compares them by identity), their classes, forwards set on them and hooks, the attention's
        mode, settings and cache index, the norms' epsilons, each projection's plan and parts, and the
        ids, addresses, shapes, strides and dtypes of the tensors C reads (the state that holds the tuple keeps
        them alive, so no other tensor takes their ids)."""
        mods = self._modules  # instance dicts read directly: a missing attribute through nn.Module costs an exception
        attn, mlp = mods.get("self_attn"), mods.get("mlp")
        norms = (mods.get("input_layernorm"), mods.get("post_attention_layernorm"))
        a, am, mm = vars(attn) if attn is not None else {}, getattr(attn, "_modules", {}), getattr(mlp, "_modules", {})
        norms += tuple(map(am.get, QK_NORMS))
        gate, experts = map(mm.get, SPARSE_MEMBERS)
        members = (attn, mlp, *norms, *map(am.get, ATTENTION_MEMBERS), *map(mm.get, MLP_MEMBERS), gate, experts)
        out = [*members, *map(type, members), *(a.get(k) for k in ("training", "layer_idx", "scaling", "head_dim")),
               getattr(a.get("config"), "_attn_implementation", None), getattr(mlp, "training", None)]
        if gate is not None:
            out += [vars(gate).get(k) for k in ROUTER_SETTINGS]
        if experts is not None:
            out += [vars(experts).get(k) for k in ("num_experts", "hidden_dim", "intermediate_dim")] + [experts._modules.get("act_fn")]
        for m in members:
            if m is not None:
                d = vars(m)
                out += [d.get("forward"), bool(d["_forward_hooks"] or d["_forward_pre_hooks"])]
        tensors = [] if gate is None else [gate._parameters.get("weight")]
        for norm in norms:
            if norm is not None:
                out.append(vars(norm).get("variance_epsilon"))
                tensors.append(norm._parameters.get("weight"))
        for linear in (am.get("qkv_proj"), am.get("o_proj"), mm.get("gate_up_proj"), mm.get("down_proj")):
            if type(linear) is CpuInt4Linear:
                out += [linear.plan, linear.plan_max_m, vars(linear).get("parts")]
                tensors += linear._buffers.values()
        out += [(id(t), t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors if t is not None]
        return tuple(out)

    def layer_args(self, x: torch.Tensor) -> tuple[DecodeLayerArgs, int, list, SparseState | None, list] | None:
        """(decode_layer's arguments, the layer's index in the cache, what keeps the memory they point
        into alive, a sparse block's SparseState or None, where the tensors outside the experts that C
        reads are, and the modules that hold them (module_slots, tensor_slots)), or None where this
        layer does not run it. x: a row that runs_here."""
        hidden = x.shape[-1]
        mods = self._modules
        attn, mlp, norm1, norm2 = (mods.get(m) for m in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))
        routing = None if mlp is None or isinstance(mlp, CpuGatedMLP) else sparse_routing(mlp)
        replaced = ((attn, CpuDecodeAttention), (norm1, CpuRMSNorm), (norm2, CpuRMSNorm)) + \
            (((mlp, CpuGatedMLP),) if routing is None else ((routing[1], CpuQuantizedExperts),))
        if not all(isinstance(m, Replacement) and type(m) is replacement_class(base, m.replaced) for m, base in replaced):
            return None  # another class (a subclass, a parametrization's) may compute something else
        qk = [attn._modules.get(m) for m in QK_NORMS] if attn.architecture().qk_norm else []
        mlp_members = MLP_MEMBERS if routing is None else SPARSE_MEMBERS
        members = [attn, mlp, norm1, norm2, *qk, *(attn._modules.get(m) for m in ATTENTION_MEMBERS), *(mlp._modules.get(m) for m in mlp_members)]
        weights = [norm._parameters.get("weight") for norm in (norm1, norm2, *qk)]  # read once: C and the state get the same tensors
        projections = [attn._modules.get(m) for m in ("qkv_proj", "o_proj")] + \
            ([mlp._modules.get(m) for m in ("gate_up_proj", "down_proj")] if routing is None else [])
        if None in members or any("forward" in vars(m) or m._forward_hooks or m._forward_pre_hooks for m in members) or \
                not attn.decodes_as_built() or (routing is None and not fused_as_built(mlp, "gate_up_proj", ("gate_proj", "up_proj"))) or \
                not all(w is not None and runs_here(x, w) for w in weights[:2]) or \
                not all(w is not None and weight_runs_here(w, (attn.head_dim,)) for w in weights[2:]):
            return None
        path = projections[0].path_for(1)
        slots = module_slots(self, ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")) + \
            module_slots(attn, ATTENTION_MEMBERS + QK_NORMS) + module_slots(mlp, mlp_members) + \
            ([] if routing is None else module_slots(routing[1], ("act_fn",))) + \
            tensor_slots([norm1, norm2, *qk, *projections, *([] if routing is None else [routing[0]])])  # the tensors C reads
        kept = kept_alive(slots)
        linears = [quant_linear_args(m, path) for m in projections]
        qkv, o = projections[:2]
        if len(qkv.parts) != 3:
            return None
        D, (q_size, kv_size, v_size) = attn.head_dim, qkv.parts
        if None in linears or (attention := cpu_attention.kernel()) is None or (matmul := layer_kernel(path)) is None or \
                v_size != kv_size or \
                not (isinstance(D, int) and 0 < D <= cpu_attention.MAX_HEAD_DIM and D % 16 == 0 and q_size % D == 0 and
                     kv_size % D == 0 and kv_size and (q_size // D) % (kv_size // D) == 0) or \
                (qkv.in_features, qkv.out_features, o.in_features, o.out_features) != (hidden, q_size + 2 * kv_size, q_size, hidden):
            return None  # sizes C's buffers are not made for
        args = DecodeLayerArgs(matmul=ctypes.cast(matmul, ctypes.c_void_p).value,
                               attention=ctypes.cast(attention, ctypes.c_void_p).value, norm1=weights[0].data_ptr(),
                               norm2=weights[1].data_ptr(), eps1=norm1.variance_epsilon, eps2=norm2.variance_epsilon, scaling=attn.scaling,
                               hidden=hidden, heads=q_size // D, kv_heads=kv_size // D, head_dim=D,
                               window=0,  # no mask (decode_args): every key the cache holds, as the attention then sees them
                               qkv=linears[0], o=linears[1])
        if routing is None:
            gate_up, down = projections[2:]
            if len(gate_up.parts) != 2 or gate_up.parts[0] != gate_up.parts[1] or \
                    (gate_up.in_features, gate_up.out_features, down.in_features, down.out_features) != \
                    (hidden, 2 * gate_up.parts[0], gate_up.parts[0], hidden):
                return None
            args.intermediate, args.gate_up, args.down = gate_up.parts[0], linears[2], linears[3]
            sparse = None
        else:
            sparse = self.sparse_args(args, routing, hidden, kept)
            if sparse is None:
                return None
        if not in_place(slots):
            return None  # tensors replaced or moved while this ran
        if qk:  # else NULL: no norms
            args.q_norm, args.k_norm, args.q_eps, args.k_eps = weights[2].data_ptr(), weights[3].data_ptr(), \
                qk[0].variance_epsilon, qk[1].variance_epsilon
        return args, attn.layer_idx, kept, sparse, slots

    @staticmethod
    def sparse_args(args: DecodeLayerArgs, routing: tuple, hidden: int, kept: list) -> SparseState | None:
        """A sparse block's fields of args set (the router's weight, every expert's projections as
        int4_gemv_rows reads them, where the router's choice goes) and what they point into appended to
        kept: its SparseState; None where decode_layer does not run it."""
        gate, experts, renormalize, round_weights = routing
        weight, E, k = gate._parameters.get("weight"), experts.num_experts, vars(gate).get("top_k")
        if not is_silu(experts.act_fn) or experts.hidden_dim != hidden or type(k) is not int or not 0 < k <= E or \
                vars(gate).get("num_experts", E) != E or weight is None or not weight_runs_here(weight, (E, hidden)) or \
                hidden % 32 or not gemv_bf16_built() or (gemv := gemv_library()) is None:
            return None
        projections = [experts.expert_args(e) for e in range(E)]  # (which may cache a weight's checks in its module)
        if None in projections:
            return None
        states = [experts.expert_state(e) for e in range(E)]  # what the arguments were built from
        gate_up = (QuantLinearArgs * E)(*(p[0] for p in projections))
        down = (QuantLinearArgs * E)(*(p[1] for p in projections))
        slots = [module_slots(experts, (str(e),)) + module_slots(expert := experts._modules[str(e)], ("gate_up_proj", "down_proj")) +
                 tensor_slots(expert._modules.values()) for e in range(E)]
        sparse = SparseState(routing, states, slots)
        kept += [gate_up, down, *kept_alive(s for ts in slots for s in ts)]  # (the router's weight: layer_args keeps it)
        args.experts_matmul = ctypes.cast(gemv.int4_gemv_rows, ctypes.c_void_p).value
        args.router, args.experts_gate_up, args.experts_down = weight.data_ptr(), ctypes.addressof(gate_up), ctypes.addressof(down)
        args.experts, args.top_k = E, k  # (the choice's buffers: SparseState.thread_args)
        args.renormalize, args.round_weights, args.intermediate = int(renormalize), int(round_weights), experts.intermediate_dim
        return sparse


class SparseState:
    """A sparse decode layer's experts as its C arguments were built from them: each expert's state
    (expert_state) and where its modules and tensors are (module_slots, tensor_slots); and, per
    thread, the buffers the router's choice goes into between decode_layer and sparse_experts (the
    experts, their weights, the normalized row): two decodes of one model in two threads (a
    server's) each keep their own."""

    def __init__(self, routing: tuple, states: list[tuple], slots: list[list]):
        _, self.experts, self.renormalize, self.round_weights = routing  # (sparse_routing's)
        self.states, self.slots, self.threads = states, slots, threading.local()

    def thread_args(self, args: DecodeLayerArgs) -> DecodeLayerArgs:
        """args (whose chosen, chosen_weights and routed are NULL: C refuses them) with this thread's buffers."""
        mine = vars(self.threads)
        if "args" not in mine:
            chosen, weights = (ctypes.c_int64 * args.top_k)(), (ctypes.c_float * args.top_k)()
            routed, logits = torch.empty(args.hidden, dtype=torch.bfloat16), torch.empty(1, args.experts, dtype=torch.bfloat16)
            copy = DecodeLayerArgs.from_buffer_copy(args)
            copy.chosen, copy.chosen_weights = ctypes.addressof(chosen), ctypes.addressof(weights)
            copy.routed, copy.logits = routed.data_ptr(), logits.data_ptr()
            mine.update(args=copy, chosen=chosen, chosen_weights=weights, routed=routed, logits=logits)
        return mine["args"]

    def router_chooses(self) -> None:
        """Where C's top-k met equal probabilities at its last place (ROUTER_TIE): the router's own steps
        after its F.linear (sparse_routing's two routers': softmax in float32, torch.topk, the
        renormalization, the rounding) on the logits C left, into this thread's buffers. Which of equal
        probabilities torch.topk takes is its own algorithm's (std::nth_element's), which C does not copy.
        (The router module itself would also compute the logits again: 0.5 ms more at each tie.)"""
        mine = vars(self.threads)
        weights, index = torch.topk(torch.softmax(mine["logits"], dim=-1, dtype=torch.float), len(mine["chosen"]), dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(torch.bfloat16)
        mine["chosen"][:] = index.reshape(-1).tolist()
        mine["chosen_weights"][:] = weights.float().reshape(-1).tolist()

    @property
    def chosen(self) -> ctypes.Array:
        """The experts the router chose at this thread's last decode_layer call."""
        return self.threads.chosen

    def as_built(self) -> bool:
        """Every expert as it was: checked when the counts moved (a walk over all of them)."""
        return all(self.experts.expert_state(e) == state for e, state in enumerate(self.states))

    def chosen_in_place(self) -> bool:
        """Whether the experts the router chose are still the modules holding the tensors C was built
        from, where they were (what the counts do not see: a tensor moved in place, or a module or
        tensor put in a module's dicts directly).
        Checked before C reads them, for those experts only: checking all of them would cost more than the layer."""
        return all(0 <= e < len(self.slots) and in_place(self.slots[e]) for e in self.chosen)


def tensor_slots(modules) -> list[tuple[dict, str, torch.Tensor, int]]:
    """(dict, name, tensor, its address) for each buffer and parameter of `modules`."""
    return [(d, name, t, t.data_ptr()) for m in modules for d in (m._buffers, m._parameters) for name, t in d.items() if t is not None]


def kept_alive(slots) -> list:
    """The tensors of tensor_slots among `slots`, and their storages: deleted from their modules, they
    stay valid where C points (moved in place: in_place sees it)."""
    tensors = [t for _, _, t, address in slots if address is not None]
    return tensors + [t.untyped_storage() for t in tensors]


def module_slots(parent: nn.Module, names) -> list[tuple[dict, str, nn.Module | None, None]]:
    """(dict, name, the module there or None, None) for each of parent's members `names`: a module put
    into parent._modules directly is no change the counts see."""
    return [(parent._modules, name, parent._modules.get(name), None) for name in names]


def in_place(slots: list) -> bool:
    """Whether each module of module_slots and each tensor of tensor_slots is still in its dict, a
    tensor at its address (a tensor's own share_memory_ or set_ moves it and frees the memory C would read)."""
    return all(d.get(name) is t and (address is None or t.data_ptr() == address) for d, name, t, address in slots)


def changes_stamp() -> tuple[int, int]:
    """The counts of changes to quantprep's modules (CountedModule) and of hooks made (each module or
    tensor hook torch makes): equal at two times, none of quantprep's modules gained or lost a hook,
    a forward, a tensor, a plan or a class in between through nn.Module's own methods."""
    return CountedModule.changes, RemovableHandle.next_id


_rotary = threading.local()


def checked_rotary(cos: torch.Tensor, sin: torch.Tensor, D: int) -> bool:
    """Whether C may read cos and sin as one row of D each. Every layer of a token gets the same two
    tensors: the last pair that passed is kept (so no other tensor takes their ids) and passes again."""
    last = getattr(_rotary, "passed", None)
    if last is not None and last[0] is cos and last[1] is sin and last[2] == D:
        return True
    if runs_here(cos) and runs_here(sin) and cos.shape == sin.shape == (1, 1, D):
        _rotary.passed = (cos, sin, D)
        return True
    return False


@functools.cache
def cache_update():
    from transformers.cache_utils import Cache

    return Cache.update


# Where torch has no bfloat16 GEMM kernel (SLOW_HALF_GEMM), from FLOAT32_MIN_ROWS rows the float lm_head
# multiplies in float32, FLOAT32_TILE_ROWS rows of its weight converted at a time (the crossover:
# benchmarks/experiments/results/cpu-layers-avx2.json, "_rows_float32_tiles"; smaller tiles made the
# float32 GEMM slower).
FLOAT32_MIN_ROWS = 16
FLOAT32_TILE_ROWS = 4096


class CpuLinear(nn.Linear):
    """A dense bfloat16 Linear without bias (the float lm_head a GPTQ checkpoint keeps). One row at a
    time in C (gemv_bf16): torch's bfloat16 matrix-vector product reads the weight well below this
    machine's memory speed. Many rows where torch has no bfloat16 GEMM kernel: in float32 over tiles
    of the weight, as the quantized linears' dense paths do there. Other inputs: nn.Linear's forward.
    `replace` makes an nn.Linear one (a subclass without state of its own)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, K, N = self.weight, self.in_features, self.out_features
        if self.bias is not None or x.dim() == 0 or x.shape[-1] != K or not runs_here(x, w, (N, K)):
            return super().forward(x)
        rows = x.numel() // K
        if rows >= FLOAT32_MIN_ROWS and SLOW_HALF_GEMM:
            return self.float32_tiles(x)
        if rows != 1:
            return super().forward(x)
        y = x.new_empty(*x.shape[:-1], N)
        if library().gemv_bf16(x.data_ptr(), w.data_ptr(), y.data_ptr(), N, K) != 0:
            return super().forward(x)
        return y

    def float32_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T, each output's sum in float32 (as torch's bfloat16 GEMM sums), rounded to x's dtype."""
        w, K, N = self.weight, self.in_features, self.out_features
        rows, y = x.reshape(-1, K).float(), x.new_empty(*x.shape[:-1], N)
        out = y.view(-1, N)
        tile = w.new_empty(min(FLOAT32_TILE_ROWS, N), K, dtype=torch.float32)
        for n0 in range(0, N, FLOAT32_TILE_ROWS):
            n1 = min(n0 + FLOAT32_TILE_ROWS, N)
            t = tile[: n1 - n0]
            t.copy_(w[n0:n1])
            out[:, n0:n1] = rows @ t.T
        return y


def same_code(f, g) -> bool:
    """Whether two functions are the same instructions on the same names and constants (transformers
    copies Llama's code into each family that shares it: "Copied from")."""
    a, b = inspect.unwrap(f).__code__, inspect.unwrap(g).__code__
    return (a.co_code, a.co_names, a.co_consts) == (b.co_code, b.co_names, b.co_consts)


def same_forward(module: nn.Module, reference: type) -> bool:
    return same_code(type(module).forward, reference.forward)


def is_rms_norm(module: nn.Module) -> bool:
    """transformers' Llama-style RMSNorm: Llama, Qwen2, Mistral and the families that copy it (one
    weight, variance_epsilon, normalize then scale); Gemma's (1 + weight) and others are left alone."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return same_forward(module, LlamaRMSNorm) and set(module._parameters) == {"weight"} and hasattr(module, "variance_epsilon")


def is_silu(act: nn.Module | None) -> bool:
    from transformers.activations import SiLUActivation

    return type(act) in (nn.SiLU, SiLUActivation)


def is_silu_experts(module: nn.Module) -> bool:
    return type(module) is QuantizedExperts and is_silu(module.act_fn)


def is_fused_silu_mlp(module: nn.Module) -> bool:
    """A Llama-style MLP (down(act(gate(x)) * up(x))) with act SiLU and gate/up fused into equal parts."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    fused = getattr(module, "gate_up_proj", None)
    return same_forward(module, LlamaMLP) and is_silu(getattr(module, "act_fn", None)) and \
        len(getattr(fused, "parts", ())) == 2 and fused.parts[0] == fused.parts[1]


@functools.cache
def attention_architecture(cls: type) -> Architecture | None:
    """The architecture (runtime/architectures.py) whose transformers attention has cls's forward,
    instruction for instruction, or None: the code decides what it computes, not the class's name."""
    import transformers

    for arch in ARCHITECTURES.values():
        modeling = sys.modules[getattr(transformers, arch.causal_lm).__module__]  # the model class's module, imported by the getattr
        if same_code(cls.forward, getattr(modeling, arch.causal_lm.removesuffix("ForCausalLM") + "Attention").forward):
            return arch
    return None


def is_fused_decode_attention(module: nn.Module) -> bool:
    """The attention of an architecture of runtime/architectures.py (forward and rotary embedding
    instruction for instruction) with q/k/v fused into qkv_proj in that order, a head size the kernels
    take, and Qwen3's q_norm and k_norm RMSNorms."""
    from transformers.models.llama import modeling_llama

    if (arch := attention_architecture(type(module))) is None:
        return False
    norms = [module._modules.get(n) for n in ("q_norm", "k_norm")]
    if arch.qk_norm and not all(isinstance(m, CpuRMSNorm) or (m is not None and is_rms_norm(m)) for m in norms):
        return False
    rotary = inspect.unwrap(type(module).forward).__globals__
    if not all(callable(rotary.get(f)) and same_code(rotary[f], getattr(modeling_llama, f)) for f in ("apply_rotary_pos_emb", "rotate_half")):
        return False
    c, D = module.config, getattr(module, "head_dim", 0)
    parts = getattr(getattr(module, "qkv_proj", None), "parts", ())
    return isinstance(D, int) and 0 < D <= cpu_attention.MAX_HEAD_DIM and D % 16 == 0 and \
        parts == (c.num_attention_heads * D, c.num_key_value_heads * D, c.num_key_value_heads * D)


def is_decoder_layer(module: nn.Module) -> bool:
    """Llama's decoder layer (forward instruction for instruction: Qwen2's, Qwen3's, Mistral's and Qwen3-MoE's too) or
    Mixtral's (the same steps, its arguments in another order), with its four members."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    return (same_forward(module, LlamaDecoderLayer) or same_forward(module, MixtralDecoderLayer)) and \
        all(m in module._modules for m in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))


def is_dense_bf16_linear(module: nn.Module) -> bool:
    """An nn.Linear (exactly) with a bfloat16 weight, no bias and K % 32 == 0, where this library has gemv_bf16."""
    return type(module) is nn.Linear and module.bias is None and module.weight.dtype == torch.bfloat16 and \
        module.in_features % 32 == 0 and gemv_bf16_built()


@functools.cache
def gemv_bf16_built() -> bool:
    """Whether gemv_bf16 was compiled for this CPU (AVX512-BF16, or AVX2 and FMA), by calling it on one 32-long row."""
    x = torch.zeros(32, dtype=torch.bfloat16)
    y = torch.empty(1, dtype=torch.bfloat16)
    return library() is not None and library().gemv_bf16(x.data_ptr(), x.data_ptr(), y.data_ptr(), 1, 32) == 0


def replace(module: nn.Module) -> nn.Module | None:
    """Swap the class of one module this file has C for (in place; the module keeps everything it
    holds) and return it, else None."""
    if is_rms_norm(module):
        module.__class__ = replacement_class(CpuRMSNorm, type(module))
    elif is_fused_silu_mlp(module):
        module.__class__ = replacement_class(CpuGatedMLP, type(module))
    elif is_silu_experts(module):
        module.__class__ = replacement_class(CpuQuantizedExperts, type(module))
    elif is_fused_decode_attention(module):
        module.__class__ = replacement_class(CpuDecodeAttention, type(module))
    elif is_decoder_layer(module):
        module.__class__ = replacement_class(CpuDecoderLayer, type(module))
    elif is_dense_bf16_linear(module):
        module.__class__ = CpuLinear
    else:
        return None
    return module


def use(model: nn.Module) -> int:
    """Give the RMSNorm, fused SiLU MLP, SiLU quantized experts, fused attention and decoder layer
    (runtime/architectures.py) and dense bfloat16 Linear modules of a bfloat16 CPU model their C forwards (replace); how many (0: another
    dtype or no C compiler)."""
    if model.dtype != torch.bfloat16 or library() is None:
        return 0
    return sum(replace(m) is not None for m in list(model.modules()))


def c_paths(linear: PackedLinear) -> set[str]:
    """The paths a quantized linear may run that are quantprep's C, built here or not: int4_a8 and
    int8_a8, CpuInt4Linear's dense paths (the native dequantizer's tiles) and its int4 path at one
    bfloat16 row (int4_gemv_cpu). It may run its plan's paths up to plan_max_m rows and its fixed
    rule's above: one switch, from its kernel to a dense path at DEQUANT_MIN_M, so the rule's two ends
    are all it picks."""
    if not linear.paths():
        return set()
    picked = {p for _, p in linear.plan} | {linear.default_path(m) for m in (linear.plan_max_m + 1, 1 << 30)}
    int4 = isinstance(linear, CpuInt4Linear)
    one_row = int4 and linear.path_for(1) == "int4" and linear.gemv_reads()
    return {p for p in picked if p in ("int4_a8", "int8_a8") or (int4 and linear.native_dense(p))} | ({"int4"} if one_row else set())


def expects_c(model: nn.Module) -> bool:
    """Whether quantprep has C for some of a CPU model's modules, built here or not: a bfloat16 model's
    attention, norms, MLPs and float lm_head (use, cpu_attention.use), or a quantized linear's path."""
    return model.dtype == torch.bfloat16 or any(c_paths(m) for m in model.modules() if isinstance(m, PackedLinear))


def c_modules(model: nn.Module) -> dict[str, int]:
    """How many of a CPU model's modules run quantprep's C here, by kind (load sets it as model.quantprep_c):
    quantized linears with a C path (c_paths; an a8 path is in a plan only where it built), the layers
    whose decode attention is the "quantprep_cpu" kernel, RMSNorms, gated MLPs and experts modules, decoder layers whose
    projections run int4_a8 or int4 at one row (one decode_layer call), and float Linears (the lm_head)."""
    counts = dict.fromkeys(("quantized_linears", "attention", "norms", "mlps", "decoder_layers", "float_linears"), 0)
    if model.config._attn_implementation == cpu_attention.NAME:
        counts["attention"] = model.config.num_hidden_layers
    built = {"dequant": native_dequantizer() is not None, "int4": gemv_library() is not None}
    built["dequant_f32"] = built["dequant"]
    for m in model.modules():
        if isinstance(m, PackedLinear):
            counts["quantized_linears"] += any(built.get(p, True) for p in c_paths(m))  # an a8 path is planned only where it built
        elif isinstance(m, CpuDecoderLayer):  # the classes below exist only where their library built (use)
            attn, mlp = m._modules["self_attn"]._modules, m._modules["mlp"]
            routing = sparse_routing(mlp)
            projections = [attn.get("qkv_proj"), attn.get("o_proj")] + \
                ([mlp._modules.get("gate_up_proj"), mlp._modules.get("down_proj")] if routing is None else [])
            path = projections[0].path_for(1) if type(projections[0]) is CpuInt4Linear else None
            counts["decoder_layers"] += cpu_attention.kernel() is not None and layer_kernel(path) is not None and \
                all(p is not None and quant_linear_args(p, path) is not None for p in projections) and \
                (routing is None or (isinstance(routing[1], CpuQuantizedExperts) and
                                     all(routing[1].expert_args(e) is not None for e in range(routing[1].num_experts))))
        elif isinstance(m, CpuRMSNorm):
            counts["norms"] += 1
        elif isinstance(m, CpuGatedMLP | CpuQuantizedExperts):
            counts["mlps"] += 1
        elif isinstance(m, CpuLinear):
            counts["float_linears"] += 1
    return counts
