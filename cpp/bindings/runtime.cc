// corelm._core bindings of the runtime: the CPU topology, the thread plan and the NUMA plan and split.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/numpy.h>

#include "bindings/bindings.h"
#include "model/model.h"
#include "runtime/numa.h"
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

PlanPolicy plan_policy(const Target& t, const std::optional<std::vector<int>>& allowed,
                       const std::optional<int>& n_threads, bool smt_siblings, bool e_cores,
                       const std::optional<std::string>& numa, const std::optional<int>& home_node) {
  if (n_threads && (*n_threads < 1 || *n_threads > 1024)) throw std::invalid_argument("n_threads must be in [1, 1024]");
  if (allowed && t.allowed.empty()) throw std::invalid_argument("allowed must name at least one CPU");
  PlanPolicy policy;
  policy.smt_siblings = smt_siblings;
  policy.e_cores = e_cores;
  policy.numa = numa ? parse_numa_policy(*numa) : NumaPolicy::Default;
  policy.home_node = home_node ? *home_node : t.topo == &system_topology() ? current_node(*t.topo) : -1;
  return policy;
}

// ---- NUMA (runtime/numa.h) --------------------------------------------------------------------

py::list shares_list(const std::vector<NodeShare>& shares) {
  py::list out;
  for (const NodeShare& s : shares) out.append(py::make_tuple(s.node, s.threads));
  return out;
}

}  // namespace

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
    return range_tuples(split_by_node(rows, grain, s));
  }, py::arg("rows"), py::arg("grain"), py::arg("shares"),
     "[(node, begin, end)]: rows cut into one range per (node, threads) share, in groups of grain rows.");
  m.def("numa_row_grain", [](const std::string& matrix, int64_t head_dim) {
    return Model::row_grain(matrix, head_dim, kernels());
  }, py::arg("matrix"), py::arg("head_dim"),
        "The rows a matrix's parallel loop (and so its NUMA split) cuts in: 'wqkv', 'wo', 'w_gate_up', "
        "'w_down' or 'lm_head'.");


}

}  // namespace corelm
