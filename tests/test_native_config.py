"""Case 17 (issue 53, case 4): `generate --native` reads config.json as transformers does, so it never
runs another model than quantprep.load. transformers builds the class the config's model_type names
(not its `architectures`), reads rope_scaling before rope_parameters, and its shared code reads keys
no config class declares; runtime/engine.py's Config refuses, in one line, every key it does not
implement. Each hostile artifact is resealed as an attacker would (its manifest relisting the new
config.json). The model_type and rope_scaling ones are shown to be real attacks: quantprep.load's
logits differ from the native runtime's before this check, which ignored those keys and so computed
the unedited artifact's logits."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_LLAMA, one_line_error, random_cpu_artifact, relist
from native_c import require_engine
from test_cpu_layers import TINY_QWEN2
from test_engine import PROMPT, torch_token_by_token

from quantprep.cli import main
from quantprep.runtime import engine

require_engine()
TOLERANCE = 1e-2  # test_engine's: relative error per token of the native logits against quantprep.load's


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A Llama cpu artifact with its config.json as prepack writes it, and the native model's logits."""
    art = random_cpu_artifact(tmp_path_factory.mktemp("native-config"), TINY_LLAMA, bits=4, group_size=64, desc_act=True, sym=False)
    return art, native_token_by_token(art)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return random_cpu_artifact(tmp_path_factory.mktemp("native-config-qwen2"), TINY_QWEN2, bits=4, group_size=64, desc_act=True, sym=False)


def native_token_by_token(art) -> np.ndarray:
    model = engine.load(art)
    return np.stack([model.forward([t]) for t in PROMPT])


def relative_error(logits: np.ndarray, reference: np.ndarray) -> float:
    return float((np.linalg.norm(logits - reference, axis=1) / np.linalg.norm(reference, axis=1)).max())


def resealed(art: Path, tmp_path: Path, edit) -> Path:
    """A copy of `art` whose config.json is edit(config), listed in its manifest with its new sha256 and
    size (and a fresh manifest digest), as anyone who can write the artifact can do."""
    copy = tmp_path / "hostile"
    shutil.copytree(art, copy)
    config = json.loads((copy / "config.json").read_text())
    edit(config)
    (copy / "config.json").write_text(json.dumps(config))
    relist(copy, "config.json")
    return copy


def generate_native_refuses(art, capsys, key: str, value) -> str:
    """`quantprep generate ART --native` exits 2 with one line naming config.json, the key, its value and
    what runs the model instead."""
    assert main(["generate", str(art), "--native", "--prompt", "b c d", "--max-new-tokens", "2"]) == 2
    line = one_line_error(capsys)
    assert f"{art / 'config.json'}: {key}={value!r}:" in line and "`quantprep generate` without --native" in line, line
    return line


def attack_is_real(hostile, native_before) -> None:
    """quantprep.load's model of the hostile config is not the one the native runtime computed for it
    (`native_before`: the unedited artifact's logits, as the keys changed were ignored)."""
    assert relative_error(native_before, torch_token_by_token(hostile, PROMPT)) > TOLERANCE


GRANITE = {"model_type": "granite", "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
           "logits_scaling": 8.0}
SMOLLM3 = {"model_type": "smollm3", "no_rope_layers": [0]}  # SmolLM3 leaves RoPE out of the layers listed 0
GEMMA = {"model_type": "gemma", "hidden_act": None, "hidden_activation": "gelu_pytorch_tanh"}  # None: left out (Gemma's default, tanh GELU)


