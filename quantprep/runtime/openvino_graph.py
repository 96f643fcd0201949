"""The openvino target's graph, made from transformers' own modeling code: the model traced with
torch.jit.trace and converted by OpenVINO's PyTorch frontend, with quantprep's subgraph for each
quantized module.

How (the same at prepack and at load's check, from the same data):
1. transformers builds the model of config.json, its parameters on the meta device; each quantized
   module of the manifest is replaced by a `GraphLinear` (fused projections through runtime/fused.py,
   a layer's experts through runtime/experts.py's QuantizedExperts), the float tensors are loaded.
2. The model is traced with its KV cache as inputs and outputs. OpenVINO's frontend replaces each
   GraphLinear call by one node (a ModuleExtension), which our ConversionExtension writes as
   targets/openvino.py's `linear`: the codes kept compressed, act-order a Gather of the activation
   (the frontend never reads g_idx, and we never hand it one). A QuantizedExperts call becomes one
   node too: without act-order in the tiled form the CPU plugin runs as GatherMatmul
   (`tiled_experts`), else each expert's projections on its routed tokens (`expert_subgraph`).
3. optimum-intel's stateful recipe (its exporters/openvino/stateful.py, which cannot be installed
   beside gptqmodel): a Gather by beam_idx on each cache input, then OpenVINO's make-stateful
   transformation turns the cache inputs and outputs into state, initialised empty.
4. Float constants are stored in the narrowest of f16, bf16, f32 that holds them exactly, and every
   node gets a name made from what it is (so that the IR written again compares equal).

The result is what openvino.genai's LLMPipeline expects: inputs input_ids, attention_mask,
position_ids, beam_idx; output logits; the cache as state.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from quantprep.format.expert_names import expert_linear
from quantprep.runtime.experts import QuantizedExperts, check_experts_installed, install_experts
from quantprep.runtime.fused import in_model
from quantprep.runtime.fused import install as install_fused
from quantprep.targets.openvino import PARTS, constants

LINEAR_OP, EXPERTS_OP = "quantprep::linear", "quantprep::experts"


class GraphLinear(nn.Module):
    """Stands in for one quantized module of the manifest while the model is traced: its output is
    only a shape (zeros); the converted graph computes it (`linear`)."""

    bias = None

    def __init__(self, index: int, meta: dict):
        super().__init__()
        self.index, self.in_features, self.out_features = index, meta["in_features"], meta["out_features"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.out_features)

    def forward_split(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return [t.contiguous() for t in torch.split(self(x), sizes, -1)]


# RoPE whose frequencies the model's forward picks by the sequence length, in Python: a trace keeps
# the choice made for its example, which is wrong past the original context
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


# The architectures tests/test_architectures.py converts and runs (docs/supported.md): others are
# refused, since tracing runs a model's Python on whatever config.json says
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "granite", "olmo2", "phi3", "glm4",
                 "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3")


def traced_problem(config: dict) -> str | None:
    """What in config.json a traced graph would not follow, or the openvino target does not convert (named), or None."""
    if config.get("model_type") not in ARCHITECTURES:
        return f"model_type={str(config.get('model_type'))[:40]!r} is not one the openvino target converts (docs/supported.md)"
    for field in ("rope_scaling", "rope_parameters"):
        params = config.get(field) or {}
        for p in (params.values() if isinstance(params, dict) and all(isinstance(v, dict) for v in params.values()) and params else [params]):
            kind = p.get("rope_type", p.get("type")) if isinstance(p, dict) else None
            if kind in LENGTH_DEPENDENT_ROPE:
                return (f"{field}.rope_type={kind!r}: its frequencies change with the sequence length, which one traced graph "
                        "does not follow")
    return None


def skeleton(config: dict, modules: dict[str, dict]) -> tuple[nn.Module, list[str]]:
    """transformers' model of `config` on the meta device, each module of `modules` replaced by a
    GraphLinear; the names in GraphLinear index order."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantprep.runtime.torch_model import params_on_meta

    if problem := traced_problem(config):
        raise ValueError(problem)
    # the implementations are quantprep's choice (SDPA, its experts module), never the config's
    config = {k: v for k, v in config.items() if k not in ("quantization_config", "experts_implementation", "attn_implementation")
              and not k.startswith("_")}
    hf = AutoConfig.for_model(**config)
    if "lm_head" in modules:
        hf.tie_word_embeddings = False
    with params_on_meta():
        try:
            model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32, trust_remote_code=False, attn_implementation="sdpa")
        except ValueError:  # a model without an SDPA path (Gemma 2's soft-capping): its eager attention
            model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32, trust_remote_code=False, attn_implementation="eager")
    install_experts(model, "<config.json>", modules)
    names = list(modules)
    for index, name in enumerate(names):
        meta = modules[name]
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module, fused = GraphLinear(index, meta), meta.get("fused")
        if fused and in_model(hf.model_type, child) is None:
            install_fused(parent, child, module, fused["members"], fused["sizes"])
        else:
            setattr(parent, child, module)
    check_experts_installed(model, "<config.json>")
    return model.eval(), names


