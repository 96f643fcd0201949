"""A cpu artifact's Llama, Qwen2, Qwen3 or Mistral decoder run by quantprep's C kernels alone: no torch, no transformers.

From a fresh process most of the time to a first token is importing torch and transformers'
modeling code, not the artifact's work (BENCHMARKS.md, "llama.cpp, the CPU anchor"). This runtime
imports numpy: it maps the artifact's safetensors (format/safetensors_numpy.py) and runs each
decoder layer as one C call (csrc/layers.c's layer_rows: a prompt's tokens in one call, then
one token at a time), every projection through int4_a8, the activations rounded to int8 per group:
the numerics of `warm --int8-activations` decode, at every length here (tests/test_engine.py
compares it with quantprep.load's model). The lm_head runs on the last position only: gemv_bf16 for
a bfloat16 head (or the tied embedding), int8_a8 for `--lm-head int8`, int4_a8 for `--lm-head int4`.

It runs a cpu artifact packed for bfloat16 activations whose config.json transformers reads as a
Llama, Qwen2, Qwen3 or Mistral (its model_type: runtime/architectures.py; SiLU MLP, default rotary
embedding, full or sliding-window attention; every other key one it reads or one that changes
nothing: Config), on a CPU whose int4_a8 reads the artifact's pack layout (AVX2 and FMA: 32 columns;
AVX512-VNNI and VBMI: 64). Anything else is refused with ArtifactMismatch saying why; quantprep.load
runs it, and without torch the openvino target (docs/openvino.md) where it builds the model.

    model = engine.load("artifacts/qwen2.5-coder-1.5b/cpu")
    tokens = model.generate([9707, 11, 1879], max_new_tokens=16)  # greedy
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import numpy as np

from quantprep._io.jsonfile import read_json_object
from quantprep.distribution.signing import configured_key
from quantprep.errors import ArtifactError, ArtifactMismatch
from quantprep.format import safetensors_numpy
from quantprep.format.model_config import MAX_SIZE
from quantprep.runtime.architectures import ANY, ARCHITECTURES, Architecture
from quantprep.runtime.checked import checked_manifest
from quantprep.targets import KERNEL_GROUP_SIZES, c_abi, c_library

FUSED_MEMBERS = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}  # in the order C reads them


@functools.cache
def libraries() -> tuple[ctypes.CDLL, ctypes.CDLL, ctypes.CDLL] | None:
    """(int8-activation matmuls, attention, layers) compiled with OpenMP (c_library.py: the same builds
    as torch's process uses where torch's OpenMP is libgomp), or None without a C compiler."""
    a8 = c_library.library("a8", ("-fopenmp",))
    attention = c_library.library("attention", ("-fopenmp",))
    layers = c_library.library("layers", ("-fopenmp", "-fno-trapping-math"))  # cpu_layers.library's flags
    return None if None in (a8, attention, layers) else (a8, attention, layers)


def default_threads() -> int:
    """OMP_NUM_THREADS, else the CPUs this process may run on (what OpenMP itself starts)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else len(os.sched_getaffinity(0))


