// AVX2 matmul straight from GGUF blocks (Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS; ggml_formats.h).
// The AVX-512 tables use it too. Per 32 weights of a row, the chunk is decoded in registers into 32
// signed int8 values (nibbles, high bits and the IQ4 table by byte shuffles), then multiplied by each
// activation row: int8 activations by VPMADDUBSW(|v|, sign(x, v)) + VPMADDWD, int16 by VPMADDWD
// against v widened; the int32 lanes times (d * s[half] * dx) are added to one fp32 vector per (row,
// activation row), and the minimums' dm * mn[half] * dx * sx to a scalar. Prefill decodes each chunk
// once for kMR activation rows. A (row, activation row) result is the same whatever the tile shape,
// so decode and prefill give the same bits.
#include <immintrin.h>

#include <algorithm>

#include "kernels/ggml_formats.h"

namespace corelm {
namespace quant {
namespace {

inline __m256i nibbles16(const uint8_t* p) {  // 16 bytes: low nibbles = elements 0..15, high = 16..31
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0f));
}
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline __m256i shr(__m256i x, int n) { return _mm256_srl_epi16(x, _mm_cvtsi32_si128(n)); }
inline __m256i low_bits(__m256i x, int n, int mask) { return _mm256_and_si256(shr(x, n), _mm256_set1_epi8((char)mask)); }

// Byte k = 0xff where bit k of the 32-bit word at p is set, else 0.
inline __m256i bits_to_bytes(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)w),
                                             _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                                0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// Chunk c of the block at blk as 32 signed int8 values in element order (decode_chunk's v).
template <WeightType T>
inline __m256i decode_values(const uint8_t* blk, int c) {
  const int h = c / 4, q = c % 4;
  if constexpr (T == WeightType::Q5_0)  // code - 16: a clear high bit makes the nibble negative
    return _mm256_or_si256(nibbles16(blk + 6), _mm256_andnot_si256(bits_to_bytes(blk + 2), _mm256_set1_epi8((char)0xf0)));
  if constexpr (T == WeightType::Q5_1)
    return _mm256_or_si256(nibbles16(blk + 8), _mm256_and_si256(bits_to_bytes(blk + 4), _mm256_set1_epi8(0x10)));
  if constexpr (T == WeightType::IQ4_NL || T == WeightType::IQ4_XS) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kIq4Values));
    return _mm256_shuffle_epi8(table, nibbles16(T == WeightType::IQ4_NL ? blk + 2 : blk + 8 + 16 * c));
  }
  if constexpr (T == WeightType::Q4_K) return low_bits(load32(blk + 16 + 32 * (c / 2)), 4 * (c % 2), 0x0f);
  if constexpr (T == WeightType::Q5_K)
    return _mm256_or_si256(low_bits(load32(blk + 48 + 32 * (c / 2)), 4 * (c % 2), 0x0f),
                           _mm256_slli_epi16(low_bits(load32(blk + 16), c, 1), 4));
  if constexpr (T == WeightType::Q6_K) {
    const __m256i lo = low_bits(load32(blk + 64 * h + 32 * (q % 2)), 4 * (q / 2), 0x0f);
    const __m256i hi = low_bits(load32(blk + 128 + 32 * h), 2 * q, 3);
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
  }
  if constexpr (T == WeightType::Q3_K) {
    const __m256i lo = low_bits(load32(blk + 32 + 32 * h), 2 * q, 3), hb = low_bits(load32(blk), c, 1);
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hb, 2)), _mm256_set1_epi8(4));
  }
  return low_bits(load32(blk + 16 + 32 * h), 2 * q, 3);  // Q2_K
}

