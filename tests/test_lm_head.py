"""`--lm-head int8|int4` (build/lm_head.py): the float lm_head rounded at build time, opted into,
recorded in the manifest, and run by the targets' int8 and int4 kernels.

Tolerances: the module against torch's own rounding of the same weight (float64): 1e-2 (bfloat16
activations, output and, for int4, the stored scales: ~0.4% a value); the whole model against the
float-head artifact: int8 3e-2 on the logits (its step is 1/127 of a row's max, ~0.3% a weight on
these random weights) and top-1 >= 0.9; int4 0.15 (a step of 1/15 of a group's range, ~0.36 of a
Gaussian weight's deviation: ~10% a logit) and top-1 >= 0.6.
"""

import pytest
import torch
from conftest import TINY_LLAMA, one_line_error, rel_err, top1
from safetensors import safe_open

import quantprep
from quantprep.build.lm_head import QUANTIZED_BY
from quantprep.build.pipeline import prepack
from quantprep.build.synthetic import write_random_checkpoint
from quantprep.cli import main
from quantprep.errors import RecipeError
from quantprep.format.artifact import read_manifest
from quantprep.targets.cpu import CpuInt4Linear
from quantprep.targets.packed import Int8PerChannelLinear


def _stored(art) -> set[str]:
    keys = set()
    for f in art.glob("*.safetensors"):
        with safe_open(f, framework="pt") as s:
            keys |= set(s.keys())
    return keys


def _rounded(w: torch.Tensor, choice: str) -> torch.Tensor:
    """The float64 weight each choice's rounding gives, by tensor ops (independent of build/lm_head.py)."""
    if choice == "int8":
        s = (w.abs().amax(1, keepdim=True) / 127).to(torch.bfloat16).double()
        return (w / s).round().clamp(-127, 127) * s
    g = w.view(w.shape[0], -1, 128)
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    s = (hi - lo) / 15
    z = (-lo / s).round().clamp(0, 15)
    return (((g / s).round() + z).clamp(0, 15) - z).mul(s).view_as(w)


@pytest.mark.parametrize("choice,logits_tol,top1_min", [("int8", 3e-2, 0.9), ("int4", 0.15, 0.6)])
@pytest.mark.parametrize("tied", [True, False])
def test_the_head_is_the_rounded_float_head(tmp_path, tied, choice, logits_tol, top1_min):
    config = dict(TINY_LLAMA, tie_word_embeddings=tied, hidden_size=128)  # int4: whole groups of 128
    gptq = write_random_checkpoint(tmp_path / "gptq", config, group_size=64)
    float_art, head_art = tmp_path / "float", tmp_path / choice
    prepack(gptq, "cpu", float_art)
    prepack(gptq, "cpu", head_art, lm_head=choice)
    meta = read_manifest(head_art)["modules"]["lm_head"]
    assert meta["quantized_by"] == QUANTIZED_BY[choice] and meta["bits"] == int(choice[3:])
    assert "lm_head" not in read_manifest(float_art)["modules"]
    assert "lm_head.weight" not in _stored(head_art) and "model.embed_tokens.weight" in _stored(head_art)

    ref_model, model = quantprep.load(float_art), quantprep.load(head_art)
    head = model.get_output_embeddings()
    assert isinstance(head, Int8PerChannelLinear if choice == "int8" else CpuInt4Linear)
    with safe_open(gptq / "model.safetensors", framework="pt") as f:  # the float head as the build read it
        w = f.get_tensor("model.embed_tokens.weight" if tied else "lm_head.weight").double()
    assert torch.equal(model.get_input_embeddings().weight, ref_model.get_input_embeddings().weight)
    x = torch.randn(8, w.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(head(x.bfloat16()), x.double() @ _rounded(w, choice).T) < 1e-2
        ids = torch.randint(0, config["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(1))
        logits, ref_logits = model(ids).logits[0], ref_model(ids).logits[0]
    assert rel_err(logits, ref_logits) < logits_tol and top1(logits, ref_logits) >= top1_min


@pytest.mark.parametrize("choice", ["int8", "int4"])
def test_the_head_s_gptq_words_hold_its_codes(choice):
    """The layer's qweight is GPTQ's packing of the same codes (the cpu target packs from the
    words, others from the codes), rows converted a block at a time."""
    from quantprep.build.lm_head import round_to_int4, round_to_int8

    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    layer = (round_to_int8 if choice == "int8" else round_to_int4)(w, rows=32)
    codes = layer.codes
    assert torch.equal(layer.unpack_codes(), codes) and codes.shape == (256, 96)
    assert torch.allclose(layer.dequantize().T.double(), _rounded(w.double(), choice), rtol=1e-5, atol=1e-6)


def test_a_head_that_is_gptq_s_already_or_an_unknown_choice_is_refused(tmp_path):
    gptq = write_random_checkpoint(tmp_path / "gptq", TINY_LLAMA, group_size=64, lm_head=True)
    with pytest.raises(RecipeError, match="already quantized"):
        prepack(gptq, "cpu", tmp_path / "a", lm_head="int8")
    with pytest.raises(RecipeError, match="expected one of float, int8, int4"):
        prepack(gptq, "cpu", tmp_path / "b", lm_head="int2")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_cli_refuses_int8_head_for_openvino_in_one_line(tmp_path, capsys):
    gptq = write_random_checkpoint(tmp_path / "gptq", TINY_LLAMA, group_size=64)
    assert main(["prepack", str(gptq), "--target", "openvino", "--out", str(tmp_path / "ov"), "--lm-head", "int8"]) == 2
    assert "openvino target keeps the checkpoint's lm_head" in one_line_error(capsys)
    assert not (tmp_path / "ov").exists()


def test_a_recipe_asks_for_the_head_and_the_cli_s_option_wins(tmp_path):
    """`lm_head` in a recipe's [build] reaches the artifact; --lm-head overrides it."""
    from quantprep.build.recipes import parse_recipe

    gptq = write_random_checkpoint(tmp_path / "gptq", dict(TINY_LLAMA, hidden_size=128), group_size=64)
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "r"\n[source]\npath = "{gptq}"\n[build]\ntargets = ["cpu"]\nlm_head = "int4"\n')
    assert parse_recipe(recipe).lm_head == "int4"
    for extra, want in (([], "int4"), (["--lm-head", "int8"], "int8")):
        out = tmp_path / f"out-{want}"
        assert main(["build", str(recipe), "--out", str(out), "--no-check", "--no-warm", *extra]) == 0
        assert read_manifest(out / "cpu")["modules"]["lm_head"]["quantized_by"] == QUANTIZED_BY[want]
