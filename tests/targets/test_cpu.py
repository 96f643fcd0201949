"""cpu target: every prepacked linear equals the dense float32 reference on fresh random inputs.

Tolerances (relative Frobenius error of the output): float32 activations 1e-5 (only float32
summation order and the folded zero (8 - z) * s rounding differ); bfloat16 2e-2 (activations and
scales round to 8 mantissa bits, ~0.4% per element; measured ~3e-3).
"""

import itertools

import pytest
import torch
from conftest import prepacked_module, rel_err, top1
from native_c import require_c, require_int4_a8

from quantprep.build.source import QuantConfig
from quantprep.build.synthetic import random_gptq_tensors
from quantprep.targets import get_target
from quantprep.targets.packed import Int8PerChannelLinear, dequantize_folded_int4

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CPU = get_target("cpu")


def _module_for(raw, q, dtype):
    return prepacked_module("cpu", raw, q, dtype)


@pytest.mark.parametrize("bits,group_size,sym,act_order,v1", list(itertools.product([4, 8], [-1, 32, 64, 128], [True, False], [True, False], [True, False])))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [2, 8])  # 128 rows: the int4 kernel; 512: dequantize + matmul
def test_prepacked_linear_matches_dense(bits, group_size, sym, act_order, v1, dtype, batch):
    # K=576 with group 128 (partial last group, as SmolLM2); N=200 is not a multiple of 16.
    K, N = 576, 200
    gen = torch.Generator().manual_seed(hash((bits, group_size, sym, act_order, v1)) % 2**31)
    raw = random_gptq_tensors(K, N, bits, group_size, sym, act_order, v1, bias=True, generator=gen)
    q = QuantConfig(bits, group_size, sym, act_order, "gptq" if v1 else "gptq_v2")
    layer, module, _ = _module_for(raw, q, dtype)
    assert isinstance(module, Int8PerChannelLinear) == (bits == 8 and group_size == -1 and sym)
    x = torch.randn(batch, 64, K)  # fresh inputs, batched 3-D as in a transformer
    ref = x @ layer.dequantize() + layer.bias.float()
    with torch.no_grad():
        y = module(x.to(dtype)).float()
    assert y.shape == (batch, 64, N)
    rel = ((y - ref).norm() / ref.norm()).item()
    assert rel < TOL[dtype], f"rel err {rel:.2e}"
    # Top-1 over 128-512 rows: bf16 flips near-ties (~1% of rows measured), float32 may flip exact near-ties only.
    top1 = (y.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert top1 >= (0.99 if dtype == torch.float32 else 0.9)


def test_kernel_group_and_padding_choice():
    gen = torch.Generator().manual_seed(0)
    q = QuantConfig(4, 128, True, True, "gptq")
    _, _, meta = _module_for(random_gptq_tensors(576, 200, 4, 128, True, True, True, generator=gen), q, torch.bfloat16)
    # 576 = 4.5 groups of 128: kernel groups of 64 divide both, so no K padding; N pads to 208.
    assert (meta["kernel_group_size"], meta["padded_in"], meta["padded_out"]) == (64, 576, 208)
    q = QuantConfig(4, -1, True, False, "gptq")
    _, _, meta = _module_for(random_gptq_tensors(200, 64, 4, -1, True, False, True, generator=gen), q, torch.bfloat16)
    assert (meta["kernel_group_size"], meta["padded_in"]) == (32, 224)  # 200 -> padded to a multiple of 32


def test_a_wrong_zero_is_caught():
    """The reference comparison must be able to fail: corrupt one zero and the error explodes."""
    gen = torch.Generator().manual_seed(1)
    q = QuantConfig(4, 32, False, True, "gptq_v2")
    layer, module, _ = _module_for(random_gptq_tensors(256, 64, 4, 32, False, True, False, generator=gen), q, torch.float32)
    module.scales_and_zeros[0, :, 1] += module.scales_and_zeros[0, :, 0]  # zero off by one code
    x = torch.randn(4, 256, generator=gen)
    ref = x @ layer.dequantize()
    rel = ((module(x) - ref).norm() / ref.norm()).item()
    assert rel > 10 * TOL[torch.float32]  # a correct float32 module is ~1e-6 (measured)


@pytest.mark.parametrize("N,K", [(64, 64), (128, 576), (80, 64), (208, 576), (16, 32), (1536, 512)])
@pytest.mark.parametrize("step", [1 << 24, 1, 70_000])  # codes packed per step: whole, one block, a few blocks
def test_fast_pack_equals_upstream_op(N, K, step):
    from quantprep.targets.cpu import pack_int4

    codes = torch.randint(0, 16, (K, N), dtype=torch.uint8)
    ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.T.to(torch.int32).contiguous(), 1)
    assert torch.equal(pack_int4(codes, torch.backends.cpu.get_cpu_capability(), step), ref)


