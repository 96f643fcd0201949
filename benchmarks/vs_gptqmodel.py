"""One real GPTQ checkpoint, two CPU runtimes: GPTQModel's own CPU kernel against quantprep's artifact
of the same checkpoint (issue 16), and with --openvino quantprep's openvino artifact of it run by
OpenVINO's CPU plugin at its defaults (issue 31: prefill through the IR, decode through
openvino.genai's pipeline). All loaded in one process, measured side by side, interleaved:

  - perplexity on quantprep's held-out text (the first --windows windows of --ctx tokens, exactly
    `quantprep eval`'s windows), each model's own, and KL(GPTQModel || quantprep) with top-1
    agreement between the two: the same checkpoint should give the same distribution;
  - 512-token prefill: seconds for one forward of the first 512 held-out tokens, median of --runs;
  - decode: greedy tokens/s for --new tokens after a 16-token prompt (generate, KV cache), median
    of --runs, with the two token sequences compared.

GPTQModel runs with BACKEND.TORCH on the CPU by default (its portable CPU kernel; it compiles with
Inductor on first use, so each model gets an untimed warm-up first: a 64-token forward and the
decode; a full-length warm-up is left out, so a first timed prefill may include some compile).
--gptqmodel BACKEND[:DTYPE] names GPTQModel's backend and dtype instead, and may be given more than
once: AUTO is what `GPTQModel.load` picks on this machine. The first one is the reference of the
quality comparison and is called "gptqmodel" in the JSON; the others "gptqmodel_<backend>[_<dtype>]".
The artifact is the cpu build of the same checkpoint, which is found in the build cache by content.

With --dense, the same checkpoint dequantized to a dense bfloat16 model runs beside them (the
floor a weight-only int4 prefill is held to, issue 32); with --profile, each model's 512-token
prefill is split by module kind (quantized or dense linears, attention, norms, the lm_head, ...)
with forward hooks, exclusive times, median of --runs.

With --dense --dense-float32 the float32 model runs too: below AVX512-BF16 torch's bfloat16 GEMM is
several times slower than its float32 one, so there float32 is the dense model a user would run.

On a CPU without AVX512-BF16 BACKEND.TORCH multiplies in torch's bfloat16 reference loop: on a 2-core
AVX2 machine (2026-11-27) it took 599 s for its warm-up and 1720 s for one 512-token prefill of the
1.5B (decode 0.1 tok/s). There GPTQModel's own choice (AUTO: TorchAtenLinear) and TORCH_FUSED in
float32 are the peers a user would run. (TorchFusedLinear's first forward turns on Inductor's
freezing and max_autotune for the whole process: a model that compiles with Inductor after it, such
as BACKEND.TORCH listed after TORCH_FUSED, compiles under those settings.)

    python benchmarks/vs_gptqmodel.py artifacts/qwen2.5-coder-1.5b/cpu [--openvino artifacts/qwen2.5-coder-1.5b/openvino]
        [--gptqmodel AUTO --gptqmodel TORCH_FUSED:float32] [--dense [--dense-float32]] [--profile]
        [--windows 4] [--runs 3] [--new 32] [--out benchmarks/results/vs-gptqmodel-qwen2.5-coder-1.5b-cpu-avx512.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from common import checkpoint_codes, gptqmodel_kernels, is_gptqmodel_backend, machine, median_and_runs, save, timed


def kind(name: str, module) -> str:
    """The profile's category of one module (exclusive time: its children are counted apart)."""
    cls = type(module).__name__
    if name.endswith("lm_head"):
        return "lm_head"
    if "Norm" in cls:
        return "norms"
    if "Attention" in cls:
        return "attention (SDPA, RoPE, cache)"
    if "MLP" in cls:
        return "mlp activation"
    if "Embedding" in cls:
        return "embeddings, rotary"
    if cls == "Linear":
        return "dense linears"
    if "Linear" in cls or "Fused" in cls or cls == "Int4PackedOp":  # Int4PackedOp: TorchFusedLinear's kernel, its child
        return "quantized linears"
    return "rest (model, layers)"


