"""`quantprep serve` for an openvino artifact: the OpenAI routes of the torch targets' server
(transformers' `serve`), over openvino.genai's pipeline.

/v1/models lists the one artifact; /v1/chat/completions and /v1/completions generate, streamed
(server-sent events) or not. Clients are untrusted, as for the torch targets: a request naming
another model answers 400, /load_model and /reset 403, an unknown field 422, a body over
MAX_BODY 413; message count, text length, the prompt's tokens (against the model's context) and
max_tokens are bounded before anything runs. The pipeline runs one request at a time (openvino.genai's
LLMPipeline is not re-entrant), at most MAX_WAITING more wait (then 503); a client that disconnects
mid-stream cancels its generation at the next token, and a stop (SIGINT, SIGTERM) cancels every
generation before the process exits.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field  # module level: FastAPI resolves the request types by name here

MAX_MESSAGES = 256
MAX_TEXT = 200_000  # characters in all of a request's messages, or its prompt
MAX_BODY = 4 << 20  # bytes of a request body
MAX_NEW_TOKENS = 4096
DEFAULT_NEW_TOKENS = 256
MAX_WAITING = 8  # requests queued behind the one generating


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_TEXT)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=2**32 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None


class ChatRequest(Request):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)


class CompletionRequest(Request):
    prompt: str = Field(min_length=1, max_length=MAX_TEXT)


def build_app(model, model_id: str, context: int | None, stopping: threading.Event, busy: threading.Lock):
    """The FastAPI app serving `model` (runtime.genai.OpenVINOModel) as `model_id`. context: the
    model's max_position_embeddings (prompt + new tokens must fit); stopping: set when the server
    stops, which cancels every generation; busy: held while the pipeline generates."""
    import numpy as np
    import openvino as ov
    import openvino_genai
    from fastapi import FastAPI, HTTPException
    from fastapi import Request as HttpRequest
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    waiting = threading.BoundedSemaphore(MAX_WAITING + 1)
    tokenizer = model.pipeline.get_tokenizer()

    @app.middleware("http")
    async def bounded_body(request: HttpRequest, call_next):
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
            return JSONResponse({"error": f"request body over {MAX_BODY} bytes"}, status_code=413)
        if size is None and request.method == "POST":  # chunked: read it here, bounded, before the route does
            body = b""
            async for part in request.stream():
                body += part
                if len(body) > MAX_BODY:
                    return JSONResponse({"error": f"request body over {MAX_BODY} bytes"}, status_code=413)
            request._body = body
        return await call_next(request)

    def prepare(req: Request, prompt: str, special: bool):
        """(token ids [1, n], generation config) after every bound; HTTPException otherwise."""
        if req.model not in (None, model_id):
            raise HTTPException(status_code=400, detail=f"this server serves {model_id} only, not {req.model!r}")
        ids = tokenizer.encode(prompt, add_special_tokens=special).input_ids.data.copy()
        new = req.max_completion_tokens or req.max_tokens or DEFAULT_NEW_TOKENS
        if ids.shape[1] == 0:
            raise HTTPException(status_code=400, detail="the prompt is empty")
        if context and ids.shape[1] + new > context:
            raise HTTPException(status_code=400, detail=f"the prompt's {ids.shape[1]} tokens and max_tokens {new} do not fit the "
                                                        f"model's context of {context} tokens")
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = new
        if req.temperature:  # OpenAI's default is sampling; 0 or none here means greedy, as quantprep generate
            config.do_sample, config.temperature = True, req.temperature
            if req.top_p:
                config.top_p = req.top_p
            if req.seed is not None:
                config.rng_seed = req.seed
        return ids, config

    def admitted():
        if not waiting.acquire(blocking=False):
            raise HTTPException(status_code=503, detail=f"{MAX_WAITING} requests are already waiting; retry later")

    def generate(ids, config, streamer=None) -> list[int]:
        """The pipeline, one request at a time; token ids in, new token ids out (the templates applied already)."""
        try:
            with busy:
                if stopping.is_set():
                    return []
                return list(model.pipeline.generate(ov.Tensor(np.ascontiguousarray(ids)), config, streamer).tokens[0])
        finally:
            waiting.release()

    async def run(ids, config, kind: str, stream: bool):
        rid, created = f"{kind}-{uuid.uuid4().hex}", int(time.time())
        obj = "chat.completion" if kind == "chatcmpl" else "text_completion"

        def choice(text: str, finish: str | None, delta: bool):
            if kind == "cmpl":
                return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            body = {"role": "assistant", "content": text}
            return {"index": 0, "finish_reason": finish, **({"delta": body} if delta else {"message": body})}

        def finish_of(tokens: int) -> str:
            return "length" if tokens >= config.max_new_tokens else "stop"

        admitted()
        if not stream:
            try:
                tokens = await asyncio.to_thread(generate, ids, config)
            except Exception as e:  # the detail to the server's log, not to the client
                print(f"quantprep serve: generation failed: {e}", file=sys.stderr, flush=True)
                raise HTTPException(status_code=500, detail="generation failed") from None
            n = int(ids.shape[1])
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_id,
                                 "choices": [choice(tokenizer.decode(tokens, skip_special_tokens=True), finish_of(len(tokens)), False)],
                                 "usage": {"prompt_tokens": n, "completion_tokens": len(tokens), "total_tokens": n + len(tokens)}})

        loop, chunks = asyncio.get_running_loop(), asyncio.Queue()
        cancelled = threading.Event()

        def on_text(text: str):
            loop.call_soon_threadsafe(chunks.put_nowait, text)
            stop = cancelled.is_set() or stopping.is_set()
            return openvino_genai.StreamingStatus.CANCEL if stop else openvino_genai.StreamingStatus.RUNNING

        def worker():
            try:
                item = ("end", len(generate(ids, config, on_text)))
            except Exception as e:
                print(f"quantprep serve: generation failed: {e}", file=sys.stderr, flush=True)
                item = ("error", "generation failed")
            loop.call_soon_threadsafe(chunks.put_nowait, item)

        async def events():
            threading.Thread(target=worker, daemon=True).start()
            try:
                while True:
                    item = await chunks.get()
                    if isinstance(item, tuple):
                        if item[0] == "error":
                            yield f"data: {json.dumps({'error': {'message': item[1]}})}\n\n"
                        else:
                            last = {"id": rid, "object": obj + ".chunk", "created": created, "model": model_id,
                                    "choices": [choice("", finish_of(item[1]), True)]}
                            yield f"data: {json.dumps(last)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    body = {"id": rid, "object": obj + ".chunk", "created": created, "model": model_id, "choices": [choice(item, None, True)]}
                    yield f"data: {json.dumps(body)}\n\n"
            finally:  # the stream ended, or the client went away (Starlette cancels this generator): stop at the next token
                cancelled.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "quantprep"}]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        if sum(len(m.content) for m in req.messages) > MAX_TEXT:
            raise HTTPException(status_code=400, detail=f"the messages hold more than {MAX_TEXT} characters")
        prompt = tokenizer.apply_chat_template([m.model_dump() for m in req.messages], add_generation_prompt=True)
        ids, config = prepare(req, prompt, special=False)  # the template holds the special tokens
        return await run(ids, config, "chatcmpl", req.stream)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        ids, config = prepare(req, req.prompt, special=True)
        return await run(ids, config, "cmpl", req.stream)

    for path, what in (("/load_model", "load other models"), ("/reset", "unload its model")):
        app.add_api_route(path, lambda what=what: JSONResponse({"error": f"this server is pinned to {model_id}: it does not {what}"},
                                                               status_code=403), methods=["POST"])
    return app


def serve(model, host: str, port: int, ready=None) -> None:
    """Serve until SIGINT or SIGTERM: then every generation is cancelled at its next token, open
    streams get 3 s to end, and the process exits without waiting on a generation that does not stop."""
    import os
    import signal

    import uvicorn

    from quantprep.errors import QuantprepError

    model_id = str(model.quantprep_path)
    model.pipeline  # noqa: B018  compiled before the port opens
    context = model.max_position_embeddings()
    stopping, busy = threading.Event(), threading.Lock()
    server = uvicorn.Server(uvicorn.Config(build_app(model, model_id, context, stopping, busy), host=host, port=port,
                                           log_level="warning", timeout_graceful_shutdown=3))
    server.install_signal_handlers = lambda: None  # ours below: the same stop as the torch targets' server
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not server.started and thread.is_alive():
        time.sleep(0.05)
    if not server.started:
        raise QuantprepError(f"{host}:{port}: the server could not listen there (in use?); pass another --port")
    if ready:
        ready({"model": model_id, "url": f"http://{host}:{port}/v1", "kcache": model.quantprep_kcache.get("status"), "warmup": "none"})
    while not stop.wait(0.2) and thread.is_alive():
        pass
    stopping.set()  # every generation stops at its next token
    server.should_exit = True
    thread.join(timeout=10)
    # a generation still inside OpenVINO when the interpreter exits aborts the process: wait for it
    # to stop (bounded), else leave without the interpreter's teardown
    if busy.acquire(timeout=10):
        busy.release()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
