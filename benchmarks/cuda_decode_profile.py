"""Where decode time goes on CUDA: torch.profiler over 16 greedy decode steps of quantprep's int4
model and of a dense bf16 model with the same Qwen2.5-1.5B shapes (random codes/weights).

    PYTHONPATH=. python3 benchmarks/cuda_decode_profile.py
"""

import tempfile
from pathlib import Path

import torch
from cuda_kernels import QWEN_CFG  # same shapes as the kernel benchmark (run from benchmarks/ on sys.path)
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM

import quantprep
from quantprep.build import prepack
from quantprep.synthetic import write_random_checkpoint


def decode_profile(model, label: str) -> None:
    ids = torch.randint(0, 150000, (1, 16), device="cuda")
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False)
    with torch.no_grad():
        model.generate(**kw, max_new_tokens=4, min_new_tokens=4)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model.generate(**kw, max_new_tokens=16, min_new_tokens=16)
            torch.cuda.synchronize()
    print(f"==== {label}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=40))


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        gptq = write_random_checkpoint(Path(d) / "gptq", QWEN_CFG, bits=4, group_size=128, desc_act=True, sym=True)
        prepack(gptq, "cuda", Path(d) / "cuda")
        decode_profile(quantprep.load(Path(d) / "cuda"), "quantprep int4")
        # A dense model from the artifact's own config.json: separates config effects from the int4 modules.
        art_cfg = AutoConfig.from_pretrained(Path(d) / "cuda")
        del art_cfg.quantization_config
        with torch.device("cuda"):
            dense_art = AutoModelForCausalLM.from_config(art_cfg, dtype=torch.bfloat16).eval()
        print("artifact config attn:", art_cfg._attn_implementation, "dense config attn:",
              AutoConfig.for_model(**QWEN_CFG)._attn_implementation)
        decode_profile(dense_art, "dense bf16, artifact config")
        del dense_art
    with torch.device("cuda"):
        dense = AutoModelForCausalLM.from_config(AutoConfig.for_model(**QWEN_CFG), dtype=torch.bfloat16).eval()
    decode_profile(dense, "dense bf16")


if __name__ == "__main__":
    main()
