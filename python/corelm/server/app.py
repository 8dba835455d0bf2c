"""The OpenAI-compatible HTTP API on FastAPI: /v1/models, /v1/completions, /v1/chat/completions,
/health and /metrics. See corelm.server for the overview."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling import SamplingParams
from ..sequence import StreamChunk
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, bad_request, sampling_error,
                       validation_error)
from .runner import EngineFailed, EngineRunner, Metrics, make_engine

log = logging.getLogger("corelm.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_N = 16                  # choices per request (n x prompts)
MAX_LOGPROBS = 20           # OpenAI's top_logprobs limit
_DISCONNECTED = object()


@dataclass
class ServerConfig:
    model_name: str
    api_key: Optional[str] = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_pending: int = 512    # requests (choices) queued or running; more get a 503


class ServerState:
    """What the endpoints share: the load status, the LLM and the engine runner once loaded."""

    def __init__(self, load_llm: Callable[[], Any], config: ServerConfig,
                 on_load_error: Optional[Callable[[BaseException], None]] = None):
        self.load_llm = load_llm
        self.config = config
        self.on_load_error = on_load_error
        self.metrics = Metrics()
        self.status = "loading"          # -> "ready" | "failed"
        self.llm = None
        self.runner: Optional[EngineRunner] = None
        self.tokens: Optional["TokenText"] = None
        self.created = int(time.time())
        self._loader = threading.Thread(target=self._load, name="corelm-load", daemon=True)

    def start_loading(self) -> None:
        self._loader.start()

    def _load(self) -> None:
        try:
            llm = self.load_llm()
            runner = EngineRunner(make_engine(llm), self.metrics)
            runner.start()
            self.llm, self.tokens, self.runner = llm, TokenText(llm.tokenizer), runner
            self.status = "ready"
            log.info("model loaded: %s", self.config.model_name)
        except BaseException as e:  # noqa: BLE001  (reported through /health and on_load_error)
            self.status = "failed"
            log.error("the model failed to load: %s", e)
            if self.on_load_error is not None:
                self.on_load_error(e)

    def wait_ready(self, timeout: float) -> bool:
        self._loader.join(timeout)
        return self.status == "ready"

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.stop()


# ---------------------------------------------------------------------------------------------------
# Token text for logprobs

_GPT2_BYTES: Optional[Dict[str, int]] = None


def _gpt2_byte_decoder() -> Dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode (byte-level BPE vocabularies spell bytes this way)."""
    global _GPT2_BYTES
    if _GPT2_BYTES is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _GPT2_BYTES = {chr(c): b for b, c in zip(bs, cs)}
    return _GPT2_BYTES


