"""The engine side of a batch run: one `BatchEngine` per worker process (or Ray actor).

A task is a short list of BatchRequests. Requests with equal SamplingParams go to the engine in one
`LLM.chat` / `LLM.generate` call (which batches them once the continuous-batching engine is in);
when such a call refuses its input (a prompt longer than the context, a token id outside the
vocabulary), the group is retried one request at a time so only the bad request gets an error line.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .protocol import BatchRequest, error_line, response_line

# Test hook: "WORKER:TASK" makes the first incarnation of worker WORKER ("*": of every worker) exit
# abruptly (os._exit, as a SIGKILL would: no cleanup, no reply) on receiving its TASK-th task (1-based).
CRASH_ENV = "CORELM_BATCH_TEST_CRASH"


def model_name(path: Optional[str]) -> str:
    if not path:
        return "corelm"
    return os.path.basename(os.path.normpath(path)) or "corelm"


class BatchEngine:
    """One worker's engine. options: corelm.LLM keyword arguments (dtype, max_seq_len, numa, schedule,
    activations), the same for every worker."""
    def __init__(self, model: Optional[str], threads: Optional[int], options: Optional[Dict[str, Any]] = None):
        from ..llm import LLM
        self.llm = LLM(model, threads=threads, **(options or {}))
        self.model = model_name(model)

    def info(self) -> Dict[str, Any]:
        return {"pid": os.getpid(), "threads": self.llm.threads,
                "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "dtype": self.llm.dtype, "schedule": self.llm.schedule, "activations": self.llm.activations}

    def run_task(self, requests: Sequence[BatchRequest]) -> List[Tuple[Dict[str, Any], int]]:
        """[(output line, completion tokens)] for every request of the task, in any order."""
        groups: List[Tuple[Tuple[str, Any], List[BatchRequest]]] = []
        for r in requests:
            for key, members in groups:
                if key == (r.kind, r.params):
                    members.append(r)
                    break
            else:
                groups.append(((r.kind, r.params), [r]))
        results = []
        for (kind, params), members in groups:
            try:
                results += self._run(kind, params, members)
            except ValueError:
                for r in members:
                    try:
                        results += self._run(kind, params, [r])
                    except ValueError as e:
                        results.append(self._fail(r, e))
                    except Exception as e:      # a bug: the request fails, the worker carries on
                        traceback.print_exc(file=sys.stderr)
                        results.append((error_line(r.custom_id, "internal_error",
                                                   f"{type(e).__name__} while generating"), 0))
        return results

    def _run(self, kind: str, params, members: List[BatchRequest]):
        if kind == "chat":
            outs = self.llm.chat([r.prompt for r in members], params)
        else:
            outs = self.llm.generate([r.prompt for r in members], params)
        return [(response_line(r, o.outputs, len(o.prompt_token_ids), self.model),
                 sum(len(c.token_ids) for c in o.outputs)) for r, o in zip(members, outs)]

    @staticmethod
    def _fail(r: BatchRequest, e: ValueError):
        msg = str(e)
        code = "context_length_exceeded" if "context" in msg else "invalid_request"
        return error_line(r.custom_id, code, msg if len(msg) <= 300 else msg[:300] + "..."), 0


def worker_main(conn, index: int, incarnation: int, cpus: Optional[List[int]], model: Optional[str],
                threads: Optional[int], options: Dict[str, Any]) -> None:
    """A worker process: pin, load, say ready, then answer tasks until told to stop (None) or the
    pipe closes. Messages out: ("ready", info) | ("fatal", text) | ("result", task_id, results)."""
    try:
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)   # before loading: the weights are first touched from here
        engine = BatchEngine(model, threads, options)
    except Exception as e:                   # a missing or corrupt model: the parent reports it
        conn.send(("fatal", f"{e}"))
        conn.close()
        os._exit(1)
    crash = os.environ.get(CRASH_ENV, "")
    crash_at = None
    if crash and incarnation == 0:
        w, _, t = crash.partition(":")
        if w == "*" or int(w) == index:
            crash_at = int(t)
    conn.send(("ready", engine.info()))
    received = 0
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        task_id, requests = msg
        received += 1
        if crash_at is not None and received == crash_at:
            os._exit(17)
        conn.send(("result", task_id, engine.run_task(requests)))
    conn.close()
