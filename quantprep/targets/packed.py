"""The torch side every target shares: GPTQ groups -> kernel groups, activation gather/pad,
PackedLinear (the module a target's kernel runs in), and the exact int8 path (no upstream kernel
on any device takes int8 with groups and zeros).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from quantprep.errors import SourceError
from quantprep.format.gptq import PrepackLayer
from quantprep.targets import KERNEL_GROUP_SIZES


def torch_base_version() -> str:
    return torch.__version__.split("+")[0]


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def tiled_int4_problem(meta: dict, target: str, n_align: int, more=lambda c: {}) -> str | None:
    """What in an int4 module's metadata is not what a tiled kernel's pack wrote: kernel_group_size one
    of KERNEL_GROUP_SIZES, K padded to it, N to n_align, and `more(kernel_group_size)`'s fields as
    given; else None. Kernels index memory by these (Target.meta_problem)."""
    c, k, n = meta.get("kernel_group_size"), meta["in_features"], meta["out_features"]
    if type(c) is int and c in KERNEL_GROUP_SIZES:
        expected = {"padded_in": round_up(k, c), "padded_out": round_up(n, n_align), **more(c)}
        if all(type(meta.get(f)) is type(v) and meta[f] == v for f, v in expected.items()):  # pack_block_n: None on some CPUs
            return None
    fields = ", ".join(f"{f} {str(meta.get(f))[:20]!r}" for f in ("kernel_group_size", "padded_in", "padded_out", *more(KERNEL_GROUP_SIZES[-1])))
    return f"{fields} are not what the {target} target packs for {k}x{n} here"


def kernel_group_size(group_size: int, in_features: int, allowed: tuple[int, ...]) -> int | None:
    """The allowed kernel group dividing the GPTQ group that pads K least (then the largest).
    A single group over all of K (group_size -1) has one scale, so any kernel group fits."""
    fits = [c for c in allowed if group_size % c == 0 or group_size >= in_features]
    return min(fits, key=lambda c: (round_up(in_features, c), -c), default=None)


def regroup(layer: PrepackLayer, allowed: tuple[int, ...], target: str) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """GPTQ groups -> uniform kernel groups of size c over K padded to Kp, exactly.

    Kernels need one group size that divides K; GPTQ has a partial last group whenever
    group_size does not divide K (SmolLM2: K=576, group 128). Each GPTQ group's scale and zero
    are repeated over the g/c kernel groups it spans; padded inputs read zero activations.
    Returns (c, Kp, scales [Kp/c, N] float32, zeros [Kp/c, N] uint8).
    """
    K, gs = layer.in_features, layer.group_size
    c = kernel_group_size(gs, K, allowed)
    if c is None:
        raise SourceError(f"tensor {layer.name}.scales: group_size {gs} does not fit the {target} int4 kernel (groups of {'/'.join(map(str, allowed))})")
    Kp = round_up(K, c)
    gptq_group = torch.arange(Kp // c) * c // gs
    return c, Kp, layer.scales.float()[gptq_group], layer.zeros[gptq_group]


def gather_and_pad(x: torch.Tensor, perm: torch.Tensor | None, padded_in: int) -> torch.Tensor:
    """Activations into the kernel's K order: act-order gather, then zero-pad K."""
    if perm is not None:
        x = x.index_select(-1, perm)
    if padded_in != x.shape[-1]:
        x = F.pad(x, (0, padded_in - x.shape[-1]))
    return x


# oneDNN has bf16/fp16 GEMM kernels from AVX512 on; below that a half-precision CPU matmul runs a
# reference loop, far slower than float32's for a prefill-sized GEMM on a 2-core AVX2 machine
# (benchmarks/experiments/README.md, "CPU int4 and int8 at large M"). The dequantize paths' dense matmuls
# run in float32 there.
SLOW_HALF_GEMM = torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2")


def dense_matmul(x: torch.Tensor, w: torch.Tensor, path: str = "dequant") -> torch.Tensor:
    """x [M, K] @ w [K, N] in x's dtype, or in float32 for path "dequant_f32"."""
    if path == "dequant_f32" and x.dtype != torch.float32:
        return (x.float() @ w.float()).to(x.dtype)
    return x @ w