@pytest.mark.parametrize("change", [GRANITE, SMOLLM3, GEMMA], ids=["granite", "smollm3", "gemma"])
def test_case17_native_refuses_a_model_type_it_does_not_implement(llama, tmp_path, capsys, change):
    """The model_type picks transformers' class; `architectures` still says LlamaForCausalLM, which the
    native runtime used to believe (granite's multipliers: 789% off on real shapes; a Gemma config
    without hidden_act ran SiLU, and with GemmaForCausalLM was refused as "hidden_act None")."""
    from transformers import AutoConfig

    art, native_before = llama

    def edit(c: dict) -> None:
        c.update(change)
        for key in [k for k, v in change.items() if v is None]:
            del c[key]
    hostile = resealed(art, tmp_path, edit)
    assert json.loads((hostile / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert AutoConfig.from_pretrained(hostile).model_type == change["model_type"]
    attack_is_real(hostile, native_before)
    generate_native_refuses(hostile, capsys, "model_type", change["model_type"])


SCALINGS = [{"rope_type": "linear", "factor": 4.0}, {"type": "linear", "factor": 4.0},  # the second: transformers 4's spelling
            {"rope_type": "yarn", "factor": 4.0},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}]


@pytest.mark.parametrize("scaling", SCALINGS, ids=["linear", "linear-type", "yarn", "llama3"])
def test_case17_native_refuses_rope_scaling_beside_rope_parameters(llama, tmp_path, capsys, scaling):
    """transformers 5 takes a non-empty rope_scaling in place of rope_parameters (convert_rope_params_to_dict);
    the native runtime used to read rope_parameters' default rotary embedding (15-18% off)."""
    from transformers import AutoConfig

    art, native_before = llama
    hostile = resealed(art, tmp_path, lambda c: c.update(rope_scaling=scaling))
    assert json.loads((hostile / "config.json").read_text())["rope_parameters"]["rope_type"] == "default"
    assert AutoConfig.from_pretrained(hostile).rope_parameters["rope_type"] == scaling.get("rope_type", scaling.get("type"))
    attack_is_real(hostile, native_before)
    line = generate_native_refuses(hostile, capsys, "rope_scaling", scaling)
    assert "rotary embedding" in line


@pytest.mark.parametrize("key, value", [
    ("hidden_activation", "gelu_pytorch_tanh"),  # Gemma's name for its activation: unread by Llama, refused as every unknown key
    ("is_causal", False), ("attention_chunk_size", 2), ("attn_implementation", "eager"),  # read by transformers' shared code
    ("per_layer_config", {"0": {"intermediate_size": 96}}),
    ("sliding_window", 2), ("output_attentions", True)])  # neutral only at their defaults (None, false)
def test_case17_native_refuses_keys_it_does_not_implement(llama, tmp_path, capsys, key, value):
    """A key the native runtime neither reads nor knows to change nothing is refused by name, whatever
    transformers' version does with it (masking, cache and loading code read keys no config class declares)."""
    art, _ = llama
    hostile = resealed(art, tmp_path, lambda c: c.update({key: value}))
    generate_native_refuses(hostile, capsys, key, value)


def smollm2_hub(c: dict) -> None:
    """SmolLM2's config.json as the Hub has it (nanotron's export, transformers 4's rope keys)."""
    c.pop("rope_parameters")
    c.update(rope_theta=100000, rope_scaling=None, is_llama_config=True, rope_interleaved=False, pretraining_tp=1,
             torch_dtype="bfloat16", pad_token_id=2, **{"transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16"}}})


def smollm2_gguf(c: dict) -> None:
    """The keys transformers' GGUF reader adds (quantprep build's path to SmolLM2)."""
    c.update(_model_name_or_path="Smollm2 135M 8k Lc100K Mix1 Ep2", unk_token_id=0, rms_norm_eps=9.999999747378752e-06)


def qwen25_hub(c: dict) -> None:
    """Qwen2.5's config.json as the Hub has it (transformers 4: rope_theta beside a null rope_scaling)."""
    for key in ("rope_parameters", "layer_types", "dtype"):
        c.pop(key)
    c.update(rope_theta=1000000.0, rope_scaling=None, sliding_window=131072, use_sliding_window=False, max_window_layers=21,
             torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)


def rope_theta_beside(c: dict) -> None:
    """rope_parameters without its theta: transformers fills it from the top-level rope_theta."""
    c.update(rope_parameters={"rope_type": "default"}, rope_theta=1000000.0)


