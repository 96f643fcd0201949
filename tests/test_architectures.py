"""Every architecture on every target (issue 54, item 5): one tiny random model per architecture,
each target's artifact against the same checkpoint dequantized into transformers' float32 model
(tools/eval.dequantized_model: no quantprep kernel in it), and the table in docs/supported.md is
this file's (`python tests/test_architectures.py` prints it; a test pins it).

The checkpoints are random GPTQ codes (build/synthetic.py: milliseconds, int4 group 32 act-order
asym, MoE experts one Linear each as gptqmodel writes them), built once per architecture for the
session. gptqmodel's own checkpoints of these architectures are tested where the machinery differs:
mixtures of experts in tests/test_moe.py (cpu, xpu, cuda against the dense model and GPTQModel's
runtime), Phi-3 and GLM-4's fused Linears in tests/test_fused_mlp.py, Qwen3 and Mistral natively in
tests/test_native_architectures.py.

Compared: every prompt position and one decode step after it (through each runtime's own KV cache).
Bounds: the openvino target computes in f32 (runtime.genai.EXACT) and must equal the cpu float32
artifact within 1e-5 relative (measured up to 1.0e-6) and the dense model as closely; xpu (float16,
emulated) within 5e-3 and top-1 >= 0.95; cuda's CPU path (bfloat16) within 3e-2 and top-1 >= 0.9, as
in test_moe.py. openvino.genai's greedy tokens equal transformers' generate on the dense model.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, add_chat_tokenizer, dense_reference_model, rel_err, top1

import quantprep
from quantprep.build.pipeline import prepack
from quantprep.build.synthetic import write_random_checkpoint
from quantprep.errors import ArtifactMismatch

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, tie_word_embeddings=False, max_position_embeddings=256, pad_token_id=1)
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
# model_type -> config beyond BASE; windows shorter than the prompt, so that they matter
ARCHITECTURES = {
    "llama": {}, "qwen2": dict(tie_word_embeddings=True), "qwen3": {}, "mistral": dict(sliding_window=8),
    "gemma2": dict(sliding_window=8), "gemma3_text": dict(sliding_window=8), "granite": {}, "olmo2": {}, "phi3": {}, "glm4": {},
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(MLA, q_lora_rank=None, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=16.0),
    "deepseek_v3": dict(MLA, q_lora_rank=32, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                        first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5),
}
MOE = {"qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"}
NATIVE = {"llama", "qwen2", "qwen3", "mistral"}  # runtime/architectures.py
TARGETS = ("cpu", "xpu", "cuda", "openvino", "native")
PROMPT = torch.randint(2, 256, (1, 12), generator=torch.Generator().manual_seed(0))
NEXT = 5


def where_tested(arch: str, target: str) -> str:
    """The table's cell: which test checks the pair (a refused pair is checked refused in one line)."""
    if target == "native":
        return "yes (test_native_architectures)" if arch in NATIVE else "refused"
    if arch in MOE and target in ("cpu", "xpu", "cuda"):
        return "yes (test_moe)"
    if arch in ("phi3", "glm4") and target in ("cpu", "xpu"):
        return "yes (test_fused_mlp)"
    return "yes"


def render_table() -> str:
    rows = ["| model_type | " + " | ".join(TARGETS) + " |", "| --- |" + " --- |" * len(TARGETS)]
    rows += [f"| `{arch}` | " + " | ".join(where_tested(arch, t) for t in TARGETS) + " |" for arch in ARCHITECTURES]
    return "\n".join(rows)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """arch -> (its GPTQ checkpoint, the dense float32 reference model), each made the first time."""
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(arch: str):
        if arch not in made:
            gptq = write_random_checkpoint(tmp_path_factory.mktemp(arch) / "gptq", dict(BASE, model_type=arch, **ARCHITECTURES[arch]),
                                           bits=4, group_size=32, desc_act=True, sym=False)
            add_chat_tokenizer(gptq, BASE["vocab_size"])
            made[arch] = gptq, dense_reference_model(gptq, torch.float32).eval()
        return made[arch]

    return get


@torch.no_grad()
def torch_logits(model) -> torch.Tensor:
    """Every prompt position's logits, then one decode step's (token NEXT) through the model's cache."""
    out = model(input_ids=PROMPT, use_cache=True)
    step = model(input_ids=torch.full((1, 1), NEXT), past_key_values=out.past_key_values, use_cache=True)
    return torch.cat([out.logits[0], step.logits[0, -1:]]).float()


