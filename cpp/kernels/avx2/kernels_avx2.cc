// AVX2 kernels (AVX2 + FMA + F16C: x86-64-v3, every x86 CPU of the last decade without AVX-512).
// This file alone is compiled with those flags; dispatch.cc hands out this table only where CPUID
// and XCR0 say the CPU and OS support them.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>

#include "kernels/avx2/avx2_util.h"
#include "kernels/kernel_util.h"
#include "kernels/kernels.h"
#include "kernels/sparse_quant.h"
#include "kernels/ggml_grouped.h"
#include "kernels/quant_layout.h"
#include "kernels/sparse_layout.h"

namespace corelm {
namespace {

// ---------------------------------------------------------------------------------------------
// Weight layout (F32, BF16): panels of 16 rows, each stored k-major, [ceil(rows/16)][K][16]; rows past
// the matrix are zero, K is not padded. Row k of a panel is what an outer-product tile multiplies by
// one activation: two 8-wide vectors, no transposition and no horizontal sums on any path, and a
// panel is one contiguous run of memory (decode reads four of them side by side, see gemv). Loops run
// over exactly K, so x past K is never read.
// BF16: the 16 values of a panel row are 8 32-bit lanes, lane i holding column i in its low half and
// column i + 8 in its high half: a shift and a mask widen them to columns 0..7 and 8..15, no shuffles.
constexpr int64_t kPanel = 16;
constexpr int64_t kSmallBatch = 32;  // up to this many rows, bf16 is widened in registers, not in a panel copy
constexpr int kMaxRows = 6;          // rows of x per tile: 6 x 16 columns = 12 accumulators of 16 registers
// Decode's software prefetch, bytes ahead of each panel stream; 0: none. Measured on one Zen 3 core
// from DRAM with four streams: none is best (fp32 ~27 GB/s; 512..2048 bytes ahead: ~19..24).
constexpr int kPrefetchBytes = 0;

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// 64-byte aligned scratch that grows and is kept per thread (bf16 prefill panels).
struct Scratch {
  float* p = nullptr;
  size_t n = 0;
  ~Scratch() { std::free(p); }
  float* get(size_t elems) {
    if (elems > n) {
      std::free(p);
      p = nullptr;
      if (posix_memalign(reinterpret_cast<void**>(&p), 64, elems * sizeof(float)) != 0) throw std::bad_alloc();
      n = elems;
    }
    return p;
  }
};

// The fp32/bf16 panel layout from value(r, c) (a float, or bf16 bits for bf16 rows), panels split over
// par's threads.
template <class Value>
PackedMatrix pack_dense(int64_t rows, int64_t cols, WeightType type, const ParallelFor* par, Value value) {
  PackedMatrix m;
  m.type = type;
  m.rows = rows;
  m.cols = cols;
  m.ld = cols;  // a panel row is 16 elements, a panel K * 16
  const bool bf16 = type == WeightType::BF16;
  m.nbytes = (size_t)round_up(rows, kPanel) * cols * (bf16 ? 2 : 4);
  m.packed_by = &kAvx2Kernels;
  m.storage = aligned_buffer(m.nbytes);  // zeroed
  auto fill = [&](int64_t p0, int64_t p1) {
    for (int64_t r0 = p0 * kPanel; r0 < std::min(rows, p1 * kPanel); r0 += kPanel) {
      const int64_t nr = std::min(kPanel, rows - r0);
      const size_t panel = (size_t)r0 * cols;  // the panel's first element
      // 16 row streams at once, each read in order; the panel is written in order
      for (int64_t k = 0; k < cols; k++)
        for (int64_t c = 0; c < nr; c++) {
          const auto v = value(r0 + c, k);
          if constexpr (std::is_same_v<decltype(v), const uint16_t>)
            static_cast<uint16_t*>(m.storage.get())[panel + k * kPanel + (c % 8) * 2 + c / 8] = v;
          else if (bf16)
            static_cast<uint16_t*>(m.storage.get())[panel + k * kPanel + (c % 8) * 2 + c / 8] = f32_to_bf16(v);
          else
            static_cast<float*>(m.storage.get())[panel + k * kPanel + c] = v;
        }
    }
  };
  const int64_t panels = (rows + kPanel - 1) / kPanel;
  if (par && *par) (*par)(panels, fill);
  else fill(0, panels);
  return m;
}

PackedMatrix pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par) {
  if (sparse::is_sparse(type)) return sparse::pack(src, rows, cols, type, par, &kAvx2Kernels);
  if (quant::is_raw_type(type)) return quant::avx2_pack(src, rows, cols, type, par);
  return pack_dense(rows, cols, type, par, [&](int64_t r, int64_t c) { return src[(size_t)r * cols + c]; });
}

PackedMatrix pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par) {
  if (type != WeightType::BF16) return quant::avx2_pack_raw(type, raw, rows, cols, par);
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(raw);
  return pack_dense(rows, cols, type, par, [&](int64_t r, int64_t c) { return bits[(size_t)r * cols + c]; });
}

