"""The build stage's quantized-checkpoint cache: named by content, so a changed source, calibration
text, gptqmodel version or setting never reuses a stale checkpoint."""

import dataclasses
import shutil

from safetensors.torch import load_file, save_file

from quantprep.build import quant_key, sha256_of
from quantprep.quantize import builtin_calibration
from quantprep.recipes import find_recipe


def test_source_hash_follows_content_not_path(tiny_float, tmp_path):
    same = tmp_path / "same"
    shutil.copytree(tiny_float, same)
    assert sha256_of(same) == sha256_of(tiny_float)
    tensors = load_file(same / "model.safetensors")
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, str(same / "model.safetensors"), metadata={"format": "pt"})
    assert sha256_of(same) != sha256_of(tiny_float)
    (tmp_path / "model.gguf").write_bytes(b"GGUF v3")
    assert len(sha256_of(tmp_path / "model.gguf")) == 64


def test_quant_key_changes_with_every_input(monkeypatch):
    import importlib.metadata

    recipe = find_recipe("smollm2-135m")
    texts = builtin_calibration(recipe.samples)
    base = quant_key(recipe, "a" * 64, texts)
    assert quant_key(recipe, "a" * 64, list(texts)) == base  # deterministic
    variants = [quant_key(recipe, "b" * 64, texts), quant_key(recipe, "a" * 64, texts[:-1] + ["other text"])]
    for field, value in (("bits", 8), ("group_size", 64), ("desc_act", False), ("sym", False), ("samples", 3), ("seed", 1)):
        variants.append(quant_key(dataclasses.replace(recipe, **{field: value}), "a" * 64, texts))
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.0.1" if d == "gptqmodel" else real_version(d))
    variants.append(quant_key(recipe, "a" * 64, texts))
    assert len({base, *variants}) == len(variants) + 1
