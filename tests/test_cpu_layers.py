"""quantprep's C decode layers (runtime/cpu_layers.py: RMSNorm, the SiLU product, decode attention, the
bf16 GEMV) against transformers' modules, torch and float64, their fallbacks, and their use by a
loaded artifact (hooks, attentions, copies kept)."""

import copy
import inspect
import pickle

import pytest
import torch
import torch.nn.functional as F
from conftest import random_cpu_artifact, rel_err, top1
from native_c import require_c, require_int4_a8
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from quantprep.runtime import cpu_layers

require_c(cpu_layers.library() is not None)


def replaced(module: torch.nn.Module, cls: type | None = None) -> torch.nn.Module:
    """A copy of module with its class swapped: as use() swaps it, or for `cls`."""
    module = copy.deepcopy(module)
    if cls is not None:
        module.__class__ = cls
    else:
        assert cpu_layers.replace(module) is module
    return module


def norm(n: int, seed: int = 0) -> Qwen2RMSNorm:
    m = Qwen2RMSNorm(n, eps=1e-6).to(torch.bfloat16)
    m.weight.data = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return m


@pytest.mark.parametrize("shape", [(1, 1, 1536), (3, 5, 100), (1, 7, 17)])
def test_rms_norm_matches_transformers_and_float64(shape):
    """Same roundings as transformers' module (float32 sum, bf16 normalize, bf16 product): at most a
    bfloat16 step apart where the float32 sums' order differs; against float64 within bf16 rounding."""
    hf = norm(shape[-1])
    ours = replaced(hf)
    assert isinstance(ours, cpu_layers.CpuRMSNorm) and isinstance(ours, Qwen2RMSNorm)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        assert cpu_layers.runs_here(x, ours.weight)  # the kernel, not the fallback, computes it
        y, ref = ours(x), hf(x)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert (y == ref).float().mean() > 0.99 and rel_err(y, ref) < 2e-3
    x64 = x.double()
    exact = hf.weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rel_err(y, exact) < 8e-3  # two bfloat16 roundings, ~2.3e-3 each (RMS)


def test_silu_mul_matches_torch_and_float64():
    """Over float's whole exp range (its own vectorized exp: no libm call) and at NaN, +-inf and +-0:
    transformers' bfloat16 result (silu, rounded, times up), and float64 within bfloat16 rounding."""
    g = torch.Generator().manual_seed(2)
    gate = torch.cat([torch.linspace(-120, 120, 20001), torch.randn(20000, generator=g) * 4,
                      torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])])
    gu = torch.cat([gate, torch.randn(gate.numel(), generator=g)]).reshape(1, -1).to(torch.bfloat16)
    n = gate.numel()
    y = torch.empty(1, n, dtype=torch.bfloat16)
    cpu_layers.library().silu_mul(gu.data_ptr(), 2 * n, y.data_ptr(), n, 1, n)
    torch_bf16 = F.silu(gu[:, :n]) * gu[:, n:]  # transformers' order and roundings
    assert torch.equal(y.isnan(), torch_bf16.isnan())
    assert ((y == torch_bf16) | y.isnan()).float().mean() > 0.999
    finite = torch_bf16.isfinite()
    gate64, up64 = gu.double()[:, :n], gu.double()[:, n:]
    assert rel_err(y[finite], (F.silu(gate64) * up64)[finite]) < 8e-3


@pytest.mark.parametrize("case", ["float32", "autograd", "strided", "meta"])
def test_rms_norm_falls_back(case):
    """What C cannot compute as transformers does goes to transformers' own forward."""
    hf = norm(64).requires_grad_(False)  # only the case under test rules C out
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    if case == "float32":
        hf, x = hf.float(), x.float()
    elif case == "strided":
        x = torch.randn(2, 3, 128).to(torch.bfloat16)[..., ::2]
    elif case == "meta":
        hf, x = hf.to("meta"), x.to("meta")
    ours = replaced(hf)
    with torch.enable_grad():
        if case == "autograd":
            x.requires_grad_(True)
        assert not cpu_layers.runs_here(x, ours.weight)
        y = ours(x)
        if case == "meta":
            assert y.device.type == "meta" and y.shape == x.shape
            return
        assert torch.equal(y, hf(x))
        if case == "autograd":
            y.float().sum().backward()
            assert x.grad is not None


def linear(N: int, K: int, bias: bool = False) -> torch.nn.Linear:
    m = torch.nn.Linear(K, N, bias=bias).to(torch.bfloat16).requires_grad_(False)
    m.weight.data = torch.randn(N, K, generator=torch.Generator().manual_seed(N)).to(torch.bfloat16)
    return m


