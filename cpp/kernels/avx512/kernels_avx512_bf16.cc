// bf16-weight products through AVX512_BF16 VDPBF16PS: each instruction multiplies 16 pairs of bf16
// and adds both products to 16 fp32 lanes, twice the multiply-adds of an fp32 FMA. Activations are
// rounded to bf16 once per call (round to nearest even), so results equal an fp64 product of the
// bf16-rounded x and W up to fp32 accumulation. Used for m >= 2 only: m = 1 decode is memory bound,
// and keeps fp32 activations (kernels_avx512.cc). This file alone is built with -mavx512bf16.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "kernels/avx512/kernels_avx512_bf16.h"
#include "kernels/avx512/panel_gemm.h"

namespace corelm {
namespace avx512 {
namespace {

// Measured on Zen 5 against the panels below: the dot path (no panel fill) is 1.3-2.3x faster for 33..128
// rows of x, about equal at 256 and 512, and slower from 1024 (it reads all of x once per 8-row weight
// group, the panels once per 32 rows).
constexpr int64_t kDotRows = 256;
constexpr int64_t kDotChunks = 64;  // K blocks of at most 64 chunks: 8 rows x 2048 bf16 = 32 KiB, in L1

// x [m][K] fp32 -> [m][ld] bf16, zero beyond K, so the kernels read whole chunks with no tail masks.
// VCVTNEPS2BF16 rounds to nearest even like f32_to_bf16 (it also flushes denormals, which the dot
// product would treat as zero anyway).
const uint16_t* to_bf16_rows(const float* x, int64_t m, int64_t ldx, int64_t K, int64_t ld) {
  thread_local std::vector<uint16_t, AlignedAlloc<uint16_t>> buf;
  if ((int64_t)buf.size() < m * ld) buf.resize(m * ld);
  for (int64_t i = 0; i < m; i++) {
    const float* src = x + i * ldx;
    uint16_t* dst = buf.data() + i * ld;
    for (int64_t k = 0; k < ld; k += 16) {
      const __mmask16 mk = K - k >= 16 ? (__mmask16)0xffff : K > k ? (__mmask16)((1u << (K - k)) - 1u) : 0;
      __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mk, src + k));
      _mm256_store_si256((__m256i*)(dst + k), (__m256i)h);
    }
  }
  return buf.data();
}

inline __m512 dp(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

// MR rows of x (bf16, [MR][ld]) against chunks [c0, c1) of weight group g: per chunk, each of the 8 rows'
// 32 weights is one load that feeds MR dot products; the block is reused from L1 by the next MR rows.
// The first block of K stores its sums, later ones add to them.
// Strip `strip` of `nstrips` also asks L2 for its share of the next block's lines (the block right after
// this one in memory): the strips of a block take longer than streaming the next one from DRAM, and
// without this the first strip over each block waited for DRAM while the prefetchers caught up.
template <int MR>
void dot_rows(const uint16_t* xb, int64_t ld, const PackedMatrix& w, int64_t g, int64_t c0, int64_t c1, float* y,
              int64_t ldy, __mmask8 keep, int64_t strip, int64_t nstrips) {
  const int64_t nchunks = ld / kChunk;
  const uint16_t* p = static_cast<const uint16_t*>(w.data()) + (g * nchunks + c0) * kGroup * kChunk;
  const char* next = reinterpret_cast<const char*>(p + (c1 - c0) * kGroup * kChunk);  // prefetch never faults
  __m512 acc[MR][kGroup];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < kGroup; j++) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = c0; c < c1; c++) {
    for (int64_t r = strip % kGroup; r < kGroup; r += nstrips)  // one 64-byte line per weight row and chunk
      _mm_prefetch(next + ((c - c0) * kGroup + r) * 64, _MM_HINT_T1);
    __m512i xv[MR];
    for (int i = 0; i < MR; i++) xv[i] = _mm512_load_si512(xb + i * ld + c * kChunk);
    for (int j = 0; j < kGroup; j++, p += kChunk) {
      const __m512i wv = _mm512_load_si512(p);
      for (int i = 0; i < MR; i++) acc[i][j] = dp(acc[i][j], xv[i], wv);
    }
  }
  for (int i = 0; i < MR; i++) {
    float* out = y + i * ldy + g * kGroup;
    __m256 s = sum8(acc[i]);
    if (c0 > 0) s = _mm256_add_ps(s, _mm256_maskz_loadu_ps(keep, out));
    _mm256_mask_storeu_ps(out, keep, s);
  }
}

