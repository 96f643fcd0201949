"""Mixture-of-experts speed on this CPU, side by side (issue 54, item 6): GPTQModel 7.7 against
quantprep's cpu and openvino artifacts of one random GPTQ checkpoint with Qwen3-30B-A3B's layer
shapes (qwen3_moe, hidden 2048, 32 heads / 4 KV heads of 128, 128 experts, 8 per token, expert
intermediate 768, vocab 151936) but only --layers layers; int4, group 128, random codes (the output
is noise; the shapes, the routing and every kernel are real).

  The openvino artifact is warmed for CPU (`quantprep warm DIR --device CPU`: OpenVINO's compiled
  model in its kcache, trusted here because this user built it), as it is published for CPU serving.

  1. first token: from the spawn of a fresh `python -c` (time.time() in the parent) to the first
     greedy token after a 16-token prompt, median of --runs processes each:
       gptqmodel  GPTQModel.load(GPTQ_DIR, device="cpu", backend=--backend) + generate 1 token
       cpu        quantprep.load(cpu artifact) + generate 1 token
       openvino   quantprep.load(openvino artifact) + generate_ids(ids, generation_config(1))
     quantprep checks an artifact in full once per user (a mark in QUANTPREP_VERIFIED_DIR, here a
     fresh temporary one), and GPTQModel's first start on a machine took far longer than its later
     ones (its load step, 74.6 s of an 80 s first start on a tiny check; not yet explained): each
     runtime's first run is reported apart
     (`first_token_first_run_s`), the medians are of the runs after it, as every start after a user's first.
  2. decode: greedy tokens/s of --new tokens after the 16-token prompt (timed from the first new
     token to the last, so the prompt's forward is left out), one process per runtime and depth, one
     untimed warm-up generates (torch.compile may recompile once a shape turns dynamic), then median of
     --runs. With a few layers the float lm_head (151936 x 2048 bfloat16, 622 MB read per token, the
     same in every runtime) is most of a token; --more-layers N also measures decode with N layers, and
     the difference gives each runtime's time per layer and its decode for all 48 layers (a line through
     the two measurements: `per_layer_ms`, `decode_48_layers_tok_s`). --runs rounds, each runtime's
     two depths back to back in each: each figure and ratio is the median of the rounds' (this host's
     speed drifts within minutes, and a depth's difference amplifies it). Decode reads memory: a layer's
     bytes (`layer_bytes`: its attention's and top-k experts' int4 codes and scales) at this machine's
     read rate (`read_bandwidth_gb_s`: torch summing 2 GiB) is the floor under every runtime
     (`per_layer_floor_ms`), and so bounds any ratio to GPTQModel's per-layer time.
  3. GPTQModel's XPU repack: TorchFusedLinear.transform_xpu (gptqmodel/nn_modules/qlinear/torch_fused.py,
     run once per Linear at its first forward on an XPU: unpack, g_idx reorder, repack column by
     column in Python) timed on CPU tensors for one MoE layer's experts x 3 projections (the CPU
     cost of it; on Arc the tensors are on the GPU and each step is a kernel launch).

Goals: first token <= 0.3x GPTQModel's, decode >= 2x GPTQModel's.

    GPTQMODEL_CPU_WORKERS=2 python benchmarks/moe_speed.py [--layers 2] [--more-layers 6] [--desc-act] [--runs 3] [--new 32]
        [--backend AUTO] [--work DIR] [--out benchmarks/results/moe-speed-qwen3-30b-a3b-cpu-avx512.json]
    tiny check: ... --layers 1 --experts 8 --hidden 256 --vocab 4096 --runs 1 --new 8
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from common import REPO, child_env, machine, median_and_runs, run_child, save

# Qwen3-30B-A3B's config.json, but for num_hidden_layers (--layers)
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
                 "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                 "norm_topk_prob": True, "intermediate_size": 6144, "vocab_size": 151936, "max_position_embeddings": 40960,
                 "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
PROMPT = list(range(1000, 1016))  # 16 token ids (taken modulo the vocabulary)

CHILD = """
import json, sys, time
t0 = time.perf_counter()
runtime, path, mode, new, runs, backend = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:6]), sys.argv[6]
info = {}
if runtime == "openvino":
    import openvino_genai
    import quantprep
    t1 = time.perf_counter()
    model = quantprep.load(path)
    info["kcache"] = model.quantprep_kcache.get("status")
    ids = [i % model.vocab_size() for i in PROMPT]

    class Stamps(openvino_genai.StreamerBase):
        def write(self, token):
            stamps.extend([time.perf_counter()] * (len(token) if isinstance(token, list) else 1))
            return openvino_genai.StreamingStatus.RUNNING

        def end(self):
            pass

    def generate(n):
        config = model.generation_config(n)
        config.min_new_tokens = n
        return model.generate_ids(ids, config, Stamps())
