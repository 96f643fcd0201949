"""runtime/engine.py: a cpu artifact run by quantprep's C without torch, against quantprep.load's
model with int4_a8 planned for every module (the same kernels behind transformers' code)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import TINY_LLAMA, edit_manifest, random_cpu_artifact, relist
from native_c import require_engine
from test_cpu_layers import TINY_QWEN2

import quantprep
from quantprep.errors import ArtifactError, ArtifactMismatch
from quantprep.runtime import engine
from quantprep.targets.cpu import CpuInt4Linear

require_engine()
PROMPT = [5, 17, 42, 99, 3, 200, 64, 8, 150, 23, 77]


def torch_token_by_token(art, ids: list[int]) -> np.ndarray:
    """quantprep.load's logits after each token, fed one at a time (each step one row: decode_layer
    from the second) with int4_a8 planned for every module."""
    model = quantprep.load(art)
    for m in model.modules():
        if isinstance(m, CpuInt4Linear):
            m.plan, m.plan_max_m = ((1, "int4_a8"),), 1 << 20
    rows, cache = [], None
    with torch.inference_mode():
        for t in ids:
            out = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0, -1].float().numpy())
    return np.stack(rows)


@pytest.mark.parametrize("config", [TINY_QWEN2, TINY_LLAMA, dict(TINY_QWEN2, tie_word_embeddings=True)],
                         ids=["qwen2", "llama", "qwen2-tied"])
def test_native_logits_match_the_torch_models(tmp_path, config):
    """Token by token, the native model's logits are the torch model's (the same C kernels; its rotary
    embedding computed by numpy, not torch: within 1e-2 relative, the same top-1, measured 0 here), and
    the prompt in one call (layer_rows over its rows) gives each position's values of token by token."""
    art = random_cpu_artifact(tmp_path, config, bits=4, group_size=64, desc_act=True, sym=False)
    reference = torch_token_by_token(art, PROMPT)
    model = engine.load(art)
    native = np.stack([model.forward([t]) for t in PROMPT])
    rel = np.linalg.norm(native - reference, axis=1) / np.linalg.norm(reference, axis=1)
    print("relative error per token", rel.max())
    assert rel.max() < 1e-2, rel
    assert (native.argmax(1) == reference.argmax(1)).all()
    model.reset()
    whole = model.forward(PROMPT)
    assert np.array_equal(whole, native[-1])
    model.reset(capacity=2)  # the cache grows past its first capacity as it fills
    assert np.array_equal(model.forward(PROMPT[:4]), native[3]) and np.array_equal(model.forward(PROMPT[4:]), native[-1])
    model.reset()
    tokens = model.generate(PROMPT, 3)
    assert len(tokens) == 3 and tokens[0] == int(native[-1].argmax())


def test_rotary_embedding_is_transformers(tmp_path):
    """cos and sin at positions 0..299 are the bfloat16 values of transformers' default rotary embedding."""
    from transformers import AutoConfig
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    art = random_cpu_artifact(tmp_path, dict(TINY_QWEN2, rope_theta=1e6), bits=4, group_size=64, desc_act=True, sym=False)
    model = engine.load(art)
    model.filled = 0
    cos, sin = model.rotary(300)
    x = torch.zeros(1, 300, 8, dtype=torch.bfloat16)
    ref_cos, ref_sin = Qwen2RotaryEmbedding(AutoConfig.from_pretrained(art))(x, torch.arange(300)[None])
    mismatched = [(cos != ref_cos[0].view(torch.int16).numpy().view(np.uint16)).mean(),
                  (sin != ref_sin[0].view(torch.int16).numpy().view(np.uint16)).mean()]
    assert max(mismatched) < 0.01, mismatched  # float32 cos/sin of numpy and torch may differ in a last bit before rounding


