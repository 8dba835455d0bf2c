"""Several models behind one server (`corelm serve --models-dir DIR`, or NAME=PATH models): a request's
`model` field picks one, which loads on first use, as llama-server's router mode does.

Every loaded model is an LLMEngine of its own (its own KV pool) in the server's process; one runner thread
(EngineRunner over an EngineSet) steps the busy engines in turn, one step each, and parks an engine's workers
after its step when another engine steps next, so only one thread pool holds the cores at a time. Requests
for a model that is loading wait for it; requests for loaded models keep running meanwhile (the load takes
the cores it shares with them while it repacks weights). Loads run one at a time, on a thread of their own.

Budget: before a model loads, idle models (no request in flight) are unloaded, least recently used first,
while loading it would exceed --max-loaded-models or --models-memory-gb; when every model over the budget is
busy, the load waits for one to become idle. A model's memory is estimated as its files' bytes plus its KV
pool's bytes (known once it has loaded; before that --kv-cache-gb if given, else 0, and the check is made
again once the model is loaded). A model alone over the memory budget still loads. A model whose load fails
is listed as failed with its error; requests for it get a 503 until a POST /models/load loads it."""
from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from ... import SamplingParams, StreamChunk
from ...errors import EngineDead
from ...openai import APIError, TokenText
from ...openai.protocol import prompt_byte_limit
from ..catalog import model_bytes, model_load_failed, model_not_found
from .runner import EngineRunner, Metrics, make_engine

log = logging.getLogger("corelm.server")

LOAD_POLL_S = 0.02       # how often a request waiting for its model's load looks again


def _park(engine) -> None:
    park = getattr(getattr(engine, "core", None), "park_threads", None)   # test doubles may have no core
    if park is not None:
        park()


class EngineSet:
    """The engine interface EngineRunner steps (add_request, abort_request, step, has_unfinished_requests,
    num_waiting, num_running, spec_counts) over every loaded model's LLMEngine. A request goes to the engine
    `expect` named for its id; step() steps the next busy engine after the last one stepped (in load order)
    and parks its workers when another engine is busy too."""

    def __init__(self):
        self._lock = threading.Lock()
        self._engines: Dict[str, Any] = {}          # model name -> engine, in load order
        self._expected: Dict[str, Any] = {}         # request id -> engine, until add_request
        self._routes: Dict[str, List[Any]] = {}     # request id -> [engine, choices not finished]
        self._last: Optional[str] = None

    def attach(self, name: str, engine) -> None:
        with self._lock:
            self._engines[name] = engine

    def detach(self, name: str) -> bool:
        """Drops a model's engine unless requests are on it; whether it was dropped."""
        with self._lock:
            engine = self._engines.get(name)
            if engine is None:
                return True
            if engine.has_unfinished_requests() or any(r[0] is engine for r in self._routes.values()) \
                    or any(e is engine for e in self._expected.values()):
                return False
            del self._engines[name]
            return True

    def busy(self, engine) -> bool:
        with self._lock:
            return engine.has_unfinished_requests() or any(r[0] is engine for r in self._routes.values())

    def expect(self, request_id: str, engine) -> None:
        with self._lock:
            self._expected[request_id] = engine

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._expected.pop(request_id, None)

    def add_request(self, request_id: str, prompt, params: SamplingParams) -> None:
        with self._lock:
            engine = self._expected.pop(request_id)
            engine.add_request(request_id, prompt, params)
            self._routes[request_id] = [engine, params.n]

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            route = self._routes.get(request_id)
        if route is not None:
            route[0].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return any(e.has_unfinished_requests() for e in self._engines.values())

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return sum(e.num_waiting for e in self._engines.values())

    @property
    def num_running(self) -> int:
        with self._lock:
            return sum(e.num_running for e in self._engines.values())

    def spec_counts(self) -> Optional[Dict[str, int]]:
        with self._lock:
            counts = [c for c in (e.spec_counts() for e in self._engines.values()) if c]
        if not counts:
            return None
        return {k: sum(c[k] for c in counts) for k in ("draft_tokens", "accepted_tokens")}

    def step(self) -> List[Tuple[str, StreamChunk]]:
        with self._lock:
            names = list(self._engines)
            busy = [n for n in names if self._engines[n].has_unfinished_requests()]
            if not busy:
                return []
            start = names.index(self._last) + 1 if self._last in self._engines else 0
            name = min(busy, key=lambda n: (names.index(n) - start) % len(names))
            engine, self._last = self._engines[name], name
        try:
            out = engine.step()
        except EngineDead:       # the server stops (EngineRunner)
            raise
        except Exception as e:   # this model's requests fail; the other models serve on
            log.exception("model %s: engine step failed; aborting its requests in flight", name)
            return self._fail(engine, f"The engine failed while generating ({type(e).__name__}).")
        finally:
            if len(busy) > 1:    # another model steps next: its workers take these cores
                _park(engine)
        with self._lock:
            for rid, chunk in out:
                route = self._routes.get(rid)
                if route is not None and chunk.finish_reason is not None:
                    route[1] -= 1
                    if route[1] <= 0:
                        del self._routes[rid]
        return out

    def _fail(self, engine, message: str) -> List[Tuple[str, StreamChunk]]:
        with self._lock:
            failed = [(rid, r[1]) for rid, r in self._routes.items() if r[0] is engine]
            for rid, _ in failed:
                del self._routes[rid]
        out = []
        for rid, unfinished in failed:
            engine.abort_request(rid)    # their "abort" chunks come from its next step, and are dropped
            out += [(rid, StreamChunk("", None, finish_reason="error", error=message))] * unfinished
        return out


