// AVX-512 kernels (F/BW/VL/DQ + FMA). This file alone is compiled with AVX-512 flags; dispatch.cc
// only hands out this table when CPUID and XCR0 say the CPU and OS support it.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/avx512/kernels_avx512_bf16.h"
#include "kernels/avx512/panel_gemm.h"
#include "kernels/kernel_util.h"
#include "kernels/kernels.h"
#include "kernels/sparse_quant.h"
#include "kernels/ggml_grouped.h"
#include "kernels/quant_layout.h"
#include "kernels/sparse_layout.h"

namespace corelm {
namespace {

using avx512::AlignedAlloc;
using avx512::kChunk;
using avx512::kGroup;
using avx512::kPanel;

inline __mmask16 tail_mask(int64_t n) { return (__mmask16)((1u << n) - 1u); }

// ---------------------------------------------------------------------------------------------
// Weight layout: [rows/8][K/32][8][32], see kernels_avx512_bf16.h.
constexpr int kPrefetchBytes = 1024;  // decode's software prefetch distance, when on:
const bool kPrefetch = decode_prefetch(false);  // off by default (kernel_util.h)
constexpr int64_t kSmallBatch = kRowExactRows;  // up to this many rows of x, stream weights like GEMV (measured: faster than panels through 32 rows)

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The fp32/bf16 layout from value(r, c) (a float, or bf16 bits for bf16 rows), rows split by groups
// over par's threads.
template <class Value>
PackedMatrix pack_dense(int64_t rows, int64_t cols, WeightType type, const ParallelFor* par, Value value) {
  PackedMatrix m;
  m.type = type;
  m.rows = rows;
  m.cols = cols;
  m.ld = round_up(cols, kChunk);
  const int64_t prow = round_up(rows, kGroup);
  const size_t esz = type == WeightType::BF16 ? 2 : 4;
  m.nbytes = (size_t)prow * m.ld * esz;
  m.packed_by = &kAvx512Kernels;
  m.storage = aligned_buffer(m.nbytes);  // zeroed
  const int64_t nchunks = m.ld / kChunk;
  auto fill = [&](int64_t g0, int64_t g1) {
    for (int64_t r = g0 * kGroup; r < std::min(rows, g1 * kGroup); r++)
      for (int64_t c = 0; c < cols; c++) {
        const size_t i = ((size_t)(r / kGroup) * nchunks + c / kChunk) * kGroup * kChunk + (r % kGroup) * kChunk + c % kChunk;
        const auto v = value(r, c);
        if constexpr (std::is_same_v<decltype(v), const uint16_t>)
          static_cast<uint16_t*>(m.storage.get())[i] = v;
        else if (type == WeightType::BF16)
          static_cast<uint16_t*>(m.storage.get())[i] = f32_to_bf16(v);
        else
          static_cast<float*>(m.storage.get())[i] = v;
      }
  };
  const int64_t groups = prow / kGroup;
  if (par && *par) (*par)(groups, fill);
  else fill(0, groups);
  return m;
}

PackedMatrix pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par) {
  if (sparse::is_sparse(type)) return sparse::pack(src, rows, cols, type, par, &kAvx512Kernels);
  if (quant::is_raw_type(type)) return quant::avx512_pack(src, rows, cols, type, par);
  return pack_dense(rows, cols, type, par, [&](int64_t r, int64_t c) { return src[(size_t)r * cols + c]; });
}

PackedMatrix pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par) {
  if (type != WeightType::BF16) return quant::avx512_pack_raw(type, raw, rows, cols, par);
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(raw);
  return pack_dense(rows, cols, type, par, [&](int64_t r, int64_t c) { return bits[(size_t)r * cols + c]; });
}

// 16 weights as fp32: bf16 is the top half of an fp32, so widening is a zero-extend and a shift.
template <bool BF16>
inline __m512 load16(const void* p) {
  if constexpr (BF16) {
    __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_loadu_ps((const float*)p);
  }
}

// Sums each of 8 accumulators and stores the rows of this group that fall in [lo, hi).
inline void store_group(__m512 acc[kGroup], float* y, int64_t row0, int64_t lo, int64_t hi) {
  for (int j = 0; j < kGroup; j++) {
    int64_t r = row0 + j;
    if (r >= lo && r < hi) y[r] = _mm512_reduce_add_ps(acc[j]);
  }
}

