"""The openvino target end to end on random checkpoints: the IR's stateful decoder in OpenVINO's CPU
plugin against the dense float model (transformers' own Llama/Qwen2 with every GPTQ weight
dequantized), verify, refusals, the model cache, load, pull and serve.

Tolerance for the decoder: relative error 1e-5 on the logits of an 8-token prefill and 4 decode
steps through the KV state, and the same top-1 everywhere. Measured (2026-11-25, 2-core AVX512):
2e-7 to 4e-7. A wrong RoPE, mask, GQA expansion, state update, fused split or head gives 1e-2 or
more. The plugin runs exactly (runtime.openvino.EXACT: f32, no dynamic quantization, f32 KV cache);
its default u8 KV cache alone gave 1e-3.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, add_chat_tokenizer, dense_reference_model, edit_manifest, one_line_error, relist

ov = pytest.importorskip("openvino", reason="the openvino extra (make setup installs it)")

import quantprep  # noqa: E402
from quantprep.build.pipeline import prepack  # noqa: E402
from quantprep.build.synthetic import write_random_checkpoint  # noqa: E402
from quantprep.cli import main  # noqa: E402
from quantprep.errors import ArtifactError  # noqa: E402

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
QWEN2 = dict(LLAMA, model_type="qwen2", tie_word_embeddings=True)  # q/k/v biases; K=64 < group 128: one padded group

CASES = {  # name: (config, checkpoint options, fuse)
    "llama-int4-g64-actorder-asym-v1": (LLAMA, dict(bits=4, group_size=64, desc_act=True, sym=False), True),  # down_proj: K=160, a partial group
    "qwen2-int4-g128-actorder-sym-tied-bias": (QWEN2, dict(bits=4, group_size=128, desc_act=True, sym=True), True),
    "llama-int8-g32-asym-v2-unfused": (LLAMA, dict(bits=8, group_size=32, desc_act=False, sym=False, v1=False), False),
    "qwen2-int4-gall-sym-v2-untied": (dict(QWEN2, tie_word_embeddings=False), dict(bits=4, group_size=-1, desc_act=False, sym=True, v1=False), True),
    "llama-int4-g32-actorder-own-g_idx-lm_head": (LLAMA, dict(bits=4, group_size=32, desc_act=True, sym=False, lm_head=True,
                                                               shared_g_idx=False), True),
    "qwen2-int8-g128-actorder-sym": (QWEN2, dict(bits=8, group_size=128, desc_act=True, sym=True), True),
}


def openvino_artifact(root, config, fuse=True, tokenizer=False, **options):
    gptq = write_random_checkpoint(root / "gptq", config, **options)
    if tokenizer:
        add_chat_tokenizer(gptq, config["vocab_size"])
    prepack(gptq, "openvino", root / "ov", fuse=fuse)
    return gptq, root / "ov"


def run_decoder(art, ids: torch.Tensor, prefill: int) -> np.ndarray:
    """Logits of `ids` [1, n]: `prefill` tokens at once, then one token at a time through the KV state."""
    model = quantprep.load(art, dtype=torch.float32)  # exact
    request = model.compiled.create_infer_request()
    request.reset_state()
    out, n = [], ids.shape[1]
    for start, stop in [(0, prefill)] + [(t, t + 1) for t in range(prefill, n)]:
        out.append(request.infer({"input_ids": ids[:, start:stop].numpy(), "attention_mask": np.ones((1, stop), np.int64),
                                  "position_ids": np.arange(start, stop)[None], "beam_idx": np.zeros(1, np.int32)})["logits"][0].copy())
    return np.concatenate(out)


@pytest.mark.parametrize("case", list(CASES))
def test_the_decoder_is_the_dense_model(case, tmp_path):
    config, options, fuse = CASES[case]
    gptq, art = openvino_artifact(tmp_path, config, fuse, **options)
    manifest = json.loads((art / "manifest.json").read_text())
    assert ("model.layers.0.self_attn.qkv_proj" in manifest["modules"]) == (fuse and options.get("shared_g_idx", True))
    assert ("lm_head" in manifest["modules"]) == options.get("lm_head", False)
    ids = torch.randint(0, config["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = dense_reference_model(gptq)(ids).logits[0].numpy()
    got = run_decoder(art, ids, prefill=8)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-5, rel
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_the_ir_keeps_the_integers_compressed(tmp_path):
    _, art = openvino_artifact(tmp_path, LLAMA, bits=4, group_size=64, desc_act=True, sym=False)
    model = quantprep.load(art, dtype=torch.float32)
    kinds = {str(op.get_output_element_type(0)) for op in model.compiled.get_runtime_model().get_ops() if op.get_output_size()}
    assert kinds & {"u4", "<Type: 'uint4_t'>"}, kinds  # the plugin runs the u4 weights, not a float copy
    ir = ov.Core().read_model(str(art / "openvino_model.xml"))
    modules = json.loads((art / "manifest.json").read_text())["modules"]
    weights = [op for op in ir.get_ops() if op.get_type_name() == "Constant" and op.get_friendly_name().removesuffix(".weight") in modules]
    assert len(weights) == len(modules) and all(str(op.get_output_element_type(0)) in ("u4", "<Type: 'uint4_t'>") for op in weights)


def test_verify_runs_the_irs_own_constants_and_catches_a_changed_scale(tmp_path, capsys):
    _, art = openvino_artifact(tmp_path, LLAMA, bits=4, group_size=64, desc_act=True, sym=False)
    assert main(["verify", str(art), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["numeric"] == "passed" and len(report["probes"]) == 9 and max(r["rel_err"] for r in report["probes"]) < 1e-5
    # an IR whose scales differ from the GPTQ source's, its files relisted so that only the numbers can tell
    core = ov.Core()
    ir = core.read_model(str(art / "openvino_model.xml"))
    [scales] = [op for op in ir.get_ops() if op.get_friendly_name() == "model.layers.0.mlp.down_proj.scales"]
    changed = ov.op.Constant(ov.Tensor(np.ascontiguousarray(scales.get_data() * np.float16(1.05))), shared_memory=False)
    changed.set_friendly_name(scales.get_friendly_name())
    scales.output(0).replace(changed.output(0))
    ov.save_model(ir, str(tmp_path / "changed.xml"), compress_to_fp16=False)
    (tmp_path / "changed.xml").replace(art / "openvino_model.xml")
    (tmp_path / "changed.bin").replace(art / "openvino_model.bin")
    relist(art, "openvino_model.xml", "openvino_model.bin")
    assert main(["verify", str(art)]) == 2
    assert "model.layers.0.mlp.down_proj" in one_line_error(capsys)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                   "original_max_position_embeddings": 64}])
def test_a_rope_that_changes_with_the_length_is_refused_in_one_line(tmp_path, capsys, rope):
    """The model's forward picks these frequencies by the sequence length in Python, which a trace
    would keep at its example's choice: refused before any work, naming the field."""
    gptq = write_random_checkpoint(tmp_path / "gptq", LLAMA, bits=4, group_size=64)
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["rope_scaling"] = rope
    (gptq / "config.json").write_text(json.dumps(cfg))
    assert main(["prepack", str(gptq), "--target", "openvino", "--out", str(tmp_path / "ov")]) == 2
    err = one_line_error(capsys)
    assert f"rope_scaling.rope_type={rope['rope_type']!r}" in err and "config.json" in err, err
    assert not (tmp_path / "ov").exists()


