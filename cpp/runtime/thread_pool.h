// A persistent thread pool: workers spin briefly waiting for the next parallel region (a decode step
// runs a few hundred of them, so waking threads through the kernel each time would dominate), then
// sleep on a condition variable. The calling thread is worker 0 and takes part in every region.
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

  // Runs fn(tid, n_threads) on every thread and returns when all have finished.
  template <class F>
  void parallel(F&& fn) {
    run([](void* ctx, int tid, int n) { (*static_cast<F*>(ctx))(tid, n); }, &fn);
  }
  void run(void (*fn)(void*, int, int), void* ctx);

 private:
  void worker_loop(int tid);

  int n_threads_;
  std::vector<std::thread> workers_;
  void (*fn_)(void*, int, int) = nullptr;
  void* ctx_ = nullptr;
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int> pending_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

// [begin, end) of n items for thread tid of nth, in whole multiples of grain (the last may be short).
inline void split_range(int64_t n, int tid, int nth, int64_t grain, int64_t* begin, int64_t* end) {
  int64_t blocks = (n + grain - 1) / grain;
  int64_t b0 = blocks * tid / nth, b1 = blocks * (tid + 1) / nth;
  *begin = b0 * grain < n ? b0 * grain : n;
  *end = b1 * grain < n ? b1 * grain : n;
}

}  // namespace corelm
