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
