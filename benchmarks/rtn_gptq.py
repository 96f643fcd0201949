"""A recipe's float model rounded to nearest into a GPTQ checkpoint, for speed benchmarks where
gptqmodel's calibration takes hours (an AVX2 machine: its forward passes run bfloat16 matmuls
without bfloat16 instructions; the Qwen2.5-Coder-1.5B recipe's estimate was over 3 h on 2 cores).

Same format, sizes and kernel work as the recipe's GPTQ checkpoint: int4, groups of 128, symmetric,
act-order (desc_act: a g_idx permutation, shared by q/k/v and by gate/up as gptqmodel writes it; here a
seeded random one), v1 zeros, float16 scales and float tensors. Only the codes differ (round to
nearest, no calibration), so decode and prefill times are the recipe's and its quality is not: a
speed run on it says so in its JSON (`codes`, from rtn.json beside the checkpoint).

It is written into the build cache (artifacts/.cache/gptq/RECIPE-rtn-SEED), where the benchmarks find
an artifact's checkpoint by content (common.artifact_codes: they record `codes`); then, at the paths
vs_llamacpp.py reads (RECIPE/cpu, and the heads beside it; no calibrated build there):

    quantprep prepack artifacts/.cache/gptq/qwen2.5-coder-1.5b-rtn-0 --target cpu --out artifacts/qwen2.5-coder-1.5b/cpu
    quantprep prepack ... --lm-head int8 --out artifacts/qwen2.5-coder-1.5b-int8-head/cpu   (and int4)

    python benchmarks/rtn_gptq.py qwen2.5-coder-1.5b   (after `make real-setup`; the float model comes from
                                                        quantprep's GGUF export, as `quantprep build` makes it)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

import torch
from common import RTN_RECORD
from safetensors import safe_open
from safetensors.torch import save_file

from quantprep.build.pipeline import cache_dir
from quantprep.build.prepack import FUSIONS
from quantprep.build.recipes import find_recipe
from quantprep.build.synthetic import pack_gptq

GROUP, BITS = 128, 4
CODES = "round to nearest (benchmarks/rtn_gptq.py): speed only, not the recipe's quality"


def rtn_codes(w: torch.Tensor, order: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [N, K] float -> GPTQ values (codes [K, N], zeros [G, N] v2, scales [G, N], g_idx [K]): groups of
    GROUP inputs taken in `order`, symmetric, scale = max|w| / 7, codes round(w / scale) + 8 in [0, 15]."""
    N, K = w.shape
    G = K // GROUP
    grouped = w.float()[:, order].reshape(N, G, GROUP)
    scales = (grouped.abs().amax(-1) / 7).half().clamp_min(torch.finfo(torch.float16).tiny)  # [N, G]; never 0 (0 / 0)
    codes = (grouped / scales.float()[..., None]).round().clamp(-8, 7).to(torch.int32) + 8
    assert 0 <= int(codes.min()) and int(codes.max()) <= 15, "non-finite weights"
    unordered = torch.empty(N, K, dtype=torch.int32)
    unordered[:, order] = codes.reshape(N, K)
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[order] = (torch.arange(K) // GROUP).to(torch.int32)
    return {"codes": unordered.T.contiguous(), "zeros": torch.full((G, N), 8, dtype=torch.int32),
            "scales": scales.T.contiguous(), "g_idx": g_idx}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", help="a recipe that starts from a GGUF (its float export must be in the build cache)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    recipe = find_recipe(args.recipe)
    src = cache_dir() / "float" / f"gguf-{recipe.source['gguf_sha256'][:16]}"
    if not (src / "config.json").is_file():
        print(f"{src}: no float export; run `quantprep build {args.recipe}` until it has exported the GGUF", file=sys.stderr)
        return 2
    out = cache_dir() / "gptq" / f"{args.recipe}-rtn-{args.seed}"
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(args.seed)
    config = json.loads((src / "config.json").read_text())
    tensors, orders = {}, {}
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for name in sorted(f.keys()):
            w = f.get_tensor(name)
            module, _, kind = name.rpartition(".")
            parent, _, child = module.rpartition(".")
            if kind == "weight" and w.dim() == 2 and parent.endswith(("self_attn", "mlp")):
                group = next((fused for members, fused in FUSIONS.items() if child in members), child)  # shared g_idx
                order = orders.setdefault((parent, group), torch.randperm(w.shape[1], generator=g))
                tensors.update({f"{module}.{k}": v for k, v in pack_gptq(rtn_codes(w, order), BITS, v1=True).items()})
            else:
                tensors[name] = w.half()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    qcfg = {"quant_method": "gptq", "bits": BITS, "group_size": GROUP, "desc_act": True, "sym": True,
            "checkpoint_format": "gptq", "lm_head": False}
    config |= {"quantization_config": qcfg, "torch_dtype": "float16"}
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "quantize_config.json").write_text(json.dumps(qcfg, indent=2))
    # what it was rounded from, for the speed runs that check an artifact's source (vs_llamacpp.py: this GGUF)
    (out / RTN_RECORD).write_text(json.dumps({"recipe": args.recipe, "gguf_sha256": recipe.source["gguf_sha256"], "codes": CODES,
                                          "seed": args.seed}, indent=2))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (src / extra).is_file():
            shutil.copy(src / extra, out / extra)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
