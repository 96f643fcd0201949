"""The openvino target's artifact: a stateful decoder in OpenVINO IR around the GPTQ integers.

The graph follows what openvino.genai's LLMPipeline expects (its own GGUF reader builds the same,
src/cpp/src/gguf_utils/): inputs input_ids, attention_mask, position_ids [batch, tokens] i64 and
beam_idx [batch] i32; output `logits` [batch, tokens, vocab]; per layer the keys and values as
state (ReadValue -> Gather(beam_idx) -> Concat -> Assign, f32 [batch, kv_heads, tokens, head_dim]).
Llama and Qwen2 (SmolLM2, Qwen2.5): embeddings, RMSNorm, RoPE (rotate_half, the default type),
GQA attention through ScaledDotProductAttention with an explicit causal mask, SiLU-gated MLP, tied
or separate lm_head. The quantized Linears are targets/openvino.py's; everything else is the
checkpoint's float tensors, kept in their stored f16/bf16 and converted to f32 in the graph.
Anything else is refused in one line before any work (`check_supported`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from quantprep._io.jsonfile import read_json_object
from quantprep.errors import SourceError
from quantprep.format.artifact import OPENVINO_MODEL, OPENVINO_TOKENIZERS, ArtifactWriter
from quantprep.targets.openvino import constants, float_storage, linear

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def rope_theta(config: dict) -> float:
    return float((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0)))


def positive(value, kind=int) -> bool:
    return isinstance(value, kind if kind is not float else (int, float)) and not isinstance(value, bool) and value > 0


def check_supported(config: dict, where: Path) -> None:
    """One line naming the config.json field that this graph does not build."""
    def refuse(field: str, value, why: str) -> None:
        raise SourceError(f"{where}: {field}={value!r}: {why}; the openvino target builds Llama and Qwen2 decoders "
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
    for field in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if not positive(config.get(field)):
            refuse(field, config.get(field), "must be a positive integer")
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if not positive(kv) or heads % kv:
        refuse("num_key_value_heads", kv, f"must divide num_attention_heads={heads}")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if not positive(head_dim) or head_dim % 2:
        refuse("head_dim", head_dim, "must be a positive even integer (RoPE rotates halves)")
    if not positive(config.get("rms_norm_eps", 1e-6), float):
        refuse("rms_norm_eps", config.get("rms_norm_eps"), "must be a positive number")
    if config.get("attention_bias") and config.get("model_type") == "llama":
        refuse("attention_bias", True, "Llama attention biases are not built")


def _i64(values) -> object:
    import openvino.opset13 as ops

    return ops.constant(np.array(values, dtype=np.int64))


def decoder(config: dict, modules: dict[str, dict], quantized: dict[str, torch.Tensor], floats) -> object:
    """The stateful decoder as an ov.Model. `quantized`: `<module>.<part>` tensors from the target's
    pack; `floats`: the checkpoint's other tensors (name -> tensor)."""
    import openvino as ov
    import openvino.opset13 as ops
    from openvino.op.util import Variable, VariableInfo

    H, layers = config["num_attention_heads"], config["num_hidden_layers"]
    hkv = config.get("num_key_value_heads") or H
    D = config.get("head_dim") or config["hidden_size"] // H
    eps = float(config.get("rms_norm_eps", 1e-6))

    def const_f32(name: str):
        t = float_storage(floats[name])
        if t.dtype == torch.bfloat16:
            c = ov.op.Constant(ov.Tensor(np.ascontiguousarray(t.view(torch.int16).numpy()).view(np.uint16),
                                         ov.Shape(list(t.shape)), ov.Type.bf16), shared_memory=False)
        else:
            c = ov.op.Constant(ov.Tensor(np.ascontiguousarray(t.numpy())), shared_memory=False)
        c.set_friendly_name(name)
        return c if t.dtype == torch.float32 else ops.convert(c, ov.Type.f32)

    def proj(x, parent: str, children: tuple[str, ...], fused: str | None):
        """The outputs of parent.<child> for each child: one fused matmul split, or one each."""
        if fused and f"{parent}.{fused}" in modules:
            name = f"{parent}.{fused}"
            meta = modules[name]
            y = linear(x, constants({p: quantized[f"{name}.{p}"] for p in _parts(quantized, name)}, meta, name), meta)
            split = ops.variadic_split(y, _i64(-1), _i64(meta["fused"]["sizes"]))
            return [split.output(i) for i in range(len(children))]
        outs = []
        for child in children:
            name = f"{parent}.{child}" if parent else child
            if name in modules:
                meta = modules[name]
                outs.append(linear(x, constants({p: quantized[f"{name}.{p}"] for p in _parts(quantized, name)}, meta, name), meta))
            elif f"{name}.weight" in floats:  # a Linear the checkpoint left in float
                y = ops.matmul(x, const_f32(f"{name}.weight"), False, True)
                outs.append(ops.add(y, const_f32(f"{name}.bias")) if f"{name}.bias" in floats else y)
            else:
                raise SourceError(f"tensor {name}.weight: missing from the checkpoint; re-export or re-quantize it")
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


