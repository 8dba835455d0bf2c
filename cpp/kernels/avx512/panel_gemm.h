// Prefill through fp32 panels, shared by every AVX-512 weight format: a format's fill() writes a
// panel of 32 weight rows as fp32, transposed to [K][32] (rows past the matrix zero), then
// outer-product register tiles sweep it: per k, two vector loads of the panel and one broadcast of
// each of MR activations feed 2*MR FMAs, with no horizontal sums. The panel stays in L2 while every
// strip of MR activation rows passes over it. Include only from files built with AVX-512 flags.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <type_traits>
#include <vector>

#include "kernels/kernel_util.h"

namespace corelm {
namespace avx512 {

using corelm::AlignedAlloc;

constexpr int64_t kPanel = 32;

template <int MR>
inline void outer_tile(const float* x, int64_t ldx, const float* panel, int64_t K, float* y, int64_t ldy,
                       __mmask16 m0, __mmask16 m1) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    __m512 w0 = _mm512_load_ps(panel + k * kPanel), w1 = _mm512_load_ps(panel + k * kPanel + 16);
    for (int i = 0; i < MR; i++) {
      __m512 xv = _mm512_set1_ps(x[i * ldx + k]);
      acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; i++) {
    _mm512_mask_storeu_ps(y + i * ldy, m0, acc[i][0]);
    _mm512_mask_storeu_ps(y + i * ldy + 16, m1, acc[i][1]);
  }
}

template <int R>
using Rows = std::integral_constant<int, R>;

template <int R, class Tile>
inline void tail_strip(int64_t r, int64_t i, Tile& tile) {
  if constexpr (R > 0) {
    if (r == R) tile(Rows<R>{}, i);
    else tail_strip<R - 1>(r, i, tile);
  }
}

// Strips of MR rows of x: tile(Rows<MR>{}, i) for i = 0, MR, 2 MR, ..., then once for the last m % MR rows.
template <int MR, class Tile>
inline void for_row_strips(int64_t m, Tile tile) {
  int64_t i = 0;
  for (; i + MR <= m; i += MR) tile(Rows<MR>{}, i);
  tail_strip<MR - 1>(m - i, i, tile);
}

// Panels of 32 weight rows over [n0, n1), starting at the 8-row group that holds n0, each of
// panel_elems elements of T: fill(p0, panel) writes rows [p0, p0 + 32); tile(Rows<R>{}, i, panel, yp,
// m0, m1) computes rows i..i+R-1 of x into yp (= y + i * ldy + p0), storing columns selected by m0, m1.
template <class T, int MR, class Fill, class Tile>
void sweep_panels(int64_t m, int64_t panel_elems, float* y, int64_t ldy, int64_t n0, int64_t n1, Fill fill,
                  Tile tile) {
  thread_local std::vector<T, AlignedAlloc<T>> panel;
  if ((int64_t)panel.size() < panel_elems) panel.resize(panel_elems);
  for (int64_t p0 = n0 / 8 * 8; p0 < n1; p0 += kPanel) {
    fill(p0, panel.data());
    // this thread's rows of the panel: [r0, r1) relative to p0 are stored, the rest are not
    const int64_t r0 = std::max(p0, n0) - p0, r1 = std::min(p0 + kPanel, n1) - p0;
    const uint32_t keep = (uint32_t)(((uint64_t)1 << r1) - 1) & ~(uint32_t)(((uint64_t)1 << r0) - 1);
    const __mmask16 m0 = (__mmask16)(keep & 0xffff), m1 = (__mmask16)(keep >> 16);
    for_row_strips<MR>(m, [&](auto rows, int64_t i) { tile(rows, i, panel.data(), y + i * ldy + p0, m0, m1); });
  }
}

// y[i][n] for i < m, n in [n0, n1) through fp32 panels.
// fill(p0, panel) writes rows [p0, p0 + 32) as panel[k * 32 + r] for k < ld (ld = K rounded up to 32).
template <class Fill>
void panel_gemm(const float* x, int64_t m, int64_t ldx, int64_t K, int64_t ld, float* y, int64_t ldy, int64_t n0,
                int64_t n1, Fill fill) {
  sweep_panels<float, 6>(m, kPanel * ld, y, ldy, n0, n1, fill,
                         [&](auto rows, int64_t i, const float* panel, float* yp, __mmask16 m0, __mmask16 m1) {
                           outer_tile<decltype(rows)::value>(x + i * ldx, ldx, panel, K, yp, ldy, m0, m1);
                         });
}

}  // namespace avx512
}  // namespace corelm