// A panel row (16 weights) as fp32 columns 0..7 and 8..15.
template <bool BF16>
inline void load_row16(const void* p, __m256& lo, __m256& hi) {
  if constexpr (BF16) {
    const __m256i v = _mm256_loadu_si256(static_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
  } else {
    lo = _mm256_loadu_ps(static_cast<const float*>(p));
    hi = _mm256_loadu_ps(static_cast<const float*>(p) + 8);
  }
}

// How a tile stores each of its (up to kMaxVectors) 8-column vectors: the caller's rows [n0, n1) only,
// since the other rows of a panel belong to another thread (and y may not even exist there).
struct StorePlan {
  static constexpr int kMaxVectors = 8;
  enum Kind : int { kNone, kAll, kMasked };
  Kind kind[kMaxVectors];
  __m256i mask[kMaxVectors];
  // For the 8 * nv columns from c0 on.
  StorePlan(int64_t c0, int nv, int64_t n0, int64_t n1) {
    for (int v = 0; v < kMaxVectors; v++) {
      const int64_t a = c0 + 8 * v, lo = std::max<int64_t>(n0 - a, 0), hi = std::min<int64_t>(n1 - a, 8);
      kind[v] = v >= nv || hi <= lo ? kNone : lo == 0 && hi == 8 ? kAll : kMasked;
      mask[v] = kind[v] == kMasked ? lane_mask(lo, hi) : _mm256_setzero_si256();
    }
  }
  inline void store(int v, float* p, __m256 a) const {
    if (kind[v] == kAll)
      _mm256_storeu_ps(p, a);
    else if (kind[v] == kMasked)
      _mm256_maskstore_ps(p, mask[v], a);
  }
};

// Decode, y = W x for NP panels from p0: each panel row times one broadcast of x[k], one FMA chain
// per 8 columns in k order. The same order as every tile, so a row's bits depend neither on how the
// caller splits the rows across threads (which decides NP) nor on the batch size. Four panels are 8
// chains; fewer are latency-bound, but still well above memory's rate.
template <bool BF16, int NP>
inline void gemv_panels(const float* x, const char* wp, int64_t K, float* y, int64_t p0, int64_t n0, int64_t n1) {
  constexpr int64_t row_bytes = kPanel * (BF16 ? 2 : 4);
  const int64_t pstride = K * row_bytes;
  __m256 acc[2 * NP];
#pragma GCC unroll 8
  for (int v = 0; v < 2 * NP; v++) acc[v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k++, wp += row_bytes) {
    const __m256 xk = _mm256_broadcast_ss(x + k);
#pragma GCC unroll 4
    for (int q = 0; q < NP; q++) {
      if constexpr (kPrefetchBytes > 0) _mm_prefetch(wp + q * pstride + kPrefetchBytes, _MM_HINT_T0);
      __m256 lo, hi;
      load_row16<BF16>(wp + q * pstride, lo, hi);
      acc[2 * q] = _mm256_fmadd_ps(xk, lo, acc[2 * q]);
      acc[2 * q + 1] = _mm256_fmadd_ps(xk, hi, acc[2 * q + 1]);
    }
  }
  const StorePlan plan(p0, 2 * NP, n0, n1);
#pragma GCC unroll 8
  for (int v = 0; v < 2 * NP; v++) plan.store(v, y + p0 + 8 * v, acc[v]);
}

// Decode over the panels of [n0, n1), four at a time: more sequential streams keep more of memory's
// requests in flight (one Zen 3 core, fp32 from DRAM: ~20 GB/s one panel at a time, ~24 two, ~27 four;
// a plain one-stream read gets ~18).
template <bool BF16>
void gemv(const float* x, const PackedMatrix& w, float* y, int64_t n0, int64_t n1) {
  constexpr int64_t esz = BF16 ? 2 : 4;
  const char* base = static_cast<const char*>(w.data());
  int64_t p0 = n0 / kPanel * kPanel;
  for (; p0 + 3 * kPanel < n1; p0 += 4 * kPanel)
    gemv_panels<BF16, 4>(x, base + (size_t)p0 * w.cols * esz, w.cols, y, p0, n0, n1);
  if (p0 + kPanel < n1) {
    gemv_panels<BF16, 2>(x, base + (size_t)p0 * w.cols * esz, w.cols, y, p0, n0, n1);
    p0 += 2 * kPanel;
  }
  if (p0 < n1) gemv_panels<BF16, 1>(x, base + (size_t)p0 * w.cols * esz, w.cols, y, p0, n0, n1);
}

// The outer-product tile: MR rows of x times NP panels (16 NP columns) over all of K. Per k, NP panel
// rows are loaded (and widened) once and each of the MR broadcasts of x feeds 2 NP FMAs.
// w: the first panel, pstride: elements from one panel to the next; y: row 0, column c0 of the tile.
// pf: NP panels (pstride apart) to prefetch alongside, row k with row k: the ones that come next from
// memory, or w itself (a prefetch that hits, where a branch in the loop would cost more).
template <int MR, int NP, bool BF16>
void tile(const float* x, int64_t ldx, const void* w, int64_t pstride, int64_t K, const void* pf, float* y,
          int64_t ldy, const StorePlan& plan) {
  using E = std::conditional_t<BF16, uint16_t, float>;
  const E* wp = static_cast<const E*>(w);
  const E* pp = static_cast<const E*>(pf);
  // every loop over registers unrolled before GCC's scalar replacement, or acc[][] stays in memory
  __m256 acc[MR][2 * NP];
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
    for (int v = 0; v < 2 * NP; v++) acc[i][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k++, wp += kPanel, pp += kPanel) {
    __m256 wv[2 * NP];
#pragma GCC unroll 2
    for (int q = 0; q < NP; q++) {
      _mm_prefetch(reinterpret_cast<const char*>(pp + q * pstride), _MM_HINT_T0);
      load_row16<BF16>(wp + q * pstride, wv[2 * q], wv[2 * q + 1]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
      const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
#pragma GCC unroll 4
      for (int v = 0; v < 2 * NP; v++) acc[i][v] = _mm256_fmadd_ps(xv, wv[v], acc[i][v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
    for (int v = 0; v < 2 * NP; v++) plan.store(v, y + i * ldy + 8 * v, acc[i][v]);
}

// Most rows of x per tile of NP panels: 2 * NP * MR accumulators of 16 registers (two bf16 panels
// with three rows spill: their widened rows take 4 more; fp32 three rows fit).
template <int NP, bool BF16>
constexpr int max_rows() {
  return NP == 1 ? kMaxRows : BF16 ? 2 : 3;
}

// tile<mr, NP, BF16> for a row count known only at run time.
template <int NP, bool BF16, int MR = 1>
inline void tile_rows(int64_t mr, const float* x, int64_t ldx, const void* w, int64_t pstride, int64_t K,
                      const void* pf, float* y, int64_t ldy, const StorePlan& plan) {
  if constexpr (MR < max_rows<NP, BF16>()) {
    if (mr != MR) return tile_rows<NP, BF16, MR + 1>(mr, x, ldx, w, pstride, K, pf, y, ldy, plan);
  }
  tile<MR, NP, BF16>(x, ldx, w, pstride, K, pf, y, ldy, plan);
}

// f(i, rows) over strips of at most max_mr rows covering [0, m), as even as possible (m = 7 is 4 + 3,
// not 6 + 1: a one-row strip has too few accumulators to hide the FMA latency).
template <class F>
inline void for_row_strips(int64_t m, int64_t max_mr, F&& f) {
  const int64_t strips = (m + max_mr - 1) / max_mr, base = m / strips, extra = m % strips;
  for (int64_t s = 0, i = 0; s < strips; s++) {
    const int64_t rows = base + (s < extra);
    f(i, rows);
    i += rows;
  }
}

// Batches of up to this many rows take two panels per tile: two streams from memory, and 8
// accumulators for two rows. Larger batches go one panel at a time, the first strip prefetching the
// next panel; two-panel tiles measured no better there (one Zen 3 core, m = 3..6 from DRAM: fp32
// 18..21 GB/s either way, bf16 slower with two panels).
constexpr int64_t kTwoPanelRows = 2;

// 2 <= m <= kSmallBatch, and fp32 weights at any m: the panels of [n0, n1) straight from the packing,
// each swept by all strips of x rows while it is in L1/L2, so weights come from memory once per call.
template <bool BF16>
void gemm_direct(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                 int64_t n1) {
  using E = std::conditional_t<BF16, uint16_t, float>;
  const int64_t K = w.cols, pstride = K * kPanel;
  const E* base = static_cast<const E*>(w.data());
  // the first strip over a panel prefetches the panel(s) after it, if this call computes them
  auto prefetch = [&](int64_t i, int64_t p, int64_t next) -> const void* {
    return base + (size_t)(i == 0 && next < n1 ? next : p) * K;
  };
  int64_t p0 = n0 / kPanel * kPanel;
  if (m <= kTwoPanelRows)
    for (; p0 + kPanel < n1; p0 += 2 * kPanel) {
      const StorePlan plan(p0, 4, n0, n1);
      for_row_strips(m, max_rows<2, BF16>(), [&](int64_t i, int64_t rows) {
        tile_rows<2, BF16>(rows, x + i * ldx, ldx, base + (size_t)p0 * K, pstride, K,
                           prefetch(i, p0, p0 + 3 * kPanel < n1 ? p0 + 2 * kPanel : n1), y + i * ldy + p0, ldy, plan);
      });
    }
  for (; p0 < n1; p0 += kPanel) {
    const StorePlan plan(p0, 2, n0, n1);
    for_row_strips(m, max_rows<1, BF16>(), [&](int64_t i, int64_t rows) {
      tile_rows<1, BF16>(rows, x + i * ldx, ldx, base + (size_t)p0 * K, pstride, K, prefetch(i, p0, p0 + kPanel),
                         y + i * ldy + p0, ldy, plan);
    });
  }
}

// bf16 prefill: each panel is widened to fp32 once (a plain copy: the layout is already k-major) and
// swept as an fp32 panel by all strips of x.
void gemm_widened(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                  int64_t n1) {
  thread_local Scratch scratch;
  const int64_t K = w.cols;
  float* panel = scratch.get((size_t)K * kPanel);
  const uint16_t* base = static_cast<const uint16_t*>(w.data());
  for (int64_t p0 = n0 / kPanel * kPanel; p0 < n1; p0 += kPanel) {
    const uint16_t* src = base + (size_t)p0 * K;
    for (int64_t k = 0; k < K; k++) {
      __m256 lo, hi;
      load_row16<true>(src + k * kPanel, lo, hi);
      _mm256_store_ps(panel + k * kPanel, lo);
      _mm256_store_ps(panel + k * kPanel + 8, hi);
    }
    const StorePlan plan(p0, 2, n0, n1);
    for_row_strips(m, max_rows<1, false>(), [&](int64_t i, int64_t rows) {
      tile_rows<1, false>(rows, x + i * ldx, ldx, panel, 0, K, panel, y + i * ldy + p0, ldy, plan);
    });
  }
}

void matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
            int64_t n1) {
  n1 = std::min(n1, w.rows);
  if (n0 >= n1) return;
  if (sparse::is_sparse(w.type)) return sparse::matmul_avx2(x, m, ldx, w, y, ldy, n0, n1, matmul);
  if (quant::is_raw_type(w.type)) return quant::avx2_matmul(x, m, ldx, w, y, ldy, n0, n1);
  const bool bf16 = w.type == WeightType::BF16;
  if (m == 1)
    bf16 ? gemv<true>(x, w, y, n0, n1) : gemv<false>(x, w, y, n0, n1);
  else if (!bf16)
    gemm_direct<false>(x, m, ldx, w, y, ldy, n0, n1);
  else if (m <= kSmallBatch)
    gemm_direct<true>(x, m, ldx, w, y, ldy, n0, n1);
  else
    gemm_widened(x, m, ldx, w, y, ldy, n0, n1);
}

void row_to_f32(const PackedMatrix& w, int64_t row, float* out) {
  if (sparse::is_sparse(w.type)) return sparse::row_to_f32(w, row, out);
  if (sparse::is_sparse_quant(w.type)) return sparse::quant_row_to_f32(w, row, out);
  if (quant::is_grouped_ggml(w.type)) return quant::grouped_ggml_row_to_f32(w, row, out);
  if (quant::is_ggml_block(w.type)) return quant::ggml_row_to_f32(w, row, out);
  if (quant::is_quant(w.type)) return quant::grouped_row_to_f32(w, row, out);
  const int64_t K = w.cols, c = row % kPanel;
  const size_t panel = (size_t)(row - c) * K;
  int64_t k = 0;
  if (w.type == WeightType::BF16) {
    // the 32-bit lane that holds column c, from every panel row: low half for c < 8, high half else
    const int* p = reinterpret_cast<const int*>(static_cast<const uint16_t*>(w.data()) + panel) + c % 8;
    const __m256i idx = _mm256_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56);
    for (; k + 8 <= K; k += 8) {
      const __m256i v = _mm256_i32gather_epi32(p + k * 8, idx, 4);
      _mm256_storeu_ps(out + k, _mm256_castsi256_ps(c < 8 ? _mm256_slli_epi32(v, 16)
                                                          : _mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))));
    }
    for (; k < K; k++) out[k] = bf16_to_f32(static_cast<const uint16_t*>(w.data())[panel + k * kPanel + (c % 8) * 2 + c / 8]);
  } else {
    const float* p = static_cast<const float*>(w.data()) + panel + c;
    const __m256i idx = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(out + k, _mm256_i32gather_ps(p + k * kPanel, idx, 4));
    for (; k < K; k++) out[k] = p[k * kPanel];
  }
}

// ---------------------------------------------------------------------------------------------
// Vector kernels. Tails go through masked loads and stores: nothing past n is read or written.

void rmsnorm(float* out, const float* x, const float* weight, int64_t n, float eps) {
  __m256 ss0 = _mm256_setzero_ps(), ss1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    ss0 = _mm256_fmadd_ps(a, a, ss0);
    ss1 = _mm256_fmadd_ps(b, b, ss1);
  }
  for (; i < n; i += 8) {
    const __m256 a = _mm256_maskload_ps(x + i, tail_mask(std::min<int64_t>(n - i, 8)));
    ss0 = _mm256_fmadd_ps(a, a, ss0);
  }
  const __m256 sv = _mm256_set1_ps(1.f / std::sqrt(hsum(_mm256_add_ps(ss0, ss1)) / (float)n + eps));
  for (i = 0; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), sv)));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(out + i, m, _mm256_mul_ps(_mm256_maskload_ps(weight + i, m), _mm256_mul_ps(_mm256_maskload_ps(x + i, m), sv)));
  }
}

