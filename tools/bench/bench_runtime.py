"""What a parallel region of corelm's thread pool costs.

A region is the pool's only synchronization: the caller publishes it (fork), every thread claims
slots, and the caller waits until all slots are done (join, the barrier between two regions). The
model runs 5 regions per layer per token, so this overhead is paid a few hundred times per decoded
token. For each thread count, with workers pinned and not, it reports the mean region time of a fresh
pool (median of --repeats runs), next to the serial time of one slot's work:

    empty      fn does nothing: the bare fork + join
    tiny/small each slot runs a dependent multiply-add chain (work=100 / 1000 steps)
    wake       empty regions 5 ms apart, past the workers' 2 ms spin: each region wakes sleepers
    wake+      the same with small work: shows whether woken workers arrive in time to help

overhead = region - slot: what the pool adds over a perfect split (slots run concurrently). "worker"
is the share of slots run by workers rather than the caller; with empty regions the caller claims
every slot before a worker gets there, which is the slot-claiming design working as intended.

Then the kernels' chunked regions (parallel_chunks, 64 units in chunks of 4), under the static and the
dynamic schedule, alternating run by run:

    chunks0    empty units: publishing the task, claiming and committing 16 chunks, the join
    chunks     each unit a 100-step chain (about the size of a decode region's chunk on a small model)

    python tools/bench/bench_runtime.py [--threads 1 2] [--repeats 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python"))

from corelm import _core  # noqa: E402

CASES = [  # name, work per slot, regions per run, idle microseconds between regions
    ("empty", 0, 20000, 0.0),
    ("tiny", 100, 20000, 0.0),
    ("small", 1000, 5000, 0.0),
    ("wake", 0, 200, 5000.0),
    ("wake+", 1000, 200, 5000.0),
]


def measure(threads: int, pin: bool, work: int, regions: int, idle_us: float, repeats: int) -> dict:
    runs = [_core.testing.bench_parallel_regions(threads, regions, work, pin, False, idle_us) for _ in range(repeats)]
    region = statistics.median(r["region_us"] for r in runs)
    slot = statistics.median(r["slot_us"] for r in runs)
    return {"threads": threads, "pin": pin, "region_us": region, "slot_us": slot,
            "overhead_us": region - slot, "worker_share": statistics.median(r["worker_share"] for r in runs),
            "pinned_workers": runs[0]["pinned_workers"]}


CHUNK_CASES = [("chunks0", 0, 20000), ("chunks", 100, 2000)]   # name, work per unit, regions per run


def measure_chunks(threads: int, work: int, regions: int, repeats: int) -> dict:
    runs = {"static": [], "dynamic": []}
    for _ in range(repeats):
        for sched in runs:
            r = _core.testing.bench_chunk_regions(threads, regions, units=64, align=1, grain=4, work=work, schedule=sched)
            assert r["exactly_once"] and r["no_late_commits"]
            runs[sched].append(r["region_us"])
    return {s: statistics.median(v) for s, v in runs.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="thread counts (default: 1 and the default thread count, at least 2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    threads = args.threads or sorted({1, max(2, len(_core.plan_threads()))})
    rows = []
    for name, work, regions, idle in CASES:
        for n in threads:
            for pin in (False, True):
                if n == 1 and pin:
                    continue   # one thread has no workers to pin
                rows.append(dict(case=name, work=work, **measure(n, pin, work, regions, idle, args.repeats)))
    chunk_rows = [dict(case=name, threads=n, **measure_chunks(n, work, regions, args.repeats))
                  for name, work, regions in CHUNK_CASES for n in threads]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if args.json:
        print(json.dumps({"cpu": _core.cpu_info()["brand"], "loadavg_1min": load, "rows": rows,
                          "chunk_rows": chunk_rows}, indent=2))
        return 0
    print(f"{_core.cpu_info()['brand']}; plan {_core.plan_threads()}; 1-min load average {load}")
    print(f"{'case':7} {'threads':>7} {'pin':>4} {'slot us':>8} {'region us':>10} {'overhead us':>12} {'worker':>7}")
    for r in rows:
        print(f"{r['case']:7} {r['threads']:7d} {'yes' if r['pin'] else 'no':>4} {r['slot_us']:8.3f} "
              f"{r['region_us']:10.3f} {r['overhead_us']:12.3f} {r['worker_share']:7.2f}")
    print(f"\n{'case':7} {'threads':>7} {'static us':>10} {'dynamic us':>11}")
    for r in chunk_rows:
        print(f"{r['case']:7} {r['threads']:7d} {r['static']:10.3f} {r['dynamic']:11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
