#include "testing/gemm_bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <thread>

#include "kernels/amx/amx.h"
#include "kernels/ggml_formats.h"
#include "testing/stream_read.h"
#include "runtime/cpu_relax.h"

namespace corelm {

// "<table>_<weight type>" (both names may hold underscores: avx512_bf16_q4_k): the available table
// whose name is the longest prefix before an underscore with a weight type after it.
static const KernelTable* table_and_type(const std::string& kind, WeightType* type) {
  for (size_t us = kind.rfind('_'); us != std::string::npos && us > 0; us = kind.rfind('_', us - 1)) {
    const KernelTable* kt = kernels_by_name(kind.substr(0, us));
    if (!kt) continue;
    *type = parse_weight_type(kind.substr(us + 1));
    return kt;
  }
  throw std::invalid_argument("unknown or unavailable kind " + kind);
}

GemmBenchResult bench_gemm(const std::string& kind, int64_t M, int64_t N, int64_t K, double seconds, int threads,
                           ActType act, double sparsity) {
  if (M < 1 || N < 1 || K < 1 || threads < 1) throw std::invalid_argument("bad shape or thread count");
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> x(M * K), w(N * K), y(M * N);
  for (auto& v : x) v = nd(rng);
  std::uniform_real_distribution<double> ud(0, 1);
  for (auto& v : w) v = ud(rng) < sparsity ? 0.f : nd(rng);
  std::vector<int8_t> xq(M * K), wq(N * K);
  for (auto& v : xq) v = (int8_t)(rng() % 255 - 127);
  for (auto& v : wq) v = (int8_t)(rng() % 255 - 127);
  std::vector<float> xs(M, 0.01f), ws(N, 0.01f);

  std::function<void(int64_t, int64_t)> run;  // columns [n0, n1)
  amx::AmxMatrix pa;
  PackedMatrix pk;
  const KernelTable* kt = nullptr;
  if (kind == "amx_bf16" || kind == "amx_int8") amx::require_available();
  if (kind == "amx_bf16" || kind == "amx_bf16_emulated") {
    pa = amx::pack_bf16(w.data(), N, K);
    bool emu = kind == "amx_bf16_emulated";
    run = [&, emu](int64_t n0, int64_t n1) {
      if (emu) amx::emulated::bf16_gemm(x.data(), M, K, pa, y.data(), N, n0, n1);
#if defined(CORELM_HAVE_AMX_BUILD)
      else amx::native::bf16_gemm(x.data(), M, K, pa, y.data(), N, n0, n1);
#endif
    };
  } else if (kind == "amx_int8") {
    pa = amx::pack_int8(wq.data(), ws.data(), N, K, 0);
    run = [&](int64_t n0, int64_t n1) {
#if defined(CORELM_HAVE_AMX_BUILD)
      amx::native::int8_gemm(xq.data(), M, K, xs.data(), pa, y.data(), N, n0, n1);
#endif
    };
  } else {
    WeightType wt;
    kt = table_and_type(kind, &wt);
    if (quant::is_ggml_block(wt)) {  // random GGUF blocks, as bench_gemv_stream's
      std::vector<uint8_t> raw((size_t)N * quant::ggml_row_bytes(wt, K));
      for (auto& b : raw) b = (uint8_t)(rng() & 0x3b);
      pk = kt->pack_raw(wt, raw.data(), N, K, nullptr);
    } else {
      pk = kt->pack(w.data(), N, K, wt, nullptr);
    }
    if (act == ActType::I8 || !kt->quant_act_bytes(pk, M, act)) {
      run = [&](int64_t n0, int64_t n1) { kt->matmul(x.data(), M, K, pk, y.data(), N, n0, n1); };
    } else {  // quantized per call, as matmul does for int8
      run = [&, act](int64_t n0, int64_t n1) {
        thread_local std::shared_ptr<void> qa;
        thread_local size_t have = 0;
        const size_t need = kt->quant_act_bytes(pk, M, act);
        if (have < need) qa = aligned_buffer(need), have = need;
        kt->quantize_act(x.data(), M, K, pk, act, qa.get());
        kt->matmul_quant(qa.get(), M, act, pk, y.data(), N, n0, n1);
      };
    }
  }
  const int64_t tiles = (N + 15) / 16;
  auto once = [&] {
    if (threads == 1) { run(0, N); return; }
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; t++) {
      const int64_t n0 = std::min(N, tiles * t / threads * 16), n1 = std::min(N, tiles * (t + 1) / threads * 16);
      pool.emplace_back([&, n0, n1] { if (n0 < n1) run(n0, n1); });
    }
    for (auto& th : pool) th.join();
  };
  once();  // warm-up: first touch, tile permission, caches
  using clk = std::chrono::steady_clock;
  int64_t iters = 0;
  const auto t0 = clk::now();
  double elapsed = 0;
  do {
    once();
    iters++;
    elapsed = std::chrono::duration<double>(clk::now() - t0).count();
  } while (elapsed < seconds);
  GemmBenchResult r;
  r.ms = 1e3 * elapsed / iters;
  r.gflops = 2.0 * M * N * K * iters / elapsed / 1e9;
  r.iters = iters;
  r.weight_bytes = kt ? pk.bytes() : 0;
  return r;
}