else:
    import torch
    from transformers.generation.streamers import BaseStreamer
    if runtime == "gptqmodel":
        from gptqmodel import BACKEND, GPTQModel
        t1 = time.perf_counter()
        model = GPTQModel.load(path, device="cpu", backend=BACKEND[backend]).model.eval()
        info["kernels"] = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "qweight")})
    else:
        import quantprep
        t1 = time.perf_counter()
        model = quantprep.load(path)
    info["dtype"] = str(next(model.parameters()).dtype)
    ids = torch.tensor([[i % model.config.vocab_size for i in PROMPT]])

    class Stamps(BaseStreamer):
        def put(self, value):
            if value.shape[-1] == 1 or value.dim() == 1:  # a new token; the prompt comes first, [1, 16]
                stamps.append(time.perf_counter())

        def end(self):
            pass

    def generate(n):
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, streamer=Stamps())
        return out[0, ids.shape[1]:].tolist()
stamps = []
t2 = time.perf_counter()
if mode == "first":
    tokens = generate(1)
    print(tokens, flush=True)
    info.update(done_at=time.time(), import_s=t1 - t0, load_s=t2 - t1, first_generate_s=time.perf_counter() - t2)
else:
    for _ in range(2):  # warm-up: kernels compile on first use, torch.compile again when a shape turns dynamic
        generate(new)
    rates = []
    for _ in range(runs):
        stamps.clear()
        tokens = generate(new)
        assert len(stamps) == new == len(tokens), (len(stamps), len(tokens))
        rates.append((new - 1) / (stamps[-1] - stamps[0]))
    info.update(tok_s=rates, tokens=tokens)
