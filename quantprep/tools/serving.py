"""`quantprep serve`: an artifact, or a published reference, checked and loaded for the backend of
its target, then served by openai_server.py; and prefill bucketing, so a server meets only the
prompt lengths it warmed.

On xpu, oneDNN creates one int4 primitive per exact token count (its cache key holds M; PyTorch's
cache of them is per thread and per process, docs/xpu.md), so the first prompt of each new length
pays primitive creation. `generate` runs the prompt's prefill at warmed lengths only: prompts
longer than the largest bucket are split into chunks of that size, and the last chunk is padded on
the right up to the next bucket. Causal attention keeps the real tokens from seeing the pads that
follow them, and the pads' keys and values are cropped from the KV cache before anything reads it,
so decoding continues as if the prompt had run unpadded. Decode runs at M = 1, which warm covers.
"""

from __future__ import annotations

import math

import torch


def geometric_buckets(lo: int = 16, hi: int = 512, step: float = 1.1, multiple: int = 8) -> list[int]:
    """Prefill lengths from lo to hi, each at most `step` times the last (rounded up to a multiple
    of `multiple`): a prompt pads by at most ~10% plus a few tokens. Warm these for bucketing."""
    out = [lo]
    while out[-1] < hi:
        out.append(min(hi, multiple * math.ceil(out[-1] * step / multiple)))
    return [1, *out]


PREFILL_BUCKETS = geometric_buckets()


def buckets_of(model) -> list[int]:
    """The prefill lengths this model's artifact warmed (warmup replays them), largest last."""
    from quantprep.format.artifact import DEFAULT_SHAPES

    shapes = getattr(model, "quantprep_buckets", None) or DEFAULT_SHAPES
    return sorted(set(shapes))


def bucket_for(length: int, buckets: list[int]) -> int:
    """The smallest bucket >= length; the largest bucket when none is (callers chunk first)."""
    return next((b for b in sorted(buckets) if b >= length), max(buckets))


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, buckets: list[int], pad_token_id: int = 0):
    """Run `input_ids` [batch, n] through the model at bucket lengths only. Returns (logits of the
    real tokens [batch, n, vocab], the KV cache holding exactly the n real tokens)."""
    from transformers import DynamicCache

    chunk = max(buckets)
    cache = DynamicCache(config=model.config)
    logits, n = [], input_ids.shape[1]
    for start in range(0, n, chunk):
        ids = input_ids[:, start:start + chunk]
        real = ids.shape[1]
        pad = bucket_for(real, buckets) - real
        if pad:
            ids = torch.nn.functional.pad(ids, (0, pad), value=pad_token_id)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        if pad:
            cache.crop(-pad)
        logits.append(out.logits[:, :real])
    return torch.cat(logits, dim=1), cache


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, buckets: list[int] | None = None, **generate_kwargs) -> torch.Tensor:
    """`model.generate` with the prompt's prefill bucketed: every token but the last is prefilled at
    bucket lengths, then generate continues from that cache at M = 1."""
    buckets = buckets or buckets_of(model)
    pad_token_id = generate_kwargs.get("pad_token_id", model.generation_config.pad_token_id) or 0
    if input_ids.shape[1] > 1:
        _, cache = prefill(model, input_ids[:, :-1], buckets, pad_token_id)
        generate_kwargs["past_key_values"] = cache
    return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **generate_kwargs)


def serve(src: str, host: str = "127.0.0.1", port: int = 8000, warmup: bool = True, trust_kcache: bool = False,
          verify_key: str | None = None, device: str = "auto", ready=None) -> None:
    """Serve an artifact with quantprep's OpenAI-compatible server (openai_server.py: /v1/models,
    /v1/chat/completions, /v1/completions, streaming; one set of bounds on every request).

    src: an artifact directory or a published reference (pulled and verified first). The served
    model's id is the artifact directory's absolute path: /v1/models lists it, requests name it (or
    no model). warmup: the artifact's warmed shapes run once in the thread that generates (oneDNN's
    primitive cache on xpu is per thread); cpu has no per-process kernel state, so nothing runs there.
    Runs until SIGINT or SIGTERM, then stops taking requests and exits within a few seconds.
    `ready(info)` is called once serving (for callers that print or measure).

    Clients are untrusted: the server is pinned to this one artifact (/load_model and /reset 403,
    a request naming another model 400); trust_kcache and verify_key apply to this artifact's load
    alone (never through the environment); the Hub is offline once the artifact is here."""
    from pathlib import Path

    from quantprep.distribution.signing import configured_key
    from quantprep.errors import QuantprepError
    from quantprep.format.artifact import WEIGHTS_INDEX
    from quantprep.runtime.checked import checked_artifact
    from quantprep.runtime.load import is_reference
    from quantprep.tools import openai_server

    key, signed = configured_key(verify_key), False
    if is_reference(src):  # pulled and checked under the reference's signature policy; then served as a directory
        from quantprep.distribution.publish import pull_checked

        src, signed = pull_checked(src, verify_key=verify_key)
        key = None
    path = Path(src).absolute()
    if not (path / "manifest.json").is_file():
        raise QuantprepError(f"{src}: not an artifact directory (no manifest.json) nor a published reference")
    manifest, target = checked_artifact(path, "once", key)  # every file hashed; a target this quantprep has
    if target.kind == "graph":
        from quantprep.runtime import openvino
        from quantprep.runtime.kcache import Kcache

        model = openvino.load(path, (manifest, target), None if device == "auto" else device, exact=False,
                              kcache=Kcache(path, manifest, trust_kcache, signed or key is not None))
        hub_offline()
        backend = openai_server.OpenVINOBackend(model)
    else:
        if not (path / WEIGHTS_INDEX).is_file():  # artifacts before from_pretrained support kept the source's GPTQ config
            raise QuantprepError(f"{path}: built by an older quantprep (no {WEIGHTS_INDEX}); rebuild it with `quantprep build` "
                                 "or `quantprep prepack` to serve it")
        from quantprep.runtime.torch_model import open_artifact

        open_artifact(path, (manifest, target), None if device == "auto" else device, None)  # refusals in one line, before loading
        hub_offline()
        backend = openai_server.TorchBackend(path, device, trust_kcache, key, signed or key is not None)
    openai_server.run(backend, host, port, warmup, ready)


def hub_offline() -> None:
    """No Hub access from here on: a served process never fetches a model, a config or code."""
    import os

    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True  # read at import; is_offline_mode() reads this
