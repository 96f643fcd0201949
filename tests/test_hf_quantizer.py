"""AutoModelForCausalLM.from_pretrained(artifact_dir) through quantprep's transformers quantizer
(hf_quantizer.py): the same model as quantprep.load (identical logits: the same modules and the same
tensors, so bit-equal), pipeline("text-generation"), the same refusals; without quantprep imported
transformers fails instead of loading a wrong model."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import edit_manifest, random_cpu_artifact
from transformers import AutoModelForCausalLM, pipeline

import quantprep
from quantprep.build.pipeline import prepack
from quantprep.errors import ArtifactError, ArtifactMismatch
from quantprep.format.artifact import MANIFEST, WEIGHTS_INDEX

QWEN2 = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}


def _artifact(tmp_path, lm_head=False, fuse=False, act_dtype=None):
    return random_cpu_artifact(tmp_path, QWEN2, act_dtype=act_dtype, fuse=fuse, bits=4, group_size=32, desc_act=True, sym=False,
                               lm_head=lm_head)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("lm_head,fuse", [(False, False), (True, False), (False, True)])
def test_from_pretrained_is_quantprep_load(tmp_path, lm_head, fuse):
    """Tied embeddings with a float lm_head, a quantized lm_head (untied), fused q/k/v + gate/up."""
    art = _artifact(tmp_path, lm_head, fuse)
    ours = quantprep.load(art)
    theirs = AutoModelForCausalLM.from_pretrained(art)
    assert type(theirs) is type(ours) and theirs.dtype == torch.bfloat16 and theirs.config.quantization_config.quant_method == "quantprep"
    assert [type(m).__name__ for m in theirs.modules()] == [type(m).__name__ for m in ours.modules()]
    assert (type(theirs.lm_head).__name__ == "CpuInt4Linear") == lm_head
    if not lm_head:
        assert theirs.lm_head.weight.data_ptr() == theirs.get_input_embeddings().weight.data_ptr()
    mine, other = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == other.keys() and all(torch.equal(mine[k], other[k]) for k in mine)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(theirs, ids), _logits(ours, ids))
    assert theirs.quantprep_kcache == ours.quantprep_kcache and theirs.quantprep_buckets == ours.quantprep_buckets
    # decode attention (runtime/cpu_attention.py) where a C compiler is: after from_pretrained has finished too
    assert theirs.config._attn_implementation == ours.config._attn_implementation == ours.quantprep_attention


def test_float32_artifact_and_device_map(tmp_path):
    art = _artifact(tmp_path, act_dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(art, device_map="cpu", dtype="auto")
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(1))
    assert model.dtype == torch.float32 and torch.equal(_logits(model, ids), _logits(quantprep.load(art), ids))
    with pytest.raises(ArtifactMismatch, match="loads onto one device"):
        AutoModelForCausalLM.from_pretrained(art, device_map={"model": "cpu", "lm_head": "meta"})


def test_pipeline_generates_like_quantprep_load(random_gptq, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    smol = tmp_path / "tok"
    vocab = {chr(97 + i % 26) * (1 + i // 26): i for i in range(256)}  # a word-level vocabulary the size of the tiny model's
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="a", pad_token="a", eos_token="b").save_pretrained(smol)
    for f in smol.iterdir():
        (random_gptq / f.name).write_bytes(f.read_bytes())
    art = tmp_path / "art"
    prepack(random_gptq, "cpu", art)
    got = pipeline("text-generation", model=str(art))("c d e f", max_new_tokens=6, do_sample=False, return_tensors=True)[0]
    model = quantprep.load(art)
    tokenizer = AutoTokenizer.from_pretrained(art)
    ids = tokenizer("c d e f", return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert list(got["generated_token_ids"]) == out[0].tolist() and len(set(out[0, ids.shape[1]:].tolist())) > 1


def test_the_same_refusals(tmp_path):
    art = _artifact(tmp_path)
    edit_manifest(art, lambda m: m["compat"].update(cpu_capability="AVX512_VNNI_AMX"))
    with pytest.raises(ArtifactMismatch, match="built for cpu_capability=AVX512_VNNI_AMX") as e1:
        quantprep.load(art)
    with pytest.raises(ArtifactMismatch, match="built for cpu_capability=AVX512_VNNI_AMX") as e2:
        AutoModelForCausalLM.from_pretrained(art)
    assert str(e1.value) == str(e2.value)


def test_a_tensor_the_model_lacks_is_refused_before_loading(tmp_path):
    from safetensors.torch import load_file, save_file

    from quantprep.format.artifact import sha256_file

    art = _artifact(tmp_path)
    m = json.loads((art / MANIFEST).read_text())
    shard = art / m["shards"][0]
    t = load_file(shard)
    t["model.layers.0.mlp.up_proj.scales_and_zeros"] = t["model.layers.0.mlp.up_proj.scales_and_zeros"][:1].clone()
    save_file(t, str(shard), metadata={"format": "pt"})
    edit_manifest(art, lambda m: m["files"][shard.name].update(sha256=sha256_file(shard), size=shard.stat().st_size))
    with pytest.raises(ArtifactError, match=r"tensor model.layers.0.mlp.up_proj.scales_and_zeros is torch.bfloat16 \(1,"):
        AutoModelForCausalLM.from_pretrained(art)


def test_an_index_that_points_elsewhere_is_refused(tmp_path):
    """transformers reads the shards the index names: one naming another file (its manifest entry
    updated, as a consistent forgery would) is refused before anything is read."""
    from quantprep.format.artifact import sha256_file

    art = _artifact(tmp_path)
    index = json.loads((art / WEIGHTS_INDEX).read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "probes.safetensors"
    (art / WEIGHTS_INDEX).write_text(json.dumps(index))
    f = art / WEIGHTS_INDEX
    edit_manifest(art, lambda m: m["files"][WEIGHTS_INDEX].update(sha256=sha256_file(f), size=f.stat().st_size))
    with pytest.raises(ArtifactError, match="does not list the tensors of the manifest's shards|not a shard of the manifest"):
        AutoModelForCausalLM.from_pretrained(art)


def test_an_unsigned_artifact_is_refused_with_a_verify_key(tmp_path, monkeypatch):
    from conftest import keypair

    art = _artifact(tmp_path)
    _, pub = keypair(tmp_path / "keys")
    monkeypatch.setenv("QUANTPREP_VERIFY_KEY", str(pub))
    with pytest.raises(ArtifactError, match="unsigned"):
        AutoModelForCausalLM.from_pretrained(art)


def test_without_quantprep_transformers_fails_naming_it(tmp_path):
    art = _artifact(tmp_path)
    assert json.loads((art / WEIGHTS_INDEX).read_text())["weight_map"]
    code = "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained(__import__('sys').argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(art)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "Unknown quantization type, got quantprep" in proc.stderr and "no file named model.safetensors" in proc.stderr
