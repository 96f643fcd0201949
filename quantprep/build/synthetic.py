"""Random GPTQ tensors and checkpoints with real shapes, for tests and load-time benchmarks.

The codes are random, so the model's output is noise; the layout, sizes and every step of the
pipeline are real. Quality is tested on checkpoints quantized by gptqmodel instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantprep.format.gptq import pack_cols, pack_rows, v2_to_v1_qzeros


def random_gptq_codes(K: int, N: int, bits: int, group_size: int, sym: bool, act_order: bool,
                      scale_dtype: torch.dtype = torch.float16, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Unpacked GPTQ values of one Linear: codes [K, N], zeros [G, N] (v2), scales [G, N], g_idx [K]."""
    gs = K if group_size == -1 else group_size
    G = math.ceil(K / gs)
    maxq = (1 << bits) - 1
    codes = torch.randint(0, maxq + 1, (K, N), generator=generator)
    if sym:
        zeros = torch.full((G, N), (maxq + 1) // 2)
    else:
        zeros = torch.randint(0, maxq + 1, (G, N), generator=generator)
    scales = (torch.rand(G, N, generator=generator) * 0.02 + 0.001).to(scale_dtype)
    if act_order:
        order = torch.randperm(K, generator=generator)  # GPTQ quantizes inputs in this order
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[order] = (torch.arange(K) // gs).to(torch.int32)
    else:
        g_idx = (torch.arange(K) // gs).to(torch.int32)
    return {"codes": codes, "zeros": zeros, "scales": scales, "g_idx": g_idx}


def pack_gptq(values: dict[str, torch.Tensor], bits: int, v1: bool) -> dict[str, torch.Tensor]:
    """Unpacked values -> on-disk GPTQ tensors (v1 stores zero-1, as GPTQModel saves by default)."""
    qzeros = pack_cols(values["zeros"], bits)
    return {"qweight": pack_rows(values["codes"], bits), "qzeros": v2_to_v1_qzeros(qzeros, bits) if v1 else qzeros,
            "scales": values["scales"], "g_idx": values["g_idx"]}


def random_gptq_tensors(K: int, N: int, bits: int, group_size: int, sym: bool, act_order: bool, v1: bool,
                        bias: bool = False, scale_dtype: torch.dtype = torch.float16,
                        generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """On-disk GPTQ tensors of one Linear (K inputs, N outputs), as GPTQModel would write them."""
    t = pack_gptq(random_gptq_codes(K, N, bits, group_size, sym, act_order, scale_dtype, generator), bits, v1)
    if bias:
        t["bias"] = torch.randn(N, generator=generator).to(scale_dtype)
    return t


def write_random_checkpoint(out: Path, model_config: dict, bits: int = 4, group_size: int = 128,
                            desc_act: bool = True, sym: bool = True, seed: int = 0, lm_head: bool = False,
                            shared_g_idx: bool = True, v1: bool = True) -> Path:
    """A GPTQ checkpoint dir for a Llama/Qwen2-style config (a mixture of experts: one quantized Linear
    per expert projection), with random codes (v1 format, or v2: `v1=False`).
    lm_head=True quantizes lm_head too (GPTQModel's `lm_head=True`), untying it from the embedding.
    shared_g_idx: q/k/v (and gate/up) get one g_idx, as in GPTQModel's checkpoints (they are
    quantized from the same input's Hessian); False gives each its own."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantprep.build.prepack import FUSIONS
    from quantprep.format.expert_names import expert_linear

    g = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.for_model(**model_config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    tensors: dict[str, torch.Tensor] = {}
    quantized = {n: (m.in_features, m.out_features, m.bias is not None) for n, m in skeleton.named_modules()
                 if isinstance(m, torch.nn.Linear) and (lm_head or n != "lm_head")}
    experts = expert_linears(skeleton)
    quantized.update(experts)
    shared: dict[tuple[str, str], torch.Tensor] = {}
    for name in sorted(quantized):
        in_features, out_features, bias = quantized[name]
        layer = random_gptq_tensors(in_features, out_features, bits, group_size, sym, desc_act, v1=v1, bias=bias, generator=g)
        parent, _, child = name.rpartition(".")
        group = next((fused for members, fused in FUSIONS.items() if child in members), None)
        if shared_g_idx and group:
            layer["g_idx"] = shared.setdefault((parent, group), layer["g_idx"]).clone()
        tensors.update({f"{name}.{k}": v for k, v in layer.items()})
    experts_modules = {expert_linear(name).experts for name in experts}
    for name, p in skeleton.state_dict(keep_vars=True).items():  # buffers too: DeepSeek-V3's e_score_correction_bias
        if name.rsplit(".", 1)[0] in quantized or name.rsplit(".", 1)[0] in experts_modules:
            continue
        if name.endswith("norm.weight") or "layernorm" in name:
            tensors[name] = torch.ones(p.shape, dtype=torch.float16)
        else:
            tensors[name] = (torch.randn(p.shape, generator=g) * 0.02).to(torch.float16)
    if cfg.tie_word_embeddings or lm_head:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    qcfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": "gptq" if v1 else "gptq_v2", "lm_head": lm_head}
    cfg_json = cfg.to_dict()
    cfg_json["quantization_config"] = qcfg
    cfg_json["torch_dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2))
    (out / "quantize_config.json").write_text(json.dumps(qcfg, indent=2))
    return out


def expert_linears(skeleton: torch.nn.Module) -> dict[str, tuple[int, int, bool]]:
    """Each expert projection of the model's experts modules (runtime/experts.py), as gptqmodel quantizes
    them, one Linear each (format/expert_names.py names): name -> (in_features, out_features, bias)."""
    from quantprep.format.expert_names import PROJECTIONS
    from quantprep.runtime.experts import experts_layout

    out = {}
    for name, module in skeleton.named_modules():
        try:
            E, H, inter = experts_layout(module)
        except ValueError:
            continue
        sizes = {"gate_proj": (H, inter), "up_proj": (H, inter), "down_proj": (inter, H)}
        out.update({f"{name}.{e}.{p}": (*sizes[p], False) for e in range(E) for p in PROJECTIONS})
    return out


def write_random_checkpoint_sharded(out: Path, model_config: dict, bits: int = 4, group_size: int = 128, desc_act: bool = True,
                                    sym: bool = True, seed: int = 0, shard_bytes: int = 2 << 30) -> Path:
    """A GPTQ checkpoint of any size written with flat memory, for the scale benchmark: one random
    layer per distinct shape, its tensors reused for every layer of that shape, written shard by
    shard with a model.safetensors.index.json as Hugging Face writes it. Same layout as
    write_random_checkpoint (v1 format, shared q/k/v and gate/up g_idx)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantprep.build.prepack import FUSIONS
    from quantprep.format.artifact import ShardWriter

    g = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.for_model(**model_config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    writer = ShardWriter(out, shard_bytes)
    by_shape: dict[tuple[int, int, bool], dict[str, torch.Tensor]] = {}
    linears = {n: m for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    for name, mod in linears.items():
        key = (mod.in_features, mod.out_features, mod.bias is not None)
        if key not in by_shape:
            by_shape[key] = random_gptq_tensors(mod.in_features, mod.out_features, bits, group_size, sym, desc_act, v1=True,
                                                bias=mod.bias is not None, generator=g)
        layer = dict(by_shape[key])
        parent, _, child = name.rpartition(".")
        group = next((members[0] for members in FUSIONS if child in members), None)
        if group and child != group:  # the group's g_idx, as GPTQModel writes it (same shapes along K)
            layer["g_idx"] = by_shape[(mod.in_features, skeleton.get_submodule(f"{parent}.{group}").out_features,
                                       skeleton.get_submodule(f"{parent}.{group}").bias is not None)]["g_idx"]
        writer.add({f"{name}.{k}": v for k, v in layer.items()})
    for name, param in skeleton.named_parameters():
        if name.rsplit(".", 1)[0] in linears or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        fill = torch.ones if name.endswith("norm.weight") or "layernorm" in name else torch.zeros
        writer.add({name: fill(param.shape, dtype=torch.float16)})
    names, _, weight_map = writer.finish()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": writer.total},
                                                                  "weight_map": weight_map}, indent=2))
    qcfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": "gptq", "lm_head": False}
    cfg_json = dict(cfg.to_dict(), quantization_config=qcfg, torch_dtype="float16")
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2))
    (out / "quantize_config.json").write_text(json.dumps(qcfg, indent=2))
    return out
