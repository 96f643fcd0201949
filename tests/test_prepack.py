"""Unpack + act-order permutation against a dense reference built directly from the raw values."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantprep.build.prepack import act_order_perm, can_fuse, prepare_layer, prepare_layers
from quantprep.build.source import QuantConfig, _validate_layer
from quantprep.build.synthetic import pack_gptq, random_gptq_codes


def dense_truth(v: dict, K: int) -> torch.Tensor:
    """W[k, n] = (code[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n], by plain gathers."""
    g = v["g_idx"].long()
    # float32 like dequantize(): each element is one subtraction and one product, so the two agree exactly.
    return (v["codes"].float() - v["zeros"].float()[g]) * v["scales"].float()[g]


combos = st.tuples(st.sampled_from([4, 8]), st.sampled_from([-1, 32, 64, 128]), st.booleans(), st.booleans(), st.booleans())


@settings(max_examples=80, deadline=None)
@given(combo=combos, k_groups=st.integers(1, 5), k_extra=st.sampled_from([0, 8, 16, 40]), n8=st.integers(1, 6),
       seed=st.integers(0, 2**31 - 1), scale_dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
       block=st.sampled_from([1 << 24, 1, 300]))
def test_unpack_dequantize_matches_truth(combo, k_groups, k_extra, n8, seed, scale_dtype, block):
    bits, group_size, sym, act_order, v1 = combo
    K = k_groups * (group_size if group_size > 0 else 64) + k_extra  # k_extra > 0: partial last group
    N = 8 * n8
    gen = torch.Generator().manual_seed(seed)
    v = random_gptq_codes(K, N, bits, group_size, sym, act_order, scale_dtype, generator=gen)
    q = QuantConfig(bits, group_size, sym, act_order, "gptq" if v1 else "gptq_v2")
    layer = prepare_layers("m", [_validate_layer("m", pack_gptq(v, bits, v1), q)])
    assert torch.equal(layer.unpack_codes(block), layer.codes)  # block: codes per step
    # With a single group every input order groups the same, so act-order needs no gather.
    single_group = group_size == -1 or K <= group_size
    assert (layer.perm is None) == (not act_order or single_group)
    assert torch.equal(layer.dequantize(), dense_truth(v, K))


def _layers(n_out: list[int], K: int = 320, seed: int = 0, same_g_idx: bool = True):
    gen, q, out = torch.Generator().manual_seed(seed), QuantConfig(4, 64, True, True, "gptq"), []
    for i, n in enumerate(n_out):
        v = random_gptq_codes(K, n, 4, 64, True, True, generator=gen)
        if same_g_idx and out:
            v["g_idx"] = out[0].g_idx.to(torch.int32)
        out.append(_validate_layer(f"m{i}", pack_gptq(v, 4, True), q))
    return out


@pytest.mark.parametrize("block", [1 << 24, 1, 1000])
def test_fused_unpack_is_the_members_side_by_side(block):
    layers = _layers([48, 16, 32])
    parts = [prepare_layer(x) for x in layers]
    fused = prepare_layers("qkv", layers)
    assert fused.out_features == 96 and torch.equal(fused.perm, parts[0].perm)
    assert torch.equal(fused.unpack_codes(block), torch.cat([x.codes for x in parts], 1))
    for field in ("qweight", "codes", "zeros", "scales"):
        assert torch.equal(getattr(fused, field), torch.cat([getattr(x, field) for x in parts], 1)), field
    assert torch.equal(fused.dequantize(), torch.cat([x.dequantize() for x in parts], 1))


def test_layers_with_different_g_idx_are_not_fused():
    layers = _layers([16, 16], same_g_idx=False)
    assert not can_fuse(layers)
    with pytest.raises(ValueError, match="cannot be fused"):
        prepare_layers("qkv", layers)


@pytest.mark.parametrize("block", [1 << 23, 1, 5000])
def test_blockwise_reference_matmul_equals_the_dense_product(block):
    layer = prepare_layers("m", _layers([40], K=328))  # partial last group, act-order
    x = torch.randn(4, 328, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ layer.dequantize().double()
    y = layer.reference_matmul(x, block=block)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_identity_permutation_is_skipped():
    assert act_order_perm(torch.arange(256) // 128) is None
    g = torch.tensor([1, 0, 1, 0])
    assert torch.equal(act_order_perm(g), torch.tensor([1, 3, 0, 2]))  # stable: ties keep input order


def test_prepack_memory_stays_flat_as_the_model_grows(tmp_path):
    """Streaming prepack (issue 18): a checkpoint 4x larger (4 vs 16 layers of 25 MB of int4 codes)
    raises the prepack process's peak RSS by far less than its size; holding the model (the
    source, or the prepacked tensors until the write, as before) would add 2 x 300 MB. Nor does a
    512 MiB float16 embedding, converted to bfloat16 block by block as it is written (2026-11-23:
    +44 MB; held whole with its source copy beside it, as before, +888 MB)."""
    import contextlib
    import shutil
    import subprocess
    import sys
    import time

    from quantprep.build.synthetic import write_random_checkpoint_sharded

    def peak_rss_mib(layers: int, vocab: int = 1024, intermediate: int = 5504) -> float:
        cfg = {"model_type": "qwen2", "hidden_size": 2048, "intermediate_size": intermediate, "num_hidden_layers": layers,
               "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": vocab, "tie_word_embeddings": True}
        name = f"{layers}-{vocab}-{intermediate}"
        src = write_random_checkpoint_sharded(tmp_path / f"gptq{name}", cfg, shard_bytes=64 << 20)
        # the peak is VmHWM of the child's own memory, polled: wait4's ru_maxrss would include this
        # process's RSS (Linux folds the spawner's into the child's), which held the checkpoint just written
        peak_kib = 0
        with open(tmp_path / f"err{name}", "w+b") as err:
            proc = subprocess.Popen([sys.executable, "-m", "quantprep", "prepack", str(src), "--target", "cpu", "--out",
                                     str(tmp_path / f"art{name}"), "--shard-size", "64", "--json"],
                                    stdout=subprocess.DEVNULL, stderr=err)
            while proc.poll() is None:
                with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/status") as f:
                    peak_kib = max([peak_kib] + [int(line.split()[1]) for line in f if line.startswith("VmHWM:")])
                time.sleep(0.02)
        assert proc.returncode == 0, (tmp_path / f"err{name}").read_text()[-2000:]
        assert len(list((tmp_path / f"art{name}").glob("model-*.safetensors"))) > 1  # shards of 64 MiB
        shutil.rmtree(src)
        return peak_kib / 1024

    small, large, big_embedding = peak_rss_mib(4), peak_rss_mib(16), peak_rss_mib(4, vocab=131072)
    # 6x wider MLPs (a fused gate/up of 135 M codes, as wide as a 14B's): layers are unpacked, probed and
    # packed a block at a time, so only the layer's own codes and packed result should count
    wide = peak_rss_mib(3, intermediate=6 * 5504)
    print({"peak_rss_mib": {"4 layers": small, "16 layers": large, "4 layers, 512 MiB embedding": big_embedding,
                            "3 layers, 6x wider MLP": wide}})
    assert large - small < 250 and big_embedding - small < 250, (small, large, big_embedding)
    assert wide - small < 400, (small, wide)
