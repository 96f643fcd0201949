"""cuda target (NVIDIA, tensor cores), through upstream torch ops.

int4, decode (M <= DECODE_MAX_M): tinygemm, `aten._weight_int4pack_mm` (bf16 activations only),
w = (q - 8) * scale + zero per group, so GPTQ's zero becomes (8 - z) * s, as on cpu. Its weight
layout is what `aten._convert_weight_to_int4pack` makes on the GPU; `pack_tinygemm` writes the
same int32 words with tensor ops so artifacts build on machines without a GPU. Layout, from
pytorch aten/src/ATen/native/cuda/int4mm.cu (`matrix_to_m16n8k16_Bint4_layout`): output
[N/8, K/(16*ikt), 32, ikt/2] int32; lane t of n-tile nt reads row n = 8*nt + t//4; word j of
k-super-tile ko holds 8 codes at k = ko*16*ikt + 32*j + 16*i1 + 8*i0 + 2*(t%4) + h, nibble
4*(4*h + 2*i1 + i0). The device run (benchmarks/experiments/cuda_kernels.py) checked it equals the op.

int4, prefill (M > DECODE_MAX_M): tinygemm is many times slower than dense bf16 at M=512
(benchmarks/experiments/results/cuda-h200.json), so
the weight is dequantized to bf16 in one Triton pass, each row where the activations have it (so
no act-order gather of x), and multiplied by cuBLAS (the fixed rule; a fused projection's parts each
on their own column slice of it, so no part is copied out of a fused output), or
a Triton GEMM dequantizes K-blocks in registers and multiplies on tensor cores, or, where the
optional `mslk-cuda` package is installed, its CUTLASS mixed-input GEMM (`bf16i4bf16_shuffled`,
the kernel torchao's preshuffled int4 calls) dequantizes in registers: paths a kernel plan may pick
(runtime/plan.py). mslk's weight layout is built on the GPU from `qweight_kn` when a plan names it
(+0.5 byte per weight in GPU memory), never read from the artifact. The dequantize pass and the
Triton GEMM read a second copy of the codes in GPTQ's [K/8, N] words
(`qweight_kn`, coalesced along N; reading tinygemm's tiles from Triton was far slower, measured once):
+0.5 byte per weight. Off a GPU and while torch.compile or export trace (verify on CPU, tests), the
weight is dequantized with tensor ops instead.

int8: dequantize + a dense matmul (`base.pack_int8`): torch's cuda `_weight_int8pack_mm` was slower
than it at every M on an H100 (benchmarks/experiments/results/int8-switch-cuda-h100.json; base.Int8PerChannelLinear).
"""

from __future__ import annotations

import subprocess

import torch
import torch.nn.functional as F
from torch import nn

from quantprep.format import gptq
from quantprep.format.gptq import PrepackLayer, pack_rows, unpack_rows
from quantprep.targets.base import Target, base_meta
from quantprep.targets.packed import (
    PackedLinear,
    dequantize_folded_int4,
    gather_and_pad,
    make_int8_module,
    optional_tensors,
    pack_int8,
    regroup,
    round_up,
    tiled_int4_problem,
    torch_base_version,
)

N_ALIGN = 8
DECODE_MAX_M = 16  # tinygemm up to here: the crossover on an H200 (benchmarks/experiments/results/cuda-h200.json)
PREFILL_CONFIG = (64, 64, 128, 4, 3)  # Triton tiles, picked by benchmarks/experiments/cuda_kernels.py --sweep
CHECK_CODES = 1 << 23  # codes compared at a time when load checks the two copies (about 18 bytes each while packing)


def inner_k_tiles(padded_in: int) -> int:
    return next(t for t in (8, 4, 2) if padded_in % (16 * t) == 0)


