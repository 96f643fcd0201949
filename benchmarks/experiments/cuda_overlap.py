"""Experiments on the cuda target's 512-token prefill gap to dense bf16 (BENCHMARKS.md, "Kernel plans").

Variants of the whole model ("fixed rule" is the shipped code as it runs). The first two recorded
runs (results/cuda-overlap-h200.json, cuda-split-h200.json: commit 6bc16ae's script) predate the
split: there "fixed rule" is `copies`, `split_mm` the split that now ships and `split_mm_pairs`
`split_pairs`. Their `logits_equal_to_fixed_rule` compared all-zero logits (the random
checkpoint's embeddings and lm_head are zeros): no evidence, so it is gone; tests/targets/
test_cuda.py and test_cuda_gpu.py check the split's parts against the fallback and float32.
0. `copies`: a fused projection (q/k/v, gate/up) as one GEMM, then a contiguous copy of each part
   (before); `split_pairs`: the shipped split for gate/up only; `views`: no copies (reference).
1. `ahead`: each dequantize-path linear's weight dequantized on a side stream, `depth` linears
   before it multiplies, so the memory-bound pass overlaps the compute-bound GEMMs (the 1.5B's
   GEMMs at M = 512 fill under half the SMs). Whole model, CUDA graph replays and eager.
2. `transposed`: a Triton GEMM computing C^T = W^T x^T, so the dequantized weight is the MMA's
   left operand; per linear at M = 512, beside dense and the shipped dequantize path.

    PYTHONPATH=.:benchmarks python3 benchmarks/cuda_overlap.py --out benchmarks/results/cuda-overlap-h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from common import machine, save
from cuda_dequant import SHAPES, random_weight
from plan_prefill import MODELS, graph_replay

from quantprep.runtime.plan import cuda_graph, gpu_seconds
from quantprep.targets.cuda import CudaInt4Linear, dequantize_kn, int4_kn_gemm
from quantprep.targets.packed import PackedLinear

GS = 128


class DequantAhead:
    def __init__(self, depth: int):
        self.depth, self.order, self.position, self.ready = depth, [], {}, {}
        self.stream = torch.cuda.Stream()

    def weight(self, mod: CudaInt4Linear) -> torch.Tensor:
        if id(mod) not in self.position:
            self.position[id(mod)] = len(self.order)
            self.order.append(mod)
        pos, main = self.position[id(mod)], torch.cuda.current_stream()
        capturing = torch.cuda.is_current_stream_capturing()
        for nxt in self.order[pos + 1: pos + 1 + self.depth]:
            if id(nxt) in self.ready:
                continue
            self.stream.wait_stream(main)
            with torch.cuda.stream(self.stream):
                w = dequantize_kn(nxt.qweight_kn, nxt.scales_and_zeros, nxt.kernel_group_size, nxt.perm, nxt.in_features)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            self.ready[id(nxt)] = (w, ev, capturing)
        entry = self.ready.pop(id(mod), None)
        if entry is not None and entry[2] == capturing:
            main.wait_event(entry[1])
            entry[0].record_stream(main)
            return entry[0].T
        return CudaInt4Linear.dequantized_weight(mod)


def copies(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The code before: one GEMM over the fused projection, then a contiguous copy of each part."""
    return PackedLinear.forward_split(self, x, sizes)


def split_pairs(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The shipped split (one GEMM per part) for gate/up (two parts) only; q/k/v one GEMM and copies."""
    return (CudaInt4Linear.forward_split if len(sizes) == 2 else PackedLinear.forward_split)(self, x, sizes)


def views(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The parts as strided views of one GEMM's output (no copies): the copies' cost, for reference."""
    return list(self(x).split(sizes, -1))


SPLITS = {"copies": copies, "split_pairs": split_pairs, "views": views}


def whole_model(name: str, runs: int, root: Path, variants: list[str]) -> dict:
    import quantprep
    from quantprep.build.pipeline import prepack
    from quantprep.build.synthetic import write_random_checkpoint_sharded
    from quantprep.tools.eval import dequantized_model

    gptq = write_random_checkpoint_sharded(root / f"gptq-{name}", MODELS[name], bits=4, group_size=128, desc_act=True, sym=True)
    art = root / f"{name}-cuda"
    prepack(gptq, "cuda", art)
    model = quantprep.load(art)
    mods = [m for m in model.modules() if isinstance(m, CudaInt4Linear)]
    dense = dequantized_model(gptq, torch.bfloat16).to(model.device).eval()
    ids = torch.randint(0, 1000, (1, 512), generator=torch.Generator().manual_seed(0)).to(model.device)

    def use(v: str) -> None:
        for m in mods:
            m.__dict__.pop("dequantized_weight", None)
            m.__dict__.pop("forward_split", None)
            if v in SPLITS:
                m.forward_split = SPLITS[v].__get__(m)
        if v.startswith("ahead_"):
            ahead = DequantAhead(int(v.split("_")[1]))
            for m in mods:
                m.dequantized_weight = lambda m=m: ahead.weight(m)

    graph, eager = {v: [] for v in variants}, {v: [] for v in variants}
    with torch.inference_mode():
        for r in range(runs + 1):
            for v in variants:
                m = dense if v == "dense" else model
                use(v)
                fwd = lambda m=m: m(input_ids=ids, use_cache=False, logits_to_keep=1)  # noqa: E731
                replay = graph_replay(m, ids)
                g = statistics.median(gpu_seconds(replay) for _ in range(3)) * 1e3
                torch.cuda.synchronize()
                t = time.perf_counter()
                fwd()
                torch.cuda.synchronize()
                e = (time.perf_counter() - t) * 1e3
                if r:
                    graph[v].append(g)
                    eager[v].append(e)
        use("fixed rule")
        for _ in range(3):
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue()[-6000:], flush=True)
    med = {v: statistics.median(x) for v, x in graph.items()}
    emed = {v: statistics.median(x) for v, x in eager.items()}
    print(name, {v: round(med[v] / med["dense"], 3) for v in med}, {v: round(emed[v] / emed["dense"], 3) for v in emed}, flush=True)
    return {"graph_ms": {v: {"median": med[v], "runs": graph[v]} for v in variants},
            "eager_ms": {v: {"median": emed[v], "runs": eager[v]} for v in variants},
            "graph_over_dense": {v: med[v] / med["dense"] for v in med},
            "eager_over_dense": {v: emed[v] / emed["dense"] for v in emed},
            "eager_profile_fixed_rule": text.getvalue()}