// Decode: y = W x for rows [n0, n1), x fp32. One group (8 rows) at a time, one stream.
template <bool BF16>
void gemv(const float* x, const PackedMatrix& w, float* y, int64_t n0, int64_t n1) {
  const size_t esz = BF16 ? 2 : 4;
  const int64_t nchunks = w.ld / kChunk;
  const char* base = static_cast<const char*>(w.data());
  const avx512::EvenOddX xs(w.cols);  // x chunk by chunk, masked past K (kernels_avx512_bf16.h)
  for (int64_t g = n0 / kGroup; g * kGroup < n1; g++) {
    const char* p = base + (size_t)g * nchunks * kGroup * kChunk * esz;
    __m512 acc[kGroup], acc2[kGroup];  // two independent chains per row
    for (int j = 0; j < kGroup; j++) acc[j] = acc2[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nchunks; c++) {
      if (kPrefetch)
        for (int b = 0; b < kGroup * kChunk * (int)esz; b += 64) _mm_prefetch(p + kPrefetchBytes + b, _MM_HINT_T0);
      if constexpr (BF16) {
        __m512 xe, xo;
        xs.split(x, c, xe, xo);
        for (int j = 0; j < kGroup; j++, p += kChunk * esz) {
          const __m512i v = _mm512_loadu_si512((const void*)p);
          acc[j] = _mm512_fmadd_ps(xe, avx512::widen_even(v), acc[j]);
          acc2[j] = _mm512_fmadd_ps(xo, avx512::widen_odd(v), acc2[j]);
        }
      } else {
        const float* xc = x + c * kChunk;
        const __m512 x0 = c < xs.full ? _mm512_loadu_ps(xc) : _mm512_maskz_loadu_ps(xs.m_lo, xc);
        const __m512 x1 = c < xs.full ? _mm512_loadu_ps(xc + 16) : _mm512_maskz_loadu_ps(xs.m_hi, xc + 16);
        for (int j = 0; j < kGroup; j++, p += kChunk * esz) {
          acc[j] = _mm512_fmadd_ps(x0, load16<BF16>(p), acc[j]);
          acc2[j] = _mm512_fmadd_ps(x1, load16<BF16>(p + 16 * esz), acc2[j]);
        }
      }
    }
    for (int j = 0; j < kGroup; j++) acc[j] = _mm512_add_ps(acc[j], acc2[j]);
    store_group(acc, y, g * kGroup, n0, n1);
  }
}

