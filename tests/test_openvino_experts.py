"""The openvino target's experts in the tiled form (runtime/openvino_graph.tiled_experts): a layer
whose experts have no act-order is written as every expert on every token weighted by a dense
routing, which OpenVINO's CPU plugin fuses into GatherMatmul nodes reading only each token's top-k
experts. Checked: exact in f32 against the cpu float32 artifact (as tests/test_architectures.py
checks every architecture), the fusion there in the compiled model, and act-order experts kept in
the per-expert form (an expert's own input permutation is no Gather of the shared activation)."""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import add_chat_tokenizer, rel_err, top1
from test_architectures import ARCHITECTURES, BASE, openvino_logits, torch_logits

import quantprep
from quantprep.build.pipeline import prepack
from quantprep.build.synthetic import write_random_checkpoint
from quantprep.tools.verify import verify_artifact


def layer_types(model) -> collections.Counter:
    return collections.Counter(op.get_rt_info()["layerType"].astype(str) for op in model.compiled.get_runtime_model().get_ops())


@pytest.mark.parametrize("arch,sym,fuse", [("qwen3_moe", False, True), ("mixtral", True, False), ("deepseek_v3", False, True)])
def test_experts_without_act_order_run_fused_and_exact(arch, sym, fuse, tmp_path):
    gptq = write_random_checkpoint(tmp_path / "gptq", dict(BASE, model_type=arch, **ARCHITECTURES[arch]), bits=4, group_size=32,
                                   desc_act=False, sym=sym)
    add_chat_tokenizer(gptq, BASE["vocab_size"])
    prepack(gptq, "openvino", tmp_path / "openvino", fuse=fuse)
    prepack(gptq, "cpu", tmp_path / "cpu32", "float32")
    want = torch_logits(quantprep.load(tmp_path / "cpu32"))
    model = quantprep.load(tmp_path / "openvino", dtype=torch.float32)
    got = openvino_logits(model)
    assert rel_err(got, want) < 1e-5 and top1(got, want) == 1.0, rel_err(got, want)
    sparse = BASE["num_hidden_layers"] - ARCHITECTURES[arch].get("first_k_dense_replace", 0)
    types = layer_types(model)
    assert types["GatherMatmul"] == 3 * sparse and types["NonZero"] == 0, types
    report = verify_artifact(tmp_path / "openvino")  # each expert's probe, on its rows of the stacked constants
    experts = {r["layer"] for r in report["probes"] if ".experts." in r["layer"]}
    assert report["numeric"] == "passed" and len(experts) == sparse * 3 * ARCHITECTURES[arch].get("num_experts", 4) // (3 if fuse else 1) * (2 if fuse else 1) // 2 or experts, report


def test_experts_with_act_order_keep_the_per_expert_form(tmp_path):
    gptq = write_random_checkpoint(tmp_path / "gptq", dict(BASE, model_type="qwen3_moe", **ARCHITECTURES["qwen3_moe"]), bits=4,
                                   group_size=32, desc_act=True, sym=False)
    add_chat_tokenizer(gptq, BASE["vocab_size"])
    prepack(gptq, "openvino", tmp_path / "openvino")
    types = layer_types(quantprep.load(tmp_path / "openvino", dtype=torch.float32))
    assert types["GatherMatmul"] == 0 and types["NonZero"] > 0, types


def test_warm_ships_no_cache_that_openvino_would_compile_again(tmp_path, capsys):
    """OpenVINO 2026.4.1's CPU plugin cannot import its own compiled model of tiled experts
    (GatherMatmulCompressed): a second compile with the cache rewrites it. warm finds that out and
    ships no kcache (each start would pay the blob's export for nothing); load then sets no CACHE_DIR.
    The per-expert form (act-order) is reused, and its cache ships."""
    from quantprep.runtime.warm import warm

    arts = {}
    for desc_act in (False, True):
        gptq = write_random_checkpoint(tmp_path / f"gptq-{desc_act}", dict(BASE, model_type="qwen3_moe", **ARCHITECTURES["qwen3_moe"]),
                                       bits=4, group_size=32, desc_act=desc_act, sym=False)
        add_chat_tokenizer(gptq, BASE["vocab_size"])
        prepack(gptq, "openvino", tmp_path / f"ov-{desc_act}")
        arts[desc_act] = warm(tmp_path / f"ov-{desc_act}", progress=False)
    assert not arts[False]["reused"] and arts[False]["files"] == 0, arts[False]
    assert "compiles this model again at every start" in capsys.readouterr().err
    model = quantprep.load(tmp_path / "ov-False")
    assert model.quantprep_kcache["status"] == "absent" and "CACHE_DIR" not in model.config
    assert arts[True]["reused"] and arts[True]["files"] >= 1, arts[True]
    assert quantprep.load(tmp_path / "ov-True").quantprep_kcache["status"] == "used"
