"""cuda int4 at prefill and decode (issue 32, item 4): which kernel path is fastest per linear?

Qwen2.5-1.5B and Qwen2.5-7B shaped int4 layers (group 128, bf16 activations, random GPTQ codes)
at M = 1, 4, 16 (decode) and 64 ... 2048 (prefill), against dense bf16 (cuBLAS, `F.linear`).
Act-order is a gather of x's columns in front of every int4 path, timed on its own three ways:
`x[:, perm]` (`gather_index`), `index_select`, a Triton kernel written here. The int4 paths:

- tinygemm `aten._weight_int4pack_mm`
- quantprep's Triton GEMM `int4_kn_gemm`, its default tiles and larger ones (`triton_<config>`)
- dequantize to bf16 [K, N] then cuBLAS: torch ops (`deq_torch_mm`) or one Triton pass written
  here (`deq_triton_mm`); the dequantize alone is in `dequant`, the matmul alone is `dense_nn`
- mslk (the CUTLASS mixed-input GEMMs that left fbgemm-gpu-genai; torchao 0.17 calls them):
  `bf16i4bf16_rowwise` and `bf16i4bf16_shuffled`, fed the same GPTQ codes (w = (q - 8) * s + z
  is mslk's own formula, with q - 8 as its signed int4)
- torchao `Int4WeightOnlyConfig` per `int4_packing_format`, on a random bf16 weight (timing only)

Every output is checked against a float32 reference (relative error, `rel_err`). Then, when asked,
whole-model 512-token prefills (eager and CUDA graph): dense bf16 against the same model with its
decoder linears as int4 modules, q/k/v and gate/up fused as quantprep fuses them, running
quantprep's current dispatch (tinygemm up to M=16, Triton above) or the best single path per M
measured above, with and without the act-order gathers. Timings: `triton.testing.do_bench` medians.
On the device machine, with mslk-cuda and torchao wheels installed (optional; without them those
candidates are left out):

    cd benchmarks && PYTHONPATH=.. python3 cuda_prefill.py --model --out results/cuda-prefill-h100.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import subprocess
import traceback

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import QWEN_1_5B, machine, save
from torch import nn
from triton.testing import do_bench

from quantprep.format.gptq import unpack_rows
from quantprep.targets.cuda import PREFILL_CONFIG, dequantize_kn, int4_kn_gemm
from quantprep.targets.packed import dequantize_folded_int4

GS = 128
QWEN_7B = QWEN_1_5B | {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                       "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}
SHAPES = {"1.5b": {"q/o": (1536, 1536), "k/v": (1536, 256), "gate/up": (1536, 8960), "down": (8960, 1536)},
          "7b": {"q/o": (3584, 3584), "k/v": (3584, 512), "gate/up": (3584, 18944), "down": (18944, 3584)}}
PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}  # linears of each shape in one decoder layer
DECODE_M, PREFILL_M = (1, 4, 16), (64, 128, 256, 512, 1024, 2048)
BIG_CONFIGS = [(64, 128, 128, 4, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (128, 128, 128, 8, 4),
               (128, 256, 64, 8, 3), (128, 256, 64, 8, 4)]
AO_FORMATS = ("tile_packed_to_4d", "plain", "preshuffled", "plain_int32")
DEVICE = "cuda"
OK_ERR = 1e-2  # bf16 operands land at 1e-3 .. 5e-3


def bench(fn, rep: int = 30) -> float:
    return do_bench(fn, warmup=min(rep, 50), rep=rep, return_mode="median")


def dequant_triton(L: dict) -> torch.Tensor:
    """The cuda target's one-pass Triton dequantizer (targets/cuda.py, `dequantize_kn`)."""
    return dequantize_kn(L["qkn"], L["sz"], GS)


def dequant_torch(L: dict) -> torch.Tensor:
    return dequantize_folded_int4(unpack_rows(L["qkn"], 4), L["sz"], GS)


