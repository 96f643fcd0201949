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

import contextlib
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
    """Serve an artifact with transformers' own OpenAI-compatible server (`transformers serve`:
    /v1/models, /v1/chat/completions, /v1/completions, streaming), the artifact preloaded through
    quantprep's quantizer (hf_quantizer.py: the load checks and the kcache rules of quantprep.load).

    src: an artifact directory or a published reference (pulled and verified first). The served
    model's id is the artifact directory's absolute path: /v1/models lists it, requests name it (or
    no model). warmup: the artifact's warmed shapes run once in the thread that generates (oneDNN's
    primitive cache on xpu is per thread); cpu has no per-process kernel state, so nothing runs there.
    Runs until SIGINT or SIGTERM, then stops taking requests and exits within a few seconds.
    `ready(info)` is called once serving (for callers that print or measure).

    Clients are untrusted: the server is pinned to this one artifact. Routes that would load
    another model or unload this one (/load_model, /reset, a request naming another model, on any
    route) answer 403; trust_kcache and verify_key apply to this artifact's load alone (never
    through the environment); the Hub is offline once the artifact is here."""
    import os
    import signal
    import sys
    import threading
    from pathlib import Path

    from transformers.cli.serve import Serve
    from transformers.cli.serving.model_manager import ModelManager

    from quantprep.distribution.signing import configured_key
    from quantprep.errors import QuantprepError
    from quantprep.format.artifact import WEIGHTS_INDEX, read_manifest
    from quantprep.runtime.hf_quantizer import load_options, register
    from quantprep.runtime.load import is_reference, open_artifact, run_shapes

    register()
    key, signed = configured_key(verify_key), False
    if is_reference(src):  # pulled and checked under the reference's signature policy; then served as a directory
        from quantprep.distribution.publish import pull_checked

        src, signed = pull_checked(src, verify_key=verify_key)
        key = None
    path = Path(src).absolute()
    if not (path / "manifest.json").is_file():
        raise QuantprepError(f"{src}: not an artifact directory (no manifest.json) nor a published reference")
    if read_manifest(path)["target"]["name"] == "openvino":  # the same routes over openvino.genai
        from quantprep.runtime import genai
        from quantprep.runtime.load import check_compat, checked_artifact
        from quantprep.tools import serving_openvino

        manifest, target = checked_artifact(path, None, key)
        check_compat(path, manifest, target)
        model = genai.load(path, manifest, None if device == "auto" else device, exact=False, kcache=True,
                           trust=trust_kcache, signed=signed or key is not None)
        hub_offline()
        serving_openvino.serve(model, host, port, ready)
        return
    if not (path / WEIGHTS_INDEX).is_file():  # artifacts before from_pretrained support kept the source's GPTQ config
        raise QuantprepError(f"{path}: built by an older quantprep (no {WEIGHTS_INDEX}); rebuild it with `quantprep build` "
                             "or `quantprep prepack` to serve it")
    open_artifact(path, None if device == "auto" else device, None, None, key)  # refusals in one line (every file hashed), before the server starts
    hub_offline()
    model_id = str(path)
    entry = {"id": model_id, "object": "model", "created": int(path.stat().st_mtime), "owned_by": "quantprep"}
    # transformers lists the models of the Hugging Face cache; this server serves one artifact
    ModelManager.get_gen_models = staticmethod(lambda cache_dir=None: [entry])
    with load_options(path, trust_kcache, key, signed or key is not None), pinned(model_id):
        server = Serve(force_model=model_id, host=host, port=port, device=device, non_blocking=True, trust_remote_code=False)
    server.server.config.timeout_graceful_shutdown = 3  # a stop during a long stream does not wait for its end
    key_id = server._model_manager.process_model_name(model_id)
    model = server._model_manager.loaded_models[key_id].model
    info = {"model": model_id, "url": f"http://{host}:{port}/v1", "kcache": model.quantprep_kcache.get("status"), "warmup": "none"}
    if warmup and next(model.parameters()).device.type != "cpu":
        # the generation manager's own thread, the one every request of this model runs on
        done = server._generation_state.get_manager(key_id).submit(run_shapes, model, model.quantprep_buckets).result()
        info["warmup"] = [t["prefill"] for t in done]
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if ready:
        ready(info)
    while not stop.wait(0.2) and server._thread.is_alive():
        pass
    server.server.should_exit = True
    server._thread.join(timeout=10)
    # generation runs on a daemon thread: interpreter exit while it is inside a torch op aborts the
    # process (SIGABRT, seen in CI). The shutdown cancelled every stream, which stops at its next
    # token; wait for the thread to be idle, and skip the teardown if a request still runs.
    idle = server._generation_state.get_manager(key_id).submit(lambda: None)
    try:
        idle.result(timeout=10)
    except TimeoutError:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def hub_offline() -> None:
    """No Hub access from here on: a served process never fetches a model, a config or code."""
    import os

    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True  # read at import; is_offline_mode() reads this


@contextlib.contextmanager
def pinned(model_id: str):
    """transformers' server, built within the block, serves `model_id` only: its model manager
    loads nothing else and never unloads it, and /load_model and /reset answer 403."""
    import transformers.cli.serving.model_manager as managers
    import transformers.cli.serving.server as servers
    from fastapi import HTTPException
    from fastapi.responses import JSONResponse

    def refuse(what: str):
        raise HTTPException(status_code=403, detail=f"this server is pinned to {model_id}: it does not {what}")

    class PinnedModelManager(managers.ModelManager):
        def load_model_and_processor(self, model_id_and_revision, *args, **kwargs):
            if self.loaded_models and model_id_and_revision not in self.loaded_models:
                refuse("load other models")
            return super().load_model_and_processor(model_id_and_revision, *args, **kwargs)

        async def load_model_streaming(self, *args, **kwargs):
            refuse("load other models")
            yield  # an async generator, as the one it replaces

        def shutdown(self):  # /reset, and the idle timer; the process's own exit ends everything
            pass

    def build_server(*args, **kwargs):
        app = build(*args, **kwargs)
        app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in ("/load_model", "/reset")]
        for path, what in (("/load_model", "load other models"), ("/reset", "unload its model")):
            app.add_api_route(path, lambda what=what: JSONResponse({"error": f"this server is pinned to {model_id}: it does "
                                                                             f"not {what}"}, status_code=403), methods=["POST"])
        return app

    manager, build = managers.ModelManager, servers.build_server  # Serve imports both when it is built
    managers.ModelManager, servers.build_server = PinnedModelManager, build_server
    try:
        yield
    finally:
        managers.ModelManager, servers.build_server = manager, build
