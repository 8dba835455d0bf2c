// What the binding sources of corelm._core share: each registers its part of the module.
//   module.cc           the module: cpu_info, option_names, Model, quantize_q4_1_search,
//                       quantize_ggml_search
//   runtime.cc          topology, thread plan, NUMA plan and split
//   amx.cc              amx_available, amx_info
//   testing_*.cc        corelm._core.testing: single kernels, AMX tile hooks, benchmarks and runtime
//                       hooks, for tests and tools (never used by the package itself)
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "runtime/numa.h"

namespace corelm {

class Model;

void bind_runtime(pybind11::module_& m);                // runtime.cc
pybind11::dict numa_dict(const Model& model, bool pages);  // runtime.cc: Model.numa_info
void register_amx(pybind11::module_& m);                // amx.cc
pybind11::dict amx_info();                              // amx.cc

// corelm._core.testing
void register_testing_kernels(pybind11::module_& t);    // testing_kernels.cc
void register_testing_bench(pybind11::module_& t);      // testing_bench.cc
void register_testing_runtime(pybind11::module_& t);    // testing_runtime.cc

// [(node, begin, end)], as Python sees a split by node.
inline std::vector<std::tuple<int, int64_t, int64_t>> range_tuples(const std::vector<RowRange>& ranges) {
  std::vector<std::tuple<int, int64_t, int64_t>> out;
  for (const RowRange& r : ranges) out.emplace_back(r.node, r.begin, r.end);
  return out;
}

}  // namespace corelm
