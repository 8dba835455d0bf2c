// Python entry points of the AMX kernels (corelm._core.amx_*, kernel_amx_*): availability, the
// GEMMs on either the emulated or the real build, and single tile instructions for testing the
// emulation. Registered from module.cc by register_amx().
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#if defined(CORELM_HAVE_X86)
#include <immintrin.h>
#endif
#include <chrono>
#include <functional>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernels/amx/amx.h"
#include "kernels/kernels.h"

namespace py = pybind11;
using namespace corelm;

namespace corelm {
py::dict amx_info();
void register_amx(py::module_& m);
void register_amx_bench(py::module_& m);
}  // namespace corelm

namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;
using Int8Array = py::array_t<int8_t, py::array::c_style | py::array::forcecast>;
using U8Array = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;

void need_native(bool emulated) {
  if (emulated) return;
  if (!amx::available())
    throw std::runtime_error("AMX is not available on this machine: " + amx::status().reason);
}

}  // namespace

py::dict corelm::amx_info() {
  const amx::Status& s = amx::status();
  py::dict d;
  d["available"] = amx::available();
  d["cpu"] = s.cpu;
  d["os"] = s.os;
  d["permission"] = s.permission;
  d["compiled"] = s.compiled;
  d["reason"] = s.reason;
  // What the AMX kernels serve in the forward pass: bf16 weights through the "amx" kernel table (chosen
  // by CORELM_ISA=amx), never int8 (q8's blocks of 32 have a scale each, TDPBSSD sums 64 at a time).
  const bool in_use = std::string(kernels().name) == "amx";
  py::dict serves;
  serves["bf16_gemm"] = in_use ? "bf16 weights (kernel table amx)"
                        : amx::available() ? "bf16 weights with CORELM_ISA=amx" : "emulated only";
  serves["int8_gemm"] = amx::available() ? "kernel entry point only" : "emulated only";
  d["kernels"] = serves;
  d["in_use"] = in_use;
  return d;
}