// exp(x): range reduction x = k ln2 + r, |r| <= ln2/2 (a little more at the top clamp), then the
// degree-6 Cephes polynomial of the AVX-512 exp512; about 1 ulp. 2^k is built in the exponent bits,
// k clamped to the normal range [-126, 127] (x is clamped to about the same range first).
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447505531f));
  __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  k = _mm256_max_ps(_mm256_min_ps(k, _mm256_set1_ps(127.f)), _mm256_set1_ps(-126.f));
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

void silu_mul(float* out, const float* gate, const float* up, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, silu_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(out + i, m, silu_mul8(_mm256_maskload_ps(gate + i, m), _mm256_maskload_ps(up + i, m)));
  }
}

// x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): gelu_tanh(g) * u
inline __m256 gelu_tanh_mul8(__m256 g, __m256 u) {
  const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g);
  const __m256 e = exp256(_mm256_mul_ps(_mm256_set1_ps(-2.f * 0.7978845608028654f), inner));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

void gelu_tanh_mul(float* out, const float* gate, const float* up, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, gelu_tanh_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(out + i, m, gelu_tanh_mul8(_mm256_maskload_ps(gate + i, m), _mm256_maskload_ps(up + i, m)));
  }
}

void layernorm(float* out, const float* x, const float* weight, const float* bias, int64_t n, float eps) {
  layernorm_loops(out, x, weight, bias, n, eps);
}

