"""The parent of a batch run: reads the input as a stream, validates lines, hands tasks (up to
`task_size` requests) to N workers, and appends each result line to the output as it arrives.

Process model: every worker is a spawned process with its own engine, pinned to its own CPU set
(topology.split_cpus: a NUMA node each where there are enough, else disjoint core slices), loading
its own copy of the weights after pinning so they sit in local memory. Each worker has a private
duplex pipe, and holds at most one task: the parent sends the next task only after the previous
result came back, so neither side can block the other, and the parent always knows which task each
worker holds. A worker that dies (exit, SIGKILL, OOM) is seen through its process sentinel; its
task goes back to the front of the queue, one task per request (so a request that kills workers
takes no neighbour down with it), and a replacement worker starts on the same CPUs. A request that
has killed MAX_ATTEMPTS workers gets an error line instead of another try.

No record is lost or duplicated: only the parent writes, once per custom_id, flushing each line;
each input line gets exactly one output line, keyed by its custom_id (the first line with that id)
or by its line number (a duplicate's or a malformed line's error); on a rerun, lines whose key is
already in the output are skipped (a truncated last line left by a crash is cut off first, so the
file stays valid JSONL). The output may not be the input, and a run whose output file is deleted or
replaced while it runs stops with an error (OutputLostError) rather than report results not on disk.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import stat
import sys
import time
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

from .protocol import BatchLineError, BatchRequest, error_line, parse_line
from ...engine import LoRARequest, check_kv_sparsity, split_cpus
from ...options import choose, choose_optional
from .worker import worker_main

MAX_ATTEMPTS = 3


# ---------------------------------------------------------------------------------------------------
# The output file

def load_done(path: str) -> Tuple[Set[str], Set[int]]:
    """(custom_ids already answered, input line numbers already reported as malformed) from an
    earlier run's output. Unparseable lines are ignored; a last line without its newline (a crash
    mid-write) is cut off so appending keeps the file valid JSONL."""
    ids: Set[str] = set()
    lines: Set[int] = set()
    if not os.path.isfile(path):             # nothing yet, or a device or pipe (/dev/full, /dev/stdout):
        return ids, lines                    # only appended to, never read back
    good_end = 0
    with open(path, "rb+") as f:
        offset = 0
        for raw in f:
            end = offset + len(raw)
            if raw.endswith(b"\n"):
                good_end = end
                try:
                    rec = json.loads(raw)
                except ValueError:
                    rec = None
                if isinstance(rec, dict):
                    cid = rec.get("custom_id")
                    if isinstance(cid, str):
                        ids.add(cid)
                    elif isinstance(rec.get("error"), dict) and isinstance(rec["error"].get("line"), int):
                        lines.add(rec["error"]["line"])
            offset = end
        if good_end < offset:
            f.truncate(good_end)
    return ids, lines


class OutputLostError(OSError):
    """The output path no longer names the file being written (deleted, or replaced by another file)."""


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_not_input(input_path: str, output_path: str) -> None:
    """Refuses an output that is the input file itself (the same path, a symlink or a hard link to it): the
    run would append to what it reads, and load_done would truncate it."""
    try:
        src, out = os.stat(input_path), os.stat(output_path)   # follows symlinks; a hard link has the same inode
    except OSError:                              # no output yet: not the input
        return
    if _same_file(src, out) and stat.S_ISREG(src.st_mode):   # (/dev/null -o /dev/null harms nothing)
        raise ValueError(f"the output {output_path} is the input file {input_path}: results would be appended to "
                         f"the requests being read. Give another -o file.")


class _Writer:
    def __init__(self, path: str, done_ids: Set[str]):
        self.path = path
        self.f = open(path, "a", encoding="utf-8")
        st = os.fstat(self.f.fileno())
        self.stat = st if stat.S_ISREG(st.st_mode) else None   # devices and pipes are not checked
        self.written = set(done_ids)
        self.count = self.errors = 0

    def write(self, rec: Dict[str, Any]) -> bool:
        cid = rec.get("custom_id")
        if cid is not None:
            if cid in self.written:            # never twice, whatever happens upstream
                return False
            self.written.add(cid)
        try:
            text = json.dumps(rec, ensure_ascii=False) + "\n"
            text.encode("utf-8")
        except UnicodeEncodeError:             # a lone surrogate: \u escapes are still valid JSON
            text = json.dumps(rec) + "\n"
        self.f.write(text)
        self.f.flush()
        self.check()
        self.count += 1
        self.errors += rec.get("error") is not None
        return True

    def check(self) -> None:
        """OutputLostError unless the path still names the file written to: results written to a deleted
        or replaced file are not on disk where the user (or a resume) looks for them."""
        if self.stat is None:
            return
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            now = None
        if now is None or not _same_file(now, self.stat):
            raise OutputLostError(f"the output file {self.path} was {'deleted' if now is None else 'replaced'} "
                                  f"while the batch ran: the results written to it are lost. Rerun to redo them.")

    def close(self) -> None:
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
        finally:
            self.f.close()


# ---------------------------------------------------------------------------------------------------
# Backends: worker processes here, Ray actors in ray_backend.py. Both answer wait() with events:
# ("ready", slot, info) | ("result", slot, task_id, results) | ("died", slot, why) | ("fatal", slot, text)

class ProcessBackend:
    def __init__(self, workers: int, threads: Optional[int], model: Optional[str], options: Dict[str, Any],
                 cpu_sets: Optional[List[List[int]]] = None):
        import multiprocessing as mp
        self.ctx = mp.get_context("spawn")
        self.cpu_sets = cpu_sets or split_cpus(workers)
        self.args = (model, threads, options)
        self.procs: Dict[int, Any] = {}
        self.conns: Dict[int, Any] = {}
        self.incarnation = collections.Counter()
        for slot in range(workers):
            self.start(slot)

    def start(self, slot: int) -> None:
        parent, child = self.ctx.Pipe(duplex=True)
        p = self.ctx.Process(target=worker_main, name=f"corelm-batch-{slot}", daemon=True,
                             args=(child, slot, self.incarnation[slot], self.cpu_sets[slot]) + self.args)
        p.start()
        child.close()
        self.incarnation[slot] += 1
        self.procs[slot], self.conns[slot] = p, parent

    def live(self) -> bool:
        return bool(self.procs)

    def pids(self) -> Dict[int, int]:
        return {s: p.pid for s, p in self.procs.items()}

    def send(self, slot: int, task_id: int, requests: List[BatchRequest]) -> None:
        try:
            self.conns[slot].send((task_id, requests))
        except OSError:
            pass                               # it died: the sentinel says so on the next wait()

    def wait(self, timeout: float) -> List[tuple]:
        from multiprocessing.connection import wait
        by_obj = {}
        for slot, c in self.conns.items():
            by_obj[c] = slot
            by_obj[self.procs[slot].sentinel] = slot
        events, dead = [], set()
        for obj in wait(list(by_obj), timeout):
            slot = by_obj[obj]
            if slot in dead:
                continue
            conn = self.conns[slot]
            try:                               # drain what it sent before it went (if it did)
                while conn.poll():
                    msg = conn.recv()
                    events.append((msg[0], slot) + tuple(msg[1:]))
            except (EOFError, OSError):
                dead.add(slot)
            if obj is not conn or slot in dead:
                p = self.procs[slot]
                p.join(timeout=5)
                if not p.is_alive() or slot in dead:
                    dead.add(slot)
        for slot in dead:
            p = self.procs.pop(slot)
            self.conns.pop(slot).close()
            p.join(timeout=5)
            events.append(("died", slot, f"exit code {p.exitcode}"))
        return events

    def terminate(self) -> None:
        """Ctrl-C: stops the workers now (SIGTERM), not after their tasks."""
        for p in self.procs.values():
            p.terminate()

    def close(self) -> Dict[int, Dict[str, Any]]:
        """Stops every worker; returns {slot: info} of those that said "ready" only now (a worker still
        loading when the work ran out loads, says so, reads the stop and exits)."""
        for slot, c in list(self.conns.items()):
            try:
                c.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        late: Dict[int, Dict[str, Any]] = {}
        for slot, c in self.conns.items():
            try:
                while c.poll():
                    msg = c.recv()
                    if msg[0] == "ready":
                        late[slot] = msg[1]
            except (EOFError, OSError):
                pass
            c.close()
        self.procs.clear()
        self.conns.clear()
        return late


# ---------------------------------------------------------------------------------------------------

def _count_lines(path: str) -> int:
    n = 0
    with open(path, "rb") as f:
        for raw in f:
            n += bool(raw.strip())
    return n


def _progress(total: int, enabled: Optional[bool]):
    from tqdm import tqdm
    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(total=total, unit="req", desc="batch", disable=not enabled, dynamic_ncols=True, file=sys.stderr)


def run_batch(input_path: str, output_path: str, workers: int = 1, threads: Optional[int] = None,
              model: Union[str, Dict[str, str], None] = None, dtype: str = "auto", max_seq_len: Optional[int] = None,
              task_size: int = 8, progress: Optional[bool] = None, ray_address: Optional[str] = None,
              max_restarts: Optional[int] = None, on_start=None, numa: Optional[str] = None,
              schedule: Optional[str] = None, activations: str = "auto", kv_cache_dtype: str = "auto",
              kv_cache_gb: Optional[float] = None, kv_sparsity: float = 0.0,
              speculative_model: Optional[str] = "[ngram]", num_speculative_tokens: Optional[int] = None,
              speculative_weights: Optional[str] = None, tensor_parallel_size: int = 1,
              pipeline_parallel_size: int = 1, mpi_hosts: Optional[str] = None,
              mpi_iface: Optional[str] = None, max_loaded_models: Optional[int] = None,
              prefix_cache_dir: Optional[str] = None, prefix_cache_gb: Optional[float] = None,
              reasoning_budget: int = -1, generation_config: str = "auto", lora_modules: Sequence[LoRARequest] = (),
              max_loras: Optional[int] = None) -> Dict[str, Any]:
    """Runs every request of input_path not yet answered in output_path; returns a summary dict.
    dtype, max_seq_len, numa, schedule, activations, kv_cache_dtype, kv_cache_gb, kv_sparsity, the speculative_*
    options, the parallel ones, prefix_cache_dir / prefix_cache_gb (one directory the workers share),
    reasoning_budget, generation_config and lora_modules / max_loras (a line whose model is an adapter's name
    runs through it) are corelm.LLM's, for every worker (a worker with tensor_parallel_size=N
    is N processes on its own cores). `model`: a path, or {name: path} for several models, each line's
    `model` picking one (worker.py), at most `max_loaded_models` loaded in a worker at once.
    `on_start(backend)` is called once the workers are started (tests use it to find their pids)."""
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}.")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}.")
    if task_size < 1:
        raise ValueError(f"--task-size must be at least 1, got {task_size}.")
    # the engine checks these too; here a typo fails before any worker starts
    choose("dtype", dtype)
    choose_optional("numa", numa)
    choose_optional("schedule", schedule)
    choose("activations", activations)
    choose("kv_cache_dtype", kv_cache_dtype)
    check_kv_sparsity(kv_sparsity)
    options = {"dtype": dtype, "max_seq_len": max_seq_len, "numa": numa, "schedule": schedule,
               "activations": activations, "kv_cache_dtype": kv_cache_dtype, "kv_cache_gb": kv_cache_gb,
               "kv_sparsity": kv_sparsity}
    options.update(speculative_model=speculative_model, num_speculative_tokens=num_speculative_tokens,
                   speculative_weights=speculative_weights)
    if reasoning_budget != -1:
        options["reasoning_budget"] = reasoning_budget
    if generation_config != "auto":
        options["generation_config"] = generation_config
    if lora_modules:
        if isinstance(model, dict):
            raise ValueError("--lora serves adapters of one model: not with --models-dir.")
        for lora in lora_modules:
            if not os.path.exists(lora.lora_path):
                raise FileNotFoundError(f"LoRA adapter {lora.lora_name}: {lora.lora_path} does not exist.")
        options["lora_modules"] = [dataclasses.replace(lora, lora_path=os.path.abspath(lora.lora_path))
                                   for lora in lora_modules]
        if max_loras is not None:
            options["max_loras"] = max_loras
    if isinstance(model, dict):
        model = {name: os.path.abspath(path) for name, path in model.items()}
        if max_loaded_models is not None:
            options["max_loaded_models"] = max_loaded_models
    if prefix_cache_dir is not None or prefix_cache_gb is not None:   # a budget alone: the engine says what is missing
        options.update(prefix_cache_dir=prefix_cache_dir and os.path.abspath(prefix_cache_dir),
                       prefix_cache_gb=prefix_cache_gb)
    if tensor_parallel_size > 1 or pipeline_parallel_size > 1:
        options.update(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                       mpi_hosts=mpi_hosts, mpi_iface=mpi_iface)
    if not os.path.exists(input_path):
        raise FileNotFoundError(f"input file {input_path} does not exist.")
    if os.path.isdir(input_path):
        raise IsADirectoryError(f"input file {input_path} is a directory.")
    check_not_input(input_path, output_path)
    max_restarts = 3 * workers if max_restarts is None else max_restarts
    done_ids, done_lines = load_done(output_path)
    total = _count_lines(input_path) if os.path.isfile(input_path) else None   # a pipe is read once
    writer = _Writer(output_path, done_ids)
    bar = _progress(total, progress)
    stats: Dict[str, Any] = {"requests": 0, "errors": 0, "skipped": 0, "generated_tokens": 0, "restarts": 0,
                             "lines": 0, "workers": {}}   # workers: slot -> what its engine reported (every worker that loaded)
    t0 = time.perf_counter()
    seen: Set[str] = set()

    def emit(rec: Dict[str, Any], tokens: int = 0) -> None:
        if writer.write(rec):
            stats["requests"] += 1
            stats["errors"] += rec.get("error") is not None
            stats["generated_tokens"] += tokens
        bar.update(1)
        dt = time.perf_counter() - t0
        if dt > 0 and not bar.disable:
            bar.set_postfix_str(f"{stats['generated_tokens'] / dt:.1f} tok/s", refresh=False)   # req/s: tqdm's rate

    def tasks() -> Iterator[List[BatchRequest]]:
        # Each input line has one output line, keyed by its custom_id when it is the first line with
        # that id, else by its line number (an error line). The key depends on the input alone, so
        # `seen` is filled for skipped lines too: a rerun tells first lines from duplicates as the
        # first run did, however many runs were killed on the way.
        batch: List[BatchRequest] = []
        with open(input_path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                stats["lines"] += 1
                try:
                    req, error = parse_line(raw), None
                    cid = req.custom_id
                except BatchLineError as e:
                    req, error, cid = None, e, e.custom_id
                except Exception as e:           # a bug below the checks: this line's error, not the run's
                    req, cid = None, None
                    error = BatchLineError("invalid_request", f"the line could not be read ({type(e).__name__}).")
                first = cid is not None and cid not in seen
                if first:
                    seen.add(cid)
                if (cid in done_ids) if first else (line_no in done_lines):
                    stats["skipped"] += 1
                    bar.update(1)
                    continue
                if error is not None:
                    emit(error_line(cid if first else None, error.code, error.message, None if first else line_no))
                elif not first:
                    emit(error_line(None, "duplicate_custom_id", "this custom_id appeared on an earlier line.",
                                    line_no))
                else:
                    batch.append(req)
                    if len(batch) >= task_size:
                        yield batch
                        batch = []
        if batch:
            yield batch

    backend = None
    try:
        if ray_address:
            from .ray_backend import RayBackend
            backend = RayBackend(ray_address, workers, threads, model, options)
        else:
            backend = ProcessBackend(workers, threads, model, options)
        if on_start is not None:
            on_start(backend)
        source = tasks()
        pending: Deque[Tuple[int, List[BatchRequest], int]] = collections.deque()
        holding: Dict[int, Optional[Tuple[int, List[BatchRequest], int]]] = {}   # slot -> its task (None: idle)
        next_id, exhausted = 0, False
        while True:
            while not exhausted and len(pending) < 2 * workers:
                try:
                    pending.append((next_id, next(source), 0))
                    next_id += 1
                except StopIteration:
                    exhausted = True
            for slot in [s for s, t in holding.items() if t is None]:
                if not pending:
                    break
                task = pending.popleft()
                holding[slot] = task
                backend.send(slot, task[0], task[1])
            if exhausted and not pending and not any(holding.values()):
                break
            if not holding and not backend.live():
                raise ChildProcessError("every batch worker died; no worker is left to run the remaining requests.")
            for ev in backend.wait(0.5):
                kind, slot = ev[0], ev[1]
                if kind == "ready":
                    holding[slot] = None
                    stats["workers"][slot] = ev[2]
                elif kind == "fatal":
                    raise ValueError(f"a batch worker could not load the model: {ev[2]}")
                elif kind == "result":
                    task = holding.get(slot)
                    if task is not None and task[0] == ev[2]:
                        holding[slot] = None
                    for rec, tokens in ev[3]:
                        emit(rec, tokens)
                elif kind == "died":
                    task = holding.pop(slot, None)
                    if task is not None:
                        task_id, reqs, attempts = task
                        if len(reqs) > 1:
                            # one request may be what kills it: retry each alone, so only that one is blamed
                            for r in reversed(reqs):
                                pending.appendleft((next_id, [r], attempts + 1))
                                next_id += 1
                        elif attempts + 1 >= MAX_ATTEMPTS:
                            emit(error_line(reqs[0].custom_id, "worker_crashed",
                                            f"the worker died {MAX_ATTEMPTS} times running this request."))
                        else:
                            pending.appendleft((task_id, reqs, attempts + 1))
                    print(f"corelm batch: worker {slot} died ({ev[2]})"
                          + (f"; its task goes back to the queue" if task is not None else ""), file=sys.stderr)
                    if stats["restarts"] < max_restarts:
                        stats["restarts"] += 1
                        backend.start(slot)
    except KeyboardInterrupt:
        if backend is not None and hasattr(backend, "terminate"):
            backend.terminate()
        raise
    finally:
        if backend is not None:
            for slot, info in (backend.close() or {}).items():   # ready only after the work ran out
                stats["workers"].setdefault(slot, info)
        bar.close()
        writer.close()
    writer.check()                               # never a summary of results that are not on disk
    stats["seconds"] = time.perf_counter() - t0
    lines = stats.pop("lines")
    stats["total_lines"] = lines if total is None else total
    return stats