def _native_or_skip():
    from quantprep.targets.cpu import native_packer

    require_c(native_packer() is not None)  # without it prepack packs with the tensor ops, which the tests above cover


# (K, N, Kp, Np): as is; N with a partial last block; K and N padded (kernel group, N % 16)
@pytest.mark.parametrize("K,N,Kp,Np", [(576, 192, 576, 192), (576, 208, 576, 208), (200, 200, 224, 208), (32, 16, 32, 16)])
@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("isa", ["AVX512", "AVX2"])
def test_native_pack_from_gptq_equals_the_tensor_ops(K, N, Kp, Np, act_order, isa):
    """The C packer reads GPTQ's int32 codes and the act-order perm; the tensor-ops path unpacks,
    gathers, pads with 8 and packs. Same bytes for both ISAs' blocks (whatever this CPU is)."""
    from quantprep.format.gptq import unpack_rows
    from quantprep.targets.cpu import FAST_PACK_BLOCK_N, pack_int4, pack_int4_from_gptq

    _native_or_skip()
    gen = torch.Generator().manual_seed(K * N)
    qweight = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, generator=gen)
    perm = torch.randperm(K, generator=gen) if act_order else None
    codes = unpack_rows(qweight, 4) if perm is None else unpack_rows(qweight, 4)[perm]
    codes = torch.nn.functional.pad(codes, (0, Np - N, 0, Kp - K), value=8)
    assert torch.equal(pack_int4_from_gptq(qweight, perm, Kp, Np, FAST_PACK_BLOCK_N[isa]), pack_int4(codes, isa))
    if isa == torch.backends.cpu.get_cpu_capability():  # and the upstream op on this CPU
        ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.T.to(torch.int32).contiguous(), 1)
        assert torch.equal(pack_int4_from_gptq(qweight, perm, Kp, Np, FAST_PACK_BLOCK_N[isa]), ref)


def test_the_target_packs_from_gptq_codes_without_unpacking_them(monkeypatch):
    """With a C compiler the cpu target never unpacks the codes, and its tensors equal those of the
    tensor-ops path (QUANTPREP_PACK=torch)."""
    from quantprep.build.prepack import prepare_layer
    from quantprep.build.source import _validate_layer
    from quantprep.targets import cpu

    _native_or_skip()
    raw = random_gptq_tensors(576, 200, 4, 128, False, True, True, generator=torch.Generator().manual_seed(3))
    layer = prepare_layer(_validate_layer("m", raw, QuantConfig(4, 128, False, True, "gptq")))
    native, _ = CPU.pack(layer, torch.bfloat16)
    assert "codes" not in layer.__dict__  # the cached property was never computed
    monkeypatch.setattr(cpu, "native_packer", lambda: None)
    ops, _ = CPU.pack(layer, torch.bfloat16)
    assert native.keys() == ops.keys() and all(torch.equal(native[k], ops[k]) for k in native)


@pytest.mark.parametrize("N,K", [(64, 64), (128, 576), (80, 64), (208, 576), (16, 32), (1536, 512)])
@pytest.mark.parametrize("block", [64, 32])
def test_unpack_inverts_pack(N, K, block):
    from quantprep.targets.cpu import FAST_PACK_BLOCK_N, pack_int4, unpack_int4

    isa = next(k for k, v in FAST_PACK_BLOCK_N.items() if v == block)
    codes = torch.randint(0, 16, (K, N), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(codes, isa), K, N, block), codes)


def test_large_m_dequant_path_agrees_with_the_kernel():
    """The two paths of one module, same weights, same rows: the dequantize path must reproduce
    the kernel (both round the weight to bf16; they differ only in summation order)."""
    gen = torch.Generator().manual_seed(5)
    layer, module, _ = _module_for(random_gptq_tensors(576, 208, 4, 128, False, True, True, generator=gen),
                                   QuantConfig(4, 128, False, True, "gptq"), torch.bfloat16)
    assert module.pack_block_n == 64 or torch.backends.cpu.get_cpu_capability() != "AVX512"
    x = torch.randn(module.DEQUANT_MIN_M, 576).bfloat16()
    with torch.no_grad():
        dense = module(x).float()
        kernel = module(x[:128]).float()  # below the threshold: the int4 kernel
    assert ((dense[:128] - kernel).norm() / kernel.norm()).item() < 1e-2


