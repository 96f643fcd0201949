"""`--lm-head int8` (build/lm_head.py): the float lm_head rounded to int8 per output channel at build
time, opted into, recorded in the manifest, and run by the targets' per-channel int8 kernels.

Tolerances: the module against torch's own rounding of the same weight (float64): 1e-2 (bfloat16
activations and output, ~0.4% a value); the whole model against the float-head artifact: 3e-2 on
the logits (int8 rounding of the head, ~0.3% a weight on these random weights) and top-1 >= 0.9.
"""

import pytest
import torch
from conftest import TINY_LLAMA, one_line_error, rel_err, top1
from safetensors import safe_open

import quantprep
from quantprep.build.pipeline import prepack
from quantprep.build.synthetic import write_random_checkpoint
from quantprep.cli import main
from quantprep.errors import RecipeError
from quantprep.format.artifact import read_manifest
from quantprep.targets.common import Int8PerChannelLinear


def _stored(art) -> set[str]:
    keys = set()
    for f in art.glob("*.safetensors"):
        with safe_open(f, framework="pt") as s:
            keys |= set(s.keys())
    return keys


@pytest.mark.parametrize("tied", [True, False])
def test_int8_head_is_the_rounded_float_head(tmp_path, tied):
    gptq = write_random_checkpoint(tmp_path / "gptq", dict(TINY_LLAMA, tie_word_embeddings=tied), group_size=64)
    float_art, int8_art = tmp_path / "float", tmp_path / "int8"
    prepack(gptq, "cpu", float_art)
    prepack(gptq, "cpu", int8_art, lm_head="int8")
    meta = read_manifest(int8_art)["modules"]["lm_head"]
    assert meta["quantized_by"] == "quantprep:rtn-int8-per-channel" and meta["bits"] == 8
    assert "lm_head" not in read_manifest(float_art)["modules"]
    assert "lm_head.weight" not in _stored(int8_art) and "model.embed_tokens.weight" in _stored(int8_art)

    ref_model, model = quantprep.load(float_art), quantprep.load(int8_art)
    head = model.get_output_embeddings()
    assert isinstance(head, Int8PerChannelLinear)
    w = ref_model.get_output_embeddings().weight.detach().double()  # [vocab, hidden], the float head
    assert torch.equal(model.get_input_embeddings().weight, ref_model.get_input_embeddings().weight)
    s = (w.abs().amax(1, keepdim=True) / 127).to(torch.bfloat16).double()
    x = torch.randn(8, w.shape[1], generator=torch.Generator().manual_seed(0))
    ref = x.double() @ ((w / s).round().clamp(-127, 127) * s).T
    with torch.no_grad():
        assert rel_err(head(x.bfloat16()), ref) < 1e-2
        ids = torch.randint(0, TINY_LLAMA["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(1))
        logits, ref_logits = model(ids).logits[0], ref_model(ids).logits[0]
    assert rel_err(logits, ref_logits) < 3e-2 and top1(logits, ref_logits) >= 0.9


def test_the_head_s_gptq_words_hold_its_codes():
    """The layer's qweight is GPTQ's 8-bit packing of the same codes (a target may read either)."""
    from quantprep.build.lm_head import round_to_int8

    layer = round_to_int8(torch.randn(96, 40, generator=torch.Generator().manual_seed(0)), rows=32)
    codes = layer.codes
    assert torch.equal(layer.unpack_codes(), codes) and codes.shape == (40, 96)


def test_a_head_that_is_gptq_s_already_or_an_unknown_choice_is_refused(tmp_path):
    gptq = write_random_checkpoint(tmp_path / "gptq", TINY_LLAMA, group_size=64, lm_head=True)
    with pytest.raises(RecipeError, match="already quantized"):
        prepack(gptq, "cpu", tmp_path / "a", lm_head="int8")
    with pytest.raises(RecipeError, match="expected one of float, int8"):
        prepack(gptq, "cpu", tmp_path / "b", lm_head="int4")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_cli_refuses_int8_head_for_openvino_in_one_line(tmp_path, capsys):
    gptq = write_random_checkpoint(tmp_path / "gptq", TINY_LLAMA, group_size=64)
    assert main(["prepack", str(gptq), "--target", "openvino", "--out", str(tmp_path / "ov"), "--lm-head", "int8"]) == 2
    assert "openvino target keeps the checkpoint's lm_head" in one_line_error(capsys)
    assert not (tmp_path / "ov").exists()
