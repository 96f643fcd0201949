"""Phi-3 and GLM-4 (issue 54, item 2): the transformers model has one `gate_up_proj` Linear (Phi-3 also
one `qkv_proj`), gptqmodel writes `gate_proj` and `up_proj` apart (Phi-3's qkv_proj whole; GLM-4's
q/k/v apart, as its model has them). Prepack concatenates the members into the model's own Linear,
in the model's order ([gate; up]), and load puts the prepacked module in its place: no split.

Each model is made tiny (hidden 128, 2 layers, seeded), quantized by the real gptqmodel inside
`quantprep build` (int4, group 32, act-order; targets cpu and xpu), once per module. References:
the same checkpoint dequantized into the model as gptqmodel's own defuser splits it (gate_proj and
up_proj as two dense Linears, its forward): it shares no code with quantprep's fusion, so a wrong
member order shows. Compared: the last prompt position's logits and one decode step's, 8 prompts.

Bounds (relative error of those 16 rows of logits, top-1 agreement); measured 2026-11-28 on 2 AVX2
cores, the worst of Phi-3 and GLM-4 in brackets:
- cpu float32 artifact: rel < 1e-5 [7.1e-7], top-1 1.0 [1.0]: the same math, summation order aside.
- cpu bfloat16 (the default): rel < 3e-2 [9.5e-3], top-1 >= 0.85 [0.938: one near-tie of 16 flips]:
  bf16 activations through every layer.
- xpu float16 through the CPU emulator: rel < 5e-3 [9.6e-4], top-1 >= 0.9 [1.0].
Phi-3 prepacked with up where gate belongs: rel 0.09 in all three, top-1 0.75.
(GPTQModel's own runtime: tests/test_architectures.py compares every target with it, on Phi-3 and
GLM-4 checkpoints gptqmodel wrote.)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import dense_reference_model, edit_manifest, make_tiny_float_model, rel_err, top1

import quantprep
from quantprep.build.pipeline import prepack
from quantprep.errors import ArtifactError, SourceError
from quantprep.targets.packed import PackedLinear

MODELS = {"phi3": {}, "glm4": {"head_dim": 32}}  # GLM-4's default head_dim is 128
RECIPE = """name = "tiny-{model}"
[source]
path = "{src}"
[quantize]
group_size = 32
[build]
targets = ["cpu", "xpu"]
prompt = "the"
max_new_tokens = 4
[warm]
shapes = [16]
"""
BOUNDS = {"cpu-float32": (1e-5, 1.0), "cpu": (3e-2, 0.85), "xpu": (5e-3, 0.9)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def built(request, tmp_path_factory):
    """`quantprep build` of a tiny float model (gptqmodel quantizes it, int4 g32 act-order, sym),
    cpu and xpu, warmed and checked as build does: (model type, GPTQ checkpoint, artifacts by name,
    the build's JSON). Plus a float32 cpu artifact of the same checkpoint."""
    model_type, root = request.param, tmp_path_factory.mktemp(request.param)
    src = make_tiny_float_model(root / "float", model_type=model_type, intermediate_size=256, tie_word_embeddings=False,
                                **MODELS[model_type])
    recipe = root / "recipe.toml"
    recipe.write_text(RECIPE.format(model=model_type, src=src))
    env = {**os.environ, "QUANTPREP_CACHE": str(root / "cache")}
    proc = subprocess.run([sys.executable, "-m", "quantprep", "build", str(recipe), "--out", str(root / "art"), "--json"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [gptq] = [p.parent for p in (root / "cache" / "gptq").glob("*/quantize_config.json")]
    prepack(gptq, "cpu", root / "art" / "cpu-float32", "float32")
    arts = {name: root / "art" / name for name in ("cpu", "xpu", "cpu-float32")}
    return model_type, gptq, arts, json.loads(proc.stdout)


def defused_dense(gptq: Path):
    """The checkpoint's weights dequantized (float32) into the model after gptqmodel's defuser has split
    each gate_up_proj into gate_proj and up_proj (its own split and forward, as GPTQModel loads them)."""
    from defuser.modeling.runtime_defusion import patch_split_gate_up_mlp
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantprep.build.prepack import prepare_layer
    from quantprep.build.source import read_checkpoint

    config = AutoConfig.from_pretrained(gptq)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert sum(patch_split_gate_up_mlp(m) for m in list(model.modules()) if hasattr(m, "gate_up_proj")) == 2
    ckpt, params = read_checkpoint(gptq), dict(model.named_parameters())
    with torch.no_grad():
        tensors = {k: ckpt.other_tensors[k] for k in ckpt.other_tensors}
        for name in ckpt.layers:
            layer = ckpt.layers[name]
            tensors[f"{name}.weight"] = prepare_layer(layer).dequantize().T
            if layer.bias is not None:
                tensors[f"{name}.bias"] = layer.bias
        assert tensors.keys() == params.keys()
        for k, t in tensors.items():
            params[k].copy_(t)
    return model.eval()


def last_and_decode(model, ids: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The logits of the prompt's last position and of one decode step (`step`, through the cache): [2B, V]."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        nxt = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat([out.logits[:, -1], nxt.logits[:, -1]]).float()


@pytest.fixture(scope="module")
def reference(built):
    _, gptq, _, _ = built
    model = defused_dense(gptq)
    ids = torch.randint(2, model.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        step = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)  # one token for both, the reference's pick
    return ids, step, last_and_decode(model, ids, step)


def test_plan_puts_members_into_the_model_linear_whatever_fuse_says():
    """Phi-3's gate/up and (a checkpoint with them apart) q/k/v go into its gate_up_proj and qkv_proj
    in the model's order, also without fusion; GLM-4's q/k/v, separate in its model, only with it."""
    from quantprep.build.prepack import fusion_plan

    names = [f"model.layers.0.{m}" for m in ("mlp.up_proj", "mlp.gate_proj", "mlp.down_proj", "self_attn.v_proj",
                                              "self_attn.k_proj", "self_attn.q_proj", "self_attn.o_proj")]
    mlp, attn = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"], [f"model.layers.0.self_attn.{c}_proj" for c in "qkv"]
    for fuse in (True, False):
        phi3 = dict(fusion_plan(names, fuse, "phi3"))
        assert phi3["model.layers.0.mlp.gate_up_proj"] == mlp and phi3["model.layers.0.self_attn.qkv_proj"] == attn
        glm4 = dict(fusion_plan(names, fuse, "glm4"))
        assert glm4["model.layers.0.mlp.gate_up_proj"] == mlp
        assert ("model.layers.0.self_attn.qkv_proj" in glm4) == fuse and ("model.layers.0.self_attn.q_proj" in glm4) != fuse
    assert all(len(m) == 1 for _, m in fusion_plan(names, False, "qwen2"))


def test_build_fuses_into_the_model_linear(built):
    """`quantprep build` (quantize, prepack, warm, a fresh-process generate) works; the manifest has the
    model's gate_up_proj (members in the model's order), never gate_proj or up_proj; verify passes."""
    from quantprep.tools.verify import verify_artifact

    model_type, _, arts, results = built
    assert [r["target"] for r in results] == ["cpu", "xpu"] and all(r["layers"] == 8 for r in results)  # qkv, o, gate_up, down x 2
    assert results[0]["check"]["completion"] and results[0]["warm"]["shapes"] == [16]
    for name in ("cpu", "xpu"):
        modules = json.loads((arts[name] / "manifest.json").read_text())["modules"]
        assert modules["model.layers.1.mlp.gate_up_proj"]["fused"] == {"members": ["gate_proj", "up_proj"], "sizes": [256, 256]}
        assert not any(n.rpartition(".")[2] in ("gate_proj", "up_proj") for n in modules)
        qkv = modules["model.layers.0.self_attn.qkv_proj"]
        assert qkv.get("fused") == ({"members": ["q_proj", "k_proj", "v_proj"], "sizes": [128, 64, 64]} if model_type == "glm4" else None)
        report = verify_artifact(arts[name])
        assert report["numeric"] == "passed" and all(r["ok"] for r in report["probes"]), report


@pytest.mark.parametrize("art", sorted(BOUNDS))
def test_logits_match_the_defused_reference(built, reference, art):
    _, _, arts, _ = built
    ids, step, want = reference
    got = last_and_decode(quantprep.load(arts[art], device="cpu"), ids, step)  # xpu: the CPU emulator
    measured = (rel_err(got, want), top1(got, want))
    print(f"{built[0]} {art}: rel {measured[0]:.2e}, top-1 {measured[1]:.3f}")
    assert measured[0] < BOUNDS[art][0] and measured[1] >= BOUNDS[art][1], measured


def test_loaded_model_holds_the_prepacked_module_itself(built):
    """The model's gate_up_proj (and Phi-3's qkv_proj) is the target's module: no members, no split;
    GLM-4's separate q/k/v keep today's fusion (members served from one matmul)."""
    from quantprep.runtime.fused import FusedMember

    model_type, _, arts, _ = built
    model = quantprep.load(arts["cpu"])
    for layer in model.model.layers:
        assert isinstance(layer.mlp.gate_up_proj, PackedLinear) and layer.mlp.gate_up_proj.parts == ()
        assert not hasattr(layer.mlp, "gate_proj") and not hasattr(layer.mlp, "up_proj")
        attn = layer.self_attn
        assert isinstance(attn.qkv_proj, PackedLinear)
        assert isinstance(getattr(attn, "q_proj", None), FusedMember) == (model_type == "glm4")


def test_no_fuse_still_fuses_what_the_model_has_fused(built, reference, tmp_path):
    """--no-fuse: GLM-4's q/k/v stay apart, gate/up still go into the model's gate_up_proj (it has no others)."""
    model_type, gptq, _, _ = built
    ids, step, want = reference
    prepack(gptq, "cpu", tmp_path / "plain", "float32", fuse=False)
    modules = json.loads((tmp_path / "plain" / "manifest.json").read_text())["modules"]
    assert modules["model.layers.0.mlp.gate_up_proj"]["fused"]["members"] == ["gate_proj", "up_proj"]
    assert ("model.layers.0.self_attn.q_proj" in modules) == (model_type == "glm4")
    got = last_and_decode(quantprep.load(tmp_path / "plain"), ids, step)
    assert rel_err(got, want) < BOUNDS["cpu-float32"][0] and top1(got, want) == 1.0


def test_dequantized_reference_fills_the_fused_linear(built, reference):
    """`quantprep eval`'s dequantized reference (tools/eval.py) builds these models: the same logits as
    the defused one."""
    _, gptq, _, _ = built
    ids, step, want = reference
    got = last_and_decode(dense_reference_model(gptq), ids, step)
    assert rel_err(got, want) < 1e-6 and torch.equal(got.argmax(-1), want.argmax(-1))


def _different_act_order(gptq: Path, out: Path) -> Path:
    """A copy whose layer-1 up_proj has another (valid) g_idx than its gate_proj: two inputs of
    different groups swapped."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(gptq, out)
    t = load_file(out / "model.safetensors")
    g = t["model.layers.1.mlp.up_proj.g_idx"]
    i, j = 0, int((g != g[0]).nonzero()[0])
    g[i], g[j] = g[j].clone(), g[i].clone()
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_members_that_cannot_fuse_exactly_are_refused(built, tmp_path, monkeypatch, capsys):
    """gptqmodel gives gate and up one g_idx (act-order sorts the diagonal of their one input's
    Hessian); a checkpoint where they differ cannot go into the model's one Linear exactly: refused in
    one line before any work (check_against_model), and by prepack itself if it got that far."""
    from quantprep.build import pipeline
    from quantprep.build.source import check_against_model, read_checkpoint
    from quantprep.cli import main

    _, gptq, _, _ = built
    bad = _different_act_order(gptq, tmp_path / "bad")
    with pytest.raises(SourceError, match=r"mlp\.gate_up_proj, but their act-order \(g_idx\).*differ"):
        check_against_model(read_checkpoint(bad))
    assert main(["prepack", str(bad), "--target", "cpu", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be concatenated exactly" in err[0] and not (tmp_path / "out").exists(), err
    monkeypatch.setattr(pipeline, "check_against_model", lambda ckpt: None)
    with pytest.raises(SourceError, match="cannot be concatenated exactly"):
        prepack(bad, "cpu", tmp_path / "out2")


def test_member_order_other_than_the_model_is_refused_at_load(built, copy_of):
    _, _, arts, _ = built
    art = copy_of(arts["cpu-float32"])
    edit_manifest(art, lambda m: m["modules"]["model.layers.0.mlp.gate_up_proj"]["fused"].update(members=["up_proj", "gate_proj"]))
    with pytest.raises(ArtifactError, match=r"gate_up_proj: members \['up_proj', 'gate_proj'\].*rebuild the artifact"):
        quantprep.load(art)