def test_warm_ships_the_model_cache_and_load_uses_it_only_for_its_key(tmp_path):
    from quantprep.runtime.warm import warm

    _, art = openvino_artifact(tmp_path, LLAMA, tokenizer=True, bits=4, group_size=64)
    report = warm(art, progress=False)
    assert report["files"] >= 1 and report["key"]["device"] == "openvino:CPU" and report["key"]["openvino"] == ov.get_version()
    model = quantprep.load(art)
    assert model.quantprep_kcache["status"] == "used" and model.config["CACHE_DIR"].endswith("/openvino")
    assert model.logits([1, 2, 3]).shape == (3, LLAMA["vocab_size"])
    # a cache warmed by another OpenVINO is not used (OpenVINO would recompile silently)
    edit_manifest(art, lambda m: m["kcache"]["key"].update(openvino="2025.0.0-0"))
    with pytest.warns(UserWarning, match="openvino="):
        model = quantprep.load(art, trust_kcache=True)
    assert model.quantprep_kcache["status"] == "ignored" and "CACHE_DIR" not in model.config


def test_an_untrusted_model_cache_is_not_used(tmp_path, monkeypatch):
    from quantprep.runtime.warm import warm

    _, art = openvino_artifact(tmp_path, LLAMA, tokenizer=True, bits=4, group_size=64)
    warm(art, progress=False)
    monkeypatch.setenv("QUANTPREP_TRUST_DIR", str(tmp_path / "another-users-trust"))  # not warmed by this user
    with pytest.warns(UserWarning, match="not trusted"):
        model = quantprep.load(art)
    assert model.quantprep_kcache["status"] == "untrusted" and "CACHE_DIR" not in model.config


