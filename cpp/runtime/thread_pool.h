// A persistent thread pool: workers spin briefly waiting for the next parallel region (a decode step
// runs a few hundred of them, so waking threads through the kernel each time would dominate), then
// sleep on a condition variable. The calling thread takes part in every region.
//
// A region has n_threads slots; fn(slot, n_threads) runs once per slot. Threads claim slots from a
// shared counter instead of owning one each, so a thread that the OS has descheduled (another process
// on its core) does not stall the region: whoever is running takes its slot.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace corelm {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Runs fn(slot, n_threads) for every slot in [0, n_threads) and returns when all have finished.
  template <class F>
  void parallel(F&& fn) {
    run([](void* ctx, int slot, int n) { (*static_cast<F*>(ctx))(slot, n); }, &fn);
  }
  void run(void (*fn)(void*, int, int), void* ctx);

 private:
  void worker_loop();
  void claim_slots(uint64_t generation);

  static constexpr int kSlotBits = 16;
  int n_threads_;
  std::vector<std::thread> workers_;
  void (*fn_)(void*, int, int) = nullptr;
  void* ctx_ = nullptr;
  uint64_t generation_ = 0;                   // written by the calling thread only
  alignas(64) std::atomic<uint64_t> state_{0};  // (generation << kSlotBits) | next unclaimed slot
  alignas(64) std::atomic<int> done_{0};        // slots finished in the current region
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