def dense_path(act_dtype: torch.dtype, device: str) -> str:
    """The dequantize path here: a dense matmul in the activation dtype ("dequant"), or in float32
    ("dequant_f32") on CPUs without half-precision GEMM kernels, where the half one runs a reference
    loop (seconds per call: never worth timing in a kernel plan)."""
    slow_half = device == "cpu" and SLOW_HALF_GEMM and act_dtype in (torch.bfloat16, torch.float16)
    return "dequant_f32" if slow_half else "dequant"


def dequantize_folded_int4(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """codes [K, N] and [K/group_size, N, 2] (scale, folded zero) -> w = (q - 8) * scale + zero,
    [K, N] in the scales' dtype: the arithmetic of the cpu and cuda int4 kernels."""
    K, N = codes.shape
    sz = scales_and_zeros
    q = codes.view(K // group_size, group_size, N).to(sz.dtype)
    return ((q - 8) * sz[:, None, :, 0] + sz[:, None, :, 1]).view(K, N)


def pack_int8(layer: PrepackLayer, act_dtype: torch.dtype, per_channel_kernel: bool) -> tuple[dict[str, torch.Tensor], str]:
    """int8 tensors and the kernel that runs them. `aten._weight_int8pack_mm` (per-channel
    symmetric) is exact when every column has one group and the symmetric zero 128: then
    w = (q - 128) * s is an int8 times a per-column scale. Otherwise: the dequantize path."""
    if per_channel_kernel and layer.zeros.shape[0] == 1 and bool((layer.zeros == 128).all()):
        return {"qweight": (layer.codes.T.to(torch.int16) - 128).to(torch.int8).contiguous(),
                "scales": layer.scales[0].to(act_dtype)}, "per_channel"
    return {"qweight": layer.codes, "scales": layer.scales.to(act_dtype), "qzeros": layer.zeros}, "dequant"


def make_int8_module(meta: dict, act_dtype: torch.dtype, per_channel: type | None = None) -> nn.Module:
    """The int8 module for meta's kernel; per_channel: a target's own subclass of Int8PerChannelLinear."""
    per_channel_class = per_channel or Int8PerChannelLinear
    return (per_channel_class if meta.get("int8_kernel") == "per_channel" else DequantInt8Linear)(meta, act_dtype)


class CountedHandle(RemovableHandle):
    """The handle of a forward hook on a CountedModule: removing the hook is a change too."""

    def remove(self) -> None:
        CountedModule.changes += 1
        super().remove()


class CountedModule(nn.Module):
    """An nn.Module whose changes made through its own methods are counted, one count shared by every
    such module (`changes`): each attribute set or deleted (its class, training, buffers, parameters,
    submodules, forward), each tensor or module registered, _apply (to(), float(), ...), and a forward
    hook's removal. With torch's count of the hooks made (RemovableHandle.next_id), a C path that holds
    the addresses of many modules' tensors sees that none of them changed without walking them all
    (cpu_layers' decode layers). What bypasses nn.Module (writes into its dicts, a tensor's .data or
    set_) is not counted."""

    changes = 0

    def __setattr__(self, name: str, value) -> None:
        CountedModule.changes += 1
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        CountedModule.changes += 1
        super().__delattr__(name)

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        CountedModule.changes += 1
        super().register_buffer(name, tensor, persistent)

    def register_parameter(self, name: str, param) -> None:
        CountedModule.changes += 1
        super().register_parameter(name, param)

    def add_module(self, name: str, module) -> None:
        CountedModule.changes += 1
        super().add_module(name, module)

    def _apply(self, fn, recurse: bool = True):
        CountedModule.changes += 1
        return super()._apply(fn, recurse)

    def register_forward_hook(self, *args, **kwargs) -> RemovableHandle:
        handle = super().register_forward_hook(*args, **kwargs)
        handle.__class__ = CountedHandle
        return handle

    def register_forward_pre_hook(self, *args, **kwargs) -> RemovableHandle:
        handle = super().register_forward_pre_hook(*args, **kwargs)
        handle.__class__ = CountedHandle
        return handle


class PackedLinear(CountedModule):
    """A prepacked quantized Linear. Subclasses register their kernel's buffers and implement
    `kernel(x)` on 2-D activations already in the kernel's K order (act-order gather, K padding).

    A module with several kernel paths (the int4 kernel, dequantizing + a dense matmul, ...) lists
    them in `paths()`, runs one with `run(x, path)` and picks one by row count M: from its kernel
    plan when load applied one (`plan`: (first M, path) pairs, ascending, timed on this machine by
    warm up to `plan_max_m` rows: runtime/plan.py), else, and beyond that, by its fixed rule
    `default_path(M)`."""

    plan: tuple[tuple[int, str], ...] = ()
    plan_max_m: int = 0
    INT8_ACTIVATION_PATHS: tuple[str, ...] = ()  # paths that round the activations to int8: plans only on request (plan.py)
    TRACED_INSTEAD: dict[str, str] = {}  # a path traced code (export, torch.compile) cannot take -> the one it takes
    parts: tuple[int, ...] = ()  # a fused projection's member sizes (runtime/fused.py sets them)

    def paths(self) -> tuple[str, ...]:
        return ()  # one path: kernel() is all there is

    def default_path(self, m: int) -> str:
        raise NotImplementedError

    def run(self, x: torch.Tensor, path: str) -> torch.Tensor:
        raise NotImplementedError

    def input_order(self, path: str) -> bool:
        """Whether `path` takes the activations as they come (its weight is in their order), so
        forward skips the act-order gather and the K padding."""
        return False

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] into the kernel's K order (act-order gather, K padding)."""
        return gather_and_pad(x, self.perm, self.padded_in)

    def prepare(self, path: str) -> None:
        """Build whatever `path` needs beyond the artifact's tensors, before it is timed or captured
        (load calls it for each path of the applied plan). Most paths need nothing."""

    def path_for(self, m: int) -> str:
        if not 1 <= m <= self.plan_max_m:
            path = self.default_path(m)
        else:
            path = next(path for first, path in reversed(self.plan) if m >= first)
        return self.TRACED_INSTEAD.get(path, path) if self.TRACED_INSTEAD and torch.compiler.is_compiling() else path

    def plan_shape(self) -> str:
        """What a plan's timings depend on besides the machine: the kernel class, the packed sizes,
        the group and the activation dtype. Modules that agree share one entry of a plan."""
        group = getattr(self, "kernel_group_size", getattr(self, "group_size", 0))
        return f"{type(self).__name__}:{self.padded_in}x{self.padded_out}:g{group}:{str(self.act_dtype).removeprefix('torch.')}"

    def __init__(self, meta: dict, act_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = meta["in_features"], meta["out_features"]
        self.padded_in = meta.get("padded_in", self.in_features)
        self.padded_out = meta.get("padded_out", self.out_features)
        self.act_dtype = act_dtype
        dev = torch.device("meta")
        self.register_buffer("perm", torch.empty(self.in_features, dtype=torch.int32, device=dev) if meta["act_order"] else None)
        self.register_buffer("bias", torch.empty(self.out_features, dtype=act_dtype, device=dev) if meta["bias"] else None)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, self.path_for(x.shape[0]))

    def check_loaded(self) -> str | None:
        """What is wrong with the tensors an artifact gave this module, else None: `perm` must be a
        permutation of the input's rows (a native dense path writes weight row perm[k])."""
        if self.perm is not None:
            p = self.perm.long()
            if p.numel() != self.in_features or int(p.min()) < 0 or int(p.max()) >= self.in_features or \
                    not bool((torch.bincount(p, minlength=self.in_features) == 1).all()):
                return f"perm is not a permutation of 0..{self.in_features - 1}"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features).to(self.act_dtype)
        path = self.path_for(x.shape[0]) if self.paths() else None
        if path is None or not self.input_order(path):
            x = self.gather(x)
        x = x.contiguous()
        y = self.kernel(x) if path is None else self.run(x, path)
        if self.padded_out != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def forward_split(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """forward(x) split into column parts of `sizes` (a fused projection's members), each
        contiguous like a Linear's output; a path that can write the parts directly overrides it."""
        return [y.contiguous() for y in self(x).split(sizes, -1)]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, act_order={self.perm is not None}, dtype={self.act_dtype}"


class DequantInt8Linear(PackedLinear):
    """Exact GPTQ int8 with groups and zeros: dequantize, then a dense matmul (any device)."""

    def __init__(self, meta: dict, act_dtype: torch.dtype):
        super().__init__(meta, act_dtype)
        self.group_size = meta["group_size"]
        dev = torch.device("meta")
        n_groups = -(-self.in_features // self.group_size)
        self.register_buffer("qweight", torch.empty(self.in_features, self.out_features, dtype=torch.uint8, device=dev))
        self.register_buffer("scales", torch.empty(n_groups, self.out_features, dtype=act_dtype, device=dev))
        self.register_buffer("qzeros", torch.empty(n_groups, self.out_features, dtype=torch.uint8, device=dev))

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        gs, k = self.group_size, self.in_features
        # (code - zero) is an integer in [-255, 255]: exact in bf16/fp16, so only the scale rounds.
        centered = self.qweight.to(self.act_dtype) - self.qzeros.to(self.act_dtype).repeat_interleave(gs, 0)[:k]
        return dense_matmul(x, centered * self.scales.repeat_interleave(gs, 0)[:k], dense_path(x.dtype, x.device.type))


class Int8PerChannelLinear(PackedLinear):
    """int8 weight [N, K] times a per-output-channel scale (cpu and cuda). Fixed rule: on the CPU
    below DEQUANT_MIN_M rows `aten._weight_int8pack_mm`, from there dequantizing once per call and a
    dense matmul; on cuda always the latter, since torch's cuda int8 kernel is the slower one at
    every M. The switch points come from the kernel / dequantize ratios across M in
    benchmarks/experiments/README.md, "CPU int4 and int8 at large M" (int8_switch.py, cpu_prefill.py); a kernel
    plan replaces them with this machine's own."""

    DEQUANT_MIN_M = 128  # cpu
    DEQUANT_MIN_M_BY_DEVICE = {"cuda": 1}

    def __init__(self, meta: dict, act_dtype: torch.dtype):
        super().__init__(meta, act_dtype)
        dev = torch.device("meta")
        self.register_buffer("qweight", torch.empty(self.out_features, self.in_features, dtype=torch.int8, device=dev))
        self.register_buffer("scales", torch.empty(self.out_features, dtype=act_dtype, device=dev))

    def check_loaded(self) -> str | None:
        """As PackedLinear's; and the weight aligned (aligned_weight) here at load, before anything
        (compile, AOT) may trace it."""
        self.aligned_weight()
        return super().check_loaded()

    def aligned_weight(self) -> torch.Tensor:
        """qweight, copied once where it starts off a 64-byte boundary on the CPU (run's reason)."""
        w = self.qweight
        if w.device.type == "cpu" and type(w) is torch.Tensor and not torch.compiler.is_compiling() and w.data_ptr() % 64:
            self.qweight = w = w.clone()
        return w

    def int8_kernel(self) -> bool:
        """Whether torch's int8 kernel may run here. On the CPU it reads rows with aligned vector
        loads: K off a multiple of 16 (K = 136) crashed the process whatever the addresses."""
        return self.qweight.device.type != "cpu" or self.in_features % 16 == 0

    def paths(self) -> tuple[str, ...]:
        dense = dense_path(self.act_dtype, self.qweight.device.type)
        return ("int8", dense) if self.int8_kernel() else (dense,)

    def default_path(self, m: int) -> str:
        if not self.int8_kernel() or m >= self.DEQUANT_MIN_M_BY_DEVICE.get(self.qweight.device.type, self.DEQUANT_MIN_M):
            return dense_path(self.act_dtype, self.qweight.device.type)
        return "int8"

    def run(self, x: torch.Tensor, path: str) -> torch.Tensor:
        if path == "int8" and self.int8_kernel():  # (plans name only paths() here: the dense path otherwise)
            # and each operand must start aligned: a weight mapped from a file 8 bytes off 16, or an
            # activation view 4-16 bytes off 32, crashed it (tests/targets/test_cpu.py). Copied, aligned.
            w = self.aligned_weight()
            if x.device.type == "cpu" and type(x) is torch.Tensor and not torch.compiler.is_compiling() and x.data_ptr() % 64:
                x = x.clone()
            return torch.ops.aten._weight_int8pack_mm(x, w, self.scales)
        return dense_matmul(x, (self.qweight.to(self.act_dtype) * self.scales[:, None]).T, path)


def optional_tensors(layer: PrepackLayer, act_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """perm (when act-order is not the identity) and bias (when present)."""
    t = {}
    if layer.perm is not None:
        t["perm"] = layer.perm.to(torch.int32)
    if layer.bias is not None:
        t["bias"] = layer.bias.to(act_dtype)
    return t
