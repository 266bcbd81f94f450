"""The HTTP app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health and
/metrics, on FastAPI, over an EngineWorker: the engine in a thread of this process (`Server(engine, config)`)
or in a child process of its own (`Server.over(ProcessWorker(...), tokenizer, config)`, as `kiln serve` runs).

Handlers never block the event loop: they hand prompts to the worker and await its outputs on an asyncio
queue. Errors are OpenAI's JSON shape (protocol.APIError). A stream is server-sent events ending in
`data: [DONE]`; a client that disconnects (mid-stream, or while waiting for a whole response) has its
request aborted at once, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.errors import KilnError
from kiln.infer.engine import LLMEngine, RequestOutput
from kiln.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_message
from kiln.serve.responses import ResponseBuilder, TokenText
from kiln.serve.worker import EngineWorker, RequestHandle, ThreadWorker
from kiln.tokenizer.chat import render_chat

LOOP_PROBE_S = 0.01  # the event-loop lag probe's period (kiln_event_loop_lag_seconds)
STREAM_INTERVAL_S = 0.02  # a stream's default pace: docs/serve.md, "The event loop at hundreds of streams"


@dataclass
class ServeConfig:
    """
    model_name      the name clients pass as `model` (another name is a 404)
    api_key         when set, /v1/* needs `Authorization: Bearer <api_key>` (401 otherwise)
    chat_template   Jinja chat template; None: /v1/chat/completions answers 400
    special_tokens  passed to the template (bos_token, eos_token), from tokenizer_config.json
    max_waiting     sequences that may wait beyond the engine's max_num_seqs running (then 503)
    max_body_bytes  request bodies larger than this are refused (413)
    stream_interval a stream sends at most one chunk per this many seconds (the tokens of the engine steps
                    in between go together in it; none is dropped); 0: one chunk per engine step. With
                    hundreds of streams, one wake-up and one SSE chunk per stream per engine step (~150
                    steps/s) kept the event loop behind, and admissions waited behind that work
    """

    model_name: str
    api_key: str | None = None
    chat_template: str | None = None
    special_tokens: dict | None = None
    max_waiting: int = 256
    max_body_bytes: int = 4 << 20
    stream_interval: float = STREAM_INTERVAL_S

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise KilnError("the served model name must be a non-empty string")
        if self.api_key is not None and not self.api_key:
            raise KilnError("--api-key must not be empty")
        if not isinstance(self.max_waiting, int) or self.max_waiting < 0:
            raise KilnError(f"max_waiting must be an integer >= 0, got {self.max_waiting!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise KilnError(f"max_body_bytes must be a positive integer, got {self.max_body_bytes!r}")
        si = self.stream_interval
        if isinstance(si, bool) or not isinstance(si, (int, float)) or not 0 <= si <= 1:
            raise KilnError(f"stream_interval must be a number of seconds in [0, 1], got {si!r}")


def _error(e: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    if e.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


# one encoder for every chunk: json.dumps with non-default separators builds a new JSONEncoder per call
_JSON = json.JSONEncoder(separators=(",", ":")).encode


def _sse(obj) -> str:
    return f"data: {_JSON(obj)}\n\n"


async def _abort(handle: RequestHandle) -> None:
    """handle.abort as a coroutine: Starlette runs a plain function's background task in its thread pool
    (a thread hop per request, and the admission count touched from outside the event loop)."""
    handle.abort()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body ({declared} bytes) exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Server:
    """The app's state: the engine worker, its metrics, the tokenizer, the config. `app` is the FastAPI
    application. `Server(engine, config)` runs `engine` in a thread of this process; `Server.over(worker,
    tokenizer, config)` serves through a worker already started (engine_process.ProcessWorker)."""

    def __init__(self, engine: LLMEngine, config: ServeConfig, log=print):
        self._setup(ThreadWorker(engine, config.max_waiting, log=log), engine.tokenizer, config, log)

    @classmethod
    def over(cls, worker: EngineWorker, tokenizer, config: ServeConfig, log=print) -> Server:
        """A server on `worker` (its tokenizer, loaded in this process, renders chat and logprob tokens)."""
        server = cls.__new__(cls)
        server._setup(worker, tokenizer, config, log)
        return server

    def _setup(self, worker: EngineWorker, tokenizer, config: ServeConfig, log) -> None:
        self.worker, self.tokenizer, self.config, self.log = worker, tokenizer, config, log
        self.metrics = worker.metrics
        self.tokens = TokenText(tokenizer)
        self._ids = 0
        self._deadline: threading.Timer | None = None
        self.app = self._build()

    def begin_shutdown(self, timeout: float) -> None:
        """Stop admitting (503) and give running requests `timeout` seconds before they are aborted; an
        aborted stream still ends properly (finish_reason "abort", then [DONE])."""
        self.worker.accepting = False
        if self._deadline is None:
            self._deadline = threading.Timer(timeout, self.worker.abort_all)
            self._deadline.daemon = True
            self._deadline.start()

    async def _watch_loop(self) -> None:
        """kiln_event_loop_lag_seconds: how late a sleep of LOOP_PROBE_S wakes (the loop's backlog)."""
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(LOOP_PROBE_S)
            self.metrics.loop_lag.observe(max(0.0, loop.time() - t - LOOP_PROBE_S))

    def _build(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app):
            self.worker.start()
            watch = asyncio.ensure_future(self._watch_loop())
            try:
                yield
            finally:
                watch.cancel()
                if self._deadline is not None:
                    self._deadline.cancel()
                self.worker.stop()

        app = FastAPI(title="kiln", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(APIError)
        async def api_error(request, e: APIError):
            return _error(e)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request, e: StarletteHTTPException):
            msg = {
                404: f"no route {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}",
            }
            return _error(APIError(e.status_code, msg.get(e.status_code, str(e.detail))))

        @app.exception_handler(Exception)
        async def internal_error(request, e: Exception):
            self.log(f"kiln serve: internal error: {type(e).__name__}: {e}")
            return _error(APIError(500, f"internal error: {type(e).__name__}"))

        @app.get("/health")
        async def health():
            if self.worker.healthy and self.worker.accepting:
                return {"status": "ok"}
            return _error(APIError(503, "the engine is not running (stopped or shutting down)"))

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models(request: Request):
            self._auth(request)
            card = {
                "id": self.config.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "kiln",
                "max_model_len": self.worker.max_model_len,
            }
            return {"object": "list", "data": [card]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await self._parse(request, CompletionRequest)
            return await self._completions(request, body)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await self._parse(request, ChatCompletionRequest)
            return await self._chat(request, body)

        return app

    # ---- request checks ----------------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not given.startswith("Bearer ") or not hmac.compare_digest(given[7:].encode(), key.encode()):
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'")

    async def _parse(self, request: Request, model):
        self._auth(request)
        raw = await _read_body(request, self.config.max_body_bytes)
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            msg, param = validation_message(e.errors())
            raise APIError(400, msg, param=param) from None
        if body.model != self.config.model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist: this server serves {self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )
        body.check_stream_options()
        return body

    def _next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}-{int(time.time() * 1000) % 10**9}"

    # ---- routes ------------------------------------------------------------------------------------------
    async def _completions(self, request: Request, body: CompletionRequest):
        prompts = body.prompts()
        k = body.logprobs
        params = body.sampling_params(
            16 if body.max_tokens is None else body.max_tokens,  # OpenAI's default for completions
            logprobs=k,
            prompt_logprobs=k if (body.echo and k is not None) else None,
        )
        echo = None
        if body.echo:
            tok = self.tokenizer
            echo = [p if isinstance(p, str) else (tok.decode(p) if tok is not None else "") for p in prompts]
        builder = ResponseBuilder(
            self._next_id("cmpl"), self.config.model_name, False, self.tokens, body.n, params.stop, k, echo
        )
        return await self._run(request, body, prompts, params, builder)

    async def _chat(self, request: Request, body: ChatCompletionRequest):
        tok = self.tokenizer
        if self.config.chat_template is None:
            raise APIError(
                400,
                "this model has no chat template: start the server with --chat-template FILE, or use "
                "/v1/completions",
                code="no_chat_template",
            )
        if tok is None:
            raise APIError(400, "this model has no tokenizer: only /v1/completions with token ids works")
        if not body.messages:
            raise APIError(400, "messages is empty: give at least one message", param="messages")
        try:
            text = render_chat(
                [m.as_template_dict() for m in body.messages],
                self.config.chat_template,
                add_generation_prompt=body.add_generation_prompt,
                **(self.config.special_tokens or {}),
            )
        except KilnError as e:
            raise APIError(400, str(e), param="messages") from None
        ids = list(tok.encode(text, allowed_special="all"))
        k = body.logprobs_k()
        want = body.requested_max_tokens()
        # no max_tokens: the rest of the context (at least 1, so an over-long prompt is a clear 400)
        max_tokens = want if want is not None else max(1, self.worker.max_model_len - len(ids))
        params = body.sampling_params(max_tokens, logprobs=k)
        builder = ResponseBuilder(
            self._next_id("chatcmpl"), self.config.model_name, True, self.tokens, body.n, params.stop, k
        )
        return await self._run(request, body, [ids], params, builder)

    async def _run(self, request: Request, body, prompts, params, builder: ResponseBuilder):
        handle = await self.worker.submit(prompts, params, stream=body.stream)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                self._stream(handle, builder, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                # runs even when a disconnect cancels the stream before its generator started
                background=BackgroundTask(_abort, handle),
            )
        finals: dict[int, RequestOutput] = {}
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while not handle.done:
                get = asyncio.ensure_future(handle.next())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():  # the client went away: abort (finally), answer nobody
                    get.cancel()
                    return Response(status_code=499)
                i, out = get.result()
                if out.finished:
                    finals[i] = out
        finally:
            gone.cancel()
            handle.abort()
        return builder.response([finals[i] for i in range(len(prompts))])

    async def _stream(self, handle: RequestHandle, builder: ResponseBuilder, include_usage: bool):
        finals: dict[int, RequestOutput] = {}
        try:
            while not handle.done:
                try:
                    outs = await handle.next_batch(self.config.stream_interval)
                except APIError as e:
                    yield _sse(e.body())
                    break
                events = []
                for i, out in outs:
                    if out.finished:
                        finals[i] = out
                    events.extend(_sse(chunk) for chunk in builder.chunks(i, out, include_usage))
                if events:  # one body message per wake-up: one h11 frame and one socket write each
                    yield "".join(events)
            else:
                if include_usage:
                    yield _sse(builder.usage_chunk(finals))
            yield "data: [DONE]\n\n"
        finally:  # also on a disconnect: Starlette cancels this generator, and the request is aborted
            handle.abort()


def build_app(engine: LLMEngine, config: ServeConfig, log=print) -> FastAPI:
    """The FastAPI app serving `engine` (its worker starts and stops with the app's lifespan)."""
    return Server(engine, config, log=log).app
