#!/usr/bin/env python3
"""Latency of the tensor-parallel allreduce (one layer's partial sums) between 2 ranks on this machine:
corelm's RankGroup.allreduce (allgather, then every rank adds the parts in rank order) and MPI_Allreduce,
for the hidden sizes of real models, as `LLM(tensor_parallel_size=2)` joins its ranks (rank 0 and a
launched job, through an MPI port) and as an MPI launcher starts them (one job), each over shared memory
and over TCP loopback (TCP_ENV: MPICH treats every rank as on another machine and uses TCP sockets).

    python tools/bench/bench_allreduce.py [--dims 896 1536] [--rows 1 16 128] [--iters 2000]

Prints median microseconds per call. Needs the distributed extra (mpi4py, mpich)."""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


# MPICH (the mpich wheel: ch4 with UCX and OFI) on TCP sockets only: no shared-memory path between local
# ranks, and the network modules' TCP transports
TCP_ENV = {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp", "FI_PROVIDER": "tcp"}


def measure(group, comm, MPI, dims, rows, iters):
    out = []
    for d in dims:
        for r in rows:
            n = d * r
            buf = np.ones(n, np.float32)
            addr = buf.ctypes.data
            for name, call in (("corelm", lambda: group.allreduce(addr, n)),
                               ("mpi", lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM))):
                k = max(20, iters // max(1, r // 16))
                times = []
                comm.Barrier()
                for _ in range(k):
                    t = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t)
                out.append({"impl": name, "dim": d, "rows": r, "us": float(np.median(times) * 1e6)})
    return out


def rank_main(args, how):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
    from corelm.engine.distributed.parallel import RankGroup, mpi
    MPI = mpi()
    if how == "port-follower":
        comm = MPI.COMM_WORLD.Connect(args.port, root=0).Merge(high=True)
    elif how == "port-root":
        port = MPI.Open_port()
        env = dict(os.environ)
        p = subprocess.Popen(["mpiexec", "-n", "1", sys.executable, os.path.abspath(__file__), "--rank", "port-follower",
                              "--port", port] + rest(args), env=env)
        comm = MPI.COMM_SELF.Accept(port, root=0).Merge(high=False)
    else:
        comm = MPI.COMM_WORLD
    group = RankGroup(comm)
    res = measure(group, comm, MPI, args.dims, args.rows, args.iters)
    if comm.Get_rank() == 0:
        print(json.dumps(res), flush=True)
    if how == "port-root":
        p.wait()


def rest(args):
    return ["--dims", *map(str, args.dims), "--rows", *map(str, args.rows), "--iters", str(args.iters)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[896, 1536])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rank", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        return rank_main(args, args.rank)
    me = os.path.abspath(__file__)
    table = []
    for transport, env in (("shm", {}), ("tcp", TCP_ENV)):
        for join, cmd in (("port (LLM)", [sys.executable, me, "--rank", "port-root"]),
                          ("launcher", ["mpiexec", "-n", "2", sys.executable, me, "--rank", "world"])):
            r = subprocess.run(cmd + rest(args), env=dict(os.environ, **env), capture_output=True, text=True, timeout=600)
            lines = [l for l in r.stdout.splitlines() if l.startswith("[")]
            if r.returncode or not lines:
                print(f"{transport} {join}: failed: {r.stderr[-500:]}", file=sys.stderr)
                continue
            for row in json.loads(lines[-1]):
                table.append(dict(row, transport=transport, join=join))
    print(f"{'transport':9} {'join':11} {'impl':7} {'dim':>5} {'rows':>5} {'us':>9}")
    for row in table:
        print(f"{row['transport']:9} {row['join']:11} {row['impl']:7} {row['dim']:5d} {row['rows']:5d} {row['us']:9.1f}")


if __name__ == "__main__":
    main()
