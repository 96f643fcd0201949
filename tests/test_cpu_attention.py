"""quantprep's decode attention on the CPU (runtime/cpu_attention.py) against a float64 reference, its
fallbacks to transformers' SDPA, and its use by a loaded artifact."""

import pickle

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err, top1
from native_c import require_c

from quantprep.runtime import cpu_attention

require_c(cpu_attention.kernel() is not None)

# the output's bfloat16 rounding alone is ~1.1e-3 relative (RMS); both kernels' errors: benchmarks/experiments/results/cpu-decode-attention-avx512.json
TOL = 4e-3


class Attention:
    """What sdpa_attention_forward reads of a transformers attention module: 2 query heads per key/value head."""
    num_key_value_groups, is_causal, training = 2, True, False


def reference(q, k, v):
    """[B, H, 1, D] x [B, KV, S, D] in float64, grouped heads repeated -> [B, 1, H, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q.double(), k, v).transpose(1, 2)


@pytest.mark.parametrize("B,H,KV,D,S", [(1, 12, 2, 128, 1), (1, 12, 2, 128, 300), (2, 9, 3, 64, 7), (1, 4, 4, 32, 65)])
def test_matches_float64_reference(B, H, KV, D, S):
    g = torch.Generator().manual_seed(S)
    q, k, v = (torch.randn(B, n, t, D, generator=g).to(torch.bfloat16) for n, t in ((H, 1), (KV, S), (KV, S)))
    assert cpu_attention.runs_here(q, k, v, None, 0.0, {})  # the kernel, not the fallback, computes it
    out, weights = cpu_attention.attention(None, q, k, v, None)
    assert weights is None and out.shape == (B, 1, H, D) and out.dtype == torch.bfloat16
    assert rel_err(out, reference(q, k, v)) < TOL


def test_scores_past_exps_range():
    """Scores of about 128, and about 16 for another head: the kernel subtracts each head's largest
    score before exp (exp overflows float32 past 88), wherever in the cache it is."""
    g = torch.Generator().manual_seed(1)
    S, peak = 197, 67
    q, k, v = (torch.randn(1, n, t, 64, generator=g) for n, t in ((8, 1), (2, S), (2, S)))
    k[0, 0, peak] = 2 * q[0, 0, 0]  # head 0's score there: 2 |q|^2 / 8, about 16 (the others: a few)
    k[0, 1, peak] = 16 * q[0, 4, 0]  # head 4's: about 128
    k[0, 1, -1] = 15 * q[0, 4, 0]  # and a second peak, in the last row
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    assert cpu_attention.runs_here(q, k, v, None, 0.0, {})  # the kernel, not SDPA's fallback
    out, _ = cpu_attention.attention(None, q, k, v, None)
    assert torch.isfinite(out).all() and rel_err(out, reference(q, k, v)) < TOL


def test_strided_cache_and_query():
    """A cache view (the first S rows of a longer buffer) and a query view with its own strides."""
    g = torch.Generator().manual_seed(0)
    k_buf, v_buf = (torch.randn(2, 2, 64, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = k_buf[:, :, :40], v_buf[:, :, :40]
    q = torch.randn(2, 6, 3, 32, generator=g).to(torch.bfloat16)[:, :, 1:2]  # [B, H, 1, D] inside a longer one
    assert not k.is_contiguous() and not q.is_contiguous() and cpu_attention.runs_here(q, k, v, None, 0.0, {})
    out, _ = cpu_attention.attention(None, q, k, v, None, scaling=0.3)
    groups = 3
    ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(groups, 1),
                                         v.double().repeat_interleave(groups, 1), scale=0.3).transpose(1, 2)
    assert rel_err(out, ref) < TOL


def test_tensors_without_data_never_reach_it():
    """Meta tensors, fake tensors (export) and jit tracing take SDPA: the kernel would read through their pointers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = [torch.randn(1, n, t, 32).to(torch.bfloat16) for n, t in ((4, 1), (2, 5), (2, 5))]
    meta = [t.to("meta") for t in real]
    assert cpu_attention.runs_here(*real, None, 0.0, {})
    assert not cpu_attention.runs_here(real[0], meta[1], meta[2], None, 0.0, {})
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in real]
        assert not cpu_attention.runs_here(*fake, None, 0.0, {})
    traced = torch.jit.trace(lambda q, k, v: cpu_attention.attention(Attention(), q, k, v, None)[0], real, check_trace=False)
    other = [torch.randn_like(t) for t in real]
    assert rel_err(traced(*other), cpu_attention.attention(Attention(), *other, None)[0]) < TOL  # the graph holds SDPA


