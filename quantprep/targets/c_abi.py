"""The Python side of quantprep's C kernels' ABI: quantprep/csrc/quantprep.h declares the structs and
every exported function once, and this module mirrors them for ctypes. tests/test_csrc.py checks
the mirror against the header: the structs' field offsets and sizes as the compiler lays them out,
and each prototype's argument and return types. c_library.library sets these signatures on each
library it loads. No torch here: targets/cpu.py and runtime/cpu_attention.py and cpu_layers.py call
the kernels on torch's tensors, runtime/engine.py on numpy arrays.
"""

from __future__ import annotations

import ctypes

MAX_HEAD_DIM = 256  # quantprep.h's MAX_D: attention and the rotary embedding keep a row on the stack
ROUTER_TIE = 1  # quantprep.h's: decode_layer's status where the router's top-k met equal probabilities at its last


class QuantLinearArgs(ctypes.Structure):
    """quantprep.h's QuantLinear: one projection's kernel arguments (C's `in` is `in_features` here)."""
    _fields_ = [("perm", ctypes.c_void_p), ("qweight", ctypes.c_void_p), ("scales_and_zeros", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)] + [(f, ctypes.c_int64) for f in ("in_features", "padded_in", "out", "group", "block")]


class DecodeLayerArgs(ctypes.Structure):
    """quantprep.h's DecodeLayer."""
    _fields_ = [(f, ctypes.c_void_p) for f in ("matmul", "attention", "experts_matmul", "norm1", "norm2", "q_norm", "k_norm")] + \
        [(f, ctypes.c_float) for f in ("eps1", "eps2", "q_eps", "k_eps", "scaling")] + \
        [(f, ctypes.c_int64) for f in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "window")] + \
        [(f, QuantLinearArgs) for f in ("qkv", "o", "gate_up", "down")] + \
        [(f, ctypes.c_void_p) for f in ("router", "experts_gate_up", "experts_down", "chosen", "chosen_weights", "routed", "logits")] + \
        [(f, ctypes.c_int64) for f in ("experts", "top_k", "renormalize", "round_weights")]


P, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
LAYER = ctypes.POINTER(DecodeLayerArgs)

# Per file of quantprep/csrc, each function it exports: (return type, argument types), as quantprep.h declares them
SIGNATURES = {
    "pack": {"pack_int4_cpu": (None, [P, P, I64, I64, I64, P])},
    "dequant": {"dequant_int4_cpu": (INT, [P, P, P, INT] + [I64] * 8 + [INT, P, INT])},
    "a8": {
        "a8_block": (INT, []),
        "a8_ahead": (INT, []),
        "int4_a8_cpu": (INT, [P, I64, I64, P, I64, P, P] + [I64] * 4 + [P, I64, INT]),
        "int8_a8_cpu": (INT, [P, I64, I64, P, P, I64, I64, P, I64, INT]),
    },
    "gemv": {
        "int4_gemv_rows": (INT, [P, P, I64, I64, P, I64, INT]),
        "int4_gemv_cpu": (INT, [P, I64, I64, P, I64, P, P] + [I64] * 4 + [P, I64, INT]),
    },
    "attention": {"decode_attention": (INT, [P, I64, I64, P, I64, I64, I64, P, I64, I64, I64, P] + [I64] * 5 + [F32])},
    "layers": {
        "gemv_bf16": (INT, [P, P, P, I64, I64]),
        "rms_norm": (None, [P, I64, P, P, I64, I64, I64, F32]),
        "qk_norm": (None, [P] + [I64] * 5 + [P, P, F32, F32]),
        "rotary": (None, [P] + [I64] * 4 + [P, P]),
        "silu_mul": (None, [P, I64, P, I64, I64, I64]),
        "layer_rows": (INT, [LAYER, P, I64] + [P] * 5 + [I64, I64, INT]),
        "decode_layer": (INT, [LAYER] + [P] * 6 + [I64, I64, INT]),
        "sparse_experts": (INT, [LAYER, P, INT]),
    },
}


def declare(lib: ctypes.CDLL, name: str) -> ctypes.CDLL:
    """`lib`, a build of csrc/<name>.c, with its functions' C signatures set."""
    for function, (restype, argtypes) in SIGNATURES[name].items():
        fn = getattr(lib, function)
        fn.restype, fn.argtypes = restype, argtypes
    return lib