@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_other_isas_pack_and_run(isa):
    """ATEN_CPU_CAPABILITY picks the kernels' ISA at process start: check each layout we emit
    (AVX2: our packer; DEFAULT: the upstream op) against the op and the dense reference there."""
    import subprocess
    import sys

    code = """
import torch
from quantprep.targets.cpu import pack_int4
from quantprep.build.prepack import prepare_layer
from quantprep.build.source import QuantConfig, _validate_layer
from quantprep.build.synthetic import random_gptq_tensors
from quantprep.targets import get_target
from quantprep.targets.packed import Int8PerChannelLinear, dequantize_folded_int4
cap = torch.backends.cpu.get_cpu_capability()
codes = torch.randint(0, 16, (576, 208), dtype=torch.uint8)
assert torch.equal(pack_int4(codes, cap), torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.T.to(torch.int32).contiguous(), 1))
t = get_target("cpu")
layer = prepare_layer(_validate_layer("m", random_gptq_tensors(576, 208, 4, 128, False, True, True), QuantConfig(4, 128, False, True, "gptq")))
tensors, meta = t.pack(layer, torch.bfloat16)
assert t.meta_problem(meta) is None, t.meta_problem(meta)  # what load asks first
m = t.make_module(meta, torch.bfloat16)
m.load_state_dict(tensors, assign=True)
for rows in (64, 600):  # the int4 kernel, then (AVX2 only) the dequantize path
    x = torch.randn(rows, 576)
    ref = x @ layer.dequantize()
    rel = ((m(x.bfloat16()).float() - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel
assert (meta["pack_block_n"] is None) == (cap == "DEFAULT")
print(cap)
"""
    import os

    env = dict(os.environ, ATEN_CPU_CAPABILITY=isa)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == isa.upper()


@pytest.mark.parametrize("M", [1, 8, Int8PerChannelLinear.DEQUANT_MIN_M - 1, Int8PerChannelLinear.DEQUANT_MIN_M, 200])
def test_int8_per_channel_both_paths(M):
    """Symmetric int8 with one group per column runs `_weight_int8pack_mm` below DEQUANT_MIN_M rows
    on the CPU and a dequantized matmul from there: both must equal the dense reference."""
    gen = torch.Generator().manual_seed(M)
    layer, module, meta = _module_for(random_gptq_tensors(576, 200, 8, -1, True, True, True, bias=True, generator=gen),
                                      QuantConfig(8, -1, True, True, "gptq"), torch.bfloat16)
    assert meta["int8_kernel"] == "per_channel" and isinstance(module, Int8PerChannelLinear)
    x = torch.randn(M, 576)
    ref = x @ layer.dequantize() + layer.bias.float()
    rel = ((module(x.bfloat16()).float() - ref).norm() / ref.norm()).item()
    assert rel < TOL[torch.bfloat16], rel