def profile_prefill(model, ids: torch.Tensor, runs: int) -> dict:
    """Milliseconds per module kind in one forward of `ids`, exclusive of children, median of runs."""
    spent: dict[str, list[float]] = {}
    stack: list[list[float]] = []  # per open module: [start, children's time]

    def pre(_m, _args):
        stack.append([time.perf_counter(), 0.0])

    def post(m, _args, _out, name):
        start, children = stack.pop()
        total = time.perf_counter() - start
        if stack:
            stack[-1][1] += total
        now[kind(name, m)] = now.get(kind(name, m), 0.0) + (total - children) * 1e3

    hooks = []
    for name, m in model.named_modules():
        hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(lambda m, a, o, name=name: post(m, a, o, name))]
    try:
        with torch.inference_mode():
            for _ in range(runs):
                now: dict[str, float] = {}
                model(input_ids=ids)
                for k, v in now.items():
                    spent.setdefault(k, []).append(v)
    finally:
        for h in hooks:
            h.remove()
    out = {k: round(statistics.median(v), 1) for k, v in sorted(spent.items(), key=lambda kv: -statistics.median(kv[1]))}
    out["total"] = round(sum(out.values()), 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("artifact")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--gptqmodel", action="append", metavar="BACKEND[:DTYPE]",
                   help="GPTQModel's backend (a gptqmodel.BACKEND name) and dtype; repeatable; default TORCH")
    p.add_argument("--openvino", metavar="DIR", help="the openvino artifact of the same checkpoint")
    p.add_argument("--dense", action="store_true", help="also the checkpoint dequantized to a dense bfloat16 model")
    p.add_argument("--dense-float32", action="store_true",
                   help="with --dense, its float32 model too (below AVX512-BF16 torch's bfloat16 GEMM is slower than its float32 one)")
    p.add_argument("--profile", action="store_true", help="split each model's 512-token prefill by module kind")
    p.add_argument("--out")
    args = p.parse_args()
    if args.dense_float32 and not args.dense:
        p.error("--dense-float32 needs --dense")
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(os.cpu_count()))

    from gptqmodel import BACKEND, GPTQModel

    specs: dict[str, tuple[str, str]] = {}  # JSON name -> (BACKEND name, torch dtype name or "")
    for i, spec in enumerate(args.gptqmodel or ["TORCH"]):
        backend, _, dtype = spec.upper().partition(":")
        if not is_gptqmodel_backend(backend) or dtype and not isinstance(getattr(torch, dtype.lower(), None), torch.dtype):
            p.error(f"--gptqmodel {spec!r}: not BACKEND[:DTYPE] (a gptqmodel.BACKEND name, a torch dtype)")
        dtype = str(getattr(torch, dtype.lower())).removeprefix("torch.") if dtype else ""  # float -> float32
        name = "gptqmodel" if i == 0 else "_".join(["gptqmodel", backend.lower()] + ([dtype] if dtype else []))
        if name in specs or (backend, dtype) in specs.values():
            p.error(f"--gptqmodel {spec!r} given twice")
        specs[name] = backend, dtype
    from transformers import AutoTokenizer

    import quantprep
    from quantprep.build.pipeline import cached_checkpoint
    from quantprep.tools.eval import _ppl, compare_window, read_text, token_windows

    art = Path(args.artifact)
    manifest = json.loads((art / "manifest.json").read_text())
    gptq = cached_checkpoint(manifest["source"]["sha256"])  # the checkpoint the artifact was built from, by content
    if gptq is None:
        raise SystemExit(f"the GPTQ checkpoint {art} was built from is not in the build cache")
    tokenizer = AutoTokenizer.from_pretrained(art)
    text, text_name = read_text()
    windows = token_windows(tokenizer, text, args.ctx, args.windows * args.ctx)

    t0 = time.perf_counter()
    ours = quantprep.load(art)
    load_ours = time.perf_counter() - t0
    models, variants, load_theirs = {}, {}, {}
    for name, (backend, dtype) in specs.items():
        t0 = time.perf_counter()
        models[name] = GPTQModel.load(str(gptq), backend=BACKEND[backend], device="cpu",
                                      **({"dtype": getattr(torch, dtype)} if dtype else {})).model.eval()
        load_theirs[name] = time.perf_counter() - t0
        variants[name] = {"backend": backend, "dtype": dtype or "default",
                          "kernels": gptqmodel_kernels(models[name])}
    theirs = models["gptqmodel"]
    models = {"gptqmodel": theirs, "quantprep": ours} | {k: v for k, v in models.items() if k != "gptqmodel"}
    dense = ({"dense": torch.bfloat16} if args.dense else {}) | ({"dense_float32": torch.float32} if args.dense and args.dense_float32 else {})
    if dense:
        from quantprep.tools.eval import dequantized_model

        for name, dtype in dense.items():
            models[name] = dequantized_model(gptq, dtype).eval()
    dtypes = {k: str(next(m.parameters()).dtype) for k, m in models.items()}
    if args.openvino:
        t0 = time.perf_counter()
        models["openvino"] = quantprep.load(args.openvino)  # the plugin's defaults, what generate and serve run
        models["openvino"].pipeline  # noqa: B018  compiled now, like the others' loads
        load_ov = time.perf_counter() - t0
        hint = models["openvino"].compiled.get_property("INFERENCE_PRECISION_HINT")
        dtypes["openvino"] = f"OpenVINO {getattr(hint, 'get_type_name', lambda: str(hint))()}, int8 dynamic quantization"
    print(f"loaded: quantprep {load_ours:.1f} s, {({k: round(v, 1) for k, v in load_theirs.items()})} s; dtypes {dtypes}; "
          f"{variants}", flush=True)

    prompt = windows[0, :16][None]
    prefill_ids = windows[0][None]
    gen = {"max_new_tokens": args.new, "min_new_tokens": args.new, "do_sample": False}

    def generate(name: str, m) -> list[int]:
        if name == "openvino":  # openvino.genai's pipeline from token ids: its own sampler and KV cache
            import openvino as ov
            import openvino_genai

            config = openvino_genai.GenerationConfig()
            config.max_new_tokens = config.min_new_tokens = args.new
            config.do_sample = False
            return list(m.pipeline.generate(ov.Tensor(prompt.numpy()), config).tokens[0])
        return m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **gen)[0, 16:].tolist()

    outputs, prefill, decode = {}, {k: [] for k in models}, {k: [] for k in models}
    with torch.inference_mode():
        for name, m in models.items():  # warm-up: GPTQModel's TORCH kernel compiles each shape on first use
            t0 = time.perf_counter()
            m(input_ids=prefill_ids[:, :64])
            outputs[name] = generate(name, m)
            print(f"warm-up {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        for _ in range(args.runs):
            for name, m in models.items():
                prefill[name].append(timed(lambda: m(input_ids=prefill_ids)))
                decode[name].append(args.new / timed(lambda: generate(name, m)))
            print(f"run: prefill {({k: round(v[-1], 2) for k, v in prefill.items()})} s, "
                  f"decode {({k: round(v[-1], 2) for k, v in decode.items()})} tok/s", flush=True)
        # quality: GPTQModel as the reference, quantprep as the model (KL(GPTQModel || quantprep))
        t0, parts = time.perf_counter(), []
        for w in windows:
            parts.append(compare_window(ours, theirs, w))
        quality_s = time.perf_counter() - t0
        ov_parts = [compare_window(models["openvino"], theirs, w) for w in windows] if args.openvino else []
    profiles = {k: profile_prefill(m, prefill_ids, args.runs) for k, m in models.items() if k != "openvino"} if args.profile else None
    stats = {k: torch.cat([x[k] for x in parts]) for k in parts[0]}
    stored = next((v for v in manifest.get("eval", {}).values() if v["ctx"] == args.ctx), None)
    result = machine() | {
        "gptqmodel": __import__("gptqmodel").__version__,
        "model": manifest["source"].get("model", gptq.name),
        "artifact": str(art),
        **checkpoint_codes(gptq),
        "dtypes": dtypes,
        "gptqmodel_variants": variants,
        "load_in_process_s": {**load_theirs, "quantprep": load_ours, **({"openvino": load_ov} if args.openvino else {})},
        "prefill_512_s": {k: median_and_runs(v) for k, v in prefill.items()},
        "decode_tok_s": {k: median_and_runs(v) for k, v in decode.items()},
        "decode_new_tokens": args.new,
        "kcache": {k: v for k, v in ours.quantprep_kcache.items() if k in ("status", "plan", "trusted")},
        "threads": torch.get_num_threads(),
        "prefill_profile_ms": profiles,
        # greedy tokens both produce before the first difference (after it, the contexts differ)
        "same_greedy_prefix": next((i for i, (a, b) in enumerate(zip(outputs["gptqmodel"], outputs["quantprep"], strict=True)) if a != b), args.new),
        "quality": {"text": text_name, "ctx": args.ctx, "windows": len(windows), "tokens": int(stats["nll"].numel()),
                    "ppl": {"quantprep": _ppl(stats["nll"]), "gptqmodel": _ppl(stats["ref_nll"])},
                    "kld_gptqmodel_quantprep": {"mean": stats["kld"].mean().item(),
                                                "p99": torch.quantile(stats["kld"].float(), 0.99).item()},
                    "top1_agree": stats["top1"].double().mean().item(), "s": round(quality_s, 1)},
        "stored_eval": stored and {k: stored[k] for k in ("ppl", "ppl_ratio", "kld", "top1_agree", "tokens", "reference")},
    }
    for k in ("prefill_512_s", "decode_tok_s"):
        r = result[k]
        for name in [*variants, *dense]:
            r[f"quantprep_over_{name}"] = r["quantprep"]["median"] / r[name]["median"]
        for name in dense:
            r[f"gptqmodel_over_{name}"] = r["gptqmodel"]["median"] / r[name]["median"]
        if args.openvino:
            r["openvino_over_gptqmodel"] = r["openvino"]["median"] / r["gptqmodel"]["median"]
            r["openvino_over_quantprep"] = r["openvino"]["median"] / r["quantprep"]["median"]
    if args.openvino:
        ov_stats = {k: torch.cat([x[k] for x in ov_parts]) for k in ov_parts[0]}
        result["openvino"] = {"artifact": args.openvino, "ppl": _ppl(ov_stats["nll"]),
                              "kld_gptqmodel_openvino": {"mean": ov_stats["kld"].mean().item(),
                                                         "p99": torch.quantile(ov_stats["kld"].float(), 0.99).item()},
                              "top1_agree": ov_stats["top1"].double().mean().item(),
                              "same_greedy_prefix": next((i for i, (a, b) in enumerate(zip(outputs["gptqmodel"], outputs["openvino"],
                                                                                           strict=True)) if a != b), args.new)}
    print(save(result, args.out))


if __name__ == "__main__":
    main()
