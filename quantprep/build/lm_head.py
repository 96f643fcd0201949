"""A quantized lm_head, opted into at build time (`--lm-head int8|int4`, a recipe's `build.lm_head`).

A GPTQ checkpoint's lm_head is usually float, and tied to the embedding (Qwen2.5-1.5B: 467 MB of
bfloat16, read whole for every decoded token: a large share of the cpu artifact's decode,
BENCHMARKS.md, "llama.cpp, the CPU anchor"). This rounds it to nearest, with no calibration:
  - int8: per output channel, symmetric, w = (q - 128) * scale, scale = max|w| / 127 rounded to
    bfloat16 first (so no target's activation dtype rounds it again): the exact case of the
    targets' per-channel int8 kernels;
  - int4: asymmetric in groups of 128 inputs, w = (q - zero) * scale, scale = (max - min) / 15:
    the targets' int4 kernels, a quarter of bfloat16's bytes.
It is quantprep's rounding, not GPTQ's, so it changes the model: never by default, and the
manifest's module says which (`quantized_by`). The embedding stays float.
"""

from __future__ import annotations

import torch

from quantprep.build.source import GPTQCheckpoint
from quantprep.errors import RecipeError
from quantprep.format.gptq import PrepackLayer

CHOICES = ("float", "int8", "int4")
QUANTIZED_BY = {"int8": "quantprep:rtn-int8-per-channel", "int4": "quantprep:rtn-int4-g128-asym"}
INT4_GROUP = 128


def block_rows(K: int, block_bytes: int = 64 << 20) -> int:
    """Rows of the head converted at a time: about `block_bytes` of float32 (and a few temporaries of that size)."""
    return max(1, block_bytes // (4 * K))


def head_weight_key(ckpt: GPTQCheckpoint) -> str:
    """The float tensor the lm_head multiplies by: `lm_head.weight`, or for tied embeddings the one
    [vocab_size, hidden_size] tensor. RecipeError when there is none, or the lm_head is GPTQ's."""
    where = f"{ckpt.path}: --lm-head"
    if "lm_head" in ckpt.layers:
        raise RecipeError(f"{where}: the checkpoint's lm_head is already quantized (GPTQ); build without --lm-head")
    if "lm_head.weight" in ckpt.other_tensors:
        return "lm_head.weight"
    cfg = ckpt.model_config.get("text_config", ckpt.model_config)
    shape = (cfg.get("vocab_size"), cfg.get("hidden_size"))
    if cfg.get("tie_word_embeddings", ckpt.model_config.get("tie_word_embeddings", True)):
        found = [k for k in ckpt.other_tensors if ckpt.other_tensors.shape(k) == shape]
        if len(found) == 1:
            return found[0]
    raise RecipeError(f"{where}: no float lm_head.weight, nor one tied embedding of shape {shape}; build without --lm-head")


def round_to_int8(weight: torch.Tensor, rows: int | None = None) -> PrepackLayer:
    """Float [vocab, hidden] -> the lm_head as a PrepackLayer of 8 bits, one group per column,
    zero 128 (GPTQ's packing: code k of column n at bits 8 * (k % 4) of qweight[k // 4, n]); rows
    converted `rows` at a time (float32 temporaries of a block, not of the whole matrix)."""
    N, K = weight.shape
    rows = rows or block_rows(K)
    if K % 4:
        raise RecipeError(f"--lm-head int8: hidden size {K} is not a multiple of 4")
    codes = torch.empty(K, N, dtype=torch.uint8)
    scales = torch.empty(N, dtype=torch.float32)
    for n0 in range(0, N, rows):
        w = weight[n0:n0 + rows].float()
        s = (w.abs().amax(1) / 127).to(torch.bfloat16).float().clamp_min(torch.finfo(torch.bfloat16).tiny)
        codes[:, n0:n0 + rows] = ((w / s[:, None]).round_().clamp_(-127, 127) + 128).to(torch.uint8).T
        scales[n0:n0 + rows] = s
    if not torch.isfinite(scales).all():
        raise RecipeError("--lm-head int8: the lm_head weight has a non-finite value; build without --lm-head")
    qweight = codes.view(K // 4, 4, N).permute(0, 2, 1).contiguous().view(torch.int32).view(K // 4, N)
    layer = PrepackLayer("lm_head", 8, K, K, N, qweight, torch.full((1, N), 128, dtype=torch.uint8), scales[None], None, None)
    layer.__dict__["codes"] = codes  # already unpacked: the cached property's value
    return layer


def round_to_int4(weight: torch.Tensor, rows: int | None = None) -> PrepackLayer:
    """Float [vocab, hidden] -> the lm_head as a PrepackLayer of 4 bits in groups of INT4_GROUP
    inputs, asymmetric (GPTQ's packing: code k of column n at bits 4 * (k % 8) of qweight[k // 8, n])."""
    N, K = weight.shape
    rows = rows or block_rows(K)
    if K % INT4_GROUP:
        raise RecipeError(f"--lm-head int4: hidden size {K} is not a multiple of {INT4_GROUP}")
    G = K // INT4_GROUP
    codes = torch.empty(K, N, dtype=torch.uint8)
    scales, zeros = torch.empty(G, N, dtype=torch.float32), torch.empty(G, N, dtype=torch.uint8)
    for n0 in range(0, N, rows):
        w = weight[n0:n0 + rows].float().view(-1, G, INT4_GROUP)  # [n, G, group]
        lo, hi = w.amin(-1).clamp_max(0), w.amax(-1).clamp_min(0)  # the range holds 0: zero is a code
        s = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        z = (-lo / s).round().clamp(0, 15)
        q = (w / s[..., None]).round_().add_(z[..., None]).clamp_(0, 15)
        codes[:, n0:n0 + rows] = q.reshape(-1, K).to(torch.uint8).T
        scales[:, n0:n0 + rows], zeros[:, n0:n0 + rows] = s.T, z.T.to(torch.uint8)
    if not torch.isfinite(scales).all():
        raise RecipeError("--lm-head int4: the lm_head weight has a non-finite value; build without --lm-head")
    pairs = codes.view(K // 8, 4, 2, N)
    qweight = (pairs[:, :, 0] | pairs[:, :, 1] << 4).permute(0, 2, 1).contiguous().view(torch.int32).view(K // 8, N)
    layer = PrepackLayer("lm_head", 4, INT4_GROUP, K, N, qweight, zeros, scales, None, None)
    layer.__dict__["codes"] = codes
    return layer


def round_head(weight: torch.Tensor, choice: str) -> PrepackLayer:
    return round_to_int8(weight) if choice == "int8" else round_to_int4(weight)
