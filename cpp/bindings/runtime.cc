// corelm._core bindings of the runtime: the CPU topology, the thread plan and the region benchmark.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "runtime/region_bench.h"
#include "runtime/topology.h"

namespace py = pybind11;

namespace corelm {

namespace {

py::dict topology_dict(const Topology& t, const std::string& root, const std::vector<int>& allowed) {
  py::list cpus, cores, caches;
  for (const LogicalCpu& c : t.cpus) {
    py::dict d;
    d["id"] = c.id, d["package"] = c.package, d["node"] = c.node, d["core"] = c.core;
    d["smt_index"] = c.smt_index, d["type"] = core_type_name(c.type);
    d["l1d"] = c.l1d, d["l2"] = c.l2, d["l3"] = c.l3;
    cpus.append(d);
  }
  for (const PhysicalCore& c : t.cores) {
    py::dict d;
    d["package"] = c.package, d["node"] = c.node, d["type"] = core_type_name(c.type), d["cpus"] = c.cpus;
    cores.append(d);
  }
  for (const CacheInfo& c : t.caches) {
    py::dict d;
    d["level"] = c.level, d["type"] = c.type, d["size"] = c.size_bytes, d["cpus"] = c.cpus;
    caches.append(d);
  }
  py::dict d;
  d["root"] = root;
  d["packages"] = t.packages;
  d["nodes"] = t.nodes;
  d["hybrid"] = t.hybrid;
  d["type_source"] = t.type_source;
  d["threads_per_core"] = t.threads_per_core();
  d["cpus"] = cpus;
  d["cores"] = cores;
  d["caches"] = caches;
  d["allowed_cpus"] = allowed;
  d["notes"] = t.notes;
  return d;
}

// The real machine (cached, limited to this process's affinity mask) or a tree below root (all its
// CPUs allowed unless the caller says otherwise).
struct Target {
  Topology owned;
  const Topology* topo;
  std::string root;
  std::vector<int> allowed;
};

Target target(const std::optional<std::string>& root, const std::optional<std::vector<int>>& allowed) {
  Target t;
  if (root) {
    t.owned = read_topology(*root, /*probe_cpuid=*/false);
    t.topo = &t.owned;
    t.root = *root;
    if (!allowed)
      for (const LogicalCpu& c : t.owned.cpus) t.allowed.push_back(c.id);
  } else {
    t.topo = &system_topology();
    t.root = "/sys";
    if (!allowed) t.allowed = process_allowed_cpus();
  }
  if (allowed) t.allowed = *allowed;
  return t;
}

}  // namespace

void bind_runtime(py::module_& m) {
  m.def("topology", [](std::optional<std::string> root) {
    Target t = target(root, std::nullopt);
    return topology_dict(*t.topo, t.root, t.allowed);
  }, py::arg("root") = py::none(),
     "The CPU topology read from sysfs below root (default: this machine, with the CPUs this process "
     "may use in 'allowed_cpus').");

  m.def("plan_threads", [](std::optional<int> n_threads, std::optional<std::string> root,
                           std::optional<std::vector<int>> allowed, bool smt_siblings, bool e_cores) {
    if (n_threads && (*n_threads < 1 || *n_threads > 1024))
      throw std::invalid_argument("n_threads must be in [1, 1024]");
    Target t = target(root, allowed);
    if (allowed && t.allowed.empty()) throw std::invalid_argument("allowed must name at least one CPU");
    PlanPolicy policy;
    policy.smt_siblings = smt_siblings;
    policy.e_cores = e_cores;
    return plan_threads(*t.topo, n_threads.value_or(0), t.allowed, policy);
  }, py::arg("n_threads") = py::none(), py::arg("root") = py::none(), py::arg("allowed") = py::none(),
     py::arg("smt_siblings") = true, py::arg("e_cores") = true,
     "The logical CPU of each thread (-1: not pinned). n_threads=None: the default count, the physical "
     "cores of the first NUMA node this process may use.");

  m.def("bench_parallel_regions", [](int n_threads, int n_regions, int work, bool pin, bool pin_caller,
                                     double idle_us) {
    if (n_threads < 1 || n_threads > 1024) throw std::invalid_argument("n_threads must be in [1, 1024]");
    RegionBenchConfig cfg;
    cfg.n_threads = n_threads, cfg.n_regions = n_regions, cfg.work = work;
    cfg.pin = pin, cfg.pin_caller = pin_caller, cfg.idle_us = idle_us;
    RegionBenchResult r;
    {
      py::gil_scoped_release release;
      r = bench_regions(cfg);
    }
    py::dict d;
    d["region_us"] = r.region_us, d["slot_us"] = r.slot_us, d["worker_share"] = r.worker_share;
    d["pinned_workers"] = r.pinned_workers, d["slots_ok"] = r.slots_ok;
    return d;
  }, py::arg("n_threads"), py::arg("n_regions") = 10000, py::arg("work") = 0, py::arg("pin") = true,
     py::arg("pin_caller") = false, py::arg("idle_us") = 0.0,
     "Mean wall time of a parallel region of a fresh pool (region_us), the serial time of one slot's "
     "work (slot_us) and the share of slots run by workers.");

  m.def("bench_chunk_regions", [](int n_threads, int n_regions, int64_t units, int64_t align, int64_t grain,
                                  int work, const std::string& schedule, bool pin, int stall_every,
                                  double stall_us, int slow_worker) {
    if (n_threads < 1 || n_threads > 1024) throw std::invalid_argument("n_threads must be in [1, 1024]");
    if (units < 1 || units > (1 << 24)) throw std::invalid_argument("units must be in [1, 16M]");
    ChunkBenchConfig cfg;
    if (!parse_schedule(schedule, &cfg.schedule)) throw std::invalid_argument("schedule must be 'static' or 'dynamic'");
    cfg.n_threads = n_threads, cfg.n_regions = n_regions, cfg.units = units, cfg.align = align;
    cfg.grain = grain, cfg.work = work, cfg.pin = pin, cfg.stall_every = stall_every;
    cfg.stall_us = stall_us, cfg.slow_worker = slow_worker;
    ChunkBenchResult r;
    {
      py::gil_scoped_release release;
      r = bench_chunk_regions(cfg);
    }
    py::dict d;
    d["region_us"] = r.region_us, d["exactly_once"] = r.exactly_once, d["no_late_commits"] = r.no_late_commits;
    d["redone"] = r.redone, d["stalls"] = r.stalls, d["shares"] = r.shares;
    return d;
  }, py::arg("n_threads"), py::arg("n_regions") = 1000, py::arg("units") = 256, py::arg("align") = 1,
     py::arg("grain") = 1, py::arg("work") = 0, py::arg("schedule") = "dynamic", py::arg("pin") = true,
     py::arg("stall_every") = 0, py::arg("stall_us") = 2000.0, py::arg("slow_worker") = 1,
     "Runs chunked regions whose every unit must be committed exactly once with its own region's value; "
     "stall_every makes a worker sleep inside a chunk it holds (as if descheduled). Returns the mean "
     "region time, the checks, chunks redone by the caller, stalls and the pool's speed shares.");
}

}  // namespace corelm