// gelu(x) = x/2 (1 + erf(x / sqrt 2)), erf by Abramowitz-Stegun 7.1.26 on |x| with the sign put back.
inline __m256 gelu8(__m256 v) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  const __m256 z = _mm256_mul_ps(v, _mm256_set1_ps(0.70710678118654752f));
  const __m256 a = _mm256_andnot_ps(sign, z);
  const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), a, one));
  __m256 p = _mm256_set1_ps(1.061405429f);
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
  p = _mm256_mul_ps(p, t);
  const __m256 e = exp256(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), a), a));
  const __m256 erf = _mm256_or_ps(_mm256_fnmadd_ps(p, e, one), _mm256_and_ps(sign, z));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), v), _mm256_add_ps(one, erf));
}

void gelu(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, gelu8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(x + i, m, gelu8(_mm256_maskload_ps(x + i, m)));
  }
}

void softmax(float* x, int64_t n) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 mx = ninf;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(x + i));
  const __m256i tm = tail_mask(n - i);  // the last n % 8 elements
  if (i < n) mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_maskload_ps(x + i, tm), _mm256_castsi256_ps(tm)));
  const __m256 mv = _mm256_set1_ps(hmax(mx));
  __m256 sum = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(x + i, e);
  }
  if (i < n) {
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_maskload_ps(x + i, tm), mv)), _mm256_castsi256_ps(tm));
    sum = _mm256_add_ps(sum, e);
    _mm256_maskstore_ps(x + i, tm, e);
  }
  const __m256 inv = _mm256_set1_ps(1.f / hsum(sum));
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
  if (i < n) _mm256_maskstore_ps(x + i, tm, _mm256_mul_ps(_mm256_maskload_ps(x + i, tm), inv));
}

