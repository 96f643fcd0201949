"""Prefill bucketing (serving.py): a prompt run at warmed lengths only, padded on the right and
cropped from the KV cache, gives the real tokens the logits and cache of the unpadded run.

Exactness is checked in float64 on the dense reference model (padding and chunking change the
GEMMs' row count, and float32 kernels round differently per row count: ~1e-4 absolute on SmolLM2's
logits). On a quantprep artifact in float32: relative error <= 1e-5 and the same greedy tokens.
"""

from pathlib import Path

import pytest
import torch
from conftest import dense_reference_model, edit_manifest, rel_err

import quantprep
from quantprep.tools.serving import bucket_for, generate, prefill

BUCKETS = [4, 8, 16]


def test_bucket_for():
    assert [bucket_for(n, BUCKETS) for n in (1, 4, 5, 16, 17)] == [4, 4, 8, 16, 16]


@pytest.mark.parametrize("n", [1, 3, 8, 13, 16, 29, 40])  # padded, exact, chunked (16 + 13 -> 16 + 16) ...
def test_padded_prefill_is_the_unpadded_one_in_float64(random_gptq, n):
    model = dense_reference_model(random_gptq, torch.float64)
    ids = torch.randint(2, model.config.vocab_size, (2, n), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=True)
    got, cache = prefill(model, ids, BUCKETS)
    assert got.shape == ref.logits.shape and cache.get_seq_length() == n
    assert (got - ref.logits).abs().max().item() < 1e-10
    for mine, theirs in zip(cache.layers, ref.past_key_values.layers, strict=True):
        assert (mine.keys - theirs.keys).abs().max().item() < 1e-10 and (mine.values - theirs.values).abs().max().item() < 1e-10


def test_a_bucketed_artifact_generates_the_same_tokens(random_gptq, tmp_path):
    from quantprep.build.pipeline import prepack

    prepack(random_gptq, "cpu", tmp_path / "a", "float32")
    model = quantprep.load(tmp_path / "a")
    assert model.quantprep_buckets == [1, 16, 128, 512]  # the shapes warm runs (DEFAULT_SHAPES)
    ids = torch.randint(2, model.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    got, _ = prefill(model, ids, BUCKETS)
    assert rel_err(got, ref) < 1e-5
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(generate(model, ids, BUCKETS, max_new_tokens=12, do_sample=False, pad_token_id=0), plain)


def test_the_qwen_recipe_warms_the_prefill_buckets():
    from quantprep.build.recipes import find_recipe
    from quantprep.tools.serving import PREFILL_BUCKETS

    assert find_recipe("qwen2.5-1.5b").warm_shapes == PREFILL_BUCKETS
    assert all(b / a <= 1.1 + 8 / a for a, b in zip(PREFILL_BUCKETS[1:], PREFILL_BUCKETS[2:], strict=False))  # <= 10% + rounding


# --- quantprep serve: quantprep's OpenAI-compatible server over the loaded artifact, driven by the real openai client ---

def chat_artifact(root, target: str = "cpu"):
    """A tiny random Llama artifact with a word-level tokenizer and a chat template (no network)."""
    from conftest import TINY_LLAMA, add_chat_tokenizer

    from quantprep.build.pipeline import prepack
    from quantprep.build.synthetic import write_random_checkpoint

    gptq = write_random_checkpoint(root / "gptq", TINY_LLAMA, bits=4, group_size=64, desc_act=True, sym=False)
    add_chat_tokenizer(gptq, TINY_LLAMA["vocab_size"])
    prepack(gptq, target, root / "art")
    return root / "art"


def local_greedy(art, content: str, new: int) -> str:
    from transformers import AutoTokenizer

    model, tok = quantprep.load(art), AutoTokenizer.from_pretrained(art)
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def start_server(art, port):
    import sys

    from conftest import serve

    stop = serve([sys.executable, "-m", "quantprep", "serve", str(art), "--port", str(port)],
                 f"http://127.0.0.1:{port}/v1/models", "quantprep serve", timeout=120)
    return stop


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import free_port
    from openai import OpenAI

    art = chat_artifact(tmp_path_factory.mktemp("serve"))
    port = free_port()
    stop = start_server(art, port)
    yield art, OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
    stop()


def _chat(client, model, content, new=12, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=new,
                                          temperature=0, **kw)


def test_models_lists_the_artifact_and_a_chat_completion_is_the_local_greedy_one(server):
    art, client = server
    assert [m.id for m in client.models.list().data] == [str(art)]
    reply = _chat(client, str(art), "b c d")
    assert reply.choices[0].message.content == local_greedy(art, "b c d", 12) and reply.usage.completion_tokens == 12


def test_streaming_gives_the_same_text(server):
    art, client = server
    chunks = [c.choices[0].delta.content or "" for c in _chat(client, str(art), "e f g", stream=True) if c.choices]
    assert len([c for c in chunks if c]) > 1 and "".join(chunks) == _chat(client, str(art), "e f g").choices[0].message.content


def test_two_concurrent_requests(server):
    from concurrent.futures import ThreadPoolExecutor

    art, client = server
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda p: _chat(client, str(art), p, new=24).choices[0].message.content, ["h i", "j k"]))
    assert got == [local_greedy(art, "h i", 24), local_greedy(art, "j k", 24)]


