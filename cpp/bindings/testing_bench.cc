// corelm._core.testing benchmarks: kernel GEMMs and decode's weight stream (testing/gemm_bench.h) and
// the thread pool's parallel regions (testing/region_bench.h). Each releases the GIL: they start and
// time their own threads.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "testing/gemm_bench.h"
#include "testing/region_bench.h"

namespace py = pybind11;

namespace corelm {

namespace {

// Runs f with the GIL released (the benchmarks start and time their own threads) and returns its result.
template <class F>
auto without_gil(F&& f) {
  py::gil_scoped_release release;
  return f();
}

}  // namespace

void register_testing_bench(py::module_& m) {
  m.def("bench_gemm", [](const std::string& kind, int64_t M, int64_t N, int64_t K, double seconds, int threads,
                         const std::string& activations, double sparsity) {
    const ActType act = parse_act_type(activations);
    const GemmBenchResult r = without_gil([&] { return bench_gemm(kind, M, N, K, seconds, threads, act, sparsity); });
    py::dict d;
    d["kind"] = kind;
    d["ms"] = r.ms;
    d["gflops"] = r.gflops;
    d["iters"] = r.iters;
    d["threads"] = threads;
    d["weight_bytes"] = r.weight_bytes;  // the packed matrix one call reads (0: AMX kinds)
    return d;
  }, py::arg("kind"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("seconds") = 1.0, py::arg("threads") = 1,
     py::arg("activations") = "int8", py::arg("sparsity") = 0.0,
     "One GEMM y = x . W^T timed over repeated calls: kind amx_bf16, amx_int8, amx_bf16_emulated or "
     "'<table>_<weight type>' (fp32, bf16, q8, q4, q4m, sbf16, ...), with `sparsity` of the weights zeroed at random. Returns ms per call, GFLOP/s, iterations, threads "
     "and the packed weight bytes.");

  m.def("bench_gemv_stream", [](const std::string& kind, std::vector<std::pair<int64_t, int64_t>> shapes,
                                int64_t layers, int reps, int threads, bool sync, const std::string& activations,
                                double sparsity, int64_t rows) {
    const ActType act = parse_act_type(activations);
    const StreamBenchResult r =
        without_gil([&] { return bench_gemv_stream(kind, shapes, layers, reps, threads, sync, act, sparsity, rows); });
    auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    py::dict d;
    d["kind"] = kind;
    d["bytes"] = r.bytes;
    d["gemv_GBps"] = median(r.gemv_GBps);
    d["read_GBps"] = median(r.read_GBps);
    d["gemv_samples"] = r.gemv_GBps;
    d["read_samples"] = r.read_GBps;
    return d;
  }, py::arg("kind"), py::arg("shapes"), py::arg("layers") = 24, py::arg("reps") = 9, py::arg("threads") = 1,
     py::arg("sync") = true, py::arg("activations") = "int8", py::arg("sparsity") = 0.0, py::arg("rows") = 1,
     "Decode's weight stream without the rest of the model: `layers` copies of the matrices `shapes` "
     "[(N, K), ...] end to end, each times `rows` activation rows (1: decode), against a plain read of as "
     "many bytes, "
     "alternated `reps` times (`sparsity` of the weights zeroed at random); the median GB/s of each and the samples.");

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
    cfg.schedule = parse_schedule(schedule);
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
}

}  // namespace corelm