@dataclass
class Lease:
    """What a request uses of its model (engine, runner, tokens for logprobs, prompt byte limit), held until
    release(): the router never unloads a model while a lease on it is held."""
    name: str
    engine: Any
    runner: Any
    tokens: Any
    max_prompt_bytes: Optional[int]
    _release: Optional[Callable[[], None]] = None

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class _ModelRunner:
    """The shared EngineRunner as one model's requests see it: add() sends them to that model's engine."""

    def __init__(self, runner: EngineRunner, engines: EngineSet, engine):
        self.runner, self.engines, self.engine = runner, engines, engine

    def add(self, request_id: str, prompt_ids: List[int], params: SamplingParams, queue: "asyncio.Queue",
            prompt_index: int = 0) -> None:
        self.engines.expect(request_id, self.engine)
        try:
            self.runner.add(request_id, prompt_ids, params, queue, prompt_index)
        finally:
            self.engines.forget(request_id)

    def abort(self, request_id: str) -> None:
        self.runner.abort(request_id)

    def call(self, fn):
        return self.runner.call(fn)

    @property
    def num_choices(self) -> int:
        return self.runner.num_choices


@dataclass
class ServedModel:
    name: str
    path: str
    file_bytes: int = 0
    status: str = "unloaded"            # -> "loading" -> "loaded" | "failed"; "loaded" -> "unloaded"
    error: Optional[str] = None
    llm: Any = None
    engine: Any = None
    tokens: Any = None
    max_prompt_bytes: Optional[int] = None
    kv_bytes: Optional[int] = None      # the KV pool's, once loaded
    leases: int = 0
    last_used: float = field(default_factory=time.monotonic)


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


