// Collectives between the processes of one model (tensor parallelism), called from the forward's own
// thread without Python: through function pointers into the MPI library the Python side loaded (mpi4py),
// so corelm builds without MPI's headers and runs without MPI where it is not used. The handles follow
// MPICH's ABI (MPICH and Intel MPI: int communicators, datatypes, operations and requests).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace corelm {

// A rank of the model died or stopped answering: no collective can complete again.
struct RankFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct MpichCalls {
  using Iallreduce = int (*)(const void* send, void* recv, int count, int type, int op, int comm, int* request);
  using Iallgather = int (*)(const void* send, int send_count, int send_type, void* recv, int recv_count,
                             int recv_type, int comm, int* request);
  using Test = int (*)(int* request, int* done, void* status);
  Iallreduce iallreduce = nullptr;
  Iallgather iallgather = nullptr;
  Test test = nullptr;
  int comm = 0, float_type = 0, sum_op = 0;
};

// Sums float32 buffers in place across the ranks with the same bits on every rank: two ranks' a + b is
// b + a, so MPI_Allreduce is exact there; from three on, every rank adds the gathered parts in rank
// order. Each wait polls: a rank on this machine whose process is gone (local_peers: their pids), or no
// progress for stall_seconds, throws RankFailure instead of hanging in the collective.
class MpiAllreduce {
 public:
  MpiAllreduce(const MpichCalls& calls, int rank, int size, std::vector<std::pair<int, int>> local_peers,
               double stall_seconds);
  void operator()(float* data, int64_t n);

 private:
  void wait(int request);
  MpichCalls mpi_;
  int rank_, size_;
  std::vector<std::pair<int, int>> local_peers_;  // (rank, pid)
  double stall_seconds_;
  std::vector<float> gathered_;
};

}  // namespace corelm
