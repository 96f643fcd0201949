"""Reading GPTQ checkpoints: layouts we accept, and bad input refused with one line naming the tensor."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantprep.build.prepack import prepare_layer
from quantprep.build.source import read_checkpoint
from quantprep.errors import SourceError

Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.0.mlp.down_proj"  # K=160, group 64: partial last group


@pytest.fixture
def ckpt_dir(random_gptq):
    return random_gptq


def _edit(ckpt_dir, fn):
    path = ckpt_dir / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, str(path))


def _edit_config(ckpt_dir, **changes):
    for name in ("quantize_config.json",):
        cfg = json.loads((ckpt_dir / name).read_text())
        cfg.update(changes)
        (ckpt_dir / name).write_text(json.dumps(cfg))


def test_reads_valid_checkpoint(ckpt_dir):
    ckpt = read_checkpoint(ckpt_dir)
    assert len(ckpt.layers) == 7 and ckpt.quant.bits == 4 and ckpt.quant.desc_act
    down = ckpt.layers[DOWN]
    assert (down.in_features, down.out_features, down.group_size) == (160, 64, 64)
    assert "lm_head.weight" in ckpt.other_tensors and "model.embed_tokens.weight" in ckpt.other_tensors
    assert len(ckpt.sha256) == 64


def test_sharded_equals_single(ckpt_dir, tmp_path):
    tensors = load_file(ckpt_dir / "model.safetensors")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for f in ("config.json", "quantize_config.json"):
        (sharded / f).write_text((ckpt_dir / f).read_text())
    keys = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2], "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for fname, ks in halves.items():
        save_file({k: tensors[k] for k in ks}, str(sharded / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    a, b = read_checkpoint(ckpt_dir), read_checkpoint(sharded)
    assert a.layers.keys() == b.layers.keys()
    for name in a.layers:
        assert torch.equal(prepare_layer(a.layers[name]).dequantize(), prepare_layer(b.layers[name]).dequantize())


def test_config_from_config_json_and_v2(ckpt_dir):
    """No quantize_config.json: config.json's quantization_config is used; v2 zeros are read as is."""
    from quantprep.format.gptq import v1_to_v2_qzeros

    (ckpt_dir / "quantize_config.json").unlink()
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (ckpt_dir / "config.json").write_text(json.dumps(cfg))
    v1 = load_file(ckpt_dir / "model.safetensors")[f"{Q}.qzeros"]
    _edit(ckpt_dir, lambda t: t.update({f"{Q}.qzeros": v1_to_v2_qzeros(t[f"{Q}.qzeros"], 4)}))
    ckpt = read_checkpoint(ckpt_dir)
    assert ckpt.quant.checkpoint_format == "gptq_v2"
    assert torch.equal(ckpt.layers[Q].qzeros, v1_to_v2_qzeros(v1, 4))