@pytest.mark.parametrize("N,K", [(1000, 1536), (7, 64), (13, 32), (151936 // 16, 96)])
def test_gemv_matches_torch_and_float64(N, K):
    """One row through a bias-free bfloat16 Linear: float32 sums of exact products, as torch's, so
    torch's bfloat16 result nearly everywhere and the same error against float64. N not a multiple
    of the rows the kernel takes at a time (AVX2: 8, AVX512-BF16: 4): 7 and 13."""
    if not cpu_layers.gemv_bf16_built():
        pytest.skip("gemv_bf16 needs AVX512-BF16 or AVX2 with FMA, which this CPU lacks")
    hf = linear(N, K)
    ours = replaced(hf)
    assert type(ours) is cpu_layers.CpuLinear
    x = torch.randn(1, 1, K, generator=torch.Generator().manual_seed(K)).to(torch.bfloat16)
    with torch.inference_mode():
        y, ref = ours(x), hf(x)
    exact = x.double() @ hf.weight.double().T
    assert y.shape == ref.shape and (y == ref).float().mean() > 0.98
    assert rel_err(y, exact) < 1.5 * rel_err(ref, exact) + 1e-4


class DenseMatmuls(TorchDispatchMode):
    """The dtypes of the operands of every matrix product torch runs under it (torch's own dispatch,
    not a stand-in)."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.matmul, torch.ops.aten.linear):
            self.dtypes.append({a.dtype for a in args if isinstance(a, torch.Tensor)})
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("slow_half_gemm,tile_rows,min_rows", [(True, 16, 6), (True, 128, 6), (True, 16, 7), (False, 16, 6)])
def test_linear_rows_where_bfloat16_gemm_is_slow(monkeypatch, slow_half_gemm, tile_rows, min_rows):
    """Six rows: where torch has no bfloat16 GEMM kernel (SLOW_HALF_GEMM, this machine's or not) and
    from FLOAT32_MIN_ROWS, float32 products over tiles of the weight's rows (16 of 100: a partial last
    tile; 128: one tile of all 100), within torch's error against float64; else nn.Linear's forward."""
    monkeypatch.setattr(cpu_layers, "SLOW_HALF_GEMM", slow_half_gemm)
    monkeypatch.setattr(cpu_layers, "FLOAT32_TILE_ROWS", tile_rows)
    monkeypatch.setattr(cpu_layers, "FLOAT32_MIN_ROWS", min_rows)
    hf = linear(100, 64)
    ours = replaced(hf, cpu_layers.CpuLinear)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.inference_mode(), DenseMatmuls() as seen:
        y = ours(x)
    ref = hf(x)
    exact = x.double() @ hf.weight.double().T
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    assert (y == ref).float().mean() > 0.98 and rel_err(y, exact) < 1.5 * rel_err(ref, exact) + 1e-4
    tiles = -(-100 // tile_rows)
    assert seen.dtypes == ([{torch.float32}] * tiles if slow_half_gemm and min_rows <= 6 else [{torch.bfloat16}])


def test_linear_rows_of_another_width():
    """As many values as one row, in rows of another width: nn.Linear's error, not gemv over the wrong values."""
    ours = replaced(linear(48, 64), cpu_layers.CpuLinear)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        ours(torch.randn(2, 32).to(torch.bfloat16))


@pytest.mark.parametrize("case", ["rows", "bias", "float32", "autograd"])
def test_linear_falls_back(monkeypatch, case):
    """Anything but bfloat16 rows of in_features without bias and autograd is nn.Linear's own forward;
    several rows too where torch has a bfloat16 GEMM kernel."""
    monkeypatch.setattr(cpu_layers, "SLOW_HALF_GEMM", False)
    hf = linear(48, 64, bias=case == "bias")
    x = torch.randn(3 if case == "rows" else 1, 64).to(torch.bfloat16)
    if case == "float32":
        hf, x = hf.float(), x.float()
    if case == "autograd":
        hf.weight.requires_grad_(True)
    ours = replaced(hf, cpu_layers.CpuLinear)  # use() swaps only bias-free bfloat16 ones
    with torch.enable_grad():
        y = ours(x)
        assert torch.equal(y, hf(x))
        if case == "autograd":
            y.float().sum().backward()
            assert ours.weight.grad is not None


class Counting:
    """The library, counting the calls of each kernel."""

    def __init__(self, lib):
        self.lib, self.calls = lib, {"rms_norm": 0, "silu_mul": 0, "rotary": 0, "gemv_bf16": 0, "decode_layer": 0}

    def __getattr__(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1
        return getattr(self.lib, name)


def prefill_and_decode(model, prompt: torch.Tensor) -> torch.Tensor:
    """The last logits of a prefill and of two decode steps after it."""
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True)
        logits = [out.logits[:, -1]]
        for token in (7, 9):
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.cat(logits)


def test_a_loaded_artifact_uses_them(random_artifact, monkeypatch):
    """quantprep.load on the CPU replaces every RMSNorm, fused MLP and attention, keeps the state
    dict's names, runs the kernels (rotary at decode only), and gives the logits of the same model
    with transformers' modules, at prefill and at decode."""
    import quantprep

    model = quantprep.load(random_artifact)
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

    for base, theirs in ((cpu_layers.CpuRMSNorm, LlamaRMSNorm), (cpu_layers.CpuGatedMLP, LlamaMLP),
                         (cpu_layers.CpuDecodeAttention, LlamaAttention)):  # every one swapped, still an instance of its class
        mods = [m for m in model.modules() if isinstance(m, theirs)]
        assert mods and all(isinstance(m, base) for m in mods)
    names = {type(m).__name__ for m in model.modules()}
    if cpu_layers.gemv_bf16_built():  # the float lm_head, still an nn.Linear, still tied to the embedding
        head = model.get_output_embeddings()
        assert type(head) is cpu_layers.CpuLinear and isinstance(head, torch.nn.Linear)
        assert head.weight is model.get_input_embeddings().weight or not model.config.tie_word_embeddings
    assert not any(n.endswith(("RMSNorm", "MLP", "Attention")) and not n.startswith("Cpu") for n in names)
    keys = set(model.state_dict())
    assert "model.norm.weight" in keys and any(k.endswith("mlp.gate_up_proj.qweight") for k in keys)
    prompt = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    counting = Counting(cpu_layers.library())
    monkeypatch.setattr(cpu_layers, "library", lambda: counting)
    ours = prefill_and_decode(model, prompt)
    layers, gemv = model.config.num_hidden_layers, 2 * cpu_layers.gemv_bf16_built()
    # the prefill: the modules; each decode step: a decode_layer call a layer (int4_gemv_cpu for the default
    # plans' int4 path), the final norm, gemv for the lm_head's one row (the prefill's logits take torch's)
    assert counting.calls == {"rms_norm": 2 * layers + 3, "silu_mul": layers, "rotary": 0, "gemv_bf16": gemv, "decode_layer": 2 * layers}
    counting.calls = dict.fromkeys(counting.calls, 0)
    with monkeypatch.context() as patch:
        patch.setattr(cpu_layers, "layer_kernel", lambda path: None)  # each module's own C forward
        modules = prefill_and_decode(model, prompt)
    assert counting.calls == {"rms_norm": 3 * (2 * layers + 1), "silu_mul": 3 * layers, "rotary": 2 * layers, "gemv_bf16": gemv,
                              "decode_layer": 0}
    assert torch.equal(ours, modules)  # decode_layer makes the modules' C calls
    for m in model.modules():  # each replaced module with its own class's forward again
        if isinstance(m, (cpu_layers.CpuRMSNorm, cpu_layers.CpuGatedMLP, cpu_layers.CpuDecodeAttention)):
            m.forward = m.replaced.forward.__get__(m)
        elif isinstance(m, cpu_layers.CpuLinear):
            m.forward = torch.nn.Linear.forward.__get__(m)
    theirs = prefill_and_decode(model, prompt)
    # the same roundings: equal here; 1e-3 leaves room for another CPU's float32 sum order (a query off by 1%: 4.6e-3)
    assert rel_err(ours, theirs) < 1e-3 and top1(ours, theirs) == 1.0


def test_a_loaded_model_keeps_hooks_attentions_and_copies(random_artifact):
    """What transformers' own modules give stays: a hook on a fused member (q_proj, up_proj) is called
    (the module then takes transformers' forward), output_attentions returns every layer's weights
    (transformers records them by class), and a deep copy and a pickle give the same logits."""
    import quantprep

    model = quantprep.load(random_artifact)
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    before = prefill_and_decode(model, prompt)
    calls = []
    layer = model.model.layers[0]
    hooks = [m.register_forward_hook(lambda mod, args, out: calls.append(type(mod).__name__))
             for m in (layer.self_attn.q_proj, layer.mlp.up_proj)]
    prefill_and_decode(model, prompt)
    assert calls.count("FusedMember") == 6  # each of the two members at the prefill and both decode steps
    for h in hooks:
        h.remove()
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(other.model.layers[0].mlp) is type(model.model.layers[0].mlp)
        assert torch.equal(prefill_and_decode(other, prompt), before)
    layers = model.config.num_hidden_layers
    model.set_attn_implementation("eager")  # (recording attentions leaves transformers' hooks, which do not pickle)
    with torch.inference_mode():
        out = model(input_ids=prompt, output_attentions=True)
    assert len(out.attentions) == layers and out.attentions[0].shape[-1] == prompt.shape[1]


def test_tensors_c_cannot_read_take_the_replaced_forward():
    """vmap's batched wrappers (no data pointer), forward-mode AD (C would drop the tangent) and a lazily
    negated view (its memory holds -x): transformers' forward, and its results."""
    import torch.autograd.forward_ad as fwAD

    hf = norm(64).requires_grad_(False)
    ours = replaced(hf)
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(torch.vmap(ours)(x), torch.vmap(hf)(x))
        neg = torch._neg_view(x[0])
        assert neg.is_neg() and torch.equal(ours(neg), hf(-x[0]))
    with fwAD.dual_level():
        dual = fwAD.make_dual(x[0], torch.ones_like(x[0]))
        tangent = fwAD.unpack_dual(ours(dual)).tangent
        assert tangent is not None and torch.equal(tangent, fwAD.unpack_dual(hf(dual)).tangent)


def test_an_attention_whose_rotary_helpers_differ_is_not_replaced(random_artifact):
    """Llama's attention forward instruction for instruction, but resolving apply_rotary_pos_emb in
    a module of its own (a family that rotates differently behind the same forward): not fused
    decode attention, and use() leaves it as it is, so its own forward and its own rotation run."""
    import types

    from transformers.models.llama import modeling_llama

    import quantprep

    attn = quantprep.load(random_artifact).model.layers[0].self_attn
    attn.__class__ = own = attn.replaced  # as load found it
    assert cpu_layers.is_fused_decode_attention(attn)
    forward = inspect.unwrap(own.forward)
    elsewhere = dict(forward.__globals__, apply_rotary_pos_emb=lambda q, k, cos, sin, *a, **kw: (q, k))
    moved = types.FunctionType(forward.__code__, elsewhere, forward.__name__, forward.__defaults__)
    assert cpu_layers.same_code(moved, forward) and cpu_layers.same_code(elsewhere["rotate_half"], modeling_llama.rotate_half)
    attn.__class__ = odd = type(own.__name__, (own,), {"forward": moved})
    assert not cpu_layers.is_fused_decode_attention(attn)
    assert cpu_layers.replace(attn) is None and type(attn) is odd  # left as it is: its own forward runs


TINY_QWEN2 = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
# q/k/v with biases, grouped heads; down_proj's 344 inputs padded to 352 (kernel groups of 32), gate_up's 688 outputs a partial pack block


@pytest.fixture
def qwen2_a8(tmp_path, monkeypatch):
    """(a loaded Qwen2 cpu artifact with int4_a8 planned for every int4 module, the library counting its calls)."""
    import quantprep
    from quantprep.targets.cpu import CpuInt4Linear

    model = quantprep.load(random_cpu_artifact(tmp_path, TINY_QWEN2, bits=4, group_size=64, desc_act=True, sym=False))
    linears = [m for m in model.modules() if isinstance(m, CpuInt4Linear)]
    require_int4_a8()
    if "int4_a8" not in linears[0].paths():
        pytest.skip("torch packs another layout than int4_a8 reads on this CPU")
    assert any(m.padded_in != m.in_features for m in linears)
    for m in linears:
        m.plan, m.plan_max_m = ((1, "int4_a8"),), 1 << 20
    assert all(isinstance(layer, cpu_layers.CpuDecoderLayer) for layer in model.model.layers)
    counting = Counting(cpu_layers.library())
    monkeypatch.setattr(cpu_layers, "library", lambda: counting)
    return model, counting


def module_by_module(model, on: bool = True) -> None:
    """Each decoder layer's own forward (the modules one by one), or back to decode_layer's."""
    for layer in model.model.layers:
        if on:
            layer.forward = layer.replaced.forward.__get__(layer)
        else:
            del layer.forward


def decode_after_crop(model, prompt: torch.Tensor) -> torch.Tensor:
    """The last logits of two decode steps, the cache cropped back by one (transformers' crop: the
    growing buffer's rows after it are not written again), and one more step."""
    with torch.inference_mode():
        cache = model(input_ids=prompt, use_cache=True).past_key_values
        for token in (7, 9):
            model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        cache.crop(-1)
        return model(input_ids=torch.tensor([[11]]), past_key_values=cache, use_cache=True).logits[:, -1]


PROMPT = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))


def test_a_decode_layer_is_one_c_call(qwen2_a8):
    """With int4_a8 planned at one row, each decoder layer of a decode step is one decode_layer call,
    whose logits equal those of the modules' own forwards (the same C calls in the same order: equal,
    not close), on a Qwen2 (q/k/v biases, grouped heads, a padded input), over a prefill and two
    decode steps, and after a cropped cache; a deep copy and a pickle decode alike."""
    model, counting = qwen2_a8
    L = model.config.num_hidden_layers
    fused, fused_crop = prefill_and_decode(model, PROMPT), decode_after_crop(model, PROMPT)
    assert counting.calls["decode_layer"] == 5 * L  # every decode step; the prefills take the modules
    module_by_module(model)
    modules, modules_crop = prefill_and_decode(model, PROMPT), decode_after_crop(model, PROMPT)
    assert counting.calls["decode_layer"] == 5 * L
    assert torch.equal(fused, modules) and torch.equal(fused_crop, modules_crop)
    module_by_module(model, False)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):  # its C arguments are not copied
        assert torch.equal(prefill_and_decode(other, PROMPT), modules)
    assert counting.calls["decode_layer"] == 9 * L


