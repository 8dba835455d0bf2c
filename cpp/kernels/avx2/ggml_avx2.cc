// AVX2 matmul of Q2_K and Q3_K straight from their GGUF blocks (ggml_formats.h), the block types with
// no grouped layout yet (ggml_grouped.h repacks the others); the AVX-512 tables use it too. Per 32
// weights of a row, the chunk is decoded in registers into 32 signed int8 values, then multiplied by
// each activation row: int8 activations by VPMADDUBSW(|v|, sign(x, v)) + VPMADDWD, int16 by VPMADDWD
// against v widened. Each super-block's 8 chunks' half sums are reduced into 8 lanes at once and added
// with one FMA per half (d * s * dx), Q2_K's minimums with one more. Prefill decodes each chunk once for
// kMR activation rows. A (row, activation row) result is the same whatever the tile shape, so decode
// and prefill give the same bits.
#include <immintrin.h>

#include <algorithm>

#include "kernels/ggml_formats.h"

namespace corelm {
namespace quant {
namespace {

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline __m256i shr(__m256i x, int n) { return _mm256_srl_epi16(x, _mm_cvtsi32_si128(n)); }
inline __m256i low_bits(__m256i x, int n, int mask) { return _mm256_and_si256(shr(x, n), _mm256_set1_epi8((char)mask)); }

// Chunk c of the block at blk as 32 signed int8 values in element order (decode_chunk's v).
template <WeightType T>
inline __m256i decode_values(const uint8_t* blk, int c) {
  const int h = c / 4, q = c % 4;  // chunk c is quarter q of half h of the super-block
  if constexpr (T == WeightType::Q3_K) {
    const __m256i lo = low_bits(load32(blk + 32 + 32 * h), 2 * q, 3), hb = low_bits(load32(blk), c, 1);
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hb, 2)), _mm256_set1_epi8(4));
  }
  return low_bits(load32(blk + 16 + 32 * h), 2 * q, 3);  // Q2_K
}