def pack_tinygemm(codes: torch.Tensor, ikt: int) -> torch.Tensor:
    """uint8 codes [K, N] (K % (16*ikt) == 0, N % 8 == 0) -> tinygemm's int32 [N/8, K/(16*ikt), 32, ikt/2]."""
    K, N = codes.shape
    # codes[n, k] with n = (nt, a) and k = (ko, j, i1, i0, b, h); lane t = 4a + b; nibble s = 4h + 2i1 + i0.
    c = codes.T.reshape(N // 8, 8, K // (16 * ikt), ikt // 2, 2, 2, 4, 2)
    c = c.permute(0, 2, 1, 6, 3, 7, 4, 5).reshape(N // 8, K // (16 * ikt), 32, ikt // 2, 8).to(torch.int64)
    words = (c << (4 * torch.arange(8, device=codes.device))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_tinygemm(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_tinygemm`: int32 [N/8, K/(16*ikt), 32, ikt/2] -> uint8 codes [N, K]."""
    nt, ko, _, half = packed.shape
    nib = (packed.unsqueeze(-1) >> (4 * torch.arange(8, device=packed.device, dtype=torch.int32))) & 0xF
    nib = nib.reshape(nt, ko, 8, 4, half, 2, 2, 2)  # (nt, ko, a, b, j, h, i1, i0)
    return nib.permute(0, 2, 1, 4, 6, 7, 3, 5).reshape(nt * 8, ko * half * 32).to(torch.uint8)


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the dequantize path runs instead
    triton = None

if triton is not None:

    # M (the prompt's length) is not specialized: Triton compiles one variant for M % 16 == 0 and
    # another for the rest, and warm's lengths are multiples of 16, so most real prompts met an
    # uncached variant at their first request. One variant serves every M.
    @triton.jit(do_not_specialize=["M"])
    def _int4_kn_gemm(a_ptr, w_ptr, sz_ptr, c_ptr, M, N, K, GROUP: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """C[M, N] = A[M, K] @ W, W[k, n] = (q - 8) * s + z with q at bits 4*(k%8) of words [K/8, N].
        Each word is loaded once and split into its 8 codes in registers; dequantized in bf16
        (as tinygemm does), accumulated in float32 on tensor cores."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # row * N reaches 2**31 on long prompts x large N
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_w = tl.arange(0, BLOCK_K // 8)
        shifts = tl.arange(0, 8) * 4
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(a_ptr + offs_m[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=offs_m[:, None] < M, other=0.0)
            words = tl.load(w_ptr + (k0 // 8 + offs_w)[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0)
            q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
            g = k0 // GROUP
            s = tl.load(sz_ptr + (g * N + offs_n) * 2, mask=n_ok, other=0.0)
            z = tl.load(sz_ptr + (g * N + offs_n) * 2 + 1, mask=n_ok, other=0.0)
            acc += tl.dot(x, (q.to(tl.bfloat16) - 8.0) * s[None, :] + z[None, :])
        tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16),
                 mask=(offs_m[:, None] < M) & n_ok[None, :])


def int4_kn_gemm(x: torch.Tensor, qweight_kn: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor,
                 config: tuple[int, int, int, int, int] | None = None, launch=None) -> torch.Tensor:
    """Prefill GEMM: bf16 x [M, Kp] @ int4 weight in GPTQ's [Kp/8, Np] words -> bf16 [M, Np].
    config = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_K must divide group_size."""
    M, K = x.shape
    N = qweight_kn.shape[1]
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    bm, bn, bk, warps, stages = config or PREFILL_CONFIG
    bk = min(bk, group_size)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    (launch or (lambda k: k))(_int4_kn_gemm)[grid](x, qweight_kn, scales_and_zeros, out, M, N, K, GROUP=group_size,
                                                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


if triton is not None:

    @triton.jit
    def _dequant_kn(w_ptr, sz_ptr, perm_ptr, out_ptr, N, K_IN, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_PERM: tl.constexpr):
        """One pass: words [Kp/8, N] + scales_and_zeros [Kp/GROUP, N, 2] -> bf16 [K_IN, N] in the
        activations' order, w = (q - 8) * s + z (BLOCK_K divides GROUP). Packed row k is input row
        perm[k] (act-order) and rows k >= K_IN are padding: writing each row where the activations
        have it spares the matmul the gather of x's columns. Each of a word's 8 nibbles is stored
        as its own slab of rows (faster than reshaping the codes to [BLOCK_K, BLOCK_N] in registers:
        benchmarks/experiments/results/cuda-dequant-h200.json)."""
        pid_k, pid_n = tl.program_id(0), tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        rows = (pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)).to(tl.int64)
        words = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0)
        g = (pid_k * BLOCK_K // GROUP).to(tl.int64)
        s = tl.load(sz_ptr + (g * N + offs_n) * 2, mask=n_ok, other=0.0)
        z = tl.load(sz_ptr + (g * N + offs_n) * 2 + 1, mask=n_ok, other=0.0)
        for j in tl.static_range(8):
            q = (words >> (4 * j)) & 0xF
            k = rows * 8 + j
            k_ok = k < K_IN
            if HAS_PERM:  # load checked perm is a permutation (PackedLinear.check_loaded); the mask holds anyway
                dest = tl.load(perm_ptr + k, mask=k_ok, other=-1).to(tl.int64)
                k_ok = k_ok & (dest >= 0) & (dest < K_IN)
            else:
                dest = k
            tl.store(out_ptr + dest[:, None] * N + offs_n[None, :], (q.to(tl.bfloat16) - 8.0) * s[None, :] + z[None, :],
                     mask=k_ok[:, None] & n_ok[None, :])


def dequantize_kn(qweight_kn: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                  perm: torch.Tensor | None = None, in_features: int | None = None) -> torch.Tensor:
    """bf16 [in_features, N] from GPTQ's words [Kp/8, N] in one Triton pass, faster than the tensor
    ops on an H100 (benchmarks/experiments/results/cuda-prefill-h100.json, "dequant"). With `perm`
    (int32, a checked permutation: PackedLinear.check_loaded) packed row k lands at row perm[k];
    rows from `in_features` on (K padding) are dropped."""
    Kp, N = qweight_kn.shape[0] * 8, qweight_kn.shape[1]
    k_in = Kp if in_features is None else in_features
    out = torch.empty(k_in, N, dtype=torch.bfloat16, device=qweight_kn.device)
    block_k = min(group_size, 128)
    _dequant_kn[(Kp // block_k, triton.cdiv(N, 128))](qweight_kn, scales_and_zeros, qweight_kn if perm is None else perm, out,
                                                      N, k_in, GROUP=group_size, BLOCK_K=block_k, BLOCK_N=128,
                                                      HAS_PERM=perm is not None, num_warps=4)
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _gather_pad(x_ptr, perm_ptr, out_ptr, M, K, KP, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[m, k] = x[m, perm[k]] for k < K, 0 for K <= k < KP: the act-order gather and the K
        padding in one pass, in tiles of BLOCK_M rows (decode: more programs than rows)."""
        pid_m, pid_k = tl.program_id(0), tl.program_id(1)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok, m_ok = offs_k < K, offs_m < M
        src = tl.load(perm_ptr + offs_k, mask=k_ok, other=0).to(tl.int64)
        k_ok = k_ok & (src >= 0) & (src < K)  # load checked perm is a permutation; the mask holds anyway
        vals = tl.load(x_ptr + offs_m[:, None] * K + src[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        tl.store(out_ptr + offs_m[:, None] * KP + offs_k[None, :], vals, mask=m_ok[:, None] & (offs_k < KP)[None, :])

    @triton.jit(do_not_specialize=["M"])
    def _gather_pad_rows(x_ptr, perm_ptr, out_ptr, M, K, KP, BLOCK_K: tl.constexpr):
        """The same, one program per row and the whole row at once: the row's random reads meet in
        one SM's L1 instead of pulling a 32-byte sector from L2 for each 2-byte value."""
        row = tl.program_id(0).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        src = tl.load(perm_ptr + offs_k, mask=k_ok, other=0)
        k_ok = k_ok & (src >= 0) & (src < K)
        vals = tl.load(x_ptr + row * K + src, mask=k_ok, other=0.0)
        tl.store(out_ptr + row * KP + offs_k, vals, mask=offs_k < KP)


# Measured on an H100 (benchmarks/experiments/results/cuda-gather-h100.json): at decode, tiles of (1, 1024) beat
# index_select; from 512 rows whole rows (16 warps: the fastest row variant on the down_proj shapes)
# beat it further on the down_proj shapes. Beyond GATHER_ROW_MAX_K (registers) torch's own.
GATHER_BLOCKS = (1, 1024)  # (BLOCK_M, BLOCK_K) up to DECODE_MAX_M rows
GATHER_ROW_MAX_K = 1 << 15


def gather_pad(x: torch.Tensor, perm: torch.Tensor, padded_in: int) -> torch.Tensor:
    """`base.gather_and_pad` in one Triton pass (torch's own at prefill beyond GATHER_ROW_MAX_K):
    x [M, K], perm int32 [K] (a checked permutation: PackedLinear.check_loaded) -> [M, padded_in]."""
    M, K = x.shape
    if M > DECODE_MAX_M and padded_in > GATHER_ROW_MAX_K:
        return gather_and_pad(x, perm, padded_in)
    x = x.contiguous()  # the kernels index rows by K: a strided view (a batch's last positions) would be misread
    out = torch.empty(M, padded_in, dtype=x.dtype, device=x.device)
    if M > DECODE_MAX_M:
        _gather_pad_rows[(M,)](x, perm, out, M, K, padded_in, BLOCK_K=triton.next_power_of_2(padded_in), num_warps=16)
    else:
        bm, bk = GATHER_BLOCKS
        _gather_pad[(triton.cdiv(M, bm), triton.cdiv(padded_in, bk))](x, perm, out, M, K, padded_in, BLOCK_M=bm, BLOCK_K=bk, num_warps=4)
    return out


MSLK_MIN_GROUP = 128  # mslk's preshuffled int4 takes groups of 128 and more (mslk/quantize/shuffle.py)
MSLK_N_ALIGN = 64


def mslk_available() -> bool:
    """Whether the optional mslk-cuda package (CUTLASS mixed-input GEMMs) is installed and loads."""
    global _MSLK
    if _MSLK is None:
        try:
            import mslk  # noqa: F401 (registers torch.ops.mslk)

            _MSLK = hasattr(torch.ops.mslk, "bf16i4bf16_shuffled") and hasattr(torch.ops.mslk, "preshuffle_i4")
        except Exception:  # not installed, or built for another torch/CUDA: the path is not offered
            _MSLK = False
    return _MSLK


_MSLK: bool | None = None


def mslk_layout(qweight_kn: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GPTQ's words [Kp/8, n] + [Kp/g, n, 2] -> mslk's (weight, scales, zeros) for `bf16i4bf16_shuffled`.
    mslk computes w = q_signed * s + z with q_signed = q - 8, two codes a byte, even k in the low
    nibble, [n, Kp/2]: the bytes of qweight_kn (two codes a byte, low nibble first) transposed,
    each nibble XOR 8. Then its own shuffle of weight and scales."""
    wq, s = torch.ops.mslk.preshuffle_i4(mslk_codes(qweight_kn), scales_and_zeros[..., 0].contiguous())
    return wq, s, scales_and_zeros[..., 1].contiguous()


def mslk_codes(qweight_kn: torch.Tensor) -> torch.Tensor:
    """GPTQ's words [Kp/8, n] -> mslk's unshuffled int4 [n, Kp/2] (int8 bytes): tensor ops, any device."""
    Kp8, n = qweight_kn.shape
    b = qweight_kn.contiguous().view(torch.uint8).view(Kp8, n, 4).permute(0, 2, 1).reshape(Kp8 * 4, n)
    return (b ^ 0x88).T.contiguous().view(torch.int8)


if triton is not None:
    # The same GEMM as a custom op that torch.compile and torch.export trace into (a raw Triton
    # launch cannot run on export's fake tensors): AOTInductor packages (aot.py) need it.
    @torch.library.triton_op("quantprep::int4_kn_gemm", mutates_args=())
    def int4_kn_gemm_op(x: torch.Tensor, qweight_kn: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
        return int4_kn_gemm(x, qweight_kn, group_size, scales_and_zeros, launch=torch.library.wrap_triton)


class CudaInt4Linear(PackedLinear):
    mslk_weights: list[tuple[torch.Tensor, ...]] | None = None  # mslk's layout per part, built by prepare
    mslk_failed: str | None = None
    # mslk's layout is not a buffer: export (AOT packages shared across layers) would bake one
    # layer's into its graph, so traced code takes the dequantize path instead
    TRACED_INSTEAD = {"mslk": "dequant"}

    def __init__(self, meta: dict, act_dtype: torch.dtype):
        super().__init__(meta, act_dtype)
        self.kernel_group_size, ikt = meta["kernel_group_size"], meta["inner_k_tiles"]
        dev = torch.device("meta")
        shape = (self.padded_out // 8, self.padded_in // (16 * ikt), 32, ikt // 2)
        self.register_buffer("qweight", torch.empty(shape, dtype=torch.int32, device=dev))
        self.register_buffer("qweight_kn", torch.empty(self.padded_in // 8, self.padded_out, dtype=torch.int32, device=dev))
        n_groups = self.padded_in // self.kernel_group_size
        self.register_buffer("scales_and_zeros", torch.empty(n_groups, self.padded_out, 2, dtype=act_dtype, device=dev))

    def dequantized_weight(self) -> torch.Tensor:
        """bf16 [N, in_features] in the activations' order (act-order undone, K padding dropped):
        w = (q - 8) * scale + zero, as tinygemm computes it. One Triton pass on a GPU in an eager
        call; the tensor ops elsewhere and while export or torch.compile trace (Inductor fuses them)."""
        if self.qweight_kn.is_cuda and triton is not None and type(self.qweight_kn) is torch.Tensor and not torch.compiler.is_compiling():
            return dequantize_kn(self.qweight_kn, self.scales_and_zeros, self.kernel_group_size, self.perm, self.in_features).T
        w = self.packed_order_weight()[: self.in_features]
        if self.perm is not None:  # packed row k is input row perm[k]
            w = torch.empty_like(w).index_copy_(0, self.perm.long(), w)
        return w.T

    def packed_order_weight(self) -> torch.Tensor:
        """[Kp, N] from qweight_kn with tensor ops, rows in the packed (kernel's K) order."""
        return dequantize_folded_int4(unpack_rows(self.qweight_kn, 4), self.scales_and_zeros, self.kernel_group_size)

    def check_loaded(self) -> str | None:
        """Also: the two copies of the codes agree (decode reads tinygemm's, prefill qweight_kn's),
        so no artifact runs one model for short prompts and another for long ones."""
        if problem := super().check_loaded():
            return problem
        # gptq.unpack_rows and pack_tinygemm: not the unpackers the kernel paths use, so a fault in
        # those shows in verify's probes rather than here
        ikt, N = self.qweight.shape[-1] * 2, self.padded_out
        step = max(8, (CHECK_CODES // self.padded_in) // 8 * 8)  # columns at a time: pack_tinygemm's int64s stay bounded
        for n0 in range(0, N, step):
            n1 = min(n0 + step, N)
            if not torch.equal(pack_tinygemm(gptq.unpack_rows(self.qweight_kn[:, n0:n1], 4), ikt), self.qweight[n0 // 8 : n1 // 8]):
                return "qweight: its codes differ from qweight_kn's (the decode and prefill copies of one weight)"
        return None

    def paths(self) -> tuple[str, ...]:
        if not self.qweight.is_cuda or triton is None:
            return ()
        return ("tinygemm", "triton", "dequant", "mslk") if self.mslk_fits() else ("tinygemm", "triton", "dequant")

    def mslk_parts(self) -> tuple[int, ...]:
        """The column widths mslk runs one GEMM each for: a fused module's members, else the whole."""
        return self.parts or (self.padded_out,)

    def mslk_fits(self) -> bool:
        """mslk installed, groups it takes, and each part a width it tiles."""
        return self.kernel_group_size >= MSLK_MIN_GROUP and all(n % MSLK_N_ALIGN == 0 for n in self.mslk_parts()) and \
            self.mslk_failed is None and mslk_available()

    def plan_shape(self) -> str:
        """Also the parts: whether mslk fits depends on them, so modules of one shape share a plan
        only when they agree on it."""
        return super().plan_shape() + (f":parts{'+'.join(map(str, self.parts))}" if self.parts else "")

    def prepare(self, path: str) -> None:
        """mslk: its layout of each part, built once on the GPU, then checked part by part against
        the dequantize path on random rows; a build that fails or computes something else (another
        mslk version's layout) is dropped and the path no longer offered, with the reason in
        `mslk_failed`, and a plan naming it falls back to the fixed rule."""
        if path != "mslk" or self.mslk_weights is not None or self.mslk_failed is not None:
            return
        try:
            if not self.mslk_fits():
                raise ValueError("mslk does not fit this module's groups or parts")
            with torch.no_grad():
                self._build_mslk()
        except Exception as e:  # a shape mslk rejects, out of GPU memory: the other paths still run
            self.mslk_weights, self.mslk_failed = None, f"mslk's build failed ({type(e).__name__}: {str(e)[:200]})"
        if self.mslk_failed is not None:
            if any(p == "mslk" for _, p in self.plan):
                self.plan, self.plan_max_m = (), 0  # the fixed rule instead
            import warnings

            warnings.warn(f"{self.mslk_failed}: path not used", stacklevel=2)

    def _build_mslk(self) -> None:
        parts, n0, weights = self.mslk_parts(), 0, []
        for n in parts:
            weights.append(mslk_layout(self.qweight_kn[:, n0 : n0 + n], self.scales_and_zeros[:, n0 : n0 + n]))
            n0 += n
        self.mslk_weights = weights
        x = torch.randn(16, self.in_features, generator=torch.Generator(self.qweight.device).manual_seed(0),
                        device=self.qweight.device).to(self.act_dtype)
        ref = self.run(x, "dequant")[:, :n0].float().split(list(parts), -1)
        got = self.run(self.gather(x), "mslk").float().split(list(parts), -1)
        rel = max(float((g - r).norm() / r.norm().clamp_min(1e-30)) for g, r in zip(got, ref, strict=True))
        if not rel <= 1e-2:  # NaN fails too
            self.mslk_weights, self.mslk_failed = None, f"mslk's output differs from the dequantize path's by {rel:.1e}"

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is None or not x.is_cuda or triton is None or torch.compiler.is_compiling():
            return super().gather(x)  # traced: Inductor fuses the gather into its producer
        return gather_pad(x, self.perm, self.padded_in)

    def default_path(self, m: int) -> str:
        """tinygemm up to DECODE_MAX_M rows, then dequantizing (one Triton pass) + cuBLAS: it beat the
        Triton GEMM at every M from 64 on all eight 1.5B and 7B linears on an H100, and beats it on
        the whole prefill (benchmarks/experiments/results/cuda-prefill-h100.json; BENCHMARKS.md, "Kernel plans")."""
        return "tinygemm" if m <= DECODE_MAX_M else "dequant"

    def input_order(self, path: str) -> bool:
        return path == "dequant"  # its weight is dequantized straight into the activations' order

    def forward_split(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """A fused projection's parts on the dequantize path: one GEMM per part on column slices of
        the weight dequantized once, so each part comes out contiguous without a copy of the fused
        output (for the 1.5B's gate/up, 18 MB read and written per layer), and a bias rides in
        addmm. Measured on the whole prefill: benchmarks/experiments/results/cuda-split-h200.json, cuda-split-7b-h200.json."""
        x2 = x.reshape(-1, self.in_features).to(self.act_dtype)
        path = self.path_for(x2.shape[0]) if self.paths() else None
        if path == "mslk" and tuple(sizes) == self.parts:  # mslk's layout is one per part already
            xg = self.gather(x2).contiguous()
            parts = [self.mslk_part(xg, i) for i in range(len(sizes))]
            if self.bias is not None:
                parts = [p + b for p, b in zip(parts, self.bias.split(sizes), strict=True)]
            return [p.reshape(*x.shape[:-1], n) for p, n in zip(parts, sizes, strict=True)]
        if path != "dequant":
            return super().forward_split(x, sizes)
        w, parts, n0 = self.dequantized_weight().T, [], 0  # [in_features, padded_out], row-major
        for n in sizes:
            part = x2 @ w[:, n0 : n0 + n] if self.bias is None else torch.addmm(self.bias[n0 : n0 + n], x2, w[:, n0 : n0 + n])
            parts.append(part.reshape(*x.shape[:-1], n))
            n0 += n
        return parts

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """Off a GPU (verify, tests: no paths, so forward has gathered and padded x): the fixed
        rule's path with each copy of the codes in the kernel's K order."""
        if self.default_path(x.shape[0]) == "tinygemm":
            return self.run(x, "tinygemm")
        return F.linear(x, self.packed_order_weight().T)

    def run(self, x: torch.Tensor, path: str) -> torch.Tensor:
        if path == "tinygemm":
            if x.is_cuda:
                return torch.ops.aten._weight_int4pack_mm(x, self.qweight, self.kernel_group_size, self.scales_and_zeros)
            # off the GPU (verify, tests): tinygemm's own copy of the codes, so its layout is checked too
            codes = unpack_tinygemm(self.qweight).T
            return F.linear(x, dequantize_folded_int4(codes, self.scales_and_zeros, self.kernel_group_size).T)
        if path == "triton":
            return int4_kn_gemm_op(x, self.qweight_kn, self.scales_and_zeros, self.kernel_group_size)
        if path == "mslk":
            parts = [self.mslk_part(x, i) for i in range(len(self.mslk_parts()))]
            return parts[0] if len(parts) == 1 else torch.cat(parts, -1)
        return F.linear(x, self.dequantized_weight())

    def mslk_part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Part i's output [M, n] from x in the kernel's K order [M, Kp]."""
        self.prepare("mslk")  # no-op once built: load and warm build it before any timing or capture
        if self.mslk_weights is None:
            raise RuntimeError(f"{self.mslk_failed}: the mslk path cannot run")
        return torch.ops.mslk.bf16i4bf16_shuffled(x, *self.mslk_weights[i])


class CudaTarget(Target):
    name = "cuda"
    device = "cuda"
    default_act_dtype = torch.bfloat16
    act_dtypes = (torch.bfloat16,)
    act_dtype_note = " (tinygemm, its decode kernel, is bf16-only)"
    layout_version = 1
    cpu_emulator = True  # off a GPU the modules dequantize each copy of the codes with tensor ops (verify, tests)
    preference = 1

    def compat_key(self) -> dict:
        return {"torch": torch_base_version()}

    def runtime_problem(self) -> str | None:
        return None if self.present() else "no CUDA device here (torch.cuda.is_available() is False)"

    def present(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def cache_key_fields(self, started: bool = True) -> dict:
        if not started:
            return {}
        major, minor = torch.cuda.get_device_capability()
        return {"name": torch.cuda.get_device_name(), "capability": f"sm_{major}{minor}", "cuda": torch.version.cuda,
                "driver": driver_version()}

    def describe(self) -> dict:
        return {"name": torch.cuda.get_device_name(), "capability": ".".join(map(str, torch.cuda.get_device_capability())),
                "cuda": torch.version.cuda, "triton": None if triton is None else triton.__version__}

    def variant_name(self, manifest: dict) -> str:
        """cuda-sm_90: the GPU its kcache was warmed on, where it has one."""
        kcap = manifest.get("kcache", {}).get("key", {}).get("capability")
        return f"{self.name}-{kcap}" if kcap else self.name

    def kernel(self, bits: int) -> str:
        return "aten._weight_int4pack_mm+dequant-bf16-matmul" if bits == 4 else "dequant-int8-matmul"

    def pack(self, layer: PrepackLayer, act_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
        from quantprep.targets import act_dtype_problem

        if problem := act_dtype_problem(self, act_dtype):  # build checks first; this guards direct callers
            from quantprep.errors import RecipeError

            raise RecipeError(problem)
        meta, tensors = base_meta(layer), optional_tensors(layer, act_dtype)
        K, N = layer.in_features, layer.out_features
        if layer.bits == 8:
            int8, meta["int8_kernel"] = pack_int8(layer, act_dtype, per_channel_kernel=True)
            return tensors | int8, meta
        c, Kp, s, z = regroup(layer, self.group_sizes, self.name)  # Kp is a multiple of c >= 32
        ikt, Np = inner_k_tiles(Kp), round_up(N, N_ALIGN)
        codes = layer.codes
        if (Kp, Np) != (K, N):
            codes = F.pad(codes, (0, Np - N, 0, Kp - K), value=8)
        sz = F.pad(torch.stack([s, (8 - z.float()) * s], dim=-1), (0, 0, 0, Np - N))
        tensors.update(qweight=pack_tinygemm(codes, ikt), qweight_kn=pack_rows(codes, 4), scales_and_zeros=sz.to(act_dtype))
        meta.update(kernel_group_size=c, padded_in=Kp, padded_out=Np, inner_k_tiles=ikt)
        return tensors, meta

    def meta_problem(self, meta: dict) -> str | None:
        """The Triton kernels index memory by these: exactly what pack wrote."""
        if meta["bits"] != 4:
            return super().meta_problem(meta)
        return tiled_int4_problem(meta, "cuda", N_ALIGN, lambda c: {"inner_k_tiles": inner_k_tiles(round_up(meta["in_features"], c))})

    def make_module(self, meta: dict, act_dtype: torch.dtype) -> nn.Module:
        return CudaInt4Linear(meta, act_dtype) if meta["bits"] == 4 else make_int8_module(meta, act_dtype)


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


TARGET = CudaTarget()