@triton.jit(do_not_specialize=["M"])
def _int4_gemm_t(a_ptr, w_ptr, sz_ptr, c_ptr, M, N, K, GROUP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C^T[BN, BM] = W^T[BN, BK] @ x^T[BK, BM]: the dequantized weight is the left operand."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_w = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = tl.load(a_ptr + offs_m[None, :] * K + (k0 + tl.arange(0, BLOCK_K))[:, None], mask=offs_m[None, :] < M, other=0.0)
        words = tl.load(w_ptr + (k0 // 8 + offs_w)[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0)
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        g = k0 // GROUP
        s = tl.load(sz_ptr + (g * N + offs_n) * 2, mask=n_ok, other=0.0)
        z = tl.load(sz_ptr + (g * N + offs_n) * 2 + 1, mask=n_ok, other=0.0)
        w = (q.to(tl.bfloat16) - 8.0) * s[None, :] + z[None, :]
        acc += tl.dot(tl.trans(w), xt)
    tl.store(c_ptr + offs_m[None, :] * N + offs_n[:, None], acc.to(tl.bfloat16), mask=(offs_m[None, :] < M) & n_ok[:, None])


def gemm_t(x, qkn, sz, config):
    M, K = x.shape
    N = qkn.shape[1]
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    bm, bn, bk, warps, stages = config
    _int4_gemm_t[(triton.cdiv(N, bn), triton.cdiv(M, bm))](x, qkn, sz, out, M, N, K, GROUP=GS, BLOCK_M=bm, BLOCK_N=bn,
                                                           BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


T_CONFIGS = [(64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 256, 64, 8, 3),
             (128, 256, 64, 8, 3), (64, 128, 128, 4, 3)]


def per_linear(rows: list[int]) -> list[dict]:
    out = []
    for model, shapes in SHAPES.items():
        for name, (K, N) in shapes.items():
            qkn, sz, perm = random_weight(K, N)
            w_packed = dequantize_kn(qkn, sz, GS)  # [K, N], packed order
            for M in rows:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                ref = (x.float() @ w_packed.float())
                dense_w = w_packed.clone()
                variants = {"dense": lambda: x @ dense_w,
                            "shipped_dequant": lambda: x @ dequantize_kn(qkn, sz, GS),
                            "triton_shipped": lambda: int4_kn_gemm(x, qkn, GS, sz)}
                for c in T_CONFIGS:
                    variants["t_" + "_".join(map(str, c))] = lambda c=c: gemm_t(x, qkn, sz, c)
                row = {"model": model, "linear": name, "K": K, "N": N, "M": M, "us": {}, "rel_err": {}}
                for v, fn in variants.items():
                    try:
                        y = fn().float()
                        row["rel_err"][v] = float((y - ref).norm() / ref.norm())
                        row["us"][v] = statistics.median(gpu_seconds(cuda_graph(fn)) for _ in range(5)) * 1e6
                    except Exception as e:  # a config that does not compile (shared memory)
                        row["us"][v] = None
                        row["rel_err"][v] = repr(e)[:120]
                d = row["us"]["dense"]
                print(model, name, M, {v: (round(t / d, 2) if t else None) for v, t in row["us"].items()}, flush=True)
                out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="1.5b,7b")
    p.add_argument("--variants", default="fixed rule,ahead_1,ahead_2,ahead_4,ahead_8,copies,split_pairs,views,dense")
    p.add_argument("--rows", default="512")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--skip", default="")
    p.add_argument("--out")
    args = p.parse_args()
    res = machine() | {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    if "linear" not in args.skip:
        res["per_linear"] = per_linear([int(r) for r in args.rows.split(",")])
        save(res, args.out)
    if "model" not in args.skip:
        res["models"] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.models.split(","):
                res["models"][name] = whole_model(name, args.runs, Path(tmp), args.variants.split(","))
                save(res, args.out)
    print(save(res, args.out))


if __name__ == "__main__":
    main()
