"""The openvino target's artifact: the decoder IR (runtime/openvino_graph.py makes the graph from
transformers' modeling code) around the GPTQ integers, and the tokenizer IR openvino-tokenizers converts from the source's
tokenizer, for runtimes that read the directory as it is (openvino.genai, OVMS). quantprep's own
load never runs either as it comes (runtime/openvino.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantprep._io.jsonfile import read_json_object
from quantprep.errors import SourceError
from quantprep.format.artifact import OPENVINO_MODEL, OPENVINO_TOKENIZERS, ArtifactWriter, sha256_file
from quantprep.runtime.fused import in_model
from quantprep.runtime.openvino_graph import TensorWeights, export

# The tokenizer IR's rt_info that only records who converted it
CONVERTER_RT_INFO = ("openvino_tokenizers_version", "openvino_version", "transformers_version", "tokenizers_version",
                     "original_tokenizer_class")


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
    quantized_parents = {layer.rpartition(".")[0] for layer in ckpt.layers} | {layer.rsplit(".", 2)[0] for layer in ckpt.layers}
    for name, param in model.named_parameters():  # a tied lm_head is the embedding's: not listed
        module = name.rpartition(".")[0]
        parent, _, child = module.rpartition(".")
        members = in_model(config.model_type, child) or ()  # Phi-3's gate_up_proj: gptqmodel writes gate_proj and up_proj
        if module in ckpt.layers or module in quantized_parents or (members and all(f"{parent}.{m}" in ckpt.layers for m in members)):
            continue  # a quantized Linear's, or a layer's experts' (3-D tensors the checkpoint holds as one Linear per expert)
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


def tokenizer_difference(path: Path, files: dict) -> str | None:
    """How an artifact's tokenizer and detokenizer IR differ, as text and bytes, from what
    openvino-tokenizers converts here from the artifact's own tokenizer files, or None. quantprep
    never runs them (runtime/openvino.py), nor hands them to OpenVINO here (its reader evaluates
    constant subgraphs, custom operations included); other runtimes of the directory run them, and
    their operations index string tables without bounds checks."""
    import tempfile

    from quantprep.errors import ArtifactError
    from quantprep.targets.openvino import ir_difference, ir_tree

    with tempfile.TemporaryDirectory(prefix="quantprep-tokenizer-") as tmp:
        try:
            written = write_tokenizers(path, Path(tmp))
        except SourceError as e:
            raise ArtifactError(str(e)) from None
        for name in OPENVINO_TOKENIZERS:
            if (name in files) != (name in written):
                return f"{name} {'listed' if name in files else 'missing'}, where openvino-tokenizers {'writes none' if name in files else 'writes one'}"
        for name in written:
            if name.endswith(".xml"):
                weights = name.removesuffix(".xml") + ".bin"
                try:
                    got = ir_tree((path / name).read_bytes())
                except ValueError as e:
                    return f"{name}: {e}"
                want = ir_tree((Path(tmp) / name).read_bytes())
                if difference := ir_difference(want, sha256_file(Path(tmp) / weights), got, files[weights]["sha256"], CONVERTER_RT_INFO):
                    return f"{name}: {difference}"
    return None


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
        config = read_config(self.ckpt.path)  # as load's check reads it: the same graph from the same data
        try:
            model = export(config, modules, TensorWeights(modules, quantized, self.ckpt.other_tensors))
        except Exception as e:  # the trace and the conversion raise many kinds for a model they cannot take
            raise SourceError(f"{self.ckpt.path / 'config.json'}: OpenVINO cannot convert this {config.get('model_type')} model "
                              f"({type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else ''}); "
                              "build the cpu target for it") from None
        point_to_kept_perms(model, modules, quantized)
        ov.save_model(model, self.tmp / OPENVINO_MODEL, compress_to_fp16=False)
        del model, quantized
        write_tokenizers(self.ckpt.path, self.tmp)
        return super().finish(manifest, probes, weights_index=False)


def point_to_kept_perms(model, modules: dict[str, dict], quantized: dict[str, torch.Tensor]) -> None:
    """Modules of one input and one act-order (DeepSeek's q_proj and kv_a_proj_with_mqa, as gptqmodel
    writes them) gather it equally, and OpenVINO keeps one of the equal Gathers and its permutation
    constant: each other module's metadata names that module (`perm_of`), where load's rebuild and
    verify read its permutation."""
    kept = {op.get_friendly_name() for op in model.get_ops() if op.get_type_name() == "Constant"}
    for name, meta in modules.items():
        if meta["act_order"] and f"{name}.perm" not in kept:
            perm = quantized[f"{name}.perm"]
            same = [other for other in modules if f"{other}.perm" in kept and torch.equal(quantized[f"{other}.perm"], perm)]
            if not same:
                raise ValueError(f"OpenVINO dropped {name}.perm, and kept no equal permutation")
            meta["perm_of"] = same[0]


def read_config(path: Path) -> dict:
    return read_json_object(path / "config.json", SourceError, "pass a Hugging Face model directory")
