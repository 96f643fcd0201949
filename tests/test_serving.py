"""Prefill bucketing (serving.py): a prompt run at warmed lengths only, padded on the right and
cropped from the KV cache, gives the real tokens the logits and cache of the unpadded run.

Exactness is checked in float64 on the dense reference model (padding and chunking change the
GEMMs' row count, and float32 kernels round differently per row count: ~1e-4 absolute on SmolLM2's
logits). On a quantprep artifact in float32: relative error <= 1e-5 and the same greedy tokens.
"""

import pytest
import torch
from conftest import dense_reference_model, rel_err

import quantprep
from quantprep.serving import bucket_for, generate, prefill

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
    from quantprep.build import build_artifacts

    build_artifacts(random_gptq, {"path": str(random_gptq)}, ["cpu"], lambda t: tmp_path / "a", "float32", progress=False)
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
    from quantprep.recipes import find_recipe
    from quantprep.serving import PREFILL_BUCKETS

    assert find_recipe("qwen2.5-1.5b").warm_shapes == PREFILL_BUCKETS
    assert all(b / a <= 1.1 + 8 / a for a, b in zip(PREFILL_BUCKETS[1:], PREFILL_BUCKETS[2:], strict=False))  # <= 10% + rounding
