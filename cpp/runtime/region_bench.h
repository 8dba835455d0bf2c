// What a parallel region of the ThreadPool costs: the fork (publishing the region and waking the
// workers' spin loops) plus the join (the caller waiting until every slot is done), which is the only
// barrier the model pays between its regions. Used by tools/bench_runtime.py and the tests.
#pragma once

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

}  // namespace corelm
