"""Qwen3 (q_norm and k_norm) and Mistral (a sliding window) through quantprep's C decoder layer, as
runtime/architectures.py describes them: the native runtime (runtime/engine.py, `generate
--native`) and the torch path's C (runtime/cpu_layers.py) against quantprep.load's model, as
tests/test_engine.py checks Llama and Qwen2. The window (8, and 4 on one layer of a Qwen3 whose
other layer attends to everything) is shorter than the tokens run, so that it matters."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import add_chat_tokenizer
from native_c import require_engine
from test_cpu_layers import Counting
from test_engine import torch_token_by_token

import quantprep
from quantprep.cli import main
from quantprep.runtime import cpu_layers, engine
from quantprep.targets.cpu import CpuInt4Linear

require_engine()
SIZES = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": False}
MODELS = {"qwen3": {"model_type": "qwen3", **SIZES},
          "mistral": {"model_type": "mistral", **SIZES, "sliding_window": 8},
          # max_window_layers 1: layer 0 full, layer 1 a window of 4 (transformers' layer_types from use_sliding_window)
          "qwen3-sliding": {"model_type": "qwen3", **SIZES, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}}
WINDOWS = {"qwen3": [None, None], "mistral": [8, 8], "qwen3-sliding": [None, 4]}
PROMPT = [5, 17, 42, 99, 3, 200, 64, 8, 150, 23, 77, 12, 9, 31]  # past every window
TOLERANCE = 1e-2  # test_engine's, against the same kernels behind transformers' code (measured 0)


@pytest.fixture(scope="module", params=list(MODELS))
def art(request, tmp_path_factory):
    """A cpu artifact of random GPTQ codes, its q_norm and k_norm weights random (written as ones: the
    weights would not show), with a word-level tokenizer."""
    from safetensors.torch import load_file, save_file

    from quantprep.build.pipeline import prepack
    from quantprep.build.synthetic import write_random_checkpoint

    root = tmp_path_factory.mktemp(request.param)
    gptq = write_random_checkpoint(root / "gptq", MODELS[request.param], bits=4, group_size=64, desc_act=True, sym=False)
    tensors, g = load_file(gptq / "model.safetensors"), torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            tensors[name] = (1 + 0.5 * torch.randn(t.shape, generator=g)).to(t.dtype)
    save_file(tensors, str(gptq / "model.safetensors"), metadata={"format": "pt"})
    add_chat_tokenizer(gptq, SIZES["vocab_size"])
    prepack(gptq, "cpu", root / "art")
    return request.param, root / "art"


def relative_error(logits, reference) -> float:
    return float((np.linalg.norm(logits - reference, axis=1) / np.linalg.norm(reference, axis=1)).max())


def test_native_logits_match_the_torch_models(art):
    """Token by token, the native model's logits are quantprep.load's with int4_a8 planned (the same C
    kernels; its window and q/k norms in layer_rows, the torch path's in cpu_layers), and the prompt in
    one call (each row its own window) gives each position's values of token by token."""
    name, path = art
    model = engine.load(path)
    assert model.config.windows == WINDOWS[name] and model.config.qk_norm == name.startswith("qwen3")
    native = np.stack([model.forward([t]) for t in PROMPT])
    reference = torch_token_by_token(path, PROMPT)
    print(name, "relative error", relative_error(native, reference))
    assert relative_error(native, reference) < TOLERANCE
    assert (native.argmax(1) == reference.argmax(1)).all()
    model.reset()
    assert np.array_equal(model.forward(PROMPT), native[-1])
    model.reset(capacity=2)  # the cache grows past its first capacity as it fills
    assert np.array_equal(model.forward(PROMPT[:9]), native[8]) and np.array_equal(model.forward(PROMPT[9:]), native[-1])


def planned(path):
    """quantprep.load's model with int4_a8 planned for every int4 module (as `warm --int8-activations` may plan it)."""
    model = quantprep.load(path)
    for m in model.modules():
        if isinstance(m, CpuInt4Linear):
            m.plan, m.plan_max_m = ((1, "int4_a8"),), 1 << 20
    return model


def token_by_token(model, ids: list[int], greedy: int = 0, cache=None) -> torch.Tensor:
    """The logits after each of `ids`, fed one at a time, and after each of `greedy` tokens picked from them."""
    rows = []
    with torch.inference_mode():
        for i in range(len(ids) + greedy):
            t = ids[i] if i < len(ids) else int(rows[-1].argmax())
            out = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


@pytest.mark.parametrize("cache", ["the model's", "full-length"])
def test_torch_c_layers_are_the_modules_forwards(art, monkeypatch, cache):
    """quantprep.load's model with int4_a8 planned runs every token's attention in C, Qwen3's norms
    included: one decode_layer call per layer where its cache holds every token and no mask hides one,
    else CpuDecodeAttention, whose window is transformers' mask and cache (the model's own cache keeps
    only a window, a DynamicCache made without the config keeps every token: its mask hides the rest).
    Its logits are those of every module's own forward (transformers' code around the same kernels:
    within 1e-3, as tests/test_cpu_layers.py; measured 0)."""
    from transformers import DynamicCache

    name, path = art
    model = planned(path)
    assert all(isinstance(layer.self_attn, cpu_layers.CpuDecodeAttention) for layer in model.model.layers)
    counting = Counting(cpu_layers.library())
    monkeypatch.setattr(cpu_layers, "library", lambda: counting)
    ours = token_by_token(model, PROMPT, cache=None if cache == "the model's" else DynamicCache())
    calls, L, windows = counting.calls, len(WINDOWS[name]), WINDOWS[name]
    # the first token's cache is empty (transformers' own layers): the modules; after it, decode_layer where no mask
    # hides a key (a window's cache: none; a full-length one: before its window is full)
    layers = sum(len(PROMPT) - 1 if w is None else min(w, len(PROMPT)) - 2 if cache == "full-length" else 0 for w in windows)
    assert calls["decode_layer"] == layers and calls["decode_layer"] + calls["rotary"] == len(PROMPT) * L, calls
    assert calls.get("qk_norm", 0) == calls["rotary"] * model.config.model_type.startswith("qwen3"), calls
    for m in model.modules():
        if isinstance(m, cpu_layers.Replacement):
            m.forward = m.replaced.forward.__get__(m)
    theirs = token_by_token(model, PROMPT, cache=None if cache == "the model's" else DynamicCache())
    assert calls["decode_layer"] + calls["rotary"] == len(PROMPT) * L  # none more
    print(name, cache, "relative error", relative_error(ours.numpy(), theirs.numpy()))
    assert relative_error(ours.numpy(), theirs.numpy()) < 1e-3 and (ours.argmax(1) == theirs.argmax(1)).all()


WITHOUT_C = r"""
import json, sys, numpy as np, torch, quantprep
model = quantprep.load(sys.argv[1])
rows, cache = [], None
with torch.inference_mode():
    for t in json.loads(sys.argv[2]):
        out = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(out.logits[0, -1].float().numpy())
np.save(sys.argv[3], np.stack(rows))
print(json.dumps(model.quantprep_c))
"""


def test_native_logits_are_the_model_without_c(art, tmp_path):
    """Against quantprep.load in a process without quantprep's C (QUANTPREP_NATIVE=0: transformers'
    modules, torch's int4 kernel on bfloat16 activations, SDPA): what differs is int4_a8's rounding of
    the activations to int8 per group (measured 2.6-4.5e-2 relative here, Llama's and Qwen2's up to 3.1e-2;
    C skipping the query norms: 0.89-1.2, ignoring the window: 0.29-0.83), and a near tie's top-1 on these
    random weights (Mistral's: 13 of 14)."""
    name, path = art
    out = tmp_path / "logits.npy"
    proc = subprocess.run([sys.executable, "-c", WITHOUT_C, str(path), json.dumps(PROMPT), str(out)], capture_output=True, text=True,
                          env=dict(os.environ, QUANTPREP_NATIVE="0"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not any(json.loads(proc.stdout.splitlines()[-1]).values())  # no C module at all
    model = engine.load(path)
    reference, native = np.load(out), np.stack([model.forward([t]) for t in PROMPT])
    print(name, "relative error", relative_error(native, reference), "top-1", (native.argmax(1) == reference.argmax(1)).mean())
    assert relative_error(native, reference) < 0.08
    assert (native.argmax(1) == reference.argmax(1)).mean() >= 0.75


def test_generate_native_is_the_torch_models_greedy_completion(art, capsys):
    """`quantprep generate --native` on the artifact: the completion of quantprep.load's model (int4_a8
    planned) greedy from the same prompt ids, past the window."""
    from quantprep.runtime.tokenizer import ArtifactTokenizer

    _, path = art
    prompt, new = "b c d e f g", 9
    tok = ArtifactTokenizer(path, json.loads((path / "manifest.json").read_text())["files"])
    ids = tok.prompt_ids(prompt)
    tokens = token_by_token(planned(path), ids, new - 1)[len(ids) - 1:].argmax(1).tolist()
    assert main(["generate", str(path), "--native", "--json", "--prompt", prompt, "--max-new-tokens", str(new)]) == 0
    assert json.loads(capsys.readouterr().out)["completion"] == tok.decode(tokens)


def drop(*keys):
    return lambda c: [c.pop(k, None) for k in keys]


# (model, edit of the config transformers saves, the native runtime's refusal or None)
CONFIGS = {
    "qwen3-hub": ("qwen3", lambda c: c.pop("layer_types") and c.update(use_sliding_window=False, sliding_window=4096, max_window_layers=0),
                  None),  # the switch off: no window, whatever max_window_layers says
    "qwen3-from-max-window-layers": ("qwen3", lambda c: c.pop("layer_types") and c.update(use_sliding_window=True, sliding_window=4,
                                                                                         max_window_layers=1), None),
    "qwen3-every-layer": ("qwen3", lambda c: c.pop("layer_types") and c.update(use_sliding_window=True, sliding_window=4,
                                                                               max_window_layers=0), None),
    "qwen3-layer-types": ("qwen3", lambda c: c.update(use_sliding_window=True, sliding_window=4,
                                                      layer_types=["sliding_attention", "full_attention"]), None),
    "qwen3-head-dim-default": ("qwen3", drop("head_dim"), None),  # Qwen3Config's 128, not hidden_size // heads
    "qwen3-attention-bias": ("qwen3", lambda c: c.update(attention_bias=True), None),
    "qwen3-sliding-without-window": ("qwen3", lambda c: c.update(layer_types=["sliding_attention", "full_attention"]),
                                     "a sliding layer without use_sliding_window"),  # transformers' cache fails on it
    "mistral-full": ("mistral", lambda c: c.update(sliding_window=None), None),
    "mistral-defaults": ("mistral", lambda c: drop("sliding_window", "head_dim", "num_key_value_heads")(c) and c.update(num_attention_heads=8),
                         None),  # MistralConfig's window of 4096 and 8 key/value heads
    "mistral-layer-types": ("mistral", lambda c: c.update(layer_types=["full_attention"] * 2), "not a key of the mistral config"),
    "mistral-bias": ("mistral", lambda c: c.update(attention_bias=True), "not a key of the mistral config"),  # MistralAttention has none
}


@pytest.mark.parametrize("case", CONFIGS)
def test_config_is_read_as_transformers_reads_it(tmp_path, case):
    """Each layer's window, the head size, the key/value heads and the biases of Config are those of
    transformers' model built from the same config.json (its attention's sliding_window: Qwen3's own,
    Mistral's config's); what transformers would build otherwise or fail on is refused in one line."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantprep.errors import ArtifactMismatch

    model_type, edit, refused = CONFIGS[case]
    config = AutoConfig.for_model(**MODELS[model_type]).to_dict()
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if refused:
        with pytest.raises(ArtifactMismatch, match=refused) as e:
            engine.Config(tmp_path)
        assert "\n" not in str(e.value) and "--target openvino" in str(e.value)
        return
    ours = engine.Config(tmp_path)
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    attention = [layer.self_attn for layer in theirs.model.layers]
    windows = [a.sliding_window if model_type == "qwen3" else a.config.sliding_window for a in attention]
    bias = {"self_attn.qkv_proj": attention[0].q_proj.bias is not None, "self_attn.o_proj": attention[0].o_proj.bias is not None,
            "mlp.gate_up_proj": theirs.model.layers[0].mlp.gate_proj.bias is not None,
            "mlp.down_proj": theirs.model.layers[0].mlp.down_proj.bias is not None}
    assert (ours.windows, ours.head_dim, ours.kv_heads, ours.bias) == (windows, attention[0].head_dim,
                                                                       theirs.config.num_key_value_heads, bias)
