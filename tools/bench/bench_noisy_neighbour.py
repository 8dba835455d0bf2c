"""Decode speed of the static and dynamic schedules, with and without a noisy neighbour.

The neighbour is a process pinned to one CPU (default: CPU 1, where the 2-thread pool pins its worker)
that busy-loops for duty * period (of its CPU time by default, see --duty-clock) and sleeps for the
rest of each period, like a co-tenant's periodic job. While it runs, the OS time-slices that CPU between it and the pool's worker in millisecond
slices, so the worker is sometimes not running at all: under the static split every region waits for
its share, under the dynamic schedule the calling thread takes over the worker's leftovers and redoes
a chunk the worker holds while descheduled.

One model per thread count; the schedule is switched on the same model (`model.schedule`), and each
round measures every (neighbour, schedule) pair in alternating order, so drift in the machine's load
hits all of them alike. The neighbour is paused (SIGSTOP) when off. Reports median decode tokens/s per
cell, the dynamic/static ratio, and the 1-minute load average before and after. On a machine busy with
other jobs, `setsid ... --nice -10` raises this run (pool and neighbour alike) above them.

    python tools/bench/bench_noisy_neighbour.py [MODEL] [--dtype bf16] [--threads 1 2] [--rounds 5]
        [--tokens 32] [--duty 0.5] [--period-ms 4] [--duty-clock cpu|wall] [--cpu 1] [--nice N] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python"))

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, when loaded by path
from core_forward import core_forward  # noqa: E402

DEFAULT_MODEL = os.path.expanduser("~/corelm-peers/models/qwen0.5b-dims-rand")

# Each period the neighbour busy-loops until it has had duty * period of CPU ("cpu": a job that needs
# that share of the core, so it takes it from whatever else runs there) or until duty * period of wall
# time has passed ("wall": gets less when it has to share), then sleeps to the end of the period.
# Periods follow absolute time, so the cycle keeps its rate however long the OS holds it off the CPU.
NEIGHBOUR = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
period, duty, clock = float(sys.argv[2]) / 1000, float(sys.argv[3]), sys.argv[4]
now = time.process_time if clock == "cpu" else time.perf_counter
t = time.perf_counter()
while True:
    start = now()
    while now() < start + duty * period:
        pass
    t = max(t + period, time.perf_counter() - period)   # a period overrun is not made up later
    time.sleep(max(0.0, t - time.perf_counter()))
"""


class Neighbour:
    def __init__(self, cpu: int, period_ms: float, duty: float, clock: str = "cpu"):
        self.proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(cpu), str(period_ms), str(duty), clock])
        self.running = True
        self.pause()

    def pause(self):
        if self.running:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.running = False

    def resume(self):
        if not self.running:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.running = True

    def close(self):
        self.resume()
        self.proc.terminate()
        self.proc.wait()


def decode_rate(core, tokens: int, warmup: int = 4) -> float:
    """Tokens/s of one-token forwards (greedy, fed back) at positions 0.. of the default sequence."""
    tok = np.array([1], dtype=np.int32)
    for pos in range(warmup):
        tok[0] = int(np.argmax(core_forward(core, tok, pos, False)))
    t0 = time.perf_counter()
    for pos in range(warmup, warmup + tokens):
        tok[0] = int(np.argmax(core_forward(core, tok, pos, False)))
    return tokens / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per measurement")
    ap.add_argument("--duty", type=float, default=0.5, help="share of each period the neighbour is busy")
    ap.add_argument("--period-ms", type=float, default=4.0)
    ap.add_argument("--duty-clock", choices=["cpu", "wall"], default="cpu",
                    help="the neighbour's busy share counts its CPU time (cpu) or wall time (wall)")
    ap.add_argument("--cpu", type=int, default=1, help="the CPU the neighbour is pinned to")
    ap.add_argument("--nice", type=int, default=0,
                    help="niceness of this process and the neighbour, and of its autogroup where the kernel "
                         "groups sessions (run under `setsid` so only this run's group changes; negative "
                         "needs root): shields the measurement from other jobs while the pool and the "
                         "neighbour still compete evenly")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.nice:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)   # inherited by the neighbour and the pool's threads
        try:   # with CONFIG_SCHED_AUTOGROUP, nice only ranks threads within their session's group
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(args.nice))
        except OSError:
            pass

    from corelm import LLM
    load_before = os.getloadavg()[0]
    neighbour = Neighbour(args.cpu, args.period_ms, args.duty, args.duty_clock)
    rows = []
    try:
        for n in args.threads:
            llm = LLM(args.model, threads=n, dtype=args.dtype, max_seq_len=args.tokens + 16, speculative_model=None)
            neighbour.pause()
            llm.wait_for_huge_pages(timeout=300)   # decode at its steady speed (LLM.wait_for_huge_pages)
            core = llm.engine.core
            cells = {(noisy, s): [] for noisy in (False, True) for s in ("static", "dynamic")}
            order = list(cells)
            for r in range(args.rounds):
                for noisy, sched in (order if r % 2 == 0 else order[::-1]):
                    (neighbour.resume if noisy else neighbour.pause)()
                    core.schedule = sched
                    cells[(noisy, sched)].append(decode_rate(core, args.tokens))
                neighbour.pause()
            for noisy in (False, True):
                st, dy = (statistics.median(cells[(noisy, s)]) for s in ("static", "dynamic"))
                rows.append(dict(threads=n, neighbour=noisy, static=st, dynamic=dy, ratio=dy / st,
                                 static_runs=cells[(noisy, "static")], dynamic_runs=cells[(noisy, "dynamic")]))
            rows[-1]["redone_chunks"] = core.redone_chunks
            del llm, core
    finally:
        neighbour.close()
    load_after = os.getloadavg()[0]
    info = dict(model=args.model, dtype=args.dtype, tokens=args.tokens, rounds=args.rounds, duty=args.duty, duty_clock=args.duty_clock, nice=args.nice,
                period_ms=args.period_ms, neighbour_cpu=args.cpu, loadavg_1min_before=load_before,
                loadavg_1min_after=load_after, rows=rows)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{os.path.basename(args.model.rstrip('/'))} {args.dtype}, {args.tokens} tokens x {args.rounds} rounds; "
          f"neighbour on CPU {args.cpu}: {args.duty:.0%} ({args.duty_clock} time) of every {args.period_ms:g} ms; "
          f"nice {args.nice}; 1-min load {load_before:.2f} -> {load_after:.2f}")
    print(f"{'threads':>7} {'neighbour':>9} {'static tok/s':>12} {'dynamic tok/s':>13} {'dyn/static':>10}")
    for r in rows:
        print(f"{r['threads']:7d} {'yes' if r['neighbour'] else 'no':>9} {r['static']:12.1f} {r['dynamic']:13.1f} "
              f"{r['ratio']:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