def openvino_logits(model) -> torch.Tensor:
    request = model.compiled.create_infer_request()
    request.reset_state()
    n, beam = PROMPT.shape[1], np.zeros(1, np.int32)
    prompt = request.infer({"input_ids": PROMPT.numpy(), "attention_mask": np.ones((1, n), np.int64), "position_ids": np.arange(n)[None],
                            "beam_idx": beam})["logits"][0].copy()
    step = request.infer({"input_ids": np.array([[NEXT]]), "attention_mask": np.ones((1, n + 1), np.int64),
                          "position_ids": np.array([[n]]), "beam_idx": beam})["logits"][0].copy()
    return torch.from_numpy(np.concatenate([prompt, step]))


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_openvino_is_the_model_in_f32_and_genai_runs_it(arch, checkpoint, tmp_path):
    gptq, reference = checkpoint(arch)
    prepack(gptq, "openvino", tmp_path / "openvino")
    prepack(gptq, "cpu", tmp_path / "cpu32", "float32")
    want = torch_logits(reference)
    cpu = torch_logits(quantprep.load(tmp_path / "cpu32"))
    model = quantprep.load(tmp_path / "openvino", dtype=torch.float32)
    got = openvino_logits(model)
    assert rel_err(cpu, want) < 1e-5 and top1(cpu, want) == 1.0
    assert rel_err(got, cpu) < 1e-5, rel_err(got, cpu)
    assert rel_err(got, want) < 1e-5 and top1(got, want) == 1.0
    with torch.no_grad():
        greedy = reference.generate(PROMPT, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, PROMPT.shape[1]:].tolist()
    config = model.generation_config(8)
    config.ignore_eos = True
    assert model.generate_ids(PROMPT[0].tolist(), config) == greedy


HALF = {"xpu": (5e-3, 0.95), "cuda": (3e-2, 0.9)}  # (relative error, top-1 share) against the float32 dense model


@pytest.mark.parametrize("arch,target", [(a, t) for a in ARCHITECTURES for t in sorted(HALF) if where_tested(a, t) == "yes"])
def test_xpu_and_cuda_run_it_within_their_precision(arch, target, checkpoint, tmp_path):
    """Off their devices: the xpu kernel's emulator (float16) and cuda's CPU path (bfloat16)."""
    gptq, reference = checkpoint(arch)
    prepack(gptq, target, tmp_path / target)
    got, want = torch_logits(quantprep.load(tmp_path / target, device="cpu")), torch_logits(reference)
    tol, agree = HALF[target]
    assert rel_err(got, want) < tol and top1(got, want) >= agree, (rel_err(got, want), top1(got, want))


@pytest.mark.parametrize("arch", sorted(set(ARCHITECTURES) - NATIVE))
def test_native_refuses_the_rest_in_one_line_pointing_to_openvino(arch, checkpoint, tmp_path):
    from quantprep.runtime import native_model

    gptq, _ = checkpoint(arch)
    prepack(gptq, "cpu", tmp_path / "cpu")
    with pytest.raises(ArtifactMismatch) as e:
        native_model.load(tmp_path / "cpu")
    assert "\n" not in str(e.value) and "model_type" in str(e.value) and "openvino" in str(e.value), str(e.value)


def test_experts_of_another_activation_are_refused_not_written_as_silu(tmp_path):
    """The graph writes each expert's activation as SiLU; a config that names another (the torch
    targets run it) is refused in one line at prepack."""
    from quantprep.errors import SourceError

    gptq = write_random_checkpoint(tmp_path / "gptq", dict(BASE, model_type="mixtral", hidden_act="gelu", **ARCHITECTURES["mixtral"]),
                                   bits=4, group_size=32)
    with pytest.raises(SourceError, match="activation GELUActivation"):
        prepack(gptq, "openvino", tmp_path / "ov")
    assert not (tmp_path / "ov").exists()


def test_the_architectures_converted_are_the_ones_tested():
    from quantprep.runtime.openvino_graph import ARCHITECTURES as CONVERTED

    assert set(CONVERTED) == set(ARCHITECTURES)


def test_the_table_in_docs_supported_is_this_files():
    doc = (REPO / "docs" / "supported.md").read_text()
    block = re.search(r"<!-- architectures: generated by tests/test_architectures.py -->\n(.*?)\n<!-- end -->", doc, re.S)
    assert block, "docs/supported.md lost its architecture table"
    assert block.group(1) == render_table(), "regenerate it: python tests/test_architectures.py"


if __name__ == "__main__":
    sys.stdout.write(render_table() + "\n")