// Small batches (a few sequences decoding together, a sequence checking speculated tokens): the GEMV
// stream, with each half group (4 weight rows) reused for MR activation rows at a time while it is in
// L1, so weights come from memory once per step. Each row is summed exactly as gemv sums it (the same
// two chains, the same order), so a row's result does not depend on how many rows came with it.
// xs: the activation rows as gemv reads them, chunk by chunk (bf16: even then odd elements; fp32: the
// two halves), split once per call (xsplit), not once per half group. The first pass over a group
// (fetch_ahead) prefetches the other half of each chunk, which it would skip line by line, and whole
// chunks a few ahead: the hardware prefetcher alone left the stream waiting on memory. Zen 5, one
// thread, bench_gemv_stream on Qwen2.5-0.5B's shapes, bf16, GB/s of weights for 2 / 3 / 4 / 8 rows:
// 18.5 / 14.6 / 14.6 / 9.2 -> 27.1 / 22.8 / 21.1 / 14.1 (1 row: 37, a plain read 41-42).
constexpr int64_t kRowsAhead = 4;  // chunks (2 KiB of bf16): 2 -> 26.6, 8 -> 27.4, 16 -> 25.0 at 2 rows
template <bool BF16, int MR>
void gemv_rows(const float* xs, int64_t ldxs, const PackedMatrix& w, float* y, int64_t ldy, int64_t g, int half,
               bool fetch_ahead) {
  constexpr int kHalf = kGroup / 2;
  const size_t esz = BF16 ? 2 : 4;
  const int64_t nchunks = w.ld / kChunk;
  constexpr int64_t kChunkBytes = kGroup * kChunk * (BF16 ? 2 : 4);
  const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000u);
  const char* const group = static_cast<const char*>(w.data()) + (size_t)g * nchunks * kChunkBytes;
  const char* p = group + half * kHalf * kChunk * esz;
  const char* const other = group + (1 - half) * kHalf * kChunk * esz;
  __m512 acc[MR][kHalf], acc2[MR][kHalf];
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
    for (int j = 0; j < kHalf; j++) acc[i][j] = acc2[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < nchunks; c++, p += kChunkBytes) {
    if (fetch_ahead) {  // this chunk's other half, and the whole chunk kRowsAhead on
      for (int64_t b = 0; b < kHalf * kChunk * (int64_t)esz; b += 64) _mm_prefetch(other + c * kChunkBytes + b, _MM_HINT_T0);
      for (int64_t b = 0; b < kChunkBytes; b += 64) _mm_prefetch(group + (c + kRowsAhead) * kChunkBytes + b, _MM_HINT_T0);
    }
    __m512 xa[MR], xb[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
      xa[i] = _mm512_load_ps(xs + i * ldxs + c * kChunk);
      xb[i] = _mm512_load_ps(xs + i * ldxs + c * kChunk + 16);
    }
#pragma GCC unroll 4
    for (int j = 0; j < kHalf; j++) {
      const char* pj = p + j * kChunk * esz;
      __m512 wa, wb;
      if constexpr (BF16) {
        const __m512i v = _mm512_loadu_si512((const void*)pj);
        wa = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), wb = _mm512_castsi512_ps(_mm512_and_si512(v, hi16));
      } else {
        wa = load16<BF16>(pj), wb = load16<BF16>(pj + 16 * esz);
      }
#pragma GCC unroll 4
      for (int i = 0; i < MR; i++) {
        acc[i][j] = _mm512_fmadd_ps(xa[i], wa, acc[i][j]);
        acc2[i][j] = _mm512_fmadd_ps(xb[i], wb, acc2[i][j]);
      }
    }
  }
  const int64_t r0 = g * kGroup + half * kHalf;
  float sums[MR][kHalf];
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
    for (int j = 0; j < kHalf; j++) sums[i][j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][j], acc2[i][j]));
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < kHalf; j++)
      if (r0 + j < w.rows) y[i * ldy + r0 + j] = sums[i][j];
}

// The m activation rows of x, chunk by chunk as gemv reads them (zero past K), into xs [m][ld].
template <bool BF16>
void xsplit(const float* x, int64_t m, int64_t ldx, int64_t K, int64_t ld, float* xs) {
  const avx512::EvenOddX eo(K);
  for (int64_t i = 0; i < m; i++)
    for (int64_t c = 0; c < ld / kChunk; c++) {
      const float* xr = x + i * ldx;
      float* d = xs + i * ld + c * kChunk;
      __m512 a, b;
      if constexpr (BF16) {
        eo.split(xr, c, a, b);
      } else {
        a = c < eo.full ? _mm512_loadu_ps(xr + c * kChunk) : _mm512_maskz_loadu_ps(eo.m_lo, xr + c * kChunk);
        b = c < eo.full ? _mm512_loadu_ps(xr + c * kChunk + 16) : _mm512_maskz_loadu_ps(eo.m_hi, xr + c * kChunk + 16);
      }
      _mm512_store_ps(d, a), _mm512_store_ps(d + 16, b);
    }
}

