#include "testing/region_bench.h"

#include <algorithm>
#include <atomic>
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

namespace {

struct alignas(64) StallFlag {
  std::atomic<int64_t> region{-1};  // the last region in which this buffer index has stalled
};

// A unit's value in a region: anything a stale or repeated commit would get wrong.
inline float unit_value(int64_t region, int64_t unit) { return (float)(region % 1000) * 4096.f + (float)unit; }

struct CheckTask {
  float* out;            // [units]
  int32_t* commits;      // [units] commits since the caller last checked
  int64_t region, stall_every;
  int work, slow_worker;
  double stall_us;
  StallFlag* stalled;    // [n_threads]
  std::atomic<int64_t>* stalls;
  void prepare(int) const {}
  void compute(int buf, int64_t u0, int64_t u1, float* s, int64_t) const {
    if (buf != 0 && stall_every > 0 && region % stall_every == 0 &&
        stalled[buf].region.exchange(region, std::memory_order_relaxed) != region) {
      stalls->fetch_add(1, std::memory_order_relaxed);
      std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(stall_us));
    }
    const int steps = buf == 0 ? work : work * slow_worker;
    for (int64_t u = u0; u < u1; u++) {
      float x = 1.f + (float)u * 1e-9f;  // per unit, so the chain is not hoisted out of the loop
      for (int i = 0; i < steps; i++) x = x * 0.999999f + 1e-6f;
      s[u - u0] = unit_value(region, u) + (x > 2.f ? 1.f : 0.f);  // x stays below 2: keeps the chain
    }
  }
  void commit(int64_t u0, int64_t u1, const float* s, int64_t) const {
    for (int64_t u = u0; u < u1; u++) out[u] = s[u - u0], commits[u]++;
  }
};

}  // namespace

ChunkBenchResult bench_chunk_regions(const ChunkBenchConfig& cfg) {
  ChunkBenchResult r;
  const int64_t units = std::max<int64_t>(1, cfg.units);
  std::vector<float> out(units, -1.f);
  std::vector<int32_t> commits(units, 0);
  std::vector<StallFlag> stalled(std::max(1, cfg.n_threads));
  std::atomic<int64_t> stalls{0};
  ThreadPool pool(cfg.n_threads, cfg.pin, false, cfg.schedule);
  pool.set_thread_nodes(cfg.thread_node);
  Chunking c{units, cfg.align, cfg.grain, 1, 1, 1.0};
  CheckTask task{out.data(), commits.data(), 0, cfg.stall_every, std::max(0, cfg.work),
                 std::max(1, cfg.slow_worker), cfg.stall_us, stalled.data(), &stalls};
  r.exactly_once = true;
  double total = 0;
  for (int64_t i = 0; i < std::max(1, cfg.n_regions); i++) {
    task.region = i + 1;
    auto t0 = Clock::now();
    pool.parallel_chunks(task, c);
    total += micros(Clock::now() - t0);
    for (int64_t u = 0; u < units; u++) {
      r.exactly_once &= commits[u] == 1 && out[u] == unit_value(task.region, u);
      commits[u] = 0;
    }
  }
  pool.quiesce();  // every late worker has finished (and dropped) its chunk
  r.no_late_commits = std::all_of(commits.begin(), commits.end(), [](int32_t n) { return n == 0; });
  r.region_us = total / std::max(1, cfg.n_regions);
  r.redone = (int64_t)pool.redone_chunks();
  r.stalls = stalls.load();
  r.shares = pool.speed_shares();
  return r;
}

}  // namespace corelm
