// Shared by kernels_avx512.cc, kernels_avx512_bf16.cc and sparse_avx512.cc: the AVX-512 fp32/bf16
// weight layout, its helpers and the AVX512_BF16 matmul. Include only from files built with AVX-512 flags.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "kernels/kernels.h"

namespace corelm {
namespace avx512 {

// Weight layout: groups of kGroup rows, each group stored chunk by chunk: [rows/8][K/32][8][32].
// Decode reads a group as one sequential stream (several separate row streams reach only ~70% of
// a core's bandwidth; one stream gets close to all of it). K is padded to 32 and rows to 8 with zeros.
constexpr int64_t kGroup = 8, kChunk = 32;

namespace {  // each file's own copy, built with its flags (see kernels/kernel_util.h)

// x as the bf16 GEMVs take it: a row's 32 bf16 weights of a chunk are one 64-byte load whose even
// elements widen with a shift and odd ones with a mask (no shuffles), so each chunk of x is split
// once into its even and odd elements, masked past K (x beyond it is not ours to read).
struct EvenOddX {
  int64_t full;  // chunks with all 32 columns
  __mmask16 m_lo, m_hi;
  __m512i even, odd;
  explicit EvenOddX(int64_t K)
      : full(K / kChunk),
        m_lo(K % kChunk >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K % 16)) - 1u)),
        m_hi(K % kChunk > 16 ? (__mmask16)((1u << (K % kChunk - 16)) - 1u) : (__mmask16)0),
        even(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)),
        odd(_mm512_add_epi32(even, _mm512_set1_epi32(1))) {}
  // Chunk c of the row at x: its even elements in xe, odd in xo.
  void split(const float* x, int64_t c, __m512& xe, __m512& xo) const {
    const __m512 x0 = c < full ? _mm512_loadu_ps(x + c * kChunk) : _mm512_maskz_loadu_ps(m_lo, x + c * kChunk);
    const __m512 x1 = c < full ? _mm512_loadu_ps(x + c * kChunk + 16) : _mm512_maskz_loadu_ps(m_hi, x + c * kChunk + 16);
    xe = _mm512_permutex2var_ps(x0, even, x1), xo = _mm512_permutex2var_ps(x0, odd, x1);
  }
};
// 32 bf16 weights (one 64-byte vector) as fp32: the even elements, then the odd ones.
inline __m512 widen_even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 widen_odd(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))); }

// The 16-lane sums of 8 accumulators as 8 floats, by three rounds of shuffles and adds (instead of 8
// separate reductions): halves of 256 bits, then 128-bit lanes, then within lanes. Each sum adds the
// same pairs in the same order as _mm512_reduce_add_ps, so it has the same bits.
inline __m256 sum8(const __m512 a[8]) {
  __m512 t[4];
  for (int p = 0; p < 4; p++)  // lanes [a.0+a.2, a.1+a.3, b.0+b.2, b.1+b.3] for a = a[2p], b = a[2p+1]
    t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xee));
  // lane l of u holds 4 partial sums of a[0], a[1], a[4], a[5]; of v: a[2], a[3], a[6], a[7]
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[2], 0x88), _mm512_shuffle_f32x4(t[0], t[2], 0xdd));
  __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(t[1], t[3], 0x88), _mm512_shuffle_f32x4(t[1], t[3], 0xdd));
  __m512 s = _mm512_add_ps(_mm512_unpacklo_ps(u, v), _mm512_unpackhi_ps(u, v));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4e));  // lane l: [u total, v total, u total, v total]
  const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 8, 12, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, s));
}

}  // namespace

// y = x W^T for bf16 weights and m >= 2 rows of x, rows [n0, n1) of W, through VDPBF16PS on activations
// rounded to bf16 (round to nearest even). Needs AVX512_BF16 (kernels_avx512_bf16.cc alone is built with it).
void bf16dp_matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy,
                   int64_t n0, int64_t n1);

}  // namespace avx512
}  // namespace corelm
