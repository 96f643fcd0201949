"""What the cpu target's int4_a8 path (int8 activations: AVX512-VNNI, or AVX2) gains and costs on a real artifact.

Every int4 module is forced onto one path at every M, in one process (with int4_a8, the per-channel
int8 modules of an artifact built with `--lm-head int8` onto int8_a8, and with int4 onto int8):

  - decode: greedy tokens/s after a 16-token prompt (transformers' generate), --new tokens, the
    paths interleaved run by run, medians of --runs;
  - accuracy: the held-out text in windows of 512 tokens (quantprep eval's definition and code),
    each path's perplexity, KL divergence and top-1 agreement against the artifact's reference
    model (the build's float model where cached), and the KL between the two paths themselves.

`benchmarks/tables.py` renders the JSON into BENCHMARKS.md ("llama.cpp, the CPU anchor").

    python benchmarks/cpu_int4_a8.py artifacts/qwen2.5-coder-1.5b/cpu [--windows 4] [--runs 3]
        [--out benchmarks/results/cpu-int4-a8-qwen2.5-coder-1.5b-avx512.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import machine, save

import quantprep
from quantprep.format.artifact import read_checked
from quantprep.targets.cpu import CpuInt4Linear, CpuInt8PerChannelLinear
from quantprep.tools.eval import compare_window, find_reference, read_text, reference_model, token_windows

PATHS = ("int4", "int4_a8")


def force(model, path: str) -> None:
    for m in model.modules():
        if isinstance(m, CpuInt4Linear):
            m.plan, m.plan_max_m = ((1, path),), 1 << 30
        elif isinstance(m, CpuInt8PerChannelLinear):  # its int8 activations path alongside int4_a8
            m.plan, m.plan_max_m = ((1, "int8_a8" if path == "int4_a8" else "int8"),), 1 << 30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--windows", type=int, default=4, help="windows of 512 held-out tokens")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new", type=int, default=32, help="tokens to decode")
    ap.add_argument("--out")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model = quantprep.load(args.artifact).eval()
    modules = [m for m in model.modules() if isinstance(m, CpuInt4Linear)]
    if not modules or "int4_a8" not in modules[0].paths():
        raise SystemExit(f"{args.artifact}: no int4 module with an int4_a8 path here (a cpu artifact; AVX512-VNNI and VBMI, or AVX2 and FMA)")
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    generate = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
    decode = {p: [] for p in PATHS}
    tokens = {}
    with torch.inference_mode():
        for p in PATHS:
            force(model, p)
            model.generate(ids, max_new_tokens=4, do_sample=False)
        for _ in range(args.runs):
            for p in PATHS:
                force(model, p)
                t = time.perf_counter()
                out = model.generate(ids, **generate)
                decode[p].append(args.new / (time.perf_counter() - t))
                tokens[p] = out[0, ids.shape[1]:].tolist()

    text, text_name = read_text()
    windows = token_windows(AutoTokenizer.from_pretrained(args.artifact), text, 512, 512 * args.windows)
    kind, ref_path = find_reference(read_checked(Path(args.artifact)))
    ref = reference_model(kind, ref_path, "cpu")
    stats = {p: [] for p in PATHS}
    between = []
    with torch.inference_mode():
        for w in windows:
            logits = {}
            for p in PATHS:
                force(model, p)
                stats[p].append(compare_window(model, ref, w))
                logits[p] = torch.log_softmax(model(input_ids=w[None]).logits[0, :-1].double(), -1)
            a, b = logits["int4"], logits["int4_a8"]
            between.append(((a.exp() * (a - b)).sum(-1), a.argmax(-1) == b.argmax(-1)))
    accuracy = {}
    for p in PATHS:
        s = {k: torch.cat([w[k] for w in stats[p]]) for k in stats[p][0]}
        accuracy[p] = {"ppl": s["nll"].mean().exp().item(), "reference_ppl": s["ref_nll"].mean().exp().item(),
                       "kld_mean": s["kld"].mean().item(), "kld_p99": torch.quantile(s["kld"].float(), 0.99).item(),
                       "top1_agree": s["top1"].double().mean().item()}
    kld = torch.cat([k for k, _ in between])
    result = {**machine(), "threads": torch.get_num_threads(), "artifact": args.artifact, "new_tokens": args.new,
              "decode_tok_s": {p: {"median": statistics.median(v), "runs": v} for p, v in decode.items()},
              "greedy_same_tokens": sum(x == y for x, y in zip(tokens["int4"], tokens["int4_a8"], strict=True)),
              "reference": kind, "text": {"name": text_name, "windows": len(windows), "ctx": 512},
              "accuracy": accuracy,
              "int4_a8_vs_int4": {"kld_mean": kld.mean().item(), "kld_p99": torch.quantile(kld.float(), 0.99).item(),
                                  "top1_agree": torch.cat([t for _, t in between]).double().mean().item()}}
    print(save(result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
