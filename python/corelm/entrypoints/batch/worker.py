"""The engine side of a batch run: one `BatchWorker` per worker process (or Ray actor).

A task is a short list of BatchRequests. All of them go to the worker's LLMEngine at once (it batches
them continuously and fans each out into its n choices), as the server hands its clients' requests to
its engine; a request the engine refuses (a prompt longer than the context, a token id outside the
vocabulary) gets an error line with the server's code and message, and the others run.

With several models ({name: path}, `corelm batch --models-dir DIR`), each line's `model` picks one: a worker
loads a model when a line first names it and runs a task's requests one model at a time (one engine holds
the cores at a time), keeping at most `max_loaded` models loaded (the least recently used one goes first).
A name the run does not serve, or a model that failed to load, is that line's error.
"""
from __future__ import annotations

import collections
import gc
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...errors import EngineDead
from ...openai import APIError, Response, TokenText, embeddings, sampling_error
from ...openai.routes import encode, make_response
from ..catalog import model_load_failed, model_not_found
from .protocol import BatchRequest, error_line, response_line


Result = Tuple[Dict[str, Any], int]   # (output line, completion tokens)


def _fatal(e: BaseException) -> bool:
    """Whether an exception must end the worker (EngineDead: a rank of its model died; a new worker starts
    anew). Anything else (a TypeError from the tokenizer, a pyo3
    PanicException, which derives from BaseException, from a catastrophic regex) fails one request."""
    return isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError, EngineDead))


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


class BatchWorker:
    """One worker's engine. options: LLMEngine keyword arguments (dtype, max_seq_len, numa, schedule,
    activations), the same for every worker. `model`: a path, or {name: path} for several models picked by
    each line's `model` field (loaded when first named; at most options["max_loaded_models"] at once)."""
    def __init__(self, model, threads: Optional[int], options: Optional[Dict[str, Any]] = None):
        self.threads, self.options = threads, dict(options or {})
        self.max_loaded = self.options.pop("max_loaded_models", None)   # the engines' options, less the router's
        self.models: Optional[Dict[str, str]] = dict(model) if isinstance(model, dict) else None
        self.loaded: "collections.OrderedDict[str, Tuple[Any, TokenText]]" = collections.OrderedDict()  # LRU first
        self.failed: Dict[str, str] = {}       # name -> why its load failed
        if self.models is None:
            self.engine, self.tokens = self._build(model)

    def _build(self, path: Optional[str]):
        from ...engine import LLMEngine
        engine = LLMEngine(path, threads=self.threads, **self.options)
        return engine, TokenText(engine.tokenizer)

    def info(self) -> Dict[str, Any]:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        if self.models is not None:
            return {"pid": os.getpid(), "cpus": cpus, "models": sorted(self.models)}
        e = self.engine
        return {"pid": os.getpid(), "threads": e.threads, "cpus": cpus,
                "dtype": e.dtype, "schedule": e.schedule, "activations": e.activations}

    def _use(self, name: Optional[str]) -> None:
        """Makes the model a line names the worker's engine, loading it (and unloading the least recently
        used beyond max_loaded) when it is not loaded; APIError for an unknown name or a failed load."""
        if name is None and len(self.models) == 1:
            name = next(iter(self.models))
        if name not in self.models:
            raise model_not_found(name, self.models)
        if name in self.failed:
            raise model_load_failed(self.failed[name])
        if name not in self.loaded:
            while self.max_loaded is not None and len(self.loaded) >= self.max_loaded:
                self.loaded.popitem(last=False)
                self.engine = self.tokens = None
                gc.collect()               # the engine's memory goes before the next one loads
            try:
                self.loaded[name] = self._build(self.models[name])
            except Exception as e:         # this model's lines fail; the others run
                self.failed[name] = _why(e)
                raise model_load_failed(self.failed[name]) from None
        self.loaded.move_to_end(name)
        self.engine, self.tokens = self.loaded[name]

    def run_task(self, requests: Sequence[BatchRequest]) -> List[Result]:
        """[(output line, completion tokens)] for every request of the task, in any order."""
        if self.models is None:
            return self._run_requests(requests)
        by_model: Dict[Optional[str], List[BatchRequest]] = collections.defaultdict(list)
        for r in requests:
            by_model[r.request.model].append(r)
        results: List[Result] = []
        for name, group in by_model.items():     # one model's engine at a time holds the cores
            try:
                self._use(name)
            except APIError as e:
                results += [(error_line(r.custom_id, e.code, e.message), 0) for r in group]
                continue
            results += self._run_requests(group)
        return results

    def _run_requests(self, requests: Sequence[BatchRequest]) -> List[Result]:
        results: List[Result] = []
        running: Dict[str, Tuple[BatchRequest, Response, int]] = {}   # engine request id -> (request, response, prompt index)
        for r in requests:
            if isinstance(r.request, embeddings.PoolingRequest):   # whole at once, between nothing
                results.append(self._pool(r))
                continue
            try:
                added = self._add(r)
            except APIError as e:
                results.append((error_line(r.custom_id, e.code or "invalid_request", e.message), 0))
                continue
            except BaseException as e:           # this request's failure, not its neighbours'
                if _fatal(e):
                    raise
                traceback.print_exc(file=sys.stderr)
                results.append((error_line(r.custom_id, "internal_error",
                                           f"the request failed before generating ({_why(e)})."), 0))
                continue
            running.update(added)
        try:
            while running:
                for rid, chunk in self.engine.step():
                    if rid not in running:       # an aborted request's last chunk
                        continue
                    r, response, prompt_index = running[rid]
                    if chunk.finish_reason == "error":   # the model gave no answer: the line says why
                        for other in [k for k, v in running.items() if v[1] is response]:
                            del running[other]
                            if other != rid:
                                self.engine.abort_request(other)
                        results.append((error_line(r.custom_id, "server_error", chunk.error), 0))
                        continue
                    response.add(prompt_index, chunk)
                    if response.finished:
                        for other in [k for k, v in running.items() if v[1] is response]:
                            del running[other]
                        results.append((response_line(r.custom_id, response.body()), response.completion_tokens))
        except BaseException as e:               # a bug: the task's requests fail, the worker carries on
            if _fatal(e):
                raise
            traceback.print_exc(file=sys.stderr)
            failed = {v[0].custom_id for v in running.values()}
            for rid in running:
                self.engine.abort_request(rid)
            results += [(error_line(cid, "internal_error", f"{type(e).__name__} while generating"), 0)
                        for cid in sorted(failed)]
        return results

    def _pool(self, r: BatchRequest) -> Result:
        """An embeddings, score or rerank line's output line."""
        try:
            job = embeddings.prepare(self.engine, r.request)
            vectors = self.engine.embed(job.ids, job.params)
        except APIError as e:
            return error_line(r.custom_id, e.code or "invalid_request", e.message), 0
        except ValueError as e:            # as the server answers it
            return error_line(r.custom_id, "invalid_request", str(e)), 0
        except BaseException as e:         # this line's failure, not its neighbours'
            if _fatal(e):
                raise
            traceback.print_exc(file=sys.stderr)
            return error_line(r.custom_id, "internal_error", f"the request failed ({_why(e)})."), 0
        body = embeddings.respond(job, vectors, r.request.model or self.engine.model_name)
        return response_line(r.custom_id, body), 0

    def _add(self, r: BatchRequest) -> Dict[str, Tuple[BatchRequest, Response, int]]:
        """Queues the request's prompts; APIError (nothing left queued) when the engine refuses one."""
        req = r.request
        prompts = encode(self.engine, req)       # encode_prompts, or with a /v1/messages prefill
        response = make_response(req, sum(len(ids) for ids in prompts), req.model or self.engine.model_name,
                                 self.tokens)        # OpenAI's, or Anthropic's for /v1/messages
        added = {}
        lora = self.engine.lora_by_name(req.model)   # a line whose model is a --lora adapter's name runs through it
        try:
            for p, ids in enumerate(prompts):
                rid = f"{response.id}-{p}"
                self.engine.add_request(rid, ids, req.params, **({} if lora is None else {"lora_request": lora}))
                added[rid] = (r, response, p)
        except BaseException as e:
            for rid in added:
                self.engine.abort_request(rid)
            if isinstance(e, ValueError):        # as the server answers it
                raise sampling_error(e) from None
            raise
        return added