@pytest.mark.parametrize("case", ["mask", "two tokens", "float32", "softcap"])
def test_falls_back_to_sdpa(case):
    """What the kernel does not compute goes to transformers' SDPA, whose result comes back unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(1)
    T = 2 if case == "two tokens" else 1
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    q, k, v = (torch.randn(1, n, t, 32, generator=g).to(dtype) for n, t in ((4, T), (2, 9), (2, 9)))
    mask = torch.ones(1, 1, T, 9, dtype=torch.bool).index_fill(-1, torch.tensor([0]), False) if case == "mask" else None  # hides a key
    assert not cpu_attention.runs_here(q, k, v, mask, 0.0, {"softcap": 30.0} if case == "softcap" else {})
    if case != "softcap":  # transformers' SDPA refuses a softcap itself
        ours, _ = cpu_attention.attention(Attention(), q, k, v, mask)
        theirs, _ = sdpa_attention_forward(Attention(), q, k, v, mask)
        assert torch.equal(ours, theirs)


def test_a_mask_that_hides_no_key_is_none():
    """A sliding window's mask at decode, whose cache holds only the window: every key through, the kernel's result."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, n, t, 32, generator=g).to(torch.bfloat16) for n, t in ((4, 1), (2, 9), (2, 9)))
    mask = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    assert cpu_attention.runs_here(q, k, v, mask, 0.0, {}) and not cpu_attention.runs_here(q, k, v, mask[..., 1:], 0.0, {})
    assert torch.equal(cpu_attention.attention(Attention(), q, k, v, mask)[0], cpu_attention.attention(Attention(), q, k, v, None)[0])


def profiled_step(model, ids, past) -> tuple[torch.Tensor, int]:
    """(logits, how many SDPA ops ran) of one forward."""
    from torch.profiler import profile

    with profile() as prof:
        logits = model(input_ids=ids, past_key_values=past).logits
    return logits, sum(e.count for e in prof.key_averages() if "scaled_dot_product" in e.key)


def test_a_loaded_artifact_decodes_with_it(random_artifact):
    """quantprep.load on the CPU switches "sdpa" to the kernel: a decode step runs no SDPA op and gives
    the logits of the same model on transformers' SDPA."""
    import quantprep

    model = quantprep.load(random_artifact)
    assert model.quantprep_attention == cpu_attention.NAME
    prompt = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    logits = {}
    with torch.inference_mode():
        for name in (cpu_attention.NAME, "sdpa"):
            model.set_attn_implementation(name)
            out = model(input_ids=prompt, use_cache=True)  # prefill: SDPA either way
            logits[name], calls = profiled_step(model, torch.tensor([[7]]), out.past_key_values)
            assert (calls == 0) == (name == cpu_attention.NAME), f"{name}: {calls} SDPA ops in a decode step"
    assert rel_err(logits[cpu_attention.NAME], logits["sdpa"]) < 2e-2
    assert top1(logits[cpu_attention.NAME], logits["sdpa"]) == 1.0


