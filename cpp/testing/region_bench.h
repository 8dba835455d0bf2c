// What a parallel region of the ThreadPool costs: the fork (publishing the region and waking the
// workers' spin loops) plus the join (the caller waiting until every slot is done), which is the only
// barrier the model pays between its regions. Used by tools/bench/bench_runtime.py and the tests through
// corelm._core.testing.
#pragma once
#include <cstdint>
#include <vector>

#include "runtime/thread_pool.h"

namespace corelm {

struct RegionBenchConfig {
  int n_threads = 1;
  int n_regions = 10000;
  int work = 0;            // per slot: steps of a dependent multiply-add chain (a few ns each); 0: empty
  bool pin = true;         // pin the pool's workers
  bool pin_caller = false;
  double idle_us = 0;      // sleep between regions (not timed): above the spin time, every region wakes sleepers
};

struct RegionBenchResult {
  double region_us = 0;       // mean wall time of one region, as the caller sees it
  double slot_us = 0;         // one slot's work run serially: the ideal region time with enough threads
  double worker_share = 0;    // fraction of slots run by workers rather than the calling thread
  int pinned_workers = 0;
  bool slots_ok = false;      // every slot ran exactly once per region
};

RegionBenchResult bench_regions(const RegionBenchConfig& cfg);

// Chunked regions (ThreadPool::parallel_chunks) over `units` units: every unit's value depends on the
// region, so a result from another region or a second commit is caught. stall_every > 0 makes a
// worker sleep stall_us inside its first chunk of every stall_every-th region, as if the OS had
// descheduled it while it held the chunk: the dynamic schedule's caller redoes it, and the late
// worker's commit (in this region or a later one) must be dropped.
struct ChunkBenchConfig {
  int n_threads = 2;
  int n_regions = 1000;
  int64_t units = 256;
  int64_t align = 1, grain = 1;
  int work = 0;                 // per unit: steps of a dependent multiply-add chain
  Schedule schedule = Schedule::Dynamic;
  bool pin = true;
  int stall_every = 0;
  double stall_us = 2000;
  int slow_worker = 1;          // workers do this many times the caller's steps per unit (a slower core)
  std::vector<int> thread_node; // fake nodes for the split by node (ThreadPool::set_thread_nodes)
};

struct ChunkBenchResult {
  double region_us = 0;
  bool exactly_once = false;   // every unit of every region committed exactly once, with its region's value
  bool no_late_commits = false;  // nothing committed after its region ended (checked after quiesce)
  int64_t redone = 0;          // chunks the caller redid
  int64_t stalls = 0;          // chunks a worker held while sleeping
  std::vector<double> shares;  // the pool's speed shares at the end
};

ChunkBenchResult bench_chunk_regions(const ChunkBenchConfig& cfg);

}  // namespace corelm
