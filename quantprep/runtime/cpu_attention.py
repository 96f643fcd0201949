"""Attention for one new token on the CPU: quantprep's C kernel in place of torch's SDPA at decode.

torch's CPU SDPA for a single bfloat16 query is several times slower than its own float32 path, and
the gap grows with the context (benchmarks/experiments/results/cpu-decode-attention-avx512.json).
This kernel reads the bfloat16 KV cache once per head and accumulates in float32, as SDPA does.

It is transformers' attention function "quantprep_cpu" (AttentionInterface), which a bfloat16
artifact loaded on the CPU uses in place of "sdpa": one query token with no mask (decode without
padding), or a mask that hides no key (a sliding window's, whose cache holds only the window), runs
here, everything else (runs_here) goes to transformers' sdpa_attention_forward unchanged. Masks are
built as for "sdpa".

The KV cache: transformers' DynamicLayer concatenates each layer's whole cache with the new token's
keys and values at every token, a copy that grows with the context
(benchmarks/experiments/results/cpu-decode-attention-avx512.json). A model that uses this attention
makes the DynamicLayers of the cache it is called with GrowingLayers, which append into a buffer with room to spare and return views of it: the same
values, no copy of the cache per token, and rows once handed out are never written again.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from quantprep.targets import c_library
from quantprep.targets.c_abi import MAX_HEAD_DIM
from quantprep.targets.cpu import eager

NAME = "quantprep_cpu"


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:
    """`decode_attention` (csrc/attention.c; c_library.py compiles it, with torch's OpenMP where it can), or
    None without a C compiler."""
    lib = c_library.library_with_torch_openmp("attention")
    return None if lib is None else lib.decode_attention


def runs_here(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
              dropout: float, kwargs: dict) -> bool:
    """Whether the C kernel computes what sdpa_attention_forward would for these inputs (to bfloat16
    rounding: both sum in float32): one token, no mask or one that hides no key, no dropout, softcap,
    sinks or position bias, eager bfloat16 CPU tensors with dense rows, no autograd."""
    B, H, T, D = query.shape
    return (T == 1 and dropout == 0.0
            and all(eager(t) and t.device.type == "cpu" for t in (query, key, value))
            and query.dtype == torch.bfloat16 and key.dtype == query.dtype and value.dtype == query.dtype
            and key.shape[0] == B and key.shape[1] > 0 and H % key.shape[1] == 0 and key.shape[3] == D
            and value.shape == key.shape and key.shape[2] > 0 and D % 16 == 0 and D <= MAX_HEAD_DIM
            and query.stride(3) == key.stride(3) == value.stride(3) == 1
            and all(kwargs.get(k) is None for k in ("softcap", "s_aux", "sinks", "position_bias"))
            and not kwargs.get("output_attentions", False)
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
            and (attention_mask is None or hides_no_key(attention_mask, key)))  # last: a tensor op


def hides_no_key(mask: torch.Tensor, key: torch.Tensor) -> bool:
    """A boolean mask over the key's rows (sdpa_mask's) that lets every row through: the same as none."""
    return mask.dtype is torch.bool and eager(mask) and mask.device.type == "cpu" and mask.dim() == 4 and \
        mask.shape[-1] == key.shape[2] and bool(mask.all())


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, T, D], key/value [B, KV, S, D] ->
    ([B, T, H, D], None)."""
    fn = kernel()
    if fn is not None and runs_here(query, key, value, attention_mask, dropout, kwargs):
        B, H, _, D = query.shape
        out = query.new_empty(B, 1, H, D)
        scale = scaling if scaling is not None else D ** -0.5
        if fn(query.data_ptr(), query.stride(0), query.stride(1),
              key.data_ptr(), key.stride(0), key.stride(1), key.stride(2),
              value.data_ptr(), value.stride(0), value.stride(1), value.stride(2),
              out.data_ptr(), B, H, key.shape[1], key.shape[2], D, scale) == 0:
            return out, None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # only here: not per decode call

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def append(cached: torch.Tensor, buffer: torch.Tensor | None, filled: int, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """cached ++ new along the sequence (dim -2) -> (a view of buffer, buffer, rows of it written)."""
    buffer, n = with_room(cached, buffer, filled, new.shape, new.dtype, new.device)
    end = n + new.shape[-2]
    buffer[:, :, n:end] = new
    return buffer[:, :, :end], buffer, end


def with_room(cached: torch.Tensor, buffer: torch.Tensor | None, filled: int, shape: torch.Size, dtype: torch.dtype,
              device: torch.device) -> tuple[torch.Tensor, int]:
    """(a buffer whose first n rows are `cached` and that has room for rows of `shape` [B, KV, rows, D]
    after them, n).

    The same buffer when `cached` is still exactly the rows written into it so far, else (a cropped,
    reordered or replaced cache, no room left, an inference-mode buffer outside inference mode) a new
    one a quarter larger than needed (at least 256 more rows), into which `cached` is copied once: so
    a row once handed out in a view is never written again."""
    n = cached.shape[-2] if cached.dim() == 4 else 0
    end = n + shape[-2]
    if not (buffer is not None and n and n == filled and cached.data_ptr() == buffer.data_ptr()
            and cached.stride() == buffer.stride() and cached.shape[:2] == shape[:2] == buffer.shape[:2]
            and cached.shape[-1] == shape[-1] == buffer.shape[-1] and end <= buffer.shape[-2] and buffer.dtype == dtype
            and buffer.device == device and (torch.is_inference_mode_enabled() or not buffer.is_inference())):
        buffer = torch.empty(*shape[:2], end + max(256, end // 4), shape[-1], dtype=dtype, device=device)
        if n:
            buffer[:, :, :n] = cached
    return buffer, n


def plain_layer(state: dict):
    """A DynamicLayer with this state: how a GrowingLayer pickles (its class is made at run time)."""
    from transformers.cache_utils import DynamicLayer

    layer = DynamicLayer.__new__(DynamicLayer)
    layer.__dict__.update(state)
    return layer


@functools.cache
def growing_layer_class() -> type:
    """GrowingLayer, made on first use: transformers is imported only then."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A DynamicLayer whose update appends into spare room (append) instead of concatenating."""

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys, self.key_buffer, self.key_rows = append(self.keys, getattr(self, "key_buffer", None),
                                                               getattr(self, "key_rows", 0), key_states)
            self.values, self.value_buffer, self.value_rows = append(self.values, getattr(self, "value_buffer", None),
                                                                     getattr(self, "value_rows", 0), value_states)
            return self.keys, self.values

        def room(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int] | None:
            """(key buffer, value buffer, n): room for rows of `shape` [B, KV, rows, D] after the n cached,
            for a caller that writes them itself and then calls `written`; None where keys and values
            hold different lengths."""
            keys, n = with_room(self.keys, getattr(self, "key_buffer", None), getattr(self, "key_rows", 0), shape, dtype, device)
            values, n_values = with_room(self.values, getattr(self, "value_buffer", None), getattr(self, "value_rows", 0),
                                         shape, dtype, device)
            return (keys, values, n) if n == n_values else None

        def written(self, keys: torch.Tensor, values: torch.Tensor, end: int) -> None:
            """The buffers from `room` hold `end` rows now: the cache is their first `end`."""
            self.keys, self.key_buffer, self.key_rows = keys[:, :, :end], keys, end
            self.values, self.value_buffer, self.value_rows = values[:, :, :end], values, end

        def __reduce_ex__(self, protocol):
            """Pickles as the DynamicLayer it stands for: its keys and values without the spare rows."""
            state = {k: v for k, v in vars(self).items() if k not in ("key_buffer", "value_buffer", "key_rows", "value_rows")}
            if state.get("keys") is not None and state["keys"].dim() == 4:
                state["keys"], state["values"] = state["keys"].contiguous(), state["values"].contiguous()
            return plain_layer, (state,)

    return GrowingLayer


def grow_in_place(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the plain DynamicLayers of the cache passed by keyword become GrowingLayers
    (a subclass; their state is kept, and copied into a buffer once at their next update)."""
    from transformers.cache_utils import DynamicLayer

    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    for layer in getattr(cache, "layers", ()):
        if type(layer) is DynamicLayer:
            layer.__class__ = growing_layer_class()


def use(model: torch.nn.Module) -> bool:
    """Switch a bfloat16 CPU model that runs transformers' "sdpa" to "quantprep_cpu", and its KV caches
    to GrowingLayers. False, nothing changed: another attention or dtype, no C compiler, or a model
    whose attention transformers cannot switch."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa" or model.dtype != torch.bfloat16 or kernel() is None:
        return False
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:  # transformers only warns for a model it cannot switch
        return False
    model.register_forward_pre_hook(grow_in_place, with_kwargs=True)
    return True
