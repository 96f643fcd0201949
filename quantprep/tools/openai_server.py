"""`quantprep serve`'s OpenAI-compatible server: one FastAPI app over a backend that turns token ids
into token ids, the torch targets' (TorchBackend: a cpu, xpu or cuda artifact loaded as
from_pretrained loads it) or openvino's (OpenVINOBackend: openvino.genai's pipeline).

/v1/models lists the one artifact; /v1/chat/completions and /v1/completions generate, streamed
(server-sent events) or not. Clients are untrusted, and every request meets these bounds, the same
for both backends, before anything runs (the constants below are their one home):

- the server is pinned to its artifact: a request naming another model is 400, /load_model and
  /reset are 403;
- a body over MAX_BODY bytes is 413, read no further; a field the schema does not name is 422
  (`generation_config`, and with it a client's own token counts, is one), and so is n other than 1;
- slow clients hold bounded memory: the bodies being read, all connections together, hold at most
  MAX_BODIES bytes, and a request whose body would take more is 503 at once; a body not read whole
  within BODY_S seconds is 408; both drop the connection. uvicorn answers 503 past MAX_CONNECTIONS
  open connections (its limit_concurrency) and closes a keep-alive connection idle for KEEP_ALIVE_S;
- messages (MAX_MESSAGES), characters (MAX_TEXT) and max_tokens (MAX_NEW_TOKENS) are bounded
  (422), and the prompt's tokens and max_tokens must fit the model's context (400);
- the chat template renders in jinja2's sandbox, off the event loop; one that fails is a one-line
  400, and the server keeps serving;
- one generation runs at a time, on one worker thread (openvino.genai's pipeline is not re-entrant;
  xpu's oneDNN primitives, warmed there, are cached per thread); at most MAX_WAITING more wait, and
  past them a request is 503;
- a client that goes away, streaming or not, stops its generation at the next token, and a request
  whose client left while it waited never starts; a stop (SIGINT, SIGTERM) stops every generation
  at its next token before the process exits.
"""

import asyncio
import copy
import json
import os
import sys
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field  # module level: FastAPI resolves the request types by name here

from quantprep.errors import ArtifactError, QuantprepError

MAX_BODY = 4 << 20  # bytes of a request body
MAX_BODIES = 8 * MAX_BODY  # bytes of the request bodies being read (slow clients'), every connection's together
BODY_S = 10  # seconds to read a whole request body, from its headers
MAX_CONNECTIONS = 64  # open connections (uvicorn's limit_concurrency): past them a request is 503
KEEP_ALIVE_S = 5  # seconds an idle keep-alive connection stays open (uvicorn's timeout_keep_alive)
MAX_MESSAGES = 256
MAX_TEXT = 200_000  # characters in all of a request's messages, or its prompt
MAX_NEW_TOKENS = 4096
DEFAULT_NEW_TOKENS = 256
MAX_WAITING = 8  # requests queued behind the one generating
DISCONNECT_POLL_S = 0.1  # how often a request in flight checks that its client is still there


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
    n: int | None = Field(None, ge=1, le=1)  # one choice per request: the backends generate one sequence
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=2**32 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None


class ChatRequest(Request):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)


class CompletionRequest(Request):
    prompt: str = Field(min_length=1, max_length=MAX_TEXT)


@dataclass(frozen=True)
class Sampling:
    """What a request asks of its generation, within the bounds: greedy unless temperature > 0."""

    new_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None

    def apply(self, config) -> None:
        """Onto a generation config, transformers' or openvino.genai's (their fields share these names)."""
        config.do_sample = bool(self.temperature)
        if config.do_sample:
            config.temperature = self.temperature
            if self.top_p:
                config.top_p = self.top_p


# --- backends: model_id, tokenizer (chat_ids, text_ids, decode; a failure is an ArtifactError line), context,
# vocab_size, kcache, warm() and generate(), which the worker thread runs ---

