// A persistent thread pool: workers spin briefly waiting for the next parallel region (a decode step
// runs a few hundred of them, so waking threads through the kernel each time would dominate), then
// sleep on a condition variable. The calling thread takes part in every region.
//
// A region has n_threads slots; fn(slot, n_threads) runs once per slot. Threads claim slots from a
// shared counter instead of owning one each, so a thread that the OS has descheduled (another process
// on its core) does not stall the region: whoever is running takes its slot.
//
// Workers are pinned one per physical core by the thread plan (runtime/topology.h): thread t of the
// plan is worker t for t >= 1, and plan[0] is left free for the calling thread, which is not pinned
// unless pin_caller asks for it (pinning a Python thread would outlive the pool and be inherited by
// every process it starts). Pinning keeps a worker's slice of the weights in its own core's caches
// across regions and keeps two workers off one core's SMT siblings.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace corelm {

class ThreadPool {
 public:
  // pin: pin workers to the plan's CPUs (failures, e.g. a cpuset that forbids them, are ignored).
  // pin_caller: also pin every thread that calls run() to plan[0], permanently (opt-in).
  explicit ThreadPool(int n_threads, bool pin = true, bool pin_caller = false);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  // The CPU each thread is pinned to, -1 where it is not; [0] is the calling thread.
  const std::vector<int>& thread_cpus() const { return thread_cpus_; }

  // Runs fn(slot, n_threads) for every slot in [0, n_threads) and returns when all have finished.
  template <class F>
  void parallel(F&& fn) {
    using Fn = std::remove_reference_t<F>;
    run([](void* ctx, int slot, int n) { (*static_cast<Fn*>(ctx))(slot, n); }, (void*)&fn);
  }
  void run(void (*fn)(void*, int, int), void* ctx);

 private:
  void worker_loop();
  int claim_slots(uint64_t generation, bool worker);  // returns how many slots this thread ran

  static constexpr int kSlotBits = 16;

  // Caller-only state: workers never read these lines, so writing them costs no transfers.
  int n_threads_;
  std::vector<std::thread> workers_;
  std::vector<int> thread_cpus_;
  int caller_cpu_ = -1;                // plan[0] when pin_caller, else -1
  std::thread::id pinned_caller_;      // the last calling thread pinned to caller_cpu_
  uint64_t generation_ = 0;
  uint64_t worker_done_target_ = 0;    // hot_.worker_done once the current region is over

  // Everything a region touches, on one cache line: the caller publishes fn/ctx with state, workers
  // claim slots and count finished ones on it. One line moving between cores per region instead of
  // three (fn/ctx, state, done) took the 2-thread region from about 0.55 to 0.35 us on a Xeon.
  struct alignas(64) Hot {
    std::atomic<uint64_t> state{0};        // (generation << kSlotBits) | next unclaimed slot
    std::atomic<uint64_t> worker_done{0};  // slots finished by workers, ever: never reset, so the
                                           // caller need not write it for each region
    void (*fn)(void*, int, int) = nullptr;
    void* ctx = nullptr;
    int n_slots = 1;
  } hot_;
  static_assert(sizeof(Hot) == 64, "the region's state must fit one cache line");

  // The sleep path, off the hot line.
  alignas(64) std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

// [begin, end) of n items for slot tid of nth, in whole multiples of grain (the last may be short).
inline void split_range(int64_t n, int tid, int nth, int64_t grain, int64_t* begin, int64_t* end) {
  int64_t blocks = (n + grain - 1) / grain;
  int64_t b0 = blocks * tid / nth, b1 = blocks * (tid + 1) / nth;
  *begin = b0 * grain < n ? b0 * grain : n;
  *end = b1 * grain < n ? b1 * grain : n;
}

}  // namespace corelm