def load_floats(model: nn.Module, weights) -> set[str]:
    """The model's tensors that `weights` holds (its parameters, and buffers it stores such as
    DeepSeek's e_score_correction_bias), as float32: the graph computes in f32. Their names."""
    wanted = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items() if weights.has_float(name)}
    model.load_state_dict({name: weights.tensor(name, shape).float() for name, shape in wanted.items()}, strict=False, assign=True)
    model.tie_weights()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type == "meta":
            raise ValueError(f"no tensor {name!r}, which the {model.config.model_type} model needs")
    return set(wanted)


class WithCache(nn.Module):
    """The model as a function of tensors: (input_ids, attention_mask, position_ids, past keys and
    values per layer, then the float tensors named `floats`) -> (logits, present keys and values per
    layer). The float tensors are inputs of the trace, not constants of it, so that OpenVINO's
    conversion folds nothing into them (Gemma's 1 + weight, a multiply by a norm of ones): `export`
    puts each one back as a constant under its own name, which the check at load finds."""

    def __init__(self, model: nn.Module, caches: int, floats: list[str]):
        super().__init__()
        self.model, self.caches, self.floats = model, caches, floats

    def forward(self, input_ids, attention_mask, position_ids, *rest):
        from transformers.cache_utils import DynamicCache, DynamicLayer

        past, floats = rest[:self.caches], dict(zip(self.floats, rest[self.caches:], strict=True))
        cache = DynamicCache()  # every layer whole, sliding-window ones too: the mask applies the window
        for i in range(len(past) // 2):
            layer = DynamicLayer()  # filled as its lazy_initialization + update would, without concatenating an empty tensor
            layer.keys, layer.values, layer.device, layer.is_initialized = past[2 * i], past[2 * i + 1], past[2 * i].device, True
            cache.layers.append(layer)
        with swapped(self.model, floats):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=True)
        present = []
        for layer in out.cache.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


@contextlib.contextmanager
def swapped(model: nn.Module, tensors: dict[str, torch.Tensor]):
    """Inside the block, each of the model's tensors named in `tensors` (and every name tied to it) is
    the tensor given: torch.func.functional_call, which the tracer refuses."""
    if not tensors:
        yield
        return
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    by_object = {id(t): tensors[name] for name, t in named if name in tensors}
    saved = []
    for name, t in named:
        if id(t) in by_object:
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            slots = owner._parameters if leaf in owner._parameters else owner._buffers
            saved.append((slots, leaf, slots[leaf]))
            slots[leaf] = by_object[id(t)]
    try:
        yield
    finally:
        for slots, leaf, original in reversed(saved):
            slots[leaf] = original


def _i64(values):
    import openvino.opset13 as ops

    return ops.constant(np.array(values, dtype=np.int64))


