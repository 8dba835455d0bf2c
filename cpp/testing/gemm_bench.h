// Kernel micro-benchmarks behind corelm._core.testing.bench_gemm / bench_gemv_stream (tools/bench/bench_amx.py,
// tools/bench/bench_quant.py, tools/hw_check.sh): a kernel table's (or AMX's) GEMM in isolation, and decode's
// weight stream without the rest of the model against a plain read of as many bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/kernels.h"

namespace corelm {

struct GemmBenchResult {
  double ms = 0;             // per call
  double gflops = 0;
  int64_t iters = 0;
  size_t weight_bytes = 0;   // the packed matrix one call reads (0: AMX kinds)
};

// One GEMM y[m][n] = x[m][k] . W[n][k]^T, weights packed once, timed over repeated calls for at least
// `seconds` on `threads` threads (each a contiguous range of 16-column tiles). kind: amx_bf16,
// amx_int8 (real kernels), amx_bf16_emulated, or a kernel table's matmul "<table>_<weight type>".
// sparsity: the fraction of weights zeroed at random before packing (what sparse weight types drop).
GemmBenchResult bench_gemm(const std::string& kind, int64_t M, int64_t N, int64_t K, double seconds, int threads,
                           ActType act, double sparsity = 0);

struct StreamBenchResult {
  size_t bytes = 0;                  // weight bytes one pass streams
  std::vector<double> gemv_GBps;     // per rep: the kernels' stream
  std::vector<double> read_GBps;     // per rep: the plain read (testing/stream_read.h)
};

// `layers` copies of the matrices `shapes` ([(N, K), ...] in the order a layer reads them), end to end
// in one buffer as the model keeps them (pack_contiguously), each multiplied by one quantized activation
// row, layer after layer, on `threads` threads (with sync, waiting for each other after every matrix,
// as the model's regions do). kind: "<table>_<weight type>", weight type bf16, a quantized type or a GGUF-block type (q4_k, ...: random blocks). The two
// passes alternate `reps` times.
StreamBenchResult bench_gemv_stream(const std::string& kind, const std::vector<std::pair<int64_t, int64_t>>& shapes,
                                    int64_t layers, int reps, int threads, bool sync, ActType act,
                                    double sparsity = 0, int64_t rows = 1);

}  // namespace corelm