template <bool BF16>
void gemv_batch(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                int64_t n1) {
  thread_local std::vector<float> tmp;
  thread_local std::vector<float, AlignedAlloc<float>> xs;
  if ((int64_t)xs.size() < m * w.ld) xs.resize(m * w.ld);
  xsplit<BF16>(x, m, ldx, w.cols, w.ld, xs.data());
  for (int64_t g = n0 / kGroup; g * kGroup < n1; g++) {
    // rows of this group outside [n0, n1) belong to another thread: compute into scratch, copy ours
    const bool whole = g * kGroup >= n0 && (g + 1) * kGroup <= n1;
    float* out = y;
    int64_t ld = ldy;
    if (!whole) {
      tmp.resize((size_t)m * (w.rows + kGroup));
      out = tmp.data();
      ld = w.rows + kGroup;
    }
    for (int half = 0; half < 2; half++) {
      int64_t i = 0;
      for (; i + 2 <= m; i += 2)
        gemv_rows<BF16, 2>(xs.data() + i * w.ld, w.ld, w, out + i * ld, ld, g, half, half == 0 && i == 0);
      if (i < m) gemv_rows<BF16, 1>(xs.data() + i * w.ld, w.ld, w, out + i * ld, ld, g, half, half == 0 && i == 0);
    }
    if (!whole)
      for (int64_t r = std::max(g * kGroup, n0); r < std::min((g + 1) * kGroup, n1); r++)
        for (int64_t k = 0; k < m; k++) y[k * ldy + r] = tmp[k * ld + r];
  }
}

// Prefill: each panel of 32 weight rows is widened to fp32 and transposed to [K][32] once, then
// avx512::panel_gemm sweeps it with outer-product tiles (panel_gemm.h).
template <bool BF16>
void gemm(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
          int64_t n1) {
  const size_t esz = BF16 ? 2 : 4;
  const int64_t K = w.cols, ld = w.ld, nchunks = ld / kChunk;
  thread_local std::vector<float, AlignedAlloc<float>> block;
  if ((int64_t)block.size() < kPanel * ld) block.resize(kPanel * ld);
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32((int)ld));
  avx512::panel_gemm(x, m, ldx, K, ld, y, ldy, n0, n1, [&](int64_t p0, float* panel) {
    // widen the panel's groups (rows past the matrix are zero in the packing, or zeroed here)
    for (int64_t g = 0; g < kPanel / kGroup; g++) {
      float* dst = block.data() + g * kGroup * ld;
      if (p0 + g * kGroup >= w.rows) {
        std::memset(dst, 0, kGroup * ld * sizeof(float));
        continue;
      }
      const char* src = static_cast<const char*>(w.data()) + (size_t)((p0 / kGroup) + g) * nchunks * kGroup * kChunk * esz;
      for (int64_t c = 0; c < nchunks; c++)
        for (int j = 0; j < kGroup; j++, src += kChunk * esz) {
          _mm512_store_ps(dst + j * ld + c * kChunk, load16<BF16>(src));
          _mm512_store_ps(dst + j * ld + c * kChunk + 16, load16<BF16>(src + 16 * esz));
        }
    }
    // transpose [32][ld] -> [ld][32]
    for (int64_t k = 0; k < K; k++) {
      _mm512_store_ps(panel + k * kPanel, _mm512_i32gather_ps(idx, block.data() + k, 4));
      _mm512_store_ps(panel + k * kPanel + 16, _mm512_i32gather_ps(idx, block.data() + 16 * ld + k, 4));
    }
  });
}

void matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
            int64_t n1) {
  n1 = std::min(n1, w.rows);
  if (n0 >= n1) return;
  if (sparse::is_sparse(w.type)) return sparse::matmul_avx512(x, m, ldx, w, y, ldy, n0, n1, matmul, false);
  if (quant::is_raw_type(w.type)) return quant::avx512_matmul(x, m, ldx, w, y, ldy, n0, n1);
  const bool bf16 = w.type == WeightType::BF16;
  if (m == 1)
    bf16 ? gemv<true>(x, w, y, n0, n1) : gemv<false>(x, w, y, n0, n1);
  else if (m <= kSmallBatch)
    bf16 ? gemv_batch<true>(x, m, ldx, w, y, ldy, n0, n1) : gemv_batch<false>(x, m, ldx, w, y, ldy, n0, n1);
  else
    bf16 ? gemm<true>(x, m, ldx, w, y, ldy, n0, n1) : gemm<false>(x, m, ldx, w, y, ldy, n0, n1);
}