class TransformersTokenizer:
    """AutoTokenizer behind the backends' tokenizer interface, for torch artifacts: it reads every
    tokenizer format transformers reads and gives the prompt ids `quantprep generate` gives (its chat
    template renders in jinja2's immutable sandbox too). Its failures become one line."""

    def __init__(self, path: Path):
        from transformers import AutoTokenizer

        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self._failing_as_one_line("the chat template failed", lambda: list(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]))

    def text_ids(self, text: str) -> list[int]:
        return self._failing_as_one_line("cannot encode the prompt", lambda: list(self.tokenizer(text, add_special_tokens=True)["input_ids"]))

    def decode(self, ids: list[int]) -> str:
        return self._failing_as_one_line("cannot decode the tokens", lambda: self.tokenizer.decode(ids, skip_special_tokens=True))

    def _failing_as_one_line(self, what: str, call):
        from quantprep.runtime.tokenizer import said

        try:
            return call()
        except Exception as e:  # raise_exception, a jinja error, RecursionError, no template: the artifact's, not the server's
            raise ArtifactError(f"{self.path}: {what} ({type(e).__name__}: {said(e)})") from None


class TorchBackend:
    """A torch artifact (cpu, xpu, cuda) loaded by from_pretrained through quantprep's quantizer, with
    --trust-kcache and --verify-key applied to that one load (hf_quantizer.load_options); generates
    with the prompt's prefill at warmed lengths (serving.generate)."""

    def __init__(self, path: Path, device: str, trust_kcache: bool, key, signed: bool):
        from transformers import AutoModelForCausalLM

        from quantprep.runtime.hf_quantizer import load_options, register

        register()
        with load_options(path, trust_kcache, key, signed):
            self.model = AutoModelForCausalLM.from_pretrained(path, device_map=device, dtype="auto", trust_remote_code=False)
        self.model_id, self.kcache = str(path), self.model.quantprep_kcache.get("status")
        self.tokenizer = TransformersTokenizer(path)
        self.context = getattr(self.model.config, "max_position_embeddings", None)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.device = next(self.model.parameters()).device

    def warm(self):
        """The artifact's warmed shapes, run once: on the worker thread, where every generation runs
        (PyTorch's oneDNN primitive cache on xpu is per thread); where kernels are built ahead (cpu) there is
        no per-process kernel state to warm."""
        from quantprep.runtime.torch_model import run_shapes
        from quantprep.targets import device_target

        if not device_target(self.device.type).jit_kernels:
            return "none"
        return [t["prefill"] for t in run_shapes(self.model, self.model.quantprep_buckets)]

    def generate(self, ids: list[int], sampling: Sampling, emit, stop) -> list[int]:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        from quantprep.tools.serving import generate

        class Emitted(BaseStreamer):
            prompt = True

            def put(self, value):
                if self.prompt:  # generate puts the prompt first
                    self.prompt = False
                    return
                for token in value.reshape(-1).tolist():
                    emit(token)

            def end(self):
                pass

        class Stopped(StoppingCriteria):  # read after every token
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), stop(), dtype=torch.bool, device=input_ids.device)

        config = copy.deepcopy(self.model.generation_config)  # the artifact's (eos, repetition penalty), bounded by the request
        config.max_new_tokens, config.num_beams, config.num_return_sequences = sampling.new_tokens, 1, 1
        sampling.apply(config)
        if config.do_sample and sampling.seed is not None:
            torch.manual_seed(sampling.seed)  # this thread runs one generation at a time
        if config.pad_token_id is None:
            eos = config.eos_token_id
            config.pad_token_id = (eos[0] if isinstance(eos, list) else eos) or 0
        prompt = torch.tensor([ids], device=self.device)
        out = generate(self.model, prompt, generation_config=config, pad_token_id=config.pad_token_id, streamer=Emitted(),
                       stopping_criteria=StoppingCriteriaList([Stopped()]))
        return out[0, len(ids):].tolist()


