// AVX2 kernels for sparse bf16 weights (kernels/sparse_layout.h). AVX2 has no expand instruction:
// 8 non-zeros at a time go back to their places through one PSHUFB, whose control comes from a
// 256-entry table indexed by that byte of the mask (4 KiB, stays in L1).
//
// Up to kRowExactRows activation rows stream masks and non-zeros directly; larger m expands 16 rows at a time into the AVX2 table's dense bf16 panel and hands it to that
// table's matmul, which reuses it across every activation row.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "kernels/kernel_util.h"
#include "kernels/sparse_layout.h"

namespace corelm {
namespace sparse {
namespace {

constexpr int64_t kAvx2Panel = 16;  // rows of the AVX2 table's dense panel (kernels_avx2.cc)

// kExpand[b]: the PSHUFB control putting the popcount(b) bf16 at the front of a 16-byte load into the
// elements whose bits are set in b, zeros elsewhere.
struct ExpandTable {
  alignas(16) uint8_t ctl[256][16];
  ExpandTable() {
    for (int b = 0; b < 256; b++) {
      int src = 0;
      for (int e = 0; e < 8; e++) {
        const bool on = b >> e & 1;
        ctl[b][2 * e] = on ? (uint8_t)(2 * src) : 0x80;
        ctl[b][2 * e + 1] = on ? (uint8_t)(2 * src + 1) : 0x80;
        src += on;
      }
    }
  }
};
const ExpandTable kExpand;

// 8 weights (bits `b` of a mask) expanded from v: as bf16, and as fp32.
inline __m128i expand8_bits(uint32_t b, const uint16_t* v) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
  return _mm_shuffle_epi8(raw, _mm_load_si128(reinterpret_cast<const __m128i*>(kExpand.ctl[b])));
}
inline __m256 expand8(uint32_t b, const uint16_t* v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(expand8_bits(b, v)), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Group g's rows in [n0, n1) of one activation row into y: masks and non-zeros streamed once, each
// row's chunk summed by its own accumulator.
void gemv_group(const float* x, const PackedMatrix& w, int64_t g, float* y, int64_t n0, int64_t n1) {
  const int64_t K = w.cols, nc = nchunks(K);
  alignas(32) float xt[kChunk];  // the last chunk's x, zero-padded (x past K is not ours to read)
  const uint8_t* p = record(w, g);
  const int64_t ahead = record_prefetch_bytes();
  __m256 acc[kGroup];
  for (int j = 0; j < kGroup; j++) acc[j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < nc; c++) {
    const float* xc = x + c * kChunk;
    if ((c + 1) * kChunk > K) {
      std::memset(xt, 0, sizeof xt);
      std::memcpy(xt, xc, (size_t)(K - c * kChunk) * 4);
      xc = xt;
    }
    const __m256 x0 = _mm256_loadu_ps(xc), x1 = _mm256_loadu_ps(xc + 8), x2 = _mm256_loadu_ps(xc + 16),
                 x3 = _mm256_loadu_ps(xc + 24);
    const uint32_t* mask = reinterpret_cast<const uint32_t*>(p);
    const uint16_t* v = reinterpret_cast<const uint16_t*>(p + kGroup * 4);
    for (int j = 0; j < kGroup; j++) {
      const uint32_t mk = mask[j];
      const int c0 = __builtin_popcount(mk & 0xff), c1 = __builtin_popcount(mk & 0xffff),
                c2 = __builtin_popcount(mk & 0xffffff);
      __m256 a = _mm256_mul_ps(x0, expand8(mk & 0xff, v));
      a = _mm256_fmadd_ps(x1, expand8(mk >> 8 & 0xff, v + c0), a);
      a = _mm256_fmadd_ps(x2, expand8(mk >> 16 & 0xff, v + c1), a);
      a = _mm256_fmadd_ps(x3, expand8(mk >> 24, v + c2), a);
      acc[j] = _mm256_add_ps(acc[j], a);
      v += __builtin_popcount(mk);
    }
    prefetch_ahead(p, reinterpret_cast<const uint8_t*>(v), ahead);
    p = reinterpret_cast<const uint8_t*>(v);
  }
  for (int j = 0; j < kGroup; j++) {
    const int64_t r = g * kGroup + j;
    if (r >= n0 && r < n1) y[r] = hsum(acc[j]);
  }
}

// Up to kRowExactRows rows: each row as decode sums it (a row's bits do not depend on the batch), a
// group at a time, so the group's record comes from L1/L2 for every row after the first.
void gemv_rows(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
               int64_t n1) {
  for (int64_t g = n0 / kGroup; g * kGroup < n1; g++)
    for (int64_t i = 0; i < m; i++) gemv_group(x + i * ldx, w, g, y + i * ldy, n0, n1);
}

// Groups g, g + 1 (rows past the matrix zero) into the AVX2 table's dense bf16 panel: column k of
// panel row c at k * 16 + (c % 8) * 2 + c / 8. A chunk's 16 rows are expanded into a row-major tile
// in L1, then transposed into the panel.
void expand_panel(const PackedMatrix& w, int64_t g, uint16_t* panel) {
  const int64_t K = w.cols, nc = nchunks(K);
  alignas(32) uint16_t tile[kAvx2Panel][kChunk];
  const uint8_t* rec[2] = {record(w, g), (g + 1) * kGroup < w.rows ? record(w, g + 1) : nullptr};
  const int64_t ahead = record_prefetch_bytes();
  for (int64_t c = 0; c < nc; c++) {
    for (int h = 0; h < 2; h++) {
      if (!rec[h]) {
        std::memset(tile[h * kGroup], 0, sizeof tile / 2);
        continue;
      }
      const uint32_t* mask = reinterpret_cast<const uint32_t*>(rec[h]);
      const uint16_t* v = reinterpret_cast<const uint16_t*>(rec[h] + kGroup * 4);
      for (int j = 0; j < kGroup; j++) {
        uint16_t* row = tile[h * kGroup + j];
        for (int q = 0; q < 4; q++) {
          const uint32_t b = mask[j] >> (8 * q) & 0xff;
          _mm_store_si128(reinterpret_cast<__m128i*>(row + 8 * q), expand8_bits(b, v));
          v += __builtin_popcount(b);
        }
      }
      prefetch_ahead(rec[h], reinterpret_cast<const uint8_t*>(v), ahead);
      rec[h] = reinterpret_cast<const uint8_t*>(v);
    }
    const int64_t n = std::min(kChunk, K - c * kChunk);
    uint16_t* out = panel + c * kChunk * kAvx2Panel;
    for (int64_t i = 0; i < n; i++)
      for (int r = 0; r < kAvx2Panel; r++) out[i * kAvx2Panel + (r % 8) * 2 + r / 8] = tile[r][i];
  }
}

void expand_panels(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                   int64_t n1, DenseMatmul dense) {
  thread_local std::vector<uint16_t, AlignedAlloc<uint16_t>> buf;
  if ((int64_t)buf.size() < w.cols * kAvx2Panel) buf.resize(w.cols * kAvx2Panel);
  for (int64_t p0 = n0 / kAvx2Panel * kAvx2Panel; p0 < n1; p0 += kAvx2Panel) {
    expand_panel(w, p0 / kGroup, buf.data());
    PackedMatrix view;  // the panel as a dense bf16 matrix of the AVX2 table
    view.type = WeightType::BF16;
    view.rows = std::min(kAvx2Panel, w.rows - p0);
    view.cols = w.cols;
    view.ld = w.cols;
    view.nbytes = (size_t)w.cols * kAvx2Panel * 2;
    view.packed_by = w.packed_by;
    view.storage = std::shared_ptr<void>(std::shared_ptr<void>(), buf.data());  // not owned
    dense(x, m, ldx, view, y + p0, ldy, std::max(n0, p0) - p0, std::min(n1, p0 + kAvx2Panel) - p0);
  }
}

}  // namespace

void matmul_avx2(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                 int64_t n1, DenseMatmul dense) {
  n1 = std::min(n1, w.rows);
  if (n0 >= n1) return;
  if (m <= kRowExactRows) return gemv_rows(x, m, ldx, w, y, ldy, n0, n1);
  expand_panels(x, m, ldx, w, y, ldy, n0, n1, dense);
}

}  // namespace sparse
}  // namespace corelm