void corelm::register_amx(py::module_& m) {
  register_amx_bench(m);
  m.def("amx_available", &amx::available,
        "True when CPUID, XCR0 and the OS permission (arch_prctl) allow the real AMX kernels.");
  m.def("amx_info", &amx_info, "AMX detection details and the reason when it is unavailable.");

  m.def("kernel_amx_bf16_gemm", [](FloatArray x, FloatArray w, bool emulated, int64_t n0, int64_t n1) {
    if (x.ndim() != 2 || w.ndim() != 2 || x.shape(1) != w.shape(1) || w.shape(0) < 1 || w.shape(1) < 1)
      throw std::invalid_argument("kernel_amx_bf16_gemm needs x [M, K] and w [N, K]");
    need_native(emulated);
    const int64_t M = x.shape(0), N = w.shape(0), K = w.shape(1);
    if (n1 < 0) n1 = N;
    amx::AmxMatrix pw = amx::pack_bf16(w.data(), N, K);
    py::array_t<float> y({M, N});
    std::fill(y.mutable_data(), y.mutable_data() + M * N, 0.0f);  // columns outside [n0, n1) stay 0
    {
      py::gil_scoped_release release;
      if (emulated) amx::emulated::bf16_gemm(x.data(), M, K, pw, y.mutable_data(), N, n0, n1);
#if defined(CORELM_HAVE_AMX_BUILD)
      else amx::native::bf16_gemm(x.data(), M, K, pw, y.mutable_data(), N, n0, n1);
#endif
    }
    return y;
  }, py::arg("x"), py::arg("w"), py::arg("emulated"), py::arg("n0") = 0, py::arg("n1") = -1,
     "y = bf16(x) . bf16(w)^T with fp32 accumulation, on the AMX-BF16 kernel (emulated or real); only columns "
     "[n0, n1) are computed (n0 a multiple of 16), the rest are 0.");

  m.def("kernel_amx_int8_gemm", [](Int8Array xq, Int8Array wq, bool emulated, py::object xs_obj,
                                   py::object ws_obj, int64_t group, int64_t n0, int64_t n1) -> py::object {
    if (xq.ndim() != 2 || wq.ndim() != 2 || xq.shape(1) != wq.shape(1) || wq.shape(0) < 1 || wq.shape(1) < 1)
      throw std::invalid_argument("kernel_amx_int8_gemm needs xq [M, K] and wq [N, K] (int8)");
    need_native(emulated);
    const int64_t M = xq.shape(0), N = wq.shape(0), K = wq.shape(1);
    if (xs_obj.is_none() != ws_obj.is_none()) throw std::invalid_argument("give both scales or neither");
    if (n1 < 0) n1 = N;
    if (xs_obj.is_none()) {  // raw int32 sums
      std::vector<float> ones(N, 1.0f);
      amx::AmxMatrix pw = amx::pack_int8(wq.data(), ones.data(), N, K, 0);
      py::array_t<int32_t> y({M, N});
      std::fill(y.mutable_data(), y.mutable_data() + M * N, 0);
      py::gil_scoped_release release;
      if (emulated) amx::emulated::int8_gemm_i32(xq.data(), M, K, pw, y.mutable_data(), N, n0, n1);
#if defined(CORELM_HAVE_AMX_BUILD)
      else amx::native::int8_gemm_i32(xq.data(), M, K, pw, y.mutable_data(), N, n0, n1);
#endif
      return std::move(y);
    }
    FloatArray xs = xs_obj.cast<FloatArray>(), ws = ws_obj.cast<FloatArray>();
    const int64_t G = group == 0 ? 1 : K / group;
    if (xs.ndim() != 2 || ws.ndim() != 2 || xs.shape(0) != M || ws.shape(0) != N || xs.shape(1) != G ||
        ws.shape(1) != G)
      throw std::invalid_argument("scales must be xs [M, K/group] and ws [N, K/group]");
    amx::AmxMatrix pw = amx::pack_int8(wq.data(), ws.data(), N, K, group);
    py::array_t<float> y({M, N});
    std::fill(y.mutable_data(), y.mutable_data() + M * N, 0.0f);
    py::gil_scoped_release release;
    if (emulated) amx::emulated::int8_gemm(xq.data(), M, K, xs.data(), pw, y.mutable_data(), N, n0, n1);
#if defined(CORELM_HAVE_AMX_BUILD)
    else amx::native::int8_gemm(xq.data(), M, K, xs.data(), pw, y.mutable_data(), N, n0, n1);
#endif
    return std::move(y);
  }, py::arg("xq"), py::arg("wq"), py::arg("emulated"), py::arg("xs") = py::none(), py::arg("ws") = py::none(),
     py::arg("group") = 0, py::arg("n0") = 0, py::arg("n1") = -1,
     "int8 x int8 GEMM on the AMX-INT8 kernel: int32 sums, or fp32 sum_g xs[m,g]*ws[n,g]*sum_{k in g} when "
     "scales are given (group = K values per scale; 0 = one scale per row).");

  m.def("amx_quantize_rows", [](FloatArray x, int64_t group) {
    if (x.ndim() != 2 || x.shape(1) < 1) throw std::invalid_argument("amx_quantize_rows needs x [M, K]");
    const int64_t M = x.shape(0), K = x.shape(1);
    const int64_t G = group == 0 ? 1 : (group > 0 && K % group == 0 ? K / group : 0);
    if (G == 0) throw std::invalid_argument("the scale group must divide K");
    py::array_t<int8_t> q({M, K});
    py::array_t<float> s({M, G});
    amx::quantize_rows_s8(x.data(), M, K, K, group, q.mutable_data(), s.mutable_data());
    return py::make_tuple(q, s);
  }, py::arg("x"), py::arg("group") = 0,
     "The AMX-INT8 activation format: (q int8 [M, K], scales [M, K/group]), x ~ q * scale per row/group.");

  m.def("amx_tile_dp", [](const std::string& op, U8Array c, U8Array a, U8Array b, bool emulated) {
    if (op != "tdpbssd" && op != "tdpbf16ps") throw std::invalid_argument("op must be 'tdpbssd' or 'tdpbf16ps'");
    if (c.ndim() != 2 || a.ndim() != 2 || b.ndim() != 2) throw std::invalid_argument("tiles are 2-D byte arrays");
    const int rc = (int)c.shape(0), cbc = (int)c.shape(1), ra = (int)a.shape(0), cba = (int)a.shape(1);
    const int rb = (int)b.shape(0), cbb = (int)b.shape(1);
    if (!emulated) {  // the hardware raises SIGILL on these; the emulation reports them as errors
      need_native(false);
      bool ok = rc >= 1 && rc <= 16 && ra >= 1 && ra <= 16 && rb >= 1 && rb <= 16 && cbc >= 4 && cbc <= 64 &&
                cba >= 4 && cba <= 64 && cbb >= 4 && cbb <= 64 && ra == rc && cba == 4 * rb && cbb == cbc &&
                cbc % 4 == 0;
      if (!ok) throw std::invalid_argument("tile shapes the instruction would reject");
    }
    py::array_t<uint8_t> out({rc, cbc});
    std::memcpy(out.mutable_data(), c.data(), (size_t)rc * cbc);
    if (emulated) amx::emulated::single_dp(op == "tdpbssd", out.mutable_data(), rc, cbc, a.data(), ra, cba, b.data(), rb, cbb);
#if defined(CORELM_HAVE_AMX_BUILD)
    else amx::native::single_dp(op == "tdpbssd", out.mutable_data(), rc, cbc, a.data(), ra, cba, b.data(), rb, cbb);
#endif
    return out;
  }, py::arg("op"), py::arg("c"), py::arg("a"), py::arg("b"), py::arg("emulated") = true,
     "One TDPBSSD/TDPBF16PS on byte tiles C [rows, colsb], A, B; returns the new C bytes.");
}