class OpenVINOBackend:
    """An openvino artifact (runtime.openvino.OpenVINOModel): its pipeline takes and gives token ids;
    quantprep's ArtifactTokenizer renders the chat template and encodes and decodes, so the artifact's
    tokenizer IR and openvino.genai's C++ Jinja never run here."""

    def __init__(self, model):
        self.model, self.model_id, self.kcache = model, str(model.quantprep_path), model.quantprep_kcache.get("status")
        self.tokenizer = model.tokenizer  # a template that cannot be used fails each chat request (400); completions still run
        self.context, self.vocab_size = model.max_position_embeddings(), model.vocab_size()
        model.pipeline  # noqa: B018  compiled before the port opens

    def warm(self):
        return "none"  # compiled above; OpenVINO keeps no per-thread state

    def generate(self, ids: list[int], sampling: Sampling, emit, stop) -> list[int]:
        import openvino_genai

        class Emitted(openvino_genai.StreamerBase):
            def write(self, token):
                for t in token if isinstance(token, list) else [token]:
                    emit(int(t))
                return openvino_genai.StreamingStatus.CANCEL if stop() else openvino_genai.StreamingStatus.RUNNING

            def end(self):
                pass

        config = self.model.generation_config(sampling.new_tokens)  # greedy, the artifact's eos and repetition penalty
        sampling.apply(config)
        if config.do_sample and sampling.seed is not None:
            config.rng_seed = sampling.seed
        return self.model.generate_ids(ids, config, Emitted())


# --- the app ---