def set_openmp_threads(n: int) -> None:
    """The thread count of the OpenMP regions this thread starts (the kernels that take no count)."""
    try:
        ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD).omp_set_num_threads(n)
    except (OSError, AttributeError):  # another OpenMP runtime: its own default
        pass


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (as torch and quantprep.h's to_bf16)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.uint32) << 16).view(np.float32)


def refuse(path: Path, why: str) -> ArtifactMismatch:
    return ArtifactMismatch(f"{path}: {why}; the native runtime cannot run it, quantprep.load can")


def refuse_config(path: Path, key: str, value, why: str) -> ArtifactMismatch:
    """One line naming config.json, the key and its value (printable and bounded: a hostile one may be neither)."""
    def bounded(text: str, limit: int) -> str:
        return text if len(text) <= limit else text[:limit] + "..."
    key, shown = bounded(key if key.isprintable() else repr(key), 100), bounded(repr(value), 200)
    return ArtifactMismatch(f"{path / 'config.json'}: {key}={shown}: {why}; `quantprep generate --native` implements Llama, Qwen2, "
                            "Qwen3 and Mistral decoders only (SiLU, the default rotary embedding, full or sliding-window attention): "
                            "run this model with `quantprep generate` without --native (quantprep.load, transformers' model), or "
                            "without torch as an openvino artifact (`--target openvino`; docs/openvino.md says which models it builds)")


# transformers builds the model a config.json's model_type names (AutoConfig's class, then
# AutoModelForCausalLM's), whatever its `architectures` say: this runtime implements ARCHITECTURES'.
# Every config.json key accepted but not read, with the values that change nothing this runtime
# computes (ANY: whatever). Any other key is refused: transformers' shared code reads keys that no
# config class declares (is_causal, attention_chunk_size, per_layer_config, attn_implementation, ...).
NEUTRAL_KEYS = {
    "transformers_version": ANY, "_name_or_path": ANY, "_model_name_or_path": ANY,  # the second: transformers' GGUF reader's name
    "quantization_config": ANY,  # quantprep.load drops it: the manifest says how each module is quantized
    "dtype": ANY, "torch_dtype": ANY,  # quantprep.load passes the manifest's act_dtype, which wins
    "bos_token_id": ANY, "eos_token_id": ANY, "unk_token_id": ANY, "sep_token_id": ANY,  # the tokenizer's and generate's
    "pad_token_id": ANY,  # the embedding's padding_idx: its gradient only
    "initializer_range": ANY, "attention_dropout": ANY,  # initialization and training: every weight is loaded, in eval mode
    "use_cache": ANY,  # the same logits with the cache or without
    "id2label": ANY, "label2id": ANY, "num_labels": ANY, "problem_type": ANY,  # classification heads, not a causal LM's
    "output_attentions": (False,), "output_hidden_states": (False,), "return_dict": (True,),  # what forward returns
    "chunk_size_feed_forward": (0,), "is_encoder_decoder": (False,),
    "use_sliding_window": (False,),  # Qwen2's and Qwen3's switch for their sliding layers (read there)
    "is_llama_config": ANY, "rope_interleaved": (False,), "transformers.js_config": ANY,  # nanotron's exports (SmolLM2's Hub config): unread
}
# The keys Config reads for every model_type, each checked below (Architecture.read: a model_type's own).
READ_KEYS = {"model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "hidden_act",
             "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"}
FULL_ATTENTION = ("full_attention", "attention")  # the second: a legacy name transformers reads as the first
ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}  # what the default rotary embedding's dict holds


def neutral(value, values) -> bool:
    """`value` is one of `values`, of the same type (JSON's 0 is not false)."""
    return values is ANY or any(type(value) is type(v) and value == v for v in values)


def rotary(c: dict, where: Path, fix: str) -> tuple[str, dict]:
    """The rotary embedding's parameters as transformers 5 reads them (configuration_utils' __post_init__,
    modeling_rope_utils' convert_rope_params_to_dict and standardize_rope_params), and the key they came
    from: a non-empty rope_scaling replaces rope_parameters whole; the top-level rope_theta (else 10000)
    and partial_rotary_factor fill what that dict lacks; rope_type defaults to its `type`, then "default"."""
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(c.get(key), dict | None):
            raise ArtifactError(f"{where}: {key} is {c.get(key)!r}, not an object or null as transformers reads it; {fix}")
    key = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    rope = dict(c.get(key) or {})
    rope.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    if c.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", c["partial_rotary_factor"])
    rope.setdefault("rope_type", rope.get("type", "default"))
    return key, rope