def test_int8_kernel_only_where_k_is_a_multiple_of_16():
    """torch's cpu int8 kernel crashed the process at K = 136 (rows off 16 bytes): such a module has
    only the dense path, and runs."""
    gen = torch.Generator().manual_seed(136)
    layer, module, _ = _module_for(random_gptq_tensors(136, 64, 8, -1, True, False, True, generator=gen),
                                   QuantConfig(8, -1, True, False, "gptq"), torch.bfloat16)
    assert isinstance(module, Int8PerChannelLinear) and "int8" not in module.paths() and module.default_path(4) != "int8"
    x = torch.randn(4, 136, generator=gen)
    with torch.no_grad():
        assert rel_err(module(x.bfloat16()), x @ layer.dequantize()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("offset", [8, 1])
def test_an_int8_weight_off_alignment_runs(offset):
    """torch's cpu int8 kernel crashed the process on a weight 8 bytes off a 16-byte boundary (as a
    file mapped at such an offset gives it): the module runs it from an aligned copy."""
    gen = torch.Generator().manual_seed(offset)
    layer, module, _ = _module_for(random_gptq_tensors(256, 64, 8, -1, True, False, True, generator=gen),
                                   QuantConfig(8, -1, True, False, "gptq"), torch.bfloat16)
    buf = torch.empty(module.qweight.numel() + 128, dtype=torch.int8)
    start = -buf.data_ptr() % 64 + offset
    misaligned = buf[start:start + module.qweight.numel()].view(module.qweight.shape)
    misaligned.copy_(module.qweight)
    module.qweight = misaligned
    x = torch.randn(4, 256, generator=gen)
    xbuf = torch.empty(4 * 256 + 64, dtype=torch.bfloat16)
    start = (-xbuf.data_ptr() % 64) // 2 + 4  # an activation view 8 bytes off a 64-byte boundary
    xv = xbuf[start:start + 4 * 256].view(4, 256)
    xv.copy_(x)
    with torch.no_grad():
        y = module(xv)
    assert module.qweight.data_ptr() % 64 == 0 and rel_err(y, x @ layer.dequantize()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("N,K,gs", [(208, 576, 64), (64, 128, 128), (16, 32, 32), (1536, 512, 128)])
@pytest.mark.parametrize("block", [64, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_dequantize_is_the_kernel_s_arithmetic(N, K, gs, block, dtype):
    """The native one-pass dequantizer against the tensor ops' w = (q - 8) * scale + zero in float64:
    exact in float32, one rounding to bfloat16 (relative 2^-8 per weight at most), for full and
    partial column blocks of both ISAs' layouts."""
    from quantprep.targets.cpu import FAST_PACK_BLOCK_N, dequantize_native, native_dequantizer, pack_int4

    require_c(native_dequantizer() is not None)
    isa = next(k for k, v in FAST_PACK_BLOCK_N.items() if v == block)
    gen = torch.Generator().manual_seed(N + K)
    codes = torch.randint(0, 16, (K, N), dtype=torch.uint8, generator=gen)
    sz = torch.stack([torch.rand(K // gs, N, generator=gen) * 0.02 + 1e-3, torch.randn(K // gs, N, generator=gen) * 0.05], -1)
    sz = sz.to(torch.bfloat16)  # as the artifact stores them
    w = dequantize_native(pack_int4(codes, isa), sz, K, N, block, gs, dtype)
    ref = dequantize_folded_int4(codes.double(), sz.double(), gs)
    if dtype == torch.float32:
        assert torch.allclose(w.double(), ref, rtol=1e-6, atol=1e-7)
    else:
        assert ((w.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-30).all()


def test_the_native_dequantizer_writes_unaligned_outputs():
    """An output view that starts 2 bytes into its buffer (vector stores at any address) gets the
    same bytes, and column ranges land at their offsets."""
    from quantprep.targets import cpu

    require_c(cpu.native_dequantizer() is not None)
    gen = torch.Generator().manual_seed(10)
    _, module, _ = _module_for(random_gptq_tensors(256, 208, 4, 64, False, True, True, generator=gen),
                               QuantConfig(4, 64, False, True, "gptq"), torch.bfloat16)
    ref = module.dequantize()
    weight = module.native_weight()
    out = torch.zeros(256, 209, dtype=torch.bfloat16)[:, 1:]
    assert out.data_ptr() % 32 == 2
    weight.write(out)
    assert torch.equal(out, ref)
    tile = torch.zeros(256, 80, dtype=torch.bfloat16)
    weight.write(tile, 128, 208)  # the last full block and the partial one
    assert torch.equal(tile, ref[:, 128:])


def test_the_native_dequantizer_without_openmp_writes_the_same_weight(monkeypatch):
    """Where torch's libgomp is not what the process loaded, the library is built without OpenMP
    (one thread per call): the same bytes as the OpenMP build, act-order and a partial block."""
    from quantprep.targets import c_library, cpu

    if c_library.torch_openmp() is None or cpu.native_dequantizer() is None:
        pytest.skip("the OpenMP build is not the one in use here")
    gen = torch.Generator().manual_seed(9)
    _, module, _ = _module_for(random_gptq_tensors(576, 208, 4, 128, False, True, True, generator=gen),
                               QuantConfig(4, 128, False, True, "gptq"), torch.bfloat16)
    with_openmp = module.dequantize()
    monkeypatch.setattr(c_library, "torch_openmp", lambda: None)
    cpu.native_dequantizer.cache_clear()
    try:
        assert cpu.native_dequantizer() is not None
        assert torch.equal(module.dequantize(), with_openmp)
    finally:
        cpu.native_dequantizer.cache_clear()


def test_without_a_compiler_the_dequantize_path_uses_tensor_ops(monkeypatch):
    from quantprep.targets import cpu

    gen = torch.Generator().manual_seed(6)
    _, module, _ = _module_for(random_gptq_tensors(576, 208, 4, 128, False, True, True, generator=gen),
                               QuantConfig(4, 128, False, True, "gptq"), torch.bfloat16)
    native = module.dequantize().float()
    monkeypatch.setattr(cpu, "native_dequantizer", lambda: None)
    ops = module.dequantize().float()
    assert ((native - ops).norm() / ops.norm()).item() < 4e-3  # each rounds to bf16 its own way


@pytest.mark.parametrize("K,gs,act_order", [(80, 64, True), (576, 128, True), (200, -1, False)])
@pytest.mark.parametrize("tile_bytes", [1 << 30, 1])  # one tile; tiles of one pack block (208 = 3 x 64 + 16)
def test_every_path_matches_the_dense_reference(K, gs, act_order, tile_bytes, monkeypatch):
    """The int4 kernel (activations gathered into act-order and zero-padded to whole kernel groups)
    and the dense path (the weight dequantized into the activations' own order, no gather, one
    column tile at a time) against the float64 reference by g_idx, with K padding (K=80 -> 96) and
    without, in one tile and in tiles of a pack block with a partial last one."""
    from quantprep.targets import cpu

    monkeypatch.setattr(cpu, "TILE_BYTES", tile_bytes)
    gen = torch.Generator().manual_seed(K)
    layer, module, _ = _module_for(random_gptq_tensors(K, 208, 4, gs, False, act_order, True, generator=gen),
                                   QuantConfig(4, gs, False, act_order, "gptq"), torch.bfloat16)
    x = torch.randn(64, K, generator=gen)
    ref = x.double() @ layer.dequantize().double()
    for path in module.paths():
        module.plan, module.plan_max_m = ((1, path),), 64
        with torch.no_grad():
            y = module(x.bfloat16()).double()
        assert ((y - ref).norm() / ref.norm()).item() < 1e-2, path
    assert module.padded_in > K or K != 80


@pytest.mark.parametrize("sizes,direct", [([192, 64, 64], True), ([200, 60, 60], False), ([128, 8], False)])  # 136: padded to 144
def test_fused_members_are_written_into_their_own_outputs(sizes, direct, monkeypatch):
    """On the tiled path a fused projection's members (q/k/v, gate/up) come out as separate
    contiguous tensors written in place, where each starts on a pack block and no padded column
    follows; elsewhere the fused output is split and copied. Same numbers either way, bias included."""
    from quantprep.targets import cpu

    require_c(cpu.native_dequantizer() is not None)
    gen = torch.Generator().manual_seed(sum(sizes))
    K, N = 256, sum(sizes)
    _, module, _ = _module_for(random_gptq_tensors(K, N, 4, 64, False, True, True, bias=True, generator=gen),
                               QuantConfig(4, 64, False, True, "gptq"), torch.bfloat16)
    assert module.bias is not None
    module.plan, module.plan_max_m = ((1, "dequant"),), 64
    calls, original = [], cpu.tiled_matmul
    monkeypatch.setattr(cpu, "tiled_matmul", lambda *a: calls.append(a[3] if len(a) > 3 else None) or original(*a))
    x = torch.randn(3, 16, K, generator=gen).bfloat16()
    with torch.no_grad():
        parts = module.forward_split(x, sizes)
        whole = module(x)
    assert (calls[0] == (0, 192, 256, 320)) == direct
    for part, ref in zip(parts, whole.split(sizes, -1), strict=True):
        assert part.is_contiguous() and part.shape == ref.shape
        assert rel_err(part, ref) < 1e-2


def _int4_a8_or_skip():
    from quantprep.targets import cpu

    require_int4_a8()
    if cpu.FAST_PACK_BLOCK_N.get(torch.backends.cpu.get_cpu_capability()) != cpu.native_a8_block():
        pytest.skip("torch packs another ISA's layout than int4_a8 reads on this CPU: no int4_a8 path")


def test_int4_a8_gives_nan_for_nan_and_follows_a_moved_buffer():
    """A NaN activation gives NaN outputs (as the int4 kernel), not finite numbers; a weight whose
    storage moved in place (share_memory_) is read where it is now."""
    _int4_a8_or_skip()
    gen = torch.Generator().manual_seed(3)
    _, module, _ = _module_for(random_gptq_tensors(256, 64, 4, 128, False, True, True, generator=gen),
                               QuantConfig(4, 128, False, True, "gptq"), torch.bfloat16)
    module.plan, module.plan_max_m = ((1, "int4_a8"),), 64
    x = torch.randn(2, 256, generator=gen).bfloat16()
    x[0, 5] = float("nan")
    with torch.no_grad():
        y = module(x)
        assert y[0].isnan().all() and not y[1].isnan().any()
        module.qweight.share_memory_()  # same tensor object, new storage
        module.qweight.fill_(0x88)  # every code 8: w = zero
        y2 = module(x[1:])
    w = module.dequantize(torch.float32).double()
    assert rel_err(y2, x[1:].double() @ w) < 2e-2


@pytest.mark.parametrize("K,N,gs,act_order", [(576, 208, 128, True), (80, 80, 64, True), (1536, 256, 128, False),
                                              (200, 48, 32, True), (512, 64, 256, False)])
@pytest.mark.parametrize("M", [1, 3, 4, 6, 9])  # the kernel takes rows four at a time
def test_int4_a8_is_the_kernel_s_weight_times_int8_activations(K, N, gs, act_order, M):
    """int4_a8 against tensor ops in float64: the activations gathered into act-order, quantized per
    kernel group to round(x / a), a = max|x| / 127, clamped to +-127, times the module's own dequantized
    weight. Only the bfloat16 output rounds (relative 2^-9 per element, ~1.1e-3 RMS): 2.5e-3. Full 64-column
    blocks (32 where the CPU packs AVX2's layout), a partial last block (208, 80, 48), K padding (80 -> 96, 200 -> 224) and groups 32-256."""
    _int4_a8_or_skip()
    gen = torch.Generator().manual_seed(K * N + M)
    _, module, _ = _module_for(random_gptq_tensors(K, N, 4, gs, False, act_order, True, generator=gen),
                               QuantConfig(4, gs, False, act_order, "gptq"), torch.bfloat16)
    assert "int4_a8" in module.paths()
    x = torch.randn(M, K, generator=gen).bfloat16()
    c, Kp = module.kernel_group_size, module.padded_in
    perm = module.perm.long() if module.perm is not None else torch.arange(K)
    xp = torch.zeros(M, Kp, dtype=torch.float64)
    xp[:, :K] = x.double()[:, perm]  # packed row k is input row perm[k]
    groups = xp.view(M, Kp // c, c)
    a = groups.abs().amax(-1, keepdim=True) / 127
    xq = torch.where(a > 0, (groups / a).round().clamp(-127, 127), 0) * a
    x_hat = torch.empty(M, K, dtype=torch.float64)
    x_hat[:, perm] = xq.view(M, Kp)[:, :K]
    ref = x_hat @ module.dequantize(torch.float32).double()
    module.plan, module.plan_max_m = ((1, "int4_a8"),), 64
    with torch.no_grad():
        y = module(x).double()
    assert rel_err(y, ref) < 2.5e-3
    assert top1(y, ref) == 1.0 or M > 1 and top1(y, ref) >= 0.75  # a near-tie may flip in bf16


@pytest.mark.parametrize("K_in,Kp,N,gs,act_order", [(200, 256, 80, 64, True), (512, 512, 96, 128, False)])
@pytest.mark.parametrize("M", [1, 2, 6])
def test_the_avx2_int4_a8_kernel_on_any_x86_host(K_in, Kp, N, gs, act_order, M):
    """csrc/a8.c built without AVX512 (its AVX2 kernel, on AVX512 hosts too), called on
    pack_int4's AVX2 layout (32-column blocks; 80 and 96 end on a partial one) against float64: the
    activations gathered by perm (packed row k reads x[perm[k]], rows past K_in read 0), rounded per
    group to round(x / a), a = max|x| / 127, times w = (q - 8) * scale + zero. Tolerance as above."""

    from quantprep.targets import c_library, cpu

    lib = c_library.library("a8", ("-mno-avx512f",))
    require_c(lib is not None)
    if lib.a8_block() != 32:
        pytest.skip("this CPU has no AVX2 and FMA")
    gen = torch.Generator().manual_seed(K_in * N + M)
    codes = torch.randint(0, 16, (Kp, N), generator=gen, dtype=torch.uint8)
    sz = (torch.randn(Kp // gs, N, 2, generator=gen) * torch.tensor([0.02, 0.1])).bfloat16()
    perm = torch.randperm(K_in, generator=gen).to(torch.int32) if act_order else None
    x = torch.randn(M, K_in, generator=gen).bfloat16()
    packed = cpu.pack_int4(codes, "AVX2")
    out = torch.empty(M, N, dtype=torch.bfloat16)
    fn = lib.int4_a8_cpu
    assert fn(x.data_ptr(), M, K_in, None if perm is None else perm.data_ptr(), K_in, packed.data_ptr(), sz.data_ptr(),
              Kp, N, gs, 64, out.data_ptr(), N, 1) == -2  # another layout's block: refused
    assert fn(x.data_ptr(), M, K_in, None if perm is None else perm.data_ptr(), K_in, packed.data_ptr(), sz.data_ptr(),
              Kp, N, gs, 32, out.data_ptr(), N, 1) == 0
    xp = torch.zeros(M, Kp, dtype=torch.float64)
    xp[:, :K_in] = x.double()[:, perm.long()] if act_order else x.double()
    groups = xp.view(M, Kp // gs, gs)
    a = groups.abs().amax(-1, keepdim=True) / 127
    xq = (torch.where(a > 0, (groups / a).round().clamp(-127, 127), 0) * a).view(M, Kp)
    s, z = sz.double().unbind(-1)
    w = (codes.double() - 8) * s.repeat_interleave(gs, 0) + z.repeat_interleave(gs, 0)
    ref = xq @ w
    assert rel_err(out.double(), ref) < 2.5e-3
    # built without its prefetch (benchmarks/experiments/cpu_layers.py's baseline): the same bits, int8_a8's too
    plain = c_library.library("a8", ("-mno-avx512f", "-DA8_AHEAD=0"))
    assert lib.a8_ahead() > 0 and plain.a8_ahead() == 0
    again = torch.empty_like(out)
    assert plain.int4_a8_cpu(x.data_ptr(), M, K_in, None if perm is None else perm.data_ptr(), K_in, packed.data_ptr(),
                             sz.data_ptr(), Kp, N, gs, 32, again.data_ptr(), N, 1) == 0
    assert torch.equal(again, out)
    w8, scale = torch.randint(-127, 128, (N, 256), generator=gen, dtype=torch.int8), torch.rand(N, generator=gen).bfloat16()
    x8 = torch.randn(M, 256, generator=gen).bfloat16()
    out8 = [torch.empty(M, N, dtype=torch.bfloat16) for _ in range(2)]
    for build, o in zip((lib, plain), out8, strict=True):
        assert build.int8_a8_cpu(x8.data_ptr(), M, 256, w8.data_ptr(), scale.data_ptr(), N, 256, o.data_ptr(), N, 1) == 0
    assert torch.equal(out8[0], out8[1]) and out8[0].isfinite().all()


def test_int4_a8_writes_a_fused_module_s_parts():
    """A fused projection's members on int4_a8 (forward_split: the split of forward's output, not
    the tiled path's writer) equal forward's columns."""
    _int4_a8_or_skip()
    gen = torch.Generator().manual_seed(7)
    sizes = [192, 64, 64]
    _, module, _ = _module_for(random_gptq_tensors(256, sum(sizes), 4, 64, False, True, True, bias=True, generator=gen),
                               QuantConfig(4, 64, False, True, "gptq"), torch.bfloat16)
    module.plan, module.plan_max_m = ((1, "int4_a8"),), 64
    x = torch.randn(1, 1, 256, generator=gen).bfloat16()
    with torch.no_grad():
        parts, whole = module.forward_split(x, sizes), module(x)
    assert module.path_for(1) == "int4_a8"
    for part, ref in zip(parts, whole.split(sizes, -1), strict=True):
        assert torch.equal(part, ref)


def test_traced_code_takes_the_int4_kernel_for_int4_a8():
    """export (AOT packages) traces fake tensors, which int4_a8's C call cannot read: the graph
    takes the int4 kernel instead (TRACED_INSTEAD), and eager calls still run int4_a8."""
    _int4_a8_or_skip()
    gen = torch.Generator().manual_seed(11)
    _, module, _ = _module_for(random_gptq_tensors(256, 64, 4, 128, False, True, True, generator=gen),
                               QuantConfig(4, 128, False, True, "gptq"), torch.bfloat16)
    module.plan, module.plan_max_m = ((1, "int4_a8"),), 64
    x = torch.randn(2, 256, generator=gen).bfloat16()
    with torch.no_grad():
        graph = torch.export.export(module, (x,)).graph_module.code
        assert "_weight_int4pack_mm_for_cpu" in graph and module.path_for(2) == "int4_a8"


@pytest.mark.parametrize("K,N", [(640, 200), (128, 40), (1536, 64)])
@pytest.mark.parametrize("M", [1, 3])
def test_int8_a8_is_the_weight_times_int8_activations(K, N, M):
    """The per-channel int8 module's int8_a8 path against tensor ops in float64: the activations
    rounded per group of 128 to round(x / a), a = max|x| / 127, times the module's own int8 weight
    and scales, plus the bias. Only the bfloat16 output and the bias add round: 4e-3. (One group
    per column has no act-order permutation.) A NaN activation gives a NaN row, the other rows
    stay finite."""
    from quantprep.targets import cpu

    require_int4_a8()  # int8_a8 is built beside it
    gen = torch.Generator().manual_seed(K * N + M)
    _, module, meta = _module_for(random_gptq_tensors(K, N, 8, -1, True, False, True, bias=True, generator=gen),
                                  QuantConfig(8, -1, True, False, "gptq"), torch.bfloat16)
    assert meta["int8_kernel"] == "per_channel" and isinstance(module, cpu.CpuInt8PerChannelLinear)
    assert "int8_a8" in module.paths() and module.perm is None
    x = torch.randn(M, K, generator=gen).bfloat16()
    groups = x.double().view(M, K // 128, 128)
    a = groups.abs().amax(-1, keepdim=True) / 127
    xq = (torch.where(a > 0, (groups / a).round().clamp(-127, 127), 0) * a).view(M, K)
    ref = xq @ (module.qweight.double() * module.scales.double()[:, None]).T + module.bias.double()
    module.plan, module.plan_max_m = ((1, "int8_a8"),), 64
    with torch.no_grad():
        assert rel_err(module(x), ref) < 4e-3
        if M > 1:
            x[0, 5] = float("nan")
            y = module(x)
            assert y[0].isnan().all() and not y[1:].isnan().any()


@pytest.mark.parametrize("block", [64, 32])  # both ISAs' layouts, whichever this CPU packs
@pytest.mark.parametrize("K,N,gs,act_order", [(576, 208, 128, True), (1536, 256, 128, False), (200, 48, 32, True),
                                              (512, 64, 256, False)])
@pytest.mark.parametrize("M", [1, 3])
def test_int4_gemv_is_the_kernel_s_weight_times_the_activations(K, N, gs, act_order, M, block):
    """int4_gemv_cpu against tensor ops in float64: x (its bfloat16 values, act-order gathered, K padded
    with zeros) times w = (q - 8) * scale + zero. Only the float32 sums and the bfloat16 output round
    (relative 2^-9 per element, ~1.1e-3 RMS): 2e-3. Full blocks, a partial last block (208, 48), K padding
    (200 -> 224), groups 32-256, several rows."""
    from quantprep.targets.cpu import FAST_PACK_BLOCK_N, native_int4_gemv, pack_int4

    require_c(native_int4_gemv() is not None)
    gen = torch.Generator().manual_seed(K * N + M + block)
    Kp = -(-K // gs) * gs
    codes = torch.randint(0, 16, (Kp, N), dtype=torch.uint8, generator=gen)
    sz = torch.stack([torch.rand(Kp // gs, N, generator=gen) * 0.02 + 1e-3, torch.randn(Kp // gs, N, generator=gen) * 0.05], -1)
    sz = sz.bfloat16().contiguous()
    packed = pack_int4(codes, next(k for k, v in FAST_PACK_BLOCK_N.items() if v == block))
    perm = torch.randperm(K, generator=gen).to(torch.int32) if act_order else None
    x = torch.randn(M, K, generator=gen).bfloat16()
    xp = torch.zeros(M, Kp, dtype=torch.float64)
    xp[:, :K] = x.double()[:, perm.long()] if act_order else x.double()  # packed row k is input column perm[k]
    ref = xp @ dequantize_folded_int4(codes.double(), sz.double(), gs)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    status = native_int4_gemv()(x.data_ptr(), M, K, None if perm is None else perm.data_ptr(), K, packed.data_ptr(), sz.data_ptr(),
                                Kp, N, gs, block, out.data_ptr(), N, torch.get_num_threads())
    assert status == 0
    assert rel_err(out.double(), ref) < 2e-3


def test_a_decode_row_runs_int4_gemv_and_refuses_what_it_cannot_read(monkeypatch):
    """The int4 path of one bfloat16 row runs int4_gemv_cpu (two rows, or a row that needs its
    gradient: torch's kernel), with the kernel's numbers; a block other than 32 or 64, or a negative
    size, is refused (-2), never read."""
    from quantprep.targets import cpu

    require_c(cpu.native_int4_gemv() is not None)
    gen = torch.Generator().manual_seed(5)
    _, module, _ = _module_for(random_gptq_tensors(512, 192, 4, 128, False, True, True, generator=gen),
                               QuantConfig(4, 128, False, True, "gptq"), torch.bfloat16)
    assert (module.path_for(1), module.path_for(2)) == ("int4", "int4")
    rows, gemv = [], cpu.native_int4_gemv()
    monkeypatch.setattr(cpu, "native_int4_gemv", lambda: lambda x, m, *rest: rows.append(m) or gemv(x, m, *rest))
    x = torch.randn(2, 512, generator=gen).bfloat16()
    with torch.no_grad():
        one, two = module(x[:1]), module(x)
    assert rows == [1]
    with torch.enable_grad():  # a row that needs its gradient: torch's op, never C (which keeps no autograd history)
        try:
            module(x[:1].clone().requires_grad_(True))
        except RuntimeError as e:  # torch's int4 op has no derivative
            assert "derivative" in str(e) or "grad" in str(e), e
    assert rows == [1]
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(module.gather(x[:1]), module.qweight, module.kernel_group_size,
                                                         module.scales_and_zeros)
    assert rel_err(one.double(), kernel.double()) < 2e-3 and rel_err(one.double(), two[:1].double()) < 2e-3
    out = torch.empty(1, 192, dtype=torch.bfloat16)
    args = [x.data_ptr(), 1, 512, module.perm.data_ptr(), 512, module.qweight.data_ptr(), module.scales_and_zeros.data_ptr(),
            512, 192, 128, 48, out.data_ptr(), 192, 1]
    assert gemv(*args) == -2
    args[10] = module.pack_block_n
    assert gemv(*args) == 0
    for i, bad in ((1, -1), (4, -5), (8, -192), (4, 600)):  # rows; in; out; in past the padded rows
        assert gemv(*args[:i], bad, *args[i + 1:]) == -2, (i, bad)