def default_scaling_replaces(c: dict) -> None:
    """A non-empty rope_scaling replaces rope_parameters whole, its theta too (10000, as none is beside it)."""
    c.update(rope_scaling={"rope_type": "default"}, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


@pytest.mark.parametrize("model, edit", [("llama", None), ("llama", smollm2_hub), ("llama", smollm2_gguf), ("qwen2", None),
                                         ("qwen2", qwen25_hub), ("llama", rope_theta_beside), ("qwen2", default_scaling_replaces)],
                         ids=["llama", "smollm2-hub", "smollm2-gguf", "qwen2", "qwen2.5-hub", "rope-theta-beside",
                              "default-scaling-replaces"])
def test_case17_native_reads_configs_as_transformers(request, tmp_path, model, edit):
    """Real configs (as prepack writes them, as the Hub and transformers' GGUF reader do) run, with the
    sizes and rotary embedding transformers reads from them, and the native logits are quantprep.load's."""
    from transformers import AutoConfig

    art = request.getfixturevalue(model)
    art = art[0] if model == "llama" else art
    if edit:
        art = resealed(art, tmp_path, edit)
    theirs, ours = AutoConfig.from_pretrained(art), engine.Config(art)
    assert (ours.rope_theta, ours.head_dim, ours.kv_heads, ours.eps, ours.context, ours.tied) == \
        (theirs.rope_parameters["rope_theta"], theirs.head_dim if model == "llama" else theirs.hidden_size // theirs.num_attention_heads,
         theirs.num_key_value_heads, theirs.rms_norm_eps, theirs.max_position_embeddings, theirs.tie_word_embeddings)
    reference, native = torch_token_by_token(art, PROMPT), native_token_by_token(art)
    assert relative_error(native, reference) < TOLERANCE
    assert (native.argmax(1) == reference.argmax(1)).all()


def test_case17_native_refusal_stays_one_line_for_a_hostile_key(llama, tmp_path, capsys):
    """A key with a line break, a value of 100 KB: still one bounded line, the key escaped."""
    art, _ = llama
    hostile = resealed(art, tmp_path, lambda c: c.update({"is_causal\nsecond line": "x" * 100_000}))
    assert main(["generate", str(hostile), "--native", "--prompt", "b c d"]) == 2
    line = one_line_error(capsys)
    assert f"{hostile / 'config.json'}: 'is_causal\\nsecond line'='xxx" in line and len(line) < 1000, line


ODD_VALUES = [None, True, -1, 0, 2**63, 1.5, "64", [1], {"a": 1}]


def test_every_field_it_reads_is_checked_before_use(llama, tmp_path):
    """engine.load has no catch-all (issue 55, item 3): each config.json key and each of a
    module's manifest fields, set to values of every JSON kind, loads (a value it may hold) or gives
    ArtifactError or ArtifactMismatch, never another exception from inside the engine."""
    from conftest import edit_manifest

    from quantprep.errors import ArtifactError, ArtifactMismatch

    art, _ = llama
    config = json.loads((art / "config.json").read_text())
    module = "model.layers.0.mlp.down_proj"
    fields = json.loads((art / "manifest.json").read_text())["modules"][module]

    def with_module_field(d: Path, key: str, value) -> Path:
        copy = shutil.copytree(art, d / "hostile")
        edit_manifest(copy, lambda m: m["modules"][module].update({key: value}))
        return copy

    edits = [(lambda d, k=k, v=v: resealed(art, d, lambda c: c.update({k: v}))) for k in [*config, "rope_scaling", "layer_types"]
             for v in ODD_VALUES]
    edits += [(lambda d, k=k, v=v: with_module_field(d, k, v)) for k in [*fields, "fused"] for v in ODD_VALUES]
    refused = 0
    for i, edit in enumerate(edits):
        (tmp_path / str(i)).mkdir()
        try:
            engine.load(edit(tmp_path / str(i)))
        except (ArtifactError, ArtifactMismatch):
            refused += 1
    assert refused > len(edits) // 2, refused
