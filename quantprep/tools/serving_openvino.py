"""`quantprep serve` for an openvino artifact: the OpenAI routes of the torch targets' server
(transformers' `serve`), over openvino.genai's pipeline.

/v1/models lists the one artifact; /v1/chat/completions and /v1/completions generate, streamed
(server-sent events) or not. Clients are untrusted, as for the torch targets: a request naming
another model answers 400, /load_model and /reset 403, an unknown field 422; message count, text
length and max_tokens are bounded before anything runs. The pipeline runs one request at a time
(openvino.genai's LLMPipeline is not re-entrant); a client that disconnects mid-stream cancels
its generation at the next token.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field  # module level: FastAPI resolves the request types by name here

MAX_MESSAGES = 256
MAX_TEXT = 200_000  # characters per message or prompt
MAX_NEW_TOKENS = 4096
DEFAULT_NEW_TOKENS = 256


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_TEXT)


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None


class ChatRequest(Request):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)


class CompletionRequest(Request):
    prompt: str = Field(max_length=MAX_TEXT)


def build_app(model, model_id: str):
    """The FastAPI app serving `model` (runtime.genai.OpenVINOModel) as `model_id`."""
    import openvino_genai
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    busy = threading.Lock()
    tokenizer = model.pipeline.get_tokenizer()

    def config_for(req: Request):
        if req.model not in (None, model_id):
            raise HTTPException(status_code=400, detail=f"this server serves {model_id} only, not {req.model!r}")
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = req.max_completion_tokens or req.max_tokens or DEFAULT_NEW_TOKENS
        config.apply_chat_template = False  # the prompt is already templated (chat) or plain (completions)
        if req.temperature:  # OpenAI's default is sampling; 0 or none here means greedy, as quantprep generate
            config.do_sample, config.temperature = True, req.temperature
            if req.top_p:
                config.top_p = req.top_p
            if req.seed is not None:
                config.rng_seed = req.seed
        return config

    def run(prompt: str, config, kind: str, stream: bool):
        rid, created = f"{kind}-{uuid.uuid4().hex}", int(time.time())
        obj = "chat.completion" if kind == "chatcmpl" else "text_completion"

        def choice(text: str, finish: str | None, delta: bool):
            if kind == "cmpl":
                return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            body = {"role": "assistant", "content": text}
            return {"index": 0, "finish_reason": finish, **({"delta": body} if delta else {"message": body})}

        def finish_of(tokens: int) -> str:
            return "length" if tokens >= config.max_new_tokens else "stop"

        if not stream:
            with busy:
                result = model.pipeline.generate([prompt], config)
            tokens = result.perf_metrics.get_num_generated_tokens()
            prompt_tokens = int(tokenizer.encode(prompt).input_ids.get_shape()[1])
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_id,
                                 "choices": [choice(result.texts[0], finish_of(tokens), False)],
                                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                                           "total_tokens": prompt_tokens + tokens}})

        chunks: queue.Queue = queue.Queue()
        cancelled = threading.Event()

        def on_text(text: str):
            chunks.put(text)
            return openvino_genai.StreamingStatus.CANCEL if cancelled.is_set() else openvino_genai.StreamingStatus.RUNNING

        def generate():
            try:
                with busy:
                    result = model.pipeline.generate([prompt], config, on_text)
                chunks.put(("end", result.perf_metrics.get_num_generated_tokens()))
            except Exception as e:  # reported to the client as the stream's last event
                chunks.put(("error", str(e)))

        def events():
            worker = threading.Thread(target=generate, daemon=True)
            worker.start()
            try:
                while True:
                    item = chunks.get()
                    if isinstance(item, tuple):
                        if item[0] == "error":
                            yield f"data: {json.dumps({'error': {'message': item[1]}})}\n\n"
                        else:
                            last = {"id": rid, "object": obj + ".chunk", "created": created, "model": model_id,
                                    "choices": [choice("", finish_of(item[1]), True)]}
                            yield f"data: {json.dumps(last)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    body = {"id": rid, "object": obj + ".chunk", "created": created, "model": model_id,
                            "choices": [choice(item, None, True)]}
                    yield f"data: {json.dumps(body)}\n\n"
            finally:  # the client went away (or the stream ended): stop generating at the next token
                cancelled.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "quantprep"}]}

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest):
        config = config_for(req)
        prompt = tokenizer.apply_chat_template([m.model_dump() for m in req.messages], add_generation_prompt=True)
        return run(prompt, config, "chatcmpl", req.stream)

    @app.post("/v1/completions")
    def completions(req: CompletionRequest):
        return run(req.prompt, config_for(req), "cmpl", req.stream)

    for path, what in (("/load_model", "load other models"), ("/reset", "unload its model")):
        app.add_api_route(path, lambda what=what: JSONResponse({"error": f"this server is pinned to {model_id}: it does not {what}"},
                                                               status_code=403), methods=["POST"])
    return app


def serve(model, host: str, port: int, ready=None) -> None:
    """Serve until SIGINT or SIGTERM; open streams get 3 s to end."""
    import signal

    import uvicorn

    model_id = str(model.quantprep_path)
    model.pipeline  # noqa: B018  compiled before the port opens
    server = uvicorn.Server(uvicorn.Config(build_app(model, model_id), host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=3))
    server.install_signal_handlers = lambda: None  # ours below: the same stop as the torch targets' server
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not server.started and thread.is_alive():
        time.sleep(0.05)
    if ready:
        ready({"model": model_id, "url": f"http://{host}:{port}/v1", "kcache": model.quantprep_kcache.get("status"), "warmup": "none"})
    while not stop.wait(0.2) and thread.is_alive():
        pass
    server.should_exit = True
    thread.join(timeout=10)