class Config:
    """The model config.json describes, read as transformers reads it and refused (ArtifactMismatch,
    one line naming the key) where it is not exactly a model this runtime computes: transformers
    builds the class its model_type names, one of ARCHITECTURES here, and every key must be one this
    runtime reads or one that changes nothing it computes (NEUTRAL_KEYS, at its neutral values).
    Malformed values are ArtifactError. `bias`: which projections have one, `qk_norm`: whether the
    attention has q_norm and k_norm, `windows`: each layer's sliding window or None, as transformers
    builds them (Architecture)."""

    def __init__(self, path: Path):
        where, fix = path / "config.json", "the artifact is corrupt: rebuild it"
        c = read_json_object(where, ArtifactError, fix)
        model_type = c.get("model_type")
        if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
            raise refuse_config(path, "model_type", model_type, "transformers builds this model's class from it, not one of "
                                                                "Llama's, Qwen2's, Qwen3's or Mistral's")
        arch = ARCHITECTURES[model_type]
        if c.get("architectures") not in (None, [arch.causal_lm]):
            raise refuse_config(path, "architectures", c.get("architectures"),
                                f"not {[arch.causal_lm]!r}, the class transformers builds for model_type {model_type!r}")
        read, neutral_keys = READ_KEYS | arch.read, NEUTRAL_KEYS | arch.neutral
        for key, value in c.items():
            if key in read:
                continue
            if key not in neutral_keys:
                raise refuse_config(path, key, value, f"not a key of the {model_type} config this runtime implements")
            if not neutral(value, neutral_keys[key]):
                raise refuse_config(path, key, value, f"it runs only {' or '.join(f'{key}={v!r}' for v in neutral_keys[key])}")
        if c.get("hidden_act", "silu") != "silu":
            raise refuse_config(path, "hidden_act", c.get("hidden_act"), "it runs a SiLU-gated MLP")
        if type(c.get("tie_word_embeddings", False)) is not bool:
            raise ArtifactError(f"{where}: tie_word_embeddings {c.get('tie_word_embeddings')!r} is not true or false; {fix}")

        def size(key: str, default=None) -> int:
            v = default if c.get(key) is None else c[key]
            if type(v) is not int or not 0 < v <= MAX_SIZE:
                raise ArtifactError(f"{where}: {key} is {v!r}, not a size; {fix}")
            return v

        def number(key: str, v) -> float:
            x = float(v) if type(v) in (int, float) and abs(v) < 1e30 else float("nan")
            if not 0 < x < 1e30:
                raise ArtifactError(f"{where}: {key} is {v!r}, not a positive number; {fix}")
            return x

        defaults = arch.defaults
        self.hidden, self.layers, self.heads = size("hidden_size"), size("num_hidden_layers"), size("num_attention_heads")
        kv_heads = c.get("num_key_value_heads", defaults["num_key_value_heads"])  # an explicit null: num_attention_heads
        self.kv_heads, self.intermediate, self.vocab = size("num_key_value_heads", kv_heads or self.heads), size("intermediate_size"), size("vocab_size")
        self.head_dim = size("head_dim", c.get("head_dim", defaults["head_dim"]) or self.hidden // self.heads)
        context = c.get("max_position_embeddings", defaults["max_position_embeddings"])
        if type(context) is not int or context <= 0:
            raise ArtifactError(f"{where}: max_position_embeddings is {context!r}, not a size; {fix}")
        self.context = min(context, MAX_SIZE)  # the positions it was trained for
        if self.heads % self.kv_heads or self.head_dim % 16 or self.head_dim > c_abi.MAX_HEAD_DIM or self.hidden % 32:
            raise refuse(path, f"{self.heads} heads of {self.head_dim} over {self.kv_heads} key/value heads, hidden size {self.hidden}")
        self.windows = layer_windows(c, arch, self.layers, path)
        key, rope = rotary(c, where, fix)
        if any(isinstance(v, dict) for v in rope.values()):
            raise refuse_config(path, key, c.get(key), "it runs one rotary embedding for every layer, not one per layer type")
        if rope["rope_type"] != "default":
            raise refuse_config(path, key, c.get(key), f"transformers builds a {rope['rope_type']!r} rotary embedding from it, "
                                                       "this runtime only the default one")
        if extra := sorted(set(rope) - ROPE_KEYS):
            raise refuse_config(path, key, c.get(key), f"{extra[0]!r} is no parameter of the default rotary embedding it runs")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:  # transformers 5's default one ignores it; another version may not
            raise refuse_config(path, "partial_rotary_factor", rope["partial_rotary_factor"], "it rotates whole heads")
        self.rope_theta, self.eps = number("rope_theta", rope["rope_theta"]), number("rms_norm_eps", c.get("rms_norm_eps", 1e-6))
        self.tied, self.qk_norm, self.bias = c.get("tie_word_embeddings", False), arch.qk_norm, {}
        for module, rule in (("self_attn.qkv_proj", arch.qkv_bias), ("self_attn.o_proj", arch.o_bias),
                             ("mlp.gate_up_proj", arch.mlp_bias), ("mlp.down_proj", arch.mlp_bias)):
            self.bias[module] = c.get(rule, False) if isinstance(rule, str) else rule  # a key's value, or the class's constant
            if type(self.bias[module]) is not bool:
                raise ArtifactError(f"{where}: {rule} {self.bias[module]!r} is not true or false; {fix}")


def layer_windows(c: dict, arch: Architecture, layers: int, path: Path) -> list[int | None]:
    """Each layer's sliding window (None: it attends to every earlier token), as transformers builds them
    (Architecture.window: the config class's __post_init__ and the attention's sliding_window)."""
    where, fix = path / "config.json", "the artifact is corrupt: rebuild it"
    layer_types, window = c.get("layer_types"), c.get("sliding_window", arch.defaults.get("sliding_window"))
    if not isinstance(layer_types, list | None) or len(layer_types or [None] * layers) != layers:  # transformers refuses it
        raise ArtifactError(f"{where}: layer_types {layer_types!r} is not a list of {layers} as transformers reads it; {fix}")
    if window is not None and (type(window) is not int or window <= 0):
        raise ArtifactError(f"{where}: sliding_window is {window!r}, not a size or null; {fix}")
    if arch.window == "every":
        return [window] * layers
    if arch.window == "layer_types":
        use, first = c.get("use_sliding_window", False), c.get("max_window_layers", 28)
        if type(use) is not bool or type(first) is not int:
            raise ArtifactError(f"{where}: use_sliding_window {use!r} or max_window_layers {first!r} is not a bool or an integer; {fix}")
        window = window if use else None
        if layer_types is None:
            layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)]
        if window is None and "sliding_attention" in layer_types:  # transformers' cache then fails
            raise refuse_config(path, "layer_types", c.get("layer_types"), "a sliding layer without use_sliding_window has no window")
    sliding = ("sliding_attention",) if arch.window == "layer_types" else ()  # with FULL_ATTENTION, the layers transformers builds here
    if any(kind not in FULL_ATTENTION + sliding for kind in layer_types or []):
        raise refuse_config(path, "layer_types", c.get("layer_types"), f"it runs {' and '.join(('full_attention', *sliding))} layers only")
    return [window if kind == "sliding_attention" else None for kind in layer_types or [None] * layers]