StreamBenchResult bench_gemv_stream(const std::string& kind, const std::vector<std::pair<int64_t, int64_t>>& shapes,
                                    int64_t layers, int reps, int threads, bool sync, ActType act,
                                    double sparsity, int64_t rows) {
  WeightType type;
  const KernelTable* kt = table_and_type(kind, &type);
  if (type == WeightType::F32) throw std::invalid_argument("the stream takes bf16 or quantized weights, not " + kind);
  if (shapes.empty() || layers < 1 || layers > 4096 || reps < 1 || threads < 1 || threads > 256 || rows < 1 || rows > 64)
    throw std::invalid_argument("need shapes, 1 <= layers <= 4096, reps >= 1, 1 <= threads <= 256, 1 <= rows <= 64");
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<PackedMatrix> mats;
  int64_t max_n = 0, max_k = 0;
  size_t bytes = 0;
  for (auto [n, k] : shapes) {
    if (n < 1 || k < 1 || n > (1 << 20) || k > (1 << 20)) throw std::invalid_argument("bad shape");
    PackedMatrix pk;
    if (quant::is_ggml_block(type)) {  // random GGUF blocks; & 0x3b keeps every fp16 scale finite
      std::vector<uint8_t> raw((size_t)n * quant::ggml_row_bytes(type, k));
      for (auto& b : raw) b = (uint8_t)(rng() & 0x3b);
      pk = kt->pack_raw(type, raw.data(), n, k, nullptr);
    } else {
      std::vector<float> w((size_t)n * k);
      std::uniform_real_distribution<double> ud(0, 1);
      for (auto& v : w) v = ud(rng) < sparsity ? 0.f : nd(rng);
      pk = kt->pack(w.data(), n, k, type, nullptr);
    }
    for (int64_t l = 0; l < layers; l++) {  // copies, so no layer finds another's lines in cache
      PackedMatrix c = pk;
      c.storage = aligned_buffer(pk.nbytes);
      std::memcpy(c.storage.get(), pk.data(), pk.nbytes);
      mats.push_back(c);
      bytes += pk.nbytes;
    }
    max_n = std::max(max_n, n), max_k = std::max(max_k, k);
  }
  std::vector<PackedMatrix> order;  // layer by layer, as decode reads them
  for (int64_t l = 0; l < layers; l++)
    for (size_t i = 0; i < shapes.size(); i++) order.push_back(mats[i * layers + l]);
  std::vector<PackedMatrix*> ptrs;
  for (PackedMatrix& w : order) ptrs.push_back(&w);
  pack_contiguously(ptrs);  // as the model keeps its weights
  mats.clear();
  std::vector<float> x(rows * max_k);
  for (auto& v : x) v = nd(rng);
  auto plain = aligned_buffer(bytes);
  std::memset(plain.get(), 1, bytes);
  // threads > 1: each thread streams its contiguous share of every matrix's rows (multiples of 32,
  // the layout's super-group) and, with sync, waits for the others after each matrix, as the
  // model's regions do; the plain read splits the buffer the same way, without waits.
  std::atomic<int64_t> arrived{0};
  auto barrier = [&](int64_t& gen) {
    gen += threads;
    arrived.fetch_add(1, std::memory_order_acq_rel);
    while (arrived.load(std::memory_order_acquire) < gen) cpu_relax();
  };
  auto team = [&](auto&& body) {
    arrived.store(0);
    std::vector<std::thread> ts;
    for (int t = 1; t < threads; t++) ts.emplace_back([&, t] { body(t); });
    body(0);
    for (auto& th : ts) th.join();
  };
  auto gemv_pass = [&] {
    team([&](int t) {
      std::vector<float> y(rows * max_n);
      size_t qbytes = 64;
      for (const PackedMatrix& w : order) qbytes = std::max(qbytes, kt->quant_act_bytes(w, rows, act));
      auto qa = aligned_buffer(qbytes);
      int64_t gen = 0;
      barrier(gen);
      for (const PackedMatrix& w : order) {
        const int64_t per = (w.rows / threads + 31) / 32 * 32;
        const int64_t n0 = std::min(w.rows, t * per), n1 = t == threads - 1 ? w.rows : std::min(w.rows, n0 + per);
        if (n0 < n1 && kt->quant_act_bytes(w, rows, act)) {
          kt->quantize_act(x.data(), rows, w.cols, w, act, qa.get());
          kt->matmul_quant(qa.get(), rows, act, w, y.data(), w.rows, n0, n1);
        } else if (n0 < n1) {
          kt->matmul(x.data(), rows, w.cols, w, y.data(), w.rows, n0, n1);
        }
        if (sync) barrier(gen);
      }
    });
  };
  volatile float sink = 0;
  auto read_pass = [&] {
    team([&](int t) {
      const size_t per = (bytes / threads + 4095) / 4096 * 4096, b0 = std::min(bytes, t * per);
      const size_t b1 = t == threads - 1 ? bytes : std::min(bytes, b0 + per);
      int64_t gen = 0;
      barrier(gen);
      sink = sink + stream_read_sum(static_cast<uint8_t*>(plain.get()) + b0, b1 - b0);
    });
  };
  using clk = std::chrono::steady_clock;
  auto gbs = [&](auto&& f) {
    const auto t0 = clk::now();
    f();
    return bytes / std::chrono::duration<double>(clk::now() - t0).count() / 1e9;
  };
  gemv_pass(), read_pass();  // first touch, warm-up
  std::vector<double> g, r;
  for (int i = 0; i < reps; i++) {
    if (i % 2) g.push_back(gbs(gemv_pass)), r.push_back(gbs(read_pass));
    else r.push_back(gbs(read_pass)), g.push_back(gbs(gemv_pass));
  }
  return StreamBenchResult{bytes, g, r};
}

}  // namespace corelm
