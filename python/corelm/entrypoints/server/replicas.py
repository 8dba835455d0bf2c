"""Data-parallel replicas behind one server (`corelm serve --data-parallel-size N`).

Each replica is a spawned process with its own LLMEngine (and GIL), pinned to its own CPU set before it
loads its weights (engine.placement.split_cpus: a NUMA node each where there are enough, else disjoint
slices of the cores), so the weights sit in its node's memory. The server process keeps only the
tokenizer (FrontEngine): it parses, renders and tokenizes requests exactly as with one engine, and its
ReplicatedRunner, the EngineRunner of the one-engine path with add/abort forwarded over a pipe, picks a
replica per prompt and feeds each replica's chunks to the requests' queues, so streaming, errors and
/metrics are the one-engine server's.

Routing (PrefixRouter.choose): a prompt goes to the replica that last served the longest run of its
leading KV blocks (the prefix cache's block hashes), so prefix-cache hits stay on one replica, when
that replica is as idle as any, or when the run is at least half the prompt and the replica has at
most PREFIX_SLACK choices in flight beyond the least-loaded one; otherwise, and for prompts shorter
than a block, to the least-loaded replica (choices queued or running), ties to the one that was sent
the fewest requests.

Failures: a replica that dies fails its requests in flight with a 503 (`replica_failed`; a stream gets
that error event and `data: [DONE]`) and is restarted on the same CPUs; /health says "degraded" until
it is ready again (503 when no replica is ready). More than `max_restarts` deaths within
RESTART_WINDOW_S seconds, or a replica that fails to load at startup, stop the server with an error
(exit status 1), since a replica that keeps dying will not get better by itself.

Messages between the processes are JSON (dicts, lists, strings, numbers) over multiprocessing pipes,
never pickles: in {"op": "add", "id", "prompt": [ids], "params": {...}} | {"op": "abort", "id"} |
{"op": "stop"}; out {"op": "ready", "info"} | {"op": "fatal", "error"} | {"op": "error", "id", "error"}
| {"op": "out", "chunks": [[id, chunk fields...]], "waiting", "running", "spec"}.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import queue as queue_mod
import signal
import sys
import threading
import time
import traceback
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from ...engine import (LLMEngine, SamplingParams, StreamChunk, allowed_cpus, block_hashes, check_prompt_fits,
                       local_model_path, model_tokenizer, served_model_name, split_cpus)
from ...openai import APIError
from .runner import EngineRunner, Metrics, _Target

log = logging.getLogger("corelm.server")

PREFIX_SLACK = 4              # choices in flight a prefix's replica may have beyond the least-loaded one
PREFIX_TABLE_SIZE = 1 << 16   # block hashes remembered (least recently routed forgotten first)
RESTART_WINDOW_S = 600.0
DEFAULT_MAX_RESTARTS = 3


class ReplicaFailure(RuntimeError):
    """The replicas cannot serve: one failed to load, or they died more often than allowed."""


# ---------------------------------------------------------------------------------------------------
# The wire format: plain JSON values only

_CHUNK_FIELDS = [f.name for f in dataclasses.fields(StreamChunk)]
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def params_to_wire(params: SamplingParams) -> Dict[str, Any]:
    d = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
         if f.name not in ("structured_outputs", "guided_decoding")}
    if params.logit_bias:
        d["logit_bias"] = [[int(k), float(v)] for k, v in params.logit_bias.items()]   # JSON keys are strings
    so = params.structured_outputs
    if so is not None:
        d["structured_outputs"] = {k: getattr(so, k) for k in _STRUCTURED_KINDS if getattr(so, k) not in (None, False)}
    return d


def params_from_wire(d: Dict[str, Any]) -> SamplingParams:
    d = dict(d)
    if d.get("logit_bias"):
        d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"]}
    return SamplingParams(**d)


def chunk_to_wire(request_id: str, chunk: StreamChunk) -> List[Any]:
    return [request_id] + [getattr(chunk, f) for f in _CHUNK_FIELDS]


def chunk_from_wire(item: List[Any]) -> Tuple[str, StreamChunk]:
    return item[0], StreamChunk(**dict(zip(_CHUNK_FIELDS, item[1:])))


def _encode(msg: Dict[str, Any]) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode("utf-8")   # ASCII: lone surrogates travel as escapes


# ---------------------------------------------------------------------------------------------------
# The replica process

def replica_main(conn, index: int, cpus: Optional[List[int]], model: Optional[str], threads: Optional[int],
                 options: Dict[str, Any]) -> None:
    """Pin, load, say ready, then apply adds and aborts between engine steps until told to stop or the
    pipe closes. Ctrl-C reaches the whole process group: the server handles it and stops the replicas,
    so a replica ignores SIGINT; one whose server is gone exits at once (batch's _exit_with_parent)."""
    from ..batch.worker import _exit_with_parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()

    def send(msg: Dict[str, Any]) -> None:
        try:
            conn.send_bytes(_encode(msg))
        except OSError:                      # the server is gone
            os._exit(0)

    try:
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)    # before loading: the weights are first touched from here
        from ...engine import LLMEngine
        engine = LLMEngine(model, threads=threads or (len(cpus) if cpus else None), **options)
    except Exception as e:                   # a missing or corrupt model: the server reports it
        text = str(e).strip().splitlines()
        send({"op": "fatal", "error": f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__})
        conn.close()
        os._exit(1)
    send({"op": "ready", "info": {
        "pid": os.getpid(), "threads": engine.threads, "max_seq_len": engine.max_seq_len,
        "vocab_size": engine.vocab_size,
        "eos_token_ids": list(engine.eos_token_ids), "kv_blocks": engine.core.kv_blocks,
        "kv_block_size": engine.core.kv_block_size,
        "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}})
    live: Dict[str, int] = {}                # request id -> choices not finished

    def fail(request_id: str, e: BaseException) -> None:
        send({"op": "error", "id": request_id, "error": str(e) or type(e).__name__})

    while True:
        timeout = 0 if engine.has_unfinished_requests() else None   # idle: block until a message
        try:
            while conn.poll(timeout):
                timeout = 0
                msg = json.loads(conn.recv_bytes())
                op, rid = msg.get("op"), msg.get("id")
                if op == "stop":
                    conn.close()
                    return
                if op == "add":
                    try:
                        params = params_from_wire(msg["params"])
                        engine.add_request(rid, msg["prompt"], params)
                        live[rid] = params.n
                    except Exception as e:   # validated by the server already: a bug, this request's only
                        fail(rid, e)
                elif op == "abort" and rid in live:
                    engine.abort_request(rid)
        except (EOFError, OSError):          # the server closed the pipe
            return
        if not engine.has_unfinished_requests():
            continue
        try:
            out = engine.step()
        except Exception as e:               # a bug in the engine: fail what was in flight, keep serving
            traceback.print_exc(file=sys.stderr)
            for rid in list(live):
                engine.abort_request(rid)
                fail(rid, RuntimeError(f"the engine failed while generating ({type(e).__name__})"))
            live.clear()
            continue
        for rid, chunk in out:
            if chunk.finish_reason is not None and rid in live:
                live[rid] -= 1
                if live[rid] == 0:
                    del live[rid]
        send({"op": "out", "chunks": [chunk_to_wire(rid, c) for rid, c in out], "waiting": engine.num_waiting,
              "running": engine.num_running, "spec": engine.spec_counts()})


# ---------------------------------------------------------------------------------------------------
# The server side

class FrontEngine:
    """What the server process needs of the model to parse, render, tokenize and check requests: the
    tokenizer (no weights), and the limits the replicas report once loaded. The prompt methods are
    LLMEngine's own, so prompts become the same token ids as with one engine."""
    encode_prompt = LLMEngine.encode_prompt
    apply_chat_template = LLMEngine.apply_chat_template
    encode_chat = LLMEngine.encode_chat

    def __init__(self, model_path: str):
        self.tokenizer, self.vocab_size = model_tokenizer(model_path)
        self.model_path = model_path
        self.model_name = served_model_name(model_path)
        self.max_seq_len = 0              # set_limits, from the first replica ready
        self.kv_blocks, self.kv_block_size = 0, 16
        self.eos_token_ids: List[int] = []

    def set_limits(self, info: Dict[str, Any], eos_token_ids: Sequence[int]) -> None:
        self.max_seq_len = int(info["max_seq_len"])
        self.vocab_size = int(info["vocab_size"])
        self.kv_blocks, self.kv_block_size = int(info["kv_blocks"]), int(info["kv_block_size"])
        self.eos_token_ids = list(eos_token_ids)

    def check_prompt(self, prompt_ids: List[int]) -> None:
        """LLMEngine.check_prompt, against the replicas' context and KV pool."""
        check_prompt_fits(prompt_ids, self.max_seq_len, self.kv_blocks, self.kv_block_size)


class PrefixRouter:
    """Which replica last served each leading-block hash (a bounded LRU table), and the routing rule."""

    def __init__(self, slack: int = PREFIX_SLACK, size: int = PREFIX_TABLE_SIZE):
        self.slack, self.size = slack, size
        self.owner: "collections.OrderedDict[int, Tuple[int, int]]" = collections.OrderedDict()

    def choose(self, hashes: List[int], n_tokens: int, block_size: int, loads: Dict[int, int],
               routed: Dict[int, int], incarnations: Dict[int, int]) -> Tuple[int, bool]:
        """(replica, whether its prefix chose it) for a prompt of n_tokens whose full blocks hash to
        `hashes`, among the replicas in `loads` (the ready ones: choices in flight each). `routed`:
        requests sent to each so far (the tie-break); `incarnations`: a restarted replica's cache is
        empty, so what its previous process served does not count.

        The replica that last served the longest run of the prompt's leading blocks gets it when it is
        as idle as any, or when that run is at least half the prompt and it has at most `slack` more
        choices in flight than the least-loaded replica (a shared system prompt alone does not outweigh
        the load); else the least-loaded replica."""
        least = min(loads, key=lambda r: (loads[r], routed.get(r, 0), r))
        owner, depth = None, 0
        for i, h in enumerate(hashes):       # a chain hash matches only where the whole prefix does
            o = self.owner.get(h)
            if o is None:
                break
            if o[0] in loads and incarnations.get(o[0]) == o[1]:
                owner, depth = o[0], i + 1
        pick = least
        if owner is not None:
            mostly_cached = 2 * depth * block_size >= n_tokens
            if loads[owner] <= loads[least] or (mostly_cached and loads[owner] <= loads[least] + self.slack):
                pick = owner
        for h in hashes:
            self.owner[h] = (pick, incarnations[pick])
            self.owner.move_to_end(h)
        while len(self.owner) > self.size:
            self.owner.popitem(last=False)
        return pick, pick == owner


_LIVE = ("loading", "restarting", "ready")   # a process that runs (or loads)


@dataclasses.dataclass
class _ReplicaTarget(_Target):
    replica: int = 0


class _Replica:
    def __init__(self, index: int, cpus: List[int]):
        self.index, self.cpus = index, cpus
        self.process = self.conn = None
        self.outbox: "queue_mod.SimpleQueue[Optional[bytes]]" = queue_mod.SimpleQueue()
        self.status = "loading"            # -> "ready" | "failed" (dead) -> "restarting" -> "ready"; "stopped"
        self.incarnation = 0
        self.info: Dict[str, Any] = {}
        self.fatal: Optional[str] = None   # what the process said before it exited
        self.requests = self.prefix_routed = self.restarts = 0
        self.waiting = self.running = 0
        self.spec: Optional[Dict[str, int]] = None


def _sender(conn, outbox) -> None:
    """Writes one replica's messages, so a replica busy with a long step blocks no one but this thread."""
    while True:
        data = outbox.get()
        if data is None:
            return
        try:
            conn.send_bytes(data)
        except OSError:                    # it died: the receiver sees that and fails its requests
            return


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "it stopped answering"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class ReplicatedRunner(EngineRunner):
    """The server's engine runner over N replica processes. `engine` is the FrontEngine; add and abort go
    to the replicas, and one receiver thread (the runner's thread) delivers their chunks with
    EngineRunner's own _deliver."""

    def __init__(self, front: Optional[FrontEngine], model: str, options: Dict[str, Any], cpu_sets: List[List[int]],
                 threads: Optional[int] = None, max_restarts: int = DEFAULT_MAX_RESTARTS):
        super().__init__(front, Metrics())
        import multiprocessing as mp
        self._ctx = mp.get_context("spawn")
        self._args = (model, threads, options)
        self.replicas = [_Replica(i, list(cpus)) for i, cpus in enumerate(cpu_sets)]
        self.router = PrefixRouter()
        self.max_restarts = max_restarts
        self.on_dead = None
        self.dead: Optional[str] = None
        self._deaths: Deque[float] = collections.deque()
        self._started = False
        self._loading = True               # startup: a replica that fails is fatal, not restarted

    # -- lifecycle -------------------------------------------------------------------------------
    def launch(self) -> None:
        """Starts every replica and the receiver thread; wait_ready then waits for them."""
        for r in self.replicas:
            self._spawn(r)
        self._started = True
        self._thread.start()

    def _spawn(self, r: _Replica) -> None:
        model, threads, options = self._args
        parent, child = self._ctx.Pipe(duplex=True)
        p = self._ctx.Process(target=replica_main, name=f"corelm-replica-{r.index}", daemon=True,
                              args=(child, r.index, r.cpus, model, threads, options))
        p.start()
        child.close()
        r.process, r.conn, r.status, r.fatal = p, parent, "loading", None
        r.incarnation += 1
        r.outbox = queue_mod.SimpleQueue()
        threading.Thread(target=_sender, args=(parent, r.outbox), name=f"corelm-replica-{r.index}-send",
                         daemon=True).start()

    def wait_ready(self) -> None:
        """Blocks until every replica has loaded; ReplicaFailure (all stopped) when one could not."""
        with self._cv:
            while self.dead is None and any(r.status != "ready" for r in self.replicas):
                self._cv.wait()
            self._loading = False
        if self.dead is not None:
            self.stop()
            raise ReplicaFailure(self.dead)

    def start(self) -> None:               # the server calls it; the replicas are running since launch()
        if not self._started:
            self.launch()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for r in self.replicas:
            r.outbox.put(_encode({"op": "stop"}))
            r.outbox.put(None)
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            if r.process is not None:
                r.process.join(max(0.0, deadline - time.monotonic()))
                if r.process.is_alive():
                    r.process.kill()
                    r.process.join(1)
            r.status = "stopped"
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for r in self.replicas:
            if r.conn is not None:
                r.conn.close()

    # -- what the server asks --------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(r.waiting for r in self.replicas if r.status == "ready")

    @property
    def num_running(self) -> int:
        return sum(r.running for r in self.replicas if r.status == "ready")

    def spec_counts(self) -> Optional[Dict[str, int]]:
        counts = [r.spec for r in self.replicas if r.spec]
        if not counts:
            return None
        return {k: sum(c.get(k, 0) for c in counts) for k in ("draft_tokens", "accepted_tokens")}

    def has_unfinished_requests(self) -> bool:
        with self._cv:
            return bool(self._targets)

    def _loads(self) -> Dict[int, int]:
        loads = {r.index: 0 for r in self.replicas if r.status == "ready"}
        for t in self._targets.values():
            if t.replica in loads:
                loads[t.replica] += t.unfinished
        return loads

    def add(self, request_id: str, prompt_ids: List[int], params: SamplingParams,
            queue: "asyncio.Queue", prompt_index: int = 0) -> None:
        """From the event loop. ValueError for what the engine would refuse; a 503 APIError when no
        replica is ready. Nothing is queued then."""
        loop = asyncio.get_running_loop()
        self.engine.check_prompt(prompt_ids)
        params.validate_against_vocab(self.engine.vocab_size)
        data = _encode({"op": "add", "id": request_id, "prompt": [int(t) for t in prompt_ids],
                        "params": params_to_wire(params)})
        hashes = block_hashes(prompt_ids, self.engine.kv_block_size)
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            if request_id in self._targets:
                raise ValueError(f"request id {request_id!r} is already in use")
            loads = self._loads()
            if not loads:
                raise APIError(503, "No replica is ready to serve (they are restarting); retry shortly.",
                               "unavailable_error", code="no_replica_ready")
            pick, by_prefix = self.router.choose(hashes, len(prompt_ids), self.engine.kv_block_size, loads,
                                                 {r.index: r.requests for r in self.replicas},
                                                 {r.index: r.incarnation for r in self.replicas})
            r = self.replicas[pick]
            r.requests += 1
            r.prefix_routed += by_prefix
            self._targets[request_id] = _ReplicaTarget(loop, queue, prompt_index, params.n, time.monotonic(),
                                                       replica=pick)
            r.outbox.put(data)
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(prompt_ids)

    def abort(self, request_id: str) -> None:
        with self._cv:
            t = self._targets.get(request_id)
            if t is not None:
                self.replicas[t.replica].outbox.put(_encode({"op": "abort", "id": request_id}))

    def health(self) -> Dict[str, Any]:
        """{"status": "ok" | "degraded" (some replica not ready) | "unavailable" (none), "replicas": [...]}."""
        with self._cv:
            states = [{"replica": r.index, "status": r.status} for r in self.replicas]
        ready = sum(s["status"] == "ready" for s in states)
        status = "ok" if ready == len(states) else "degraded" if ready else "unavailable"
        return {"status": status, "replicas": states}

    def render_metrics(self) -> str:
        with self._cv:
            loads = {r.index: 0 for r in self.replicas}
            for t in self._targets.values():
                loads[t.replica] += t.unfinished
            rows = [(r, f'{{replica="{r.index}"}}') for r in self.replicas]
            lines: List[str] = []

            def metric(name: str, kind: str, help_: str, values) -> None:
                lines.append(f"# HELP corelm_{name} {help_}")
                lines.append(f"# TYPE corelm_{name} {kind}")
                lines.extend(f"corelm_{name}{labels} {value}" for labels, value in values)

            metric("replica_requests_total", "counter", "Prompts routed to each replica.",
                   [(lab, r.requests) for r, lab in rows])
            metric("replica_prefix_routed_total", "counter",
                   "Prompts routed to a replica because it last served their longest leading KV blocks.",
                   [(lab, r.prefix_routed) for r, lab in rows])
            metric("replica_load", "gauge", "Choices queued or running on each replica.",
                   [(lab, loads[r.index]) for r, lab in rows])
            metric("replica_up", "gauge", "1 while a replica is loaded and serving.",
                   [(lab, int(r.status == "ready")) for r, lab in rows])
            metric("replica_restarts_total", "counter", "Times a replica died and was restarted.",
                   [(lab, r.restarts) for r, lab in rows])
            metric("replica_info", "gauge", "A replica's process and CPUs.",
                   [(f'{{replica="{r.index}",pid="{r.process.pid if r.process else ""}",'
                     f'cpus="{",".join(map(str, r.cpus))}"}}', 1) for r, _ in rows])
        return "\n".join(lines) + "\n"

    # -- the receiver thread ---------------------------------------------------------------------
    def _run(self) -> None:
        from multiprocessing.connection import wait
        while True:
            with self._cv:
                if self._stopping:
                    return
                handles: Dict[Any, Tuple[_Replica, int]] = {}
                for r in self.replicas:
                    if r.status in _LIVE and r.process is not None:
                        handles[r.conn] = (r, r.incarnation)
                        handles[r.process.sentinel] = (r, r.incarnation)
            try:
                ready = wait(list(handles), timeout=0.2)   # the timeout picks up restarted replicas
            except OSError:                  # a handle closed under us by stop()
                continue
            for obj in ready:
                r, incarnation = handles[obj]
                if r.incarnation != incarnation or r.status not in _LIVE:
                    continue                 # handled already (its conn and sentinel were both ready)
                alive = self._drain(r)
                if not alive or obj is not r.conn:
                    self._died(r)

    def _drain(self, r: _Replica) -> bool:
        """Handles what the replica sent; False once its pipe is closed."""
        try:
            while r.conn.poll():
                self._handle(r, json.loads(r.conn.recv_bytes()))
        except (EOFError, OSError):
            return False
        return True

    def _handle(self, r: _Replica, msg: Dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "out":
            r.waiting, r.running, r.spec = msg["waiting"], msg["running"], msg.get("spec")
            self._deliver([chunk_from_wire(c) for c in msg["chunks"]])
        elif op == "error":                  # a request the replica refused or failed
            with self._cv:
                t = self._targets.pop(msg["id"], None)
            if t is not None:
                log.error("request %s failed on replica %d: %s", msg["id"], r.index, msg["error"])
                self._fail([t], APIError(500, f"The engine failed: {msg['error']}", "server_error"))
        elif op == "ready":
            with self._cv:
                r.info, r.status = msg["info"], "ready"
                self._cv.notify_all()
            log.info("replica %d ready (pid %s, CPUs %s, %s threads)", r.index, msg["info"].get("pid"),
                     msg["info"].get("cpus"), msg["info"].get("threads"))
        elif op == "fatal":
            r.fatal = msg["error"]

    def _fail(self, targets: List[_ReplicaTarget], error: APIError) -> None:
        for t in targets:
            t.loop.call_soon_threadsafe(t.queue.put_nowait, error)
        with self.metrics.lock:
            self.metrics.finished["error"] += sum(t.unfinished for t in targets)

    def _died(self, r: _Replica) -> None:
        r.process.join(1)
        why = r.fatal or _exit_text(r.process.exitcode)
        with self._cv:
            if self._stopping:
                return
            r.status = "failed"
            r.outbox.put(None)
            failed = [t for t in self._targets.values() if t.replica == r.index]
            for rid in [k for k, t in self._targets.items() if t.replica == r.index]:
                del self._targets[rid]
        r.conn.close()
        if failed:
            self._fail(failed, APIError(503, f"Replica {r.index} stopped unexpectedly ({why}); its requests "
                                             f"failed. Retry the request.", "unavailable_error",
                                        code="replica_failed"))
        now = time.monotonic()
        while self._deaths and self._deaths[0] < now - RESTART_WINDOW_S:
            self._deaths.popleft()
        self._deaths.append(now)
        fatal = None
        if self._loading:
            fatal = f"replica {r.index} failed to load the model: {why}"
        elif len(self._deaths) > self.max_restarts:
            fatal = (f"replica {r.index} died ({why}): {len(self._deaths)} replica deaths in {RESTART_WINDOW_S:g} s "
                     f"are more than --replica-restarts {self.max_restarts} allows; stopping the server")
        if fatal is not None:
            log.error("%s", fatal)
            with self._cv:
                self.dead = fatal
                self._cv.notify_all()
            if not self._loading and self.on_dead is not None:
                self.on_dead(ReplicaFailure(fatal))
            return
        log.error("replica %d died (%s); %d request(s) failed; restarting it", r.index, why, len(failed))
        r.restarts += 1
        with self._cv:
            if not self._stopping:
                self._spawn(r)
                r.status = "restarting"


class ReplicatedLLM:
    """What `load_llm` gives the server for --data-parallel-size N: `engine` (the FrontEngine) and
    make_runner, which hands over the running replicas."""

    def __init__(self, front: FrontEngine, runner: ReplicatedRunner):
        self.engine, self.runner = front, runner

    def make_runner(self, metrics: Metrics, on_dead=None) -> ReplicatedRunner:
        self.runner.metrics, self.runner.on_dead = metrics, on_dead
        return self.runner


def resolve_model(model: Optional[str]) -> str:
    """A local path for `model`: the embedded default, a file or folder, or a hub reference downloaded
    once here (not by every replica at once)."""
    return local_model_path(model)


def load_replicas(model: Optional[str], size: int, options: Dict[str, Any], threads: Optional[int] = None,
                  max_restarts: int = DEFAULT_MAX_RESTARTS,
                  cpu_sets: Optional[List[List[int]]] = None) -> ReplicatedLLM:
    """Starts `size` replicas of `model` (options: LLMEngine's keyword arguments, threads aside; `threads`
    per replica, default the replica's CPUs), one per CPU set (default engine.placement.split_cpus),
    and the server's tokenizer; returns once all are ready. ReplicaFailure when one cannot load."""
    if size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {size}.")
    if max_restarts < 0:
        raise ValueError(f"--replica-restarts must be 0 or more, got {max_restarts}.")
    path = resolve_model(model)
    cpu_sets = cpu_sets or split_cpus(size)
    if size > len(allowed_cpus()):
        log.warning("%d replicas on %d CPUs: replicas share CPUs", size, len(allowed_cpus()))
    options = {k: v for k, v in options.items() if k != "threads"}
    runner = ReplicatedRunner(None, path, options, cpu_sets, threads, max_restarts)
    try:
        runner.launch()
        front = FrontEngine(path)           # while the replicas load
        runner.wait_ready()
    except BaseException:
        runner.stop()
        raise
    info = runner.replicas[0].info
    front.set_limits(info, info["eos_token_ids"])
    runner.engine = front
    return ReplicatedLLM(front, runner)