def expert_subgraph(x, tokens_mask, weights_in, linear_of, expert, intermediate: int):
    """Output [T, H] of one expert on the tokens routed to it: NonZero picks the (token, slot) pairs
    of `tokens_mask` [T, k], the expert runs on those rows only (none at all: an empty matmul), each
    row weighted by its routing weight; the rows are then scattered back into place as [T, H]."""
    import openvino.opset13 as ops

    pairs = ops.non_zero(tokens_mask, "i64")  # [2, n]
    tokens = ops.gather(pairs, _i64(0), _i64(0))  # [n]
    routed = ops.gather_nd(weights_in, ops.transpose(pairs, _i64([1, 0])))  # [n]
    rows = ops.gather(x, tokens, _i64(0))
    gate_up = expert.get("gate_up_proj")
    if gate_up is not None:
        y = linear_of(gate_up, rows)
        gate, up = ops.variadic_split(y, _i64(-1), _i64([intermediate, intermediate])).outputs()
    else:
        gate, up = linear_of(expert["gate_proj"], rows), linear_of(expert["up_proj"], rows)
    h = ops.multiply(ops.swish(gate), up)  # SiLU: export refuses experts of another activation
    y = ops.multiply(linear_of(expert["down_proj"], h), ops.unsqueeze(routed, _i64(-1)))
    return tokens, y


SAME_ACROSS_EXPERTS = ("bits", "sym", "groups", "padded_in", "in_features", "out_features")


def tiled_experts_of(modules: dict[str, dict]) -> dict[str, list[dict[str, str]]]:
    """The experts modules written in the tiled form -> each expert's {projection: module name}, in
    order: every expert with the same projections and metadata, and none with act-order (an
    expert's own input permutation is no Gather of the one activation all experts share), padding
    or a bias. The other layers' experts are written one by one (`expert_subgraph`)."""
    layers: dict[str, dict[int, dict[str, str]]] = {}
    for name in modules:
        if (e := expert_linear(name)) is not None:
            layers.setdefault(e.experts, {}).setdefault(e.index, {})[e.projection] = name
    tiled = {}
    for prefix, by_index in layers.items():
        experts = [by_index[i] for i in sorted(by_index)]
        kinds = set(experts[0])
        if sorted(by_index) != list(range(len(experts))) or any(set(e) != kinds for e in experts) \
                or kinds not in ({"gate_up_proj", "down_proj"}, {"gate_proj", "up_proj", "down_proj"}):
            continue
        metas = {kind: [modules[e[kind]] for e in experts] for kind in kinds}
        if all(not m["act_order"] and not m["bias"] and m["padded_in"] == m["in_features"]
               and all(m[k] == ms[0][k] for k in SAME_ACROSS_EXPERTS) for ms in metas.values() for m in ms):
            tiled[prefix] = experts
    return tiled


def stacked_kinds(experts: list[dict[str, str]], modules: dict[str, dict]) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """The tiled form's three stacked projections -> (the projection each expert's rows come from,
    which rows: gate and up are the halves of a fused gate_up_proj)."""
    if "gate_up_proj" not in experts[0]:
        return {kind: (kind, None) for kind in ("gate_proj", "up_proj", "down_proj")}
    half = modules[experts[0]["gate_up_proj"]]["out_features"] // 2
    return {"gate_proj": ("gate_up_proj", (0, half)), "up_proj": ("gate_up_proj", (half, 2 * half)), "down_proj": ("down_proj", None)}


def stacked_meta(experts: list[dict[str, str]], modules: dict[str, dict], kind: str) -> dict:
    source, rows = stacked_kinds(experts, modules)[kind]
    meta = modules[experts[0][source]]
    return meta if rows is None else dict(meta, out_features=rows[1] - rows[0])


def tiled_experts(x, index, routing, prefix: str, experts: list[dict[str, str]], weights, modules: dict[str, dict]):
    """[T, H]: every expert on every token, weighted by a dense [E, T] routing (zero where not chosen)
    and summed. This is optimum-intel's batched experts, which OpenVINO's CPU plugin turns into
    GatherMatmul nodes that read only each token's top-k experts' codes
    (ConvertTiledMoeBlockToGatherMatmuls: Tile -> Reshape -> MatMul(gate), MatMul(up) -> Swish of
    one input * up -> MatMul(down) -> Reshape -> Multiply(routing) -> ReduceSum)."""
    import openvino as ov
    import openvino.opset13 as ops
    from openvino._pyopenvino import NodeFactory

    from quantprep.targets.openvino import decompressed

    E = len(experts)

    def weight(kind: str):
        meta = stacked_meta(experts, modules, kind)
        return decompressed(weights.stacked(prefix, experts, kind), [E, meta["out_features"], meta["padded_in"]])

    H = stacked_meta(experts, modules, "down_proj")["out_features"]
    tokens = ops.gather(ops.shape_of(x, "i64"), _i64([0]), _i64(0))
    dense = ops.scatter_elements_update(ops.broadcast(ops.constant(np.float32(0)), ops.concat([tokens, _i64([E])], 0)),
                                        ops.convert(index, ov.Type.i64), ops.convert(routing, ov.Type.f32), _i64(1))
    route = ops.reshape(ops.transpose(dense, _i64([1, 0])), _i64([E, -1, 1]), False)
    xe = ops.reshape(ops.tile(x, _i64([E, 1])), _i64([E, -1, H]), False)
    gate, up = ops.matmul(xe, weight("gate_proj"), False, True), ops.matmul(xe, weight("up_proj"), False, True)
    silu = NodeFactory("opset4").create("Swish", [gate.output(0)], {})  # one input: ops.swish adds a beta the fusion does not match
    down = ops.reshape(ops.matmul(ops.multiply(silu, up), weight("down_proj"), False, True), _i64([E, -1, H]), False)
    return ops.reduce_sum(ops.multiply(down, route), _i64([0]), False)


