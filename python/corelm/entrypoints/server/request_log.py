"""What the server writes to its log (logger "corelm.server", Python logging): a block when the model is
loaded (model, format and dtype, threads, kernels) and the web page's URL when it listens, then one line per
generation request or refusal:

    request chatcmpl-9f.. POST /v1/chat/completions 200 prompt=48 cached=32 completion=16 ttft=0.041s 212.5 tok/s
    request - POST /v1/chat/completions 400 reason="Invalid value for 'temperature': it must be ..."

Refusals' reasons are the API's fixed messages, which never quote the request, so no user text is logged.
"""
from __future__ import annotations

import logging
import time
from typing import Any, List, Optional

from ...engine import system_info

log = logging.getLogger("corelm.server")


def model_block(name: str, llm: Any) -> str:
    """The lines logged once the model is loaded."""
    engine = getattr(llm, "engine", llm)
    loaded = getattr(engine, "loaded", None)
    fmt = getattr(loaded, "source_format", None) or "?"
    kernels = system_info().get("kernels") or {}
    isa = ", ".join(sorted(set(kernels.values()))) or "unknown (corelm._core not loaded)"
    lines: List[str] = [f"model loaded: {name}",
                        f"  file:    {getattr(engine, 'model_path', '?')} ({fmt})",
                        f"  dtype:   {getattr(engine, 'dtype', '?')}, context {getattr(engine, 'max_seq_len', '?')} "
                        f"tokens",
                        f"  threads: {getattr(engine, 'threads', '?')}",
                        f"  kernels: {isa}"]
    return "\n".join(lines)


def listening(url: str) -> None:
    log.info("web chat page and API at %s", url)


class RequestLog:
    """One request's line: started when the request arrives, told its response (id and token counts) and its
    first token, written once when it ends (done) or is refused (refused)."""

    def __init__(self, method: str, route: str):
        self.route = f"{method} {route}"
        self.started = time.monotonic()
        self.first_token: Optional[float] = None
        self.response: Any = None
        self.written = False

    def token(self) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()

    def done(self, status: int) -> None:
        if self.written:
            return
        self.written = True
        r = self.response
        if r is None:
            log.info("request - %s %d", self.route, status)
            return
        now = time.monotonic()
        ttft = "-" if self.first_token is None else f"{self.first_token - self.started:.3f}s"
        rate = "-" if self.first_token is None or now <= self.first_token else \
            f"{r.completion_tokens / (now - self.first_token):.1f}"
        log.info("request %s %s %d prompt=%d cached=%d completion=%d ttft=%s %s tok/s", r.id, self.route, status,
                 r.prompt_tokens, r.num_cached_tokens, r.completion_tokens, ttft, rate)

    def refused(self, status: int, reason: str) -> None:
        if self.written:
            return
        self.written = True
        rid = getattr(self.response, "id", "-")
        (log.warning if status >= 500 else log.info)('request %s %s %d reason="%s"', rid, self.route, status, reason)