// ---------------------------------------------------------------------------------------------
// Attention over cached keys and values: 8 tokens (keys) or 8 channels (values) per vector.

// 8 cached fp32, bf16 or int8 values as fp32.
inline __m256 load_kv8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_kv8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline __m256 load_kv8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline float kv_value(float v) { return v; }
inline float kv_value(uint16_t v) { return bf16_to_f32(v); }
inline float kv_value(int8_t v) { return (float)v; }

// Vectors per head in a tile of NG heads: up to 8 accumulators, so that few heads still have enough
// independent FMA chains (1 or 2 heads: 4 vectors of 8 tokens or channels).
template <int NG>
constexpr int vectors_per_head() {
  return NG <= 2 ? 4 : NG <= 4 ? 2 : 1;
}

// The last n % 8 tokens (keys) or hd % 8 channels (values) go through a zero-padded fp32 copy 8 wide,
// so the tiles load whole vectors and store only the tail (AVX2 has no masked 8/16-bit loads).
thread_local Scratch kv_tail;

// NG heads x NV vectors of 8 tokens from token j: a key channel vector is loaded once and used by
// every head. A tail (NV = 1) stores only its first cnt < 8 tokens.
template <int NG, int NV, bool Tail, class T>
inline void kv_scores_block(const float* q, int64_t hd, const T* k, int64_t ldk, int64_t j, int64_t cnt, float* s,
                            int64_t lds) {
  static_assert(!Tail || NV == 1, "a tail is one vector");
  __m256 acc[NG][NV];
#pragma GCC unroll 8
  for (int g = 0; g < NG; g++)
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) acc[g][v] = _mm256_setzero_ps();
  for (int64_t d = 0; d < hd; d++) {
    __m256 kd[NV];
    for (int v = 0; v < NV; v++) kd[v] = load_kv8(k + d * ldk + j + 8 * v);
    for (int g = 0; g < NG; g++) {
      const __m256 qv = _mm256_broadcast_ss(q + g * hd + d);
      for (int v = 0; v < NV; v++) acc[g][v] = _mm256_fmadd_ps(qv, kd[v], acc[g][v]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < NG; g++)
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
      if (Tail)
        _mm256_maskstore_ps(s + g * lds + j, tail_mask(cnt), acc[g][v]);
      else
        _mm256_storeu_ps(s + g * lds + j + 8 * v, acc[g][v]);
    }
}