class TensorWeights:
    """The graph's constants from tensors (prepack): `quantized`, `<module>.<part>` tensors from the
    target's pack; `floats`, the checkpoint's other tensors (name -> tensor)."""

    def __init__(self, modules: dict[str, dict], quantized: dict[str, torch.Tensor], floats):
        self.modules, self.quantized, self.floats = modules, quantized, floats

    def module(self, name: str) -> dict:
        prefix = name + "."
        parts = {key[len(prefix):]: t for key, t in self.quantized.items() if key.rpartition(".")[0] == name}
        return constants(parts, self.modules[name], name)

    def stacked(self, prefix: str, experts: list[dict[str, str]], kind: str) -> dict:
        """Projection `kind` of every expert, its tensors stacked on a first axis (scales in f32 where
        the experts' differ), as constants named `<prefix>.<kind>.<part>`."""
        source, rows = stacked_kinds(experts, self.modules)[kind]
        per = [{key.rpartition(".")[2]: t for key, t in self.quantized.items() if key.rpartition(".")[0] == e[source]} for e in experts]
        if rows is not None:
            per = [{part: t[rows[0]:rows[1]] for part, t in p.items()} for p in per]
        if len({p["scales"].dtype for p in per}) > 1:
            per = [dict(p, scales=p["scales"].float()) for p in per]
        tensors = {part: torch.stack([p[part] for p in per]) for part in per[0]}
        return constants(tensors, stacked_meta(experts, self.modules, kind), f"{prefix}.{kind}", len(experts))

    def has_float(self, name: str) -> bool:
        return name in self.floats

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.floats[name]


