"""Kernel plans on one machine: a model's 512-token prefill with the plan `warm` decided here,
against each module's fixed rule, each single path forced, and the dense bfloat16 model of the same
checkpoint; decode (M = 1) too. A random GPTQ checkpoint of the chosen shapes (Qwen2.5-1.5B, 7B) is
prepacked for --target, warmed (the plan's timing is reported), and loaded once; the variants run
interleaved in one process, medians of --runs (cuda: CUDA graph replays; the CPU: eager, no
KV cache, the last position's logits).

    python benchmarks/plan_prefill.py --target cuda --models 1.5b,7b --out benchmarks/results/plan-prefill-cuda-h100.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import QWEN_1_5B, machine, save, timed

QWEN_7B = dict(QWEN_1_5B, hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
               vocab_size=152064, tie_word_embeddings=False)
MODELS = {"1.5b": QWEN_1_5B, "7b": QWEN_7B}


def timed_ms(fn, cuda: bool) -> float:
    return timed(fn, cuda) * 1e3


def graph_replay(model, ids):
    """A CUDA graph of one forward (no cache, last logits): the GPU's work without Python's launch
    time, which made eager prefills of the 1.5B vary 2x from run to run on an H200."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return g.replay


def one_model(name: str, target: str, runs: int, root: Path) -> dict:
    import quantprep
    from quantprep.build.pipeline import prepack
    from quantprep.build.synthetic import write_random_checkpoint_sharded
    from quantprep.runtime.warm import warm
    from quantprep.targets.packed import PackedLinear
    from quantprep.tools.eval import dequantized_model

    gptq = write_random_checkpoint_sharded(root / f"gptq-{name}", MODELS[name], bits=4, group_size=128, desc_act=True, sym=True)
    art = root / f"{name}-{target}"
    prepack(gptq, target, art)
    t0 = time.perf_counter()
    report = warm(art, shapes=[1, 16, 64, 128, 256, 512], progress=False)
    warm_s = time.perf_counter() - t0
    model = quantprep.load(art)
    cuda = model.device.type == "cuda"
    modules = [m for m in model.modules() if isinstance(m, PackedLinear) and len(m.paths()) > 1]
    planned = {id(m): (m.plan, m.plan_max_m) for m in modules}
    paths = modules[0].paths()

    def use(variant: str) -> None:
        for m in modules:
            m.plan, m.plan_max_m = planned[id(m)] if variant == "plan" else ((), 0) if variant == "fixed rule" else (((1, variant),), 1 << 30)

    dense = dequantized_model(gptq, torch.bfloat16).to(model.device).eval()
    ids = torch.randint(0, 1000, (1, 512), generator=torch.Generator().manual_seed(0)).to(model.device)
    variants = ["plan", "fixed rule", *paths, "dense"]
    prefill, decode = {v: [] for v in variants}, {v: [] for v in variants}
    with torch.inference_mode():
        for r in range(runs + 1):  # the first round warms up (Triton compiles, oneDNN primitives)
            for v in variants:
                m = dense if v == "dense" else model
                if v != "dense":
                    use(v)
                if cuda:  # each variant's graph, captured with its paths
                    p = timed_ms(graph_replay(m, ids), cuda)
                    d = timed_ms(graph_replay(m, ids[:, :1]), cuda)
                else:
                    p = timed_ms(lambda m=m: m(input_ids=ids, use_cache=False, logits_to_keep=1), cuda)
                    d = timed_ms(lambda m=m: m(input_ids=ids[:, :1], use_cache=False, logits_to_keep=1), cuda)
                if r:
                    prefill[v].append(p)
                    decode[v].append(d)
    use("plan")
    med = {k: statistics.median(v) for k, v in prefill.items()}
    return {"warm_s": round(warm_s, 2), "plan_s": report["plan"]["s"], "plan": report["plan"]["shapes"],
            "prefill512_ms": {k: {"median": med[k], "runs": v} for k, v in prefill.items()},
            "forward_m1_ms": {k: {"median": statistics.median(v), "runs": v} for k, v in decode.items()},
            "prefill512_over_dense": {k: med[k] / med["dense"] for k in med}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="cpu")
    p.add_argument("--models", default="1.5b")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    res = machine() | {"target": args.target, "threads": torch.get_num_threads(), "models": {}}
    if args.target == "cuda":
        import importlib.metadata

        from quantprep.targets.cuda import mslk_available

        res["device"] = torch.cuda.get_device_name()
        res["mslk"] = importlib.metadata.version("mslk-cuda") if mslk_available() else None  # its path is a variant where installed
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            res["models"][name] = one_model(name, args.target, args.runs, Path(tmp))
            print({k: round(v, 3) for k, v in res["models"][name]["prefill512_over_dense"].items()}, flush=True)
            save(res, args.out)
    print(save(res, args.out))


if __name__ == "__main__":
    main()
