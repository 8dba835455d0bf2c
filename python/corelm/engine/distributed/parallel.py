"""A model across several processes over MPI (mpi4py; `pip install "corelm[distributed]"` brings it with
MPICH): tensor parallelism (each rank a slice of every layer) or pipeline parallelism (each rank some layers).

Rank 0 is the engine: tokenizer, scheduler, sampling, the server. Every other rank holds its part
(shard.py) and follows: for each call rank 0 makes on its core (`forward_batch`, `park_threads`) it
broadcasts the call and every rank runs it on its own part. Tensor-parallel cores sum their partial
products twice a layer through `RankGroup.allreduce`, and the ranks' slices of the logits are gathered on
rank 0; pipeline stages hand their hidden states on (`send_hidden`, `receive_hidden`), and the last stage's
logits go to rank 0. The engine above sees one core (`ParallelCore`), so batching, the prefix cache,
speculative decoding and structured output work unchanged. Messages are flat integer arrays, never
pickles: MPI's ports are unauthenticated.

Launch: `start(...)` from a plain Python process launches ranks 1..N-1 as an MPI job of their own
(`mpiexec -n N-1 python -m corelm.engine.distributed.follower PORT`, joined through an MPI port), each pinned
to its own NUMA node or slice of the cores; under an MPI launcher (`mpiexec -n N python app.py`) the ranks it
started are used, and ranks other than 0 follow inside `LLM(...)` and exit when rank 0 is done.

Faults: every wait polls, so a rank that dies is noticed within a second (its process is gone, on one
machine) or after `stall_timeout` seconds without progress (any machine): rank 0's call raises
`RankFailure` and every later one does too; followers exit when rank 0 is gone.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import socket
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ...errors import EngineDead

log = logging.getLogger("corelm")

OP_FORWARD, OP_PARK, OP_STOP = 1, 2, 3
HEADER = 5   # op, tokens, sequences, block-table entries, micro-batches (pipeline: the sequences in groups)
HIDDEN_TAG, LOGITS_TAG = 7, 8


class RankFailure(EngineDead):
    """A rank of the group died or stopped answering: the group cannot run another step."""


def mpi():
    """mpi4py's MPI module, without MPI_Finalize at exit (a dead rank would make it wait forever)."""
    try:
        import mpi4py
    except ImportError as e:
        raise ImportError('tensor parallelism needs mpi4py and an MPI: pip install "corelm[distributed]"') from e
    mpi4py.rc.finalize = False
    mpi4py.rc.threads = True
    from mpi4py import MPI
    return MPI


def mpich_calls(MPI):
    """(MPI_Iallreduce, MPI_Iallgather, MPI_Test) addresses in the MPI library mpi4py loaded, where its ABI is
    MPICH's (int handles: what runtime/collectives.h calls); None otherwise."""
    if MPI._sizeof(MPI.Comm) != 4 or MPI._sizeof(MPI.Request) != 4:
        return None
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libmpi" in line and line.rstrip().endswith(".so.12")}
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        try:
            return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                         for name in ("MPI_Iallreduce", "MPI_Iallgather", "MPI_Test"))
        except AttributeError:
            continue
    return None