class IRWeights:
    """The graph's weight constants from an artifact's IR files, without OpenVINO reading them: each
    Const layer found by name in the parsed .xml, its element type and shape pinned by what the
    manifest and config.json say the graph reads (`expected`), its bytes mapped from the .bin within
    bounds. A constant that is missing or does not fit raises ValueError, naming it. (Its element
    type and shape, checked first, bound what is read: a constant may hold no more than the model
    needs.)"""

    def __init__(self, root, bin_path: Path, modules: dict[str, dict]):
        self.named = {layer.get("name"): layer for layer in root.iter("layer") if layer.get("type") == "Const"}
        self.bin = np.memmap(bin_path, dtype=np.uint8, mode="r") if Path(bin_path).stat().st_size else np.zeros(0, np.uint8)
        self.modules = modules

    def _constant(self, name: str, types: tuple[str, ...], want: list[int], stored: str | None = None):
        """The constant `name`, read from the IR's constant `stored` (default: the same name)."""
        import openvino as ov

        layer = self.named.get(stored or name)
        data = None if layer is None else layer.find("data")
        if data is None:
            raise ValueError(f"no constant {name!r}, which the graph reads")
        kind, shape = data.get("element_type"), [int(d) for d in data.get("shape", "").split(",") if d.strip() and d.strip().isdigit()]
        if kind not in types or shape != want:
            raise ValueError(f"constant {name!r} is {kind} {shape}, where the graph reads {'/'.join(types)} {want}")
        offset, size = int(data.get("offset", -1)), int(data.get("size", -1))
        element = getattr(ov.Type, kind)  # one of `expected`'s names, which are OpenVINO's
        if offset < 0 or size != (int(np.prod(shape, dtype=np.int64)) * element.bitwidth + 7) // 8 or offset + size > len(self.bin):
            raise ValueError(f"constant {name!r}: offset {offset} and size {size} do not fit its {kind} {shape} in the .bin")
        c = ov.op.Constant(ov.Tensor(np.ascontiguousarray(self.bin[offset:offset + size]), ov.Shape(shape), element), shared_memory=True)
        c.set_friendly_name(name)
        return c

    def module(self, name: str) -> dict:
        meta = self.modules[name]
        required = {"weight", "scales"} | ({"zeros"} if not meta["sym"] else set()) | ({"perm"} if meta["act_order"] else set())
        stored = {"perm": f"{meta['perm_of']}.perm"} if "perm_of" in meta else {}
        parts = {part: self._constant(f"{name}.{part}", *expected(name, part, meta), stored.get(part))
                 for part in PARTS if part in required or f"{name}.{part}" in self.named}
        if "perm" in parts and not np.array_equal(np.sort(parts["perm"].get_data()), np.arange(meta["in_features"])):
            raise ValueError(f"constant {name + '.perm'!r} is not a permutation of its {meta['in_features']} inputs")
        return parts

    def stacked(self, prefix: str, experts: list[dict[str, str]], kind: str) -> dict:
        meta = stacked_meta(experts, self.modules, kind)
        parts = ("weight", "scales") if meta["sym"] else ("weight", "zeros", "scales")
        return {part: self._constant(f"{prefix}.{kind}.{part}", *expected(prefix, part, meta, len(experts))) for part in parts}

    def has_float(self, name: str) -> bool:
        return name in self.named

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The float tensor `name` of the model's `shape`, as stored in the IR (narrow_floats)."""
        c = self._constant(name, FLOATS, list(shape))
        data = torch.from_numpy(c.get_data().copy()) if c.get_element_type().get_type_name() != "bf16" else \
            torch.from_numpy(np.frombuffer(c.get_data().tobytes(), np.int16).copy()).view(torch.bfloat16)
        return data.reshape(shape)


FLOATS = ("f16", "bf16", "f32")  # float_storage's choices


def expected(module: str, part: str, meta: dict, experts: int | None = None) -> tuple[tuple[str, ...], list[int]]:
    """The element types and shape the graph reads a quantized module's constant `part` as, from its
    manifest metadata (targets/openvino.py's pack); `experts`: that many modules' stacked."""
    N, G, bits, sym = meta["out_features"], meta["groups"], meta["bits"], meta["sym"]
    gs, lead = meta["padded_in"] // G, [experts] if experts else []
    width = "4" if bits == 4 else "8"
    return {"weight": ((("i" if sym else "u") + width,), [*lead, N, G, gs]), "zeros": (("u" + width,), [*lead, N, G, 1]),
            "scales": (FLOATS, [*lead, N, G, 1]), "perm": (("i64",), [meta["in_features"]]), "bias": (FLOATS, [N])}[part]


