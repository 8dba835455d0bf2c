"""Tensor-parallel ranks 1..N-1 that rank 0 launched (parallel.start):
`mpiexec -n N-1 python -m corelm.engine.distributed.follower PORT` joins them to rank 0 through its MPI port."""
import sys

from .parallel import RankFailure, RankGroup, mpi, run_follower


def main() -> int:
    if len(sys.argv) != 2:
        print("corelm.engine.distributed.follower is started by corelm itself (tensor_parallel_size or pipeline_parallel_size > 1)", file=sys.stderr)
        return 2
    MPI = mpi()
    group = RankGroup(MPI.COMM_WORLD.Connect(sys.argv[1], root=0).Merge(high=True))
    try:
        run_follower(group)
    except RankFailure as e:       # rank 0 is gone: nothing left to follow
        print(f"corelm: {e}; rank {group.rank} exits", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