def test_a_fresh_process_imports_no_torch(tmp_path):
    art = random_cpu_artifact(tmp_path, TINY_QWEN2, bits=4, group_size=64, desc_act=True, sym=False)
    code = ("import sys; from quantprep.runtime import engine; m = engine.load(sys.argv[1]); "
            "t = m.generate([1, 2, 3], 4); print(len(t), sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code, str(art)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["4", "[]"], out.stderr[-2000:]


def test_what_it_cannot_run_is_refused_with_one_line(tmp_path):
    """Configs and manifests it cannot run, or that are malformed, or that describe another model
    than the tensors: one line naming the artifact (ArtifactMismatch where quantprep.load may run it)."""
    art = random_cpu_artifact(tmp_path, TINY_QWEN2, bits=4, group_size=64, desc_act=True, sym=False)
    config = json.loads((art / "config.json").read_text())
    manifest = json.loads((art / "manifest.json").read_text())
    qkv = "model.layers.0.self_attn.qkv_proj"

    def fused(order):
        return lambda m: m["modules"][qkv]["fused"].update(members=order)

    for change, edit, error, words in [
            ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, None, ArtifactMismatch, "rotary"),
            ({"architectures": ["GemmaForCausalLM"]}, None, ArtifactMismatch, "GemmaForCausalLM"),
            ({"num_key_value_heads": 3}, None, ArtifactMismatch, "key/value heads"),
            ({"hidden_size": -5}, None, ArtifactError, "hidden_size"),
            ({"rope_scaling": [1], "rope_parameters": None}, None, ArtifactError, "rope_scaling"),
            ({"tie_word_embeddings": 1}, None, ArtifactError, "tie_word_embeddings"),
            ({"rms_norm_eps": 10 ** 400}, None, ArtifactError, "rms_norm_eps"),
            ({"num_hidden_layers": 1, "layer_types": ["full_attention"]}, None, ArtifactMismatch,
             "model.layers.1"),  # the manifest's second layer: refused, not dropped
            ({"num_hidden_layers": 1}, None, ArtifactError, "layer_types"),  # two kinds for one layer: transformers refuses it
            ({}, fused(["q_proj", "v_proj", "k_proj"]), ArtifactMismatch, "fused"),  # C reads q, k, v in order
            ({}, lambda m: m["modules"][qkv].update(bias=False), ArtifactError, "bias"),  # a Qwen2's q/k/v have one
            ({}, lambda m: m["modules"][qkv].update(padded_in=float(m["modules"][qkv]["padded_in"])), ArtifactError, qkv)]:
        (art / "config.json").write_text(json.dumps(dict(config, **change)))
        relist(art, "config.json")
        if edit:
            edit_manifest(art, edit)
        with pytest.raises(error, match=words) as e:
            engine.load(art)
        assert "\n" not in str(e.value) and str(art) in str(e.value)
        (art / "manifest.json").write_text(json.dumps(manifest))
    (art / "config.json").write_text(json.dumps(config))
    relist(art, "config.json")
    engine.load(art)


def test_hostile_tensors_are_refused_before_c_reads_them(tmp_path):
    """A perm that is not a permutation (C gathers x[perm[k]]); a header whose offsets run past the
    file, whose dtype is not a name, whose sizes disagree, or whose data is misaligned; a tensor the
    model does not read: ArtifactError naming the tensor, not a read out of bounds or a traceback."""
    from quantprep.format import safetensors_numpy

    art = random_cpu_artifact(tmp_path, TINY_QWEN2, bits=4, group_size=64, desc_act=True, sym=False)
    shard = art / json.loads((art / "manifest.json").read_text())["shards"][0]
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = "model.layers.0.self_attn.o_proj.perm"
    begin = 8 + n + header[name]["data_offsets"][0]
    first = bytes(raw[begin:begin + 4])
    raw[begin:begin + 4] = (10 ** 6).to_bytes(4, "little")
    shard.write_bytes(raw)
    with pytest.raises(ArtifactError, match="sha256"):  # the checks of every load come first
        engine.load(art)
    with pytest.raises(ArtifactError, match=f"{name} is not a permutation"):
        engine.load(art, verify="sizes")
    raw[begin:begin + 4] = first

    def rewritten(change) -> None:
        h = json.loads(json.dumps(header))
        change(h)
        text = json.dumps(h).encode()
        text += b" " * (-(8 + len(text)) % 64)  # the data 64-byte aligned, as quantprep writes it
        shard.write_bytes(len(text).to_bytes(8, "little") + text + bytes(raw[8 + n:]))

    for change, words in [(lambda h: h[name]["data_offsets"].__setitem__(1, h[name]["data_offsets"][1] + (1 << 30)), "data_offsets"),
                          (lambda h: h[name].update(dtype=["I32"]), "no dtype"),
                          (lambda h: h[name]["data_offsets"].__setitem__(0, h[name]["data_offsets"][0] + 1), "shape"),
                          (lambda h: h[name].update(data_offsets=[o + 2 for o in h[name]["data_offsets"]]), "aligned")]:
        rewritten(change)
        with pytest.raises(ArtifactError, match=f"tensor {name!r}: .*{words}"):
            safetensors_numpy.read(shard)
    rewritten(lambda h: h.update({"model.extra": h[name]}))  # one more tensor than the model reads (aliasing another's bytes)
    relist(art, shard.name)
    with pytest.raises(ArtifactError, match="'model.extra' is not one the"):
        engine.load(art)