print(json.dumps(info))
"""


def build(work: Path, config: dict, desc_act: bool) -> dict[str, Path]:
    """The random GPTQ checkpoint, its word-level tokenizer and both artifacts under `work` (reused when there)."""
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import add_chat_tokenizer

    from quantprep.build.pipeline import prepack
    from quantprep.build.synthetic import write_random_checkpoint
    from quantprep.format.artifact import read_manifest
    from quantprep.runtime.kcache import trust_reason
    from quantprep.runtime.warm import warm

    paths = {"gptqmodel": work / "gptq", "cpu": work / "cpu", "openvino": work / "openvino"}
    for name, path in paths.items():
        if path.exists():
            if name == "openvino" and "kcache" in (manifest := read_manifest(path)) and trust_reason(path, manifest) is None:
                # warmed by another trust store
                warm(path, device="CPU", progress=False)
            continue
        t = time.perf_counter()
        if name == "gptqmodel":
            write_random_checkpoint(path, config, bits=4, group_size=128, desc_act=desc_act, sym=True)
            # the test tokenizer's words grow with its vocabulary (151936 of them: a tokenizer.json past the
            # artifact's 64 MiB bound); the prompts use ids below 4096
            add_chat_tokenizer(path, min(config["vocab_size"], 4096))
        else:
            prepack(paths["gptqmodel"], name, path)
            if name == "openvino":  # as published for CPU serving: OpenVINO's compiled model in its kcache
                warm(path, device="CPU", progress=False)
        print(f"built {path}: {time.perf_counter() - t:.1f} s", flush=True)
    return paths


def xpu_repack(config: dict, desc_act: bool, experts: int) -> dict:
    """Seconds of GPTQModel's TorchFusedLinear.transform_xpu over `experts` experts x (gate, up, down)
    of one layer, on CPU tensors (what its first XPU forward runs per Linear), float16 scales."""
    import torch
    from gptqmodel.nn_modules.qlinear.torch_fused import TorchFusedLinear

    from quantprep.build.synthetic import pack_gptq, random_gptq_codes

    h, m = config["hidden_size"], config["moe_intermediate_size"]
    g = torch.Generator().manual_seed(0)
    per: dict[str, list[float]] = {"gate_proj": [], "up_proj": [], "down_proj": []}
    for _ in range(experts):
        for proj, (k, n) in {"gate_proj": (h, m), "up_proj": (h, m), "down_proj": (m, h)}.items():
            layer = TorchFusedLinear(bits=4, group_size=128, sym=True, desc_act=desc_act, in_features=k, out_features=n)
            t = pack_gptq(random_gptq_codes(k, n, 4, 128, True, desc_act, generator=g), 4, v1=False)  # v2: GPTQModel's in memory
            for name, v in t.items():
                getattr(layer, name).copy_(v)
            layer.post_init()
            t0 = time.perf_counter()
            layer.transform_xpu(torch.float16)
            per[proj].append(time.perf_counter() - t0)
    return {"function": "gptqmodel.nn_modules.qlinear.torch_fused.TorchFusedLinear.transform_xpu", "experts": experts,
            "s": sum(map(sum, per.values())), "per_linear_median_s": {k: median_and_runs(v)["median"] for k, v in per.items()}}


def layer_bytes(config: dict, group_size: int = 128) -> int:
    """Bytes a decoded token reads per layer: its attention's and its top-k experts' int4 codes with
    float16 scales per group, and the bfloat16 router (norms and the KV cache left out)."""
    h, heads, kv, d = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    linears = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h)]
    linears += [(h, config["moe_intermediate_size"])] * 2 * config["num_experts_per_tok"]
    linears += [(config["moe_intermediate_size"], h)] * config["num_experts_per_tok"]
    return sum(k * n // 2 + k // group_size * n * 2 for k, n in linears) + h * config["num_experts"] * 2


def read_bandwidth_gb_s(runs: int = 5) -> float:
    """This machine's memory read rate with torch's threads: the median time to sum 2 GiB."""
    import torch

    x = torch.ones(1 << 28, dtype=torch.int64)
    x.sum()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 8 / median_and_runs(times)["median"] / 1e9


def decode_summary(result: dict, rounds: list[dict], layers: int, more_layers: int | None) -> None:
    """Medians over the rounds ({runtime: {depth: tok/s}}) into result: decode_tok_s (and _more_layers),
    per_layer_ms (the slope between the two depths, each round's), decode_48_layers_tok_s (the line
    through them at 48 layers), and each round's ratio to GPTQModel's, whose median is the ratio reported."""
    def summary(value) -> dict:  # {runtime: median_and_runs of value(round, runtime)}, the ratios beside
        out = {}
        for n in rounds[0]:
            values = [v for r in rounds if (v := value(r, n)) is not None]
            if values:
                out[n] = median_and_runs(values)
        for n in ("cpu", "openvino"):
            ratios = [v / g for r in rounds if (v := value(r, n)) is not None and (g := value(r, "gptqmodel")) is not None]
            if ratios and "gptqmodel" in out:
                out[f"{n}_ratios"] = median_and_runs(ratios)
        return out

    def per_layer(r: dict, n: str) -> float | None:
        got = r.get(n, {})
        if layers not in got or more_layers not in got:
            return None
        return (1000 / got[more_layers] - 1000 / got[layers]) / (more_layers - layers)

    def at_48(r: dict, n: str) -> float | None:
        p = per_layer(r, n)
        return None if p is None or p <= 0 else 1000 / (1000 / r[n][layers] + (48 - layers) * p)

    result["decode_tok_s"] = summary(lambda r, n: r.get(n, {}).get(layers))
    if more_layers:
        result["more_layers"] = more_layers
        result["decode_tok_s_more_layers"] = summary(lambda r, n: r.get(n, {}).get(more_layers))
        result["per_layer_ms"] = {n: v["median"] for n, v in summary(per_layer).items() if not n.endswith("_ratios")}
        for n, v in result["per_layer_ms"].items():
            if v <= 0:  # deeper ran faster: the host's speed moved between the runs, no estimate holds
                result["errors"][f"{n} per layer"] = f"{v:.2f} ms per layer (not positive): measure again on a quiet machine"
        result["decode_48_layers_tok_s"] = summary(at_48)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--more-layers", type=int, help="also decode with this many layers: time per layer, 48-layer decode")
    p.add_argument("--desc-act", action="store_true", help="act-order checkpoint (random g_idx)")
    p.add_argument("--experts", type=int, help="override num_experts (a quick check)")
    p.add_argument("--hidden", type=int, help="override hidden_size (a quick check)")
    p.add_argument("--vocab", type=int, help="override vocab_size (a quick check)")
    p.add_argument("--runs", type=int, default=3, help="first-token processes, decode rounds, and generates in each decode process")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--backend", default="AUTO", help="GPTQModel's BACKEND name (AUTO: its own pick on this CPU)")
    p.add_argument("--only", nargs="+", choices=["gptqmodel", "cpu", "openvino"], default=["gptqmodel", "cpu", "openvino"])
    p.add_argument("--skip", nargs="*", choices=["first", "decode", "repack"], default=[])
    p.add_argument("--work", help="where the checkpoint and artifacts go (reused when there); default a temporary directory")
    p.add_argument("--out")
    args = p.parse_args()
    config = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    for key, value in {"num_experts": args.experts, "hidden_size": args.hidden, "vocab_size": args.vocab}.items():
        if value:
            config[key] = value
    config["num_experts_per_tok"] = min(config["num_experts_per_tok"], config["num_experts"])
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    tmp = tempfile.TemporaryDirectory()
    work = Path(args.work or tmp.name)
    # this user's state, as a serving machine keeps it between starts: the kcache's trust (warm records it)
    # and its runtime copy (the first start copies it); set before tests/conftest.py (build) sets its own
    os.environ.setdefault("QUANTPREP_TRUST_DIR", str(work / "user" / "trusted-kcache"))
    os.environ.setdefault("QUANTPREP_KCACHE_DIR", str(work / "user" / "kcache"))
    paths = build(work / f"layers-{args.layers}", config, args.desc_act)
    deeper = build(work / f"layers-{args.more_layers}", dict(config, num_hidden_layers=args.more_layers), args.desc_act) \
        if args.more_layers else None
    code = f"PROMPT = {PROMPT!r}\n" + CHILD
    env = child_env(QUANTPREP_VERIFIED_DIR=str(Path(tmp.name, "verified")))  # fresh: the first quantprep load is unmarked
    result = machine() | {"benchmark": "moe-speed", "gptqmodel": __import__("gptqmodel").__version__, "config": config,
                          "bits": 4, "group_size": 128, "desc_act": args.desc_act, "backend": args.backend,
                          "prompt_tokens": len(PROMPT), "new_tokens": args.new, "runs": args.runs,
                          "gptqmodel_cpu_workers": os.environ["GPTQMODEL_CPU_WORKERS"], "errors": {}}

    def child(name: str, mode: str, at: dict[str, Path] = paths) -> dict | None:
        try:
            start, r = run_child(code, [name, str(at[name]), mode, str(args.new), str(args.runs), args.backend], env=env)
        except RuntimeError as e:  # recorded, so the other runtimes still run (GPTQModel may refuse the model)
            result["errors"][f"{name} {mode}"] = str(e).strip().splitlines()[-1]
            print(f"{name} {mode} failed: {result['errors'][f'{name} {mode}']}", flush=True)
            return None
        if "done_at" in r:
            r["first_token_s"] = r.pop("done_at") - start
        print(name, mode, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k != "tokens"}, flush=True)
        return r

    if "first" not in args.skip:
        raw: dict[str, list[dict]] = {n: [] for n in args.only}
        result["first_token_first_run_s"] = {}
        for n in args.only:  # quantprep's first load checks the artifact in full and marks it; GPTQModel's may build its extension
            if r := child(n, "first"):
                result["first_token_first_run_s"][n] = r["first_token_s"]
        for _ in range(args.runs):
            for n in args.only:
                if f"{n} first" not in result["errors"] and (r := child(n, "first")):
                    raw[n].append(r)
        result["first_token_s"] = {n: median_and_runs([r["first_token_s"] for r in rs]) for n, rs in raw.items() if rs}
        result["first_token_raw"] = raw
    if "decode" not in args.skip:
        depths = [(args.layers, paths)] + ([(args.more_layers, deeper)] if deeper else [])
        rounds = []
        for _ in range(args.runs):
            # the runtimes in turn, round by round, each one's two depths back to back: the per-layer time and
            # the ratios come from measurements seconds apart (this host's speed drifts over minutes)
            rounds.append({n: {d: median_and_runs(r["tok_s"])["median"] for d, at in depths if (r := child(n, "decode", at))}
                           for n in args.only})
        result["decode_rounds"] = rounds
        decode_summary(result, rounds, args.layers, args.more_layers)
        if deeper:  # the floor no runtime can pass: a layer's bytes at this machine's read rate
            result["layer_bytes"], result["read_bandwidth_gb_s"] = layer_bytes(config), read_bandwidth_gb_s()
            result["per_layer_floor_ms"] = result["layer_bytes"] / result["read_bandwidth_gb_s"] / 1e6
    for key, goal, better in (("first_token_s", 0.3, "<="), ("decode_tok_s", 2.0, ">="), ("decode_48_layers_tok_s", 2.0, ">=")):
        r = result.get(key, {})
        if "gptqmodel" in r:
            for n in ("cpu", "openvino"):
                if n in r:  # decode: the median of each round's ratio (decode_summary); the first token: of the medians
                    ratio = r.pop(f"{n}_ratios")["median"] if f"{n}_ratios" in r else r[n]["median"] / r["gptqmodel"]["median"]
                    met = ratio <= goal if better == "<=" else ratio >= goal
                    r[f"{n}_over_gptqmodel"] = {"ratio": ratio, "goal": f"{better} {goal}", "met": met}
    if "repack" not in args.skip:
        t = time.perf_counter()
        result["xpu_repack_one_layer"] = xpu_repack(config, args.desc_act, config["num_experts"])
        print(f"xpu repack: {result['xpu_repack_one_layer']} ({time.perf_counter() - t:.1f} s)", flush=True)
    print(save(result, args.out))


if __name__ == "__main__":
    main()