// The AVX512_BF16 table: bf16 weights with m >= 2 go through VDPBF16PS (activations rounded to bf16);
// everything else as above. Its row_exact table is the plain one (fp32 activations, decode's sums).
void matmul_bf16dp(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                   int64_t n1) {
  if (sparse::is_sparse(w.type)) return sparse::matmul_avx512(x, m, ldx, w, y, ldy, n0, n1, matmul_bf16dp, true);
  if (w.type != WeightType::BF16 || m == 1) return matmul(x, m, ldx, w, y, ldy, n0, n1);
  n1 = std::min(n1, w.rows);
  if (n0 < n1) avx512::bf16dp_matmul(x, m, ldx, w, y, ldy, n0, n1);
}

// 16 cached fp32, bf16 or int8 values as fp32 (masked for the tail).
inline __m512 load_kv16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_kv16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m512 load_kv16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

// NG heads x 16 tokens per pass: a key channel vector is loaded once and used by every head.
template <int NG, class T>
void kv_scores_tile(const float* q, int64_t hd, const T* k, int64_t ldk, int64_t n, float* s, int64_t lds) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : tail_mask(n - j);
    __m512 acc[NG];
    for (int g = 0; g < NG; g++) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
      const __m512 kd = load_kv16(k + d * ldk + j, m);
      for (int g = 0; g < NG; g++) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * hd + d]), kd, acc[g]);
    }
    for (int g = 0; g < NG; g++) _mm512_mask_storeu_ps(s + g * lds + j, m, acc[g]);
  }
}

// NG heads x 16 channels per pass over the tokens: a value vector is loaded once and used by every head.
template <int NG, class T>
void kv_accum_tile(const float* p, int64_t ldp, const T* v, int64_t n, int64_t hd, float* out) {
  for (int64_t d = 0; d < hd; d += 16) {
    const __mmask16 m = hd - d >= 16 ? (__mmask16)0xffff : tail_mask(hd - d);
    __m512 acc[NG];
    for (int g = 0; g < NG; g++) acc[g] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
      const __m512 vj = load_kv16(v + j * hd + d, m);
      for (int g = 0; g < NG; g++) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * ldp + j]), vj, acc[g]);
    }
    for (int g = 0; g < NG; g++) {
      float* o = out + g * hd + d;
      _mm512_mask_storeu_ps(o, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), acc[g]));
    }
  }
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

// Sparse rows: 16 channels at a time, their kept values (popcount(m) of them; a whole vector is read,
// the rows' slack keeps that inside the cache) expanded in registers under the channels' mask
// (VEXPANDPS: AVX512F, no VBMI2 needed). f(d, m, x) for each 16 channels from d with kept ones: m their
// mask, x the row there (dropped elements zero).
inline __mmask16 kv_mask16(const uint32_t* mask, int64_t d) { return (__mmask16)(mask[d / 32] >> (d & 16)); }
template <class T>
inline __m512 expand_kv16(const T* v, __mmask16 m) {
  return _mm512_maskz_expand_ps(m, load_kv16(v, (__mmask16)0xffff));
}
template <class T, class F>
inline void for_kept16(const uint32_t* mask, const T* v, int64_t hd, F&& f) {
  for (int64_t d = 0; d < hd; d += 16) {
    const __mmask16 m = kv_mask16(mask, d);
    if (!m) continue;
    f(d, m, expand_kv16(v, m));
    v += __builtin_popcount(m);
  }
}

// Token j's row expanded into k[c] (16 channels each, C of them: hd = 16 C), its values pointer running
// in a register; a row's chunks without kept channels are zero.
template <int C, class T>
inline void expand_row(const uint32_t* mask, const T* v, __m512 k[C]) {
  for (int c = 0; c < C; c++) {
    const __mmask16 m = (__mmask16)(mask[c / 2] >> (16 * (c & 1)));
    k[c] = expand_kv16(v, m);
    v += __builtin_popcount(m);
  }
}

