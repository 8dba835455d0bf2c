#include "runtime/thread_pool.h"

#include <chrono>

#include "runtime/topology.h"

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

ThreadPool::ThreadPool(int n_threads, bool pin, bool pin_caller)
    : n_threads_(n_threads < 1 ? 1 : n_threads), thread_cpus_(n_threads_, -1) {
  hot_.n_slots = n_threads_;
  std::vector<int> plan;
  if (pin || pin_caller) plan = plan_threads(system_topology(), n_threads_, process_allowed_cpus());
  if (pin_caller) caller_cpu_ = thread_cpus_[0] = plan[0];
  for (int t = 1; t < n_threads_; t++) {
    workers_.emplace_back([this] { worker_loop(); });
    if (pin && pin_thread(workers_.back().native_handle(), plan[t])) thread_cpus_[t] = plan[t];
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
    hot_.state.store((generation_ + 1) << kSlotBits);
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
}

int ThreadPool::claim_slots(uint64_t generation, bool worker) {
  for (int ran = 0;;) {
    uint64_t s = hot_.state.load(std::memory_order_acquire);
    if ((s >> kSlotBits) != generation) return ran;           // that region is over
    int slot = (int)(s & ((1u << kSlotBits) - 1));
    if (slot >= hot_.n_slots) return ran;                      // every slot is taken
    if (!hot_.state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
    hot_.fn(hot_.ctx, slot, hot_.n_slots);  // safe: the region can't end while this slot is unfinished
    ran++;
    // At once, before looking for another slot: the caller may be waiting on this very count.
    if (worker) hot_.worker_done.fetch_add(1, std::memory_order_release);
  }
}

void ThreadPool::run(void (*fn)(void*, int, int), void* ctx) {
  if (caller_cpu_ >= 0 && std::this_thread::get_id() != pinned_caller_) {  // once per calling thread
    pin_current_thread(caller_cpu_);
    pinned_caller_ = std::this_thread::get_id();
  }
  if (n_threads_ == 1) {
    fn(ctx, 0, 1);
    return;
  }
  hot_.fn = fn;
  hot_.ctx = ctx;
  const uint64_t gen = ++generation_;
  hot_.state.store(gen << kSlotBits, std::memory_order_seq_cst);  // publishes fn/ctx; Dekker pair with sleepers_
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(mu_);  // pairs with the sleeper's re-check under the mutex
    cv_.notify_all();
  }
  // When the caller's claim_slots returns, every slot is claimed; workers hold the ones it did not run.
  worker_done_target_ += n_threads_ - claim_slots(gen, /*worker=*/false);
  while (hot_.worker_done.load(std::memory_order_acquire) != worker_done_target_) cpu_relax();
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    auto spin_start = std::chrono::steady_clock::now();
    uint64_t gen;
    for (uint32_t i = 0;; i++) {
      gen = hot_.state.load(std::memory_order_acquire) >> kSlotBits;
      if (gen != seen) break;
      cpu_relax();
      if ((i & 255) == 255 && std::chrono::steady_clock::now() - spin_start > kSpinTime) {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lock, [&] { return (hot_.state.load(std::memory_order_seq_cst) >> kSlotBits) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        spin_start = std::chrono::steady_clock::now();
      }
    }
    seen = gen;
    if (stop_.load()) return;
    claim_slots(gen, /*worker=*/true);
  }
}

}  // namespace corelm