// NG heads x NV vectors of 8 channels from channel d, over all n tokens (rows ldv apart): a value
// vector is loaded once and used by every head. A tail (NV = 1) updates only its first cnt < 8 channels.
template <int NG, int NV, bool Tail, class T>
inline void kv_accum_block(const float* p, int64_t ldp, const T* v, int64_t ldv, int64_t n, int64_t hd, int64_t d,
                           int64_t cnt, float* out) {
  static_assert(!Tail || NV == 1, "a tail is one vector");
  __m256 acc[NG][NV];
#pragma GCC unroll 8
  for (int g = 0; g < NG; g++)
#pragma GCC unroll 4
    for (int u = 0; u < NV; u++) acc[g][u] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j++) {
    __m256 vj[NV];
    for (int u = 0; u < NV; u++) vj[u] = load_kv8(v + j * ldv + d + 8 * u);
    for (int g = 0; g < NG; g++) {
      const __m256 pv = _mm256_broadcast_ss(p + g * ldp + j);
      for (int u = 0; u < NV; u++) acc[g][u] = _mm256_fmadd_ps(pv, vj[u], acc[g][u]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < NG; g++)
#pragma GCC unroll 4
    for (int u = 0; u < NV; u++) {
      float* o = out + g * hd + d + 8 * u;
      if (Tail) {
        const __m256i m = tail_mask(cnt);
        _mm256_maskstore_ps(o, m, _mm256_add_ps(_mm256_maskload_ps(o, m), acc[g][u]));
      } else {
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[g][u]));
      }
    }
}

template <int NG, class T>
void kv_scores_tile(const float* q, int64_t hd, const T* k, int64_t ldk, int64_t n, float* s, int64_t lds) {
  constexpr int NV = vectors_per_head<NG>();
  int64_t j = 0;
  for (; j + 8 * NV <= n; j += 8 * NV) kv_scores_block<NG, NV, false>(q, hd, k, ldk, j, 8 * NV, s, lds);
  for (; j + 8 <= n; j += 8) kv_scores_block<NG, 1, false>(q, hd, k, ldk, j, 8, s, lds);
  if (j == n) return;
  const int64_t cnt = n - j;
  float* t = kv_tail.get((size_t)hd * 8);  // [hd][8]: channel d of tokens j..n-1
  for (int64_t d = 0; d < hd; d++)
    for (int64_t i = 0; i < 8; i++) t[d * 8 + i] = i < cnt ? kv_value(k[d * ldk + j + i]) : 0.f;
  kv_scores_block<NG, 1, true>(q, hd, static_cast<const float*>(t), 8, 0, cnt, s + j, lds);
}

