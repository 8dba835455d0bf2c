#include "runtime/region_bench.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "runtime/thread_pool.h"
#include "runtime/topology.h"

namespace corelm {

namespace {

// One cache line per slot, so the benchmark's own bookkeeping does not bounce lines between threads.
struct alignas(64) SlotState {
  float acc = 1.0f;
  long runs = 0;         // every region must run every slot exactly once
  long worker_runs = 0;
};

// A chain of dependent steps: its time does not depend on memory, and the compiler cannot drop it
// because the result is stored.
inline void slot_work(SlotState& s, int work) {
  float x = s.acc;
  for (int i = 0; i < work; i++) x = x * 0.999999f + 1e-6f;
  s.acc = x;
}

using Clock = std::chrono::steady_clock;

double micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

}  // namespace

RegionBenchResult bench_regions(const RegionBenchConfig& cfg) {
  // pin_caller pins this thread for good; the benchmark gives it back its CPUs when done, so later
  // pools (planned within this thread's mask) are not confined to one CPU.
  struct RestoreCpus {
    std::vector<int> cpus = process_allowed_cpus();
    ~RestoreCpus() { set_current_thread_cpus(cpus); }
  } restore;
  RegionBenchResult r;
  const int n_regions = std::max(1, cfg.n_regions);
  ThreadPool pool(cfg.n_threads, cfg.pin, cfg.pin_caller);
  for (size_t t = 1; t < pool.thread_cpus().size(); t++) r.pinned_workers += pool.thread_cpus()[t] >= 0;
  std::vector<SlotState> slots(pool.size());
  const std::thread::id caller = std::this_thread::get_id();
  const int work = std::max(0, cfg.work);
  auto region = [&](int slot, int) {
    slot_work(slots[slot], work);
    slots[slot].runs++;
    if (std::this_thread::get_id() != caller) slots[slot].worker_runs++;
  };

  auto t0 = Clock::now();
  for (int i = 0; i < n_regions; i++) slot_work(slots[0], work);
  r.slot_us = micros(Clock::now() - t0) / n_regions;

  for (int i = 0; i < std::min(n_regions, 1000); i++) pool.parallel(region);  // warm up: workers spinning
  for (SlotState& s : slots) s.worker_runs = s.runs = 0;
  if (cfg.idle_us <= 0) {
    t0 = Clock::now();
    for (int i = 0; i < n_regions; i++) pool.parallel(region);
    r.region_us = micros(Clock::now() - t0) / n_regions;
  } else {
    double total = 0;
    for (int i = 0; i < n_regions; i++) {
      std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(cfg.idle_us));
      auto t = Clock::now();
      pool.parallel(region);
      total += micros(Clock::now() - t);
    }
    r.region_us = total / n_regions;
  }
  long worker_runs = 0;
  r.slots_ok = true;
  for (const SlotState& s : slots) worker_runs += s.worker_runs, r.slots_ok &= s.runs == n_regions;
  r.worker_share = (double)worker_runs / ((double)n_regions * pool.size());
  return r;
}

}  // namespace corelm