void dot_batch(const uint16_t* xb, int64_t m, int64_t ld, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
               int64_t n1) {
  // K in near-equal blocks of at most kDotChunks, so that a group's block stays in L1 while all m rows
  // pass over it (unblocked, K = 4864 ran at 0.6x the speed of K = 896)
  const int64_t nchunks = ld / kChunk, nblocks = (nchunks + kDotChunks - 1) / kDotChunks;
  const int64_t kc = (nchunks + nblocks - 1) / nblocks;
  for (int64_t g = n0 / kGroup; g * kGroup < n1; g++) {
    // rows of this group outside [n0, n1) belong to another thread
    const int64_t lo = std::max(n0 - g * kGroup, (int64_t)0), hi = std::min(n1 - g * kGroup, kGroup);
    const __mmask8 keep = (__mmask8)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
    for (int64_t c0 = 0; c0 < nchunks; c0 += kc) {
      const int64_t c1 = std::min(c0 + kc, nchunks);
      // strips of 2 rows: 16 accumulators (3 rows was no faster at K = 896, 4 spills registers)
      for_row_strips<2>(m, [&](auto rows, int64_t i) {
        dot_rows<decltype(rows)::value>(xb + i * ld, ld, w, g, c0, c1, y + i * ldy, ldy, keep, i / 2, (m + 1) / 2);
      });
    }
  }
}

// Prefill: panels of 32 weight rows in VNNI order, [ld/2][32] 32-bit words each holding the bf16 pair
// (k, k+1) of one row, gathered straight from the group layout. Per pair of k, two loads of the panel and
// one broadcast pair of each of MR activation rows feed 2 * MR VDPBF16PS, with no horizontal sums.
template <int MR>
void pair_tile(const uint32_t* xp, int64_t ldp, const uint32_t* panel, int64_t npairs, float* y, int64_t ldy,
               __mmask16 m0, __mmask16 m1) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < npairs; k++) {
    const __m512i w0 = _mm512_load_si512(panel + k * kPanel), w1 = _mm512_load_si512(panel + k * kPanel + 16);
    for (int i = 0; i < MR; i++) {
      const __m512i xv = _mm512_set1_epi32((int)xp[i * ldp + k]);
      acc[i][0] = dp(acc[i][0], xv, w0);
      acc[i][1] = dp(acc[i][1], xv, w1);
    }
  }
  for (int i = 0; i < MR; i++) {
    _mm512_mask_storeu_ps(y + i * ldy, m0, acc[i][0]);
    _mm512_mask_storeu_ps(y + i * ldy + 16, m1, acc[i][1]);
  }
}

void pair_gemm(const uint16_t* xb, int64_t m, int64_t ld, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
               int64_t n1) {
  const int64_t nchunks = ld / kChunk, npairs = ld / 2, group_words = nchunks * kGroup * kChunk / 2;
  const int64_t ngroups = (w.rows + kGroup - 1) / kGroup;
  // word of (row j of group g, pair p of chunk c) = g * group_words + c * 128 + j * 16 + p
  const __m512i idx = _mm512_add_epi32(
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                         _mm512_set1_epi32((int)group_words)),
      _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 0, 16, 32, 48, 64, 80, 96, 112));
  const uint32_t* words = static_cast<const uint32_t*>(w.data());
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xb);
  sweep_panels<uint32_t, 6>(
      m, npairs * kPanel, y, ldy, n0, n1,
      [&](int64_t p0, uint32_t* panel) {
        // two gathers of 16 words (groups g, g+1) per pair; groups past the matrix are not in memory: zero
        const int64_t g0 = p0 / kGroup;
        __mmask16 mask[2];
        for (int h = 0; h < 2; h++) {
          const int64_t valid = std::min(std::max(ngroups - (g0 + 2 * h), (int64_t)0), (int64_t)2);
          mask[h] = (__mmask16)((1u << (8 * valid)) - 1u);
        }
        for (int64_t c = 0; c < nchunks; c++)
          for (int64_t p = 0; p < kChunk / 2; p++) {
            uint32_t* dst = panel + (c * kChunk / 2 + p) * kPanel;
            for (int h = 0; h < 2; h++) {
              const uint32_t* src = words + (g0 + 2 * h) * group_words + c * kGroup * kChunk / 2 + p;
              __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask[h], idx, src, 4);
              _mm512_store_si512(dst + 16 * h, v);
            }
          }
      },
      [&](auto rows, int64_t i, const uint32_t* panel, float* yp, __mmask16 m0, __mmask16 m1) {
        pair_tile<decltype(rows)::value>(xp + i * (ld / 2), ld / 2, panel, npairs, yp, ldy, m0, m1);
      });
}

}  // namespace

void bf16dp_matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                   int64_t n1) {
  const uint16_t* xb = to_bf16_rows(x, m, ldx, w.cols, w.ld);
  if (m <= kDotRows)
    dot_batch(xb, m, w.ld, w, y, ldy, n0, n1);
  else
    pair_gemm(xb, m, w.ld, w, y, ldy, n0, n1);
}

}  // namespace avx512
}  // namespace corelm