def test_a_decode_layer_follows_changes(qwen2_a8):
    """What the modules would do differently takes them: a hook on a member (it is called), a forward
    set on a member, another plan, fused members in another order, autograd, a row of another width (the modules' error, not C's
    read); a norm's new epsilon and a weight moved in memory (share_memory_) are C's too. Logits equal
    to the modules' throughout; model.float() leaves nothing of C's arguments."""
    model, counting = qwen2_a8
    layers, L = model.model.layers, model.config.num_hidden_layers
    module_by_module(model)
    modules = prefill_and_decode(model, PROMPT)
    module_by_module(model, False)

    def decode(fused_layers: int) -> None:
        """As loaded (fused_layers of them in C), then module by module, the same logits."""
        before = counting.calls["decode_layer"]
        ours = prefill_and_decode(model, PROMPT)
        assert counting.calls["decode_layer"] - before == 2 * fused_layers
        module_by_module(model)
        assert torch.equal(ours, prefill_and_decode(model, PROMPT))
        module_by_module(model, False)

    calls = []
    hook = layers[1].self_attn.o_proj.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    decode(L - 1)
    assert len(calls) == 6  # the prefill and two steps, as loaded and module by module
    hook.remove()
    mlp = layers[0].mlp
    mlp.forward = mlp.forward
    decode(L - 1)
    del mlp.forward
    layers[0].mlp.down_proj.plan = ((1, "int4"),)  # torch's kernel: other logits, the modules' own
    decode(L - 1)
    layers[0].mlp.down_proj.plan = ((1, "int4_a8"),)
    decode(L)
    assert torch.equal(prefill_and_decode(model, PROMPT), modules)
    attn = layers[0].self_attn  # the fused members in another order (as a manifest may list them): C reads q, k, v in order
    attn.k_proj, attn.v_proj = attn.v_proj, attn.k_proj
    decode(L - 1)
    attn.k_proj, attn.v_proj = attn.v_proj, attn.k_proj
    norm = layers[1].post_attention_layernorm
    norm.variance_epsilon, eps = 0.25, norm.variance_epsilon  # read into C's arguments: they follow
    decode(L)
    norm.variance_epsilon = eps
    with torch.no_grad():
        out = model(input_ids=PROMPT, use_cache=True)
        before = counting.calls["decode_layer"]
        with torch.enable_grad():
            model(input_ids=torch.tensor([[7]]), past_key_values=out.past_key_values, use_cache=True)
        assert counting.calls["decode_layer"] == before
        cos_sin = model.model.rotary_emb(out.logits, torch.tensor([[PROMPT.shape[1]]]))
        narrow = torch.zeros(1, 1, model.config.hidden_size - 32, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError):
            layers[0](narrow, position_embeddings=cos_sin, cache=out.past_key_values)
        assert counting.calls["decode_layer"] == before

    moved = layers[0].mlp.gate_up_proj.qweight
    address = moved.data_ptr()
    moved.share_memory_()  # a new address, and new codes there that C must read
    moved.copy_(moved.flip(0))
    assert moved.data_ptr() != address
    fused = prefill_and_decode(model, PROMPT)
    module_by_module(model)
    before = counting.calls["decode_layer"]
    modules_now = prefill_and_decode(model, PROMPT)
    assert counting.calls["decode_layer"] == before
    assert torch.equal(fused, modules_now) and not torch.equal(modules_now, modules)
    assert all("_decode_layer" in vars(layer) for layer in layers)
    model.float()  # nothing of the bfloat16 weights kept
    assert not any("_decode_layer" in vars(layer) for layer in layers)