def test_a_torch_load_refuses_an_openvino_artifact_and_its_loads_import_neither_the_build_nor_torch(tmp_path):
    from quantprep.runtime.checked import checked_artifact
    from quantprep.runtime.torch_model import open_artifact

    _, art = openvino_artifact(tmp_path, LLAMA, bits=4, group_size=64)
    with pytest.raises(quantprep.ArtifactMismatch, match="runs in OpenVINO"):
        open_artifact(art, checked_artifact(art, "once", None), None, None)
    from transformers import AutoModelForCausalLM

    with pytest.raises(quantprep.ArtifactMismatch, match="OpenVINO IR"):
        AutoModelForCausalLM.from_pretrained(art)
    code = (f"import sys, quantprep; m = quantprep.load({str(art)!r}); ids = m.generate_ids([1, 2], m.generation_config(1)); "
            "print('OV', len(ids), sorted(n for n in sys.modules if n.startswith('quantprep.build')), "
            "[n for n in ('transformers', 'torch') if n in sys.modules])")
    first, again = (subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO) for _ in range(2))
    assert first.returncode == 0 and "OV 1 [] ['transformers', 'torch']" in first.stdout, first.stderr[-2000:]  # the IR's check, once: a trace
    # then a load and its first token without torch's and transformers' imports (2-4 s)
    assert again.returncode == 0 and "OV 1 [] []" in again.stdout, (again.stdout, again.stderr[-2000:])


def test_pull_takes_the_openvino_variant_only_when_asked(tmp_path, monkeypatch):
    from conftest import random_cpu_artifact

    from quantprep.distribution.publish import publish, pull

    monkeypatch.setenv("QUANTPREP_PULL_CACHE", str(tmp_path / "cache"))
    _, art = openvino_artifact(tmp_path, LLAMA, bits=4, group_size=64)
    cpu = random_cpu_artifact(tmp_path, LLAMA, "cpu", bits=4, group_size=64)
    publish([cpu, art], str(tmp_path / "ref"))
    index = json.loads((tmp_path / "ref" / "index.json").read_text())
    assert sorted(v["name"] for v in index["variants"])[-1] == "openvino"
    assert json.loads((pull(str(tmp_path / "ref")) / "manifest.json").read_text())["target"]["name"] == "cpu"
    got = pull(str(tmp_path / "ref"), target="openvino")
    assert json.loads((got / "manifest.json").read_text())["target"]["name"] == "openvino"
    assert (got / "openvino_model.xml").is_file()