def test_append_is_concatenation():
    """Appends into spare room give torch.cat's values, through a reallocation, a crop and a replaced tensor."""
    g = torch.Generator().manual_seed(3)
    chunks = [torch.randn(2, 3, n, 16, generator=g) for n in (5, 1, 1, 300, 1, 1)]
    cached, buffer, rows, reference = torch.tensor([]), None, 0, torch.empty(2, 3, 0, 16)
    buffers = []
    for chunk in chunks:
        cached, buffer, rows = cpu_attention.append(cached, buffer, rows, chunk)
        reference = torch.cat([reference, chunk], dim=-2)
        buffers.append(buffer.data_ptr())
        assert torch.equal(cached, reference)
    assert buffers[0] == buffers[1] == buffers[2] != buffers[3] == buffers[4] == buffers[5]  # grew once, at the 300 rows
    handed_out = cached.clone()
    cropped, reference = cached[..., :-2, :], reference[..., :-2, :]  # DynamicLayer.crop: a shorter view of the buffer
    new = torch.randn(2, 3, 1, 16, generator=g)
    grown, buffer2, rows2 = cpu_attention.append(cropped, buffer, rows, new)
    assert torch.equal(grown, torch.cat([reference, new], dim=-2)) and rows2 == reference.shape[-2] + 1
    assert torch.equal(cached, handed_out) and buffer2.data_ptr() != buffer.data_ptr()  # the earlier view is unchanged
    selected = grown[[1, 0]]  # DynamicLayer.batch_select_indices: a new tensor, copied into a new buffer
    regrown, buffer3, _ = cpu_attention.append(selected, buffer2, rows2, new[[1, 0]])
    assert buffer3.data_ptr() != buffer2.data_ptr() and torch.equal(regrown, torch.cat([selected, new[[1, 0]]], dim=-2))
    elsewhere = torch.randn(buffer3.shape, generator=g)[:, :, :regrown.shape[-2]]  # the buffer's strides, another tensor
    grown, _, _ = cpu_attention.append(elsewhere, buffer3, regrown.shape[-2], new)
    assert torch.equal(grown, torch.cat([elsewhere, new], dim=-2))


def test_a_cache_from_inference_mode_grows_outside_it():
    """generate runs under no_grad: a buffer made under inference_mode cannot be written there, so it is copied."""
    with torch.inference_mode():
        cached, buffer, rows = cpu_attention.append(torch.tensor([]), None, 0, torch.ones(1, 2, 3, 16))
    with torch.no_grad():
        grown, _, _ = cpu_attention.append(cached, buffer, rows, torch.zeros(1, 2, 1, 16))
    assert torch.equal(grown, torch.cat([torch.ones(1, 2, 3, 16), torch.zeros(1, 2, 1, 16)], dim=-2))


def test_a_loaded_model_grows_its_cache_in_place(random_artifact):
    """The cache a loaded model is called with holds GrowingLayers after the call, and decoding with it
    gives the logits of the same steps on plain concatenating layers."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    import quantprep

    class Concatenating(DynamicLayer):  # not converted: the hook converts exactly DynamicLayer
        pass

    model = quantprep.load(random_artifact)
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    runs, caches = {}, {}
    with torch.inference_mode():
        for name in ("growing", "concatenating"):
            cache = DynamicCache(config=model.config)
            if name == "concatenating":
                cache.layers = [Concatenating() for _ in cache.layers]
            ids, logits = prompt, []
            for _ in range(4):
                out = model(input_ids=ids, past_key_values=cache)
                logits.append(out.logits[:, -1])
                ids = out.logits[:, -1:].argmax(-1)
            runs[name] = (torch.cat(logits), [type(layer).__name__ for layer in cache.layers])
            caches[name] = cache
    assert set(runs["growing"][1]) == {"GrowingLayer"} and set(runs["concatenating"][1]) == {"Concatenating"}
    assert torch.equal(runs["growing"][0], runs["concatenating"][0])
    restored = pickle.loads(pickle.dumps(caches["growing"]))  # pickles as DynamicLayers holding the same values
    assert [type(layer).__name__ for layer in restored.layers] == ["DynamicLayer"] * len(restored.layers)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
               for a, b in zip(restored.layers, caches["concatenating"].layers, strict=True))