// The roofline's reference: sum `bytes` (a multiple of 64) as floats, eight independent AVX-512 adds
// per 512 bytes (as shared/bench/peers' membw), eight AVX adds per 256 bytes with AVX2, or a scalar sum.
#if defined(CORELM_HAVE_X86)
__attribute__((target("avx512f"))) static float plain_read_avx512(const void* p, size_t bytes) {
  const float* f = static_cast<const float*>(p);
  const size_t n = bytes / 4;
  __m512 s[8];
  for (auto& v : s) v = _mm512_setzero_ps();
  size_t i = 0;
  for (; i + 128 <= n; i += 128)
    for (int j = 0; j < 8; j++) s[j] = _mm512_add_ps(s[j], _mm512_load_ps(f + i + 16 * j));
  for (int j = 1; j < 8; j++) s[0] = _mm512_add_ps(s[0], s[j]);
  float t = _mm512_reduce_add_ps(s[0]);
  for (; i < n; i++) t += f[i];
  return t;
}
__attribute__((target("avx2"))) static float plain_read_avx2(const void* p, size_t bytes) {
  const float* f = static_cast<const float*>(p);
  const size_t n = bytes / 4;
  __m256 s[8];
  for (auto& v : s) v = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int j = 0; j < 8; j++) s[j] = _mm256_add_ps(s[j], _mm256_load_ps(f + i + 8 * j));
  for (int j = 1; j < 8; j++) s[0] = _mm256_add_ps(s[0], s[j]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s[0]);
  float t = 0;
  for (float v : lanes) t += v;
  for (; i < n; i++) t += f[i];
  return t;
}
#endif
static float plain_read_sum(const void* p, size_t bytes) {
#if defined(CORELM_HAVE_X86)
  if (cpu_features().os_avx512) return plain_read_avx512(p, bytes);
  if (cpu_features().os_avx && cpu_features().avx2) return plain_read_avx2(p, bytes);
#endif
  const float* f = static_cast<const float*>(p);
  float t = 0;
  for (size_t i = 0; i < bytes / 4; i++) t += f[i];
  return t;
}