BAD_TENSORS = [
    ("wrong qweight dtype", lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"].float()}), f"{Q}.qweight"),
    ("qzeros shape", lambda t: t.update({f"{Q}.qzeros": t[f"{Q}.qzeros"][:, :1].contiguous()}), f"{Q}.qzeros"),
    ("scales group count", lambda t: t.update({f"{DOWN}.scales": t[f"{DOWN}.scales"][:2]}), f"{DOWN}.scales"),
    ("nan scale", lambda t: t[f"{Q}.scales"].view(-1).__setitem__(3, float("nan")), f"{Q}.scales"),
    ("inf scale", lambda t: t[f"{Q}.scales"].view(-1).__setitem__(0, float("inf")), f"{Q}.scales"),
    ("missing qzeros", lambda t: t.pop(f"{Q}.qzeros"), f"{Q}.qzeros"),
    ("missing qweight", lambda t: t.pop(f"{Q}.qweight"), f"{Q}.qweight"),
    ("g_idx out of range", lambda t: t[f"{Q}.g_idx"].__setitem__(0, 7), f"{Q}.g_idx"),
    ("g_idx not a grouping", lambda t: t.update({f"{DOWN}.g_idx": torch.zeros(160, dtype=torch.int32)}), f"{DOWN}.g_idx"),
    ("g_idx wrong length", lambda t: t.update({f"{Q}.g_idx": t[f"{Q}.g_idx"][:10]}), f"{Q}.g_idx"),
    ("bias shape", lambda t: t.update({f"{Q}.bias": torch.zeros(3, dtype=torch.float16)}), f"{Q}.bias"),
]


@pytest.mark.parametrize("what,edit,tensor", BAD_TENSORS, ids=[b[0] for b in BAD_TENSORS])
def test_bad_tensor_names_the_tensor(ckpt_dir, what, edit, tensor):
    _edit(ckpt_dir, edit)
    with pytest.raises(SourceError) as e:
        read_checkpoint(ckpt_dir)
    msg = str(e.value)
    assert tensor in msg and "\n" not in msg, msg


@pytest.mark.parametrize("changes,needle", [
    ({"bits": 3}, "bits=3"), ({"bits": 2}, "bits=2"), ({"dynamic": {"-:.*": {}}}, "dynamic"),
    ({"checkpoint_format": "marlin"}, "marlin"), ({"quant_method": "awq"}, "awq"), ({"group_size": 0}, "group_size"),
])
def test_bad_quant_config(ckpt_dir, changes, needle):
    _edit_config(ckpt_dir, **changes)
    with pytest.raises(SourceError, match=needle):
        read_checkpoint(ckpt_dir)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(SourceError, match="not a directory"):
        read_checkpoint(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SourceError, match="GPTQ checkpoint"):
        read_checkpoint(tmp_path)


def test_pickle_bin_files_are_never_read(ckpt_dir):
    (ckpt_dir / "model.safetensors").rename(ckpt_dir / "pytorch_model.bin")
    with pytest.raises(SourceError, match="pickle"):
        read_checkpoint(ckpt_dir)


def test_truncated_safetensors(ckpt_dir):
    p = ckpt_dir / "model.safetensors"
    p.write_bytes(p.read_bytes()[:1000])
    with pytest.raises(SourceError, match="model.safetensors"):
        read_checkpoint(ckpt_dir)


NO_PICKLE = """
import pickle

def _refuse(*args, **kwargs):
    raise RuntimeError("pickle used on the default path")

class _Unpickler(pickle.Unpickler):
    def load(self):
        _refuse()

pickle.load = pickle.loads = _refuse
pickle.Unpickler = pickle._Unpickler = _Unpickler
"""


def test_default_paths_never_unpickle(tiny_gptq4, tmp_path):
    """Issue 13: every process (and the fresh-process check build starts) runs with pickle's loaders
    raising: build (prepack, write, the fresh-process check), inspect, verify, and load through
    generate must still pass. A failing control proves the hook is active."""
    import subprocess
    import sys

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(NO_PICKLE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))

    def quantprep(*args):
        return subprocess.run([sys.executable, "-m", "quantprep", *args], env=env, capture_output=True, text=True, timeout=900)

    control = subprocess.run([sys.executable, "-c", "import pickle; pickle.loads(pickle.dumps(1))"], env=env, capture_output=True, text=True)
    assert control.returncode != 0 and "pickle used on the default path" in control.stderr
    art = tmp_path / "art"
    for args in (["prepack", str(tiny_gptq4), "--target", "cpu", "--out", str(art)],
                 ["build", "smollm2-135m", "--source", str(tiny_gptq4), "--out", str(tmp_path / "built"), "--no-warm"],
                 ["inspect", str(art)], ["verify", str(art)], ["generate", str(art), "--max-new-tokens", "2"]):
        proc = quantprep(*args)
        assert proc.returncode == 0, (args, proc.stderr[-2000:])


@pytest.mark.parametrize("content", [b"\xff\xfe not utf8", b"[1, 2]", b'{"bits": '])
def test_bad_json_files_are_one_line_errors(ckpt_dir, content):
    (ckpt_dir / "quantize_config.json").write_bytes(content)
    with pytest.raises(SourceError, match="quantize_config.json") as e:
        read_checkpoint(ckpt_dir)
    assert "\n" not in str(e.value)



def test_large_float_tensors_are_converted_block_by_block(tmp_path):
    """read_converted (embeddings and other float tensors at prepack): a tensor past block_bytes is
    written by write_safetensors a block of rows at a time, with the bytes of a whole `.to(dtype)`;
    smaller and integer tensors come back whole."""
    from quantprep.build.source import LazyTensors, StoredRows
    from quantprep.format.artifact import write_safetensors

    emb, ids = torch.randn(1003, 40, dtype=torch.float16), torch.arange(7, dtype=torch.int64)
    save_file({"emb": emb, "ids": ids}, tmp_path / "m.safetensors")
    lazy = LazyTensors(tmp_path, {"emb": "m.safetensors", "ids": "m.safetensors"}, ["emb", "ids"])
    dtypes = [torch.bfloat16, torch.float32, torch.float16]
    for block in (1 << 30, 40 * 2 * 10, 1):  # whole; 10 rows (the last block partial); one row
        got = lazy.read_converted("emb", dtypes, block_bytes=block)
        assert all(isinstance(t, StoredRows) for t in got) == (block < emb.numel() * 2)
        write_safetensors(tmp_path / "out.safetensors", {f"emb.{i}": t for i, t in enumerate(got)} | {"ids": ids}, {})
        out = load_file(tmp_path / "out.safetensors")
        for i, d in enumerate(dtypes):
            assert out[f"emb.{i}"].dtype == d and torch.equal(out[f"emb.{i}"], emb.to(d))
        (whole,) = lazy.read_converted("ids", [torch.bfloat16], block_bytes=block)
        assert torch.equal(whole, ids)