@triton.jit(do_not_specialize=["M"])
def _gather_cols(x_ptr, perm_ptr, out_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, k] = x[m, perm[k]]: the act-order gather, rows of x read once (through L2), out coalesced."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    src = tl.load(perm_ptr + cols, mask=cols < K, other=0)
    mask = (rows[:, None] < M) & (cols < K)[None, :]
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], tl.load(x_ptr + rows[:, None] * K + src[None, :], mask=mask), mask=mask)


def gather_triton(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    M, K = x.shape
    out = torch.empty_like(x)
    _gather_cols[(triton.cdiv(M, 16), triton.cdiv(K, 256))](x, perm, out, M, K, BLOCK_M=16, BLOCK_K=256, num_warps=4)
    return out


GATHERS = {"gather_index": lambda x, perm: x[:, perm], "gather_index_select": lambda x, perm: torch.index_select(x, 1, perm),
           "gather_triton": gather_triton}


def load_extras() -> dict:
    """mslk and torchao, where their wheels were installed; what failed and why otherwise."""
    extras = {}
    try:
        import mslk  # noqa: F401 (loads mslk.so: torch.ops.mslk)

        extras["mslk"] = importlib.metadata.version("mslk-cuda")
    except Exception as e:
        extras["mslk_error"] = f"{type(e).__name__}: {e}"[:500]
    try:
        import torchao

        extras["torchao"] = torchao.__version__
    except Exception as e:
        extras["torchao_error"] = f"{type(e).__name__}: {e}"[:500]
    return extras


def random_int4(K: int, N: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random GPTQ codes uint8 [K, N] and scales_and_zeros bf16 [K/GS, N, 2] (scale, folded zero)."""
    codes = torch.randint(0, 16, (K, N), dtype=torch.uint8, device=device)
    s = torch.rand(K // GS, N, device=device) * 0.01 + 0.002
    return codes, torch.stack([s, (8 - torch.randint(0, 16, (K // GS, N), device=device)) * s], dim=-1).bfloat16()


def layouts(codes: torch.Tensor, sz: torch.Tensor, extras: dict) -> dict:
    """Every layout of one int4 weight: codes uint8 [K, N], sz bf16 [K/GS, N, 2] (scale, folded zero)."""
    nk = codes.T.contiguous()
    K, N = codes.shape
    words = (codes.view(K // 8, 8, N).to(torch.int64) << (4 * torch.arange(8, device=codes.device)).view(1, 8, 1)).sum(1)
    L = {"qkn": torch.where(words >= 2**31, words - 2**32, words).to(torch.int32), "sz": sz,  # quantprep's pack_rows, on the GPU
         "tg": torch.ops.aten._convert_weight_to_int4pack((nk[:, 0::2] << 4) | nk[:, 1::2], 8)}
    if "mslk" in extras:
        signed = nk.to(torch.int8) - 8  # mslk: [N, K/2] int8, even k in the low nibble
        L["ms_wq"] = ((signed[:, 0::2] & 0xF) | (signed[:, 1::2] << 4)).contiguous()
        L["ms_s"], L["ms_z"] = sz[..., 0].contiguous(), sz[..., 1].contiguous()
        L["ms_s_nk"], L["ms_z_nk"] = L["ms_s"].T.contiguous(), L["ms_z"].T.contiguous()
        L["ms_shuf_wq"], L["ms_shuf_s"] = torch.ops.mslk.preshuffle_i4(L["ms_wq"], L["ms_s"])
    return L


def int4_paths(extras: dict) -> dict:
    """name -> fn(x [M, K] bf16, layouts) -> [M, N]: the paths that run from GPTQ codes."""
    paths = {"tinygemm": lambda x, L: torch.ops.aten._weight_int4pack_mm(x, L["tg"], GS, L["sz"]),
             "deq_torch_mm": lambda x, L: x @ dequant_torch(L),
             "deq_triton_mm": lambda x, L: x @ dequant_triton(L)}
    for cfg in [PREFILL_CONFIG, *BIG_CONFIGS]:
        paths["triton_" + "_".join(map(str, cfg))] = lambda x, L, cfg=cfg: int4_kn_gemm(x, L["qkn"], GS, L["sz"], cfg)
    if "mslk" in extras:
        paths["mslk_rowwise"] = lambda x, L: torch.ops.mslk.bf16i4bf16_rowwise(x, L["ms_wq"], L["ms_s"], L["ms_z"])
        # mslk's rowwise op read our [K/g, N] scales wrong here (rel_err ~1, run 1): the same op, scales as [N, K/g]
        paths["mslk_rowwise_nk"] = lambda x, L: torch.ops.mslk.bf16i4bf16_rowwise(x, L["ms_wq"], L["ms_s_nk"], L["ms_z_nk"])
        paths["mslk_shuffled"] = lambda x, L: torch.ops.mslk.bf16i4bf16_shuffled(x, L["ms_shuf_wq"], L["ms_shuf_s"], L["ms_z"])
    return paths


DEFAULT_TRITON = "triton_" + "_".join(map(str, PREFILL_CONFIG))


def torchao_linears(K: int, N: int, extras: dict) -> dict:
    """format -> an nn.Linear quantized by torchao's Int4WeightOnlyConfig (or the error it raised)."""
    if "torchao" not in extras:
        return {}
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    out = {}
    for fmt in AO_FORMATS:
        seq = nn.Sequential(nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16))
        w = seq[0].weight.detach().float().T.contiguous()
        try:
            quantize_(seq, Int4WeightOnlyConfig(group_size=GS, int4_packing_format=fmt))
            lin = seq[0]
        except Exception as e:
            out[fmt] = f"{type(e).__name__}: {e}"[:300]
            continue
        try:  # its own dequantized weight is the reference; else the bf16 weight (quantization error included)
            out[fmt] = (lin, lin.weight.dequantize().float().T.contiguous(), "rel_err")
        except Exception:
            out[fmt] = (lin, w, "rel_err_vs_unquantized")
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def per_linear(extras: dict, models: list[str], skip: list[str], res: dict, out: str) -> None:
    """res["linears"]: rows {model, layer, K, N, M, candidate, ms, rel_err | error}; res["dequant"]:
    the dequantize alone, per shape. Saved to out after each shape."""
    rows, dequant_rows = res.setdefault("linears", []), res.setdefault("dequant", [])
    paths = {n: f for n, f in int4_paths(extras).items() if not any(n.startswith(p) for p in skip)}
    for model in models:
        for layer, (K, N) in SHAPES[model].items():
            torch.manual_seed(K * 7 + N)
            codes, sz = random_int4(K, N, "cuda")
            L = layouts(codes, sz, extras)
            w_ref = dequantize_folded_int4(codes, sz.float(), GS)  # float32 [K, N]
            L["w_kn"] = w_ref.bfloat16()
            L["w_nk"] = L["w_kn"].T.contiguous()
            perm = torch.randperm(K, device="cuda")
            ao = torchao_linears(K, N, extras)
            base = {"model": model, "layer": layer, "K": K, "N": N}
            for name, fn in (("dequant_torch", dequant_torch), ("dequant_triton", dequant_triton)):
                err = rel_err(fn(L), w_ref)
                dequant_rows.append(base | {"candidate": name, "ms": bench(lambda: fn(L)), "rel_err": err})
            for M in DECODE_M + PREFILL_M:
                x = torch.randn(M, K, device="cuda").bfloat16()
                ref = x.float() @ w_ref
                cands = {"dense": lambda x, L: F.linear(x, L["w_nk"]), "dense_nn": lambda x, L: x @ L["w_kn"]}
                cands |= {n: (lambda x, L, g=g: g(x, perm)) for n, g in GATHERS.items()}
                cands |= {n: f for n, f in paths.items() if not (n.startswith("triton_") and n != DEFAULT_TRITON and M < 64)}
                cands |= {f"torchao_{fmt}": (lambda x, L, lin=v[0]: lin(x)) if isinstance(v, tuple) else v for fmt, v in ao.items()}
                for name, fn in cands.items():
                    row = base | {"M": M, "candidate": name}
                    if isinstance(fn, str):
                        rows.append(row | {"error": fn})
                        continue
                    try:
                        y = fn(x, L)
                        if name.startswith("torchao_"):
                            _, w_ao, key = ao[name[8:]]
                            row[key] = rel_err(y, x.float() @ w_ao)
                        elif name in GATHERS:
                            row["rel_err"] = 0.0 if torch.equal(y, x[:, perm]) else 1.0
                        else:
                            row["rel_err"] = rel_err(y, ref)
                        row["ms"] = bench(lambda: fn(x, L))
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    rows.append(row)
                dense = next(r["ms"] for r in rows if r["candidate"] == "dense" and r["M"] == M and r["layer"] == layer and r["model"] == model)
                line = " ".join(f"{r['candidate']}={r['ms'] / dense:.2f}" for r in rows[-len(cands):] if "ms" in r and r["candidate"] != "dense")
                print(f"{model} {layer} M={M} dense {dense * 1e3:.1f}us | {line}", flush=True)
            L = ao = w_ref = None  # free this shape before the next
            torch.cuda.empty_cache()
            save(res, out)


def ok(r: dict) -> bool:
    return "ms" in r and r.get("rel_err", 0.0) < OK_ERR


def best_plan(rows: list[dict], extras: dict) -> dict:
    """Per (model, layer, M): the fastest correct path that runs from GPTQ codes (no torchao), and
    per (model, M) the model's linear time (PER_LAYER-weighted) of that plan over dense's, also
    with the act-order gather added, and the best single path for all shapes."""
    deployable = set(int4_paths(extras))
    best, summary = {}, []
    for model in SHAPES:
        for M in DECODE_M + PREFILL_M:
            sel = [r for r in rows if r["model"] == model and r["M"] == M]
            if not sel:
                continue
            dense = plan = gather = 0.0
            totals = {}
            for layer, count in PER_LAYER.items():
                lay = [r for r in sel if r["layer"] == layer]
                d = next(r["ms"] for r in lay if r["candidate"] == "dense")
                win = min((r for r in lay if r["candidate"] in deployable and ok(r)), key=lambda r: r["ms"])
                best[f"{model}|{layer}|{M}"] = win["candidate"]
                dense, plan = dense + count * d, plan + count * win["ms"]
                gather += count * min(r["ms"] for r in lay if r["candidate"] in GATHERS and ok(r))
                for r in lay:
                    if r["candidate"] not in GATHERS and ok(r):
                        totals.setdefault(r["candidate"], []).append(count * r["ms"])
            single = {c: sum(v) for c, v in totals.items() if len(v) == len(PER_LAYER)}
            one = min((c for c in single if c in deployable), key=single.get)
            summary.append({"model": model, "M": M, "plan_over_dense": plan / dense, "plan_with_gather_over_dense": (plan + gather) / dense,
                            "best_single_path": one, "best_single_over_dense": single[one] / dense,
                            "per_path_over_dense": {c: t / dense for c, t in sorted(single.items(), key=lambda kv: kv[1])}})
    return {"best": best, "summary": summary}


class Int4Linear(nn.Module):
    """K -> N as random GPTQ int4 codes: the act-order gather `self.gather` (None: no gather), the path
    `self.choose(M)` names, the bias. whole_model sets gather and choose per run."""

    def __init__(self, K: int, N: int, bias: torch.Tensor | None, extras: dict, paths: dict):
        super().__init__()
        self.in_features, self.out_features = K, N
        codes, sz = random_int4(K, N, DEVICE)
        self.L, self.paths, self.bias = layouts(codes, sz, extras), paths, bias
        self.perm = torch.randperm(K, device=DEVICE)
        self.gather, self.choose = None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        x2 = x2.contiguous() if self.gather is None else self.gather(x2, self.perm)
        y = self.paths[self.choose(x2.shape[0])](x2, self.L)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_split(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """What a fused group calls (runtime/fused.py), as PackedLinear does it."""
        return [y.contiguous() for y in self(x).split(sizes, -1)]


def graphed(model, ids):
    """A CUDA graph of one prefill forward; returns its replay (or raises)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(2):
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return g.replay


def int4_model(cfg, extras: dict) -> tuple[nn.Module, dict[str, list[Int4Linear]]]:
    """A Qwen2 model with its decoder linears as Int4Linear, q/k/v and gate/up fused as quantprep
    fuses them (quantprep.runtime.fused: one matmul and one gather per group)."""
    from transformers import AutoModelForCausalLM

    from quantprep.runtime.fused import install

    with torch.device(DEVICE):
        q = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    paths, mods = int4_paths(extras), {"qkv": [], "o": [], "gate_up": [], "down": []}
    for layer in q.model.layers:
        at, mlp = layer.self_attn, layer.mlp
        sizes = [at.q_proj.out_features, at.k_proj.out_features, at.v_proj.out_features]
        bias = torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]).detach()
        mods["qkv"].append(Int4Linear(at.q_proj.in_features, sum(sizes), bias, extras, paths))
        install(at, "qkv_proj", mods["qkv"][-1], ["q_proj", "k_proj", "v_proj"], sizes)
        at.o_proj = Int4Linear(at.o_proj.in_features, at.o_proj.out_features, None, extras, paths)
        mods["o"].append(at.o_proj)
        sizes = [mlp.gate_proj.out_features, mlp.up_proj.out_features]
        mods["gate_up"].append(Int4Linear(mlp.gate_proj.in_features, sum(sizes), None, extras, paths))
        install(mlp, "gate_up_proj", mods["gate_up"][-1], ["gate_proj", "up_proj"], sizes)
        mlp.down_proj = Int4Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, None, extras, paths)
        mods["down"].append(mlp.down_proj)
    torch.cuda.empty_cache()
    return q, mods


def whole_model(model_name: str, res: dict, extras: dict) -> dict:
    """512-token prefill, batch 1 (last token's logits, no KV cache): dense bf16 against int4 runs
    that differ in kernel choice and act-order gather; interleaved rounds of do_bench medians,
    eager and as one CUDA graph. `down_folded`: no gather before down_proj, as when its permutation
    is applied to gate/up's output columns at pack time (exact; costs nothing at run time)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**(QWEN_1_5B if model_name == "1.5b" else QWEN_7B))
    with torch.device("cuda"):
        dense = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    q, mods = int4_model(cfg, extras)
    summary = {s["M"]: s["best_single_path"] for s in res["plan"]["summary"] if s["model"] == model_name}
    Ms = sorted(summary)

    def best(M):
        return summary[next((m for m in Ms if m >= M), Ms[-1])]

    def current(M):
        return "tinygemm" if M <= 16 else DEFAULT_TRITON

    at512 = [r for r in res["linears"] if r["model"] == model_name and r["M"] == 512 and r["candidate"].startswith("gather_") and ok(r)]
    fast = min({r["candidate"] for r in at512}, key=lambda c: sum(r["ms"] for r in at512 if r["candidate"] == c))
    configs = {"int4_current": (current, "gather_index", "gather_index"),  # quantprep's cuda target today
               "int4_best": (best, "gather_index", "gather_index"),
               "int4_best_fast_gather_down_folded": (best, fast, None),
               "int4_best_no_gather": (best, None, None)}  # no act-order (or the gather fused upstream)

    def use(name):
        choose, gather, down_gather = configs[name]
        for group, ms in mods.items():
            g = down_gather if group == "down" else gather
            for m in ms:
                m.choose, m.gather = choose, GATHERS[g] if g else None
        return q

    runs = {"dense_bf16": lambda: dense} | {n: (lambda n=n: use(n)) for n in configs}
    out = {"paths_at_512": best(512), "fast_gather": fast, "int4_weights_mib": sum(
        t.numel() * t.element_size() for ms in mods.values() for m in ms for t in m.L.values()) / 2**20}
    with torch.no_grad():
        for get in runs.values():
            get()(input_ids=ids_512(), use_cache=False, logits_to_keep=1)
        eager = {n: [] for n in runs}
        ids = ids_512()
        for _ in range(5):
            for n, get in runs.items():
                m = get()
                eager[n].append(bench(lambda m=m: m(input_ids=ids, use_cache=False, logits_to_keep=1), rep=300))
    out["eager_prefill512_ms"] = {n: statistics.median(v) for n, v in eager.items()}
    out["eager_runs_ms"] = eager
    graph = {}
    for n, get in runs.items():
        try:
            replay = graphed(get(), ids)
            graph[n] = statistics.median(bench(replay, rep=300) for _ in range(3))
        except Exception as e:
            graph[n] = f"{type(e).__name__}: {e}"[:300]
    out["graph_prefill512_ms"] = graph
    for k in ("eager_prefill512_ms", "graph_prefill512_ms"):
        d = out[k]["dense_bf16"]
        out[k.replace("_ms", "_over_dense")] = {n: v / d for n, v in out[k].items() if isinstance(v, float) and isinstance(d, float)}
    print(model_name, json.dumps({k: v for k, v in out.items() if k != "eager_runs_ms"}, indent=1), flush=True)
    return out


def ids_512() -> torch.Tensor:
    return torch.randint(0, 150000, (1, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(0))


def short(name: str) -> str:
    for a, b in (("triton_", "tr"), ("deq_", "d_"), ("torchao_", "ao_"), ("mslk_", "ms_"), ("tile_packed_to_4d", "tile4d")):
        name = name.replace(a, b)
    return name


def table(rows: list[dict]) -> None:
    """Per (model, layer): M down, each candidate's time / dense time."""
    for model in SHAPES:
        for layer in SHAPES[model]:
            sel = [r for r in rows if r["model"] == model and r["layer"] == layer]
            if not sel:
                continue
            names = list(dict.fromkeys(r["candidate"] for r in sel if r["candidate"] not in ("dense",)))
            print(f"\n{model} {layer} {SHAPES[model][layer]}: time / dense ('x' wrong, '-' failed)")
            print(f"{'M':>5} {'dense_us':>8} " + " ".join(f"{short(n):>16}" for n in names))
            for M in DECODE_M + PREFILL_M:
                by = {r["candidate"]: r for r in sel if r["M"] == M}
                d = by["dense"]["ms"]
                cells = [("-" if "ms" not in by.get(n, {}) else f"{by[n]['ms'] / d:.2f}" + ("" if ok(by[n]) else "x")) for n in names]
                print(f"{M:>5} {d * 1e3:>8.1f} " + " ".join(f"{c:>16}" for c in cells))


def summarize(summary: list[dict]) -> None:
    for s in summary:
        print(f"{s['model']} M={s['M']}: plan {s['plan_over_dense']:.2f}x dense ({s['plan_with_gather_over_dense']:.2f}x with gather); "
              f"best single path {s['best_single_path']} {s['best_single_over_dense']:.2f}x", flush=True)


def versions(extras: dict) -> dict:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    return {"device": torch.cuda.get_device_name(), "nvidia_smi": smi, "cuda": torch.version.cuda, "triton": triton.__version__,
            "fbgemm_gpu_genai": "not carried: its 36 MB wheel and mslk-cuda's 44 MB exceed the 64 MiB the device call takes; "
                                "mslk-cuda 1.1.0 holds the same bf16i4bf16 kernels (torchao 0.17 calls torch.ops.mslk)"} | extras


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/cuda-prefill-h100.json")
    p.add_argument("--models", default="1.5b,7b")
    p.add_argument("--model", action="store_true", help="also whole-model 512-token prefills")
    p.add_argument("--skip", default="", help="comma-separated candidate name prefixes to leave out")
    p.add_argument("--table", metavar="JSON", help="only print the tables of a results file (no GPU)")
    args = p.parse_args()
    if args.table:
        res = json.loads(open(args.table).read())
        table(res["linears"])
        summarize(res["plan"]["summary"])
        return
    extras = load_extras()
    res = machine() | versions(extras)
    print(json.dumps(res), flush=True)
    per_linear(extras, args.models.split(","), [s for s in args.skip.split(",") if s], res, args.out)
    res["plan"] = best_plan(res["linears"], extras)
    save(res, args.out)
    summarize(res["plan"]["summary"])
    if args.model:
        res["whole_model"] = {}
        for m in args.models.split(","):
            try:
                res["whole_model"][m] = whole_model(m, res, extras)
            except Exception:
                res["whole_model"][m] = {"error": traceback.format_exc()[-1500:]}
                print(res["whole_model"][m]["error"], flush=True)
            save(res, args.out)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