class TokenText:
    """A token id -> (text, UTF-8 bytes) for logprobs. Text of a partial UTF-8 sequence uses U+FFFD;
    `bytes` carries the exact bytes, as OpenAI's API does."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: Dict[int, Tuple[str, List[int]]] = {}
        backend = getattr(tokenizer, "_tk", None)
        try:
            self.byte_level = backend is not None and '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder"))
        except Exception:  # noqa: BLE001
            self.byte_level = False

    def get(self, token_id: int) -> Tuple[str, List[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit

    def _bytes(self, token_id: int) -> bytes:
        tok = self.tokenizer
        piece = tok.id_to_token(token_id) or ""
        if tok.is_special(token_id):
            return piece.encode("utf-8")
        if tok.is_byte_fallback(token_id) and len(piece) == 6 and piece.startswith("<0x"):
            return bytes([int(piece[3:5], 16)])
        if self.byte_level:
            table = _gpt2_byte_decoder()
            if piece and all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if "▁" in piece:
            return piece.replace("▁", " ").encode("utf-8")
        return tok.decode([token_id], skip_special_tokens=False).encode("utf-8")


# ---------------------------------------------------------------------------------------------------
# Per-choice accumulation and OpenAI shapes

@dataclass
class Choice:
    index: int
    text: List[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: Optional[str] = None
    logprobs: List[Tuple[int, float, list, int]] = field(default_factory=list)  # (id, lp, top, text offset)
    offset: int = 0

    def add(self, chunk: StreamChunk) -> None:
        if chunk.token_id is not None:
            self.tokens += 1
            if chunk.logprob is not None:
                self.logprobs.append((chunk.token_id, chunk.logprob, chunk.top_logprobs or [], self.offset))
        self.text.append(chunk.text)
        self.offset += len(chunk.text)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason


def _chat_logprobs(tokens: TokenText, entries) -> Dict[str, Any]:
    content = []
    for tid, lp, top, _ in entries:
        text, raw = tokens.get(tid)
        tops = []
        for t, l in top:
            tt, tb = tokens.get(t)
            tops.append({"token": tt, "logprob": l, "bytes": tb})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": tops})
    return {"content": content}


def _completion_logprobs(tokens: TokenText, entries) -> Dict[str, Any]:
    out: Dict[str, List[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp, top, offset in entries:
        out["tokens"].append(tokens.get(tid)[0])
        out["token_logprobs"].append(lp)
        tops: Dict[str, float] = {}
        for t, l in top:
            tops.setdefault(tokens.get(t)[0], l)
        out["top_logprobs"].append(tops)
        out["text_offset"].append(offset)
    return out


def _sse(obj: Any) -> str:
    # ASCII-only JSON: the stream can never carry a broken UTF-8 sequence.
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------------------------------------------
# Request plumbing

async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to be too big (before parsing)."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise bad_request("Invalid Content-Length header.")
        if int(length) > limit:
            raise APIError(413, f"The request body exceeds the limit of {limit} bytes.", code="request_too_large")
    parts, total = [], 0
    async for part in request.stream():
        total += len(part)
        if total > limit:
            raise APIError(413, f"The request body exceeds the limit of {limit} bytes.", code="request_too_large")
        parts.append(part)
    return b"".join(parts)


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is already read, so the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _parse(model, body: bytes):
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


def _sampling_params(req, max_tokens: Optional[int], logprobs: Optional[int], rename: Dict[str, str]) -> SamplingParams:
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"Invalid value for 'n': it must be an integer from 1 to {MAX_N}.", "n")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        p = rename.get("logprobs", "logprobs")
        raise bad_request(f"Invalid value for '{p}': it must be an integer from 0 to {MAX_LOGPROBS}.", p)
    if req.logit_bias:
        raise bad_request("'logit_bias' is not supported.", "logit_bias")
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
            seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as e:
        raise sampling_error(e, rename, max_n=MAX_N, max_logprobs=MAX_LOGPROBS) from None


def _check_prompt(ids: List[int], limit: int, param: str) -> None:
    if not ids:
        raise bad_request(f"The '{param}' is empty.", param)
    if len(ids) >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens, but the prompt has "
                          f"{len(ids)} tokens (at least one token must be left to generate).",
                          param, code="context_length_exceeded")


def _chat_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request("Only text content parts are supported.", "messages")
        texts.append(part.text)
    return "".join(texts)


# ---------------------------------------------------------------------------------------------------

def create_app(load_llm: Callable[[], Any], model_name: str, *, api_key: Optional[str] = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_pending: int = 512,
               on_load_error: Optional[Callable[[BaseException], None]] = None) -> FastAPI:
    """The ASGI app. `load_llm()` runs in a background thread once the server is up; until it returns,
    /health and the generation endpoints answer 503."""
    state = ServerState(load_llm, ServerConfig(model_name, api_key, max_body_bytes, max_pending), on_load_error)

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
    metrics = state.metrics
    key = api_key.encode("utf-8") if api_key else None

    def error_response(e: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        metrics.count_request(request.url.path if request.url.path in _ROUTES else "other", e.status)
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        message = {404: "Not found.", 405: "Method not allowed."}.get(e.status_code, "Invalid request.")
        metrics.count_request("other", e.status_code)
        return error_response(APIError(e.status_code, message, kind))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error")
        metrics.count_request(request.url.path if request.url.path in _ROUTES else "other", 500)
        return error_response(APIError(500, "Internal server error.", "server_error"))

    def authorize(request: Request) -> None:
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode("utf-8", errors="replace") if scheme.lower() == "bearer" else b""
        if not hmac.compare_digest(given, key):   # constant time
            raise APIError(401, "Invalid or missing API key.", "invalid_request_error", code="invalid_api_key")

    def require_ready() -> None:
        if state.status == "loading":
            raise APIError(503, "Loading model.", "unavailable_error", code="model_loading")
        if state.status != "ready":
            raise APIError(503, "The model failed to load.", "unavailable_error", code="model_load_failed")

    @app.get("/health")
    async def health():
        if state.status == "ready":
            metrics.count_request("/health", 200)
            return {"status": "ok"}
        require_ready()

    @app.get("/metrics")
    async def metrics_endpoint(request: Request):
        authorize(request)
        runner = state.runner
        text = metrics.render(runner.num_waiting if runner else 0, runner.num_running if runner else 0,
                              state.status == "ready")
        metrics.count_request("/metrics", 200)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        metrics.count_request("/v1/models", 200)
        card = {"id": model_name, "object": "model", "created": state.created, "owned_by": "corelm"}
        if state.llm is not None:
            card["max_model_len"] = state.llm.max_seq_len
        return {"object": "list", "data": [card]}

    async def generate(request: Request, endpoint: str):
        authorize(request)
        require_ready()
        body = await _read_body(request, state.config.max_body_bytes)
        llm, runner, tokens = state.llm, state.runner, state.tokens
        chat = endpoint == "/v1/chat/completions"
        if chat:
            req = _parse(ChatCompletionRequest, body)
            if req.tools:
                raise bad_request("'tools' are not supported.", "tools")
            if req.response_format and req.response_format.get("type", "text") != "text":
                raise bad_request("Only the 'text' response_format is supported.", "response_format")
            if req.top_logprobs is not None and not req.logprobs:
                raise bad_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            rename = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                      "logprobs": "top_logprobs"}
            params = _sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, rename)
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": _chat_text(m.content)}
                        for m in req.messages]
            def render() -> List[int]:
                text = llm.apply_chat_template(messages, add_generation_prompt=True)
                return llm.tokenizer.encode(text, add_special_tokens=False)
            try:   # off the event loop: a long conversation takes a while to render and tokenize
                prompts = [await asyncio.to_thread(render)]
            except ValueError:
                raise bad_request("The chat template could not be applied to these messages.", "messages") from None
            param = "messages"
        else:
            req = _parse(CompletionRequest, body)
            if req.echo:
                raise bad_request("'echo' is not supported.", "echo")
            if req.suffix:
                raise bad_request("'suffix' is not supported.", "suffix")
            if req.best_of is not None and req.best_of != req.n:
                raise bad_request("'best_of' must equal 'n' (or be omitted).", "best_of")
            params = _sampling_params(req, req.max_tokens, req.logprobs, {})
            raw = req.prompt
            if isinstance(raw, str) or (raw and all(isinstance(p, int) for p in raw)):
                raw = [raw]
            elif any(isinstance(p, int) for p in raw):
                raise bad_request("'prompt' mixes token ids and prompts.", "prompt")
            if not raw or len(raw) * req.n > MAX_N:
                raise bad_request(f"Give from 1 to {MAX_N} prompts (times 'n').", "prompt")
            prompts = []
            for p in raw:
                if isinstance(p, str):
                    prompts.append(await asyncio.to_thread(llm.tokenizer.encode, p, add_special_tokens=True))
                else:
                    if any(not 0 <= t < llm.spec.vocab_size for t in p):
                        raise bad_request("The prompt contains token ids outside the vocabulary.", "prompt")
                    prompts.append(list(p))
            param = "prompt"
        for ids in prompts:
            _check_prompt(ids, llm.max_seq_len, param)
        n = params.n
        if runner.num_requests + n * len(prompts) > state.config.max_pending:
            raise APIError(503, "The server is busy; retry later.", "unavailable_error", code="server_busy")

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        choices: List[Choice] = []
        pending: Dict[int, str] = {}        # choice index -> engine request id, until it finishes
        try:
            for p, ids in enumerate(prompts):
                for k in range(n):
                    index = p * n + k
                    sp = replace(params, n=1, seed=None if params.seed is None else params.seed + k)
                    runner.add(f"{rid}-{index}", ids, sp, queue, index)
                    pending[index] = f"{rid}-{index}"
                    choices.append(Choice(index))
        except ValueError as e:
            for r in pending.values():
                runner.abort(r)
            raise sampling_error(e) from None

        def abort_pending() -> None:
            for r in list(pending.values()):
                runner.abort(r)
            pending.clear()

        prompt_tokens = sum(len(ids) for ids in prompts)
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": model_name}
        want_logprobs = params.logprobs is not None

        def usage() -> Dict[str, int]:
            done = sum(c.tokens for c in choices)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}

        async def next_chunk() -> Tuple[int, Any]:
            index, chunk = await queue.get()
            if isinstance(chunk, EngineFailed):
                raise APIError(500, "The engine failed while generating.", "server_error")
            if chunk is not _DISCONNECTED and chunk.finish_reason is not None:
                pending.pop(index, None)
            return index, chunk

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def watch() -> None:
                await _wait_disconnect(request)
                abort_pending()
                queue.put_nowait((-1, _DISCONNECTED))

            # Watching starts now, not when the body is first iterated: if the client is gone before
            # the response starts, the generator never runs, but the watcher still aborts.
            watcher = asyncio.create_task(watch())

            async def events():
                try:
                    extra = {"usage": None} if include_usage else {}
                    if chat:
                        for c in choices:
                            yield _sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                             "logprobs": None, "finish_reason": None}], **extra})
                    while pending:
                        try:
                            index, chunk = await next_chunk()
                        except APIError as e:
                            yield _sse(e.body())
                            return
                        if chunk is _DISCONNECTED:
                            return
                        c = choices[index]
                        start = len(c.logprobs)
                        c.add(chunk)
                        if not (chunk.text or chunk.finish_reason or (want_logprobs and len(c.logprobs) > start)):
                            continue
                        finish = chunk.finish_reason
                        entry: Dict[str, Any] = {"index": index}
                        new_lp = c.logprobs[start:]
                        if chat:
                            entry["delta"] = {"content": chunk.text} if chunk.text else {}
                            entry["logprobs"] = _chat_logprobs(tokens, new_lp) if want_logprobs else None
                        else:
                            entry["text"] = chunk.text
                            entry["logprobs"] = _completion_logprobs(tokens, new_lp) if want_logprobs else None
                        entry["finish_reason"] = finish
                        yield _sse({**head, "choices": [entry], **extra})
                    if include_usage:
                        yield _sse({**head, "choices": [], "usage": usage()})
                    yield "data: [DONE]\n\n"
                finally:
                    watcher.cancel()
                    abort_pending()

            metrics.count_request(endpoint, 200)
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def collect() -> None:
            while pending:
                index, chunk = await next_chunk()
                choices[index].add(chunk)

        collector = asyncio.create_task(collect())
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not collector.done():       # the client left: nobody will read the answer
                abort_pending()
                metrics.count_request(endpoint, 499)
                return Response(status_code=499)
            collector.result()              # raises APIError when the engine failed
        finally:
            collector.cancel()
            watcher.cancel()
            abort_pending()
        out = []
        for c in choices:
            text = "".join(c.text)
            if chat:
                item = {"index": c.index, "message": {"role": "assistant", "content": text},
                        "logprobs": _chat_logprobs(tokens, c.logprobs) if want_logprobs else None,
                        "finish_reason": c.finish_reason}
            else:
                item = {"index": c.index, "text": text,
                        "logprobs": _completion_logprobs(tokens, c.logprobs) if want_logprobs else None,
                        "finish_reason": c.finish_reason}
            out.append(item)
        metrics.count_request(endpoint, 200)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": model_name, "choices": out, "usage": usage()})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "/v1/chat/completions")

    return app


_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
