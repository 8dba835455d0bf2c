#include "runtime/thread_pool.h"

#include <chrono>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#else
static inline void cpu_relax() {}
#endif

namespace corelm {

// How long an idle worker polls before it sleeps: long enough to bridge the Python-side work between
// two decode steps (sampling, detokenizing), short enough not to burn a core when idle.
static constexpr auto kSpinTime = std::chrono::microseconds(2000);

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads < 1 ? 1 : n_threads) {
  for (int t = 1; t < n_threads_; t++) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
    state_.store((generation_ + 1) << kSlotBits);
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::claim_slots(uint64_t generation) {
  for (;;) {
    uint64_t s = state_.load(std::memory_order_acquire);
    if ((s >> kSlotBits) != generation) return;             // that region is over
    int slot = (int)(s & ((1u << kSlotBits) - 1));
    if (slot >= n_threads_) return;                           // every slot is taken
    if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
    fn_(ctx_, slot, n_threads_);  // safe: the region can't end while this slot is unfinished
    done_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::run(void (*fn)(void*, int, int), void* ctx) {
  if (n_threads_ == 1) {
    fn(ctx, 0, 1);
    return;
  }
  fn_ = fn;
  ctx_ = ctx;
  done_.store(0, std::memory_order_relaxed);
  const uint64_t gen = ++generation_;
  state_.store(gen << kSlotBits, std::memory_order_seq_cst);  // publishes fn_/ctx_; Dekker pair with sleepers_
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(mu_);  // pairs with the sleeper's re-check under the mutex
    cv_.notify_all();
  }
  claim_slots(gen);
  while (done_.load(std::memory_order_acquire) != n_threads_) cpu_relax();
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    auto spin_start = std::chrono::steady_clock::now();
    uint64_t gen;
    for (uint32_t i = 0;; i++) {
      gen = state_.load(std::memory_order_acquire) >> kSlotBits;
      if (gen != seen) break;
      cpu_relax();
      if ((i & 255) == 255 && std::chrono::steady_clock::now() - spin_start > kSpinTime) {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lock, [&] { return (state_.load(std::memory_order_seq_cst) >> kSlotBits) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        spin_start = std::chrono::steady_clock::now();
      }
    }
    seen = gen;
    if (stop_.load()) return;
    claim_slots(gen);
  }
}

}  // namespace corelm