def under_launcher() -> bool:
    """Whether an MPI launcher (mpiexec, srun) started this process as one of several ranks."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        if int(os.environ.get(var, "1") or 1) > 1:
            return True
    return False


class RankGroup:
    """The ranks of one model over an MPI communicator: the collectives the cores and
    the engine need, each polled so that a dead or stalled rank becomes an error, not a hang."""

    def __init__(self, comm, stall_timeout: float = 120.0):
        self.MPI = mpi()
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stall_timeout = float(stall_timeout)
        self.failed: Optional[str] = None
        self.stopped = False
        self.launcher = None   # the followers' mpiexec, where rank 0 launched them
        self._pending: List[Any] = []   # sends in flight: (request, the buffer it reads)
        self._gathered = np.empty(0, np.float32)
        # who runs where: a rank on this machine whose process is gone has died
        me = (socket.gethostname(), os.getpid())
        self.peers = comm.allgather(me)
        self._local = [(r, pid) for r, (host, pid) in enumerate(self.peers) if host == me[0] and r != self.rank]
        self._last_check = 0.0

    # -- failure detection -------------------------------------------------------------------------
    def _check_peers(self) -> None:
        now = time.monotonic()
        if now - self._last_check < 0.2:
            return
        self._last_check = now
        import psutil
        for r, pid in self._local:
            try:
                alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                self.fail(f"rank {r} of the model's {self.size} (pid {pid}) died")

    def run(self, forward, *args):
        """forward(*args) on this rank's core, whose collectives raise the core's RankFailure: the group's."""
        from ... import _core
        if self.failed:
            raise RankFailure(self.failed)
        try:
            return forward(*args)
        except _core.RankFailure as e:
            self.fail(str(e))

    def fail(self, why: str) -> None:
        self.failed = self.failed or why
        self.end_launcher(kill=True)
        raise RankFailure(self.failed)

    def end_launcher(self, kill: bool = False, timeout: float = 10.0) -> None:
        """The followers' job (ranks rank 0 launched): waited for after a stop, killed after a failure."""
        launcher, self.launcher = self.launcher, None
        if launcher is None:
            return
        if not kill:
            try:
                launcher.wait(timeout)
                return
            except Exception:
                pass
        try:
            os.killpg(launcher.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        launcher.wait()

    def wait(self, request, stall_timeout: Optional[float] = None) -> None:
        """Completes a non-blocking MPI request: spins briefly (a step's collectives answer within
        microseconds), then sleeps between polls; raises RankFailure if a rank dies or nothing moves for
        stall_timeout seconds (None: this group's; 0: wait for ever, as an idle follower does)."""
        if self.failed:
            raise RankFailure(self.failed)
        limit = self.stall_timeout if stall_timeout is None else stall_timeout
        start = time.monotonic()
        spins = 0
        while not request.Test():
            spins += 1
            if spins < 20000:
                continue
            self._check_peers()
            waited = time.monotonic() - start
            if limit and waited > limit:
                self.fail(f"the model's ranks stopped answering for {waited:.0f} s")
            time.sleep(0.0002 if waited < 0.05 else 0.002)

    # -- collectives ---------------------------------------------------------------------------------
    def allreduce(self, address: int, n: int) -> None:
        """Sums n float32 at `address` across the ranks in place, with the same bits on every rank (so the
        ranks never drift apart) and from run to run: two ranks' a + b is b + a, so MPI_Allreduce is exact
        there; from three on every rank adds the gathered parts in rank order (MPI fixes no order)."""
        part = np.ctypeslib.as_array((ctypes.c_float * n).from_address(address))
        if self.size == 2:
            self.wait(self.comm.Iallreduce(self.MPI.IN_PLACE, part, op=self.MPI.SUM))
            return
        if self._gathered.size < n * self.size:
            self._gathered = np.empty(n * self.size, np.float32)
        every = self._gathered[:n * self.size]
        self.wait(self.comm.Iallgather(part, every))
        every = every.reshape(self.size, n)
        np.add(every[0], every[1], out=part)
        for r in range(2, self.size):
            np.add(part, every[r], out=part)

    def attach_allreduce(self, core) -> None:
        """Gives `core` this group's allreduce: called from C++ straight into the MPI library where it speaks
        MPICH's ABI (the mpich and impi-rt wheels), else through `allreduce` below (which takes the GIL)."""
        calls = mpich_calls(self.MPI)
        if calls is None:
            core.set_allreduce(self.allreduce)
            return
        def handle(obj) -> int:   # an MPICH handle as the C int it is (mpi4py gives it unsigned)
            h = self.MPI._handleof(obj) & 0xFFFFFFFF
            return h - (1 << 32) if h >= 1 << 31 else h
        core.set_allreduce_mpi(*calls, comm=handle(self.comm), float_type=handle(self.MPI.FLOAT),
                               sum_op=handle(self.MPI.SUM), rank=self.rank, size=self.size,
                               local_peers=self._local, stall_seconds=self.stall_timeout)

    def send_hidden(self, address: int, n: int) -> None:
        """A pipeline stage's output (n float32 at address) to the next stage, without waiting: a copy goes,
        and this stage goes on with its next micro-batch (finish_sends waits for them all)."""
        self.send_async(np.ctypeslib.as_array((ctypes.c_float * n).from_address(address)).copy(), self.rank + 1,
                        HIDDEN_TAG)

    def send_async(self, data: np.ndarray, dest: int, tag: int) -> None:
        self._pending.append((self.comm.Isend(data, dest=dest, tag=tag), data))

    def finish_sends(self) -> None:
        pending, self._pending = self._pending, []
        for request, _ in pending:
            self.wait(request)

    def receive_hidden(self, address: int, n: int) -> None:
        """The previous stage's output into n float32 at address."""
        part = np.ctypeslib.as_array((ctypes.c_float * n).from_address(address))
        self.wait(self.comm.Irecv(part, source=self.rank - 1, tag=HIDDEN_TAG))

    def bcast_ints(self, values: Optional[np.ndarray], n: int, idle: bool = False) -> np.ndarray:
        buf = values if self.rank == 0 else np.empty(n, np.int64)
        self.wait(self.comm.Ibcast(buf, root=0), stall_timeout=0 if idle else None)
        return buf

    def bcast_json(self, value: Any = None) -> Any:
        """A small JSON-able value from rank 0 (options at start-up)."""
        data = np.frombuffer(json.dumps(value).encode(), np.uint8) if self.rank == 0 else None
        size = self.bcast_ints(np.array([0 if data is None else data.size], np.int64), 1)
        buf = data if self.rank == 0 else np.empty(int(size[0]), np.uint8)
        self.wait(self.comm.Ibcast(buf, root=0))
        return json.loads(buf.tobytes().decode())

    def gather_columns(self, part: np.ndarray, widths: Sequence[int]) -> Optional[np.ndarray]:
        """Rank 0: the ranks' [rows][width_r] arrays side by side, [rows][sum of widths]; others: None."""
        rows = part.shape[0]
        counts = [rows * w for w in widths]
        if self.rank != 0:
            self.wait(self.comm.Igatherv(np.ascontiguousarray(part, np.float32), None, root=0))
            return None
        flat = np.empty(sum(counts), np.float32)
        self.wait(self.comm.Igatherv(np.ascontiguousarray(part, np.float32),
                                     [flat, counts, np.cumsum([0] + counts[:-1]).tolist(), self.MPI.FLOAT], root=0))
        out = np.empty((rows, sum(widths)), np.float32)
        col = 0
        for w, piece in zip(widths, np.split(flat, np.cumsum(counts)[:-1])):
            out[:, col:col + w] = piece.reshape(rows, w)
            col += w
        return out

    def gather_json(self, value: Any) -> Optional[List[Any]]:
        """Rank 0: every rank's small JSON-able value, by rank; others: None."""
        data = np.frombuffer(json.dumps(value).encode(), np.uint8)
        sizes = np.zeros(self.size, np.int64)
        self.wait(self.comm.Iallgather(np.array([data.size], np.int64), sizes))
        if self.rank != 0:
            self.wait(self.comm.Igatherv(data, None, root=0))
            return None
        flat = np.empty(int(sizes.sum()), np.uint8)
        counts = sizes.tolist()
        self.wait(self.comm.Igatherv(data, [flat, counts, np.cumsum([0] + counts[:-1]).tolist(), self.MPI.BYTE], root=0))
        return [json.loads(p.tobytes().decode()) for p in np.split(flat, np.cumsum(counts)[:-1])]


def _encode_forward(tokens: np.ndarray, seqs, groups: Sequence[int] = ()) -> np.ndarray:
    """One int64 array: the header, the tokens, (n_tokens, pos, n_blocks, all_logits) per sequence, the block
    tables, then the sequences per micro-batch (pipeline parallelism)."""
    tables = [np.asarray(s[2], np.int64).reshape(-1) for s in seqs]
    meta = np.array([(int(s[0]), int(s[1]), t.size, int(bool(s[3]))) for s, t in zip(seqs, tables)],
                    np.int64).reshape(-1)
    head = np.array([OP_FORWARD, tokens.size, len(seqs), sum(t.size for t in tables), len(groups)], np.int64)
    return np.concatenate([head, tokens.astype(np.int64), meta] + tables + [np.asarray(groups, np.int64)])


def _decode_forward(body: np.ndarray, T: int, n: int, micro: int):
    tokens = body[:T].astype(np.int32)
    meta = body[T:T + 4 * n].reshape(n, 4)
    seqs, at = [], T + 4 * n
    for n_tokens, pos, n_blocks, all_logits in meta.tolist():
        seqs.append((n_tokens, pos, body[at:at + n_blocks].astype(np.int32), bool(all_logits)))
        at += n_blocks
    return tokens, seqs, body[at:at + micro].tolist()


def micro_batches(seqs, parts: int) -> List[int]:
    """The sequences cut into at most `parts` consecutive groups of about equal tokens (their counts), so
    pipeline stages work on one group while the next stage works on the one before."""
    parts = max(1, min(parts, len(seqs)))
    sizes = [int(s[0]) for s in seqs]
    total, counts, start = sum(sizes), [], 0
    for p in range(parts):
        want, end, acc = total * (p + 1) / parts, start, sum(sizes[:start])
        while end < len(seqs) - (parts - p - 1) and (end == start or acc + sizes[end] <= want + 1e-9):
            acc += sizes[end]
            end += 1
        if p == parts - 1:
            end = len(seqs)
        counts.append(end - start)
        start = end
    return [c for c in counts if c]


def _groups(tokens: np.ndarray, seqs, counts: Sequence[int]):
    """(tokens, seqs) of each micro-batch."""
    at_seq = at_tok = 0
    for c in counts:
        part = seqs[at_seq:at_seq + c]
        t = sum(int(s[0]) for s in part)
        yield tokens[at_tok:at_tok + t], part
        at_seq, at_tok = at_seq + c, at_tok + t


def _logit_rows(seqs) -> int:
    return sum(int(s[0]) if s[3] else 1 for s in seqs)


class ParallelCore:
    """Rank 0's view of the group: the calls the engine makes on a core, made on every rank. Any other
    attribute is rank 0's own core's (its part's sizes, threads, KV cache). logit_widths: the columns of the
    logits each rank computes (a slice of the vocabulary each, or all on the last pipeline stage)."""

    def __init__(self, core, group: RankGroup, logit_widths: Sequence[int], kind: str):
        self._core, self._group, self._widths, self.kind = core, group, list(logit_widths), kind
        atexit.register(self.stop)   # the followers exit with rank 0

    def __getattr__(self, name):
        return getattr(self._core, name)

    @property
    def ranks(self) -> int:
        return self._group.size

    def forward_batch(self, tokens, seqs):
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        seqs = list(seqs)
        groups = micro_batches(seqs, self._group.size) if self.kind == "pipeline" else []
        msg = _encode_forward(tokens, seqs, groups)
        self._group.bcast_ints(msg[:HEADER].copy(), HEADER)
        self._group.bcast_ints(msg[HEADER:].copy(), msg.size - HEADER)
        if self.kind != "pipeline":
            logits = self._group.run(self._core.forward_batch, tokens, seqs)
            return self._group.gather_columns(logits[:, :self._widths[0]], self._widths)
        # the last stage's logits of each micro-batch, received as they come while this stage goes on
        g = self._group
        parts = [np.empty((_logit_rows(part), self._widths[-1]), np.float32) for _, part in _groups(tokens, seqs, groups)]
        receives = [g.comm.Irecv(buf, source=g.size - 1, tag=LOGITS_TAG) for buf in parts]
        try:
            for t, part in _groups(tokens, seqs, groups):
                g.run(self._core.forward_batch, t, part)
            g.finish_sends()
        except ValueError:   # refused input: every stage refused it at the same micro-batch; no logits come
            for request in receives:
                request.Cancel()
            raise
        for request in receives:
            g.wait(request)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def park_threads(self):
        self._group.bcast_ints(np.array([OP_PARK, 0, 0, 0, 0], np.int64), HEADER)
        self._core.park_threads()

    def stop(self) -> None:
        """Tells the followers to exit (rank 0's engine is done); once."""
        if self._group.failed or self._group.stopped:
            return
        self._group.stopped = True
        try:
            self._group.bcast_ints(np.array([OP_STOP, 0, 0, 0, 0], np.int64), HEADER)
            self._group.end_launcher()
        except RankFailure:
            pass


def follow(core, group: RankGroup, width: int) -> None:
    """A follower's loop: run each call rank 0 broadcasts on this rank's shard until told to stop. A call
    that fails here fails on rank 0 too (the same input), so the loop goes on; a dead rank 0 ends it."""
    last = group.rank == group.size - 1
    while True:
        head = group.bcast_ints(None, HEADER, idle=True)
        op, T, n, blocks, micro = (int(v) for v in head)
        if op == OP_STOP:
            return
        if op == OP_PARK:
            core.park_threads()
            continue
        body = group.bcast_ints(None, T + 4 * n + blocks + micro)
        tokens, seqs, groups = _decode_forward(body, T, n, micro)
        try:
            if not groups:
                logits = group.run(core.forward_batch, tokens, seqs)
                group.gather_columns(logits[:, :width], [])
                continue
            for t, part in _groups(tokens, seqs, groups):   # a pipeline stage: micro-batch after micro-batch
                logits = group.run(core.forward_batch, t, part)
                if last:
                    group.send_async(np.ascontiguousarray(logits), 0, LOGITS_TAG)
            group.finish_sends()
        except (ValueError, RuntimeError) as e:
            if isinstance(e, RankFailure):
                raise
            continue


# -- start-up ----------------------------------------------------------------------------------------

def _build_part(options: Dict[str, Any], kind: str, group: RankGroup):
    """Loads the model and builds this rank's part of it; returns (core, every rank's logit columns, the
    loaded model)."""
    from ..model_builder import build_core_model
    from ...loader import load_model
    from .shard import pipeline_plan, plan
    loaded = load_model(options["model"])
    shards = (plan if kind == "tensor" else pipeline_plan)(loaded.spec, group.size)
    core = build_core_model(loaded, dtype=options["dtype"], threads=options["threads"],
                            max_seq_len=options["max_seq_len"], kv_cache_dtype=options["kv_cache_dtype"],
                            kv_cache_gb=options["kv_cache_gb"], kv_sparsity=options["kv_sparsity"],
                            pin_threads=options["pin_threads"], numa=options["numa"],
                            schedule=options["schedule"], activations=options["activations"],
                            shard=shards[group.rank])
    vocab = int(loaded.spec.vocab_size)
    if kind == "tensor":
        group.attach_allreduce(core)
        widths = [s.vocab[1] - s.vocab[0] for s in shards]
    else:
        core.set_pipeline(group.receive_hidden if group.rank > 0 else None,
                          group.send_hidden if group.rank < group.size - 1 else None)
        widths = [0] * (group.size - 1) + [vocab]
    return core, widths, loaded


def _pin(cpus: Optional[List[int]]) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def run_follower(group: RankGroup) -> None:
    """A follower from start to end: options from rank 0, its shard, then `follow` until stopped."""
    start = group.bcast_json()
    group.stall_timeout = float(start["stall_timeout"])
    _pin(start["cpus"][group.rank] if start["cpus"] else None)
    try:
        core, widths, _ = _build_part(start["options"], start["kind"], group)
        status = {"ok": True}
    except Exception as e:                    # reported by rank 0, which raises it
        core, status = None, {"ok": False, "error": f"{type(e).__name__}: {e}"}
    group.gather_json(status)
    if not group.bcast_json():                # rank 0's verdict: every rank built its part
        return
    follow(core, group, widths[group.rank])


def interface_env(iface: Optional[str]) -> Dict[str, str]:
    """The environment that keeps MPICH's traffic (UCX or libfabric TCP) on network interface `iface`: MPI's
    ports take any connection, so on a shared network they belong on a private interface."""
    return {"UCX_NET_DEVICES": iface, "FI_TCP_IFACE": iface, "FI_SOCKETS_IFACE": iface} if iface else {}


def _launch_followers(MPI, size: int, hosts: Optional[str], iface: Optional[str]):
    """Ranks 1..size-1 as a job of their own (the MPI wheel's mpiexec), joined to this process through
    an MPI port. Their own job, not MPI_Comm_spawn's: MPICH ends every process of a job when one dies,
    and rank 0 is the user's process, which must live to report it. Returns (communicator, launcher)."""
    import shutil
    import subprocess
    import threading
    port = MPI.Open_port()
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if mpiexec is None:
        raise ImportError('tensor parallelism needs an MPI launcher (mpiexec): pip install "corelm[distributed]"')
    cmd = [mpiexec, "-disable-auto-cleanup", "-n", str(size - 1)] + (["-f", hosts] if hosts else []) + \
          (["-iface", iface] if iface else []) + [sys.executable, "-m", "corelm.engine.distributed.follower", port]
    launcher = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True,
                                env=dict(os.environ, **interface_env(iface)))
    joined: Dict[str, Any] = {}

    def accept() -> None:   # blocking, with no timeout of its own: a thread, watched below
        try:
            joined["comm"] = MPI.COMM_SELF.Accept(port, root=0).Merge(high=False)
        except Exception as e:  # pragma: no cover - MPI refused the connection
            joined["error"] = e
    t = threading.Thread(target=accept, name="corelm-tp-accept", daemon=True)
    t.start()
    deadline = time.monotonic() + 300
    while t.is_alive():
        t.join(0.05)
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill() if launcher.poll() is None else None
            raise RankFailure(f"the model's ranks did not start ({' '.join(cmd)} exited with "
                              f"{launcher.returncode})")
    if "error" in joined:
        raise RankFailure(f"the model's ranks could not join: {joined['error']}")
    return joined["comm"], launcher