def _exit_with_parent(poll_s: float = 0.2) -> None:
    """A daemon thread that ends this process once its parent is gone (reparented: getppid changes), so
    an orphan neither finishes its task for nobody nor prints a BrokenPipeError traceback."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)
    threading.Thread(target=watch, name="corelm-batch-parent-watch", daemon=True).start()


def worker_main(conn, index: int, incarnation: int, cpus: Optional[List[int]], model,
                threads: Optional[int], options: Dict[str, Any]) -> None:
    """A worker process: pin, load, say ready, then answer tasks until told to stop (None) or the
    pipe closes. Messages out: ("ready", info) | ("fatal", text) | ("result", task_id, results).
    Ctrl-C reaches the whole process group: the parent handles it (and stops the workers), so a worker
    ignores SIGINT rather than print a KeyboardInterrupt traceback of its own. A worker whose parent is
    gone (SIGKILLed) has nobody to answer: it exits at once, quietly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()

    def send(msg) -> None:
        try:
            conn.send(msg)
        except OSError:                      # BrokenPipeError: the parent died
            os._exit(0)

    try:
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)   # before loading: the weights are first touched from here
        worker = BatchWorker(model, threads, options)
    except Exception as e:                   # a missing or corrupt model: the parent reports it
        send(("fatal", f"{e}"))
        conn.close()
        os._exit(1)
    send(("ready", worker.info()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        task_id, requests = msg
        send(("result", task_id, worker.run_task(requests)))
    conn.close()
