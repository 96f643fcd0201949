"""The openvino target's graph: a stateful decoder in OpenVINO IR around the GPTQ integers, built
from its weights by quantprep's code, at prepack and again at load.

The graph follows what openvino.genai's LLMPipeline expects (its own GGUF reader builds the same,
src/cpp/src/gguf_utils/): inputs input_ids, attention_mask, position_ids [batch, tokens] i64 and
beam_idx [batch] i32; output `logits` [batch, tokens, vocab]; per layer the keys and values as
state (ReadValue -> Gather(beam_idx) -> Concat -> Assign, f32 [batch, kv_heads, tokens, head_dim]).
Llama and Qwen2 (SmolLM2, Qwen2.5): embeddings, RMSNorm, RoPE (rotate_half, the default type),
GQA attention through ScaledDotProductAttention with an explicit causal mask, SiLU-gated MLP, tied
or separate lm_head. The quantized Linears are targets/openvino.py's; everything else is the
checkpoint's float tensors, kept in their stored f16/bf16 and converted to f32 in the graph.
Anything else is refused in one line before any work (`check_supported`).

An IR is a program: OpenVINO runs whatever graph it reads, and its reader already evaluates constant
subgraphs as it infers shapes. So a load never hands an artifact's IR to OpenVINO as it comes:
`rebuilt_difference` builds the graph again from the IR's own weight constants (found by name in the
.xml that Python's parser read, types and shapes pinned by the manifest and config, bytes mapped from
the .bin: `IRWeights`), writes it as prepack does, and compares the two as text and bytes. Only an
IR equal to what this code writes runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from quantprep.targets.openvino import PARTS, constants, float_storage, linear

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
MAX_SIZE = 1 << 20  # any one dimension of a config: far above real models, small enough that no array of it exhausts memory


def rope_theta(config: dict) -> float:
    return float((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0)))


def positive(value, kind=int) -> bool:
    return isinstance(value, kind if kind is not float else (int, float)) and not isinstance(value, bool) and value > 0


def check_supported(config: dict, where, error: type[Exception]) -> None:
    """One line (`error`) naming the config.json field that this graph does not build."""
    def refuse(field: str, value, why: str) -> None:
        raise error(f"{where}: {field}={value!r}: {why}; the openvino target builds Llama and Qwen2 decoders "
                          "(docs/openvino.md): use the cpu target for this model")

    if config.get("model_type") not in ARCHITECTURES:
        refuse("model_type", config.get("model_type"), "not an architecture the openvino target builds")
    for field in ("rope_parameters", "rope_scaling"):  # transformers 5 names it the first, older configs the second
        params = config.get(field) or {}
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            refuse(field, params, "only one RoPE for every layer is built")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            refuse(f"{field}.rope_type", kind, "only the default RoPE is built")
    if not positive(rope_theta(config), float):
        refuse("rope_theta", rope_theta(config), "must be a positive number")
    if config.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", config.get("hidden_act"), "only SiLU-gated MLPs are built")
    if config.get("use_sliding_window"):
        refuse("use_sliding_window", True, "sliding-window attention is not built")
    if config.get("mlp_bias"):
        refuse("mlp_bias", True, "MLP biases are not built")
    for field in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size"):
        if not positive(config.get(field)) or config[field] > MAX_SIZE:
            refuse(field, config.get(field), f"must be a positive integer up to {MAX_SIZE}")
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if not positive(kv) or heads % kv:
        refuse("num_key_value_heads", kv, f"must divide num_attention_heads={heads}")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if not positive(head_dim) or head_dim % 2 or head_dim > MAX_SIZE:
        refuse("head_dim", head_dim, "must be a positive even integer (RoPE rotates halves)")
    if not positive(config.get("rms_norm_eps", 1e-6), float):
        refuse("rms_norm_eps", config.get("rms_norm_eps"), "must be a positive number")
    if config.get("attention_bias") and config.get("model_type") == "llama":
        refuse("attention_bias", True, "Llama attention biases are not built")


def _i64(values) -> object:
    import openvino.opset13 as ops

    return ops.constant(np.array(values, dtype=np.int64))


class TensorWeights:
    """The graph's constants from tensors (prepack): `quantized`, `<module>.<part>` tensors from the
    target's pack; `floats`, the checkpoint's other tensors (name -> tensor)."""

    def __init__(self, modules: dict[str, dict], quantized: dict[str, torch.Tensor], floats):
        self.modules, self.quantized, self.floats = modules, quantized, floats

    def module(self, name: str) -> dict:
        prefix = name + "."
        parts = {key[len(prefix):]: t for key, t in self.quantized.items() if key.rpartition(".")[0] == name}
        return constants(parts, self.modules[name], name)

    def has_float(self, name: str) -> bool:
        return name in self.floats

    def tensor(self, name: str) -> torch.Tensor:
        return self.floats[name]

    def float(self, name: str):
        """A Constant in the narrowest float type that holds the tensor exactly, named `name`."""
        import openvino as ov

        t = float_storage(self.floats[name])
        if t.dtype == torch.bfloat16:
            c = ov.op.Constant(ov.Tensor(np.ascontiguousarray(t.view(torch.int16).numpy()).view(np.uint16),
                                         ov.Shape(list(t.shape)), ov.Type.bf16), shared_memory=False)
        else:
            c = ov.op.Constant(ov.Tensor(np.ascontiguousarray(t.numpy())), shared_memory=False)
        c.set_friendly_name(name)
        return c


class IRWeights:
    """The graph's weight constants from an artifact's IR files, without OpenVINO reading them: each
    Const layer found by name in the parsed .xml, its element type and shape pinned by what the
    manifest and config.json say the graph reads (`expected`), its bytes mapped from the .bin within
    bounds. A constant that is missing or does not fit raises ValueError, naming it."""

    def __init__(self, root, bin_path: Path, config: dict, modules: dict[str, dict]):
        self.named = {layer.get("name"): layer for layer in root.iter("layer") if layer.get("type") == "Const"}
        self.bin = np.memmap(bin_path, dtype=np.uint8, mode="r") if Path(bin_path).stat().st_size else np.zeros(0, np.uint8)
        self.config, self.modules = config, modules

    def _constant(self, name: str):
        import openvino as ov

        layer = self.named.get(name)
        data = None if layer is None else layer.find("data")
        if data is None:
            raise ValueError(f"no constant {name!r}, which the graph reads")
        kind, shape = data.get("element_type"), [int(d) for d in data.get("shape", "").split(",") if d.strip()]
        types, want = expected(name, self.config, self.modules)
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
        return {part: self._constant(f"{name}.{part}") for part in PARTS if f"{name}.{part}" in self.named}

    def has_float(self, name: str) -> bool:
        return name in self.named

    def float(self, name: str):
        return self._constant(name)


FLOATS = ("f16", "bf16", "f32")  # float_storage's choices


def expected(name: str, config: dict, modules: dict[str, dict]) -> tuple[tuple[str, ...], list[int]]:
    """The element types and shape the graph reads constant `name` as: a quantized module's part
    from its manifest metadata (targets/openvino.py's pack), a float tensor from config.json."""
    module, _, part = name.rpartition(".")
    if module in modules:
        meta = modules[module]
        N, G, bits, sym = meta["out_features"], meta["groups"], meta["bits"], meta["sym"]
        gs = meta["padded_in"] // G
        width = "4" if bits == 4 else "8"
        return {"weight": ((("i" if sym else "u") + width,), [N, G, gs]), "zeros": (("u" + width,), [N, G, 1]),
                "scales": (FLOATS, [N, G, 1]), "perm": (("i64",), [meta["in_features"]]), "bias": (FLOATS, [N])}.get(part, ((), []))
    H, V, inter = config["hidden_size"], config["vocab_size"], config.get("intermediate_size")
    heads = config["num_attention_heads"]
    D = config.get("head_dim") or H // heads
    q, kv = heads * D, (config.get("num_key_value_heads") or heads) * D
    linears = {"q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H), "o_proj": (H, q), "gate_proj": (inter, H), "up_proj": (inter, H),
               "down_proj": (H, inter)}
    leaf = name.split(".")
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return FLOATS, [V, H]
    if name == "model.norm.weight" or leaf[-2:-1] in (["input_layernorm"], ["post_attention_layernorm"]):
        return FLOATS, [H]
    if len(leaf) >= 2 and leaf[-2] in linears:
        out, inp = linears[leaf[-2]]
        return FLOATS, [out, inp] if leaf[-1] == "weight" else [out]
    return (), []


def decoder(config: dict, modules: dict[str, dict], weights) -> object:
    """The stateful decoder as an ov.Model; `weights`: TensorWeights or IRWeights."""
    import openvino as ov
    import openvino.opset13 as ops
    from openvino.op.util import Variable, VariableInfo

    H, layers = config["num_attention_heads"], config["num_hidden_layers"]
    hkv = config.get("num_key_value_heads") or H
    D = config.get("head_dim") or config["hidden_size"] // H
    eps = float(config.get("rms_norm_eps", 1e-6))

    def const_f32(name: str):
        c = weights.float(name)
        return c if c.get_element_type() == ov.Type.f32 else ops.convert(c, ov.Type.f32)

    def proj(x, parent: str, children: tuple[str, ...], fused: str | None):
        """The outputs of parent.<child> for each child: one fused matmul split, or one each."""
        if fused and f"{parent}.{fused}" in modules:
            name = f"{parent}.{fused}"
            meta = modules[name]
            y = linear(x, weights.module(name), meta)
            split = ops.variadic_split(y, _i64(-1), _i64(meta["fused"]["sizes"]))
            return [split.output(i) for i in range(len(children))]
        outs = []
        for child in children:
            name = f"{parent}.{child}" if parent else child
            if name in modules:
                outs.append(linear(x, weights.module(name), modules[name]))
            elif weights.has_float(f"{name}.weight"):  # a Linear the checkpoint left in float
                y = ops.matmul(x, const_f32(f"{name}.weight"), False, True)
                outs.append(ops.add(y, const_f32(f"{name}.bias")) if weights.has_float(f"{name}.bias") else y)
            else:
                raise ValueError(f"no constant {name + '.weight'!r}, which the graph reads")
        return outs

    def rms(x, name: str):
        var = ops.reduce_mean(ops.multiply(x, x), _i64([-1]), True)
        inv = ops.divide(ops.constant(np.float32(1.0)), ops.sqrt(ops.add(var, ops.constant(np.float32(eps)))))
        return ops.multiply(ops.multiply(x, inv), const_f32(name))

    def heads(t, n: int):  # [B, L, n * D] -> [B, n, L, D]
        return ops.transpose(ops.reshape(t, _i64([0, 0, n, D]), True), _i64([0, 2, 1, 3]))

    def rotate_half(x):
        x1 = ops.slice(x, _i64([0]), _i64([D // 2]), _i64([1]), _i64([3]))
        x2 = ops.slice(x, _i64([D // 2]), _i64([D]), _i64([1]), _i64([3]))
        return ops.concat([ops.negative(x2), x1], -1)

    params = [ops.parameter([-1, -1], ov.Type.i64, name="input_ids"), ops.parameter([-1, -1], ov.Type.i64, name="attention_mask"),
              ops.parameter([-1, -1], ov.Type.i64, name="position_ids"), ops.parameter([-1], ov.Type.i32, name="beam_idx")]
    for p in params:
        p.output(0).get_tensor().set_names({p.get_friendly_name()})
    input_ids, attention_mask, position_ids, beam_idx = params

    embed = const_f32("model.embed_tokens.weight")
    h = ops.gather(embed, input_ids, ops.constant(np.int32(0)))
    batch = ops.gather(ops.shape_of(input_ids, ov.Type.i64), _i64([0]), _i64(0))
    q_len = ops.gather(ops.shape_of(input_ids, ov.Type.i64), _i64(1), _i64(0))
    kv_len = ops.gather(ops.shape_of(attention_mask, ov.Type.i64), _i64(1), _i64(0))

    # RoPE: inv_freq x position_ids -> cos/sin [B, 1, L, D] (transformers' default rotary embedding)
    inv_freq = (1.0 / rope_theta(config) ** (np.arange(0, D, 2, dtype=np.float64) / D)).astype(np.float32).reshape(1, -1, 1)
    inv = ops.broadcast(ops.constant(inv_freq), ops.concat([batch, _i64([1]), _i64([1])], 0), broadcast_spec="BIDIRECTIONAL")
    freqs = ops.transpose(ops.matmul(inv, ops.convert(ops.unsqueeze(position_ids, _i64(1)), ov.Type.f32), False, False), _i64([0, 2, 1]))
    angles = ops.concat([freqs, freqs], -1)
    cos, sin = ops.unsqueeze(ops.cos(angles), _i64(1)), ops.unsqueeze(ops.sin(angles), _i64(1))

    # mask [B, 1, L, S]: query i sits at kv_len - q_len + i, sees keys up to it that attention_mask keeps
    kpos = ops.range(_i64(0), kv_len, _i64(1), ov.Type.i64)
    qpos = ops.reshape(ops.range(ops.subtract(kv_len, q_len), kv_len, _i64(1), ov.Type.i64), _i64([-1, 1]), False)
    allowed = ops.logical_and(ops.less_equal(kpos, qpos), ops.unsqueeze(ops.not_equal(attention_mask, _i64(0)), _i64([1, 2])))
    mask = ops.select(allowed, ops.constant(np.float32(0)), ops.constant(np.float32(np.finfo(np.float32).min)))

    sinks = []
    for i in range(layers):
        pf = f"model.layers.{i}"
        x = rms(h, f"{pf}.input_layernorm.weight")
        q, k, v = proj(x, f"{pf}.self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj")
        q, k, v = heads(q, H), heads(k, hkv), heads(v, hkv)
        q = ops.add(ops.multiply(q, cos), ops.multiply(rotate_half(q), sin))
        k = ops.add(ops.multiply(k, cos), ops.multiply(rotate_half(k), sin))
        kv = []
        for kind, cur in (("key", k), ("value", v)):
            info = VariableInfo()
            info.variable_id, info.data_shape, info.data_type = f"past_key_values.{i}.{kind}", ov.PartialShape([-1, hkv, -1, D]), ov.Type.f32
            var = Variable(info)
            empty = ops.broadcast(ops.constant(np.float32(0)), ops.concat([batch, _i64([hkv]), _i64([0]), _i64([D])], 0))
            present = ops.concat([ops.gather(ops.read_value(empty, var), beam_idx, _i64(0)), cur], 2)
            sinks.append(ops.assign(present, var))
            if H != hkv:  # GQA: [B, hkv, S, D] -> [B, H, S, D]
                present = ops.broadcast(ops.unsqueeze(present, _i64(2)), _i64([1, 1, H // hkv, 1, 1]), broadcast_spec="BIDIRECTIONAL")
                present = ops.reshape(present, _i64([0, H, -1, D]), True)
            kv.append(present)
        att = ops.scaled_dot_product_attention(q, kv[0], kv[1], mask, causal=False)
        att = ops.reshape(ops.transpose(att, _i64([0, 2, 1, 3])), _i64([0, 0, H * D]), True)
        [o] = proj(att, f"{pf}.self_attn", ("o_proj",), None)
        h = ops.add(h, o)
        x = rms(h, f"{pf}.post_attention_layernorm.weight")
        gate, up = proj(x, f"{pf}.mlp", ("gate_proj", "up_proj"), "gate_up_proj")
        [down] = proj(ops.multiply(ops.swish(gate), up), f"{pf}.mlp", ("down_proj",), None)
        h = ops.add(h, down)
    h = rms(h, "model.norm.weight")
    # the head as transformers (and quantprep's load) chooses it: quantized, else tied to the
    # embedding (a stored lm_head.weight is then ignored), else the float lm_head (check_floats)
    if "lm_head" in modules:
        [logits] = proj(h, "", ("lm_head",), None)
    elif config["tie_word_embeddings"]:
        logits = ops.matmul(h, embed, False, True)
    else:
        logits = ops.matmul(h, const_f32("lm_head.weight"), False, True)
    logits.output(0).get_tensor().set_names({"logits"})
    result = ops.result(logits)
    result.set_friendly_name("logits")
    return ov.Model([result], sinks, params, "quantprep_decoder")


def rebuilt_difference(config: dict, modules: dict[str, dict], root, bin_path: Path, bin_sha256: str, scratch: Path) -> str | None:
    """How an artifact's IR (its parsed .xml `root`, its .bin, whose sha256 the manifest gave) differs
    from the IR this code writes from that IR's own weight constants, or None. OpenVINO never reads
    the artifact's files here: the graph is built from bytes mapped by IRWeights, written to
    `scratch` as prepack writes it, and compared as text and bytes."""
    from quantprep.targets.openvino import ir_difference, saved_ir

    try:
        weights = IRWeights(root, bin_path, config, modules)  # held until written: the constants share its mapped .bin
        want = decoder(config, modules, weights)
    except ValueError as e:
        return str(e)
    except RuntimeError as e:  # OpenVINO's shape checks on the graph it built here
        return f"its constants do not fit the graph ({str(e).strip().splitlines()[-1][:200]})"
    want_root, want_bin = saved_ir(want, scratch)
    del want, weights
    return ir_difference(want_root, want_bin, root, bin_sha256)
