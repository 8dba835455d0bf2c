// AVX-512 kernels (F/BW/VL/DQ + FMA). This file alone is compiled with AVX-512 flags; dispatch.cc
// only hands out this table when CPUID and XCR0 say the CPU and OS support it.
#include <immintrin.h>

#include <cmath>

#include "kernels/kernels.h"

namespace corelm {
namespace {

inline __mmask16 tail_mask(int64_t n) { return (__mmask16)((1u << n) - 1u); }

// 16 weights as fp32: bf16 is the top half of an fp32, so widening is a zero-extend and a shift.
template <bool BF16>
inline __m512 load_w(const void* base, int64_t i) {
  if constexpr (BF16) {
    __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_loadu_ps((const float*)base + i);
  }
}
template <bool BF16>
inline __m512 load_w_masked(const void* base, int64_t i, __mmask16 m) {
  if constexpr (BF16) {
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t*)base + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_maskz_loadu_ps(m, (const float*)base + i);
  }
}

// y[i][j] = x[i] . w[j] for an MR x NR tile, dot-product form: both operands are K-contiguous, so
// the weights stream once from memory and each x vector is reused NR times from registers.
template <int MR, int NR, bool BF16>
inline void tile(const float* x, int64_t ldx, const void* w, int64_t ldw, int64_t K, float* y, int64_t ldy) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NR];
    for (int j = 0; j < NR; j++) wv[j] = load_w<BF16>(w, j * ldw + k);
    for (int i = 0; i < MR; i++) {
      __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {
    __mmask16 m = tail_mask(K - k);
    __m512 wv[NR];
    for (int j = 0; j < NR; j++) wv[j] = load_w_masked<BF16>(w, j * ldw + k, m);
    for (int i = 0; i < MR; i++) {
      __m512 xv = _mm512_maskz_loadu_ps(m, x + i * ldx + k);
      for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NR; j++) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int MR, bool BF16>
inline void rows_tile(const float* x, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                      int64_t n1) {
  const size_t esz = BF16 ? 2 : 4;
  const char* wb = static_cast<const char*>(w.data());
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4)
    tile<MR, 4, BF16>(x, ldx, wb + (size_t)n * w.row_stride * esz, w.row_stride, w.cols, y + n, ldy);
  for (; n < n1; n++)
    tile<MR, 1, BF16>(x, ldx, wb + (size_t)n * w.row_stride * esz, w.row_stride, w.cols, y + n, ldy);
}

template <bool BF16>
void matmul_t(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
              int64_t n1) {
  const size_t esz = BF16 ? 2 : 4;
  const char* wb = static_cast<const char*>(w.data());
  if (m == 1) {  // decode: bound by weight bandwidth; 8 rows in flight hide the FMA latency
    int64_t n = n0;
    for (; n + 8 <= n1; n += 8)
      tile<1, 8, BF16>(x, ldx, wb + (size_t)n * w.row_stride * esz, w.row_stride, w.cols, y + n, ldy);
    for (; n < n1; n++)
      tile<1, 1, BF16>(x, ldx, wb + (size_t)n * w.row_stride * esz, w.row_stride, w.cols, y + n, ldy);
    return;
  }
  // prefill: a block of weight rows stays in L1/L2 while every 4-row strip of x passes over it
  const int64_t NB = 16;
  for (int64_t nb = n0; nb < n1; nb += NB) {
    int64_t ne = nb + NB < n1 ? nb + NB : n1;
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) rows_tile<4, BF16>(x + i * ldx, ldx, w, y + i * ldy, ldy, nb, ne);
    switch (m - i) {
      case 3: rows_tile<3, BF16>(x + i * ldx, ldx, w, y + i * ldy, ldy, nb, ne); break;
      case 2: rows_tile<2, BF16>(x + i * ldx, ldx, w, y + i * ldy, ldy, nb, ne); break;
      case 1: rows_tile<1, BF16>(x + i * ldx, ldx, w, y + i * ldy, ldy, nb, ne); break;
      default: break;
    }
  }
}

void matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
            int64_t n1) {
  if (w.type == WeightType::BF16)
    matmul_t<true>(x, m, ldx, w, y, ldy, n0, n1);
  else
    matmul_t<false>(x, m, ldx, w, y, ldy, n0, n1);
}

float dot(const float* a, const float* b, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : tail_mask(n - i);
    acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

void axpy(float* y, float a, const float* x, int64_t n) {
  __m512 av = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : tail_mask(n - i);
    __m512 yv = _mm512_maskz_loadu_ps(m, y + i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x + i), yv));
  }
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
  for (int64_t k = 0; k < w.cols; k += 16) {
    __mmask16 m = w.cols - k >= 16 ? (__mmask16)0xffff : tail_mask(w.cols - k);
    __m512 v = w.type == WeightType::BF16 ? load_w_masked<true>(w.data(), row * w.row_stride + k, m)
                                          : load_w_masked<false>(w.data(), row * w.row_stride + k, m);
    _mm512_mask_storeu_ps(out + k, m, v);
  }
}

}  // namespace

const KernelTable kAvx512Kernels = {"avx512", matmul, rmsnorm, silu_mul, dot, axpy, softmax, row_to_f32};

}  // namespace corelm
