"""cpu target.

int4: `aten._weight_int4pack_mm_for_cpu`. Weight packed by `_convert_weight_to_int4pack_for_cpu`
from int32 codes [N, K] (the packed layout depends on the CPU ISA, so the ISA is part of the
compatibility key). The kernel computes w = (q - 8) * scale + zero per group, so GPTQ's
w = (q - z) * s becomes zero = (8 - z) * s. Kernel limits (torch 2.14): group size in
{32, 64, 128, 256}, K divisible by it, N divisible by 16.

GPTQ groups are mapped to kernel groups by `packed.regroup` (exact, see there).

int8: `_weight_int8pack_mm` is per-channel symmetric, so it runs only the GPTQ layers where that
is exact (one group per column, zero 128; faster than dequantizing at M=1, benchmarks/experiments/int8_switch.py); other
layers keep int8 codes and dequantize per forward (`base.pack_int8`).
"""

from __future__ import annotations

import functools
import itertools
import os
import platform
import threading

import torch
import torch.nn.functional as F
from torch import nn

from quantprep import settings
from quantprep.format.gptq import PrepackLayer
from quantprep.targets import c_library
from quantprep.targets.base import Target, base_meta
from quantprep.targets.packed import (
    Int8PerChannelLinear,
    PackedLinear,
    dense_matmul,
    dense_path,
    dequantize_folded_int4,
    make_int8_module,
    optional_tensors,
    pack_int8,
    regroup,
    round_up,
    tiled_int4_problem,
    torch_base_version,
)

N_ALIGN = 16


# Block sizes of aten._convert_weight_to_int4pack_for_cpu's layout per ISA (pytorch
# aten/src/ATen/native/cpu/int4mm_kernel.cpp, weight_to_int4pack_kernel). Per block of BLOCK_N
# output rows it stores [K, BLOCK_N/2] bytes: byte j of row k = w[j + BLOCK_N/2, k] << 4 | w[j, k];
# a last, partial block pairs adjacent rows. The op reads int32 [N, K] column by column; these
# tensor ops give the same bytes from uint8 codes several times faster (tests compare the two).
# Other ISAs fall back to the op itself.
FAST_PACK_BLOCK_N = {"AVX512": 64, "AVX2": 32}