// NG heads x one token: the token's key expanded once serves every head. Each head's 16 lanes are
// summed 8 tokens at a time (sum8: the lanes of _mm512_reduce_add_ps in its order, a third of its
// shuffles and adds). C > 0: hd = 16 C, the whole row expanded into registers first, then each head's
// dot (the common head sizes; 4,096 int8 rows at GQA 7 and hd 64: 107 us one head at a time per chunk,
// 100 with the sums 8 tokens at a time, 59 so); C = 0: any hd, chunk by chunk.
template <int NG, int C, class T>
void kv_scores_sparse_tile(const float* q, int64_t hd, const uint32_t* mask, const T* val, int64_t nk, int64_t n,
                           float* s, int64_t lds) {
  alignas(64) float part[NG][8][16];
  const int64_t mw = kv_mask_words(hd);
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t nj = std::min<int64_t>(8, n - j0);
    for (int64_t jj = 0; jj < nj; jj++) {
      const int64_t j = j0 + jj;
      if constexpr (C > 0) {
        __m512 k[C];
        expand_row<C>(mask + j * mw, val + j * nk, k);
        for (int g = 0; g < NG; g++) {
          __m512 acc = _mm512_setzero_ps();
          for (int c = 0; c < C; c++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * hd + 16 * c), k[c], acc);
          _mm512_store_ps(part[g][jj], acc);
        }
      } else {
        __m512 acc[NG];
        for (int g = 0; g < NG; g++) acc[g] = _mm512_setzero_ps();
        for_kept16(mask + j * mw, val + j * nk, hd, [&](int64_t d, __mmask16 m, __m512 k) {
          // q loaded whole (masked only past hd), so the load folds into the FMA: the dropped channels
          // are zero in k, as in the dense kernel's product
          for (int g = 0; g < NG; g++) {
            const float* qg = q + g * hd + d;
            const __m512 qv = hd - d >= 16 ? _mm512_loadu_ps(qg) : _mm512_maskz_loadu_ps(tail_mask(hd - d), qg);
            acc[g] = _mm512_fmadd_ps(qv, k, acc[g]);
          }
        });
        for (int g = 0; g < NG; g++) _mm512_store_ps(part[g][jj], acc[g]);
      }
    }
    const __mmask8 keep = (__mmask8)((1u << nj) - 1u);
    for (int g = 0; g < NG; g++) {
      __m512 a[8];
      for (int jj = 0; jj < 8; jj++) a[jj] = jj < nj ? _mm512_load_ps(part[g][jj]) : _mm512_setzero_ps();
      _mm256_mask_storeu_ps(s + g * lds + j0, keep, avx512::sum8(a));
    }
  }
}

// NG heads x 16 channels over up to 16 tokens, as kv_accum_tile: each head's sum stays in a register
// over the tokens (each token's values pointer advanced past the chunks already read).
template <int NG, class T>
void kv_accum_sparse_tile(const float* p, int64_t ldp, const uint32_t* mask, const T* val, int64_t nk, int64_t n,
                          int64_t hd, float* out) {
  const int64_t mw = kv_mask_words(hd);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nj = std::min<int64_t>(16, n - j0);
    const T* v[16];
    for (int64_t j = 0; j < nj; j++) v[j] = val + (j0 + j) * nk;
    for (int64_t d = 0; d < hd; d += 16) {
      __m512 acc[NG];
      for (int g = 0; g < NG; g++) acc[g] = _mm512_setzero_ps();
      for (int64_t j = 0; j < nj; j++) {
        const __mmask16 m = kv_mask16(mask + (j0 + j) * mw, d);
        if (!m) continue;
        const __m512 x = expand_kv16(v[j], m);
        v[j] += __builtin_popcount(m);
        for (int g = 0; g < NG; g++) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * ldp + j0 + j]), x, acc[g]);
      }
      const __mmask16 m = hd - d >= 16 ? (__mmask16)0xffff : tail_mask(hd - d);
      for (int g = 0; g < NG; g++) {
        float* o = out + g * hd + d;
        _mm512_mask_storeu_ps(o, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), acc[g]));
      }
    }
  }
}

// Chunks of a row per pass of kv_accum_sparse_rows: a divisor of C whose NG x CP sums and CP expanded
// chunks fit the 32 vector registers.
constexpr int accum_chunks_per_pass(int C, int NG) {
  int cp = C;
  while (cp > 1 && (C % cp != 0 || (NG + 1) * cp > 28)) cp--;
  return cp;
}