def export(config: dict, modules: dict[str, dict], weights) -> object:
    """The stateful decoder as an ov.Model; `weights` (TensorWeights or IRWeights) gives each quantized module's constants and the float tensors."""
    import openvino as ov
    import openvino.opset13 as ops
    import openvino.opset15 as opset15
    from openvino.frontend.pytorch import ConversionExtension, ModuleExtension
    from openvino.frontend.pytorch.ts_decoder import TorchScriptPythonDecoder

    from quantprep.targets.openvino import linear

    with quiet():
        model, names = skeleton(config, modules)
    loaded = load_floats(model, weights)
    experts = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    from transformers.activations import ACT2FN

    silu = (nn.SiLU, type(ACT2FN["silu"]))
    for m in experts:  # the torch path runs the config's activation; the graph writes SiLU
        if not isinstance(m.act_fn, silu):
            raise ValueError(f"experts with activation {type(m.act_fn).__name__} are not converted; build the cpu target for this model")
    for i, m in enumerate(experts):
        m.graph_index = i
    tiled = tiled_experts_of(modules)

    def linear_of(module: GraphLinear, x):
        name = names[module.index]
        return linear(x, weights.module(name), modules[name])

    def convert_linear(context):
        module = graph_linears[int(context.get_values_from_const_input(1))]
        return [linear_of(module, context.get_input(0)).output(0)]

    def convert_experts(context):
        m = experts[int(context.get_values_from_const_input(3))]
        x, index, routing = context.get_input(0), context.get_input(1), context.get_input(2)
        shape = ops.shape_of(x, "i64")
        x = ops.reshape(x, _i64([-1, m.hidden_dim]), False)
        parts = [{k: v for k, v in m._modules[str(e)]._modules.items() if isinstance(v, GraphLinear)} for e in range(m.num_experts)]
        prefix = expert_linear(names[parts[0]["down_proj"].index]).experts
        if prefix in tiled:
            out = tiled_experts(x, index, routing, prefix, tiled[prefix], weights, modules)
        else:
            out = ops.broadcast(ops.constant(np.float32(0)), ops.shape_of(x, "i64"))
            for e in range(m.num_experts):
                mask = ops.equal(index, ops.convert(ops.constant(np.int64(e)), index.get_element_type()))
                tokens, y = expert_subgraph(x, mask, routing, linear_of, parts[e], m.intermediate_dim)
                out = opset15.scatter_nd_update(out, ops.unsqueeze(tokens, _i64(-1)), y, "sum")
        return [ops.reshape(out, shape, False).output(0)]

    graph_linears = {m.index: m for m in model.modules() if isinstance(m, GraphLinear)}
    extensions = [
        ModuleExtension(GraphLinear, LINEAR_OP, evaluate=lambda m, x, index: m(x), convert=lambda m, op, x: op(x, torch.tensor(m.index))),
        ModuleExtension(QuantizedExperts, EXPERTS_OP, evaluate=lambda m, h, i, w, index: torch.zeros_like(h),
                        convert=lambda m, op, h, i, w: op(h, i, w, torch.tensor(m.graph_index))),
        ConversionExtension(LINEAR_OP, convert_linear), ConversionExtension(EXPERTS_OP, convert_experts),
    ]
    floats = {name: t for name, t in list(model.named_parameters()) + list(model.named_buffers()) if name in loaded}
    with torch.no_grad(), quiet():
        example = example_inputs(model)
        wrapped = WithCache(model, len(example) - 3, list(floats))
        # the tracer's own check re-runs the trace with the float tensors swapped back: it cannot compare
        traced = TorchScriptPythonDecoder(wrapped, example_input=(*example, *floats.values()), trace_kwargs={"check_trace": False},
                                          module_extensions={e.module: e for e in extensions if isinstance(e, ModuleExtension)})
        converted = ov.convert_model(traced, extension=[e for e in extensions if isinstance(e, ConversionExtension)])
    del wrapped, model
    constants_for(converted, floats)
    return stateful(additive_masks(converted), [tuple(t.shape) for t in example[3:]])


def constants_for(model, floats: dict[str, torch.Tensor]) -> None:
    """The trace's last inputs, one per float tensor, made constants again: each named as its tensor
    and stored in the narrowest float type that holds it exactly (targets/openvino.float_constant:
    checkpoints keep their floats in f16 or bf16; the IR need not hold them twice as large)."""
    import openvino as ov
    import openvino.opset13 as ops

    from quantprep.targets.openvino import float_constant

    inputs = model.get_parameters()
    if len(inputs) < len(floats):
        raise ValueError(f"the converted graph has {len(inputs)} inputs, fewer than its {len(floats)} float tensors")
    for parameter, (name, t) in zip(inputs[len(inputs) - len(floats):], floats.items(), strict=True):
        c = float_constant(t, name)
        value = c if c.get_element_type() == ov.Type.f32 else ops.convert(c, ov.Type.f32)
        for consumer in parameter.output(0).get_target_inputs():
            consumer.replace_source_output(value.output(0))
        model.remove_parameter(parameter)
    model.validate_nodes_and_infer_types()