struct Act {
  const void* q;
  const float* dx;
  const int32_t *sx, *sx32;  // per 16 and per 32 columns
  int64_t ld;
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline __m256 bytes_times(__m128i b8, float d, bool is_signed) {  // 8 bytes (low half of b8) as floats, times d
  const __m256i w = is_signed ? _mm256_cvtepi8_epi32(b8) : _mm256_cvtepu8_epi32(b8);
  return _mm256_mul_ps(_mm256_cvtepi32_ps(w), _mm256_set1_ps(d));
}
inline __m128i even_odd(__m128i b16) {  // bytes 0,2,..,14 then 1,3,..,15
  return _mm_shuffle_epi8(b16, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
}

// The scales of a super-block's 8 chunks (chunk c in lane c), as decode_scales gives them: ds0/ds1 =
// d * s of each chunk's first/second half, and for Q2_K dm0/dm1 = dmin * mn the same way.
template <WeightType T>
inline void group_scales(const uint8_t* blk, __m256* ds0, __m256* ds1, __m256* dm0, __m256* dm1) {
  if constexpr (T == WeightType::Q3_K) {
    const uint32_t a0 = u32_at(blk + 96), a1 = u32_at(blk + 100), t = u32_at(blk + 104), lo = 0x0f0f0f0fu, hi = 0x03030303u;
    const __m128i s = _mm_sub_epi8(
        _mm_setr_epi32((int)((a0 & lo) | ((t & hi) << 4)), (int)((a1 & lo) | (((t >> 2) & hi) << 4)),
                       (int)(((a0 >> 4) & lo) | (((t >> 4) & hi) << 4)), (int)(((a1 >> 4) & lo) | (((t >> 6) & hi) << 4))),
        _mm_set1_epi8(32));
    const __m128i eo = even_odd(s);
    const float d = f16_at(blk + 108);
    *ds0 = bytes_times(eo, d, true), *ds1 = bytes_times(_mm_srli_si128(eo, 8), d, true);
  } else {  // Q2_K
    const __m128i eo = even_odd(_mm_loadu_si128((const __m128i*)blk)), m4 = _mm_set1_epi8(0x0f);
    const __m128i s = _mm_and_si128(eo, m4), mn = _mm_and_si128(_mm_srli_epi16(eo, 4), m4);
    const float d = f16_at(blk + 80), dmin = f16_at(blk + 82);
    *ds0 = bytes_times(s, d, false), *ds1 = bytes_times(_mm_srli_si128(s, 8), d, false);
    *dm0 = bytes_times(mn, dmin, false), *dm1 = bytes_times(_mm_srli_si128(mn, 8), dmin, false);
  }
}

// P[c] (8 int32 lanes per chunk: lanes 0..3 sums over the chunk's first half, 4..7 its second) for the
// 8 chunks of a group -> the chunks' half sums, chunk c in lane c: h0 (first halves) and h1.
inline void reduce_group(const __m256i P[8], __m256i* h0, __m256i* h1) {
  const __m256i t0 = _mm256_hadd_epi32(P[0], P[1]), t1 = _mm256_hadd_epi32(P[2], P[3]);
  const __m256i t2 = _mm256_hadd_epi32(P[4], P[5]), t3 = _mm256_hadd_epi32(P[6], P[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  *h0 = _mm256_permute2x128_si256(u0, u1, 0x20);
  *h1 = _mm256_permute2x128_si256(u0, u1, 0x31);
}

// Rows n0..n0+NR-1 of w against activation rows i0..i0+MR-1: y[i][n] for each. Per group of 8 chunks
// each (row, activation row) gets its chunks' integer sums in 8 lanes, then one FMA with the 8 chunks'
// d * s * dx (and, with minimums, one for dm * mn * dx * sum(xq)).
template <WeightType T, class Q, int NR, int MR>
void tile(const Act& a, const PackedMatrix& w, int64_t n0, int64_t i0, float* y, int64_t ldy) {
  constexpr bool kMins = T == WeightType::Q2_K;  // both types have half scales
  const size_t bb = ggml_type_block_bytes(T), rb = ggml_row_bytes(T, w.cols);
  const int64_t nb = w.cols / 32;
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; r++) rows[r] = static_cast<const uint8_t*>(w.data()) + (n0 + r) * rb;
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; i++)
    for (int r = 0; r < NR; r++) acc[i][r] = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < nb; c0 += 8) {  // super-block by super-block
    const size_t g_at = (c0 / 8) * bb;
    __m256 ds0[NR], ds1[NR], dm0[NR], dm1[NR];
    for (int r = 0; r < NR; r++) group_scales<T>(rows[r] + g_at, &ds0[r], &ds1[r], &dm0[r], &dm1[r]);
    __m256i P[MR][NR][8];
    for (int c = 0; c < 8; c++) {
      __m256i v[NR];
      for (int r = 0; r < NR; r++) v[r] = decode_values<T>(rows[r] + g_at, c);
      if constexpr (sizeof(Q) == 1) {
        __m256i av[NR];
        for (int r = 0; r < NR; r++) av[r] = _mm256_sign_epi8(v[r], v[r]);
        for (int i = 0; i < MR; i++) {
          const __m256i x = load32(static_cast<const uint8_t*>(a.q) + (i0 + i) * a.ld + 32 * (c0 + c));
          for (int r = 0; r < NR; r++)
            P[i][r][c] = _mm256_madd_epi16(_mm256_maddubs_epi16(av[r], _mm256_sign_epi8(x, v[r])), _mm256_set1_epi16(1));
        }
      } else {
        __m256i vlo[NR], vhi[NR];
        for (int r = 0; r < NR; r++) {
          vlo[r] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v[r]));
          vhi[r] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v[r], 1));
        }
        for (int i = 0; i < MR; i++) {
          const int16_t* xq = static_cast<const int16_t*>(a.q) + (i0 + i) * a.ld + 32 * (c0 + c);
          const __m256i xlo = _mm256_loadu_si256((const __m256i*)xq), xhi = _mm256_loadu_si256((const __m256i*)(xq + 16));
          for (int r = 0; r < NR; r++) {
            const __m256i p0 = _mm256_madd_epi16(vlo[r], xlo), p1 = _mm256_madd_epi16(vhi[r], xhi);
            P[i][r][c] = _mm256_add_epi32(_mm256_permute2x128_si256(p0, p1, 0x20), _mm256_permute2x128_si256(p0, p1, 0x31));
          }
        }
      }
    }
    for (int i = 0; i < MR; i++) {
      const int64_t ib = (i0 + i) * nb + c0;
      const __m256 dx = _mm256_loadu_ps(a.dx + ib);
      __m256 sx0, sx1;
      if constexpr (kMins) {  // sums per half: sx[2c + h], chunk c in lane c
        const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        const __m256i A = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i*)(a.sx + 2 * ib)), order);
        const __m256i B = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i*)(a.sx + 2 * ib + 8)), order);
        sx0 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(A, B, 0x20));
        sx1 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(A, B, 0x31));
      }
      for (int r = 0; r < NR; r++) {
        __m256i h0, h1;
        reduce_group(P[i][r], &h0, &h1);
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h0), _mm256_mul_ps(ds0[r], dx), acc[i][r]);
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h1), _mm256_mul_ps(ds1[r], dx), acc[i][r]);
        if constexpr (kMins) {
          acc[i][r] = _mm256_fnmadd_ps(_mm256_mul_ps(dm0[r], dx), sx0, acc[i][r]);
          acc[i][r] = _mm256_fnmadd_ps(_mm256_mul_ps(dm1[r], dx), sx1, acc[i][r]);
        }
      }
    }
  }
  for (int i = 0; i < MR; i++)
    for (int r = 0; r < NR; r++) y[(i0 + i) * ldy + n0 + r] = hsum(acc[i][r]);
}

