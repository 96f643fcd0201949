"""Writes tests/data/gptqmodel/ for tests/test_architectures.py: in <arch>/, each architecture's tiny
random float model (ARCHITECTURES there) as the real gptqmodel quantizes it (int4, group 32, act-order,
sym); in gptqmodel_logits.safetensors, GPTQModel's own runtime's logits on each (TORCH backend,
float16: every PROMPT position, then one decode step of NEXT); in versions.json, which gptqmodel,
transformers and torch wrote them. All quantized in one process, all run in one fresh process.

    python tests/make_gptqmodel_matrix.py    # about 60 s on 2 shared cores; then commit tests/data/gptqmodel
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "gptqmodel"
LOGITS = DATA / "gptqmodel_logits.safetensors"  # not in a checkpoint dir: prepack reads every *.safetensors there
# what gptqmodel writes that the tests need (not its logs, nor quantprep_quantize.json's timing)
KEEP = ("config.json", "generation_config.json", "model.safetensors", "quantize_config.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json")


def float_model(arch: str, out: Path) -> Path:
    """The seeded float model of ARCHITECTURES[arch], with a word-level tokenizer of the calibration
    text's most common words (the rest are <unk>) and a chat template (openvino.genai wants one)."""
    from collections import Counter

    import torch
    from conftest import CALIB, CHAT_TEMPLATE
    from safetensors.torch import load_file, save_file
    from test_architectures import ARCHITECTURES, BASE, UNROUTED
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    words = [w for w, _ in Counter(CALIB.split()).most_common(BASE["vocab_size"] - 2)]
    tk = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}, unk_token="<unk>"))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix="##")  # decodes joined by spaces
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(out)
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **{**BASE, **ARCHITECTURES[arch]}, eos_token_id=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    if arch == "deepseek_v3":
        weights = load_file(out / "model.safetensors")
        weights[f"{UNROUTED.rsplit('.', 2)[0]}.gate.e_score_correction_bias"][-1] = -1e4
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def quantize_all(work: Path, archs: list[str]) -> None:
    from quantprep.build.quantize import builtin_calibration, quantize_gptq

    # mixtral first: after qwen3_moe, gptqmodel 7.7 maps Mixtral's experts wrongly in the same process
    # ("LazyTurtle: ... checkpoint tensor could not be reshaped into the target layout")
    for arch in sorted(archs, key=lambda a: a != "mixtral"):
        print(f"make_gptqmodel_matrix: quantizing {arch}", file=sys.stderr, flush=True)
        quantize_gptq(float_model(arch, work / arch / "float"), work / arch / "gptq", 4, 32, True, True, builtin_calibration(17))


def record(out: Path, dirs: list[Path]) -> None:
    """GPTQModel's logits of each checkpoint in `dirs`, [PROMPT positions + 1, vocab], into the file `out` by dir name."""
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from safetensors.torch import save_file
    from test_architectures import NEXT, PROMPT

    logits = {}
    for d in dirs:
        # TORCH backend: GPTQModel's default CPU kernels crash on K % group_size != 0; it runs fp16/bf16 only
        model = GPTQModel.load(str(d), backend=BACKEND.TORCH, device="cpu", dtype=torch.float16).model
        with torch.no_grad():
            prompt = model(input_ids=PROMPT, use_cache=True)
            step = model(input_ids=torch.full((1, 1), NEXT), past_key_values=prompt.past_key_values, use_cache=True)
        logits[d.name] = torch.cat([prompt.logits[0], step.logits[0, -1:]]).float().contiguous()
    save_file(logits, str(out))


def run_record(out: Path, dirs: list[Path]) -> None:
    """record() in a fresh process: gptqmodel's worker pools and patches stay out of the caller's.
    TORCHDYNAMO_DISABLE: GPTQModel's TORCH kernel compiles its dequantize (about 10 s a model here);
    eager gave the same logits bit for bit on all 14 models."""
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([sys.executable, __file__, "--record", str(out), *map(str, dirs)], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("gptqmodel", "transformers", "torch")}


def main() -> None:
    from test_architectures import ARCHITECTURES

    archs = list(ARCHITECTURES)
    shutil.rmtree(DATA, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        quantize_all(work, archs)
        for arch in archs:
            (DATA / arch).mkdir(parents=True)
            for name in KEEP:
                if (work / arch / "gptq" / name).exists():
                    shutil.copy(work / arch / "gptq" / name, DATA / arch / name)
        run_record(LOGITS, [DATA / a for a in archs])
    (DATA / "versions.json").write_text(json.dumps(versions(), indent=1) + "\n")


if __name__ == "__main__":  # tests/ is on sys.path: conftest and test_architectures import
    if sys.argv[1:2] == ["--record"]:
        record(Path(sys.argv[2]), [Path(d) for d in sys.argv[3:]])
    else:
        main()
