"""Fused q/k/v and gate/up (issue 3): planned only where exact, same logits as the unfused
artifact, the member fallback is correct, and no activation is held between calls."""

import json

import pytest
import torch
from conftest import prepacked_module, random_cpu_artifact

import quantprep
from quantprep.build.prepack import fusion_plan
from quantprep.runtime.fused import FusedGroup, FusedMember

CFG = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 160,
       "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": False}


def test_plan_groups_members_in_any_order():
    names = sorted(f"model.layers.{i}.{m}" for i in range(2) for m in
                   ("self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"))
    plan = dict(fusion_plan(names))
    assert plan["model.layers.0.self_attn.qkv_proj"] == [f"model.layers.0.self_attn.{c}" for c in ("q_proj", "k_proj", "v_proj")]
    assert plan["model.layers.1.mlp.gate_up_proj"] == ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    assert plan["model.layers.0.self_attn.o_proj"] == ["model.layers.0.self_attn.o_proj"]
    assert sorted(m for members in plan.values() for m in members) == names  # every layer exactly once
    assert all(len(m) == 1 for _, m in fusion_plan(names, fuse=False))
    partial = [n for n in names if not n.endswith("layers.0.self_attn.v_proj")]
    assert "model.layers.0.self_attn.qkv_proj" not in dict(fusion_plan(partial))  # a member missing: no fusion


def _artifact(tmp_path, name, act_dtype, shared=True, fuse=True, bits=4, sym=True):
    return random_cpu_artifact(tmp_path, CFG, name, act_dtype, fuse, bits=bits, group_size=32, desc_act=True, sym=sym,
                               shared_g_idx=shared)


def _modules(art):
    return json.loads((art / "manifest.json").read_text())["modules"]


@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (8, False)])
def test_fused_artifact_gives_the_unfused_logits(tmp_path, bits, sym):
    fused = _artifact(tmp_path, "fused", "float32", bits=bits, sym=sym)
    plain = _artifact(tmp_path, "plain", "float32", fuse=False, bits=bits, sym=sym)
    mods = _modules(fused)
    assert mods["model.layers.1.self_attn.qkv_proj"]["fused"]["sizes"] == [64, 32, 32]
    assert mods["model.layers.1.mlp.gate_up_proj"]["fused"]["members"] == ["gate_proj", "up_proj"]
    assert not any("fused" in m for m in _modules(plain).values())
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = quantprep.load(fused)(ids).logits, quantprep.load(plain)(ids).logits
    # float32 activations: the fused matmul computes each output column as the separate one does.
    assert ((a - b).norm() / b.norm()).item() < 1e-5
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    from quantprep.tools.verify import verify_artifact

    verify_artifact(fused)


def test_different_act_order_is_not_fused(tmp_path):
    art = _artifact(tmp_path, "art", "float32", shared=False)
    mods = _modules(art)
    assert "model.layers.0.self_attn.q_proj" in mods and not any(m.get("fused") for m in mods.values())


def test_member_fallback_and_no_held_activations(tmp_path):
    art = _artifact(tmp_path, "art", "bfloat16")
    model = quantprep.load(art)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedMember)
    group: FusedGroup = attn.q_proj.group
    x = torch.randn(1, 5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        whole = attn.qkv_proj(x)
        for i, member in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)):  # called outside attention: fallback
            assert torch.equal(member(x), whole.split([64, 32, 32], -1)[i])
        model(torch.randint(0, 256, (1, 7)))
    assert group.state is None  # every slice consumed: no activation held


def test_fused_model_compiles(tmp_path, monkeypatch):
    """torch.compile traces the MLP with its fused gate/up; outputs match eager."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    art = _artifact(tmp_path, "art", "bfloat16")
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        eager = quantprep.load(art)(ids).logits.float()
        compiled = quantprep.load(art, compile=True)(ids).logits.float()
    assert ((compiled - eager).norm() / eager.norm()).item() < 2e-2  # bf16; Inductor fuses in fp32


def test_two_threads_sharing_a_group_get_their_own_slices():
    """Two serving threads on one model: each member call must return the slice of its own input.
    The matmuls release the GIL, so the threads interleave inside `output`."""
    import threading

    from quantprep.build.source import QuantConfig
    from quantprep.build.synthetic import random_gptq_tensors

    raw = random_gptq_tensors(256, 96, 4, 64, True, True, True, generator=torch.Generator().manual_seed(0))
    _, fused, _ = prepacked_module("cpu", raw, QuantConfig(4, 64, True, True, "gptq"), torch.bfloat16)
    group = FusedGroup(fused, [32, 32, 32])
    members = [FusedMember(group, i, 256) for i in range(3)]
    errors = []

    def serve(seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(300):
            x = torch.randn(64, 256, generator=gen).bfloat16()
            with torch.no_grad():
                want = fused(x).split([32, 32, 32], -1)
                got = [m(x) for m in members]
            errors.extend(i for i in range(3) if not torch.equal(got[i], want[i]))

    threads = [threading.Thread(target=serve, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
