"""Mixtures of experts (Qwen3-MoE, Mixtral, DeepSeek-V2, DeepSeek-V3) on the cpu, xpu and cuda targets.

Each model is tiny and random (hidden 64, 2 layers, 4 or 8 experts, seeded, a word-level tokenizer),
as the real gptqmodel quantized it (int4, group 32, act-order), which writes one quantized Linear per
expert: the checkpoints tests/test_architectures.py has recorded in tests/data/gptqmodel/ (there each
target is also compared with GPTQModel's own runtime on them), prepacked here for every target. Their
logits at the last prompt position and one decode step are compared with the same checkpoint
dequantized into transformers' own float32 model (its 3-D experts tensors: tools/eval.py). Off their
devices the xpu artifacts run the XPU kernel's emulator and the cuda ones the CPU path of
CudaInt4Linear (tinygemm's copy of the codes at up to 16 rows, the dequantize path's copy above); on a
GPU `test_cuda_on_gpu` runs the real kernels (random GPTQ codes, no gptqmodel there), skipped without
one (run on an H200 with the device tool: 4 passed).

DeepSeek-V3's router is given one expert no token can reach (e_score_correction_bias -1e4):
gptqmodel rounds it to nearest, no logits test can see it, and its probe is what checks it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import dense_reference_model, rel_err, relist, top1
from safetensors.torch import load_file, save_file
from test_architectures import ARCHITECTURES, BASE, DATA, UNROUTED

import quantprep
from quantprep.build.pipeline import build_artifacts, prepack
from quantprep.errors import ArtifactError, SourceError
from quantprep.format.artifact import read_manifest
from quantprep.runtime.experts import QuantizedExperts
from quantprep.tools.verify import verify_artifact

MODELS = {arch: ARCHITECTURES[arch] for arch in ("qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3")}  # initializer_range 0.1: there
TARGETS = ("cpu", "xpu", "cuda")  # each at its default activation dtype: bfloat16, float16 (emulated), bfloat16 (CPU path)
# (relative error of the logits, share of top-1 agreements over every prompt position and the decode
# step) against the float32 dense reference, per activation dtype. Measured: bf16 0.7-2.0e-2, top-1 0.94-1.0
# on these random logits (transformers' own bf16 model of such dequantized weights: 1.0-2.3e-2); fp16
# 0.8-1.7e-3, 1.0; float32 below 9e-7, 1.0.
TOLERANCE = {"bfloat16": (3e-2, 0.9), "float16": (5e-3, 0.95), "float32": (1e-5, 1.0)}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """arch -> its directory: gptq/ (gptqmodel's, recorded), one artifact per target and cpu-float32/; each built the first time it is asked for."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            root = tmp_path_factory.mktemp(arch)
            shutil.copytree(DATA / arch, root / "gptq")
            build_artifacts(root / "gptq", {"path": str(root / "gptq")}, list(TARGETS), lambda t: root / t, progress=False)
            prepack(root / "gptq", "cpu", root / "cpu-float32", "float32")
            built[arch] = root
        return built[arch]

    return get


@pytest.fixture(scope="module")
def reference():
    """arch's checkpoint dequantized into transformers' float32 model, built once."""
    models = {}

    def get(gptq: Path):
        if gptq not in models:
            models[gptq] = dense_reference_model(gptq, torch.float32)
        return models[gptq]

    return get


PROMPTS = torch.randint(2, 256, (2, 24), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def last_and_decode(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits of every prompt position, of the last, of one decode step after it) for PROMPTS, on the
    CPU; the decode step feeds token 5 to both models (the same input whatever either predicts)."""
    ids = PROMPTS.to(next(model.parameters()).device) % model.config.vocab_size
    out = model(input_ids=ids, use_cache=True)
    # past_key_values: transformers 5.24 reads it as `cache` (with a warning), 5.17 (the GPU machine's) knows no other
    step = model(input_ids=torch.full_like(ids[:, :1], 5), past_key_values=out.past_key_values, use_cache=True)
    return out.logits.float().cpu(), out.logits[:, -1].float().cpu(), step.logits[:, -1].float().cpu()


@contextlib.contextmanager
def routing(model, calls: list, replay: bool):
    """Each experts module's (top_k_index, top_k_weights), call by call in model order: recorded from
    `model` into `calls`, or replayed from them into `model` in place of its router's."""
    def hook(module, args, kwargs):
        if not replay:
            calls.append((args[1].clone(), args[2].clone()))
            return None
        index, weights = calls.pop(0)
        return (args[0], index.to(args[1].device), weights.to(args[2].device, args[2].dtype)), kwargs

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules() if type(m).__name__.endswith("Experts")]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    assert not replay or not calls


def check_logits(model, ref_model, dtype: str, what: str) -> None:
    """`model`'s logits (last position, decode step) within TOLERANCE[dtype] of the float32 `ref_model`'s.
    Half-precision activations can flip a near-tied top-k (measured: Mixtral's cpu artifact in bf16
    sent 1 of 48 prompt tokens to another expert, moving its logits by 7e-2, beyond any kernel's
    error), so then the reference takes the experts `model`'s router chose; in float32 it routes on its
    own. And the experts must matter: without them the logits move 10x the bf16 tolerance."""
    tol, agree = TOLERANCE[dtype]
    chosen = []
    with routing(model, chosen, replay=False):
        got = last_and_decode(model)
    with routing(ref_model, chosen if dtype != "float32" else [], replay=dtype != "float32"):
        ref = last_and_decode(ref_model)
    for name, a, b in zip(("last position", "decode step"), got[1:], ref[1:], strict=True):
        assert rel_err(a, b) <= tol, f"{what} {name}: rel err {rel_err(a, b):.2e} > {tol:.0e}"
    assert top1(torch.cat([got[0].flatten(0, 1), got[2]]), torch.cat([ref[0].flatten(0, 1), ref[2]])) >= agree, what
    chosen = []
    with routing(ref_model, chosen, replay=False):
        last_and_decode(ref_model)
    with routing(ref_model, [(index, torch.zeros_like(w)) for index, w in chosen], replay=True):
        assert rel_err(last_and_decode(ref_model)[1], ref[1]) >= 10 * TOLERANCE["bfloat16"][0], f"{what}: the experts hardly matter"


@pytest.mark.parametrize("target", [*TARGETS, "cpu-float32"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_logits_match_the_dense_reference(moe, reference, arch, target):
    root = moe(arch)
    model = quantprep.load(root / target, device="cpu")
    assert sum(isinstance(m, QuantizedExperts) for m in model.modules()) == (1 if arch.startswith("deepseek") else 2)  # first_k_dense_replace=1
    check_logits(model, reference(root / "gptq"), read_manifest(root / target)["target"]["act_dtype"], f"{arch} {target}")


def test_decode_runs_only_the_experts_hit(moe, monkeypatch):
    """One decode token of batch 1 runs its top-k experts, once each, not all of them: on a bfloat16
    CPU model as two C calls of k rows each (cpu_layers.CpuQuantizedExperts), and without C through
    QuantizedExperts.expert k times."""
    from quantprep.runtime import cpu_layers

    model = quantprep.load(moe("deepseek_v3") / "cpu")
    k = model.config.num_experts_per_tok
    calls, rows = [], []
    run = QuantizedExperts.expert
    monkeypatch.setattr(QuantizedExperts, "expert", lambda self, e, x: calls.append((e, x.shape[0])) or run(self, e, x))
    lib = cpu_layers.gemv_library()
    if lib is not None:
        class Counted:
            def int4_gemv_rows(self, w, x, ldx, n, *rest):
                rows.append(n)
                return lib.int4_gemv_rows(w, x, ldx, n, *rest)
        monkeypatch.setattr(cpu_layers, "gemv_library", Counted)
    with torch.no_grad():
        out = model(input_ids=PROMPTS[:1], use_cache=True)
        calls.clear(), rows.clear()
        model(input_ids=torch.tensor([[5]]), past_key_values=out.past_key_values, use_cache=True)
        layers = sum(isinstance(m, QuantizedExperts) for m in model.modules())
        if lib is not None:
            assert (calls, rows) == ([], [k, k] * layers)
            monkeypatch.setattr(cpu_layers, "gemv_library", lambda: None)  # the path without C
            model(input_ids=torch.tensor([[6]]), past_key_values=out.past_key_values, use_cache=True)
    assert len(calls) == k * layers and all(rows == 1 for _, rows in calls), calls
    for i in range(layers):
        assert len({e for e, _ in calls[i * k:(i + 1) * k]}) == k, calls


def test_a_decode_token_and_the_c_silu_product_compute_what_the_grouped_torch_path_does(moe, monkeypatch):
    """A token alone takes the decode path, on a bfloat16 CPU model two C calls for its k experts
    (cpu_layers.CpuQuantizedExperts: int4_gemv_rows, C's SiLU product). The same bits as the
    Python decode path (its experts in turn, each projection's int4_gemv and C's SiLU product) and as
    torch's SiLU and product; within the bfloat16 rounding of the grouped path on that token among
    others (whose experts hit twice run the int4 kernel)."""
    from native_c import require_c

    from quantprep.runtime import cpu_layers
    from quantprep.runtime.cpu_layers import CpuQuantizedExperts

    require_c(cpu_layers.library() is not None and cpu_layers.gemv_library() is not None)
    model = quantprep.load(moe("qwen3_moe") / "cpu")
    experts = next(m for m in model.modules() if isinstance(m, QuantizedExperts))
    assert isinstance(experts, CpuQuantizedExperts)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, experts.hidden_dim, generator=gen).to(torch.bfloat16)
    k = model.config.num_experts_per_tok
    index = torch.stack([torch.randperm(experts.num_experts, generator=gen)[:k] for _ in range(3)])
    weights = torch.softmax(torch.randn(3, k, generator=gen), -1)
    with torch.no_grad():
        grouped = experts(x, index, weights)
        alone = torch.cat([experts(x[i:i + 1], index[i:i + 1], weights[i:i + 1]) for i in range(3)])
        monkeypatch.setattr(cpu_layers, "gemv_library", lambda: None)  # one expert at a time, in Python
        python_alone = torch.cat([experts(x[i:i + 1], index[i:i + 1], weights[i:i + 1]) for i in range(3)])
        experts.__class__ = QuantizedExperts  # torch's SiLU and product
        torch_alone = torch.cat([experts(x[i:i + 1], index[i:i + 1], weights[i:i + 1]) for i in range(3)])
    assert torch.equal(alone, python_alone) and torch.equal(alone, torch_alone)
    assert rel_err(alone.double(), grouped.double()) < 1e-2
    assert alone.abs().sum() > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_sparse_decoder_layer_is_one_c_call_that_sees_its_experts_change(moe, arch, monkeypatch):
    """At batch 1 each decode step of a Qwen3-MoE or Mixtral bfloat16 CPU model is one decode_layer call per
    layer, then sparse_experts (its sparse block in C: the router's gemv_bf16, softmax and top-k, then the k
    experts' two int4_gemv_rows calls). It picks the router's experts and gives the modules' logits. An
    expert hooked or given another weight after the layer's arguments were built is seen before C runs:
    the layer takes the modules (the hook sees its call) or is built again (the new weight counts). A
    tensor moved in memory by its own method (share_memory_: no module sees it), a norm's or the chosen
    experts', is seen before C reads it."""
    from native_c import require_c

    from quantprep.runtime import cpu_layers

    require_c(cpu_layers.library() is not None and cpu_layers.gemv_library() is not None and cpu_layers.gemv_bf16_built())
    model = quantprep.load(moe(arch) / "cpu")
    layers = model.model.layers
    sparse = [layer for layer in layers if cpu_layers.sparse_routing(layer.mlp) is not None]
    assert len(sparse) == len(layers) == 2
    calls = {"decode_layer": 0}
    lib = cpu_layers.library()

    class Counted:
        def __getattr__(self, name):
            calls[name] = calls.get(name, 0) + 1
            return getattr(lib, name)

    monkeypatch.setattr(cpu_layers, "library", Counted)
    router_picks = []
    for layer in sparse:  # the router's own choice, from transformers' code on the C layer's input
        gate = layer.mlp.gate
        layer.post_attention_layernorm.register_forward_hook(lambda m, a, out, gate=gate: router_picks.append(gate(out)[2]))

    def steps(tokens=(7, 9), after_prefill=lambda: None):
        with torch.no_grad():
            out = model(input_ids=PROMPTS[:1], use_cache=True)
            after_prefill()
            logits = []
            for token in tokens:
                out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
                logits.append(out.logits[0, -1].float())
        return torch.stack(logits)

    for layer in sparse:  # hooks only on the norms' outputs until the C layer has run: take them off for it
        layer.post_attention_layernorm._forward_hooks.clear()
    ours = steps()
    assert calls["decode_layer"] == 2 * len(layers)
    chosen = [sorted(vars(layer)["_decode_layer"].sparse.chosen) for layer in sparse]
    for layer in sparse:
        gate = layer.mlp.gate
        layer.post_attention_layernorm.register_forward_hook(lambda m, a, out, gate=gate: router_picks.append(gate(out)[2]))
    with monkeypatch.context() as patch:
        patch.setattr(cpu_layers, "layer_kernel", lambda path: None)
        modules = steps()
    assert [sorted(p.reshape(-1).tolist()) for p in router_picks[-len(sparse):]] == chosen  # the last step's, layer by layer
    # equal here; 1e-3 leaves room for another CPU's order of the router's float32 sums (the products of
    # Qwen3-MoE's experts and weights not rounded: 4.7e-3)
    assert rel_err(ours, modules) < 1e-3 and top1(ours, modules) == 1.0
    for layer in sparse:
        layer.post_attention_layernorm._forward_hooks.clear()

    steps()  # the arguments built again
    experts = sparse[0].mlp.experts
    seen = []
    handles = [experts._modules[str(e)].gate_up_proj.register_forward_hook(lambda m, a, o: seen.append(1))
               for e in range(experts.num_experts)]
    calls["decode_layer"] = 0
    steps(tokens=(7,), after_prefill=seen.clear)
    # the hooks moved the counts: layer 0 found its experts changed and took the modules, layer 1 none
    assert calls["decode_layer"] == len(layers) - 1 and len(seen) == model.config.num_experts_per_tok
    assert vars(sparse[0])["_decode_layer"].args is None
    for h in handles:
        h.remove()
    steps()
    zeroed = {}
    for e in range(experts.num_experts):  # another weight for every expert of layer 0: its output is the zero point's
        linear = experts._modules[str(e)].down_proj
        zeroed[e] = linear.qweight
        linear.qweight = torch.zeros_like(linear.qweight)
    calls["decode_layer"] = 0
    changed = steps()
    assert calls["decode_layer"] == 2 * len(layers)  # layer 0 built again from the new tensors
    with monkeypatch.context() as patch:
        patch.setattr(cpu_layers, "layer_kernel", lambda path: None)
        assert rel_err(changed, steps()) < 1e-2
    assert rel_err(changed, ours) > 1e-2

    # tensors moved in memory by their own methods (no module sees it) between two decode steps, C reads
    # them where they are: a norm's weight (checked at each call), then every expert's codes (after the call)
    for moved in ([sparse[1].post_attention_layernorm.weight],
                  [experts._modules[str(e)].gate_up_proj.qweight for e in range(experts.num_experts)]):
        with torch.no_grad():
            out = model(input_ids=PROMPTS[:1], use_cache=True)
            out = model(input_ids=torch.tensor([[7]]), past_key_values=out.past_key_values, use_cache=True)
            addresses = [t.data_ptr() for t in moved]
            for t in moved:
                t.share_memory_()
                t.copy_(t * 2 if t.is_floating_point() else t.flip(-1))  # (the norm's weight is all ones)
            assert all(t.data_ptr() != a for t, a in zip(moved, addresses, strict=True))
            cache = copy.deepcopy(out.past_key_values)
            calls["decode_layer"] = 0
            in_c = model(input_ids=torch.tensor([[9]]), past_key_values=out.past_key_values, use_cache=True).logits.float()
            assert calls["decode_layer"] == len(layers)
            with monkeypatch.context() as patch:
                patch.setattr(cpu_layers, "layer_kernel", lambda path: None)
                by_modules = model(input_ids=torch.tensor([[9]]), past_key_values=cache, use_cache=True).logits.float()
        assert rel_err(in_c, by_modules) < 1e-3


def test_two_threads_decoding_one_sparse_model_each_get_their_own_experts(moe, monkeypatch):
    """Two decodes of one Qwen3-MoE model in two threads (a server's), from its first step on (both
    threads build the layers' arguments, and one's replace the other's while it runs): the router's
    choice each decode_layer call leaves for its sparse_experts call is that thread's, so each
    thread's logits equal its decode run alone on another load of the model. (With one set of
    buffers per layer, the other thread's choice overwrote it between the two calls: the threads got
    other experts' outputs.)"""
    import ctypes
    import threading

    from native_c import require_c

    from quantprep.runtime import cpu_layers

    require_c(cpu_layers.library() is not None and cpu_layers.gemv_library() is not None and cpu_layers.gemv_bf16_built())
    model, apart = quantprep.load(moe("qwen3_moe") / "cpu"), quantprep.load(moe("qwen3_moe") / "cpu")
    lib, calls = cpu_layers.library(), []

    class Counted:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(lib, name)

    monkeypatch.setattr(cpu_layers, "library", Counted)

    def decode(prompt: torch.Tensor, tokens: list[int], model=model) -> torch.Tensor:
        with torch.no_grad():
            out = model(input_ids=prompt, use_cache=True)
            logits = []
            for token in tokens:
                out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
                logits.append(out.logits[0, -1].float())
        return torch.stack(logits)

    work = [(PROMPTS[i : i + 1], [(7 * i + 3 * s) % 40 + 1 for s in range(24)]) for i in range(2)]
    alone = [decode(*w, model=apart) for w in work]
    assert all("_decode_layer" not in vars(layer) for layer in model.model.layers)
    assert rel_err(alone[0], alone[1]) > 1e-2  # different experts chosen: a swap would show
    results: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def run(i: int) -> None:
        for _ in range(4):
            results[i].append(decode(*work[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # each decode step of each thread: both layers in C
    assert calls.count("sparse_experts") == 2 * len(model.model.layers) * 24 * (1 + 4)
    shared = vars(model.model.layers[0])["_decode_layer"].args  # the layer's own arguments have no buffers: C refuses them
    assert lib.sparse_experts(ctypes.byref(shared), torch.empty(shared.hidden, dtype=torch.bfloat16).data_ptr(), 1) == -2
    for i in range(2):
        assert len(results[i]) == 4
        for got in results[i]:
            assert torch.equal(got, alone[i])


@pytest.mark.parametrize("rows", ["equal", "boundary"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_experts_a_c_layer_takes_at_equal_router_probabilities_are_torch_topk_s(moe, monkeypatch, arch, rows):
    """Layer 1's router (4 experts, top 2; Qwen3-MoE's weights rounded to bfloat16, Mixtral's not)
    made to tie. "equal": every row the same, so are the probabilities, and torch.topk takes experts
    2 and 3 (its own order of ties, not the lowest indices). "boundary": rows -r, 0, 0, r, so experts
    1 and 2 tie for the second place only, and torch.topk takes 2 after 3. The C layer meets the tie,
    leaves the choice to torch.topk on its logits, and its logits are the modules'."""
    from native_c import require_c

    from quantprep.runtime import cpu_layers

    require_c(cpu_layers.library() is not None and cpu_layers.gemv_library() is not None and cpu_layers.gemv_bf16_built())
    model = quantprep.load(moe(arch) / "cpu")
    gate = model.model.layers[1].mlp.gate
    r = gate.weight[0].clone()
    with torch.no_grad():  # in place: C reads it at its address
        gate.weight.copy_(r.expand_as(gate.weight) if rows == "equal" else torch.stack([-r, 0 * r, 0 * r, r]))
    x = torch.randn(1, gate.hidden_dim).bfloat16()
    picks = gate(x)[2].tolist() + gate(-x)[2].tolist()
    assert picks == ([[2, 3], [2, 3]] if rows == "equal" else [[3, 2], [0, 1]] if (x.float() @ r.float()).item() > 0 else [[0, 1], [3, 2]])
    ties = []
    chooses = cpu_layers.SparseState.router_chooses
    monkeypatch.setattr(cpu_layers.SparseState, "router_chooses", lambda self: ties.append(1) or chooses(self))

    def steps(modules: bool = False) -> torch.Tensor:
        with monkeypatch.context() as patch, torch.no_grad():
            if modules:
                patch.setattr(cpu_layers, "layer_kernel", lambda path: None)
            out = model(input_ids=PROMPTS[:1], use_cache=True)
            logits = []
            for token in (7, 9, 11):
                out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
                logits.append(out.logits[0, -1].float())
        return torch.stack(logits)

    in_c = steps()
    assert len(ties) == 3  # each step's layer 1
    assert torch.equal(in_c, steps(modules=True))


def test_a_module_put_into_a_dict_directly_is_seen_before_c_reads_it(moe, monkeypatch):
    """A projection swapped by writing a module's `_modules` (no nn.Module method: the counts do not
    move), an attention's or a chosen expert's, is what the next C decode step reads: its logits
    equal the modules' path, not the old projection's."""
    from native_c import require_c

    from quantprep.runtime import cpu_layers

    require_c(cpu_layers.library() is not None and cpu_layers.gemv_library() is not None and cpu_layers.gemv_bf16_built())
    model = quantprep.load(moe("qwen3_moe") / "cpu")
    layer = model.model.layers[1]
    experts = layer.mlp.experts
    swaps = [(layer.self_attn._modules, "o_proj")] + [(experts._modules[str(e)]._modules, "down_proj") for e in range(experts.num_experts)]
    others = []
    for d, name in swaps:  # made before the decode: each change to them is counted
        other = copy.deepcopy(d[name])
        other.qweight = other.qweight.flip(0)
        others.append(other)

    def step(cache, modules: bool = False):
        with monkeypatch.context() as patch, torch.no_grad():
            if modules:
                patch.setattr(cpu_layers, "layer_kernel", lambda path: None)
            return model(input_ids=torch.tensor([[9]]), past_key_values=cache, use_cache=True).logits[0, -1].float()

    for swap in ([0], list(range(1, len(swaps)))):
        with torch.no_grad():
            out = model(input_ids=PROMPTS[:1], use_cache=True)
            out = model(input_ids=torch.tensor([[7]]), past_key_values=out.past_key_values, use_cache=True)
        assert vars(layer)["_decode_layer"].args is not None  # C ran that step
        before = step(copy.deepcopy(out.past_key_values))
        for i in swap:
            d, name = swaps[i]
            d[name], others[i] = others[i], d[name]
        in_c, by_modules = step(copy.deepcopy(out.past_key_values)), step(out.past_key_values, modules=True)
        assert rel_err(in_c, before) > 1e-2
        assert rel_err(in_c, by_modules) < 1e-3
        for i in swap:
            d, name = swaps[i]
            d[name], others[i] = others[i], d[name]


def test_compiled_regions_leave_the_experts_eager(moe):
    """torch.compile and the compiled MLP packages (warm --compile, aot.py) take the dense MLPs: the
    experts a MoE layer runs depend on the data, which export cannot capture (warm would fail)."""
    from quantprep.runtime.aot import decoder_mlps

    model = quantprep.load(moe("deepseek_v3") / "cpu")
    assert decoder_mlps(model) == [model.model.layers[0].mlp]  # first_k_dense_replace=1: layer 0 is dense


def test_every_expert_is_probed_and_checked(moe, copy_of, capsys):
    """The expert calibration never reached was rounded to nearest (no act-order) and the others
    act-ordered, each by its own g_idx; verify probes all of them on every target; a wrong code in
    the unreached expert changes no logits (no token reaches it) and fails verify, naming it."""
    from quantprep.cli import main

    root = moe("deepseek_v3")
    modules = read_manifest(root / "cpu")["modules"]
    experts = [f"model.layers.1.mlp.experts.{e}" for e in range(8)]
    assert [modules[f"{e}.gate_up_proj"]["act_order"] for e in experts] == [True] * 7 + [False]
    for target in TARGETS:
        report = verify_artifact(root / target)
        assert report["experts"] == {"moe_layers": 1, "experts": 8, "linears": 16, "probed": 8}, target
        assert {r["layer"] for r in report["probes"]} >= {f"{e}.{p}" for e in experts for p in ("gate_up_proj", "down_proj")}
    assert main(["inspect", str(root / "cpu")]) == 0
    assert "experts    8 in 1 MoE layers, 16 of the quantized linears" in capsys.readouterr().out
    assert main(["verify", str(root / "cpu")]) == 0
    assert "experts: 8 of 8 in 1 MoE layers, 16 of the quantized linears, probed" in capsys.readouterr().out

    art = copy_of(root / "cpu")
    before = last_and_decode(quantprep.load(art))
    shard = read_manifest(art)["shards"][0]
    tensors = load_file(art / shard)
    key = f"{UNROUTED}.down_proj.qweight"
    tensors[key] = tensors[key] ^ 0x11  # one bit of every code of every byte: another weight, same layout
    save_file(tensors, art / shard, metadata={"format": "pt"})
    relist(art, shard)
    after = last_and_decode(quantprep.load(art))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    with pytest.raises(ArtifactError, match=rf"layer {UNROUTED}\.down_proj at 1 rows differs from the dense reference"):
        verify_artifact(art)


def test_eval_counts_the_experts_its_text_reached(moe, capsys):
    from quantprep.cli import _eval_line
    from quantprep.tools.eval import evaluate

    root = moe("deepseek_v3")
    r = evaluate(root / "cpu-float32", reference=root / "gptq", ctx=32, max_tokens=512, store=False, progress=False)
    assert r["experts"] == {"experts": 8, "routed": 7, "moe_layers": 1}  # all but the unreachable one
    assert r["kld"]["mean"] < 1e-6 and r["top1_agree"] == 1.0
    assert _eval_line(r).endswith(", 7 of 8 experts routed to")


def test_from_pretrained_loads_the_same_model(moe):
    from transformers import AutoModelForCausalLM

    art = moe("qwen3_moe") / "cpu"
    theirs = AutoModelForCausalLM.from_pretrained(art)
    ours = quantprep.load(art)
    assert sum(isinstance(m, QuantizedExperts) for m in theirs.modules()) == 2
    for a, b in zip(last_and_decode(ours), last_and_decode(theirs), strict=True):
        assert torch.equal(a, b)


def test_deepseek_router_stays_float32(moe):
    """DeepSeek's router weight and e_score_correction_bias, which choose the experts, are float32 in
    the model's code: the bf16 artifact stores them so (-1e4 is -9984 in bf16), and a load in another
    dtype keeps them, through quantprep.load and from_pretrained alike."""
    from transformers import AutoModelForCausalLM

    art = moe("deepseek_v3") / "cpu"
    stored = load_file(art / read_manifest(art)["shards"][0])
    router = "model.layers.1.mlp.gate"
    assert stored[f"{router}.weight"].dtype == torch.float32 and stored["model.norm.weight"].dtype == torch.bfloat16
    assert stored[f"{router}.e_score_correction_bias"][-1].item() == -1e4
    ours, theirs = quantprep.load(art, dtype=torch.float16), AutoModelForCausalLM.from_pretrained(art, dtype=torch.float16)
    assert ours.get_submodule(router).e_score_correction_bias.dtype == theirs.get_submodule(router).weight.dtype == torch.float32
    assert torch.equal(last_and_decode(ours)[0], last_and_decode(theirs)[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the cuda target's CPU path runs in the tests above)")
@pytest.mark.parametrize("arch", list(MODELS))
def test_cuda_on_gpu(arch, tmp_path):
    """The cuda artifacts on the GPU: tinygemm at decode, dequantize + cuBLAS for the prompt. Random
    GPTQ codes (build/synthetic.py), so it runs where gptqmodel is not installed, such as the GPU machine."""
    from quantprep.build.synthetic import write_random_checkpoint

    gptq = write_random_checkpoint(tmp_path / "gptq", dict(BASE, **MODELS[arch], model_type=arch), group_size=32)
    prepack(gptq, "cuda", tmp_path / "cuda")
    check_logits(quantprep.load(tmp_path / "cuda"), dense_reference_model(gptq), "bfloat16", f"{arch} cuda on the GPU")


# --- random GPTQ checkpoints (build/synthetic.py: milliseconds, no gptqmodel): layouts and refusals ---

QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                 num_experts_per_tok=2, mlp_only_layers=[1], decoder_sparse_step=1, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def random_moe(tmp_path_factory) -> Path:
    from quantprep.build.synthetic import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("random-moe") / "gptq", QWEN3_MOE, group_size=32)


def test_mlp_only_layers_stay_dense(random_moe, tmp_path):
    """Qwen3-MoE's mlp_only_layers: transformers' own choice of which layers are sparse, kept."""
    prepack(random_moe, "cpu", tmp_path / "art", "float32")
    model = quantprep.load(tmp_path / "art")
    assert [type(layer.mlp.experts).__name__ if hasattr(layer.mlp, "experts") else type(layer.mlp).__name__
            for layer in model.model.layers] == ["QuantizedExperts", "Qwen3MoeMLP", "QuantizedExperts"]
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, dense_reference_model(random_moe)(input_ids=ids).logits) <= 1e-4


def _one_line(e) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def test_checkpoint_refusals(random_moe, tmp_path):
    """A checkpoint missing an expert, or with one of another size, fails prepack in one line."""
    gptq = tmp_path / "gptq"
    shutil.copytree(random_moe, gptq)
    weights = load_file(gptq / "model.safetensors")
    missing = {k: v for k, v in weights.items() if not k.startswith("model.layers.2.mlp.experts.3.up_proj.")}
    save_file(missing, gptq / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SourceError) as e:
        prepack(gptq, "cpu", tmp_path / "a")
    assert "tensor model.layers.2.mlp.experts.3.up_proj.qweight: missing (1 of the 12 expert projections" in _one_line(e)

    config = json.loads((gptq / "config.json").read_text())
    save_file(weights, gptq / "model.safetensors", metadata={"format": "pt"})
    (gptq / "config.json").write_text(json.dumps(dict(config, moe_intermediate_size=64)))
    with pytest.raises(SourceError) as e:
        prepack(gptq, "cpu", tmp_path / "b")
    assert "tensor model.layers.0.mlp.experts.0.down_proj.qweight: 32x64, the qwen3_moe model's experts' down_proj is 64x64" in _one_line(e)


def test_artifact_refusals(random_moe, tmp_path):
    """An artifact whose manifest lost an expert, or whose config.json has fewer experts, fails load in one line."""
    from conftest import edit_manifest

    prepack(random_moe, "cpu", tmp_path / "art")
    art = tmp_path / "lost"
    shutil.copytree(tmp_path / "art", art)
    edit_manifest(art, lambda m: m["modules"].pop("model.layers.0.mlp.experts.2.down_proj"))
    with pytest.raises(ArtifactError) as e:
        quantprep.load(art)
    assert "module model.layers.0.mlp.experts.2.down_proj is missing from manifest.json" in _one_line(e)

    art = tmp_path / "fewer"
    shutil.copytree(tmp_path / "art", art)
    (art / "config.json").write_text(json.dumps(dict(json.loads((art / "config.json").read_text()), num_local_experts=3)))  # num_experts
    relist(art, "config.json")
    with pytest.raises(ArtifactError) as e:
        quantprep.load(art)
    assert "is expert 3, the qwen3_moe model's model.layers.0.mlp.experts has 3" in _one_line(e)