template <int NG, class T>
void kv_accum_tile(const float* p, int64_t ldp, const T* v, int64_t n, int64_t hd, float* out) {
  constexpr int NV = vectors_per_head<NG>();
  int64_t d = 0;
  for (; d + 8 * NV <= hd; d += 8 * NV) kv_accum_block<NG, NV, false>(p, ldp, v, hd, n, hd, d, 8 * NV, out);
  for (; d + 8 <= hd; d += 8) kv_accum_block<NG, 1, false>(p, ldp, v, hd, n, hd, d, 8, out);
  if (d == hd) return;
  const int64_t cnt = hd - d;
  float* t = kv_tail.get((size_t)n * 8);  // [n][8]: channels d..hd-1 of every token
  for (int64_t j = 0; j < n; j++)
    for (int64_t i = 0; i < 8; i++) t[j * 8 + i] = i < cnt ? kv_value(v[j * hd + d + i]) : 0.f;
  kv_accum_block<NG, 1, true>(p, ldp, static_cast<const float*>(t), 8, n, hd, 0, cnt, out + d);
}

void kv_scores(KVType t, const float* q, int64_t G, int64_t hd, const void* k, int64_t ldk, int64_t n, float* s,
               int64_t lds) {
  with_kv_type(t, k, [&](auto kp) {
    for_head_tiles(G, [&](auto ng, int64_t g0) {
      kv_scores_tile<decltype(ng)::value>(q + g0 * hd, hd, kp, ldk, n, s + g0 * lds, lds);
    });
  });
}

void kv_accum(KVType t, const float* p, int64_t ldp, int64_t G, const void* v, int64_t n, int64_t hd, float* out) {
  with_kv_type(t, v, [&](auto vp) {
    for_head_tiles(G, [&](auto ng, int64_t g0) {
      kv_accum_tile<decltype(ng)::value>(p + g0 * ldp, ldp, vp, n, hd, out + g0 * hd);
    });
  });
}

// Sparse rows, 8 channels at a time. AVX2 has no expand: the 8 values from the chunk's first kept one
// are loaded whole (kKVSparseSlack covers the last row), VPERMPS moves the r-th of them to the lane of
// the r-th set mask bit, and the lanes without a bit are cleared.
struct ExpandIndex {
  uint64_t lanes[256];  // byte i of lanes[m]: the rank of lane i's bit among m's set bits
  ExpandIndex() {
    for (int m = 0; m < 256; m++) {
      lanes[m] = 0;
      for (int i = 0, r = 0; i < 8; i++)
        if (m >> i & 1) lanes[m] |= (uint64_t)r++ << (8 * i);
    }
  }
};
const ExpandIndex kExpandIndex;

inline __m256i kv_lanes8(unsigned m) {  // all ones in the lanes whose bit is set
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)m), bit), bit);
}
template <class T>
inline __m256 expand_kv8(const T* v, unsigned m, __m256i lanes) {
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)kExpandIndex.lanes[m]));
  return _mm256_and_ps(_mm256_permutevar8x32_ps(load_kv8(v), idx), _mm256_castsi256_ps(lanes));
}
// f(d, lanes, x) for each 8 channels from d with kept ones: lanes their mask, x the row there.
inline unsigned kv_mask8(const uint32_t* mask, int64_t d) { return mask[d / 32] >> (d & 24) & 0xff; }
template <class T, class F>
inline void for_kept8(const uint32_t* mask, const T* v, int64_t hd, F&& f) {
  for (int64_t d = 0; d < hd; d += 8) {
    const unsigned m = kv_mask8(mask, d);
    if (!m) continue;
    const __m256i lanes = kv_lanes8(m);
    f(d, lanes, expand_kv8(v, m, lanes));
    v += __builtin_popcount(m);
  }
}

