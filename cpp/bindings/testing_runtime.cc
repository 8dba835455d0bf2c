// corelm._core.testing: the runtime's placement and split functions the model uses internally, exposed
// so tests can check them on their own (fake nodes, mmap-backed arrays).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "runtime/numa.h"
#include "runtime/thread_pool.h"

namespace py = pybind11;

namespace corelm {

namespace {

// The base address and byte size of a writable, C-contiguous array (the tests' mmap-backed buffers).
std::pair<char*, size_t> array_bytes(py::array a) {
  if (!(a.flags() & py::array::c_style) || !a.writeable()) throw std::invalid_argument("need a writable C-contiguous array");
  return {static_cast<char*>(a.mutable_data()), (size_t)a.nbytes()};
}

}  // namespace

void register_testing_runtime(py::module_& m) {
  m.def("numa_split_per_layer", [](int64_t layers, int64_t rows, size_t bytes, const std::vector<std::pair<int, int>>& shares) {
    std::vector<NodeShare> s;
    for (const auto& p : shares) s.push_back({std::max(0, p.first), std::max(0, p.second)});
    return range_tuples(split_per_layer(layers, rows, bytes, s));
  }, py::arg("layers"), py::arg("rows"), py::arg("bytes"), py::arg("shares"),
        "Byte ranges (node, begin, end) of a buffer of layers x rows equal rows, each layer's rows split by node "
        "(the KV cache's kv heads).");
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

  m.def("pool_home_ranges", [](const std::vector<int>& thread_node, int64_t units, int64_t align, int64_t grain,
                               const std::string& schedule, std::optional<std::vector<double>> weights) {
    const Schedule sched = parse_schedule(schedule);
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
