"""xpu target (Intel Arc A-series and B-series, Xe iGPUs), through upstream torch ops only (no IPEX).

int4: `aten._weight_int4pack_mm_with_scales_and_zeros` (torch >= 2.8, XPU only). It takes the
weight as int32 [N, K/8] with element k at bits 4*(k%8), which is GPTQ's `qweight.T` once K is in
act-order, plus scales [K/c, N] and int8 zeros [K/c, N] (v2 values), w = (q - zero) * scale.
Nothing needs an XPU to pack, so xpu artifacts build on any machine. Off an XPU (tests, `verify`
on a CPU-only machine) the module runs `xpu_emulator`, written from the kernel's source.

int8: the exact dequantize + matmul path shared with the other targets.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from quantprep.format.gptq import PrepackLayer
from quantprep.targets import xpu_emulator
from quantprep.targets.base import Target, base_meta
from quantprep.targets.packed import (
    PackedLinear,
    make_int8_module,
    optional_tensors,
    pack_int8,
    regroup,
    torch_base_version,
)
from quantprep.targets.xpu_env import (
    aot_name,
    arch_warning,
    cache_warning,
    int4_matmul_report,
    onednn_notes,
    primitive_cache_env,
    xpu_cache_report,
)

KERNEL = "aten._weight_int4pack_mm_with_scales_and_zeros"
# Its group size may be any multiple of 32 (Blas.cpp): the common KERNEL_GROUP_SIZES are those GPTQ groups divide into.
# XpuInt4Linear.kernel's call: every argument by position, as (its name in torch 2.8's schema, the
# type passed). pytorch#194692 (open) makes qZeros `Tensor?` and allows float32 scales: the call
# fits both, since int8 zero points stay valid.
KERNEL_CALL = (("self", torch.TensorType.get()), ("mat2", torch.TensorType.get()), ("qGroupSize", torch.IntType.get()),
               ("qScale", torch.TensorType.get()), ("qZeros", torch.TensorType.get()))


def kernel_schema() -> torch.FunctionSchema | None:
    """This torch's schema of KERNEL (the op's argument names, types and optionality), None where it has no such op."""
    try:
        return torch.ops.aten._weight_int4pack_mm_with_scales_and_zeros.default._schema
    except (AttributeError, RuntimeError):
        return None


def kernel_schema_problem(schema: torch.FunctionSchema) -> str | None:
    """Why KERNEL_CALL does not fit `schema`, else None: the call would fail in the first forward
    (too few arguments, one moved, keyword-only or of another type, a new one without a default,
    or a result that is not one Tensor)."""
    args = schema.arguments
    names = [a.name for a in args]
    if len(args) < len(KERNEL_CALL):
        return f"it takes {len(args)} arguments, quantprep passes {len(KERNEL_CALL)}"
    for i, ((name, passed), arg) in enumerate(zip(KERNEL_CALL, args[:len(KERNEL_CALL)], strict=True)):
        if name in names and names.index(name) != i:  # same-typed arguments swapped would pass the type check
            return f"{name} is argument {names.index(name)}, quantprep passes it as argument {i}"
        if arg.kwarg_only:
            return f"argument {i} ({arg.name}) is keyword-only, quantprep passes {name} by position"
        if not passed.isSubtypeOf(arg.type):
            return f"argument {i} ({arg.name}) is {arg.type}, quantprep passes {name} as {passed}"
    if required := [a.name for a in args[len(KERNEL_CALL):] if not a.has_default_value()]:
        return f"it requires {', '.join(required)}, which quantprep does not pass"
    if len(schema.returns) != 1 or not schema.returns[0].type.isSubtypeOf(torch.TensorType.get()):
        return "it does not return one Tensor"
    return None


def xpu_op_note(schema: torch.FunctionSchema | None) -> str:
    """This torch's schema of the xpu int4 op (its arguments' names, types and optionality, as torch
    prints them) and whether quantprep's call fits it (kernel_schema_problem)."""
    if schema is None:
        return f"int4 op {KERNEL}: not in this torch"
    if why := kernel_schema_problem(schema):
        return f"int4 op `{schema}`: quantprep's call does NOT fit it: {why}"
    optional = [a.name for a in schema.arguments if isinstance(a.type, torch.OptionalType)]
    also = f"; optional here: {', '.join(optional)} (quantprep still passes int8 zero points)" if optional else ""
    return f"int4 op `{schema}`: quantprep's call fits it{also}"


def driver_version() -> str | None:
    """The Level Zero driver version of XPU 0 (starts the device), None without an XPU."""
    if not TARGET.present():
        return None
    return getattr(torch.xpu.get_device_properties(), "driver_version", None)


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
        return mm(x, self.qweight, self.kernel_group_size, self.scales, self.qzeros)  # KERNEL_CALL, checked at load


