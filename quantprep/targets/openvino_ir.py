"""GPTQ layers as OpenVINO compressed weights: the integers as they are, act-order right (issue 31).

OpenVINO's plugins keep a weight compressed when it reaches the MatMul through
Convert -> Subtract(zero point) -> Multiply(scale) -> Reshape -> Convert(f32); a Convert to f32
before the Reshape gets the weight folded to f32 (branch openvino-groundwork, README). A GPTQ
layer maps onto that pattern without requantizing:

- the codes [K, N] in act-order (a PrepackLayer's: row k belongs to group k // group_size) become
  the weight [N, G, gs]: u4 (two codes a byte, low nibble first) or u8;
- zeros and scales [G, N] become [N, G, 1], one per group. Never per element ([N, K], a gather by
  g_idx inside the weight): the CPU plugin computes those wrong, or crashes;
- a symmetric layer (every zero 2^(bits-1)) becomes i4/i8 holding code - zero, with no Subtract: a
  relabelling of the same integers;
- the activation takes a Gather with the act-order permutation, x @ W = x[:, perm] @ W_perm
  (optimum-intel's export and OpenVINO's PyTorch frontend read groups as contiguous and skip this);
- a partial last group: K padded with zero codes up to G * gs, the activation with zeros.

openvino is imported by this module only, and only when it is used.
"""

from __future__ import annotations

import numpy as np

from quantprep.format.gptq import PrepackLayer


def _constant(values: np.ndarray, element_type: str, shape: list[int]):
    """A Constant of `element_type` (u4, i4, u8, i8) from integer values, packed as OpenVINO stores them."""
    import openvino as ov

    if element_type in ("u4", "i4"):
        nibbles = (values.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
        packed = nibbles[0::2] | (nibbles[1::2] << 4)  # low nibble = the even element
        data = ov.Tensor(np.ascontiguousarray(packed), ov.Shape(shape), getattr(ov.Type, element_type))
    else:
        data = ov.Tensor(np.ascontiguousarray(values.reshape(shape).astype(np.uint8 if element_type == "u8" else np.int8)))
    # shared_memory=False: a Constant sharing this function's temporary buffer reads freed memory
    return ov.op.Constant(data, shared_memory=False)


def weight(layer: PrepackLayer):
    """The layer's weight as an f32 [N, G * gs] node that decompresses its integers, K in act-order."""
    import openvino as ov
    import openvino.opset13 as ops

    K, N, gs = layer.in_features, layer.out_features, layer.group_size
    G = layer.zeros.shape[0]
    if G * gs < K:
        raise ValueError(f"{layer.name}: {G} groups of {gs} do not cover K={K}")
    codes = np.zeros((N, G * gs), dtype=np.int16)
    codes[:, :K] = layer.codes.numpy().T  # padded rows: code 0 times a real group's scale, against zero activations
    zeros = layer.zeros.numpy().T.astype(np.int16)  # [N, G]
    half = 1 << (layer.bits - 1)
    kind = "4" if layer.bits == 4 else "8"
    scale = ov.op.Constant(ov.Tensor(np.ascontiguousarray(layer.scales.float().numpy().T.reshape(N, G, 1).astype(np.float16))),
                           shared_memory=False)
    if (zeros == half).all():  # symmetric: signed codes, no zero point
        w = ops.convert(_constant(codes - half, "i" + kind, [N, G, gs]), ov.Type.f16)
    else:
        w = ops.subtract(ops.convert(_constant(codes, "u" + kind, [N, G, gs]), ov.Type.f16),
                         ops.convert(_constant(zeros, "u" + kind, [N, G, 1]), ov.Type.f16))
    w = ops.reshape(ops.multiply(w, scale), ops.constant(np.array([N, G * gs], dtype=np.int64)), False)
    return ops.convert(w, ov.Type.f32)


def linear(x, layer: PrepackLayer):
    """x [..., K] (f32) @ the layer's weight, + bias: the activation gathered into act-order and
    padded to whole groups."""
    import openvino.opset13 as ops

    pad = layer.zeros.shape[0] * layer.group_size - layer.in_features
    if layer.perm is not None:
        x = ops.gather(x, ops.constant(layer.perm.numpy().astype(np.int64)), ops.constant(np.int64(-1)))
    if pad:
        shape = x.get_output_partial_shape(0) if hasattr(x, "get_output_partial_shape") else x.get_partial_shape()
        rank = shape.rank.get_length()
        x = ops.pad(x, ops.constant(np.zeros(rank, dtype=np.int64)), ops.constant(np.array([0] * (rank - 1) + [pad], dtype=np.int64)),
                    "constant")
    y = ops.matmul(x, weight(layer), False, True)
    if layer.bias is not None:
        y = ops.add(y, ops.constant(layer.bias.float().numpy()))
    return y