constexpr int kNR = 2, kMR = 4;
constexpr size_t kChunkBytes = 256 << 10;  // rows per prefill pass: about this many weight bytes (L2)

template <WeightType T, class Q, int MR>
void rows_tile(const Act& a, const PackedMatrix& w, int64_t n0, int64_t n1, int64_t i0, float* y, int64_t ldy) {
  int64_t n = n0;
  for (; n + kNR <= n1; n += kNR) tile<T, Q, kNR, MR>(a, w, n, i0, y, ldy);
  for (; n < n1; n++) tile<T, Q, 1, MR>(a, w, n, i0, y, ldy);
}

template <WeightType T, class Q>
void matmul_t(const Act& a, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if (m == 1) {  // decode: two rows at a time, one stream each
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) tile<T, Q, 2, 1>(a, w, n, 0, y, ldy);
    for (; n < n1; n++) tile<T, Q, 1, 1>(a, w, n, 0, y, ldy);
    return;
  }
  const int64_t step = std::max<int64_t>(kNR, (int64_t)(kChunkBytes / ggml_row_bytes(T, w.cols)) / kNR * kNR);
  for (int64_t c0 = n0; c0 < n1; c0 += step) {
    const int64_t c1 = std::min(n1, c0 + step);
    int64_t i = 0;
    for (; i + kMR <= m; i += kMR) rows_tile<T, Q, kMR>(a, w, c0, c1, i, y, ldy);
    for (; i < m; i++) rows_tile<T, Q, 1>(a, w, c0, c1, i, y, ldy);
  }
}

template <class Q>
void matmul_q(const Act& a, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  switch (w.type) {
    case WeightType::Q2_K: return matmul_t<WeightType::Q2_K, Q>(a, m, w, y, ldy, n0, n1);
    case WeightType::Q3_K: return matmul_t<WeightType::Q3_K, Q>(a, m, w, y, ldy, n0, n1);
    default: return;  // the others are grouped (ggml_grouped.h)
  }
}

}  // namespace

void ggml_matmul_quant_avx2(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                            int64_t n0, int64_t n1) {
  n1 = std::min(n1, w.rows);
  const size_t e = act_elem_bytes(act);
  const float* dx = reinterpret_cast<const float*>(static_cast<const uint8_t*>(qa) + m * w.ld * e);
  const int32_t* sx = reinterpret_cast<const int32_t*>(dx + m * (w.ld / 32));
  const Act a{qa, dx, sx, sx + m * (w.ld / 16), w.ld};
  if (act == ActType::I16) return matmul_q<int16_t>(a, m, w, y, ldy, n0, n1);
  matmul_q<int8_t>(a, m, w, y, ldy, n0, n1);
}

}  // namespace quant
}  // namespace corelm