// Micro-benchmark: one GEMM y[m][n] = x[m][k] . W[n][k]^T, weights packed once, timed over repeated
// calls on `threads` threads (each a contiguous range of 16-column tiles). kind: amx_bf16, amx_int8
// (real kernels), amx_bf16_emulated, or a kernel table's matmul: "<table>_<weight type>" (fp32, bf16, q8, q4, q4m).
void corelm::register_amx_bench(py::module_& m) {
  m.def("bench_gemm", [](const std::string& kind, int64_t M, int64_t N, int64_t K, double seconds, int threads,
                         const std::string& activations) {
    const ActType act = parse_act_type(activations);
    if (M < 1 || N < 1 || K < 1 || threads < 1) throw std::invalid_argument("bad shape or thread count");
    std::mt19937 rng(7);
    std::normal_distribution<float> nd;
    std::vector<float> x(M * K), w(N * K), y(M * N);
    for (auto& v : x) v = nd(rng);
    for (auto& v : w) v = nd(rng);
    std::vector<int8_t> xq(M * K), wq(N * K);
    for (auto& v : xq) v = (int8_t)(rng() % 255 - 127);
    for (auto& v : wq) v = (int8_t)(rng() % 255 - 127);
    std::vector<float> xs(M, 0.01f), ws(N, 0.01f);

    std::function<void(int64_t, int64_t)> run;  // columns [n0, n1)
    amx::AmxMatrix pa;
    PackedMatrix pk;
    const KernelTable* kt = nullptr;
    if (kind == "amx_bf16" || kind == "amx_int8") need_native(false);
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
      const size_t us = kind.rfind('_');
      if (us == std::string::npos) throw std::invalid_argument("unknown kind " + kind);
      kt = kernels_by_name(kind.substr(0, us));
      const std::string wt = kind.substr(us + 1);
      const WeightType wts[] = {WeightType::F32, WeightType::BF16, WeightType::Q8, WeightType::Q4, WeightType::Q4M};
      const WeightType* type = std::find_if(std::begin(wts), std::end(wts), [&](WeightType t) { return wt == weight_type_name(t); });
      if (!kt || type == std::end(wts)) throw std::invalid_argument("unknown or unavailable kind " + kind);
      pk = kt->pack(w.data(), N, K, *type, nullptr);
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
    py::gil_scoped_release release;
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
    py::gil_scoped_acquire acquire;
    py::dict d;
    d["kind"] = kind;
    d["ms"] = 1e3 * elapsed / iters;
    d["gflops"] = 2.0 * M * N * K * iters / elapsed / 1e9;
    d["iters"] = iters;
    d["threads"] = threads;
    d["weight_bytes"] = kt ? pk.bytes() : 0;  // the packed matrix one call reads (0: AMX kinds)
    return d;
  }, py::arg("kind"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("seconds") = 1.0, py::arg("threads") = 1,
     py::arg("activations") = "int8");

  // Decode's weight stream without the rest of the model: `layers` copies of the matrices `shapes`
  // ([(N, K), ...] in the order a layer reads them), end to end in one buffer as the model keeps them
  // (pack_contiguously), far more bytes than the caches hold, each multiplied by one quantized
  // activation row, layer after layer, on `threads` threads. The peer in the same call is a plain
  // AVX-512 read of as many bytes (what the roofline assumes). Alternates the two `reps` times;
  // returns the median GB/s of each.
  m.def("bench_gemv_stream", [](const std::string& kind, std::vector<std::pair<int64_t, int64_t>> shapes,
                                int64_t layers, int reps, int threads, bool sync, const std::string& activations) {
    const ActType act = parse_act_type(activations);
    const size_t us = kind.rfind('_');
    const KernelTable* kt = us == std::string::npos ? nullptr : kernels_by_name(kind.substr(0, us));
    const WeightType wts[] = {WeightType::BF16, WeightType::Q8, WeightType::Q4, WeightType::Q4M};
    const WeightType* type = std::find_if(std::begin(wts), std::end(wts), [&](WeightType t) {
      return us != std::string::npos && kind.substr(us + 1) == weight_type_name(t); });
    if (!kt || type == std::end(wts)) throw std::invalid_argument("unknown or unavailable kind " + kind);
    if (shapes.empty() || layers < 1 || layers > 4096 || reps < 1 || threads < 1 || threads > 256)
      throw std::invalid_argument("need shapes, 1 <= layers <= 4096, reps >= 1, 1 <= threads <= 256");
    std::mt19937 rng(7);
    std::normal_distribution<float> nd;
    std::vector<PackedMatrix> mats;
    int64_t max_n = 0, max_k = 0;
    size_t bytes = 0;
    for (auto [n, k] : shapes) {
      if (n < 1 || k < 1 || n > (1 << 20) || k > (1 << 20)) throw std::invalid_argument("bad shape");
      std::vector<float> w((size_t)n * k);
      for (auto& v : w) v = nd(rng);
      PackedMatrix pk = kt->pack(w.data(), n, k, *type, nullptr);
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
    std::vector<float> x(max_k);
    for (auto& v : x) v = nd(rng);
    auto plain = aligned_buffer(bytes);
    std::memset(plain.get(), 1, bytes);
    py::gil_scoped_release release;
    // threads > 1: each thread streams its contiguous share of every matrix's rows (multiples of 32,
    // the layout's super-group) and, with sync, waits for the others after each matrix, as the
    // model's regions do; the plain read splits the buffer the same way, without waits.
    std::atomic<int64_t> arrived{0};
    auto barrier = [&](int64_t& gen) {
      gen += threads;
      arrived.fetch_add(1, std::memory_order_acq_rel);
      while (arrived.load(std::memory_order_acquire) < gen) _mm_pause();
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
        std::vector<float> y(max_n);
        size_t qbytes = 64;
        for (const PackedMatrix& w : order) qbytes = std::max(qbytes, kt->quant_act_bytes(w, 1, act));
        auto qa = aligned_buffer(qbytes);
        int64_t gen = 0;
        barrier(gen);
        for (const PackedMatrix& w : order) {
          const int64_t per = (w.rows / threads + 31) / 32 * 32;
          const int64_t n0 = std::min(w.rows, t * per), n1 = t == threads - 1 ? w.rows : std::min(w.rows, n0 + per);
          if (n0 < n1 && kt->quant_act_bytes(w, 1, act)) {
            kt->quantize_act(x.data(), 1, w.cols, w, act, qa.get());
            kt->matmul_quant(qa.get(), 1, act, w, y.data(), w.rows, n0, n1);
          } else if (n0 < n1) {
            kt->matmul(x.data(), 1, w.cols, w, y.data(), w.rows, n0, n1);
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
        sink = sink + plain_read_sum(static_cast<uint8_t*>(plain.get()) + b0, b1 - b0);
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
    auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    py::gil_scoped_acquire acquire;
    py::dict d;
    d["kind"] = kind;
    d["bytes"] = bytes;
    d["gemv_GBps"] = median(g);
    d["read_GBps"] = median(r);
    d["gemv_samples"] = g;
    d["read_samples"] = r;
    return d;
  }, py::arg("kind"), py::arg("shapes"), py::arg("layers") = 24, py::arg("reps") = 9, py::arg("threads") = 1,
     py::arg("sync") = true, py::arg("activations") = "int8");
}