// kv_accum_sparse_tile for hd = 16 C (the common head sizes): each token's row expanded CP chunks at a
// time into registers, its NG probabilities broadcast once for them; the same sums in the same order
// (a chunk without kept channels adds zero). 4,096 int8 rows, GQA 7, hd 64: 55 us chunk by chunk, 47 so.
template <int NG, int C, class T>
void kv_accum_sparse_rows(const float* p, int64_t ldp, const uint32_t* mask, const T* val, int64_t nk, int64_t n,
                          float* out) {
  constexpr int64_t hd = 16 * C, mw = (hd + 31) / 32;
  constexpr int CP = accum_chunks_per_pass(C, NG);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nj = std::min<int64_t>(16, n - j0);
    for (int c0 = 0; c0 < C; c0 += CP) {
      __m512 acc[NG][CP];
      for (int g = 0; g < NG; g++)
        for (int c = 0; c < CP; c++) acc[g][c] = _mm512_setzero_ps();
      for (int64_t j = j0; j < j0 + nj; j++) {
        const uint32_t* mk = mask + j * mw;
        int64_t before = c0 % 2 ? __builtin_popcount(mk[c0 / 2] & 0xffffu) : 0;  // kept channels before chunk c0
        for (int w = 0; w < c0 / 2; w++) before += __builtin_popcount(mk[w]);
        const T* v = val + j * nk + before;
        __m512 k[CP];
        for (int c = 0; c < CP; c++) {
          const __mmask16 m = (__mmask16)(mk[(c0 + c) / 2] >> (16 * ((c0 + c) & 1)));
          k[c] = expand_kv16(v, m);
          v += __builtin_popcount(m);
        }
        for (int g = 0; g < NG; g++) {
          const __m512 pg = _mm512_set1_ps(p[g * ldp + j]);
          for (int c = 0; c < CP; c++) acc[g][c] = _mm512_fmadd_ps(pg, k[c], acc[g][c]);
        }
      }
      for (int g = 0; g < NG; g++)
        for (int c = 0; c < CP; c++) {
          float* o = out + g * hd + 16 * (c0 + c);
          _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), acc[g][c]));
        }
    }
  }
}

void kv_scores_sparse(KVType t, const float* q, int64_t G, int64_t hd, const uint32_t* mask, const void* val,
                      int64_t nk, int64_t n, float* s, int64_t lds) {
  for_kv_head_tiles(t, val, G, [&](auto ng, int64_t g0, auto vp) {
    constexpr int NG = decltype(ng)::value;
    if (hd == 64) kv_scores_sparse_tile<NG, 4>(q + g0 * hd, hd, mask, vp, nk, n, s + g0 * lds, lds);
    else if (hd == 128) kv_scores_sparse_tile<NG, 8>(q + g0 * hd, hd, mask, vp, nk, n, s + g0 * lds, lds);
    else kv_scores_sparse_tile<NG, 0>(q + g0 * hd, hd, mask, vp, nk, n, s + g0 * lds, lds);
  });
}

void kv_accum_sparse(KVType t, const float* p, int64_t ldp, int64_t G, const uint32_t* mask, const void* val,
                     int64_t nk, int64_t n, int64_t hd, float* out) {
  for_kv_head_tiles(t, val, G, [&](auto ng, int64_t g0, auto vp) {
    constexpr int NG = decltype(ng)::value;
    if (hd == 64) kv_accum_sparse_rows<NG, 4>(p + g0 * ldp, ldp, mask, vp, nk, n, out + g0 * hd);
    else if (hd == 128) kv_accum_sparse_rows<NG, 8>(p + g0 * ldp, ldp, mask, vp, nk, n, out + g0 * hd);
    else kv_accum_sparse_tile<NG>(p + g0 * ldp, ldp, mask, vp, nk, n, hd, out + g0 * hd);
  });
}

void rmsnorm(float* out, const float* x, const float* weight, int64_t n, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : tail_mask(n - i);
    __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  float scale = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)n + eps);
  __m512 sv = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : tail_mask(n - i);
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), sv);
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, weight + i), v));
  }
}

// exp(x) for x <= 0 region and beyond: range reduction x = k*ln2 + r, |r| <= ln2/2, then a degree-6
// polynomial (Cephes coefficients); about 1 ulp, enough to match std::exp within test tolerance.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365447505531f));
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, k);
}

void silu_mul(float* out, const float* gate, const float* up, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : tail_mask(n - i);
    __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, up + i)));
  }
}

