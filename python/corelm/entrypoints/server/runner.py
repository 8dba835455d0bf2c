"""The engine thread: one background thread steps the engine while it has work and sleeps otherwise;
each request's chunks go to its asyncio queue through loop.call_soon_threadsafe.

Only the request-level engine interface is used (add_request, abort_request, step,
has_unfinished_requests, num_waiting, num_running); `make_engine` is the one place that picks the engine.
The engine fans a request out into its n choices; the request is done when every choice has finished.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from ... import SamplingParams, StreamChunk
from ...errors import EngineDead

log = logging.getLogger("corelm.server")


def make_engine(llm):
    """The engine the server drives: the LLM's own LLMEngine, so every client shares one KV-cache pool
    and each step runs all of them in one forward pass."""
    return llm.engine


class EngineFailed(Exception):
    """Delivered to a request's queue when the engine raised while stepping it, or ended one of its choices
    with finish_reason "error" (the message says why)."""


@dataclass
class Metrics:
    """Counters for GET /metrics (Prometheus text format), updated from both threads under a lock."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: Dict[Tuple[str, int], int] = field(default_factory=lambda: collections.defaultdict(int))
    finished: Dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    engine_steps: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    window: Deque[Tuple[float, int]] = field(default_factory=collections.deque)   # (time, tokens) per step
    window_s: float = 10.0

    def count_request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def tokens_per_second(self, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        with self.lock:
            while self.window and self.window[0][0] < now - self.window_s:
                self.window.popleft()
            return sum(n for _, n in self.window) / self.window_s

    def render(self, waiting: int, running: int, model_loaded: bool, spec: Optional[Dict[str, int]] = None) -> str:
        tps = self.tokens_per_second()
        lines: List[str] = []

        def metric(name: str, kind: str, help_: str, samples: List[Tuple[str, Any]]) -> None:
            lines.append(f"# HELP corelm_{name} {help_}")
            lines.append(f"# TYPE corelm_{name} {kind}")
            for labels, value in samples:
                lines.append(f"corelm_{name}{labels} {value}")

        with self.lock:
            metric("http_requests_total", "counter", "HTTP requests by endpoint and status code.",
                   [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
            metric("requests_finished_total", "counter",
                   "Generation requests finished, by finish reason (abort: cancelled, e.g. the client left).",
                   [(f'{{finish_reason="{r}"}}', n) for r, n in sorted(self.finished.items())])
            metric("prompt_tokens_total", "counter", "Prompt tokens read.", [("", self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "Tokens generated.", [("", self.generation_tokens)])
            metric("engine_steps_total", "counter", "Engine steps run.", [("", self.engine_steps)])
            metric("time_to_first_token_seconds", "summary", "Time from request to first token.",
                   [("_sum", round(self.ttft_sum, 6)), ("_count", self.ttft_count)])
        metric("requests_waiting", "gauge", "Requests queued in the engine.", [("", waiting)])
        metric("requests_running", "gauge", "Requests being generated.", [("", running)])
        metric("generation_tokens_per_second", "gauge",
               f"Tokens generated per second over the last {self.window_s:g} s.", [("", round(tps, 3))])
        metric("model_loaded", "gauge", "1 once the model is loaded.", [("", int(model_loaded))])
        if spec is not None:   # speculative decoding (vLLM's spec_decode counters)
            metric("spec_decode_draft_tokens_total", "counter", "Tokens proposed by the draft or prompt lookup.",
                   [("", spec["draft_tokens"])])
            metric("spec_decode_accepted_tokens_total", "counter", "Proposed tokens the model kept.",
                   [("", spec["accepted_tokens"])])
        return "\n".join(lines) + "\n"


@dataclass
class _Target:
    loop: asyncio.AbstractEventLoop
    queue: "asyncio.Queue[Any]"
    prompt_index: int               # which of the HTTP request's prompts this engine request is
    unfinished: int                 # its choices that have not finished
    started: float                  # monotonic time of add_request
    first_token: bool = False


class EngineRunner:
    def __init__(self, engine, metrics: Metrics, on_dead: Optional[Callable[[BaseException], None]] = None):
        self.engine = engine
        self.metrics = metrics
        self.on_dead = on_dead     # called once, from the engine thread, when the engine can serve no more
        self.dead: Optional[str] = None
        self._cv = threading.Condition()
        self._targets: Dict[str, _Target] = {}
        self._calls: Deque[Tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future"]] = collections.deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="corelm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            for rid in list(self._targets):
                self.engine.abort_request(rid)
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    def spec_counts(self) -> Optional[Dict[str, int]]:
        counts = getattr(self.engine, "spec_counts", None)   # test doubles of the engine may have none
        return counts() if counts else None

    @property
    def num_choices(self) -> int:
        """Choices queued or running (each one a sequence in the engine)."""
        with self._cv:
            return sum(t.unfinished for t in self._targets.values())

    def has_unfinished_requests(self) -> bool:
        with self._cv:
            return bool(self._targets) or self.engine.has_unfinished_requests()

    def add(self, request_id: str, prompt_ids: List[int], params: SamplingParams,
            queue: "asyncio.Queue", prompt_index: int = 0, lora_request=None) -> None:
        """From the event loop. Raises ValueError (from the engine's validation) without queueing.
        The queue receives (prompt_index, chunk) for every choice's chunks. lora_request: the LoRA adapter
        the request runs through (None: the base model)."""
        loop = asyncio.get_running_loop()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            # (an adapter only where there is one: the router's engines take no lora_request)
            self.engine.add_request(request_id, prompt_ids, params,
                                    **({} if lora_request is None else {"lora_request": lora_request}))
            self._targets[request_id] = _Target(loop, queue, prompt_index, params.n, time.monotonic())
            self._cv.notify()
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(prompt_ids)

    def call(self, fn: Callable[[], Any]) -> "asyncio.Future":
        """From the event loop: runs fn() on the engine thread between two steps (the engine is not
        thread-safe: embeddings use its model and KV pool); the future gets its result or exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            self._calls.append((fn, loop, future))
            self._cv.notify()
        return future

    def _run_call(self) -> None:
        with self._cv:
            if not self._calls:
                return
            fn, loop, future = self._calls.popleft()
        try:
            result, error = fn(), None
        except Exception as e:   # the caller's to report (a bad input, no free KV blocks)
            result, error = None, e

        def deliver() -> None:
            if future.cancelled():
                return
            future.set_exception(error) if error is not None else future.set_result(result)
        loop.call_soon_threadsafe(deliver)

    def abort(self, request_id: str) -> None:
        """Cancels a request that has not finished; its last chunk (finish_reason "abort") is dropped."""
        with self._cv:
            if request_id in self._targets:
                self.engine.abort_request(request_id)
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._calls and not self.engine.has_unfinished_requests():
                    self._cv.wait()
                if self._stopping and not self.engine.has_unfinished_requests():
                    for _, loop, future in self._calls:
                        loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_exception(
                            RuntimeError("the engine is shutting down")))
                    return
            self._run_call()   # one call between steps: generation keeps moving under a stream of them
            if not self.engine.has_unfinished_requests():
                continue
            try:
                out = self.engine.step()
            except EngineDead as e:   # nothing more can run: fail what was in flight, stop stepping
                log.error("the engine died: %s", e)
                self.dead = str(e)
                self._fail_all(f"The engine stopped: {e}")
                if self.on_dead is not None:
                    self.on_dead(e)
                return
            except Exception:  # a bug in the engine: fail what was in flight, keep serving
                log.exception("engine step failed; aborting the requests in flight")
                self._fail_all()
                continue
            self._deliver(out)

    def _deliver(self, out: List[Tuple[str, StreamChunk]]) -> None:
        now = time.monotonic()
        tokens = 0
        ttfts: List[float] = []
        finished: List[str] = []
        with self._cv:
            for rid, chunk in out:
                target = self._targets.get(rid)
                if chunk.token_id is not None:
                    tokens += 1
                if chunk.finish_reason is not None:
                    finished.append(chunk.finish_reason)
                if target is None:
                    continue
                if chunk.finish_reason is not None:
                    target.unfinished -= 1
                    if target.unfinished == 0:
                        self._targets.pop(rid)
                if chunk.token_id is not None and not target.first_token:
                    target.first_token = True
                    ttfts.append(now - target.started)
                item = (target.prompt_index, chunk)
                if chunk.finish_reason == "error":
                    log.error("request %s failed: %s", rid, chunk.error)
                    item = EngineFailed(chunk.error)
                target.loop.call_soon_threadsafe(target.queue.put_nowait, item)
        m = self.metrics
        with m.lock:
            m.engine_steps += 1
            m.generation_tokens += tokens
            m.ttft_sum += sum(ttfts)
            m.ttft_count += len(ttfts)
            for reason in finished:
                m.finished[reason] += 1
            if tokens:
                m.window.append((now, tokens))

    def _fail_all(self, message: Optional[str] = None) -> None:
        with self._cv:
            targets, self._targets = self._targets, {}
            for rid in targets:
                self.engine.abort_request(rid)
        for t in targets.values():   # their "abort" chunks from the next step are dropped
            t.loop.call_soon_threadsafe(t.queue.put_nowait, EngineFailed(message) if message else EngineFailed())
        with self.metrics.lock:
            self.metrics.finished["error"] += sum(t.unfinished for t in targets.values())