class ModelRouter:
    """The models one server serves by name. `load_llm(path)` builds a model's corelm.LLM (on a load thread);
    max_loaded: at most this many loaded at once (None: no limit); memory_bytes: at most this many bytes of
    estimated memory loaded (None: no limit); kv_bytes_hint: a KV pool's bytes before a model has loaded
    (--kv-cache-gb)."""

    def __init__(self, models: Dict[str, str], load_llm: Callable[[str], Any], max_loaded: Optional[int] = None,
                 memory_bytes: Optional[int] = None, kv_bytes_hint: Optional[int] = None):
        if not models:
            raise ValueError("no models to serve.")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be at least 1, got {max_loaded}.")
        if memory_bytes is not None and memory_bytes <= 0:
            raise ValueError("--models-memory-gb must be positive.")
        self.models = {n: ServedModel(n, p, model_bytes(p)) for n, p in models.items()}
        self.load_llm = load_llm
        self.max_loaded, self.memory_bytes, self.kv_bytes_hint = max_loaded, memory_bytes, kv_bytes_hint
        self.engines = EngineSet()
        self.runner: Optional[EngineRunner] = None
        self._cv = threading.Condition()
        self._load_lock = threading.Lock()      # one load at a time: two would count on the same free memory
        self._stopping = False

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, metrics: Metrics, on_dead: Optional[Callable[[BaseException], None]] = None) -> EngineRunner:
        self.runner = EngineRunner(self.engines, metrics, on_dead=on_dead)
        self.runner.start()
        return self.runner

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self.runner is not None:
            self.runner.stop()

    # -- what the endpoints ask ------------------------------------------------------------------
    def get(self, name: Optional[str]) -> ServedModel:
        """The model named `name` (None: the only one, when one is served); a 404 naming the models served."""
        if name is None and len(self.models) == 1:
            return next(iter(self.models.values()))
        model = self.models.get(name) if isinstance(name, str) else None
        if model is None:
            raise model_not_found(name, self.models)
        return model

    def cards(self, created: int) -> List[Dict[str, Any]]:
        """/v1/models' entries, with llama-server's router field `status`: {"value": "loaded" | "loading" |
        "unloaded" | "failed", "error" (failed)}."""
        out = []
        with self._cv:
            for m in self.models.values():
                status: Dict[str, Any] = {"value": m.status}
                if m.status == "failed":
                    status["error"] = m.error
                card = {"id": m.name, "object": "model", "created": created, "owned_by": "corelm", "status": status}
                if m.engine is not None:
                    card["max_model_len"] = m.engine.max_seq_len
                out.append(card)
        return out

    async def acquire(self, name: Optional[str]) -> Lease:
        """A lease on the model, loaded first when it is not (waiting for it); a 404 for an unknown name, a 503
        when its load failed (or failed earlier: POST /models/load tries again)."""
        model = self.get(name)
        with self._cv:
            model.leases += 1
            model.last_used = time.monotonic()
            if model.status == "unloaded":
                self._start_load(model)
        try:
            while model.status == "loading":
                await asyncio.sleep(LOAD_POLL_S)
            with self._cv:
                if model.status != "loaded":
                    raise model_load_failed(model.error)
                engine = model.engine
                return Lease(model.name, engine, _ModelRunner(self.runner, self.engines, engine), model.tokens,
                             model.max_prompt_bytes, lambda: self._release(model))
        except BaseException:
            self._release(model)
            raise

    def _release(self, model: ServedModel) -> None:
        with self._cv:
            model.leases -= 1
            model.last_used = time.monotonic()
            self._cv.notify_all()

    async def load(self, name: Optional[str]) -> None:
        """POST /models/load: loads the model (again, after a failed load) unless it is loaded; waits for it."""
        model = self.get(name)
        with self._cv:
            if model.status in ("unloaded", "failed"):
                self._start_load(model)
        while model.status == "loading":
            await asyncio.sleep(LOAD_POLL_S)
        if model.status != "loaded":
            raise model_load_failed(model.error)

    def unload(self, name: Optional[str]) -> None:
        """POST /models/unload: a 400 when the model is not loaded, a 409 while requests use it."""
        model = self.get(name)
        with self._cv:
            if model.status != "loaded":
                raise APIError(400, "The model is not loaded.", "invalid_request_error", param="model",
                               code="model_not_loaded")
            if not self._unload(model):
                raise APIError(409, "The model has requests in flight; it cannot be unloaded now.",
                               "invalid_request_error", param="model", code="model_busy")
        gc.collect()   # the engine's buffers go now, not at the next collection

    # -- loading and unloading -------------------------------------------------------------------
    def _start_load(self, model: ServedModel) -> None:   # under self._cv
        model.status, model.error = "loading", None
        threading.Thread(target=self._load, args=(model,), name=f"corelm-load-{model.name}", daemon=True).start()

    def _estimate(self, model: ServedModel) -> int:
        kv = model.kv_bytes if model.kv_bytes is not None else (self.kv_bytes_hint or 0)
        return model.file_bytes + kv

    def _over(self, loaded: List[ServedModel], incoming: Optional[ServedModel]) -> bool:
        count = len(loaded) + (incoming is not None)
        total = sum(self._estimate(m) for m in loaded) + (self._estimate(incoming) if incoming else 0)
        return ((self.max_loaded is not None and count > self.max_loaded)
                or (self.memory_bytes is not None and total > self.memory_bytes and count > 1))

    def _make_room(self, incoming: Optional[ServedModel], keep: ServedModel, wait: bool) -> None:
        """Unloads idle models, least recently used first, while the loaded ones (and `incoming`) exceed the
        budget; with `wait`, waits for a busy one to become idle when no model is idle. Under self._cv."""
        while not self._stopping:
            loaded = [m for m in self.models.values() if m.status == "loaded" and m is not keep]
            if not self._over(loaded + ([keep] if incoming is None else []), incoming):
                return
            idle = sorted((m for m in loaded if m.leases == 0 and not self.engines.busy(m.engine)),
                          key=lambda m: m.last_used)
            if any(self._unload(m) for m in idle[:1]):
                continue
            if not wait:
                log.warning("models: over the budget with every other model busy; %s stays loaded", keep.name)
                return
            self._cv.wait(0.5)   # a request ending notifies; the timeout catches an engine going idle

    def _unload(self, model: ServedModel) -> bool:   # under self._cv
        if model.leases or not self.engines.detach(model.name):
            return False
        model.llm = model.engine = model.tokens = None
        model.status = "unloaded"
        log.info("model unloaded: %s", model.name)
        return True

    def _load(self, model: ServedModel) -> None:
        with self._load_lock:
            try:
                with self._cv:
                    self._make_room(model, model, wait=True)
                gc.collect()   # unloaded engines' memory is returned before the new one takes its own
                llm = self.load_llm(model.path)
                engine = make_engine(llm)
                tokens, limit = TokenText(engine.tokenizer), prompt_byte_limit(engine)
                kv = getattr(getattr(engine, "core", None), "kv_bytes", 0)
            except BaseException as e:  # noqa: BLE001  (listed as failed; the other models serve on)
                log.error("model %s failed to load: %s", model.name, _why(e))
                with self._cv:
                    model.status, model.error = "failed", _why(e)
                return
            with self._cv:
                model.llm, model.engine, model.tokens, model.max_prompt_bytes = llm, engine, tokens, limit
                model.kv_bytes = int(kv)
                self.engines.attach(model.name, engine)
                model.status = "loaded"
                log.info("model loaded: %s (about %.2f GB: files and KV pool)", model.name,
                         self._estimate(model) / (1 << 30))
                self._make_room(None, model, wait=False)   # its KV pool is known now