class Weights:
    """Every tensor of the artifact's shards, by name; `take` checks one's dtype and shape."""

    def __init__(self, path: Path, manifest: dict):
        self.path, self.tensors, self.taken = path, {}, set()
        for shard in manifest["shards"]:
            self.tensors.update(safetensors_numpy.read(path / shard))

    def take(self, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise ArtifactError(f"{self.path}: tensor {name} is missing from the artifact; rebuild it")
        have, array = self.tensors[name]
        if have != dtype or array.shape != shape:
            raise ArtifactError(f"{self.path}: tensor {name} is {have} {list(array.shape)}, expected {dtype} {list(shape)}; rebuild the artifact")
        self.taken.add(name)
        return array

    def check_all_taken(self) -> None:
        """Every tensor of the artifact is one the model reads (as quantprep.load's check_tensors): an
        artifact of another shape of model is refused, not partly run."""
        if extra := sorted(set(self.tensors) - self.taken):
            raise ArtifactError(f"{self.path}: tensor {extra[0]!r} is not one the {self.path / 'config.json'} model reads; rebuild the artifact")


class NativeModel:
    """The artifact's decoder with its KV cache. `forward(ids)` appends tokens and returns the last
    one's logits; `generate` decodes greedily; `reset` empties the cache."""

    def __init__(self, path: Path, manifest: dict, threads: int | None = None):
        libs = libraries()
        if libs is None:
            raise refuse(path, f"quantprep's C kernels are not built here ({c_library.unavailable_reason()})")
        a8, attention, self.lib = libs
        self.block, self.threads = a8.a8_block(), threads or default_threads()
        set_openmp_threads(self.threads)
        if not self.block:
            raise refuse(path, "this CPU has no int4_a8 kernel (it needs AVX2 and FMA, or AVX512-VNNI and VBMI)")
        target = manifest["target"]
        if target.get("name") != "cpu" or target.get("act_dtype") != "bfloat16":
            raise refuse(path, f"a {target.get('name')!r} artifact for {target.get('act_dtype')!r} activations (it runs cpu, bfloat16)")
        self.path, self.config, self.weights = path, Config(path), Weights(path, manifest)
        self.files = manifest["files"]  # what the checked manifest lists: runtime/tokenizer.py reads only these, checked again
        self.int4_a8, self.int8_a8 = a8.int4_a8_cpu, a8.int8_a8_cpu
        c, modules = self.config, manifest["modules"]
        names = {f"model.layers.{i}.{m}" for i in range(c.layers) for m in c.bias} | ({"lm_head"} & set(modules))
        if extra := sorted(set(modules) - names):
            raise refuse(path, f"module {extra[0]!r} in manifest.json is not one of the {c.layers}-layer model's projections")
        q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
        self.embed = self.weights.take("model.embed_tokens.weight", "BF16", (c.vocab, c.hidden))
        self.norm = self.weights.take("model.norm.weight", "BF16", (c.hidden,))
        self.layers = []
        for i in range(c.layers):
            p = f"model.layers.{i}."
            norms = [self.weights.take(f"{p}{n}.weight", "BF16", (c.hidden,)) for n in ("input_layernorm", "post_attention_layernorm")]
            qk = [self.weights.take(f"{p}self_attn.{n}.weight", "BF16", (c.head_dim,)).ctypes.data if c.qk_norm else None
                  for n in ("q_norm", "k_norm")]
            linears = [self.quant_linear(modules, f"{p}{name}", k, n, parts)
                       for name, k, n, parts in (("self_attn.qkv_proj", c.hidden, q + 2 * kv, [q, kv, kv]),
                                                 ("self_attn.o_proj", q, c.hidden, None),
                                                 ("mlp.gate_up_proj", c.hidden, 2 * c.intermediate, [c.intermediate] * 2),
                                                 ("mlp.down_proj", c.intermediate, c.hidden, None))]
            self.layers.append(c_abi.DecodeLayerArgs(
                matmul=ctypes.cast(self.int4_a8, ctypes.c_void_p).value,
                attention=ctypes.cast(attention.decode_attention, ctypes.c_void_p).value,
                norm1=norms[0].ctypes.data, norm2=norms[1].ctypes.data, q_norm=qk[0], k_norm=qk[1],
                eps1=c.eps, eps2=c.eps, q_eps=c.eps, k_eps=c.eps, scaling=c.head_dim ** -0.5, hidden=c.hidden, heads=c.heads,
                kv_heads=c.kv_heads, head_dim=c.head_dim, intermediate=c.intermediate,
                window=min(c.windows[i] or 0, 1 << 62),  # 0: none; past any position this process reaches, the same
                qkv=linears[0], o=linears[1], gate_up=linears[2], down=linears[3]))
        self.head = self.lm_head(modules)
        self.weights.check_all_taken()
        half = np.arange(0, c.head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(c.head_dim)
        self.inv_freq = (np.float32(1.0) / np.power(np.float32(c.rope_theta), half)).astype(np.float32)  # as transformers' default
        self.reset()

    def quant_linear(self, modules: dict, name: str, k: int, n: int, parts: list[int] | None) -> c_abi.QuantLinearArgs:
        """int4_a8's arguments for one projection the manifest lists, its tensors checked."""
        meta = modules.get(name)
        if not isinstance(meta, dict) or meta.get("bits") != 4:
            raise refuse(self.path, f"module {name} is not a 4-bit projection ({meta and meta.get('bits')!r} bits)")
        fields = [meta.get(f) for f in ("in_features", "out_features", "kernel_group_size", "padded_in", "padded_out", "pack_block_n")]
        group, fused = fields[2], meta.get("fused")
        members = FUSED_MEMBERS.get(name.rpartition(".")[2])
        shape = [(fused or {}).get("members"), (fused or {}).get("sizes")] if fused else [None, None]
        if not all(type(f) is int for f in fields) or group not in KERNEL_GROUP_SIZES or \
                fields[:2] + fields[3:5] + shape != [k, n, -(-k // group) * group, n, members, parts]:
            raise refuse(self.path, f"module {name} has (in, out, group, padded in, padded out, block, fused) "
                                    f"{(*fields, fused)!r}, not the {k}x{n} (fused {members}: {parts}) the config makes")
        if fields[5] != self.block:
            raise refuse(self.path, f"module {name} is packed in {fields[5]}-column blocks, this CPU's int4_a8 reads {self.block}")
        if meta.get("bias") is not self.config.bias.get(name.split(".", 3)[-1], False):
            raise ArtifactError(f"{self.path}: module {name}: bias {meta.get('bias')!r} in manifest.json, but the config's model "
                                f"has {'one' if not meta.get('bias') else 'none'}; rebuild the artifact")
        kp = meta["padded_in"]
        qweight = self.weights.take(f"{name}.qweight", "U8", (n, kp // 2))
        sz = self.weights.take(f"{name}.scales_and_zeros", "BF16", (kp // group, n, 2))
        perm = self.weights.take(f"{name}.perm", "I32", (k,)) if meta.get("act_order") else None
        if perm is not None and not np.array_equal(np.sort(perm), np.arange(k, dtype=np.int32)):
            raise ArtifactError(f"{self.path}: tensor {name}.perm is not a permutation of 0..{k - 1}; rebuild the artifact")
        bias = self.weights.take(f"{name}.bias", "BF16", (n,)) if meta.get("bias") else None
        return c_abi.QuantLinearArgs(None if perm is None else perm.ctypes.data, qweight.ctypes.data, sz.ctypes.data,
                                     None if bias is None else bias.ctypes.data, k, kp, n, group, self.block)

    def lm_head(self, modules: dict):
        """A function of one bfloat16 row -> the vocabulary's logits (bfloat16 bits)."""
        c, meta = self.config, modules.get("lm_head")
        if meta is None:
            if c.tied and "lm_head.weight" in self.weights.tensors:
                self.weights.taken.add("lm_head.weight")  # as transformers ties it: the embedding's takes its place
            w = self.embed if c.tied else self.weights.take("lm_head.weight", "BF16", (c.vocab, c.hidden))

            def gemv(x: np.ndarray) -> np.ndarray:
                y = np.empty(c.vocab, np.uint16)
                if self.lib.gemv_bf16(x.ctypes.data, w.ctypes.data, y.ctypes.data, c.vocab, c.hidden):
                    raise refuse(self.path, "gemv_bf16 was not built for this CPU")
                return y
            return gemv
        if meta.get("bits") == 8 and meta.get("int8_kernel") == "per_channel" and not meta.get("act_order") and not meta.get("bias") \
                and (meta.get("in_features"), meta.get("out_features")) == (c.hidden, c.vocab) and c.hidden % 128 == 0:
            w = self.weights.take("lm_head.qweight", "I8", (c.vocab, c.hidden))
            s = self.weights.take("lm_head.scales", "BF16", (c.vocab,))

            def int8(x: np.ndarray) -> np.ndarray:
                y = np.empty(c.vocab, np.uint16)
                if self.int8_a8(x.ctypes.data, 1, c.hidden, w.ctypes.data, s.ctypes.data, c.vocab, c.hidden, y.ctypes.data, c.vocab,
                                self.threads):
                    raise MemoryError("int8_a8 could not allocate its quantized activations")
                return y
            return int8
        if meta.get("bits") == 4 and not meta.get("fused") and not meta.get("bias"):
            args = self.quant_linear(modules, "lm_head", c.hidden, c.vocab, None)

            def int4(x: np.ndarray) -> np.ndarray:
                y = np.empty(c.vocab, np.uint16)
                self.linear(args, x, 1, y)
                return y
            return int4
        raise refuse(self.path, f"an lm_head of {meta.get('bits')!r} bits ({meta.get('int8_kernel')!r}, act_order {meta.get('act_order')!r})")

    def linear(self, p: c_abi.QuantLinearArgs, x: np.ndarray, rows: int, y: np.ndarray) -> None:
        status = self.int4_a8(x.ctypes.data, rows, p.in_features, p.perm, p.in_features, p.qweight, p.scales_and_zeros, p.padded_in,
                              p.out, p.group, p.block, y.ctypes.data, p.out, self.threads)
        if status:
            raise MemoryError(f"int4_a8 failed ({status})")

    def reset(self, capacity: int = 256) -> None:
        """Empty the KV cache, with room for `capacity` tokens before it grows."""
        c = self.config
        capacity = max(1, capacity)
        self.filled = 0
        self.keys = np.zeros((c.layers, c.kv_heads, capacity, c.head_dim), np.uint16)
        self.values = np.zeros_like(self.keys)

    def make_room(self, rows: int) -> None:
        capacity = self.keys.shape[2]
        if self.filled + rows <= capacity:
            return
        bigger = max(2 * capacity, self.filled + rows)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = np.zeros(old.shape[:2] + (bigger, old.shape[3]), np.uint16)
            new[:, :, :self.filled] = old[:, :, :self.filled]
            setattr(self, name, new)

    def rotary(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin [rows, head_dim] of the next positions, as transformers' default rotary embedding
        (float32, rounded to bfloat16)."""
        positions = np.arange(self.filled, self.filled + rows, dtype=np.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        angles = np.concatenate([freqs, freqs], axis=1)
        return to_bf16(np.cos(angles)), to_bf16(np.sin(angles))

    def forward(self, ids: list[int]) -> np.ndarray:
        """Run `ids` after the tokens already in the cache; the last one's logits (float32 [vocab])."""
        c, rows = self.config, len(ids)
        if rows < 1 or any(not isinstance(t, (int, np.integer)) or not 0 <= t < c.vocab for t in ids):
            raise ValueError(f"token ids must be 1 or more integers in 0..{c.vocab - 1}")
        self.make_room(rows)
        x = np.ascontiguousarray(self.embed[np.asarray(ids, np.int64)])
        out = np.empty_like(x)
        cos, sin = self.rotary(rows)
        capacity = self.keys.shape[2]
        for i, layer in enumerate(self.layers):
            status = self.lib.layer_rows(ctypes.byref(layer), x.ctypes.data, rows, out.ctypes.data, cos.ctypes.data, sin.ctypes.data,
                                         self.keys[i].ctypes.data, self.values[i].ctypes.data, capacity, self.filled, self.threads)
            if status == -1:
                raise MemoryError("layer_rows could not allocate its buffers")
            if status:
                raise ValueError(f"layer_rows refused layer {i} ({status})")
            x, out = out, x
        self.filled += rows
        last = np.empty(c.hidden, np.uint16)
        self.lib.rms_norm(x[-1].ctypes.data, c.hidden, self.norm.ctypes.data, last.ctypes.data, c.hidden, 1, c.hidden, c.eps)
        return from_bf16(self.head(last))

    def generate(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy: the prompt `ids` after the cache's tokens, then max_new_tokens tokens (returned)."""
        tokens, logits = [], self.forward(list(ids))
        for _ in range(max_new_tokens):
            tokens.append(int(np.argmax(logits)))
            if len(tokens) < max_new_tokens:
                logits = self.forward(tokens[-1:])
        return tokens


def load(path: str | os.PathLike, verify: str = "once", verify_key: str | os.PathLike | None = None,
         threads: int | None = None) -> NativeModel:
    """A cpu artifact directory as a NativeModel, after the checks every load makes (checked.py;
    `verify` and `verify_key` as quantprep.load's). threads: default OMP_NUM_THREADS, else every CPU
    this process may use. ArtifactMismatch: not one this runtime runs. The shards stay mapped while
    the model lives, as llama.cpp's: replace an artifact as quantprep does (a new directory swapped
    in), never its files in place."""
    path = Path(path)
    manifest = checked_manifest(path, verify, configured_key(verify_key))
    return NativeModel(path, manifest, threads)  # which checks each field it reads: an exception past those is a bug
