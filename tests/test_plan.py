"""Kernel plans (issue 32): warm times each distinct linear shape's kernel paths on this machine and
ships the winners as kcache/plan.json; load runs them when the kcache is trusted and the plan's key
is this machine's, and otherwise keeps each module's fixed rule with one warning."""

import json

import pytest
import torch
from conftest import TINY_LLAMA, edit_manifest, random_cpu_artifact, rel_err
from native_c import require_c, require_int4_a8
from torch.utils._python_dispatch import TorchDispatchMode

import quantprep
from quantprep.format.artifact import read_manifest, sha256_file
from quantprep.runtime import plan
from quantprep.runtime.kcache import KCACHE, PLAN
from quantprep.runtime.warm import warm
from quantprep.targets.cpu import CpuInt4Linear
from quantprep.targets.packed import PackedLinear, dense_path

LENGTHS = [1, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 104, 120, 136, 152, 168, 192, 216, 240, 264, 296, 328, 368,
           408, 456, 504, 512]  # the 1.5B recipe's warm shapes
CONFIG = dict(TINY_LLAMA, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
INT4_OP = "_weight_int4pack_mm_for_cpu"
DENSE = dense_path(torch.bfloat16, "cpu")  # "dequant_f32" below AVX512, whose bfloat16 GEMM is a slow loop


def _module(K=128, N=256) -> CpuInt4Linear:
    from conftest import prepacked_module

    from quantprep.build.source import QuantConfig
    from quantprep.build.synthetic import random_gptq_tensors

    raw = random_gptq_tensors(K, N, 4, 64, False, True, True)
    return prepacked_module("cpu", raw, QuantConfig(4, 64, False, True, "gptq"), torch.bfloat16)[1]


def affine(costs: dict[str, tuple[float, float]], calls: list[int]):
    """A stand-in clock: path p takes a + b * M ms (the model the search relies on)."""
    def measure(module, x, paths):
        calls.append(x.shape[0])
        return {p: costs[p][0] + costs[p][1] * x.shape[0] for p in paths}
    return measure


def test_int8_activation_paths_only_when_asked():
    """A path that rounds the activations to int8 (cpu int4_a8) never wins a plan for its speed
    alone: warm --int8-activations lets it."""
    m = _module()
    require_int4_a8()
    if "int4_a8" not in m.paths():
        pytest.skip("torch packs another layout than int4_a8 reads on this CPU")
    fastest = affine({"int4": (0, 0.1), DENSE: (20, 0.01), "int4_a8": (0, 0.001)}, [])
    assert plan.decide_shape(m, [1, 512], fastest)[0] == [[1, "int4"], [512, DENSE]]
    assert plan.decide_shape(m, [1, 512], fastest, int8_activations=True)[0] == [[1, "int4_a8"]]


def test_search_finds_the_crossover_with_a_few_timings():
    calls = []
    # int4: 0.1 ms per row; dequant: 20 ms + 0.01 ms per row: they cross at M = 222.2
    ranges, timings = plan.decide_shape(_module(), LENGTHS, affine({"int4": (0, 0.1), DENSE: (20, 0.01)}, calls))
    assert ranges == [[1, "int4"], [240, DENSE]]  # 216 < 222.2 < 240
    assert len(calls) <= 2 + 5 and set(calls) == {int(m) for m in timings}  # log2(27) bisections, not 27 lengths


@pytest.mark.parametrize("costs,expected", [
    ({"int4": (0, 0.1), DENSE: (100, 0.01)}, [[1, "int4"]]),  # never crosses within the lengths
    ({"int4": (5, 0.1), DENSE: (0, 0.01)}, [[1, DENSE]]),
])
def test_search_with_one_winner_times_the_two_ends_only(costs, expected):
    calls = []
    assert plan.decide_shape(_module(), LENGTHS, affine(costs, calls))[0] == expected
    assert sorted(calls) == [1, 512]


def test_real_timings_give_ascending_ranges_of_the_module_s_paths():
    m = _module()
    ranges, timings = plan.decide_shape(m, [1, 64, 512])
    assert ranges[0][0] == 1 and [r[0] for r in ranges] == sorted({r[0] for r in ranges})
    timed = set(m.paths()) - set(m.INT8_ACTIVATION_PATHS)  # those only with int8_activations
    assert {p for _, p in ranges} <= timed and all(set(t) == timed for t in timings.values())


def test_long_first_calls_cut_the_timed_calls(monkeypatch):
    """On a CPU: first calls all short, SHORT_REPS timed calls per path after them, or REPS where
    they were not that short; a path whose first call took plan.LONG_CALL_S or more is called once
    more, or not again where that first call was a clear loss (CLEAR_LOSS times the fastest's), and
    then that call is its timing."""
    m = _module()
    calls = []
    original = type(m).run
    monkeypatch.setattr(type(m), "run", lambda self, x, path: calls.append(path) or original(self, x, path))
    x = torch.randn(4, m.in_features).bfloat16()

    def timed_calls(long: float, loss: float, short: float) -> dict:
        monkeypatch.setattr(plan, "LONG_CALL_S", long)
        monkeypatch.setattr(plan, "CLEAR_LOSS", loss)
        monkeypatch.setattr(plan, "SHORT_CALL_S", short)
        calls.clear()
        with torch.inference_mode():
            ms = plan.time_paths(m, x, ("int4", DENSE))
        assert set(ms) == {"int4", DENSE} and all(t > 0 for t in ms.values())
        return {p: calls.count(p) for p in ("int4", DENSE)}

    inf = float("inf")
    assert timed_calls(inf, inf, 0.0) == {"int4": 1 + plan.REPS, DENSE: 1 + plan.REPS}
    assert timed_calls(inf, inf, inf) == {"int4": 1 + plan.SHORT_REPS, DENSE: 1 + plan.SHORT_REPS}
    assert timed_calls(0.0, inf, 0.0) == {"int4": 2, DENSE: 2}  # every call long, none a clear loss
    assert timed_calls(0.0, 0.0, 0.0) == {"int4": 1, DENSE: 1}  # every call long and a clear loss


class Ops(TorchDispatchMode):
    """The aten ops a forward calls, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _logits_and_ops(model, length: int):
    ids = torch.arange(length).view(1, length) % model.config.vocab_size
    with torch.inference_mode(), Ops() as ops:
        logits = model(ids).logits[0].float()
    return logits, ops.names


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    art = random_cpu_artifact(tmp_path_factory.mktemp("plan"), CONFIG, bits=4, group_size=64, desc_act=True, sym=False)
    report = warm(art, shapes=[1, 8, 64], progress=False)
    return art, report


def _rewrite_plan(art, edit) -> None:
    """Change kcache/plan.json and list it again, as anyone can (the kcache is then no longer the one warmed here)."""
    p = art / KCACHE / PLAN
    data = json.loads(p.read_text())
    edit(data)
    p.write_text(json.dumps(data) if isinstance(data, dict) else data)

    def relist(m):
        m["kcache"]["files"][PLAN] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    edit_manifest(art, relist)


def test_warm_ships_a_plan_for_every_shape_and_load_applies_it(planned):
    art, report = planned
    manifest = read_manifest(art)
    assert PLAN in manifest["kcache"]["files"]
    shipped = json.loads((art / KCACHE / PLAN).read_text())
    assert shipped["shapes"] == report["plan"]["shapes"] and shipped["key"] == plan.plan_key("cpu")
    model = quantprep.load(art)
    modules = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert {m.plan_shape() for m in modules} == set(shipped["shapes"])  # q/k/v, o, gate/up, down: 4 shapes
    assert model.quantprep_kcache["plan"] == len(modules) == 2 * 4
    assert all(list(map(list, m.plan)) == shipped["shapes"][m.plan_shape()] and m.plan_max_m == 64 for m in modules)


def test_load_runs_the_planned_path(planned, copy_of):
    art = copy_of(planned[0])
    reference, _ = _logits_and_ops(quantprep.load(art, kcache=False), 8)
    for forced, int4_calls in (("int4", 8), (DENSE, 0)):
        _rewrite_plan(art, lambda d, forced=forced: d["shapes"].update({s: [[1, forced]] for s in d["shapes"]}))
        model = quantprep.load(art, trust_kcache=True)
        logits, ops = _logits_and_ops(model, 8)
        assert ops.count(INT4_OP) == int4_calls, (forced, ops.count(INT4_OP))
        # the two paths are the same arithmetic but for bf16 rounding
        assert rel_err(logits, reference) < 2e-2 and (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.85


def test_above_the_longest_length_timed_the_fixed_rule_runs(planned, copy_of):
    art = copy_of(planned[0])
    _rewrite_plan(art, lambda d: d["shapes"].update({s: [[1, DENSE]] for s in d["shapes"]}))
    model = quantprep.load(art, trust_kcache=True)
    m = next(m for m in model.modules() if isinstance(m, CpuInt4Linear))
    assert [m.path_for(n) for n in (1, 64, 65, CpuInt4Linear.DEQUANT_MIN_M)] == [DENSE, DENSE, "int4", DENSE]


def test_without_a_plan_the_fixed_rule_runs(planned):
    art, _ = planned
    model = quantprep.load(art, kcache=False)
    assert all(m.plan == () for m in model.modules() if isinstance(m, PackedLinear))
    _, ops = _logits_and_ops(model, 8)
    assert ops.count(INT4_OP) == 8  # below DEQUANT_MIN_M every int4 module runs the kernel


def test_an_untrusted_plan_is_not_applied(planned, copy_of):
    art = copy_of(planned[0])
    _rewrite_plan(art, lambda d: d["shapes"].update({s: [[1, DENSE]] for s in d["shapes"]}))  # now another kcache
    with pytest.warns(UserWarning, match="not trusted here"):
        model = quantprep.load(art)
    assert model.quantprep_kcache["status"] == "untrusted" and "plan" not in model.quantprep_kcache
    assert all(m.plan == () for m in model.modules() if isinstance(m, PackedLinear))


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["key"].update(processor="another CPU"), "built for processor='another CPU'"),
    (lambda d: d["key"].update(threads=999), "built for threads=999"),
    (lambda d: d["shapes"].update({s: [[1, "int4"], [8, "rm -rf"]] for s in d["shapes"]}), "names path 'rm -rf'"),
    (lambda d: d["shapes"].update({s: [[1, "int4"], [1, "dequant"]] for s in d["shapes"]}), "first_m ascending"),
    (lambda d: d["shapes"].update({s: [[0, "int4"]] for s in d["shapes"]}), "first_m ascending"),
    (lambda d: d["shapes"].update({s: [[1.5, "int4"]] for s in d["shapes"]}), "first_m ascending"),
    (lambda d: d["shapes"].update({s: [[1, "int4"]] * 65 for s in d["shapes"]}), "first_m ascending"),
    (lambda d: d.update(version=2), "plan version 2"),
    (lambda d: d.update(max_m="512"), "max_m '512'"),
    (lambda d: d["shapes"].update({s: [[1, "int4"], [d["max_m"] + 1, "dequant"]] for s in d["shapes"]}), "first_m ascending"),
    (lambda d: d.update(shapes=[]), "expected a key and at most"),
    (lambda d: d.update(nested=json.loads("[" * 100 + "]" * 100)), "nested deeper"),
])
def test_a_foreign_or_malformed_plan_is_ignored_with_one_warning(planned, copy_of, edit, message):
    art = copy_of(planned[0])
    _rewrite_plan(art, edit)
    with pytest.warns(UserWarning, match="kernel plan not used") as caught:
        model = quantprep.load(art, trust_kcache=True)
    assert any(message in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert model.quantprep_kcache["plan"].startswith("ignored")
    assert all(m.plan == () for m in model.modules() if isinstance(m, PackedLinear))


def test_a_plan_larger_than_its_bound_is_not_read(planned, copy_of):
    art = copy_of(planned[0])
    _rewrite_plan(art, lambda d: d.update(padding="x" * plan.MAX_BYTES))
    with pytest.warns(UserWarning, match="larger than"):
        model = quantprep.load(art, trust_kcache=True)
    assert all(m.plan == () for m in model.modules() if isinstance(m, PackedLinear))


def test_a_plan_changed_after_listing_is_refused(planned, copy_of):
    art = copy_of(planned[0])
    p = art / KCACHE / PLAN
    p.write_bytes(p.read_bytes().replace(b'"version": 1', b'"version": 2'))  # same size: only its sha256 tells
    with pytest.warns(UserWarning, match="does not match its sha256"):
        model = quantprep.load(art, trust_kcache=True)
    assert all(m.plan == () for m in model.modules() if isinstance(m, PackedLinear))


def test_compiled_packages_split_where_the_plan_switches(planned):
    """AOT export follows the planned paths: its token ranges break at a plan's switch, at the end
    of the plan, and at the fixed rule's switch beyond it."""
    from quantprep.runtime.aot import decoder_mlps, export_ranges

    model = quantprep.load(planned[0], kcache=False)
    shapes = set(plan.planned_modules(model))
    plan.apply(model, {"version": 1, "key": plan.plan_key("cpu"), "max_m": 8,
                       "shapes": {s: [[1, "int4"], [4, DENSE]] for s in shapes}}, "cpu")
    spans = [(lo, hi) for lo, hi, _ in export_ranges(decoder_mlps(model)[0], model.config.hidden_size, 1024)]
    assert spans == [(1, 1), (2, 3), (4, 8), (9, CpuInt4Linear.DEQUANT_MIN_M - 1), (CpuInt4Linear.DEQUANT_MIN_M, 1024)]


@pytest.mark.parametrize("bad", ["out of range", "repeated"])
def test_an_artifact_whose_perm_is_not_a_permutation_is_refused(planned, copy_of, bad):
    """The dense path's native dequantizer writes weight row perm[k]: a perm that indexes outside
    the layer (memory) or repeats a row (a silently different model) is refused at load and verify."""
    from conftest import relist
    from safetensors.torch import load_file, save_file

    from quantprep.errors import ArtifactError
    from quantprep.tools.verify import verify_artifact

    art = copy_of(planned[0])
    shard = read_manifest(art)["shards"][0]
    tensors = load_file(art / shard)
    name = next(k for k in tensors if k.endswith(".perm"))
    perm = tensors[name].clone()
    perm[0] = 1 << 20 if bad == "out of range" else perm[1]
    tensors[name] = perm
    save_file(tensors, art / shard, metadata={"format": "pt"})
    relist(art, shard)
    for run in (lambda: quantprep.load(art), lambda: verify_artifact(art)):
        with pytest.raises(ArtifactError, match="perm is not a permutation"):
            run()


@pytest.mark.parametrize("field,value", [("pack_block_n", -64), ("pack_block_n", 1), ("pack_block_n", True),
                                         ("kernel_group_size", 7), ("padded_in", 32), ("padded_out", 1 << 40)])
def test_layout_metadata_the_native_path_indexes_by_is_checked(planned, copy_of, field, value):
    """The dense path's C code addresses memory with these manifest fields: any value other than
    what the cpu target packs is refused in one line, before a byte of weights is read."""
    from quantprep.errors import ArtifactError

    art = copy_of(planned[0])
    edit_manifest(art, lambda m: next(v for k, v in m["modules"].items() if k.endswith("down_proj")).update({field: value}))
    with pytest.raises(ArtifactError, match="malformed cpu metadata"):
        quantprep.load(art)


def test_zero_rows_and_autograd(monkeypatch):
    """Zero rows take the fixed rule; the dense path multiplies cached tiles (out=) only without
    autograd, and with it dequantizes the whole weight, so a backward pass gets x's gradient."""
    from quantprep.targets import cpu

    m = _module()
    assert m(torch.zeros(0, m.in_features, dtype=torch.bfloat16)).shape == (0, m.out_features)
    require_c(cpu.native_dequantizer() is not None)
    m.plan, m.plan_max_m = ((1, DENSE),), 64
    tiled, original = [], cpu.tiled_matmul
    monkeypatch.setattr(cpu, "tiled_matmul", lambda *a: tiled.append(1) or original(*a))
    x = torch.randn(8, m.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        y = m(x)
    assert tiled == [1]
    x.requires_grad_(True)
    y_grad = m(x)
    y_grad.float().sum().backward()
    assert tiled == [1]
    assert rel_err(x.grad.float(), m.dequantize().float().sum(1).expand(8, -1)) < 1e-2  # d(sum x @ w)/dx
    assert rel_err(y_grad.detach().float(), y.float()) < 1e-2


def test_apply_prepares_each_planned_path(planned, monkeypatch):
    """load builds what a planned path needs before the first forward (cuda's mslk layout; a no-op
    on the CPU's paths): every module is prepared for every path its ranges name."""
    art, _ = planned
    seen = []
    monkeypatch.setattr(CpuInt4Linear, "prepare", lambda self, path: seen.append((id(self), path)))
    model = quantprep.load(art)
    modules = [m for m in model.modules() if isinstance(m, CpuInt4Linear) and m.plan]
    assert modules and set(seen) == {(id(m), p) for m in modules for _, p in m.plan}