@contextlib.contextmanager
def quiet():
    """No warnings from the trace: it warns of every Python branch on a tensor in transformers'
    modeling (the choices it keeps are the ones every input takes: traced_problem refuses the rest),
    and of its own deprecation."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)


def example_inputs(model: nn.Module) -> tuple[torch.Tensor, ...]:
    """A batch of 2 sequences of 3 new tokens after 2 cached ones: no dimension is 1, so the
    trace specializes none of them."""
    batch, new, cached = 2, 3, 2
    ids = torch.ones(batch, cached, dtype=torch.int64)
    with torch.no_grad():
        present = WithCache(model, 0, [])(ids, torch.ones(batch, cached, dtype=torch.int64), torch.arange(cached).expand(batch, -1))[1:]
    past = tuple(torch.zeros(t.shape) for t in present)
    positions = torch.arange(cached, cached + new).expand(batch, -1)
    return (torch.ones(batch, new, dtype=torch.int64), torch.ones(batch, cached + new, dtype=torch.int64), positions, *past)


def additive_masks(model):
    """Each attention's boolean mask (transformers' SDPA mask) as the additive f32 mask it means: the
    CPU plugin's attention took several times as long with the boolean one (Qwen2.5-1.5B's shapes, a
    prefill of 512 tokens; docs/openvino.md)."""
    import openvino as ov
    import openvino.opset13 as ops

    made = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() == "ScaledDotProductAttention" and op.get_input_size() > 3 and op.input(3).get_element_type() == ov.Type.boolean:
            source = op.input(3).get_source_output()
            key = (source.get_node().get_friendly_name(), source.get_index())
            if key not in made:
                made[key] = ops.select(source, ops.constant(np.float32(0)), ops.constant(np.float32(np.finfo(np.float32).min))).output(0)
            op.input(3).replace_source_output(made[key])
    model.validate_nodes_and_infer_types()
    return model


def stateful(model, cache_shapes: list[tuple[int, ...]]):
    """optimum-intel's recipe: inputs and outputs named as genai reads them, a Gather by beam_idx on
    each cache input, the cache inputs and outputs made state, each state initialised empty for the
    batch of input_ids. `cache_shapes`: each cache input's [batch, heads, tokens, head size] as traced."""
    import openvino as ov
    import openvino.opset13 as ops
    from openvino._offline_transformations import apply_make_stateful_transformation

    caches = len(cache_shapes)
    inputs = ["input_ids", "attention_mask", "position_ids"] + [f"past_key_values.{i // 2}.{('key', 'value')[i % 2]}" for i in range(caches)]
    outputs = ["logits"] + [f"present.{i // 2}.{('key', 'value')[i % 2]}" for i in range(caches)]
    for port, name in zip(model.inputs, inputs, strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, outputs, strict=True):
        port.get_tensor().set_names({name})
    beam_idx = ops.parameter([-1], ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    for parameter, (_, heads, _, size) in zip(model.get_parameters()[3:], cache_shapes, strict=True):
        parameter.set_partial_shape(ov.PartialShape([-1, heads, -1, size]))  # the state's fixed dimensions
        consumers = parameter.output(0).get_target_inputs()
        reordered = ops.gather(parameter, beam_idx, _i64(0))
        for consumer in consumers:
            consumer.replace_source_output(reordered.output(0))
    model.add_parameters([beam_idx])
    model.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(model, dict(zip(inputs[3:], outputs[1:], strict=True)))
    batch = ops.gather(ops.shape_of(model.input("input_ids"), "i64"), _i64([0]), _i64(0))
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":
            dims = [batch] + [_i64([d.get_length() if d.is_static else 0]) for d in list(op.get_output_partial_shape(0))[1:]]
            op.set_arguments([ops.broadcast(ops.constant(np.float32(0)), ops.concat(dims, 0))])
    model.validate_nodes_and_infer_types()
    model.set_friendly_name("quantprep_decoder")  # else a per-process counter's
    return model


# --- the check at load: the artifact's IR against the one this code makes from the IR's own data ---

def size_problem(config: dict) -> str | None:
    """A size in config.json (or a config inside it) past any model (MAX_SIZE), named, or None:
    transformers would build, and the trace run, whatever sizes the config gives."""
    from quantprep.format.model_config import MAX_SIZE

    for key, value in config.items():
        if key == "quantization_config":  # the checkpoint's, which the model is not built from
            continue
        if isinstance(value, dict):
            if problem := size_problem(value):
                return f"{key}.{problem}"
            continue
        sized = key.endswith(("_size", "_dim", "_rank", "_heads", "_layers", "_experts", "_window", "_position_embeddings")) \
            or key.startswith(("num_", "n_"))
        if sized and value is not None and not isinstance(value, (list, bool)) and (type(value) is not int or not 0 <= value <= MAX_SIZE):
            return f"{key}={value!r} is not a size up to {MAX_SIZE}"
    return None


LAYER = re.compile(r"model\.layers\.([0-9]+)\.")
EXPERT = re.compile(r"\.experts\.([0-9]+)\.")
EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts")


def shape_problem(config: dict, modules: dict[str, dict], names: set[str]) -> str | None:
    """What the config or manifest says that the artifact does not hold, before anything is built
    from them: a model as deep as the layers the IR and manifest name (a deeper one would be built
    whole before its first missing weight), as many experts as they name, and each quantized
    module's metadata whole and bounded. `names`: the IR's constant names."""
    from quantprep.format.model_config import MAX_SIZE

    layers = {int(m.group(1)) for n in (*names, *modules) if (m := LAYER.match(n))}
    if config.get("num_hidden_layers") != len(layers) or layers != set(range(len(layers))):
        return f"num_hidden_layers={config.get('num_hidden_layers')!r}, where its weights name {len(layers)} layers"
    experts = {int(m.group(1)) for n in modules if (m := EXPERT.search(n))}
    for key in EXPERT_COUNTS:
        if key in config and experts and config[key] != max(experts) + 1:
            return f"{key}={config[key]!r}, where manifest.json names {max(experts) + 1} experts"

    def size(v) -> bool:
        return type(v) is int and 0 < v <= MAX_SIZE

    for name, meta in modules.items():
        if not (isinstance(meta, dict) and all(size(meta.get(k)) for k in ("in_features", "out_features", "groups", "padded_in"))
                and meta.get("bits") in (4, 8) and type(meta.get("sym")) is bool and type(meta.get("act_order")) is bool
                and type(meta.get("bias")) is bool and meta["padded_in"] % meta["groups"] == 0 and meta["padded_in"] >= meta["in_features"]):
            return f"module {name} in manifest.json: its metadata is not the openvino target's"
        if "perm_of" in meta and not (meta["act_order"] and isinstance(other := modules.get(meta["perm_of"]), dict)
                                      and other.get("act_order") is True and "perm_of" not in other
                                      and other.get("in_features") == meta["in_features"]):
            return f"module {name} in manifest.json: its perm_of names no act-order module of its {meta['in_features']} inputs"
    return None


def rebuilt_difference(config: dict, modules: dict[str, dict], root, bin_path: Path, bin_sha256: str, scratch: Path) -> str | None:
    """How an artifact's IR (its parsed .xml `root`, its .bin, whose sha256 the manifest gave) differs
    from the IR this code makes from the artifact's config.json, manifest and that IR's own constants,
    or None. OpenVINO never reads the artifact's files here: the constants are mapped by IRWeights,
    the graph is made (`export`), written to `scratch` as prepack writes it, and compared as text and bytes."""
    from quantprep.targets.openvino import ir_difference, saved_ir

    weights = IRWeights(root, bin_path, modules)  # held until written: the constants share its mapped .bin
    if problem := size_problem(config) or traced_problem(config) or shape_problem(config, modules, set(weights.named)):
        return problem
    try:
        tiled = tiled_experts_of(modules)
        stacked = {name for experts in tiled.values() for e in experts for name in e.values()}
        for name in modules:  # each module's constants there, of its type and shape, before the trace reads them
            if name not in stacked:
                weights.module(name)
        for prefix, experts in tiled.items():
            for kind in stacked_kinds(experts, modules):
                weights.stacked(prefix, experts, kind)
        want = export(config, modules, weights)
    except ValueError as e:  # a constant missing or of another type or shape
        return str(e).strip().splitlines()[0][:300]
    except Exception as e:  # transformers and OpenVINO refuse what an artifact's config.json may say in many kinds
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:200]}"
    want_root, want_bin = saved_ir(want, scratch)
    del want, weights
    return ir_difference(want_root, want_bin, root, bin_sha256)
