// MpiAllreduce (collectives.h).
#include "runtime/collectives.h"

#include <signal.h>

#include <cerrno>
#include <chrono>
#include <thread>

#include "runtime/cpu_relax.h"

namespace corelm {

namespace {
void* const kInPlace = reinterpret_cast<void*>(-1);   // MPICH's MPI_IN_PLACE
void* const kStatusIgnore = reinterpret_cast<void*>(1);  // MPICH's MPI_STATUS_IGNORE
}  // namespace

MpiAllreduce::MpiAllreduce(const MpichCalls& calls, int rank, int size, std::vector<std::pair<int, int>> local_peers,
                           double stall_seconds)
    : mpi_(calls), rank_(rank), size_(size), local_peers_(std::move(local_peers)), stall_seconds_(stall_seconds) {
  if (!mpi_.iallreduce || !mpi_.iallgather || !mpi_.test) throw std::invalid_argument("MpiAllreduce needs MPI's calls");
}

void MpiAllreduce::wait(int request) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto last_check = start;
  for (long spins = 0;; spins++) {
    int done = 0;
    if (mpi_.test(&request, &done, kStatusIgnore) != 0) throw RankFailure("an MPI collective failed");
    if (done) return;
    if (spins < 20000) {
      cpu_relax();
      continue;
    }
    const auto now = clock::now();
    if (now - last_check > std::chrono::milliseconds(200)) {
      last_check = now;
      for (const auto& [r, pid] : local_peers_)
        if (kill(pid, 0) != 0 && errno == ESRCH)
          throw RankFailure("rank " + std::to_string(r) + " of the model's " + std::to_string(size_) + " (pid " +
                            std::to_string(pid) + ") died");
      const double waited = std::chrono::duration<double>(now - start).count();
      if (stall_seconds_ > 0 && waited > stall_seconds_)
        throw RankFailure("the model's ranks stopped answering for " + std::to_string((int)waited) + " s");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 200000 ? 20 : 500));
  }
}

void MpiAllreduce::operator()(float* data, int64_t n) {
  if (n > (int64_t)0x7fffffff) throw std::invalid_argument("allreduce of more than 2^31 floats");
  int request = 0;
  if (size_ == 2) {
    if (mpi_.iallreduce(kInPlace, data, (int)n, mpi_.float_type, mpi_.sum_op, mpi_.comm, &request) != 0)
      throw RankFailure("MPI_Iallreduce failed");
    return wait(request);
  }
  gathered_.resize((size_t)n * size_);
  if (mpi_.iallgather(data, (int)n, mpi_.float_type, gathered_.data(), (int)n, mpi_.float_type, mpi_.comm, &request) != 0)
    throw RankFailure("MPI_Iallgather failed");
  wait(request);
  for (int64_t i = 0; i < n; i++) {
    float s = gathered_[i] + gathered_[n + i];
    for (int r = 2; r < size_; r++) s += gathered_[(size_t)r * n + i];
    data[i] = s;
  }
}

}  // namespace corelm