struct Act {
  const void* q;
  const float* dx;
  const int32_t* sx;
  int64_t ld;
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Rows n0..n0+NR-1 of w against activation rows i0..i0+MR-1: y[i][n] for each.
template <WeightType T, class Q, int NR, int MR>
void tile(const Act& a, const PackedMatrix& w, int64_t n0, int64_t i0, float* y, int64_t ldy) {
  constexpr int64_t kElems = T == WeightType::Q5_0 || T == WeightType::Q5_1 || T == WeightType::IQ4_NL ? 32 : 256;
  constexpr int kChunks = kElems / 32;
  const size_t bb = ggml_type_block_bytes(T), rb = ggml_row_bytes(T, w.cols);
  const int64_t nb = w.cols / 32;
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; r++) rows[r] = static_cast<const uint8_t*>(w.data()) + (n0 + r) * rb;
  __m256 acc[MR][NR];
  float macc[MR][NR];
  for (int i = 0; i < MR; i++)
    for (int r = 0; r < NR; r++) acc[i][r] = _mm256_setzero_ps(), macc[i][r] = 0.f;
  const bool halves = has_half_scales(T), mins = has_minimums(T);
  for (int64_t c = 0; c < nb; c++) {
    const int cc = (int)(c % kChunks);
    __m256i v[NR];
    Chunk sc[NR];
    for (int r = 0; r < NR; r++) {
      const uint8_t* blk = rows[r] + (c / kChunks) * bb;
      v[r] = decode_values<T>(blk, cc);
      decode_scales(T, blk, cc, &sc[r]);
    }
    if constexpr (sizeof(Q) == 1) {
      __m256 ds[NR];  // d * s per lane: lanes 0..3 are the first half
      __m256i av[NR];
      for (int r = 0; r < NR; r++) {
        ds[r] = _mm256_set_m128(_mm_set1_ps(sc[r].d * (float)sc[r].s[1]), _mm_set1_ps(sc[r].d * (float)sc[r].s[0]));
        av[r] = _mm256_sign_epi8(v[r], v[r]);
      }
      for (int i = 0; i < MR; i++) {
        const int64_t ib = (i0 + i) * nb + c;
        const __m256i x = load32(static_cast<const uint8_t*>(a.q) + (i0 + i) * a.ld + 32 * c);
        const __m256 dx = _mm256_set1_ps(a.dx[ib]);
        for (int r = 0; r < NR; r++) {
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(av[r], _mm256_sign_epi8(x, v[r])), _mm256_set1_epi16(1));
          acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(ds[r], dx), acc[i][r]);
        }
      }
    } else {
      __m256i vlo[NR], vhi[NR];
      for (int r = 0; r < NR; r++) {
        vlo[r] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v[r]));
        vhi[r] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v[r], 1));
      }
      for (int i = 0; i < MR; i++) {
        const int64_t ib = (i0 + i) * nb + c;
        const int16_t* xq = static_cast<const int16_t*>(a.q) + (i0 + i) * a.ld + 32 * c;
        const __m256i xlo = _mm256_loadu_si256((const __m256i*)xq), xhi = _mm256_loadu_si256((const __m256i*)(xq + 16));
        const float dx = a.dx[ib];
        for (int r = 0; r < NR; r++) {
          const __m256i p0 = _mm256_madd_epi16(vlo[r], xlo), p1 = _mm256_madd_epi16(vhi[r], xhi);
          if (halves) {
            acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(sc[r].d * (float)sc[r].s[0] * dx), acc[i][r]);
            acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(sc[r].d * (float)sc[r].s[1] * dx), acc[i][r]);
          } else {
            acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)),
                                        _mm256_set1_ps(sc[r].d * (float)sc[r].s[0] * dx), acc[i][r]);
          }
        }
      }
    }
    if (mins)
      for (int i = 0; i < MR; i++) {
        const int64_t ib = (i0 + i) * nb + c;
        const float dx = a.dx[ib];
        const int32_t s0 = a.sx[2 * ib], s1 = a.sx[2 * ib + 1];
        for (int r = 0; r < NR; r++)
          macc[i][r] += sc[r].dm * dx * (float)(sc[r].mn[0] * s0 + sc[r].mn[1] * s1);
      }
  }
  for (int i = 0; i < MR; i++)
    for (int r = 0; r < NR; r++) y[(i0 + i) * ldy + n0 + r] = hsum(acc[i][r]) - macc[i][r];
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
  if (m == 1) {  // decode: four rows at a time, one stream each
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) tile<T, Q, 4, 1>(a, w, n, 0, y, ldy);
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
#define CORELM_CASE(T) \
  case WeightType::T: return matmul_t<WeightType::T, Q>(a, m, w, y, ldy, n0, n1);
    CORELM_CASE(Q5_0)
    CORELM_CASE(Q5_1)
    CORELM_CASE(Q2_K)
    CORELM_CASE(Q3_K)
    CORELM_CASE(Q4_K)
    CORELM_CASE(Q5_K)
    CORELM_CASE(Q6_K)
    CORELM_CASE(IQ4_NL)
    CORELM_CASE(IQ4_XS)
#undef CORELM_CASE
    default:
      return;
  }
}

}  // namespace

void ggml_matmul_quant_avx2(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                            int64_t n0, int64_t n1) {
  n1 = std::min(n1, w.rows);
  const size_t e = act_elem_bytes(act);
  const float* dx = reinterpret_cast<const float*>(static_cast<const uint8_t*>(qa) + m * w.ld * e);
  const Act a{qa, dx, reinterpret_cast<const int32_t*>(dx + m * (w.ld / 32)), w.ld};
  if (act == ActType::I16) return matmul_q<int16_t>(a, m, w, y, ldy, n0, n1);
  matmul_q<int8_t>(a, m, w, y, ldy, n0, n1);
}

}  // namespace quant
}  // namespace corelm