def model_config(ckpt) -> dict:
    """config.json as read, with tie_word_embeddings as transformers resolves it (its default differs by model type)."""
    from transformers import AutoConfig

    config = read_config(ckpt.path)
    tied = AutoConfig.from_pretrained(ckpt.path, trust_remote_code=False).tie_word_embeddings
    return dict(config, tie_word_embeddings=bool(tied) and "lm_head" not in ckpt.layers)


def check_floats(ckpt) -> None:
    """Every float tensor the model needs (embeddings, norms, a float lm_head when not tied) is in the
    checkpoint with the shape its config gives: the graph would broadcast a wrong one silently."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt.path, trust_remote_code=False)
    config.__dict__.pop("quantization_config", None)
    if "lm_head" in ckpt.layers:
        config.tie_word_embeddings = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    for name, param in model.named_parameters():  # a tied lm_head is the embedding's: not listed
        if name.rpartition(".")[0] in ckpt.layers:
            continue
        if name not in ckpt.other_tensors:
            raise SourceError(f"tensor {name}: missing from the checkpoint, which the {config.model_type} model of its config.json "
                              "needs; re-export or re-quantize it")
        if ckpt.other_tensors.shape(name) != tuple(param.shape):
            raise SourceError(f"tensor {name}: {ckpt.other_tensors.shape(name)} in the checkpoint, the model of its config.json needs "
                              f"{tuple(param.shape)}; re-export or re-quantize it")


def check_tokenizer(path: Path) -> None:
    """The source's tokenizer loads (openvino-tokenizers converts it when the IR is written)."""
    from transformers import AutoTokenizer

    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return
    try:
        AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # transformers raises several kinds for a tokenizer it cannot build
        raise SourceError(f"{path / 'tokenizer_config.json'}: transformers cannot load this tokenizer ({type(e).__name__}: "
                          f"{str(e)[:200]}); fix or remove the tokenizer files") from None


def _parts(quantized: dict, name: str) -> list[str]:
    return [key[len(name) + 1:] for key in quantized if key.rpartition(".")[0] == name]


def write_tokenizers(src: Path, out: Path) -> list[str]:
    """openvino_tokenizer/_detokenizer.xml/.bin from the checkpoint's Hugging Face tokenizer
    (openvino-tokenizers; its chat template goes with it). No tokenizer in the source: none here."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    if not (src / "tokenizer.json").is_file() and not (src / "tokenizer_config.json").is_file():
        return []
    hf = AutoTokenizer.from_pretrained(src, trust_remote_code=False)
    try:
        tok, detok = convert_tokenizer(hf, with_detokenizer=True)
    except Exception as e:  # openvino-tokenizers raises several kinds for a tokenizer it cannot convert
        raise SourceError(f"{src / 'tokenizer.json'}: openvino-tokenizers cannot convert this tokenizer ({type(e).__name__}: "
                          f"{str(e)[:200]}); build another target for this model") from None
    ov.save_model(tok, out / "openvino_tokenizer.xml")
    ov.save_model(detok, out / "openvino_detokenizer.xml")
    return [name for name in OPENVINO_TOKENIZERS if (out / name).is_file()]


class OpenVINOWriter(ArtifactWriter):
    """An ArtifactWriter whose weights go into the IR, not shards: the packed modules are held (the
    int4 model's size) until `finish` builds the graph, saves it, and converts the tokenizer. The
    float tensors are read again from the checkpoint as stored (the stream hands them over in f32)."""

    def __init__(self, out: Path, ckpt, force: bool = False):
        super().__init__(out, ckpt.path, ckpt.side_files, ckpt.nbytes, force)
        self.ckpt, self.held = ckpt, {}

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        self.held.update({k: v for k, v in tensors.items() if not hasattr(v, "blocks")})  # StoredRows: a large float

    def finish(self, manifest: dict, probes: dict[str, torch.Tensor] | None = None) -> Path:
        import openvino as ov

        modules = manifest["modules"]
        quantized = {k: v for k, v in self.held.items() if k.rpartition(".")[0] in modules}
        self.held = {}
        model = decoder(model_config(self.ckpt), modules, quantized, self.ckpt.other_tensors)
        ov.save_model(model, self.tmp / OPENVINO_MODEL, compress_to_fp16=False)
        del model, quantized
        write_tokenizers(self.ckpt.path, self.tmp)
        return super().finish(manifest, probes, weights_index=False)


def read_config(path: Path) -> dict:
    return read_json_object(path / "config.json", SourceError, "pass a Hugging Face model directory")
