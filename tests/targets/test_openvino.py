"""openvino target, one layer (issue 31): a GPTQ layer as an OpenVINO compressed weight, run by
OpenVINO's CPU plugin in f32 with dynamic quantization off, against an independent reference:
the dense weight dequantized straight from the on-disk tensors by g_idx, row by row (no act-order
permutation involved), in float64.

Tolerance: relative error 1e-5. The only rounding is float32 accumulation and f16 scales, which
GPTQ stores in f16 already (measured 2e-7 to 1e-6); a wrong group, permutation, nibble order or zero
point gives 0.1 or more (optimum-intel's act-order export: 0.70).
"""

import numpy as np
import pytest
import torch

from quantprep.build.prepack import prepare_layer
from quantprep.build.source import QuantConfig, _validate_layer
from quantprep.build.synthetic import random_gptq_tensors
from quantprep.format.gptq import unpack_cols, unpack_rows, v1_to_v2_qzeros

ov = pytest.importorskip("openvino", reason="the openvino extra (make setup installs it)")

CASES = [  # K, N, bits, group, sym, act_order, v1, bias
    (256, 96, 4, 128, True, True, True, False),
    (256, 96, 4, 128, False, True, True, True),
    (256, 96, 4, 64, False, False, False, False),
    (256, 96, 4, 32, True, False, False, True),
    (256, 96, 4, -1, False, True, True, False),
    (160, 64, 4, 64, False, True, True, False),  # a partial last group
    (256, 96, 8, 128, True, True, True, False),
    (256, 96, 8, 32, False, True, False, True),
]


def dense_reference(raw: dict, bits: int, v1: bool) -> np.ndarray:
    """W [K, N] float64: w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]. v1 zeros are read
    as GPTQModel reads them (its offset added to the packed words: format/gptq.py)."""
    q = unpack_rows(raw["qweight"], bits).double()
    z = unpack_cols(v1_to_v2_qzeros(raw["qzeros"], bits) if v1 else raw["qzeros"], bits)[:, : q.shape[1]]
    g = raw["g_idx"].long()
    return ((q - z.double()[g]) * raw["scales"].double()[g]).numpy()


def run(layer, x: np.ndarray) -> tuple[np.ndarray, object]:
    import openvino.opset13 as ops

    from quantprep.targets.openvino import TARGET, constants, linear

    tensors, meta = TARGET.pack(layer, torch.float32)
    param = ops.parameter([-1, layer.in_features], ov.Type.f32, name="x")
    model = ov.Model([linear(param, constants(tensors, meta, "m"), meta)], [param])
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"})
    return compiled(x)[0], compiled


@pytest.mark.parametrize("K,N,bits,group,sym,act_order,v1,bias", CASES)
def test_a_gptq_layer_runs_compressed_and_right_in_the_cpu_plugin(K, N, bits, group, sym, act_order, v1, bias):
    gen = torch.Generator().manual_seed(K + N + bits + group)
    raw = random_gptq_tensors(K, N, bits, group, sym, act_order, v1, bias=bias, generator=gen)
    layer = prepare_layer(_validate_layer("m", raw, QuantConfig(bits, group, sym, act_order, "gptq" if v1 else "gptq_v2")))
    assert (layer.perm is not None) == (act_order and group != -1)  # the case exercises the permutation it says (one group: none)
    x = torch.randn(5, K, generator=gen).numpy()
    y, compiled = run(layer, x)
    ref = x.astype(np.float64) @ dense_reference(raw, bits, v1)
    if bias:
        ref += raw["bias"].double().numpy()
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < 1e-5, rel
    assert (y.argmax(-1) == ref.argmax(-1)).all()
    # kept compressed: the plugin's runtime graph still holds the integer weight
    kinds = {str(op.get_output_element_type(0)) for op in compiled.get_runtime_model().get_ops()}
    assert kinds & {"<Type: 'uint4_t'>", "<Type: 'int4_t'>", "<Type: 'uint8_t'>", "<Type: 'int8_t'>", "u4", "i4", "u8", "i8"}, kinds


def test_a_v1_zero_point_of_0_is_read_as_gptqmodel_reads_it():
    """v1 stores zero-1 packed in int32 words; a zero of 0 borrows from the next nibble, so reading
    nibbles one by one (+1 each) gets the layer wrong (the issue measured 0.30 for optimum-intel)."""
    gen = torch.Generator().manual_seed(7)
    raw = random_gptq_tensors(256, 96, 4, 64, False, False, True, generator=gen)
    zeros = unpack_cols(v1_to_v2_qzeros(raw["qzeros"], 4), 4)
    assert (zeros == 0).float().mean() > 0.03  # the case holds zeros of 0
    layer = prepare_layer(_validate_layer("m", raw, QuantConfig(4, 64, False, False, "gptq")))
    x = torch.randn(5, 256, generator=gen).numpy()
    ref = x.astype(np.float64) @ dense_reference(raw, 4, v1=True)
    y, _ = run(layer, x)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5
    nibblewise = (unpack_cols(raw["qzeros"], 4) + 1) & 0xF  # the reading that ignores the borrow
    assert (nibblewise != zeros).any()


@pytest.mark.parametrize("sym", [True, False])
def test_the_contiguous_group_reading_is_measurably_wrong_where_ours_is_right(sym):
    """optimum-intel's GPTQ export and OpenVINO's PyTorch frontend read group g as the K rows
    g*gs..(g+1)*gs in checkpoint order and never read g_idx. The same layer through that reading
    (no permutation: codes in checkpoint order, row k in group k // gs) against ours, on an
    act-order checkpoint, both in the CPU plugin against the dense reference by g_idx. Measured
    (2026-11-25): 0.61 sym and 1.07 asym for the contiguous reading, 4e-7 for ours (the issue: 0.70, 1.21)."""
    import dataclasses

    gen = torch.Generator().manual_seed(3 + sym)
    raw = random_gptq_tensors(512, 128, 4, 128, sym, True, True, generator=gen)
    layer = prepare_layer(_validate_layer("m", raw, QuantConfig(4, 128, sym, True, "gptq")))
    x = torch.randn(8, 512, generator=gen).numpy()
    ref = x.astype(np.float64) @ dense_reference(raw, 4, v1=True)
    ours, _ = run(layer, x)
    contiguous, _ = run(dataclasses.replace(layer, perm=None), x)
    rel = lambda y: np.linalg.norm(y - ref) / np.linalg.norm(ref)  # noqa: E731
    assert rel(ours) < 1e-5 and rel(contiguous) > 0.3, (rel(ours), rel(contiguous))