// NG heads x one token at head size 64: the token's row expanded into 8 registers first (its values
// pointer in a register), then each head's dot. 4,096 int8 rows at GQA 7, one thread on the Xeon with
// AMX: 132 us chunk by chunk, 96 so.
template <int NG, class T>
void kv_scores_sparse_row64(const float* q, const uint32_t* mask, const T* val, int64_t nk, int64_t n, float* s,
                            int64_t lds) {
  for (int64_t j = 0; j < n; j++) {
    const uint32_t* mk = mask + j * 2;
    const T* v = val + j * nk;
    __m256 k[8];
    for (int c = 0; c < 8; c++) {
      const unsigned m = mk[c / 4] >> (8 * (c % 4)) & 0xff;
      k[c] = expand_kv8(v, m, kv_lanes8(m));   // zero where no channel is kept
      v += __builtin_popcount(m);
    }
    for (int g = 0; g < NG; g++) {
      __m256 acc = _mm256_setzero_ps();
      for (int c = 0; c < 8; c++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * 64 + 8 * c), k[c], acc);
      s[g * lds + j] = hsum(acc);
    }
  }
}

template <int NG, class T>
void kv_scores_sparse_tile(const float* q, int64_t hd, const uint32_t* mask, const T* val, int64_t nk, int64_t n,
                           float* s, int64_t lds) {
  if (hd == 64) return kv_scores_sparse_row64<NG>(q, mask, val, nk, n, s, lds);
  for (int64_t j = 0; j < n; j++) {
    __m256 acc[NG];
    for (int g = 0; g < NG; g++) acc[g] = _mm256_setzero_ps();
    for_kept8(mask + j * kv_mask_words(hd), val + j * nk, hd, [&](int64_t d, __m256i lanes, __m256 k) {
      // q read only in kept lanes: no read past q's end, and nothing from a dropped channel
      for (int g = 0; g < NG; g++) acc[g] = _mm256_fmadd_ps(_mm256_maskload_ps(q + g * hd + d, lanes), k, acc[g]);
    });
    for (int g = 0; g < NG; g++) s[g * lds + j] = hsum(acc[g]);
  }
}

// NG heads x 8 channels over up to 16 tokens: each head's sum stays in a register over the tokens (each
// token's values pointer advanced past the chunks already read).
template <int NG, class T>
void kv_accum_sparse_tile(const float* p, int64_t ldp, const uint32_t* mask, const T* val, int64_t nk, int64_t n,
                          int64_t hd, float* out) {
  const int64_t mw = kv_mask_words(hd);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nj = std::min<int64_t>(16, n - j0);
    const T* v[16];
    for (int64_t j = 0; j < nj; j++) v[j] = val + (j0 + j) * nk;
    for (int64_t d = 0; d < hd; d += 8) {
      __m256 acc[NG];
      for (int g = 0; g < NG; g++) acc[g] = _mm256_setzero_ps();
      for (int64_t j = 0; j < nj; j++) {
        const unsigned m = kv_mask8(mask + (j0 + j) * mw, d);
        if (!m) continue;
        const __m256i lanes = kv_lanes8(m);
        const __m256 x = expand_kv8(v[j], m, lanes);
        v[j] += __builtin_popcount(m);
        for (int g = 0; g < NG; g++) acc[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * ldp + j0 + j), x, acc[g]);
      }
      const __m256i m = tail_mask(std::min<int64_t>(8, hd - d));
      for (int g = 0; g < NG; g++) {
        float* o = out + g * hd + d;
        _mm256_maskstore_ps(o, m, _mm256_add_ps(_mm256_maskload_ps(o, m), acc[g]));
      }
    }
  }
}

void kv_scores_sparse(KVType t, const float* q, int64_t G, int64_t hd, const uint32_t* mask, const void* val,
                      int64_t nk, int64_t n, float* s, int64_t lds) {
  for_kv_head_tiles(t, val, G, [&](auto ng, int64_t g0, auto vp) {
    kv_scores_sparse_tile<decltype(ng)::value>(q + g0 * hd, hd, mask, vp, nk, n, s + g0 * lds, lds);
  });
}

void kv_accum_sparse(KVType t, const float* p, int64_t ldp, int64_t G, const uint32_t* mask, const void* val,
                     int64_t nk, int64_t n, int64_t hd, float* out) {
  for_kv_head_tiles(t, val, G, [&](auto ng, int64_t g0, auto vp) {
    kv_accum_sparse_tile<decltype(ng)::value>(p + g0 * ldp, ldp, mask, vp, nk, n, hd, out + g0 * hd);
  });
}

}  // namespace

// row_grain 32: the quantized layout's super-group
const KernelTable kAvx2Kernels = {"avx2", 32, pack, matmul, rmsnorm, silu_mul, gelu_tanh_mul, layernorm, gelu, kv_scores, kv_accum,
                                  kv_scores_sparse, kv_accum_sparse, softmax,
                                  row_to_f32, pack_raw, quant::avx2_quant_act_bytes,
                                  quant::avx2_quantize_act, quant::avx2_matmul_quant};

}  // namespace corelm
