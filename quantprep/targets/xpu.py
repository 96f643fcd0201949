"""xpu target (Intel Arc A-series and B-series, Xe iGPUs), through upstream torch ops only (no IPEX).

int4: `aten._weight_int4pack_mm_with_scales_and_zeros` (torch >= 2.8, XPU only). It takes the
weight as int32 [N, K/8] with element k at bits 4*(k%8), which is GPTQ's `qweight.T` once K is in
act-order, plus scales [K/c, N] and int8 zeros [K/c, N] (v2 values), w = (q - zero) * scale.
Nothing needs an XPU to pack, so xpu artifacts build on any machine. Off an XPU (tests, `verify`
on a CPU-only machine) the module runs `xpu_emulator`, written from the kernel's source.

int8: the exact dequantize + matmul path shared with the other targets.
"""

from __future__ import annotations

import torch
from torch import nn

from quantprep.format.gptq import PrepackLayer
from quantprep.targets import xpu_emulator
from quantprep.targets.common import (
    PackedLinear,
    Target,
    base_meta,
    make_int8_module,
    optional_tensors,
    pack_int8,
    regroup,
    torch_base_version,
)
from quantprep.targets.intel_runtime import arch_warning

KERNEL = "aten._weight_int4pack_mm_with_scales_and_zeros"
# Any multiple of 32 is accepted (Blas.cpp); these are the ones GPTQ group sizes divide into.
KERNEL_GROUP_SIZES = (256, 128, 64, 32)


def pack_int4_nk(codes: torch.Tensor, block: int = 1 << 24) -> torch.Tensor:
    """uint8 codes [K, N] -> int32 [N, K/8], element k at bits 4*(k%8) (little-endian bytes).
    About `block` codes (a slab of columns) at a time: nibble pairs packed along K, then only the
    half-size slab transposed. Memory: the result and one slab."""
    K, N = codes.shape
    out = torch.empty(N, K // 2, dtype=torch.uint8)
    cols = max(1, block // K)
    for n0 in range(0, N, cols):
        slab = codes[:, n0:n0 + cols]
        out[n0:n0 + cols] = (slab[0::2] | (slab[1::2] << 4)).T
    return out.view(torch.int32)


class XpuInt4Linear(PackedLinear):
    def __init__(self, meta: dict, act_dtype: torch.dtype):
        super().__init__(meta, act_dtype)
        self.kernel_group_size = meta["kernel_group_size"]
        dev = torch.device("meta")
        n_groups = self.padded_in // self.kernel_group_size
        self.register_buffer("qweight", torch.empty(self.out_features, self.padded_in // 8, dtype=torch.int32, device=dev))
        self.register_buffer("scales", torch.empty(n_groups, self.out_features, dtype=act_dtype, device=dev))
        self.register_buffer("qzeros", torch.empty(n_groups, self.out_features, dtype=torch.int8, device=dev))

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        mm = torch.ops.aten._weight_int4pack_mm_with_scales_and_zeros if x.device.type == "xpu" else \
            xpu_emulator.weight_int4pack_mm_with_scales_and_zeros
        return mm(x, self.qweight, self.kernel_group_size, self.scales, self.qzeros)


class XpuTarget(Target):
    name = "xpu"
    device = "xpu"
    default_act_dtype = torch.float16
    act_dtypes = xpu_emulator.ACT_DTYPES  # oneDNN has no fp32 int4 primitive (docs/xpu.md)
    layout_version = 1
    cpu_emulator = True  # xpu_emulator runs the int4 kernel's semantics on CPU

    def compat_key(self) -> dict:
        return {"torch": torch_base_version()}

    def load_warning(self) -> str | None:
        """Checked at every load on a real XPU: a card torch has no AOT kernels for works, but
        JIT-compiles every kernel on first use (minutes)."""
        props = torch.xpu.get_device_properties()
        return arch_warning(props.name, torch.xpu.get_arch_list(), getattr(props, "architecture", None))

    def runtime_problem(self) -> str | None:
        if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 8):
            return f"torch {torch.__version__} has no XPU int4 kernel (needs torch >= 2.8)"
        if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            return "no XPU device here (torch.xpu.is_available() is False)"
        return None

    def kernel(self, bits: int) -> str:
        return KERNEL if bits == 4 else "dequant-int8-matmul"

    def pack(self, layer: PrepackLayer, act_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
        meta, tensors = base_meta(layer), optional_tensors(layer, act_dtype)
        if layer.bits == 8:
            int8, meta["int8_kernel"] = pack_int8(layer, act_dtype, per_channel_kernel=False)
            return tensors | int8, meta
        c, Kp, scales, zeros = regroup(layer, KERNEL_GROUP_SIZES, self.name)
        codes = layer.codes
        if Kp != layer.in_features:
            codes = torch.nn.functional.pad(codes, (0, 0, 0, Kp - layer.in_features), value=8)
        tensors.update(qweight=pack_int4_nk(codes), scales=scales.to(act_dtype), qzeros=zeros.to(torch.int8))
        meta.update(kernel_group_size=c, padded_in=Kp)
        return tensors, meta

    def make_module(self, meta: dict, act_dtype: torch.dtype) -> nn.Module:
        return XpuInt4Linear(meta, act_dtype) if meta["bits"] == 4 else make_int8_module(meta, act_dtype)


TARGET = XpuTarget()