void gelu_tanh_mul(float* out, const float* gate, const float* up, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f), c2 = _mm512_set1_ps(-2.f * 0.7978845608028654f);
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : tail_mask(n - i);
    __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g);
    __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_mul_ps(c2, inner))));  // x * sigmoid(2u)
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, up + i)));
  }
}

void layernorm(float* out, const float* x, const float* weight, const float* bias, int64_t n, float eps) {
  layernorm_loops(out, x, weight, bias, n, eps);
}

// gelu(x) = x/2 (1 + erf(x / sqrt 2)), erf by Abramowitz-Stegun 7.1.26 on |x| with the sign put back.
void gelu(float* x, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f), half = _mm512_set1_ps(0.5f);
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    const __m512 z = _mm512_mul_ps(v, _mm512_set1_ps(0.70710678118654752f));
    const __m512 a = _mm512_abs_ps(z);
    const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), a, one));
    __m512 p = _mm512_set1_ps(1.061405429f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
    p = _mm512_mul_ps(p, t);
    const __m512 e = exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), a), a));
    __m512 erf_abs = _mm512_fnmadd_ps(p, e, one);
    const __m512 erf = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(erf_abs), _mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32(INT32_MIN))));
    _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_mul_ps(half, v), _mm512_add_ps(one, erf)));
  }
}

void softmax(float* x, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : tail_mask(n - i);
    mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, x + i));
  }
  __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : tail_mask(n - i);
    __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), mv));
    e = _mm512_maskz_mov_ps(m, e);
    sum = _mm512_add_ps(sum, e);
    _mm512_mask_storeu_ps(x + i, m, e);
  }
  __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv));
  }
}

void row_to_f32(const PackedMatrix& w, int64_t row, float* out) {
  if (sparse::is_sparse(w.type)) return sparse::row_to_f32(w, row, out);
  if (sparse::is_sparse_quant(w.type)) return sparse::quant_row_to_f32(w, row, out);
  if (quant::is_grouped_ggml(w.type)) return quant::grouped_ggml_row_to_f32(w, row, out);
  if (quant::is_ggml_block(w.type)) return quant::ggml_row_to_f32(w, row, out);
  if (quant::is_quant(w.type)) return quant::grouped_row_to_f32(w, row, out);
  const size_t esz = w.type == WeightType::BF16 ? 2 : 4;
  const int64_t nchunks = w.ld / kChunk;
  const char* p = static_cast<const char*>(w.data()) +
                  (((size_t)(row / kGroup) * nchunks) * kGroup + row % kGroup) * kChunk * esz;
  for (int64_t c = 0; c < nchunks; c++, p += kGroup * kChunk * esz)
    for (int h = 0; h < 2; h++) {
      int64_t k = c * kChunk + h * 16;
      if (k >= w.cols) break;
      __mmask16 m = w.cols - k >= 16 ? (__mmask16)0xffff : tail_mask(w.cols - k);
      __m512 v = w.type == WeightType::BF16 ? load16<true>(p + h * 16 * 2) : load16<false>(p + h * 16 * 4);
      _mm512_mask_storeu_ps(out + k, m, v);
    }
}

}  // namespace

const KernelTable kAvx512Kernels = {"avx512", /*row_grain: the quantized layout interleaves 32 rows*/ 32, pack, matmul, rmsnorm, silu_mul, gelu_tanh_mul, layernorm, gelu, kv_scores,
                                    kv_accum, kv_scores_sparse, kv_accum_sparse, softmax, row_to_f32, pack_raw,
                                    quant::avx512_quant_act_bytes, quant::avx512_quantize_act,
                                    quant::avx512_matmul_quant};
const KernelTable kAvx512Bf16Kernels = {"avx512_bf16", 32, pack, matmul_bf16dp, rmsnorm, silu_mul, gelu_tanh_mul, layernorm, gelu, kv_scores,
                                        kv_accum, kv_scores_sparse, kv_accum_sparse, softmax, row_to_f32, pack_raw,
                                        quant::avx512_quant_act_bytes, quant::avx512_quantize_act,
                                        quant::avx512_matmul_quant, &kAvx512Kernels};

}  // namespace corelm