def test_a_manifest_cannot_list_an_unknown_file_next_to_the_ir(tmp_path):
    from quantprep.format.artifact import read_manifest

    _, art = openvino_artifact(tmp_path, LLAMA, bits=4, group_size=64)
    (art / "openvino_extension.so").write_bytes(b"\x7fELF")
    edit_manifest(art, lambda m: m["files"].update({"openvino_extension.so": {"sha256": "0" * 64, "size": 4}}))
    with pytest.raises(ArtifactError, match="openvino_extension.so"):
        read_manifest(art)


# --- quantprep serve on an openvino artifact: the OpenAI routes, driven by the real openai client ---

@pytest.fixture(scope="module")
def ov_server(tmp_path_factory):
    from conftest import TINY_LLAMA, free_port
    from openai import OpenAI
    from test_serving import start_server

    root = tmp_path_factory.mktemp("ov-serve")
    _, art = openvino_artifact(root, TINY_LLAMA, tokenizer=True, bits=4, group_size=64, desc_act=True, sym=False)
    port = free_port()
    stop = start_server(art, port)
    yield art, OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
    stop()


def greedy_words(art, content: str, new: int) -> str:
    """The greedy continuation computed here from the IR's logits (not through genai), as words."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(art)
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, return_dict=True)["input_ids"]
    model = quantprep.load(art, dtype=torch.float32)
    for _ in range(new):
        ids = [*ids, int(model.logits(ids)[-1].argmax())]
    return tok.decode(ids[-new:], skip_special_tokens=True)


def _chat(client, model, content, new=8, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=new,
                                          temperature=0, **kw)


def test_served_chat_is_the_greedy_continuation_and_streams_the_same(ov_server):
    art, client = ov_server
    assert [m.id for m in client.models.list().data] == [str(art)]
    reply = _chat(client, str(art), "b c d")
    text = reply.choices[0].message.content
    assert text == greedy_words(art, "b c d", 8) and len(set(text.split())) > 2, text  # not one repeated token
    assert reply.usage.completion_tokens == 8
    chunks = [c.choices[0].delta.content or "" for c in _chat(client, str(art), "b c d", stream=True) if c.choices]
    assert len([c for c in chunks if c]) > 1 and "".join(chunks).split() == text.split()
    done = client.completions.create(model=str(art), prompt="e f g", max_tokens=4, temperature=0)
    assert done.choices[0].text.strip() and done.usage.completion_tokens <= 4


def test_the_openvino_server_refuses_what_the_torch_one_refuses(ov_server):
    import urllib.error
    import urllib.request

    import openai

    art, client = ov_server
    with pytest.raises(openai.APIStatusError) as bad:
        _chat(client, "some-other-model", "b c")
    assert bad.value.status_code == 400
    with pytest.raises(openai.APIStatusError) as bad:
        _chat(client, str(art), "b c", extra_body={"not_a_field": 1})
    assert bad.value.status_code == 422
    with pytest.raises(openai.APIStatusError) as bad:
        _chat(client, str(art), "b c", new=10**6)
    assert bad.value.status_code == 422
    for route in ("/load_model", "/reset"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(str(client.base_url).removesuffix("/v1/") + route, data=b"{}",
                                                          method="POST"), timeout=10)
        assert refused.value.code == 403 and b"pinned" in refused.value.read()
    for bad, code in (({"seed": -1}, 422), ({"stream_options": {"x": 1}}, 422)):
        with pytest.raises(openai.APIStatusError) as refused:
            _chat(client, str(art), "b c", extra_body=bad)
        assert refused.value.status_code == code, bad
    with pytest.raises(openai.APIStatusError) as refused:  # TINY_LLAMA's context: 2048 tokens
        _chat(client, str(art), "b " * 1000, new=4000 - 1000)
    assert refused.value.status_code == 400 and "context" in refused.value.response.text
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=str(art), prompt=" ", max_tokens=2)
    assert refused.value.status_code == 400 and "empty" in refused.value.response.text
    big = urllib.request.Request(str(client.base_url) + "chat/completions", data=b"{}",  # says 5 MiB: refused on the header
                                 headers={"Content-Type": "application/json", "Content-Length": str(5 << 20)}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(big, timeout=30)
    assert refused.value.code == 413


# wide enough that 2,000 tokens take seconds (so a cancelled stream is told apart from a finished
# one by far more than the time a disconnect takes to reach the server on a busy 2-core machine), and
# without an end-of-sequence id, which serve stops at, so the full generation runs them all
WIDE = dict(LLAMA, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            eos_token_id=None)


def test_a_client_that_goes_away_cancels_its_generation(tmp_path):
    """The next request does not wait for a dropped stream to run to its max_tokens: timed against
    the same full generation run to its end (a ratio, so the machine's speed cancels out)."""
    import time

    from conftest import serve_with_client

    _, art = openvino_artifact(tmp_path, WIDE, tokenizer=True, bits=4, group_size=64)
    proc, client = serve_with_client(art)
    try:
        new = 600  # within the 2048-token context; the next request after a drop must not wait for it
        t0 = time.perf_counter()
        full = client.completions.create(model=str(art), prompt="l m", max_tokens=new, temperature=0)
        whole = time.perf_counter() - t0
        assert full.usage.completion_tokens > 300, full.usage  # long enough to tell apart
        stream = client.completions.create(model=str(art), prompt="l m", max_tokens=new, temperature=0, stream=True)
        next(iter(stream))
        stream.close()
        t0 = time.perf_counter()
        assert client.completions.create(model=str(art), prompt="b c d", max_tokens=2, temperature=0).choices[0].text
        after = time.perf_counter() - t0
    finally:
        proc.kill()
    print({"full_generation_s": whole, "next_request_after_a_drop_s": after})
    assert after < whole / 2, (after, whole)


def test_sigterm_during_streams_exits_cleanly_and_a_busy_port_is_one_line(tmp_path):
    import signal
    import socket
    import threading

    import openai
    from conftest import TINY_LLAMA, serve_with_client

    _, art = openvino_artifact(tmp_path, TINY_LLAMA, tokenizer=True, bits=4, group_size=64)
    proc, client = serve_with_client(art)
    try:
        started = threading.Barrier(4)

        def consume():
            try:
                stream = client.completions.create(model=str(art), prompt="n o", max_tokens=2000, temperature=0, stream=True)
                started.wait(30)
                for _ in stream:
                    pass
            except (openai.APIError, threading.BrokenBarrierError):
                pass

        threads = [threading.Thread(target=consume) for _ in range(3)]
        for t in threads:
            t.start()
        started.wait(30)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        out = proc.stdout.read()
        assert code == 0, out[-3000:]
        for t in threads:
            t.join(timeout=20)
    finally:
        proc.kill()
    with socket.socket() as taken:  # a port in use: one line, exit 2, not "serving"
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = subprocess.run([sys.executable, "-m", "quantprep", "serve", str(art), "--port", str(taken.getsockname()[1])],
                              capture_output=True, text=True, timeout=120)
    assert busy.returncode == 2 and "could not listen" in busy.stderr and "serving" not in busy.stdout, busy.stderr[-2000:]


def test_a_damaged_or_oversized_ir_is_refused_in_one_line(tmp_path, capsys):
    """A hostile or damaged artifact: an IR with an operation quantprep never writes (its files
    relisted, so only the comparison with quantprep's own IR can tell), and an .xml listed larger
    than an IR graph may be (refused before reading)."""
    from conftest import TINY_LLAMA

    _, art = openvino_artifact(tmp_path, TINY_LLAMA, tokenizer=True, bits=4, group_size=64)
    xml = (art / "openvino_model.xml").read_text()
    (art / "openvino_model.xml").write_text(xml.replace('<layers>', '<layers><layer id="x" type="NoSuchOp"/>', 1))
    relist(art, "openvino_model.xml")
    capsys.readouterr()  # the build's own output
    assert main(["generate", str(art), "--prompt", "b c"]) == 2
    err = one_line_error(capsys)
    assert "openvino_model.xml" in err and "NoSuchOp" in err and "not the IR quantprep writes" in err, err
    assert main(["verify", str(art)]) == 2
    assert "openvino_model.xml" in one_line_error(capsys)
    edit_manifest(art, lambda m: m["files"]["openvino_model.xml"].update(size=1 << 30))
    with pytest.raises(ArtifactError):  # the listed size is checked against the file first
        quantprep.load(art)
    from quantprep.runtime.openvino import check_files

    with pytest.raises(ArtifactError, match="MiB an IR graph may have"):
        check_files(art, json.loads((art / "manifest.json").read_text()))


def _edit_tensors(gptq, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(gptq / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(gptq / "model.safetensors"), metadata={"format": "pt"})


def test_the_head_is_the_one_transformers_and_the_cpu_target_use(tmp_path):
    """A tied Qwen2 checkpoint that also stores a different lm_head.weight: transformers (and the
    cpu target's load) tie the head to the embedding again, so the IR must too."""
    gptq = write_random_checkpoint(tmp_path / "gptq", QWEN2, bits=4, group_size=64)
    _edit_tensors(gptq, lambda t: t.update({"lm_head.weight": torch.randn(QWEN2["vocab_size"], QWEN2["hidden_size"]).half()}))
    prepack(gptq, "openvino", tmp_path / "ov")
    prepack(gptq, "cpu", tmp_path / "cpu", "float32")
    ids = torch.randint(0, QWEN2["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = quantprep.load(tmp_path / "cpu")(input_ids=ids).logits[0]
    got = quantprep.load(tmp_path / "ov", dtype=torch.float32)(input_ids=ids).logits[0]
    assert ((got - want).norm() / want.norm()).item() < 1e-4


@pytest.mark.parametrize("case", ["untied-without-lm_head", "a norm of the wrong shape", "a missing norm"])
def test_float_tensors_the_graph_would_misread_are_refused_in_one_line(tmp_path, capsys, case):
    gptq = write_random_checkpoint(tmp_path / "gptq", LLAMA, bits=4, group_size=64)
    name = {"untied-without-lm_head": "lm_head.weight", "a norm of the wrong shape": "model.norm.weight",
            "a missing norm": "model.layers.0.input_layernorm.weight"}[case]
    _edit_tensors(gptq, lambda t: t.update({name: torch.ones(1).half()}) if "shape" in case else t.pop(name))
    capsys.readouterr()
    assert main(["prepack", str(gptq), "--target", "openvino", "--out", str(tmp_path / "ov")]) == 2
    err = one_line_error(capsys)
    assert f"tensor {name}" in err, err
    assert not (tmp_path / "ov").exists()


def test_warm_checks_the_artifact_before_trusting_what_it_compiles(tmp_path, capsys):
    """A changed byte in the IR (same size, manifest untouched): warm refuses before compiling, and
    records no trust."""
    from conftest import TINY_LLAMA

    from quantprep.runtime.kcache import trust_dir

    _, art = openvino_artifact(tmp_path, TINY_LLAMA, tokenizer=True, bits=4, group_size=64)
    quantprep.load(art)  # marks the files hashed here, as a first use would
    xml = (art / "openvino_model.xml").read_bytes()
    (art / "openvino_model.xml").write_bytes(xml.replace(b"quantprep_decoder", b"quantprep_decodex", 1))
    before = sorted(p.name for p in trust_dir().glob("*")) if trust_dir().exists() else []
    capsys.readouterr()
    assert main(["warm", str(art)]) == 2
    assert "openvino_model.xml" in one_line_error(capsys)
    assert (sorted(p.name for p in trust_dir().glob("*")) if trust_dir().exists() else []) == before
    assert "kcache" not in json.loads((art / "manifest.json").read_text())