def test_a_bad_request_is_4xx_and_the_server_keeps_serving(server):
    import openai

    art, client = server
    with pytest.raises(openai.APIStatusError) as bad:
        _chat(client, "some-other-model", "b c")
    assert bad.value.status_code == 400
    with pytest.raises(openai.APIStatusError) as bad:
        _chat(client, str(art), "b c", extra_body={"not_a_field": 1})
    assert bad.value.status_code == 422
    assert _chat(client, str(art), "b c d").choices[0].message.content == local_greedy(art, "b c d", 12)


def test_serve_a_published_reference(tmp_path, monkeypatch):
    """SRC may be a published reference: the variant that fits is pulled (verified) into the cache, then served."""
    import os

    from conftest import free_port
    from openai import OpenAI

    from quantprep.distribution.publish import publish

    art = chat_artifact(tmp_path / "a")
    publish([art], str(tmp_path / "published"))
    monkeypatch.setenv("QUANTPREP_PULL_CACHE", str(tmp_path / "pulled"))
    port = free_port()
    import sys

    from conftest import serve

    stop = serve([sys.executable, "-m", "quantprep", "serve", f"file://{tmp_path / 'published'}", "--port", str(port)],
                 f"http://127.0.0.1:{port}/v1/models", "quantprep serve", timeout=120, env=dict(os.environ))
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
        [served] = [m.id for m in client.models.list().data]
        assert served.startswith(str(tmp_path / "pulled")) and (Path(served) / "manifest.json").is_file()
        assert _chat(client, served, "b c d").choices[0].message.content == local_greedy(art, "b c d", 12)
    finally:
        stop()


# within the tiny model's 2048-token context; far more than the tokens it streams in the moment a stop
# takes to reach the server, so the request is still running when the server stops
LONG = 2000


def test_sigterm_during_a_request_stops_it_cleanly(tmp_path):
    import signal
    import threading

    import openai
    from conftest import serve_with_client

    art = chat_artifact(tmp_path)
    proc, client = serve_with_client(art)
    try:
        got, first = [], threading.Event()

        def consume():
            try:
                for c in _chat(client, str(art), "n o", new=LONG, stream=True):
                    got.append(c)
                    first.set()
            except openai.APIError:
                pass
            first.set()

        t = threading.Thread(target=consume)
        t.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
        out = proc.stdout.read()
        assert code == 0, out[-3000:]
        t.join(timeout=20)
        print({"chunks_before_stop": len(got)})
        assert not t.is_alive() and 0 < len(got) < LONG
        assert "Shutting down" in out
    finally:
        proc.kill()


def test_serve_refuses_in_one_line(tmp_path):
    """Not an artifact; an artifact built for another CPU: one line, exit 2, before any server starts."""
    import subprocess
    import sys


    def serve_err(src):
        proc = subprocess.run([sys.executable, "-m", "quantprep", "serve", str(src), "--port", "1"], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        return proc.stderr

    assert "not an artifact directory" in serve_err(tmp_path)
    art = chat_artifact(tmp_path / "a")
    edit_manifest(art, lambda m: m["compat"].update(cpu_capability="AVX512_VNNI_AMX"))
    assert "built for cpu_capability=AVX512_VNNI_AMX" in serve_err(art)
