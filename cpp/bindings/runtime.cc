// corelm._core bindings of the runtime: the CPU topology, the thread plan and the region benchmark.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/numpy.h>

#include "model/model.h"
#include "runtime/numa.h"
#include "runtime/region_bench.h"
#include "runtime/topology.h"

namespace py = pybind11;

namespace corelm {

NumaPolicy numa_policy_arg(const std::string& s);  // below: "default", "distribute" or "isolate", else throws

namespace {

// Runs f with the GIL released (the benchmarks start and time their own threads) and returns its result.
template <class F>
auto without_gil(F&& f) {
  py::gil_scoped_release release;
  return f();
}

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

PlanPolicy plan_policy(const Target& t, const std::optional<std::vector<int>>& allowed,
                       const std::optional<int>& n_threads, bool smt_siblings, bool e_cores,
                       const std::optional<std::string>& numa, const std::optional<int>& home_node) {
  if (n_threads && (*n_threads < 1 || *n_threads > 1024)) throw std::invalid_argument("n_threads must be in [1, 1024]");
  if (allowed && t.allowed.empty()) throw std::invalid_argument("allowed must name at least one CPU");
  PlanPolicy policy;
  policy.smt_siblings = smt_siblings;
  policy.e_cores = e_cores;
  policy.numa = numa ? numa_policy_arg(*numa) : NumaPolicy::Default;
  policy.home_node = home_node ? *home_node : t.topo == &system_topology() ? current_node(*t.topo) : -1;
  return policy;
}

// ---- NUMA (runtime/numa.h) --------------------------------------------------------------------

py::list shares_list(const std::vector<NodeShare>& shares) {
  py::list out;
  for (const NodeShare& s : shares) out.append(py::make_tuple(s.node, s.threads));
  return out;
}

py::list ranges_list(const std::vector<RowRange>& ranges) {
  py::list out;
  for (const RowRange& r : ranges) out.append(py::make_tuple(r.node, r.begin, r.end));
  return out;
}

// The base address and byte size of a writable, C-contiguous array (the tests' mmap-backed buffers).
std::pair<char*, size_t> array_bytes(py::array a) {
  if (!(a.flags() & py::array::c_style) || !a.writeable()) throw std::invalid_argument("need a writable C-contiguous array");
  return {static_cast<char*>(a.mutable_data()), (size_t)a.nbytes()};
}

}  // namespace

NumaPolicy numa_policy_arg(const std::string& s) {
  NumaPolicy p;
  if (!parse_numa_policy(s, &p)) throw std::invalid_argument("numa must be 'default', 'distribute' or 'isolate', got '" + s + "'");
  return p;
}

py::dict numa_dict(const Model& model, bool pages) {
  const NumaLayout& n = model.numa_layout();
  py::list placed;
  for (const PlacedBuffer& p : model.numa_placed()) {
    py::list ranges;
    for (const RowRange& r : p.byte_ranges) {
      py::dict d;
      d["node"] = r.node, d["begin"] = r.begin, d["end"] = r.end;
      if (pages) {  // where the range's pages are now: {node: pages}; -2 (-ENOENT) counts pages never touched
        std::map<int, int> count;
        for (int node : numa_page_nodes(static_cast<const char*>(p.base) + r.begin, r.end - r.begin)) count[node]++;
        d["pages"] = count;
      }
      ranges.append(d);
    }
    py::dict d;
    d["name"] = p.name, d["bytes"] = p.bytes, d["ranges"] = ranges, d["error"] = p.error;
    placed.append(d);
  }
  py::dict d;
  d["policy"] = numa_policy_name(n.policy);
  d["thread_cpus"] = n.thread_cpus;
  d["thread_node"] = n.thread_node;
  d["shares"] = shares_list(n.shares);
  d["pool_thread_node"] = model.pool().thread_nodes();  // the nodes the pool splits its regions by
  d["status"] = model.numa_status();
  d["placed"] = placed;
  return d;
}

void bind_runtime(py::module_& m) {
  m.def("topology", [](std::optional<std::string> root) {
    Target t = target(root, std::nullopt);
    return topology_dict(*t.topo, t.root, t.allowed);
  }, py::arg("root") = py::none(),
     "The CPU topology read from sysfs below root (default: this machine, with the CPUs this process "
     "may use in 'allowed_cpus').");

  m.def("plan_threads", [](std::optional<int> n_threads, std::optional<std::string> root,
                           std::optional<std::vector<int>> allowed, bool smt_siblings, bool e_cores,
                           std::optional<std::string> numa, std::optional<int> home_node) {
    Target t = target(root, allowed);
    return plan_threads(*t.topo, n_threads.value_or(0), t.allowed,
                        plan_policy(t, allowed, n_threads, smt_siblings, e_cores, numa, home_node));
  }, py::arg("n_threads") = py::none(), py::arg("root") = py::none(), py::arg("allowed") = py::none(),
     py::arg("smt_siblings") = true, py::arg("e_cores") = true, py::arg("numa") = py::none(),
     py::arg("home_node") = py::none(),
     "The logical CPU of each thread (-1: not pinned). n_threads=None: the default count, the physical "
     "cores of the first NUMA node this process may use (numa='isolate': of the home node, "
     "numa='distribute': of every node). home_node: isolate's node (default: the node this thread runs "
     "on, or for a fake tree the first node).");

  // NUMA placement decisions and the calls behind them (runtime/numa.h).
  m.def("numa_plan", [](std::optional<int> n_threads, std::optional<std::string> root,
                        std::optional<std::vector<int>> allowed, std::optional<std::string> numa,
                        std::optional<int> home_node) {
    Target t = target(root, allowed);
    std::vector<int> plan = plan_threads(*t.topo, n_threads.value_or(0), t.allowed,
                                         plan_policy(t, allowed, n_threads, true, true, numa, home_node));
    py::dict d;
    d["thread_cpus"] = plan, d["thread_node"] = thread_nodes(*t.topo, plan);
    d["shares"] = shares_list(node_shares(*t.topo, plan));
    return d;
  }, py::arg("n_threads") = py::none(), py::arg("root") = py::none(), py::arg("allowed") = py::none(),
     py::arg("numa") = py::none(), py::arg("home_node") = py::none(),
     "The thread plan under a NUMA policy with each thread's node and the (node, threads) shares.");

  m.def("numa_split", [](int64_t rows, int64_t grain, const std::vector<std::pair<int, int>>& shares) {
    if (rows < 0 || grain < 1) throw std::invalid_argument("rows must be >= 0 and grain >= 1");
    std::vector<NodeShare> s;
    for (const auto& p : shares) {
      if (p.first < 0 || p.second < 0) throw std::invalid_argument("shares are (node >= 0, threads >= 0)");
      s.push_back({p.first, p.second});
    }
    return ranges_list(split_by_node(rows, grain, s));
  }, py::arg("rows"), py::arg("grain"), py::arg("shares"),
     "[(node, begin, end)]: rows cut into one range per (node, threads) share, in groups of grain rows.");

  m.def("numa_split_per_layer", [](int64_t layers, int64_t rows, size_t bytes, const std::vector<std::pair<int, int>>& shares) {
    std::vector<NodeShare> s;
    for (const auto& p : shares) s.push_back({std::max(0, p.first), std::max(0, p.second)});
    return ranges_list(split_per_layer(layers, rows, bytes, s));
  }, py::arg("layers"), py::arg("rows"), py::arg("bytes"), py::arg("shares"),
        "Byte ranges (node, begin, end) of a buffer of layers x rows equal rows, each layer's rows split by node "
        "(the KV cache's kv heads).");
  m.def("numa_row_grain", &Model::row_grain, py::arg("matrix"), py::arg("head_dim"),
        "The rows a matrix's parallel loop (and so its NUMA split) cuts in: 'wqkv', 'wo', 'w_gate_up', "
        "'w_down' or 'lm_head'.");
  m.def("numa_row_offset", &row_offset, py::arg("row"), py::arg("rows"), py::arg("nbytes"),
        "The byte offset of a row in a packed matrix of rows rows and nbytes bytes.");
  m.def("page_bytes", &page_bytes);

  m.def("numa_place", [](py::array a, size_t begin, size_t end, int node, bool strict) {
    auto [base, bytes] = array_bytes(a);
    if (begin > end || end > bytes) throw std::invalid_argument("need 0 <= begin <= end <= the array's bytes");
    return numa_place(base + begin, end - begin, node, strict);
  }, py::arg("array"), py::arg("begin"), py::arg("end"), py::arg("node"), py::arg("strict") = true,
     "Puts the pages starting in bytes [begin, end) of an array on node (mbind); '' or the error. The "
     "array must own whole pages (an mmap-backed one does).");

  m.def("numa_page_nodes", [](py::array a, size_t begin, size_t end) {
    auto [base, bytes] = array_bytes(a);
    if (begin > end || end > bytes) throw std::invalid_argument("need 0 <= begin <= end <= the array's bytes");
    return numa_page_nodes(base + begin, end - begin);
  }, py::arg("array"), py::arg("begin"), py::arg("end"),
     "The node of each page starting in bytes [begin, end) of an array (move_pages); -2: not touched yet.");

  m.def("bench_parallel_regions", [](int n_threads, int n_regions, int work, bool pin, bool pin_caller,
                                     double idle_us) {
    if (n_threads < 1 || n_threads > 1024) throw std::invalid_argument("n_threads must be in [1, 1024]");
    RegionBenchConfig cfg;
    cfg.n_threads = n_threads, cfg.n_regions = n_regions, cfg.work = work;
    cfg.pin = pin, cfg.pin_caller = pin_caller, cfg.idle_us = idle_us;
    const RegionBenchResult r = without_gil([&] { return bench_regions(cfg); });
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
                                  double stall_us, int slow_worker, const std::vector<int>& nodes) {
    if (n_threads < 1 || n_threads > 1024) throw std::invalid_argument("n_threads must be in [1, 1024]");
    if (units < 1 || units > (1 << 24)) throw std::invalid_argument("units must be in [1, 16M]");
    ChunkBenchConfig cfg;
    if (!parse_schedule(schedule, &cfg.schedule)) throw std::invalid_argument("schedule must be 'static' or 'dynamic'");
    cfg.n_threads = n_threads, cfg.n_regions = n_regions, cfg.units = units, cfg.align = align;
    cfg.grain = grain, cfg.work = work, cfg.pin = pin, cfg.stall_every = stall_every;
    cfg.stall_us = stall_us, cfg.slow_worker = slow_worker, cfg.thread_node = nodes;
    const ChunkBenchResult r = without_gil([&] { return bench_chunk_regions(cfg); });
    py::dict d;
    d["region_us"] = r.region_us, d["exactly_once"] = r.exactly_once, d["no_late_commits"] = r.no_late_commits;
    d["redone"] = r.redone, d["stalls"] = r.stalls, d["shares"] = r.shares;
    return d;
  }, py::arg("n_threads"), py::arg("n_regions") = 1000, py::arg("units") = 256, py::arg("align") = 1,
     py::arg("grain") = 1, py::arg("work") = 0, py::arg("schedule") = "dynamic", py::arg("pin") = true,
     py::arg("stall_every") = 0, py::arg("stall_us") = 2000.0, py::arg("slow_worker") = 1,
     py::arg("nodes") = std::vector<int>{},
     "Runs chunked regions whose every unit must be committed exactly once with its own region's value; "
     "stall_every makes a worker sleep inside a chunk it holds (as if descheduled); nodes: a fake node per "
     "thread, to split by node. Returns the mean region time, the checks, chunks redone by the caller, "
     "stalls and the pool's speed shares.");

  m.def("pool_home_ranges", [](const std::vector<int>& thread_node, int64_t units, int64_t align, int64_t grain,
                               const std::string& schedule, std::optional<std::vector<double>> weights) {
    Schedule sched;
    if (!parse_schedule(schedule, &sched)) throw std::invalid_argument("schedule must be 'static' or 'dynamic'");
    if (units < 1 || align < 1 || grain < align || grain % align != 0)
      throw std::invalid_argument("need units >= 1, align >= 1 and grain a multiple of align");
    if (thread_node.empty() || (weights && weights->size() != thread_node.size()))
      throw std::invalid_argument("need a node per thread and as many weights");
    const std::vector<NodeShare> shares = pool_node_shares(thread_node);
    std::vector<ChunkGroup> groups(std::max<size_t>(1, shares.size()));
    groups.resize(chunk_groups(units, align, grain, shares, groups.data()));
    std::vector<HomeRange> homes(thread_node.size());
    home_ranges(groups.data(), (int)groups.size(), thread_node, sched, align, weights ? weights->data() : nullptr,
                homes.data());
    py::list g, h;
    for (const ChunkGroup& c : groups) g.append(py::make_tuple(c.node, c.unit_begin, c.unit_end, c.chunk_begin, c.chunk_end));
    for (const HomeRange& r : homes) h.append(py::make_tuple(r.group, r.begin, r.end));
    py::dict d;
    d["groups"] = g, d["homes"] = h;
    return d;
  }, py::arg("thread_node"), py::arg("units"), py::arg("align"), py::arg("grain"), py::arg("schedule"),
     py::arg("weights") = py::none(),
     "The pool's split by node of a chunked region, for a node per thread (-1: none): groups "
     "[(node, unit_begin, unit_end, chunk_begin, chunk_end)] and each thread's home range (group, begin, "
     "end), in units (static) or chunks (dynamic, in proportion to weights).");
}

}  // namespace corelm
