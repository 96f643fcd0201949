"""cuda target on CPU: the tinygemm layout (against a line-by-line translation of the CUDA
packing kernel) and the dequantize path vs the dense reference. The real kernels run on the GPU
machine (benchmarks/experiments/cuda_kernels.py): `_convert_weight_to_int4pack` equality and parity there.

Tolerance: bf16 activations, rel < 2e-2 (as cpu bf16; measured ~3e-3).
"""

import itertools

import pytest
import torch
from conftest import prepacked_module

from quantprep.build.prepack import prepare_layer
from quantprep.build.source import QuantConfig, _validate_layer
from quantprep.build.synthetic import random_gptq_tensors
from quantprep.format.gptq import unpack_rows
from quantprep.targets import get_target
from quantprep.targets.cuda import pack_tinygemm, unpack_tinygemm
from quantprep.targets.packed import Int8PerChannelLinear

CUDA = get_target("cuda")


def reference_tinygemm_pack(codes_nk: torch.Tensor, ikt: int) -> torch.Tensor:
    """pytorch aten/src/ATen/native/cuda/int4mm.cu, matrix_to_m16n8k16_Bint4_layout, as loops.
    `inp` is the op's uint8 [n][k/2] input: byte = code[2b] << 4 | code[2b+1]."""
    n, k = codes_nk.shape
    inp = (codes_nk[:, 0::2] << 4) | codes_nk[:, 1::2]
    out = torch.zeros(n // 8, k // (16 * ikt), 32, ikt // 2, dtype=torch.int64)
    for n_tile, k_outer, t in itertools.product(range(n // 8), range(k // (16 * ikt)), range(32)):
        for inner in range(0, ikt, 2):
            n0 = n_tile * 8 + t // 4
            k_base0 = (k_outer * ikt + inner) * 16 // 2
            k_base1 = k_base0 + 16 // 2
            ks = [k_base0 + t % 4, k_base0 + t % 4 + 4, k_base1 + t % 4, k_base1 + t % 4 + 4]
            v = [int(inp[n0, kk]) for kk in ks]
            pack = ((v[3] & 0xF) << 28) | ((v[2] & 0xF) << 24) | ((v[1] & 0xF) << 20) | ((v[0] & 0xF) << 16) | \
                ((v[3] & 0xF0) << 8) | ((v[2] & 0xF0) << 4) | (v[1] & 0xF0) | ((v[0] & 0xF0) >> 4)
            out[n_tile, k_outer, t, inner // 2] = pack
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


@pytest.mark.parametrize("ikt", [2, 4, 8])
def test_pack_follows_the_cuda_kernel(ikt):
    codes = torch.randint(0, 16, (256, 24), dtype=torch.uint8)  # [K, N]
    packed = pack_tinygemm(codes, ikt)
    assert torch.equal(packed, reference_tinygemm_pack(codes.T.contiguous(), ikt))
    assert torch.equal(unpack_tinygemm(packed), codes.T)


@pytest.mark.parametrize("bits,group_size,sym,act_order,v1", list(itertools.product([4, 8], [-1, 32, 128], [True, False], [True, False], [True, False])))
def test_prepacked_linear_matches_dense_on_cpu(bits, group_size, sym, act_order, v1):
    K, N = 576, 200
    gen = torch.Generator().manual_seed(hash((bits, group_size, sym, act_order, v1)) % 2**31)
    raw = random_gptq_tensors(K, N, bits, group_size, sym, act_order, v1, bias=True, generator=gen)
    layer = prepare_layer(_validate_layer("m", raw, QuantConfig(bits, group_size, sym, act_order, "gptq" if v1 else "gptq_v2")))
    tensors, meta = CUDA.pack(layer, torch.bfloat16)
    module = CUDA.make_module(meta, torch.bfloat16)
    module.load_state_dict(tensors, assign=True)
    assert isinstance(module, Int8PerChannelLinear) == (bits == 8 and group_size == -1 and sym)
    if bits == 4:  # decode (tinygemm) and prefill (GPTQ words) copies hold the same codes
        assert torch.equal(unpack_tinygemm(tensors["qweight"]), unpack_rows(tensors["qweight_kn"], 4).T)
    x = torch.randn(4, 64, K)
    ref = x @ layer.dequantize() + layer.bias.float()
    with torch.no_grad():
        y = module(x.bfloat16()).float()
    rel = ((y - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, f"rel err {rel:.2e}"
    if bits == 4:  # the dequantize path takes x as it comes (no gather): its weight is in x's order
        with torch.no_grad():
            y = module.run(x.reshape(-1, K).bfloat16(), "dequant")[:, :N].float().view_as(ref) + layer.bias.float()
        rel = ((y - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, f"dequant path, x in its own order: rel err {rel:.2e}"


@pytest.mark.parametrize("group_size,act_order", list(itertools.product([-1, 32], [True, False])))
def test_forward_gives_each_path_x_in_its_order(group_size, act_order):
    """K = 200 pads to 224: forward gathers and pads x for tinygemm, and hands the dequantize path x
    as it comes (its weight is in x's order, padding dropped). Off a GPU paths() is empty, so the
    two paths are listed here to run forward's choice as it runs on a GPU (with the CPU stand-ins
    of each kernel)."""
    K, N = 200, 136
    gen = torch.Generator().manual_seed(group_size + act_order)
    raw = random_gptq_tensors(K, N, 4, group_size, False, act_order, True, bias=True, generator=gen)
    layer, module, _ = prepacked_module("cuda", raw, QuantConfig(4, group_size, False, act_order, "gptq"), torch.bfloat16)
    assert module.padded_in == 224
    module.paths = lambda: ("tinygemm", "dequant")
    x = torch.randn(3, 40, K, generator=gen)
    ref = x @ layer.dequantize() + layer.bias.float()
    for path in ("tinygemm", "dequant"):
        module.plan, module.plan_max_m = ((1, path),), 1 << 20
        with torch.no_grad():
            y = module(x.bfloat16()).float()
        rel = ((y - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, f"{path}: rel err {rel:.2e}"


@pytest.fixture(scope="module")
def cuda_artifact(tmp_path_factory):
    """A random TINY_LLAMA cuda artifact (group 64), built once here: tests that edit it use copy_of."""
    from conftest import TINY_LLAMA

    from quantprep.build.pipeline import prepack
    from quantprep.build.synthetic import write_random_checkpoint

    root = tmp_path_factory.mktemp("cuda-art")
    prepack(write_random_checkpoint(root / "gptq", TINY_LLAMA, group_size=64), "cuda", root / "art")
    return root / "art"


@pytest.mark.parametrize("check_codes", [1 << 23, 1])
def test_an_artifact_whose_two_copies_of_the_codes_differ_is_refused(cuda_artifact, copy_of, monkeypatch, check_codes):
    """Decode reads tinygemm's copy of the codes, prefill qweight_kn's: an artifact whose copies
    differ (one model for short prompts, another for long ones) is refused at load and verify,
    compared whole or 8 columns at a time (CHECK_CODES); a copy of another dtype, by verify too."""
    from conftest import relist
    from safetensors.torch import load_file, save_file

    import quantprep
    from quantprep.errors import ArtifactError
    from quantprep.format.artifact import read_manifest
    from quantprep.targets import cuda
    from quantprep.tools.verify import verify_artifact

    monkeypatch.setattr(cuda, "CHECK_CODES", check_codes)
    art = copy_of(cuda_artifact)
    quantprep.load(art, device="cpu")  # as built: both copies agree
    shard = read_manifest(art)["shards"][0]
    tensors = load_file(art / shard)
    name = next(k for k in tensors if k.endswith(".qweight_kn"))
    tensors[name] = tensors[name] ^ 1  # one code in every word of the prefill copy
    save_file(tensors, art / shard, metadata={"format": "pt"})
    relist(art, shard)
    for run in (lambda: quantprep.load(art, device="cpu"), lambda: verify_artifact(art)):
        with pytest.raises(ArtifactError, match="codes differ from qweight_kn"):
            run()
    tensors[name] = tensors[name].float()  # the same shape, another dtype
    save_file(tensors, art / shard, metadata={"format": "pt"})
    relist(art, shard)
    for run in (lambda: quantprep.load(art, device="cpu"), lambda: verify_artifact(art)):
        with pytest.raises(ArtifactError, match=rf"tensor {name} is torch.float32"):
            run()


def test_cuda_target_needs_bf16():
    from quantprep.errors import RecipeError

    layer = prepare_layer(_validate_layer("m", random_gptq_tensors(128, 64, 4, 32, True, False, True), QuantConfig(4, 32, True, False, "gptq")))
    with pytest.raises(RecipeError, match="bfloat16"):
        CUDA.pack(layer, torch.float16)


def test_cuda_artifacts_refuse_other_activation_dtypes_at_load(cuda_artifact):
    """tinygemm is bf16-only, so a cuda artifact loaded with dtype=float16 is refused up front with
    one line that names the reason, not at the first decode step."""
    import quantprep
    from quantprep.errors import ArtifactMismatch

    for dtype in (torch.float16, torch.float32):
        with pytest.raises(ArtifactMismatch, match=r"runs bfloat16 activations only, not float.*tinygemm"):
            quantprep.load(cuda_artifact, device="cpu", dtype=dtype)


@pytest.mark.parametrize("act_order", [True, False])
def test_fused_parts_on_the_dequantize_path_equal_the_split_forward(act_order):
    """forward_split's dequantize path (one GEMM per column slice, bias in addmm) against the
    fallback (forward, then each part copied out) and the float32 reference: same shapes, each
    part contiguous, equal within bf16 rounding. The GPU's paths are stood in for here (CI has
    no GPU); the dequantized weight comes from the tensor-op fallback."""
    from conftest import rel_err

    from quantprep.targets.packed import PackedLinear

    gen = torch.Generator().manual_seed(0)
    raw = random_gptq_tensors(576, 200, 4, 128, False, act_order, True, bias=True, generator=gen)
    layer, module, _ = prepacked_module("cuda", raw, QuantConfig(4, 128, False, act_order, "gptq"), torch.bfloat16)
    module.paths = lambda: ("tinygemm", "triton", "dequant")  # as on a GPU; run() computes "dequant" off one too
    sizes, x = [136, 24, 40], torch.randn(2, 40, 576, generator=gen).bfloat16()
    assert module.path_for(80) == "dequant"
    ref = (x.float() @ layer.dequantize() + layer.bias.float()).split(sizes, -1)
    with torch.no_grad():
        parts, fallback = module.forward_split(x, sizes), PackedLinear.forward_split(module, x, sizes)
    for part, other, r in zip(parts, fallback, ref, strict=True):
        assert part.shape == other.shape == r.shape and part.is_contiguous() and part.dtype == torch.bfloat16
        assert rel_err(part, other) < 1e-2 and rel_err(part, r) < 1e-2


def test_mslk_codes_are_the_signed_codes_two_a_byte():
    """mslk's int4 (before its own shuffle): [N, K/2] bytes, k even in the low nibble, each the code
    minus 8 as a signed nibble; decoded here by arithmetic, independently of the XOR it uses."""
    from quantprep.format.gptq import pack_rows
    from quantprep.targets.cuda import mslk_codes

    codes = torch.randint(0, 16, (256, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    b = mslk_codes(pack_rows(codes, 4)).to(torch.int16)  # [N, K/2], each byte as -128..127
    assert b.shape == (24, 128)
    low, high = b & 0xF, (b >> 4) & 0xF  # two's complement nibbles
    signed = lambda n: torch.where(n >= 8, n - 16, n)  # noqa: E731
    assert torch.equal(signed(low), codes[0::2].T.to(torch.int16) - 8)
    assert torch.equal(signed(high), codes[1::2].T.to(torch.int16) - 8)


def test_a_fused_modules_parts_are_in_its_plan_shape():
    """Whether mslk fits a module depends on its parts (each a multiple of 64), so two fused modules
    of one packed size but other parts must not share a plan entry."""
    raw = random_gptq_tensors(1024, 2112, 4, 128, True, True, True, bias=False, generator=torch.Generator().manual_seed(0))
    _, a, _ = prepacked_module("cuda", raw, QuantConfig(4, 128, True, True, "gptq"), torch.bfloat16)
    _, b, _ = prepacked_module("cuda", raw, QuantConfig(4, 128, True, True, "gptq"), torch.bfloat16)
    plain = a.plan_shape()
    a.parts, b.parts = (1088, 512, 512), (1056, 1056)
    assert a.plan_shape() == plain + ":parts1088+512+512" and b.plan_shape() == plain + ":parts1056+1056"
