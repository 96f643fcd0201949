"""Serving an artifact: prefill bucketing, so a server meets only the prompt lengths it warmed.

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
    shapes = getattr(model, "quantprep_buckets", None) or [1, 16, 128, 512]
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