class BoundedBody:
    """ASGI middleware: a request's body is read here, at most MAX_BODY bytes, before the route parses
    it. A Content-Length over the bound, or a chunked body that grows past it, is answered 413 at once.
    The bodies being read hold at most MAX_BODIES bytes together, counted as they arrive, until each is
    read whole: a request whose body would take more is 503 at once, and a body not read whole within
    BODY_S seconds is 408; both drop the connection (its client may still be sending). One instance
    per app, on one event loop: the count needs no lock."""

    def __init__(self, app):
        self.app = app
        self.reading = 0  # bytes the bodies being read hold, every connection's together

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        size = dict(scope["headers"]).get(b"content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
            return await self.refuse(scope, receive, send, 413)
        held = 0  # bytes of this body read so far: its share of self.reading

        async def read():
            """The body; or the status refusing it; or None: the client left before sending it all."""
            nonlocal held
            parts, more = [], True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return None
                parts.append(message.get("body", b""))
                if held + len(parts[-1]) > MAX_BODY:
                    return 413
                if self.reading + len(parts[-1]) > MAX_BODIES:
                    return 503
                self.reading, held = self.reading + len(parts[-1]), held + len(parts[-1])
                more = message.get("more_body", False)
            return b"".join(parts)

        try:
            async with asyncio.timeout(BODY_S):
                body = await read()
        except TimeoutError:
            body = 408
        finally:
            self.reading -= held
        if body is None:
            return
        if isinstance(body, int):
            return await self.refuse(scope, receive, send, body)
        given = False

        async def replay():  # the body once, then the connection's own messages (its disconnect)
            nonlocal given
            if given:
                return await receive()
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    @staticmethod
    async def refuse(scope, receive, send, status: int):
        """A body refused, the rest of it unread: 413 keeps the connection, 503 and 408 close it."""
        from starlette.responses import JSONResponse

        error = {413: f"request body over {MAX_BODY} bytes",
                 503: f"the request bodies being read would pass {MAX_BODIES} bytes; retry later",
                 408: f"the request body did not arrive within {BODY_S} s"}[status]
        headers = {"Connection": "close"} if status != 413 else None
        await JSONResponse({"error": error}, status_code=status, headers=headers)(scope, receive, send)


class IncrementalText:
    """The text each new token adds, for streaming: decoding a window of the last tokens, since a token
    can end inside a UTF-8 character or change how the one before it decodes; the pieces join to the
    text of all the tokens decoded at once."""

    def __init__(self, decode):
        self.decode, self.ids, self.start, self.done = decode, [], 0, 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._new(final=False)

    def flush(self) -> str:
        return self._new(final=True)

    def _new(self, final: bool) -> str:
        before = self.decode(self.ids[self.start:self.done])
        after = self.decode(self.ids[self.start:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.start, self.done = self.done, len(self.ids)
        return after[len(before):]


def build_app(backend, stopping: threading.Event, worker: ThreadPoolExecutor):
    """The FastAPI app serving `backend` (TorchBackend or OpenVINOBackend) as its model_id.
    stopping: set when the server stops, which stops every generation; worker: the one thread that
    generates."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.requests import Request as HttpRequest

    model_id, tokenizer, context = backend.model_id, backend.tokenizer, backend.context
    app = FastAPI()
    app.add_middleware(BoundedBody)
    slots = threading.BoundedSemaphore(MAX_WAITING + 1)  # the generating request and those waiting behind it
    watchers = set()  # the disconnect watchers' tasks, held (the event loop keeps only weak references)

    def generation(ids, sampling, emit, cancel) -> list[int]:
        """On the worker thread: one generation, stopped at its next token once cancelled or stopping."""
        def stop():
            return cancel.is_set() or stopping.is_set()

        if stop():  # its client left, or the server stops, while it waited
            return []
        try:
            return backend.generate(ids, sampling, emit, stop)
        except Exception as e:  # the detail to the server's log, not to the client
            print(f"quantprep serve: generation failed: {e}", file=sys.stderr, flush=True)
            raise

    def abandon(future: Future, cancel: threading.Event):
        """Nothing more of this generation is wanted: it stops at its next token, or never starts (and
        gives its place in the queue back at once)."""
        cancel.set()
        future.cancel()

    async def abandon_on_disconnect(http, future: Future, cancel: threading.Event):
        while not future.done():  # polled: Starlette tells a handler of a disconnect only when asked
            if await http.is_disconnected():
                abandon(future, cancel)
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    async def answer(http, req: Request, kind: str, encode):
        if req.model not in (None, model_id):
            raise HTTPException(status_code=400, detail=f"this server serves {model_id} only, not {req.model!r}")
        if not slots.acquire(blocking=False):
            raise HTTPException(status_code=503, detail=f"{MAX_WAITING} requests are already waiting; retry later")
        try:
            sampling = Sampling(req.max_completion_tokens or req.max_tokens or DEFAULT_NEW_TOKENS, req.temperature, req.top_p, req.seed)
            try:
                ids = await asyncio.to_thread(encode)  # a template may take its time: not on the event loop
            except ArtifactError as e:
                raise HTTPException(status_code=400, detail=str(e)) from None
            if not ids:
                raise HTTPException(status_code=400, detail="the prompt is empty")
            if max(ids) >= backend.vocab_size:  # a tokenizer larger than the model: its ids would index past the embedding
                raise HTTPException(status_code=400, detail=f"the prompt has token id {max(ids)}, past the model's {backend.vocab_size}")
            if context and len(ids) + sampling.new_tokens > context:
                raise HTTPException(status_code=400, detail=f"the prompt's {len(ids)} tokens and max_tokens {sampling.new_tokens} do not "
                                                            f"fit the model's context of {context} tokens")
            loop, tokens, cancel = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

            def emit(token: int):
                if req.stream:
                    loop.call_soon_threadsafe(tokens.put_nowait, token)

            future = worker.submit(generation, ids, sampling, emit, cancel)
        except BaseException:
            slots.release()
            raise
        future.add_done_callback(lambda _: slots.release())
        watcher = asyncio.create_task(abandon_on_disconnect(http, future, cancel))
        watchers.add(watcher)
        watcher.add_done_callback(watchers.discard)
        rid, created = f"{kind}-{uuid.uuid4().hex}", int(time.time())
        obj = "chat.completion" if kind == "chatcmpl" else "text_completion"

        def body(text: str, finish: str | None, delta: bool, usage: dict | None = None) -> dict:
            if kind == "cmpl":
                choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            else:
                message = {"role": "assistant", "content": text}
                choice = {"index": 0, "finish_reason": finish, **({"delta": message} if delta else {"message": message})}
            out = {"id": rid, "object": obj + (".chunk" if delta else ""), "created": created, "model": model_id, "choices": [choice]}
            return out | ({"usage": usage} if usage else {})

        def usage(new: list[int]) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": len(new), "total_tokens": len(ids) + len(new)}

        def finish(new: list[int]) -> str:
            return "length" if len(new) >= sampling.new_tokens else "stop"

        if not req.stream:
            try:
                new = await asyncio.wrap_future(future)
            except asyncio.CancelledError:
                if not future.cancelled():  # this handler is cancelled, not the generation
                    raise
                raise HTTPException(status_code=503, detail="cancelled: the client went away") from None  # read by no one
            except Exception:
                raise HTTPException(status_code=500, detail="generation failed") from None
            finally:
                abandon(future, cancel)
            return JSONResponse(body(tokenizer.decode(new), finish(new), False, usage(new)))

        def ended(done: Future):  # after every token it put: the worker puts them in order
            try:
                loop.call_soon_threadsafe(tokens.put_nowait, done)
            except RuntimeError:  # the event loop closed (the server stopped)
                pass

        future.add_done_callback(ended)

        async def events():
            text = IncrementalText(tokenizer.decode)
            try:
                while True:
                    item = await tokens.get()
                    if not isinstance(item, Future):
                        if piece := text.add(item):
                            yield f"data: {json.dumps(body(piece, None, True))}\n\n"
                        continue
                    if item.cancelled() or item.exception() is not None:
                        yield f"data: {json.dumps({'error': {'message': 'generation failed'}})}\n\n"
                    else:
                        new = item.result()
                        yield f"data: {json.dumps(body(text.flush(), finish(new), True))}\n\n"
                        if req.stream_options and req.stream_options.include_usage:
                            yield f"data: {json.dumps(body('', None, True, usage(new)) | {'choices': []})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
            finally:  # the stream ended, or its client went away (Starlette closes this generator)
                abandon(future, cancel)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/models")
    def models():
        created = int(Path(model_id).stat().st_mtime)
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "quantprep"}]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, http: HttpRequest):
        if sum(len(m.content) for m in req.messages) > MAX_TEXT:
            raise HTTPException(status_code=400, detail=f"the messages hold more than {MAX_TEXT} characters")
        messages = [m.model_dump() for m in req.messages]
        return await answer(http, req, "chatcmpl", lambda: tokenizer.chat_ids(messages))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: HttpRequest):
        return await answer(http, req, "cmpl", lambda: tokenizer.text_ids(req.prompt))

    for path, what in (("/load_model", "load other models"), ("/reset", "unload its model")):
        app.add_api_route(path, lambda what=what: JSONResponse({"error": f"this server is pinned to {model_id}: it does not {what}"},
                                                               status_code=403), methods=["POST"])
    return app


def run(backend, host: str, port: int, warmup: bool = True, ready=None) -> None:
    """Serve `backend` until SIGINT or SIGTERM: then every generation stops at its next token, open
    streams get 3 s to end, and the process exits without waiting on a generation that does not stop.
    warmup: backend.warm() first, on the thread that generates. `ready(info)` is called once serving."""
    import signal

    import uvicorn

    worker = ThreadPoolExecutor(1, thread_name_prefix="quantprep-generate")
    info = {"model": backend.model_id, "url": f"http://{host}:{port}/v1", "kcache": backend.kcache,
            "warmup": worker.submit(backend.warm).result() if warmup else "none"}
    stopping = threading.Event()
    server = uvicorn.Server(uvicorn.Config(build_app(backend, stopping, worker), host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=3, limit_concurrency=MAX_CONNECTIONS,
                                           timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, daemon=True)  # off the main thread, uvicorn leaves the signals to us
    thread.start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not server.started and thread.is_alive():
        time.sleep(0.05)
    if not server.started:
        raise QuantprepError(f"{host}:{port}: the server could not listen there (in use?); pass another --port")
    if ready:
        ready(info)
    while not stop.wait(0.2) and thread.is_alive():
        pass
    stopping.set()  # every generation stops at its next token, and those waiting never start
    server.should_exit = True
    thread.join(timeout=10)
    # a generation still inside torch or OpenVINO when the interpreter exits aborts the process (SIGABRT,
    # seen in CI): wait for the worker to be idle (bounded), else leave without the interpreter's teardown
    try:
        worker.submit(lambda: None).result(timeout=10)
        worker.shutdown(wait=False)
    except TimeoutError:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
