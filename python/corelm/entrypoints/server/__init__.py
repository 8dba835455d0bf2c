"""An OpenAI-compatible HTTP server (`corelm serve`), on FastAPI and uvicorn (`pip install corelm[serve]`).

    GET  /health                503 {"error": ...} while the model loads, then 200 {"status": "ok"}
    GET  /metrics               Prometheus text: requests, tokens, queue length, tokens/s
    GET  /v1/models
    POST /v1/completions        prompt: str | [str] | [int] | [[int]]
    POST /v1/chat/completions   messages through the model's chat template (chat_template_kwargs)
    POST /v1/messages           Anthropic's Messages API (and /v1/messages/count_tokens)
    POST /v1/responses          OpenAI's Responses API, stateless (no previous_response_id)
    POST /tokenize, /detokenize as vLLM's server: a prompt or messages -> token ids, and back
    POST /models/load, /models/unload   with several models (router.py): {"model": NAME}, as llama-server's
    GET  /                      the web chat page (static/, no build step, nothing fetched from elsewhere)

The model loads in a background thread after the server starts listening. Hostile clients get bounded
answers: a body not received within body_timeout seconds is a 408 (connection closed), a client that
leaves mid-upload is counted as a 499 (no traceback), connections beyond max_connections get a 503, and
so do a client's connections beyond max_connections_per_client; a request's headers not received within
header_timeout seconds close the connection (guard.py). A Host header that is not an IP address, a
localhost name or an allowed host gets a 400, a POST that is not application/json a 415, and CORS
headers go only to allowed origins. On shutdown (Ctrl-C) every open stream ends with an error event and
`data: [DONE]`. One engine thread steps
the request-level engine (runner.make_engine) for every client; a client that disconnects has its
requests aborted; with `corelm serve --data-parallel-size N`, replicas.py runs N engine processes
instead, behind the same endpoints. Errors use OpenAI's envelope {"error": {"message", "type", "param", "code"}} with
fixed messages that never echo user text. Request bodies and response shapes are corelm.openai's,
shared with `corelm batch`.

    from corelm.entrypoints.server import create_app
    app = create_app(lambda: corelm.LLM(path), model_name="my-model")   # any ASGI server runs it
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from typing import Sequence

from .app import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, create_app  # noqa: F401
from .guard import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS_PER_CLIENT, guarded_protocol  # noqa: F401
from .request_log import listening
from .runner import make_engine  # noqa: F401

DEFAULT_MAX_CONNECTIONS = 256     # open connections (and requests in flight); more are answered 503


def uvicorn_config(app, max_connections: int = DEFAULT_MAX_CONNECTIONS, *,
                   header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
                   max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT, **kwargs):
    """The uvicorn.Config `corelm serve` runs `app` with: at most `max_connections` connections (uvicorn
    answers 503 and closes beyond that), at most `max_connections_per_client` from one address (503 and
    closed), a request's headers within `header_timeout` seconds (else closed), an idle keep-alive
    connection closed after 5 s, 5 s for a graceful shutdown. kwargs: more (or other) uvicorn.Config
    arguments (host, port, log_level)."""
    import uvicorn
    return uvicorn.Config(app, **{"limit_concurrency": max_connections, "timeout_keep_alive": 5,
                                  "timeout_graceful_shutdown": 5,
                                  "http": guarded_protocol(header_timeout, max_connections_per_client), **kwargs})


def make_server(config):
    """A uvicorn.Server for `config` (uvicorn_config's) that, when it starts shutting down, first ends
    the app's requests in flight (ServerState.begin_shutdown), so streams close cleanly and at once. A
    Ctrl-C (or SIGTERM) it shut down for sets `interrupted` instead of being raised again inside the event
    loop, where uvicorn would re-raise it: that cancels the app's lifespan mid-shutdown and prints its
    traceback."""
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        interrupted = False

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    self.interrupted = bool(self._captured_signals)
                    self._captured_signals.clear()

        async def shutdown(self, sockets=None):
            state = getattr(getattr(config.app, "state", None), "corelm", None)
            if state is not None:
                state.begin_shutdown()
            await super().shutdown(sockets)

    return Server(config)


def run(load_llm: Callable[[], Any], model_name: str, host: str = "127.0.0.1", port: int = 8000,
        api_key: Optional[str] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        log_level: str = "info", body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS, header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
        max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT, allowed_hosts: Sequence[str] = (),
        allowed_origins: Sequence[str] = (), router=None) -> int:
    """Serves until Ctrl-C. Returns 1 when the model failed to load (the server then stops), else 0.
    The Host names allowed are the listening address, IP addresses, localhost names and `allowed_hosts`.
    With `router` (a ModelRouter; load_llm and model_name None) it serves several models, loaded on demand;
    one that fails to load is listed as failed and the server serves on."""
    failed = []
    server_box = []

    def on_load_error(exc: BaseException) -> None:
        failed.append(exc)
        if server_box:
            server_box[0].should_exit = True

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(message)s")
    app = create_app(load_llm, model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                     body_timeout=body_timeout, on_load_error=on_load_error,
                     allowed_hosts=[host, *allowed_hosts], allowed_origins=allowed_origins, router=router)
    server = make_server(uvicorn_config(app, max_connections, header_timeout=header_timeout,
                                        max_connections_per_client=min(max_connections_per_client, max_connections),
                                        host=host, port=port, log_level=log_level))
    server_box.append(server)
    listening(f"http://{f'[{host}]' if ':' in host else host}:{port}/")
    server.run()
    if failed:
        raise failed[0]
    return 130 if server.interrupted else 0
