"""The build stage's quantized-checkpoint cache: named by content, so a changed source, calibration
text, gptqmodel version or setting never reuses a stale checkpoint."""

import dataclasses
import shutil

from safetensors.torch import load_file, save_file

from quantprep.build.pipeline import prepack, quant_key, sha256_of
from quantprep.build.quantize import builtin_calibration
from quantprep.build.recipes import find_recipe


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


def test_builds_are_reproducible(random_gptq, tmp_path, monkeypatch):
    """Issue 15 item 4: the same checkpoint, quantprep version and target give byte-identical files,
    manifest included, wherever the checkpoint and the output live (SOURCE_DATE_EPOCH sets `created`)."""
    import shutil


    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")
    moved = shutil.copytree(random_gptq, tmp_path / "elsewhere" / "checkpoint")
    for target in ("cpu", "xpu"):
        a, b = tmp_path / f"a-{target}", tmp_path / "deeper" / f"b-{target}"
        prepack(random_gptq, target, a)
        prepack(moved, target, b)
        files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
        for rel in files:
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), f"{target}: {rel} differs"
        manifest = (a / "manifest.json").read_text()
        assert "2026-01-01T00:00:00" in manifest and str(tmp_path) not in manifest


def test_a_bad_source_date_epoch_is_one_line(random_gptq, tmp_path, capsys, monkeypatch):
    from quantprep.cli import main

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    assert main(["prepack", str(random_gptq), "--target", "cpu", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SOURCE_DATE_EPOCH='yesterday'" in err[0], err
    assert not (tmp_path / "o").exists()


def test_a_build_runs_torch_on_one_thread_unless_the_environment_says(random_gptq, tmp_path, monkeypatch):
    """libgomp's workers spin between ops; a build's own torch ops are small: one thread while it
    streams (observed inside prepack_stream), the caller's count after; OMP_NUM_THREADS wins."""
    import torch

    from quantprep.build import pipeline as build

    seen, stream = [], build.prepack_stream
    monkeypatch.setattr(build, "prepack_stream", lambda *a, **k: (seen.append(torch.get_num_threads()), stream(*a, **k))[1])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        build.prepack(random_gptq, "cpu", tmp_path / "a")
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        build.prepack(random_gptq, "cpu", tmp_path / "b")
    finally:
        torch.set_num_threads(threads)
    assert seen == [1, 2]