def start(options: Dict[str, Any], size: int, kind: str = "tensor", stall_timeout: float = 120.0,
          hosts: Optional[str] = None, iface: Optional[str] = None):
    """Rank 0's start: the group of `size` ranks (launched here, or the launcher's), every rank's part built
    with `options` (build_core_model's, plus "model"), cut by `kind` ("tensor" or "pipeline"), and the core
    the engine drives. Returns (ParallelCore, the loaded model: its tokenizer and spec). On a rank other
    than 0 under a launcher, follows rank 0 and exits the process when rank 0 is done. hosts: an MPI
    hostfile for ranks 1..N-1 (default: this machine); iface: the network interface MPI's traffic keeps to
    (needs to be set before MPI starts in this process, so it is also exported here)."""
    os.environ.update(interface_env(iface))
    MPI = mpi()
    if under_launcher():
        comm = MPI.COMM_WORLD
        if comm.Get_size() != size:
            raise ValueError(f"{kind}_parallel_size={size} but the MPI launcher started {comm.Get_size()} ranks.")
        group = RankGroup(comm, stall_timeout)
        if group.rank != 0:
            run_follower(group)
            sys.exit(0)
        cpus = None                            # the launcher placed the ranks (mpiexec --bind-to ...)
    else:
        from ..placement import split_cpus
        cpus = split_cpus(size) if hosts is None else None
        comm, launcher = _launch_followers(MPI, size, hosts, iface)
        group = RankGroup(comm, stall_timeout)
        group.launcher = launcher
    group.bcast_json({"options": options, "kind": kind, "cpus": cpus, "stall_timeout": stall_timeout})
    _pin(cpus[0] if cpus else None)
    try:
        core, widths, loaded = _build_part(options, kind, group)
        status, failure = {"ok": True}, None
    except Exception as e:
        core, widths, loaded, status = None, None, None, {"ok": False, "error": f"{type(e).__name__}: {e}"}
        failure = e
    statuses = group.gather_json(status)
    bad = [f"rank {r}: {s['error']}" for r, s in enumerate(statuses) if not s["ok"]]
    group.bcast_json(not bad)
    if isinstance(failure, ValueError):   # a bad model file or option: rank 0's own error (ModelLoadError...)
        raise failure
    if bad:
        raise ValueError(f"{kind} parallelism could not start: " + "; ".join(bad))
    return ParallelCore(core, group, widths, kind), loaded
