"""What quantization cost: an artifact's perplexity, and the KL divergence and top-1 agreement of
its next-token distributions against a reference model (docs/eval.md).

The anchor is llama.cpp's `perplexity --kl-divergence`; the definition here is exact so anyone can
recompute it: the text is tokenized once with the artifact's tokenizer, without special tokens, and
cut into consecutive non-overlapping windows of `ctx` tokens (the last partial window dropped).
Each window is scored on its own. Perplexity = exp(mean negative log-likelihood of every token
after the first in each window). At those same positions, KL(reference || artifact) of the two
next-token distributions (natural log) gives the mean and 99th percentile, and top-1 agreement is
the share of positions where both models' most likely token is the same.

The reference: `reference=` (a float model directory, or a GPTQ checkpoint, which is then
dequantized to dense float weights), else the float model the checkpoint was quantized from when
the build's caches still hold it, else the GPTQ checkpoint the artifact was built from. Against a
dequantized reference only the kernels' error is measured (quantization error is in both).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from pathlib import Path

import torch

from quantprep.errors import QuantprepError
from quantprep.format.artifact import read_checked, refuse_code, republish
from quantprep.runtime.experts import routed_tokens

HELDOUT_FILE = Path(__file__).with_name("heldout.txt")
DEFAULT_CTX = 512
CHUNK = 128  # positions per log-softmax: bounds memory at 2 x CHUNK x vocab floats


def read_text(text_file: str | os.PathLike | None = None, dataset: str | None = None) -> tuple[str, str]:
    """(text, its name). Default: the held-out text shipped with quantprep (heldout.txt: Python's
    language reference from the standard library's pydoc_data, disjoint from calibration.txt)."""
    if text_file is not None and dataset is not None:
        raise QuantprepError("pass --text or --dataset, not both")
    if dataset is not None:
        if dataset not in ("wikitext2", "wikitext-2"):
            raise QuantprepError(f"--dataset {dataset}: only wikitext2 is known; pass --text FILE for any other text")
        try:
            import datasets
        except ImportError:
            raise QuantprepError("--dataset needs the datasets library: pip install datasets") from None
        try:
            ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
        except Exception as e:  # offline without a cached copy: datasets raises several kinds
            raise QuantprepError(f"--dataset wikitext2: not in the datasets cache and not downloadable here ({type(e).__name__}); "
                                 "run once online, or pass --text FILE") from None
        return "".join(ds["text"]), "wikitext-2-raw-v1 test"
    path = Path(text_file) if text_file is not None else HELDOUT_FILE
    try:
        return path.read_text(encoding="utf-8"), (path.name if text_file is not None else "quantprep held-out")
    except (OSError, UnicodeDecodeError) as e:
        raise QuantprepError(f"{path}: cannot read it as UTF-8 text ({e.__class__.__name__}); pass a text file") from None


def token_windows(tokenizer, text: str, ctx: int, max_tokens: int | None = None) -> torch.Tensor:
    """[windows, ctx] token ids: the text tokenized once, without special tokens, cut into
    consecutive windows of ctx tokens; the last partial window dropped."""
    if ctx < 2:
        raise QuantprepError(f"--ctx {ctx}: a window needs at least 2 tokens")
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    n = len(ids) // ctx
    if max_tokens is not None:
        n = min(n, max_tokens // ctx)
    if n == 0:
        raise QuantprepError(f"the text has {len(ids)} tokens: fewer than one window of --ctx {ctx}"
                             f"{f' within --max-tokens {max_tokens}' if max_tokens is not None else ''}")
    return ids[: n * ctx].view(n, ctx)


def find_reference(manifest: dict, reference: str | os.PathLike | None = None) -> tuple[str, Path]:
    """(kind, directory): "float" or "dequantized"."""
    from quantprep.build.pipeline import cache_dir, cached_checkpoint
    from quantprep.build.source import is_gptq_dir, resolve_hub_model

    if reference is not None:
        path = Path(reference)
        if not (path / "config.json").is_file():
            raise QuantprepError(f"--reference {path}: no config.json; pass a float model or a GPTQ checkpoint directory")
        return ("dequantized" if is_gptq_dir(path) else "float"), path
    source = manifest["source"]
    if sha := source.get("gguf_sha256"):  # the build dequantized a GGUF file into its cache
        found = sorted((cache_dir() / "float").glob(f"*{sha[:16]}"))
        if found and (found[0] / "config.json").is_file():
            return "float", found[0]
    if "id" in source and "/" in source["id"]:  # a hub model, from the local Hugging Face cache
        try:
            path = resolve_hub_model(source["id"], source.get("revision"))
            return ("dequantized" if is_gptq_dir(path) else "float"), path
        except QuantprepError:
            pass
    if path := cached_checkpoint(source["sha256"]):  # the GPTQ checkpoint, identified by content
        return "dequantized", path
    raise QuantprepError("no reference model found for this artifact (the build's float model and GPTQ checkpoint are not in "
                         "this machine's caches): pass --reference FLOAT_OR_GPTQ_DIR")


def dequantized_model(gptq_dir: Path, dtype: torch.dtype = torch.float32):
    """The GPTQ checkpoint with every quantized weight dequantized to a dense float Linear."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantprep.build.prepack import fusion_plan, prepare_layers
    from quantprep.build.source import read_checkpoint
    from quantprep.format.expert_names import PROJECTIONS as EXPERT_PROJECTIONS
    from quantprep.runtime.experts import expert_weight, stacked_expert

    ckpt = read_checkpoint(gptq_dir)
    config = AutoConfig.from_pretrained(gptq_dir, trust_remote_code=False)
    del config.quantization_config
    if "lm_head" in ckpt.layers:
        config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    params = {**dict(model.named_buffers()), **dict(model.named_parameters())}  # buffers too: DeepSeek's e_score_correction_bias
    filled, expert_slices = set(), {}

    def put(name: str, t: torch.Tensor) -> None:  # one tensor at a time: memory is the model plus one layer
        if name not in params or params[name].shape != t.shape:
            raise QuantprepError(f"{gptq_dir}: tensor {name} {tuple(t.shape)} does not fit its config.json "
                                 f"({tuple(params[name].shape) if name in params else 'no such parameter'})")
        params[name].data.copy_(t)
        filled.add(name)

    with torch.no_grad():
        for key in ckpt.other_tensors:
            put(key, ckpt.other_tensors[key])
        # layers the model has as one Linear (Phi-3's gate_up_proj: runtime/fused.py IN_MODEL) fill it, in its order
        for name, members in fusion_plan(list(ckpt.layers), fuse=False, model_type=config.model_type):
            layer = prepare_layers(name, [ckpt.layers[m] for m in members])
            if (e := stacked_expert(model, name)) is not None:  # an expert's projection: its slice of the model's 3-D experts tensors
                expert_weight(model.get_submodule(e.experts), e.index, e.projection).copy_(layer.dequantize().T)
                expert_slices[e.experts] = expert_slices.get(e.experts, 0) + 1
                continue
            put(f"{name}.weight", layer.dequantize().T)
            if layer.bias is not None:
                put(f"{name}.bias", layer.bias)
        for experts, n in expert_slices.items():  # filled when every expert's every projection was
            if n == len(EXPERT_PROJECTIONS) * model.get_submodule(experts).num_experts:
                filled.update({f"{experts}.gate_up_proj", f"{experts}.down_proj"})
    model.tie_weights()  # a tied lm_head is the embedding's parameter: not listed below
    missing = {n for n, _ in model.named_parameters()} - filled
    if missing:
        raise QuantprepError(f"{gptq_dir}: its tensors do not fit its config (missing {sorted(missing)[:3]})")
    return model.eval()


def reference_model(kind: str, path: Path, device: str):
    from transformers import AutoModelForCausalLM

    if kind == "dequantized":
        return dequantized_model(path).to(device)
    refuse_code(path, QuantprepError)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False).to(device).eval()


@torch.no_grad()
def compare_window(model, ref, window: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position NLL of both models, KL(ref || model) and top-1 agreement, for the tokens after the first."""
    x = window[None]
    logits, ref_logits = model(input_ids=x).logits[0, :-1], ref(input_ids=x).logits[0, :-1]
    target = window[1:].to(logits.device)
    out = {k: [] for k in ("nll", "ref_nll", "kld", "top1")}
    for s in range(0, len(target), CHUNK):
        lp = torch.log_softmax(logits[s:s + CHUNK].double(), -1)
        rlp = torch.log_softmax(ref_logits[s:s + CHUNK].double(), -1)
        t = target[s:s + CHUNK, None]
        out["nll"].append(-lp.gather(1, t)[:, 0])
        out["ref_nll"].append(-rlp.gather(1, t)[:, 0])
        out["kld"].append((rlp.exp() * (rlp - lp)).sum(-1))
        out["top1"].append(lp.argmax(-1) == rlp.argmax(-1))
    return {k: torch.cat(v).cpu() for k, v in out.items()}


def evaluate(path: str | os.PathLike, reference: str | os.PathLike | None = None, text_file: str | os.PathLike | None = None,
             dataset: str | None = None, ctx: int = DEFAULT_CTX, max_tokens: int | None = None, device: str | None = None,
             store: bool = True, progress: bool = True, dtype: str | None = None) -> dict:
    """Score the artifact at `path` against its reference; with `store`, record the result in the
    artifact's manifest (`eval`, keyed by text and ctx; published again atomically, as warm does).
    dtype: the activation dtype to load with (quantprep.load's; an openvino artifact: float32 runs
    the plugin exactly, None its defaults, what generate and serve run)."""
    from transformers import AutoTokenizer

    from quantprep.runtime.load import load

    path = Path(path)
    manifest = read_checked(path)
    text, text_name = read_text(text_file, dataset)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError):
        raise QuantprepError(f"{path}: no usable tokenizer in the artifact (its source checkpoint had none); "
                             "eval needs the tokenizer files next to config.json") from None
    windows = token_windows(tokenizer, text, ctx, max_tokens)
    kind, ref_path = find_reference(manifest, reference)
    from quantprep.targets import get_target

    target = manifest["target"]["name"]
    if device is None:  # the target's device, else its CPU emulator (xpu: slow; --max-tokens bounds it)
        t = get_target(target)
        device = "cpu" if t.runtime_problem() is not None and t.cpu_emulator else None
    model = load(path, device=device, dtype=getattr(torch, dtype) if dtype else None)
    if get_target(target).kind == "graph":  # OpenVINO runs it, with the plugin's defaults (what generate and serve run); the reference on the CPU
        device, shown = "cpu", f"OpenVINO {model.device}"
    else:
        device = shown = str(next(model.parameters()).device)
    ref = reference_model(kind, ref_path, device)
    if progress:
        print(f"eval {path} ({target} on {shown}) vs the {kind} reference {ref_path}: {len(windows)} windows of {ctx} tokens",
              file=sys.stderr, flush=True)
    t0, parts = time.perf_counter(), []
    # a mixture of experts' text reaches some of its experts: the result says how many (the rest are only verify's probes)
    with routed_tokens(model) if isinstance(model, torch.nn.Module) else contextlib.nullcontext({}) as routed:
        for i, w in enumerate(windows):
            parts.append(compare_window(model, ref, w.to(device)))
            if progress and (i + 1) % 10 == 0:
                print(f"  {i + 1}/{len(windows)} windows, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    stats = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    half = len(parts) // 2
    halves = [_ppl(torch.cat([p["nll"] for p in ps])) for ps in (parts[:half], parts[half:]) if ps]
    result = {
        "ppl": _ppl(stats["nll"]),
        "reference": {"kind": kind, "path": str(ref_path), "ppl": _ppl(stats["ref_nll"])},
        "kld": {"mean": stats["kld"].mean().item(), "p99": torch.quantile(stats["kld"].float(), 0.99).item()},
        "top1_agree": stats["top1"].double().mean().item(),
        "tokens": int(stats["nll"].numel()),
        "target": target,
        "device": shown,
        **({"dtype": dtype} if dtype else {}),
        "ctx": ctx,
        "text": {"name": text_name, "sha256": hashlib.sha256(text.encode()).hexdigest(), "windows": len(windows)},
        "halves_ppl": halves,
        "s": round(time.perf_counter() - t0, 1),
    }
    if routed:
        result["experts"] = {"experts": sum(c.numel() for c in routed.values()), "routed": sum(int((c > 0).sum()) for c in routed.values()),
                             "moe_layers": len(routed)}
    result["ppl_ratio"] = result["ppl"] / result["reference"]["ppl"]
    result["kld_values"] = stats["kld"]  # for plot(); not stored, not printed
    if store:
        key = stored_key(result)
        stored = {k: v for k, v in result.items() if k not in ("device", "kld_values")}
        stored["reference"] = {k: v for k, v in result["reference"].items() if k != "path"}  # no machine paths in the manifest
        republish(path, path, None, [], {"eval": dict(manifest.get("eval", {}), **{key: stored})})
    return result


def stored_key(result: dict) -> str:
    return f"{result['text']['sha256'][:12]}-ctx{result['ctx']}-{result['tokens']}" + (f"-{result['dtype']}" if result.get("dtype") else "")


def plot(result: dict, path: Path, out: str | os.PathLike) -> None:
    """Left: perplexity per target (this artifact and sibling artifacts of the same build that hold
    a result for the same text, ctx and tokens) against the reference's. Right: the distribution
    of the per-token KL divergence of this run."""
    try:
        import matplotlib
    except ImportError:
        raise QuantprepError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from quantprep.format.artifact import read_manifest

    key, ppl = stored_key(result), {result["target"]: result["ppl"]}
    for sibling in sorted(Path(path).absolute().parent.iterdir()):
        try:
            if (e := read_manifest(sibling).get("eval", {}).get(key)) and e["target"] not in ppl:
                ppl[e["target"]] = e["ppl"]
        except QuantprepError:
            continue
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [f"reference\n({result['reference']['kind']})", *ppl]
    values = [result["reference"]["ppl"], *ppl.values()]
    bars = a.bar(names, values, color=["0.6"] + ["C0"] * len(ppl))
    a.bar_label(bars, fmt="%.3f")
    a.set_ylabel("perplexity")
    a.set_ylim(0, max(values) * 1.15)
    a.set_title(f"{result['tokens']} tokens of {result['text']['name']}, ctx {result['ctx']}")
    kld = result["kld_values"].clamp_min(1e-8).float().numpy()
    import numpy as np

    b.hist(kld, bins=np.logspace(-8, max(1, float(np.log10(kld.max())) + 0.1), 60), color="C1")
    b.set_xscale("log")
    for q, style in ((result["kld"]["mean"], "-"), (result["kld"]["p99"], "--")):
        b.axvline(q, color="k", linestyle=style, linewidth=1)
    b.set_xlabel("KL divergence per token vs the reference (nats)")
    b.set_ylabel("tokens")
    b.set_title(f"{result['target']}: KLD mean {result['kld']['mean']:.3g} (solid), p99 {result['kld']['p99']:.3g} (dashed), "
                f"top-1 {100 * result['top1_agree']:.1f}%", fontsize=9)
    fig.suptitle(str(path), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _ppl(nll: torch.Tensor) -> float:
    return float(torch.exp(nll.double().mean()))
