"""The decoders quantprep's C decode layer computes, one row per transformers model_type: what each
adds to Llama's (RMSNorm, a SiLU-gated MLP, the default rotary embedding, causal attention), as
transformers 5 builds it. runtime/engine.py reads config.json by it, without torch;
runtime/cpu_layers.py finds transformers' attention class by it (causal_lm) and runs its q/k norms;
both fill c_abi's DecodeLayer from it. (A sliding window is engine's: in transformers' model it
is the attention mask's and the cache's, which the torch path takes as they are.)
"""

from __future__ import annotations

from dataclasses import dataclass

ANY = object()  # a config key's value when none changes the logits transformers' model computes


@dataclass(frozen=True)
class Architecture:
    causal_lm: str  # the class transformers builds for the model_type (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES); "<Name>ForCausalLM"
    qkv_bias: bool | str  # whether q/k/v have a bias: always, never, or the config key that says (default false)
    o_bias: bool | str
    mlp_bias: bool | str
    qk_norm: bool  # q_norm and k_norm: an RMSNorm over head_dim on each query and key head, before the rotary embedding
    # Which layers attend to a sliding window (a query at position p sees the keys in (p - sliding_window, p]):
    # "none"; "layer_types": the layers config.layer_types names "sliding_attention", whose attention's
    # `sliding_window` is the config's, kept only with use_sliding_window (else the list defaults to
    # sliding from max_window_layers on, and to no sliding layer without one); "every": every layer,
    # config.sliding_window (None: none).
    window: str
    defaults: dict  # the config class's values of keys config.json may leave out (head_dim None: hidden_size // heads)
    read: frozenset[str]  # the keys of this model_type read beside engine.READ_KEYS
    neutral: dict  # keys of this model_type accepted unread, with the values that change nothing (ANY: whatever)


QWEN_WINDOW = {"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28}
ARCHITECTURES = {
    "llama": Architecture("LlamaForCausalLM", "attention_bias", "attention_bias", "mlp_bias", False, "none",
                          {"max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None},
                          frozenset({"attention_bias", "mlp_bias", "layer_types"}),
                          {"pretraining_tp": ANY,  # transformers 5's Llama does not read it
                           "sliding_window": (None,)}),  # transformers' cache would keep only that many tokens
    "qwen2": Architecture("Qwen2ForCausalLM", True, False, False, False, "layer_types",
                          {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": None, **QWEN_WINDOW},
                          frozenset({"layer_types", *QWEN_WINDOW}), {}),
    "qwen3": Architecture("Qwen3ForCausalLM", "attention_bias", "attention_bias", False, True, "layer_types",
                          {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128, **QWEN_WINDOW},
                          frozenset({"attention_bias", "layer_types", *QWEN_WINDOW}), {}),
    # MistralConfig has no layer_types: transformers warns and its cache would follow one while every
    # layer's mask follows sliding_window; refused as any key it does not declare
    "mistral": Architecture("MistralForCausalLM", False, False, False, False, "every",
                            {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "head_dim": None, "sliding_window": 4096},
                            frozenset({"sliding_window"}), {}),
}