class XpuTarget(Target):
    name = "xpu"
    device = "xpu"
    default_act_dtype = torch.float16
    act_dtypes = xpu_emulator.ACT_DTYPES  # oneDNN has no fp32 int4 primitive (docs/xpu.md)
    act_dtype_note = " (oneDNN has no float32 int4 matmul; docs/xpu.md)"
    layout_version = 1
    cpu_emulator = True  # xpu_emulator runs the int4 kernel's semantics on CPU
    preference = 0
    driver_cache = ("NEO_", "SYCL_")  # compute-runtime's and SYCL's kernel caches (docs/xpu.md)
    log_env = {"ONEDNN_VERBOSE": "2"}  # legacy level 2: creation and execution, understood by every oneDNN 3.x

    def compat_key(self) -> dict:
        return {"torch": torch_base_version()}

    def present(self) -> bool:
        return hasattr(torch, "xpu") and torch.xpu.is_available()

    def synchronize(self) -> None:
        torch.xpu.synchronize()

    def started(self) -> bool:
        return torch.xpu.is_initialized()

    def cache_key_fields(self, started: bool = True) -> dict:
        key = {"arch_list": torch.xpu.get_arch_list()}  # compiled into torch: no device start
        if started:
            props = torch.xpu.get_device_properties()
            key.update(name=props.name, driver=getattr(props, "driver_version", None))
        return key

    def describe(self) -> dict:
        props = torch.xpu.get_device_properties()
        arch, architecture, driver = torch.xpu.get_arch_list(), getattr(props, "architecture", None), getattr(props, "driver_version", None)
        return {"name": props.name, "driver": driver, "architecture": architecture, "aot_name": aot_name(architecture, props.name),
                "arch_list": arch, "notes": [xpu_op_note(kernel_schema()),
                                             *xpu_cache_report(dict(os.environ), arch, props.name, architecture, driver)]}

    def run_env(self, manifest: dict, env: dict[str, str]) -> dict[str, str]:
        """ONEDNN_PRIMITIVE_CACHE_CAPACITY for the warmed prompt lengths x the int4 linear shapes, when
        oneDNN's default would evict some of them (xpu_env.primitive_cache_env); before the
        first oneDNN primitive is created."""
        lengths = manifest.get("kcache", manifest.get("serving", {})).get("shapes", [])
        linears = {(m["in_features"], m["out_features"]) for m in manifest.get("modules", {}).values() if m.get("bits") == 4}
        return primitive_cache_env(len(lengths) + 1, len(linears), env)  # + 1: decode (M=1)

    def warm_env(self, manifest: dict, env: dict[str, str]) -> dict[str, str]:
        """run_env, and native code from Triton when `ocloc` is on PATH (TRITON_XPU_GEN_NATIVE_CODE:
        Triton compiles SPIR-V to a zebin with ocloc, so kcache/triton holds binaries instead of
        SPIR-V that only the driver cache could keep compiled)."""
        extra = self.run_env(manifest, env)
        if shutil.which("ocloc", path=env.get("PATH")) and "TRITON_XPU_GEN_NATIVE_CODE" not in env:
            extra["TRITON_XPU_GEN_NATIVE_CODE"] = "1"
        return extra

    def cache_warning(self, env: dict[str, str]) -> str | None:
        return cache_warning(env, driver_version())

    def read_log(self, lines: list[str]) -> tuple[list[dict], list[str]]:
        """oneDNN's verbose output: which implementation ran each int4 matmul (xpu_env)."""
        rows = int4_matmul_report(lines)
        return rows, onednn_notes(rows)

    def load_warning(self) -> str | None:
        """Checked at every load on a real XPU: a card torch has no AOT kernels for works, but
        JIT-compiles every kernel on first use (minutes)."""
        props = torch.xpu.get_device_properties()
        return arch_warning(props.name, torch.xpu.get_arch_list(), getattr(props, "architecture", None))

    def runtime_problem(self) -> str | None:
        if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 8):
            return f"torch {torch.__version__} has no XPU int4 kernel (needs torch >= 2.8)"
        schema = kernel_schema()  # before the device: the op's contract is the installed torch's, card or not
        if schema is None:
            return f"torch {torch.__version__} has no {KERNEL}"
        if why := kernel_schema_problem(schema):
            call = ", ".join(f"{t} {n}" for n, t in KERNEL_CALL)
            return (f"torch {torch.__version__}'s {KERNEL} is `{schema}`, which quantprep's call ({call}) does not fit: {why}; "
                    "install a torch whose op takes that call, or a quantprep that knows this schema")
        if not self.present():
            return "no XPU device here (torch.xpu.is_available() is False)"
        return None

    def kernel(self, bits: int) -> str:
        return KERNEL if bits == 4 else "dequant-int8-matmul"

    def pack(self, layer: PrepackLayer, act_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
        meta, tensors = base_meta(layer), optional_tensors(layer, act_dtype)
        if layer.bits == 8:
            int8, meta["int8_kernel"] = pack_int8(layer, act_dtype, per_channel_kernel=False)
            return tensors | int8, meta
        c, Kp, scales, zeros = regroup(layer, self.group_sizes, self.name)
        codes = layer.codes
        if Kp != layer.in_features:
            codes = torch.nn.functional.pad(codes, (0, 0, 0, Kp - layer.in_features), value=8)
        tensors.update(qweight=pack_int4_nk(codes), scales=scales.to(act_dtype), qzeros=zeros.to(torch.int8))
        meta.update(kernel_group_size=c, padded_in=Kp)
        return tensors, meta

    def meta_problem(self, meta: dict) -> str | None:
        """The op reads [N, padded_in / 8] codes and padded_in / kernel_group_size groups."""
        if problem := super().meta_problem(meta):
            return problem
        c, k = meta.get("kernel_group_size"), meta["in_features"]
        if meta["bits"] == 4 and (type(c) is not int or c not in self.group_sizes or meta.get("padded_in") != -(-k // c) * c):
            return f"kernel_group_size {str(c)[:20]!r} and padded_in {str(meta.get('padded_in'))[:20]!r} are not what the xpu target packs for {k} inputs"
        return None

    def make_module(self, meta: dict, act_dtype: torch.dtype) -> nn.Module:
        return XpuInt4Linear(meta, act_dtype) if meta["bits"] == 4 else make_int8_module(meta, act_dtype)


TARGET = XpuTarget()

