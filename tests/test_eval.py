"""quantprep eval (eval.py): the figures against independent computations (transformers' own loss,
torch's kl_div), against the float model a checkpoint was quantized from and against its
dequantized weights, stored in the manifest, and one-line refusals."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import CALIB, make_tiny_float_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantprep
from quantprep.cli import main
from quantprep.format.artifact import read_checked
from quantprep.tools.eval import evaluate, token_windows

CTX = 32


@pytest.fixture(scope="module")
def tiny_art(tiny_gptq4, tmp_path_factory):
    from quantprep.build.pipeline import prepack

    out = tmp_path_factory.mktemp("eval") / "cpu"
    prepack(tiny_gptq4, "cpu", out)
    return out


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(CALIB * 2)  # words the tiny tokenizer knows
    return p


def test_figures_match_an_independent_computation(tiny_art, tiny_float, text, tmp_path):
    r = evaluate(tiny_art, reference=tiny_float, text_file=text, ctx=CTX, store=False, progress=False)
    art = quantprep.load(tiny_art)
    ref = AutoModelForCausalLM.from_pretrained(tiny_float, dtype=torch.float32).eval()
    windows = token_windows(AutoTokenizer.from_pretrained(tiny_art), text.read_text(), CTX)
    assert r["tokens"] == windows.shape[0] * (CTX - 1) and r["text"]["windows"] == windows.shape[0] >= 4
    with torch.no_grad():
        # transformers' loss with labels = the window: the mean NLL of every token after the first
        ref_loss = torch.stack([ref(input_ids=w[None], labels=w[None]).loss for w in windows]).double()
        art_loss = torch.stack([art(input_ids=w[None], labels=w[None]).loss.float() for w in windows]).double()
        lp = torch.cat([F.log_softmax(art(input_ids=w[None]).logits[0, :-1].double(), -1) for w in windows])
        rlp = torch.cat([F.log_softmax(ref(input_ids=w[None]).logits[0, :-1].double(), -1) for w in windows])
    assert r["reference"]["ppl"] == pytest.approx(ref_loss.mean().exp().item(), rel=1e-5)
    assert r["ppl"] == pytest.approx(art_loss.mean().exp().item(), rel=2e-3)  # bf16 logits: the loss is taken in bf16 there
    kld = F.kl_div(lp, rlp, log_target=True, reduction="none").sum(-1)
    assert r["kld"]["mean"] == pytest.approx(kld.mean().item(), rel=1e-6, abs=1e-9)
    assert r["top1_agree"] == pytest.approx((lp.argmax(-1) == rlp.argmax(-1)).double().mean().item())
    assert r["ppl_ratio"] == pytest.approx(r["ppl"] / r["reference"]["ppl"]) and len(r["halves_ppl"]) == 2
    assert r["reference"]["kind"] == "float"


def test_references_float_dequantized_and_a_wrong_one(tiny_art, tiny_float, tiny_gptq4, text, tmp_path):
    """Against its own dequantized checkpoint only the kernel error remains (tiny); against the
    float model the quantization error shows; against another model the figures fall apart."""
    deq = evaluate(tiny_art, reference=tiny_gptq4, text_file=text, ctx=CTX, store=False, progress=False)
    flt = evaluate(tiny_art, reference=tiny_float, text_file=text, ctx=CTX, store=False, progress=False)
    other = evaluate(tiny_art, reference=make_tiny_float_model(tmp_path / "other", seed=1), text_file=text, ctx=CTX,
                     store=False, progress=False)
    assert deq["reference"]["kind"] == "dequantized"
    # bf16 activations in the artifact vs float32 weights: kernel error (tolerances from this tiny model's runs x ~5)
    assert deq["kld"]["mean"] < 2e-3 and deq["top1_agree"] > 0.97 and abs(deq["ppl_ratio"] - 1) < 0.01
    assert flt["kld"]["mean"] > deq["kld"]["mean"]
    assert other["kld"]["mean"] > 100 * flt["kld"]["mean"] and other["top1_agree"] < flt["top1_agree"]


def test_the_reference_is_found_in_the_build_cache(tiny_art, tiny_gptq4, text, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QUANTPREP_CACHE", str(tmp_path / "cache"))
    assert main(["eval", str(tiny_art), "--text", str(text), "--ctx", str(CTX), "--no-store"]) == 2  # nothing cached
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pass --reference" in err[0]
    shutil.copytree(tiny_gptq4, tmp_path / "cache" / "gptq" / "tiny-0123")
    r = evaluate(tiny_art, text_file=text, ctx=CTX, store=False, progress=False)
    assert r["reference"] == dict(r["reference"], kind="dequantized", path=str(tmp_path / "cache" / "gptq" / "tiny-0123"))


def test_the_result_is_stored_and_shown(tiny_art, tiny_float, text, tmp_path, capsys):
    art = tmp_path / "art"
    shutil.copytree(tiny_art, art)
    assert main(["eval", str(art), "--reference", str(tiny_float), "--text", str(text), "--ctx", str(CTX), "--json",
                 "--plot", str(tmp_path / "eval.png")]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (tmp_path / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "kld_values" not in r
    m = read_checked(art, full_hash=True)  # republished whole: every hash still checks
    [stored] = m["eval"].values()
    assert stored["ppl"] == r["ppl"] and stored["kld"] == r["kld"] and "path" not in stored["reference"]
    assert main(["inspect", str(art)]) == 0
    assert f"ppl {r['ppl']:.4f}" in capsys.readouterr().out


def test_eval_keeps_the_kcache(tiny_art, tiny_gptq4, tmp_path, capsys):
    from test_warm import _build

    from quantprep.runtime.warm import warm

    art = tmp_path / "art"
    shutil.copytree(tiny_art, art)
    warm(art, shapes=[1, 4], compile=False, progress=False)  # a kcache of its kernel plan: seconds
    before = read_checked(art)["kcache"]
    assert before["files"]
    r = evaluate(art, reference=tiny_gptq4, ctx=16, max_tokens=64, store=True, progress=False)  # the held-out text
    after = read_checked(art, full_hash=True)
    assert after["kcache"] == before and all((art / "kcache" / rel).is_file() for rel in before["files"])
    assert r["tokens"] == 4 * 15 and len(after["eval"]) == 1
    no_tokenizer = _build(tmp_path / "synthetic")  # random codes, no tokenizer files
    assert main(["eval", str(no_tokenizer), "--reference", str(tmp_path / "synthetic" / "gptq"), "--no-store"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no usable tokenizer" in err[0], err


def test_bad_input_is_one_line(tiny_art, text, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("the history of the printing press")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    for argv, needle in ((["--ctx", "1"], "at least 2 tokens"),
                         (["--text", str(short)], "fewer than one window"),
                         (["--text", str(binary)], "as UTF-8 text"),
                         (["--dataset", "c4"], "only wikitext2"),
                         (["--reference", str(tmp_path)], "no config.json")):
        assert main(["eval", str(tiny_art), "--no-store", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (argv, err)


def test_wikitext2_offline_without_a_cached_copy_is_one_line(tiny_art, tmp_path, monkeypatch, capsys):
    pytest.importorskip("datasets", reason="the datasets library is not installed")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert main(["eval", str(tiny_art), "--no-store", "--dataset", "wikitext2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not in the datasets cache" in err[0], err
