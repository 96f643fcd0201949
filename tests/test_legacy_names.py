"""Mixtral checkpoints of the transformers 4 era, most of those on the Hub (TheBloke's among them),
name a layer's block `block_sparse_moe` and its experts' projections w1 (gate), w3 (up) and w2
(down). read_checkpoint reads them under transformers 5's names (format/expert_names.current_name),
so the artifact is the one the same weights under today's names give."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import TINY_LLAMA
from safetensors.torch import load_file, save_file

import quantprep
from quantprep.build.pipeline import prepack
from quantprep.build.synthetic import write_random_checkpoint
from quantprep.errors import SourceError
from quantprep.format.artifact import read_manifest

MIXTRAL = dict(TINY_LLAMA, model_type="mixtral", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
LEGACY = {".mlp.": ".block_sparse_moe.", ".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}


def legacy(key: str) -> str:
    if ".experts." not in key and ".mlp.gate." not in key:
        return key
    for new, old in LEGACY.items():
        key = key.replace(new, old)
    return key


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("legacy")
    today = write_random_checkpoint(root / "today", MIXTRAL, bits=4, group_size=32, desc_act=True, sym=False)
    old = root / "old"
    shutil.copytree(today, old)
    for f in old.glob("*.safetensors"):
        save_file({legacy(k): v for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    assert any(".block_sparse_moe.experts.0.w1.qweight" in k for f in old.glob("*.safetensors") for k in load_file(f))
    return today, old


def test_a_legacy_mixtral_checkpoint_gives_the_same_artifact(checkpoints, tmp_path):
    today, old = checkpoints
    prepack(today, "cpu", tmp_path / "today", "float32")
    prepack(old, "cpu", tmp_path / "old", "float32")
    assert read_manifest(tmp_path / "old")["modules"] == read_manifest(tmp_path / "today")["modules"]
    ids = torch.arange(2, 14)[None]
    with torch.no_grad():
        want = quantprep.load(tmp_path / "today")(ids).logits
        got = quantprep.load(tmp_path / "old")(ids).logits
    assert torch.equal(got, want)


def test_a_name_held_twice_is_refused(checkpoints, tmp_path):
    _, old = checkpoints
    both = tmp_path / "both"
    shutil.copytree(old, both)
    [f] = both.glob("*.safetensors")
    tensors = load_file(f)
    key = next(k for k in tensors if k.endswith(".block_sparse_moe.gate.weight"))
    tensors[key.replace(".block_sparse_moe.", ".mlp.")] = tensors[key].clone()
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(SourceError, match="which the checkpoint also holds"):
        prepack(both, "cpu", tmp_path / "art")
    assert not (tmp_path / "art").exists()