def pack_int4(codes: torch.Tensor, capability: str, step: int = 1 << 24) -> torch.Tensor:
    """uint8 codes [K, N] (N % 16 == 0) -> the kernel's packed uint8 [N, K/2] for this ISA, about
    `step` codes at a time (memory: the result and one step of temporaries)."""
    K, N = codes.shape
    block = FAST_PACK_BLOCK_N.get(capability)
    if block is None:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.T.to(torch.int32).contiguous(), 1)
    out = torch.empty(N * K // 2, dtype=torch.uint8)
    n_full = N // block * block
    cols = max(1, step // (K * block)) * block
    for n0 in range(0, n_full, cols):
        n1 = min(n0 + cols, n_full)
        c = codes[:, n0:n1].reshape(K, (n1 - n0) // block, 2, block // 2)
        out[n0 * K // 2:n1 * K // 2] = (c[:, :, 0] | (c[:, :, 1] << 4)).permute(1, 0, 2).reshape(-1)
    if n_full < N:  # the last, partial block pairs adjacent rows
        c = codes[:, n_full:]
        out[n_full * K // 2:] = (c[:, 0::2] | (c[:, 1::2] << 4)).reshape(-1)
    return out.view(N, K // 2)


@functools.cache
def native_packer():
    """`pack_int4_cpu` (csrc/pack.c: pack_int4's layout straight from GPTQ's int32 codes, several times
    faster than the tensor ops); None without a C compiler or with QUANTPREP_PACK=torch (then the
    tensor ops)."""
    lib = None if os.environ.get(settings.PACK) == "torch" else c_library.library("pack")
    return None if lib is None else lib.pack_int4_cpu


@functools.cache
def native_dequantizer():
    """`dequant_int4_cpu` (csrc/dequant.c: the dense paths' weight in one pass over the packed bytes), or
    None (then the tensor ops). Built with OpenMP (GCC's) only where torch's runtime is the
    libgomp.so.1 already loaded: the library then binds to it (one runtime, torch's threads, torch's
    thread count); elsewhere one thread per call."""
    lib = c_library.library_with_torch_openmp("dequant")
    return None if lib is None else lib.dequant_int4_cpu


def eager(t: torch.Tensor) -> bool:
    """Real data in an eager call: export and torch.compile trace fake tensors, which have no data to
    hand to C (they take the tensor ops, which Inductor fuses), and torch.jit.trace records only
    tensor ops (a C call would be missing from its graph). Nor under torch.func's vmap or grad (their
    wrappers have no data pointer), with forward-mode AD active (C would drop the tangents), or a
    lazily negated view (its memory holds -t)."""
    return (type(t) is torch.Tensor and not torch.compiler.is_compiling() and not torch.jit.is_tracing() and not t.is_neg()
            and not torch._C._functorch.is_functorch_wrapped_tensor(t) and torch.autograd.forward_ad._current_level < 0)


class NativeWeight:
    """One packed int4 weight as the native dequantizer reads it: pack_int4's layout (K packed rows,
    N columns in blocks of `block`), the kernel's (scale, zero) pairs per group, and the output row
    of each packed row (act-order: packed row k is input row perm[k]) for the first `rows`."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, K: int, N: int, block: int, group_size: int,
                 perm: torch.Tensor | None = None, rows: int | None = None):
        self.fn = native_dequantizer()
        self.K, self.N, self.block, self.group_size = K, N, block, group_size
        self.rows = K if rows is None else rows
        # read as stored (bfloat16 or float32); other dtypes once as float32
        sz = scales_and_zeros if scales_and_zeros.dtype in (torch.bfloat16, torch.float32) else scales_and_zeros.float()
        self.scales_and_zeros = sz.contiguous()
        self.dest = None if perm is None else perm.to(torch.int32).contiguous()
        self.packed = packed.contiguous()
        # C indexes memory by these (a dest value out of range is skipped there): checked, not asserted
        tensors = [self.packed, self.scales_and_zeros] + ([] if self.dest is None else [self.dest])
        if any(t.device.type != "cpu" or not eager(t) for t in tensors) or self.packed.dtype != torch.uint8 or \
                (self.dest is not None and self.dest.numel() < self.rows) or self.rows > K or self.packed.numel() * 2 != K * N or \
                self.scales_and_zeros.shape != (-(-K // group_size), N, 2) or block not in (32, 64) or N % 2:
            raise ValueError(f"a packed int4 weight of {K}x{N} (block {block}, group {group_size}) does not match its tensors")

    def write(self, out: torch.Tensor, n_begin: int = 0, n_end: int | None = None) -> None:
        """Columns [n_begin, n_end) (n_begin on a block, n_end on a block or N) into out [rows,
        n_end - n_begin or more] (bfloat16 or float32, unit column stride), on torch's threads."""
        n_end = self.N if n_end is None else n_end
        if out.dtype not in (torch.bfloat16, torch.float32) or out.device.type != "cpu" or not eager(out) or \
                out.stride(1) != 1 or out.shape[0] < self.rows or \
                not 0 <= n_begin < n_end <= self.N or n_begin % self.block or (n_end % self.block and n_end != self.N) or \
                out.shape[1] < n_end - n_begin or (self.rows > 1 and out.stride(0) < n_end - n_begin):
            raise ValueError(f"columns [{n_begin}, {n_end}) of a {self.K}x{self.N} weight do not fit an output of {tuple(out.shape)}")
        sz = self.scales_and_zeros
        if self.fn(self.packed.data_ptr(), None if self.dest is None else self.dest.data_ptr(), sz.data_ptr(),
                   int(sz.dtype == torch.bfloat16), self.K, self.N, self.block, self.group_size, self.rows, n_begin, n_end,
                   out.stride(0), int(out.dtype == torch.bfloat16), out.data_ptr(), torch.get_num_threads()):
            raise MemoryError("the native dequantizer could not allocate a group's scales")


def dequantize_native(packed: torch.Tensor, scales_and_zeros: torch.Tensor, K: int, N: int, block: int, group_size: int,
                      dtype: torch.dtype, perm: torch.Tensor | None = None, rows: int | None = None) -> torch.Tensor | None:
    """pack_int4's layout (K packed rows) -> w = (q - 8) * scale + zero in `dtype` (bfloat16 or float32):
    [K, N], or with `perm` (act-order: packed row k is input row perm[k]) the first `rows` packed
    rows in input order, [rows, N]. None without the native dequantizer or for another dtype."""
    if not eager(packed) or dtype not in (torch.bfloat16, torch.float32) or native_dequantizer() is None:
        return None
    weight = NativeWeight(packed, scales_and_zeros, K, N, block, group_size, perm, rows)
    out = torch.empty(weight.rows, N, dtype=dtype)
    weight.write(out)
    return out




@functools.cache
def native_a8_block() -> int:
    """The pack block whose layout csrc/a8.c's int4_a8_cpu reads on this machine (64:
    AVX512-VNNI and VBMI; 32: AVX2 and FMA), or 0: no compiler, or neither ISA (no int4_a8 or
    int8_a8 path). An AVX512 CPU without VNNI or VBMI gets 32, and torch packs 64 there: int8_a8
    only. OpenMP as native_dequantizer."""
    lib = c_library.library_with_torch_openmp("a8")
    return 0 if lib is None else lib.a8_block()


@functools.cache
def native_int4_a8():
    """`int4_a8_cpu` (csrc/a8.c), or None without a kernel (native_a8_block)."""
    return c_library.library_with_torch_openmp("a8").int4_a8_cpu if native_a8_block() else None


@functools.cache
def native_int8_a8():
    """`int8_a8_cpu` (csrc/a8.c), or None without a kernel (native_a8_block)."""
    return c_library.library_with_torch_openmp("a8").int8_a8_cpu if native_a8_block() else None


GEMV_BLOCKS = (32, 64)  # the pack blocks csrc/gemv.c reads


@functools.cache
def gemv_library():
    """csrc/gemv.c compiled (int4_gemv_cpu, int4_gemv_rows), or None without a C compiler. OpenMP as native_dequantizer."""
    return c_library.library_with_torch_openmp("gemv")


def native_int4_gemv():
    """`int4_gemv_cpu` (csrc/gemv.c), or None without a C compiler."""
    lib = gemv_library()
    return None if lib is None else lib.int4_gemv_cpu


# The dense path multiplies one column tile of the weight at a time instead of dequantizing the
# whole weight first: each tile is written into a buffer that stays in cache by torch's own threads
# (each its share of the columns), then multiplied on them. Whole weights written to memory and read
# back, tiles written past the cache (streaming stores) and tiles written by one core for both to
# read were each slower (benchmarks/experiments/cpu_dense_tiles.py). Tiles are a
# power of two of columns of at most TILE_BYTES, or one pack block where a block is larger.
TILE_BYTES = 5 << 19
_tile = threading.local()


def tile_buffer(K: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """[K, columns] of `dtype` in a buffer this thread reuses (as large as the largest tile it has needed)."""
    need = K * columns * dtype.itemsize
    buf = getattr(_tile, "buf", None)
    if buf is None or buf.numel() < need:
        buf = _tile.buf = torch.empty(need, dtype=torch.uint8)
    return buf[:need].view(dtype).view(K, columns)


def tile_columns(weight: NativeWeight, dtype: torch.dtype, widest: int) -> int:
    """A tile's columns: pack blocks doubled while the tile fits TILE_BYTES and the widest range."""
    columns = weight.block
    while columns * 2 * weight.rows * dtype.itemsize <= TILE_BYTES and columns * 2 <= widest:
        columns *= 2
    return columns


def tiled_matmul(x: torch.Tensor, weight: NativeWeight, dtype: torch.dtype, bounds: tuple[int, ...] | None = None) -> list[torch.Tensor]:
    """x [M, rows] @ the dequantized weight [rows, N] in `dtype`, tile by tile (see TILE_BYTES),
    without autograd (out= writes): one contiguous output per column range [bounds[i], bounds[i+1])
    (default: (0, N); each bound on a pack block, or N)."""
    bounds = (0, weight.N) if bounds is None else bounds
    columns = tile_columns(weight, dtype, max(b - a for a, b in itertools.pairwise(bounds)))
    w = tile_buffer(weight.rows, columns, dtype)
    x = x.to(dtype)
    outputs = []
    for lo, hi in itertools.pairwise(bounds):
        y = torch.empty(x.shape[0], hi - lo, dtype=dtype)
        for n0 in range(lo, hi, columns):
            n1 = min(n0 + columns, hi)
            weight.write(w, n0, n1)
            torch.mm(x, w[:, : n1 - n0], out=y[:, n0 - lo : n1 - lo])
        outputs.append(y)
    return outputs


CODE_8_WORD = 0x88888888 - (1 << 32)  # eight codes of 8 in one int32: the padding, as pack_int4 pads


def pack_int4_from_gptq(qweight: torch.Tensor, perm: torch.Tensor | None, Kp: int, Np: int, block: int) -> torch.Tensor | None:
    """GPTQ int4 qweight [K/8, N] (+ act-order perm) -> pack_int4's result for codes padded to
    [Kp, Np] with 8; None when there is no native packer."""
    fn = native_packer()
    if fn is None:
        return None
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    q = qweight.contiguous()
    if Np != N:
        q = torch.cat([q, torch.full((K // 8, Np - N), CODE_8_WORD, dtype=torch.int32)], 1)
    if Kp != K:  # padded rows: source rows K.. of code 8, kept in place after the permuted ones
        q = torch.cat([q, torch.full(((Kp - K) // 8, Np), CODE_8_WORD, dtype=torch.int32)], 0)
    dest = None
    if perm is not None:  # result row k reads source row perm[k], so source row i goes to argsort(perm)[i]
        dest = torch.cat([torch.argsort(perm), torch.arange(K, Kp)])  # a permutation of 0..Kp-1 whatever perm is
    assert q.dtype == torch.int32 and q.shape == (Kp // 8, Np) and (dest is None or dest.shape == (Kp,))
    out = torch.empty(Np * Kp // 2, dtype=torch.uint8)
    fn(q.data_ptr(), None if dest is None else dest.data_ptr(), Kp, Np, block, out.data_ptr())
    return out.view(Np, Kp // 2)


def unpack_int4(packed: torch.Tensor, K: int, N: int, block: int) -> torch.Tensor:
    """Inverse of pack_int4 for a FAST_PACK_BLOCK_N layout: packed uint8 [N, K/2] -> codes [K, N]."""
    n_full = N // block * block
    flat = packed.view(-1)
    c = flat[: n_full * K // 2].view(n_full // block, K, block // 2)
    parts = [torch.stack([c & 15, c >> 4], dim=2).permute(1, 0, 2, 3).reshape(K, n_full)]
    if n_full < N:  # the last, partial block pairs adjacent rows
        t = flat[n_full * K // 2:].view(K, (N - n_full) // 2)
        parts.append(torch.stack([t & 15, t >> 4], dim=-1).reshape(K, N - n_full))
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


class CpuInt4Linear(PackedLinear):
    """Paths: "int4", the kernel (one bfloat16 row: csrc/gemv.c's int4_gemv_cpu, the same arithmetic
    in float32 with the weight streamed ahead, where it built); "dequant" (or "dequant_f32", base.dense_path), dequantizing the
    packed weight and a dense matmul, whose fixed cost the kernel's time, linear in M, passes at
    some M. Fixed rule: the dense path from DEQUANT_MIN_M rows, where it won on both machines
    measured (benchmarks/experiments/README.md, "CPU int4 and int8 at large M"); a kernel
    plan replaces it with this machine's own crossover."""

    DEQUANT_MIN_M = 384
    INT8_ACTIVATION_PATHS = ("int4_a8",)
    TRACED_INSTEAD = {"int4_a8": "int4"}  # its C call needs real data

    def __init__(self, meta: dict, act_dtype: torch.dtype):
        super().__init__(meta, act_dtype)
        self.kernel_group_size = meta["kernel_group_size"]
        self.pack_block_n = meta.get("pack_block_n")  # None: a layout we cannot unpack (DEFAULT ISA)
        dev = torch.device("meta")
        self.register_buffer("qweight", torch.empty(self.padded_out, self.padded_in // 2, dtype=torch.uint8, device=dev))
        n_groups = self.padded_in // self.kernel_group_size
        self.register_buffer("scales_and_zeros", torch.empty(n_groups, self.padded_out, 2, dtype=act_dtype, device=dev))

    def paths(self) -> tuple[str, ...]:
        if not self.pack_block_n:
            return ()
        a8 = ("int4_a8",) if self.act_dtype == torch.bfloat16 and self.pack_block_n == native_a8_block() else ()
        return ("int4", dense_path(self.act_dtype, "cpu"), *a8)

    def gemv_reads(self) -> bool:
        """Whether int4_gemv_cpu can read this module: bfloat16 activations and one of its blocks."""
        return self.act_dtype == torch.bfloat16 and self.pack_block_n in GEMV_BLOCKS

    def gemv(self, x: torch.Tensor) -> bool:
        """Whether int4_gemv_cpu runs the int4 path for x: one real bfloat16 CPU row that needs no
        gradient (at two rows it re-reads each block from cache and lost to torch's kernel), a module
        it reads, and the library built."""
        return x.shape[0] == 1 and x.dtype == torch.bfloat16 and self.gemv_reads() and eager(x) and x.device.type == "cpu" and \
            not (torch.is_grad_enabled() and x.requires_grad) and native_int4_gemv() is not None  # C keeps no autograd history

    def default_path(self, m: int) -> str:
        return dense_path(self.act_dtype, "cpu") if self.pack_block_n and m >= self.DEQUANT_MIN_M else "int4"

    def prepare(self, path: str) -> None:
        if path in ("dequant", "dequant_f32"):
            native_dequantizer()  # compiled (once a machine) here, not inside a first call that a plan times

    def run(self, x: torch.Tensor, path: str) -> torch.Tensor:
        if path == "int4":
            if self.gemv(x):
                return self.c_matmul(x, path)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.kernel_group_size, self.scales_and_zeros)
        if path == "int4_a8":
            return self.c_matmul(x, path)
        if self.tiles(path):
            return tiled_matmul(x, self.native_weight(), self.dense_dtype(path))[0].to(x.dtype)
        return dense_matmul(x, self.dequantize(self.dense_dtype(path)), path)

    def dense_dtype(self, path: str) -> torch.dtype:
        return torch.float32 if path == "dequant_f32" else self.act_dtype

    def tiles(self, path: str) -> bool:
        """Whether `path` runs as tiled_matmul: a dense path the native dequantizer writes, real data
        and no autograd (which would keep each tile for backward), and the dequantizer built."""
        return self.native_dense(path) and eager(self.qweight) and not torch.is_grad_enabled() and native_dequantizer() is not None

    def native_dense(self, path: str) -> bool:
        """Whether `path` is a dense path in a dtype the native dequantizer writes (tiles: where it built)."""
        return path in ("dequant", "dequant_f32") and self.dense_dtype(path) in (torch.bfloat16, torch.float32)

    def forward_split(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """A fused projection's members written straight into their own outputs on the tiled
        path (no copy of the fused output into contiguous parts), where each starts on a pack block."""
        bounds = list(itertools.accumulate(sizes, initial=0))
        path = self.path_for(x.numel() // self.in_features)  # decided before touching x: forward does the rest otherwise
        if not self.tiles(path) or any(b % self.pack_block_n for b in bounds[:-1]) or bounds[-1] != self.padded_out:
            return super().forward_split(x, sizes)  # a member off a block, or padded columns at the end
        x2 = x.reshape(-1, self.in_features).to(self.act_dtype).contiguous()
        parts = [y.to(self.act_dtype) for y in tiled_matmul(x2, self.native_weight(), self.dense_dtype(path), tuple(bounds))]
        if self.bias is not None:  # in the activation dtype, as forward adds it
            for y, b in zip(parts, self.bias.split(sizes), strict=True):
                y += b
        return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in parts]

    def input_order(self, path: str) -> bool:
        return path != "int4"  # the dense paths dequantize into the activations' order; int4_a8 gathers as it quantizes

    def c_matmul(self, x: torch.Tensor, path: str) -> torch.Tensor:
        """x [M, K] through csrc's int4_a8_cpu (path "int4_a8": x in the activations' order, gathered in C)
        or int4_gemv_cpu (path "int4": x already in the kernel's order and padding). One signature."""
        x = x.to(torch.bfloat16).contiguous()
        K = self.in_features if path == "int4_a8" else self.padded_in
        if not eager(x) or x.device.type != "cpu" or x.shape[1] != K:
            raise ValueError(f"{path} takes real cpu activations of {K} columns, not {tuple(x.shape)}")
        out = torch.empty(x.shape[0], self.padded_out, dtype=torch.bfloat16)
        perm, qweight, sz, Kp, N, gs = self.c_weight(path)
        kernel, perm = (native_int4_a8(), perm) if path == "int4_a8" else (native_int4_gemv(), None)
        status = kernel(x.data_ptr(), x.shape[0], x.stride(0), perm, K, qweight, sz, Kp, N, gs, self.pack_block_n,
                        out.data_ptr(), out.stride(0), torch.get_num_threads())
        if status == -2:
            raise ValueError(f"{path}'s library cannot read {self.pack_block_n}-column blocks of group {gs}")
        if status:
            raise MemoryError(f"{path} could not allocate its activations")
        return out

    def c_weight(self, path: str = "int4_a8") -> tuple:
        """The C kernels' weight arguments (perm, qweight, scales_and_zeros addresses; K, N, group).
        C indexes memory by them: the addresses are taken at each call (a buffer can move in place:
        share_memory_, set_), the checks done once per path and set of addresses, shapes, strides and dtypes."""
        b = self._buffers  # not the attributes: nn.Module's __getattr__ costs more than the rest, per call
        buffers = (b["perm"], b["qweight"], b["scales_and_zeros"])
        key = (path, *(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in buffers))
        if vars(self).get("_c_weight") != key:
            if any(t is not None and (not eager(t) or t.device.type != "cpu") for t in buffers):
                raise ValueError(f"{path} runs real cpu tensors only ({self.in_features}x{self.out_features})")
            perm, qweight, sz = buffers
            block = native_a8_block() if path == "int4_a8" else self.pack_block_n if self.gemv_reads() else None
            if any(t is not None and (not t.is_contiguous() or t.data_ptr() % t.element_size()) for t in buffers) or \
                    sz.dtype != torch.bfloat16 or \
                    sz.shape != (self.padded_in // self.kernel_group_size, self.padded_out, 2) or self.pack_block_n != block or \
                    qweight.dtype != torch.uint8 or qweight.numel() * 2 != self.padded_in * self.padded_out or \
                    (perm is not None and (perm.numel() != self.in_features or perm.dtype != torch.int32)):
                raise ValueError(f"{path} cannot run a {self.in_features}x{self.out_features} module with these tensors")
            vars(self)["_c_weight"] = key  # a cache of the checks, not a change (CountedModule)
        perm, qweight, sz = (None if t is None else t.data_ptr() for t in buffers)
        return perm, qweight, sz, self.padded_in, self.padded_out, self.kernel_group_size

    def native_weight(self) -> NativeWeight:
        return NativeWeight(self.qweight, self.scales_and_zeros, self.padded_in, self.padded_out, self.pack_block_n,
                            self.kernel_group_size, self.perm, self.in_features)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The kernel's own arithmetic, w = (q - 8) * scale + zero, as a dense [in_features, N]
        weight in the activations' order (act-order undone, K padding dropped) in `dtype` (default:
        the activations'): one native pass where it compiled, else tensor ops."""
        dtype = dtype or self.act_dtype
        K, Kp, N = self.in_features, self.padded_in, self.padded_out
        w = dequantize_native(self.qweight, self.scales_and_zeros, Kp, N, self.pack_block_n, self.kernel_group_size, dtype,
                              self.perm, K)
        if w is None:
            codes = unpack_int4(self.qweight, Kp, N, self.pack_block_n)
            w = dequantize_folded_int4(codes, self.scales_and_zeros, self.kernel_group_size).to(dtype)[:K]
            if self.perm is not None:  # packed row k is input row perm[k]
                w = torch.empty_like(w).index_copy_(0, self.perm.long(), w)
        return w


class CpuInt8PerChannelLinear(Int8PerChannelLinear):
    """Int8PerChannelLinear's paths, and "int8_a8" where it compiled (native_a8_block; bfloat16,
    K a multiple of 128): the activations rounded to int8 per group of 128 as int4_a8's, then u8 x s8
    dot products (int8_a8_cpu). torch's int8 kernel converts every weight to float before its
    product, which at one row makes the per-channel int8 lm_head compute-bound on a small CPU
    (BENCHMARKS.md, "llama.cpp, the CPU anchor"). A plan picks it only after `warm --int8-activations`."""

    INT8_ACTIVATION_PATHS = ("int8_a8",)
    TRACED_INSTEAD = {"int8_a8": "int8"}  # its C call needs real data

    def paths(self) -> tuple[str, ...]:
        a8 = self.act_dtype == torch.bfloat16 and self.in_features % 128 == 0 and native_a8_block() != 0
        return super().paths() + (("int8_a8",) if a8 else ())

    def run(self, x: torch.Tensor, path: str) -> torch.Tensor:
        return self.int8_a8(x) if path == "int8_a8" else super().run(x, path)

    def int8_a8(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] (in the weight's K order: forward gathered it) through int8_a8_cpu."""
        x = x.to(torch.bfloat16).contiguous()
        w, s = self._buffers["qweight"], self._buffers["scales"]
        if not all(eager(t) and t.device.type == "cpu" and t.is_contiguous() for t in (x, w, s)) or x.shape[1] != self.in_features \
                or w.dtype != torch.int8 or w.shape != (self.out_features, self.in_features) or s.dtype != torch.bfloat16 or \
                s.shape != (self.out_features,) or self.in_features % 128:
            raise ValueError(f"int8_a8 runs real contiguous cpu tensors of {self.in_features}x{self.out_features} only, not {tuple(x.shape)}")
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        if native_int8_a8()(x.data_ptr(), x.shape[0], x.stride(0), w.data_ptr(), s.data_ptr(), self.out_features, self.in_features,
                            out.data_ptr(), out.stride(0), torch.get_num_threads()):
            raise MemoryError("int8_a8 could not allocate its quantized activations")
        return out


class CpuTarget(Target):
    name = "cpu"
    device = "cpu"
    default_act_dtype = torch.bfloat16
    act_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    layout_version = 1
    preference = 2  # after the accelerators
    jit_kernels = False  # torch's and quantprep's C kernels are built ahead: a kcache without compile holds only a plan

    def compat_key(self) -> dict:
        return {"torch": torch_base_version(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}

    def runtime_problem(self) -> str | None:
        return None  # a CPU is always present

    def present(self) -> bool:
        return True

    def cache_key_fields(self, started: bool = True) -> dict:
        return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine()}

    def plan_key_fields(self) -> dict:
        return {"processor": c_library.cpuinfo("model name"), "threads": torch.get_num_threads()}

    def describe(self) -> dict:
        return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}

    def variant_name(self, manifest: dict) -> str:
        """cpu-avx2, cpu-avx512: the packed layout depends on the ISA."""
        cap = manifest["compat"].get("cpu_capability")
        return f"{self.name}-{str(cap).lower()}" if cap else self.name

    def kernel(self, bits: int) -> str:
        return "aten._weight_int4pack_mm_for_cpu" if bits == 4 else "aten._weight_int8pack_mm|dequant-int8-matmul"

    def pack(self, layer: PrepackLayer, act_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
        meta, tensors = base_meta(layer), optional_tensors(layer, act_dtype)
        if layer.bits == 8:
            int8, meta["int8_kernel"] = pack_int8(layer, act_dtype, per_channel_kernel=True)
            return tensors | int8, meta
        K, N = layer.in_features, layer.out_features
        c, Kp, s, z = regroup(layer, self.group_sizes, self.name)
        Np = round_up(N, N_ALIGN)
        sz = F.pad(torch.stack([s, (8 - z.float()) * s], dim=-1), (0, 0, 0, Np - N))  # [Kp/c, Np, 2]
        capability = torch.backends.cpu.get_cpu_capability()
        block = FAST_PACK_BLOCK_N.get(capability)
        packed = None if block is None else pack_int4_from_gptq(layer.qweight, layer.perm, Kp, Np, block)
        if packed is None:
            codes = layer.codes
            if (Kp, Np) != (K, N):
                codes = F.pad(codes, (0, Np - N, 0, Kp - K), value=8)  # [Kp, Np]
            packed = pack_int4(codes, capability)
        tensors["qweight"] = packed
        tensors["scales_and_zeros"] = sz.to(act_dtype)
        meta.update(kernel_group_size=c, padded_in=Kp, padded_out=Np, pack_block_n=block)
        return tensors, meta

    def meta_problem(self, meta: dict) -> str | None:
        """The native dequantizer indexes memory by these: exactly what pack wrote on this ISA."""
        if meta["bits"] != 4:
            return super().meta_problem(meta)
        pack_block_n = FAST_PACK_BLOCK_N.get(torch.backends.cpu.get_cpu_capability())
        return tiled_int4_problem(meta, "cpu", N_ALIGN, lambda c: {"pack_block_n": pack_block_n})

    def make_module(self, meta: dict, act_dtype: torch.dtype) -> nn.Module:
        return CpuInt4Linear(meta, act_dtype) if meta["bits"] == 4 else make_int8_module(meta, act_dtype, CpuInt8PerChannelLinear)


TARGET = CpuTarget()
