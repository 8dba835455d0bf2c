"""The OpenAI-compatible HTTP API on FastAPI: /v1/models, /v1/completions, /v1/chat/completions,
/tokenize, /detokenize, /health, /metrics, and the web chat page at /; Anthropic's /v1/messages and
/v1/messages/count_tokens (corelm.openai.anthropic); OpenAI's /v1/responses (corelm.openai.responses_api). See corelm.entrypoints.server for the overview."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.responses import Response as HTTPResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ...openai import CHAT_URL, COMPLETIONS_URL, APIError, Response, TokenText, bad_request, sampling_error
from ...openai import anthropic, embeddings, responses_api, routes
from ...openai.protocol import check_prompt_bytes, prompt_byte_limit
from .guard import HostGuard
from .router import Lease, ModelRouter
from .request_log import RequestLog, model_block
from .runner import EngineFailed, EngineRunner, Metrics, make_engine
from .tokens import detokenize, tokenize

log = logging.getLogger("corelm.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0     # a request body not fully received by then is a 408 (connection closed)
STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
# The web chat page's files (a fixed list: no path from the URL reaches the file system) and their types.
STATIC_FILES = {"index.html": "text/html; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
                "chat.css": "text/css; charset=utf-8", "favicon.svg": "image/svg+xml"}
# Only the page's own files and API; no inline script or handler runs, whatever ends up in the page.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                           "form-action 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                "Cache-Control": "no-cache"}
_DISCONNECTED = object()
_SHUTDOWN = object()      # put on every open request's queue when the server starts shutting down


@dataclass
class ServerConfig:
    model_name: str
    api_key: Optional[str] = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_pending: int = 512    # choices queued or running; more get a 503
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S


class ServerState:
    """What the endpoints share: the load status; the LLM, its engine and the engine runner once loaded; or,
    serving several models, the router (router.py), whose models load on demand."""

    def __init__(self, load_llm: Optional[Callable[[], Any]], config: ServerConfig,
                 on_load_error: Optional[Callable[[BaseException], None]] = None,
                 router: Optional[ModelRouter] = None):
        self.load_llm = load_llm
        self.router = router
        self.config = config
        self.on_load_error = on_load_error
        self.metrics = Metrics()
        self.status = "loading"          # -> "ready" | "failed"
        self.llm = None
        self.engine = None
        self.runner: Optional[EngineRunner] = None
        self.tokens: Optional[TokenText] = None
        self.max_prompt_bytes: Optional[int] = None
        self.created = int(time.time())
        self.stopping = False
        self.open_queues: "dict[asyncio.Queue, asyncio.AbstractEventLoop]" = {}   # requests in flight
        self._loader = threading.Thread(target=self._load, name="corelm-load", daemon=True)

    def start_loading(self) -> None:
        self._loader.start()

    def _load(self) -> None:
        if self.router is not None:   # nothing loads up front: a model loads when a request names it
            self.runner = self.router.start(self.metrics, on_dead=self._engine_died)
            self.status = "ready"
            return
        try:
            llm = self.load_llm()
            engine = make_engine(llm)
            make_runner = getattr(llm, "make_runner", None)   # replicas.ReplicatedLLM: its replicas' runner
            runner = (make_runner(self.metrics, on_dead=self._engine_died) if make_runner is not None
                      else EngineRunner(engine, self.metrics, on_dead=self._engine_died))
            self.max_prompt_bytes = prompt_byte_limit(engine)
            runner.start()
            self.llm, self.engine, self.tokens, self.runner = llm, engine, TokenText(engine.tokenizer), runner
            self.status = "ready"
            log.info(model_block(self.config.model_name, llm))
        except BaseException as e:  # noqa: BLE001  (reported through /health and on_load_error)
            self.status = "failed"
            log.error("the model failed to load: %s", e)
            if self.on_load_error is not None:
                self.on_load_error(e)

    def _engine_died(self, e: BaseException) -> None:
        """The engine can serve no more (a tensor-parallel rank died): /health and new requests answer 503, and
        `corelm serve` stops with an error (on_load_error) rather than serve nothing."""
        self.status = "failed"
        if self.on_load_error is not None:
            self.on_load_error(e)

    async def lease(self, name: Optional[str]) -> Lease:
        """The model a request names: the router's (loaded first, a 404 for an unknown name), else the one
        model whatever the name."""
        if self.router is not None:
            return await self.router.acquire(name)
        return Lease(self.config.model_name, self.engine, self.runner, self.tokens, self.max_prompt_bytes)

    def wait_ready(self, timeout: float) -> bool:
        self._loader.join(timeout)
        return self.status == "ready"

    def begin_shutdown(self) -> None:
        """The server is about to stop: every request in flight ends now (a stream with an error
        event and [DONE], others with a 503), so the server need not wait for them, nor cancel them."""
        self.stopping = True
        for queue, loop in list(self.open_queues.items()):
            loop.call_soon_threadsafe(queue.put_nowait, _SHUTDOWN)

    def shutdown(self) -> None:
        if self.router is not None:
            self.router.stop()
        elif self.runner is not None:
            self.runner.stop()


def _sse(obj: Any) -> str:
    # ASCII-only JSON: the stream can never carry a broken UTF-8 sequence.
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _OpenAIStream:
    """A streamed OpenAI response's SSE text: data-only events, ended by [DONE] (after an error too);
    anthropic.MessageStream is the same for /v1/messages."""

    def __init__(self, response: Response):
        self.response = response

    def start(self):
        return [_sse(event) for event in self.response.stream_start()]

    def add(self, item):
        entry = self.response.add(*item)
        return [] if entry is None else [_sse(self.response.stream_chunk([entry]))]

    def end(self):
        return [_sse(event) for event in self.response.stream_end()] + ["data: [DONE]\n\n"]

    @staticmethod
    def error(e: APIError):
        return [_sse(e.body()), "data: [DONE]\n\n"]


# ---------------------------------------------------------------------------------------------------
# Request plumbing

async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused with a 413 as soon as it is known to be too big (before parsing), and with a
    408 when it has not all arrived `timeout` seconds after the headers (a stalled upload holds a
    connection, and its file descriptor, for no longer). Raises starlette's ClientDisconnect when the
    client leaves mid-upload."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise bad_request("Invalid Content-Length header.")
        if int(length) > limit:
            raise APIError(413, f"The request body exceeds the limit of {limit} bytes.", code="request_too_large")

    async def read() -> bytes:
        parts, total = [], 0
        async for part in request.stream():
            total += len(part)
            if total > limit:
                raise APIError(413, f"The request body exceeds the limit of {limit} bytes.",
                               code="request_too_large")
            parts.append(part)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout:g} seconds.",
                       code="request_timeout") from None


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is already read, so the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---------------------------------------------------------------------------------------------------

def create_app(load_llm: Optional[Callable[[], Any]], model_name: Optional[str], *, api_key: Optional[str] = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_pending: int = 512,
               body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
               on_load_error: Optional[Callable[[BaseException], None]] = None,
               allowed_hosts: Sequence[str] = (), allowed_origins: Sequence[str] = (),
               router: Optional[ModelRouter] = None) -> FastAPI:
    """The ASGI app. `load_llm()` runs in a background thread once the server is up; until it returns,
    /health and the generation endpoints answer 503. A body not received within `body_timeout`
    seconds gets a 408 and the connection is closed. Requests whose Host is not an IP address, a
    localhost name or one of `allowed_hosts` ("*" for any) get a 400 (guard.HostGuard); CORS headers
    go only to the `allowed_origins` ("*" for any), none by default. POST bodies must be
    application/json (a 415 otherwise: a cross-site form or text/plain POST never reaches the API).
    With `router` (load_llm and model_name None) it serves the router's models by a request's `model`, and
    POST /models/load and /models/unload."""
    state = ServerState(load_llm, ServerConfig(model_name, api_key, max_body_bytes, max_pending, body_timeout),
                        on_load_error, router)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        state.start_loading()
        try:
            yield
        finally:
            state.shutdown()

    app = FastAPI(title="corelm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.corelm = state
    origins = [o.strip() for o in allowed_origins if o and o.strip()]
    if origins:
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"], max_age=600)
    app.add_middleware(HostGuard, allowed_hosts=allowed_hosts)     # added last: runs first
    metrics = state.metrics
    key = api_key.encode("utf-8") if api_key else None

    def error_response(e: APIError, path: str = "") -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        if e.status == 408:            # the rest of the body may never come
            headers = {"Connection": "close"}
        # Anthropic's routes answer in Anthropic's error shape
        body = anthropic.error_body(e) if anthropic.owns(path) else e.body()
        return JSONResponse(body, status_code=e.status, headers=headers)

    def request_log(request: Request) -> RequestLog:
        """The request's log line (request_log.py), begun by a generation route or made now."""
        return getattr(request.state, "corelm_log", None) or RequestLog(request.method, request.url.path)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        request_log(request).refused(e.status, e.message)
        metrics.count_request(request.url.path if request.url.path in _ROUTES else "other", e.status)
        return error_response(e, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        message = {404: "Not found.", 405: "Method not allowed."}.get(e.status_code, "Invalid request.")
        metrics.count_request("other", e.status_code)
        request_log(request).refused(e.status_code, message)
        return error_response(APIError(e.status_code, message, kind), request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error")
        metrics.count_request(request.url.path if request.url.path in _ROUTES else "other", 500)
        return error_response(APIError(500, "Internal server error.", "server_error"), request.url.path)

    def authorize(request: Request) -> None:
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode("utf-8", errors="replace") if scheme.lower() == "bearer" else b""
        # Anthropic's clients send the key as x-api-key
        other = request.headers.get("x-api-key", "").strip().encode("utf-8", errors="replace")
        if not (hmac.compare_digest(given, key) | hmac.compare_digest(other, key)):   # constant time, both
            raise APIError(401, "Invalid or missing API key.", "invalid_request_error", code="invalid_api_key")

    def require_json(request: Request) -> None:
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise APIError(415, "The request body must be JSON, sent with 'Content-Type: application/json'.",
                           code="unsupported_media_type")

    def require_ready() -> None:
        if state.stopping:
            raise APIError(503, "The server is shutting down.", "unavailable_error", code="server_shutdown")
        if state.status == "loading":
            raise APIError(503, "Loading model.", "unavailable_error", code="model_loading")
        if state.status != "ready":
            raise APIError(503, "The model failed to load.", "unavailable_error", code="model_load_failed")

    @app.get("/health")
    async def health():
        if state.status == "ready":
            report = getattr(state.runner, "health", None)   # replicas: {"status", "replicas": [...]}
            body = report() if report is not None else {"status": "ok"}
            if body["status"] == "unavailable":
                raise APIError(503, "No replica is ready to serve (they are restarting).", "unavailable_error",
                               code="no_replica_ready")
            metrics.count_request("/health", 200)
            return body
        require_ready()

    @app.get("/metrics")
    async def metrics_endpoint(request: Request):
        authorize(request)
        runner = state.runner
        text = metrics.render(runner.num_waiting if runner else 0, runner.num_running if runner else 0,
                              state.status == "ready", runner.spec_counts() if runner else None)
        if runner is not None and hasattr(runner, "render_metrics"):   # replicas: routing and health
            text += runner.render_metrics()
        metrics.count_request("/metrics", 200)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        metrics.count_request("/v1/models", 200)
        if state.router is not None:   # every model, with its status
            return {"object": "list", "data": state.router.cards(state.created)}
        card = {"id": model_name, "object": "model", "created": state.created, "owned_by": "corelm"}
        if state.engine is not None:
            card["max_model_len"] = state.engine.max_seq_len
        # LoRA adapters as vLLM lists them: their name, path (root) and the model they adapt (parent)
        adapters = [{"id": r.lora_name, "object": "model", "created": state.created, "owned_by": "corelm",
                     "root": r.lora_path, "parent": model_name}
                    for r in (getattr(state.engine, "list_loras", lambda: [])() if state.engine is not None else [])]
        return {"object": "list", "data": [card] + adapters}

    async def generate(request: Request, endpoint: str):
        leases = []          # the model's lease, released by close() or here when the request fails before
        try:
            return await _generate(request, endpoint, leases)
        except BaseException:
            for lease in leases:
                lease.release()
            raise

    async def _generate(request: Request, endpoint: str, leases: list):
        request.state.corelm_log = rlog = RequestLog(request.method, endpoint)
        authorize(request)
        require_json(request)
        require_ready()
        try:
            body = await _read_body(request, state.config.max_body_bytes, state.config.body_timeout)
        except ClientDisconnect:           # it left mid-upload: a client abort, not a server error
            metrics.count_request(endpoint, 499)
            return HTTPResponse(status_code=499)
        req = routes.parse_body(endpoint, body)         # parse_request, Anthropic's or the Responses API's
        lease = await state.lease(req.model)       # a router's model loads now, unless it is loaded
        leases.append(lease)
        engine, runner = lease.engine, lease.runner
        # a prompt too long for the context by its size alone is refused before anything is rendered
        check_prompt_bytes(req, lease.max_prompt_bytes, engine.max_seq_len)
        # off the event loop: a long prompt or conversation takes a while to render and tokenize
        prompts = await asyncio.to_thread(routes.encode, engine, req)   # encode_prompts, or with a prefill
        if runner.num_choices + req.num_choices > state.config.max_pending:
            raise APIError(503, "The server is busy; retry later.", "unavailable_error", code="server_busy")

        # a request whose model names a LoRA adapter (--lora NAME=PATH) runs through it, and is answered as NAME
        lookup = getattr(engine, "lora_by_name", None) if state.router is None else None
        lora = lookup(req.model) if lookup is not None else None
        response = routes.make_response(req, sum(len(ids) for ids in prompts), lora.lora_name if lora else lease.name,
                                        lease.tokens)
        rlog.response = response
        queue: asyncio.Queue = asyncio.Queue()     # (prompt index, chunk) | EngineFailed | _DISCONNECTED | _SHUTDOWN
        request_ids = [f"{response.id}-{p}" for p in range(len(prompts))]   # one engine request per prompt

        def abort_all() -> None:           # the runner ignores requests that already finished
            for rid in request_ids:
                runner.abort(rid)

        require_ready()                    # the server may have begun shutting down meanwhile
        try:
            for p, ids in enumerate(prompts):
                if lora is None:
                    runner.add(request_ids[p], ids, req.params, queue, p)
                else:
                    runner.add(request_ids[p], ids, req.params, queue, p, lora_request=lora)
        except ValueError as e:
            abort_all()
            raise sampling_error(e) from None
        except BaseException:              # no replica ready: the prompts already added are dropped too
            abort_all()
            raise
        loop = asyncio.get_running_loop()
        state.open_queues[queue] = loop

        def close() -> None:
            state.open_queues.pop(queue, None)
            abort_all()
            lease.release()

        async def next_chunk():
            item = await queue.get()
            if isinstance(item, APIError):      # replicas: one died with the request on it (503)
                raise item
            if isinstance(item, EngineFailed):
                raise APIError(500, str(item) or "The engine failed while generating.", "server_error")
            if item is _SHUTDOWN:
                raise APIError(503, "The server is shutting down.", "unavailable_error", code="server_shutdown")
            if isinstance(item, tuple) and item[1].token_id is not None:
                rlog.token()
            return item

        if req.stream:
            async def watch() -> None:
                await _wait_disconnect(request)
                close()
                queue.put_nowait(_DISCONNECTED)

            # Watching starts now, not when the body is first iterated: if the client is gone before
            # the response starts, the generator never runs, but the watcher still aborts.
            watcher = asyncio.create_task(watch())

            sse = (anthropic.MessageStream(response) if isinstance(response, anthropic.MessageResponse)
                   else responses_api.ResponseStream(response) if isinstance(response, responses_api.ResponseObject)
                   else _OpenAIStream(response))

            async def events():
                try:
                    for text in sse.start():
                        yield text
                    while not response.finished:
                        try:
                            item = await next_chunk()
                        except APIError as e:      # the stream still ends as streams do
                            rlog.refused(e.status, e.message)
                            for text in sse.error(e):
                                yield text
                            return
                        if item is _DISCONNECTED:
                            rlog.done(499)
                            return
                        for text in sse.add(item):
                            yield text
                    for text in sse.end():
                        yield text
                finally:
                    watcher.cancel()
                    close()
                    rlog.done(200)

            metrics.count_request(endpoint, 200)
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def collect() -> None:
            while not response.finished:
                response.add(*await next_chunk())

        collector = asyncio.create_task(collect())
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not collector.done():       # the client left: nobody will read the answer
                abort_all()
                metrics.count_request(endpoint, 499)
                rlog.done(499)
                return HTTPResponse(status_code=499)
            collector.result()              # raises APIError when the engine failed
        finally:
            collector.cancel()
            watcher.cancel()
            close()
        metrics.count_request(endpoint, 200)
        rlog.done(200)
        return JSONResponse(response.body())

    async def post_body(request: Request, endpoint: str):
        """A POST's JSON body once authorized and the server ready, or the 499 of a client that left."""
        authorize(request)
        require_json(request)
        require_ready()
        try:
            return await _read_body(request, state.config.max_body_bytes, state.config.body_timeout)
        except ClientDisconnect:
            metrics.count_request(endpoint, 499)
            return HTTPResponse(status_code=499)

    async def token_endpoint(request: Request, endpoint: str, handler):
        body = await post_body(request, endpoint)
        if isinstance(body, HTTPResponse):
            return body
        lease = await state.lease(_model_field(body) if state.router is not None else None)
        try:
            out = await asyncio.to_thread(handler, lease, body)
        finally:
            lease.release()
        metrics.count_request(endpoint, 200)
        return JSONResponse(out)

    async def pooling_endpoint(request: Request, url: str, endpoint: str):
        """Embeddings, score and rerank: the body tokenized off the event loop, the vectors computed on the
        engine's thread between generation steps (runner.call)."""
        body = await post_body(request, endpoint)
        if isinstance(body, HTTPResponse):
            return body
        rlog = request_log(request)
        lease = await state.lease(_model_field(body) if state.router is not None else None)
        try:
            call = getattr(lease.runner, "call", None)
            if call is None:
                raise APIError(501, "Embeddings are not served by data-parallel replicas; serve the embedding "
                                    "model without --data-parallel-size.", "invalid_request_error")
            job = await asyncio.to_thread(embeddings.parse, lease.engine, url, body)
            try:
                vectors = await call(lambda: lease.engine.embed(job.ids, job.params))
            except ValueError as e:
                raise bad_request(str(e)) from None
            except RuntimeError as e:     # no free KV blocks now, or the engine is stopping
                raise APIError(503, str(e), "server_error") from None
            out = embeddings.respond(job, vectors, lease.name)
        finally:
            lease.release()
        metrics.count_request(endpoint, 200)
        with metrics.lock:
            metrics.prompt_tokens += job.prompt_tokens
        rlog.done(200)
        return JSONResponse(out)

    @app.post(embeddings.EMBEDDINGS_URL)
    async def embeddings_endpoint(request: Request):
        return await pooling_endpoint(request, embeddings.EMBEDDINGS_URL, embeddings.EMBEDDINGS_URL)

    @app.post(embeddings.SCORE_URL)
    async def score_endpoint(request: Request):
        return await pooling_endpoint(request, embeddings.SCORE_URL, embeddings.SCORE_URL)

    def rerank_route(url: str):
        async def rerank(request: Request):
            return await pooling_endpoint(request, embeddings.RERANK_URL, url)
        return rerank

    for rerank_url in embeddings.RERANK_URLS:
        app.add_api_route(rerank_url, rerank_route(rerank_url), methods=["POST"])

    @app.post(TOKENIZE_URL)
    async def tokenize_endpoint(request: Request):
        return await token_endpoint(request, TOKENIZE_URL, lambda lease, body: tokenize(lease.engine, body))

    @app.post(DETOKENIZE_URL)
    async def detokenize_endpoint(request: Request):
        return await token_endpoint(request, DETOKENIZE_URL, lambda lease, body: detokenize(lease.engine, body))

    def static_file(name: str):
        metrics.count_request("/", 200)
        return FileResponse(os.path.join(STATIC_DIR, name), media_type=STATIC_FILES[name], headers=PAGE_HEADERS)

    @app.get("/")
    async def index():
        return static_file("index.html")

    @app.get("/favicon.ico")
    async def favicon():          # browsers ask for it: an SVG icon rather than a 404 in the console
        return static_file("favicon.svg")

    @app.get("/static/{name}")
    async def static(name: str):
        if name not in STATIC_FILES or name == "index.html":
            raise APIError(404, "Not found.", "not_found_error")
        return static_file(name)

    @app.post(COMPLETIONS_URL)
    async def completions(request: Request):
        return await generate(request, COMPLETIONS_URL)

    @app.post(CHAT_URL)
    async def chat_completions(request: Request):
        return await generate(request, CHAT_URL)

    @app.post(anthropic.MESSAGES_URL)
    async def messages(request: Request):
        return await generate(request, anthropic.MESSAGES_URL)

    @app.post(responses_api.RESPONSES_URL)
    async def responses(request: Request):
        return await generate(request, responses_api.RESPONSES_URL)

    @app.post(anthropic.COUNT_TOKENS_URL)
    async def count_tokens(request: Request):
        return await token_endpoint(request, anthropic.COUNT_TOKENS_URL,
                                    lambda lease, body: anthropic.count_tokens(lease.engine, body,
                                                                               lease.max_prompt_bytes))

    if router is not None:   # llama-server's router routes: {"model": NAME} -> {"success": true}
        async def model_admin(request: Request, endpoint: str, action) -> JSONResponse:
            body = await post_body(request, endpoint)
            if isinstance(body, HTTPResponse):
                return body
            name = _model_field(body)
            if name is None:
                raise bad_request("'model' (a string) is required.", param="model")
            result = action(name)
            if asyncio.iscoroutine(result):
                await result
            metrics.count_request(endpoint, 200)
            return JSONResponse({"success": True})

        @app.post(LOAD_URL)
        async def load_model(request: Request):
            return await model_admin(request, LOAD_URL, router.load)

        @app.post(UNLOAD_URL)
        async def unload_model(request: Request):
            return await model_admin(request, UNLOAD_URL, router.unload)

    return app


def _model_field(body: bytes) -> Optional[str]:
    """A JSON body's "model" when it is a string (the endpoint's own parsing judges the rest)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    model = obj.get("model") if isinstance(obj, dict) else None
    return model if isinstance(model, str) else None


TOKENIZE_URL, DETOKENIZE_URL = "/tokenize", "/detokenize"
LOAD_URL, UNLOAD_URL = "/models/load", "/models/unload"
_ROUTES = {COMPLETIONS_URL, CHAT_URL, TOKENIZE_URL, DETOKENIZE_URL, LOAD_URL, UNLOAD_URL, "/v1/models", "/health",
           "/metrics", "/",
           *anthropic.URLS, *routes.URLS, embeddings.EMBEDDINGS_URL, embeddings.SCORE_URL, *embeddings.RERANK_URLS}
