// AVX2 matmul of the GGUF block types in the grouped layout (ggml_grouped.h), as the AVX-512 one
// (avx512/ggml_grouped_avx512.cc) with 256-bit vectors: a piece's 32 code bytes (8 rows x 4 columns)
// are decoded in the byte domain (nibbles, high bits, the IQ4 table by VPSHUFB), widened to int16 in
// two halves (rows 0-3, rows 4-7) and multiplied by a broadcast of the 4 activations with VPMADDWD,
// so each row keeps its own pair of lanes. Per chunk and 8 rows one FMA adds cvt(sum) * (d*s) * dx,
// and with minimums one more takes (dm * mn) * dx * sum(xq) off. A (row, token) gets the same
// operations in decode and prefill.
#include <immintrin.h>

#include <algorithm>

#include "kernels/ggml_grouped.h"
#include "kernels/kernel_util.h"

namespace corelm {
namespace quant {
namespace {

// Piece p's high bits from its plane bytes moved to bit 4 (and 5) of each byte, ORed into w. 16-bit
// shifts are enough: the mask keeps only bits that came from the same byte.
template <WeightType T>
inline __m256i add_high(__m256i w, __m256i plane, int p) {
  const __m256i mask = _mm256_set1_epi8(Tr<T>::hi == 1 ? 0x10 : 0x30);
  const int at = Tr<T>::hi == 1 ? p : 2 * (p % 4);
  const __m256i moved = at <= 4 ? _mm256_slli_epi16(plane, 4 - at) : _mm256_srli_epi16(plane, at - 4);
  return _mm256_or_si256(w, _mm256_and_si256(moved, mask));
}

// Calls piece(p, w) for the 8 pieces of chunk c of super-block sb for NG groups: w[g][0] rows 0-3 and
// w[g][1] rows 4-7 of the piece, as int16.
template <WeightType T, int NG, class Piece>
inline void for_pieces(const GroupedView& v, int64_t sb, int c, Piece piece) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kIq4Values));
  const uint8_t* qs = v.qs(sb, c);
  const uint8_t* hp = v.hi(sb, c);
  __m256i plane[NG];
  if constexpr (Tr<T>::hi == 1)
    for (int g = 0; g < NG; g++) plane[g] = _mm256_loadu_si256((const __m256i*)(hp + g * 32));
  for (int uh = 0; uh < 4; uh++) {  // 32 bytes at 32 * uh: pieces 4u + h (low nibbles), 4u + 2 + h (high)
    const int u = uh >> 1, h = uh & 1;
    __m256i lo[NG][2], hi[NG][2];
    for (int g = 0; g < NG; g++) {
      const __m256i b = _mm256_loadu_si256((const __m256i*)(qs + g * 128 + 32 * uh));
      __m256i l = _mm256_and_si256(b, m4), e = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
      if constexpr (Tr<T>::hi == 2) plane[g] = _mm256_loadu_si256((const __m256i*)(hp + g * 64 + 32 * u));
      if constexpr (Tr<T>::hi > 0) {
        l = add_high<T>(l, plane[g], 4 * u + h);
        e = add_high<T>(e, plane[g], 4 * u + 2 + h);
      }
      if constexpr (Tr<T>::table) {
        l = _mm256_shuffle_epi8(table, l);
        e = _mm256_shuffle_epi8(table, e);
      }
      lo[g][0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(l)), lo[g][1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(l, 1));
      hi[g][0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(e)), hi[g][1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(e, 1));
    }
    piece(4 * u + h, lo);
    piece(4 * u + 2 + h, hi);
  }
}

inline __m256 rows8(__m256i r03, __m256i r47) {  // pairs of lanes summed -> 8 floats, row j in lane j
  return _mm256_cvtepi32_ps(_mm256_permute4x64_epi64(_mm256_hadd_epi32(r03, r47), 0xd8));
}
inline __m256 s8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline __m256 u8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline __m256 f16x8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256i bcast8(const int16_t* p) {
  long long v;
  std::memcpy(&v, p, 8);
  return _mm256_set1_epi64x(v);
}

// As the AVX-512 kernel: the super-block about 8 KiB ahead, a chunk's share of its lines per chunk.
constexpr int64_t kPrefetchBytes = 8192;
const bool kPrefetch = decode_prefetch(true);

// MR activation rows (from i0) x NG groups over the whole row: out[i][g].
template <WeightType T, int MR, int NG>
void tile(const GroupedAct& a, int64_t i0, const GroupedView& v, int64_t nsb, __m256 out[MR][NG]) {
  using R = Tr<T>;
  constexpr int H = R::halves ? 2 : 1;  // integer sums per (row, group): per half with half scales
  __m256 acc[MR][NG];
  for (int i = 0; i < MR; i++)
    for (int g = 0; g < NG; g++) acc[i][g] = _mm256_setzero_ps();
  const int64_t pf_lines = (v.sb_bytes + 63) / 64, pf_per_chunk = (pf_lines + R::chunks - 1) / R::chunks;
  const int64_t pf_ahead = std::max<int64_t>(1, (kPrefetchBytes + v.sb_bytes / 2) / v.sb_bytes);
  for (int64_t sb = 0; sb < nsb; sb++) {
    for (int c = 0; c < R::chunks; c++) {
      if (kPrefetch) {
        const char* ahead = reinterpret_cast<const char*>(v.base) + (sb + pf_ahead) * v.sb_bytes;
        for (int64_t l = c * pf_per_chunk; l < std::min(pf_lines, (c + 1) * pf_per_chunk); l++)
          _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
      }
      const int64_t b = sb * R::chunks + c;
      __m256i s[MR][NG][H][2];  // [.][.][half][rows 0-3, rows 4-7]
      for (int i = 0; i < MR; i++) {
        const int64_t ib = (i0 + i) * a.nb + b;
        for (int g = 0; g < NG; g++)
          for (int k = 0; k < H; k++) {  // the code offset: -offset * sum(xq), half of it in each lane of a pair
            const int32_t corr = -R::offset / 2 * (R::halves ? a.sx[2 * ib + k] : a.sx32[ib]);
            s[i][g][k][0] = s[i][g][k][1] = _mm256_set1_epi32(corr);
          }
      }
      for_pieces<T, NG>(v, sb, c, [&](int p, const __m256i (*w)[2]) {
        const int k = R::halves ? p / 4 : 0;
        for (int i = 0; i < MR; i++) {
          const __m256i x = bcast8(a.q + (i0 + i) * a.ld + 32 * b + 4 * p);
          for (int g = 0; g < NG; g++)
            for (int r = 0; r < 2; r++) s[i][g][k][r] = _mm256_add_epi32(s[i][g][k][r], _mm256_madd_epi16(w[g][r], x));
        }
      });
      for (int g = 0; g < NG; g++) {
        const __m256 D = f16x8(v.D(sb) + 8 * g);
        __m256 ds[2] = {D, D};
        if constexpr (R::scales) {
          const int8_t* S = v.S(sb, R::halves ? 2 * c : c) + g * 8 * R::nsc;
          for (int k = 0; k < H; k++) ds[k] = _mm256_mul_ps(s8(S + 8 * k), D);
        }
        __m256 dmm;
        if constexpr (R::mins) dmm = R::min_codes ? _mm256_mul_ps(u8(v.M(sb, c) + g * 8 * R::chunks), f16x8(v.Dm(sb) + 8 * g)) : f16x8(v.Dm(sb) + 8 * g);
        for (int i = 0; i < MR; i++) {
          const int64_t ib = (i0 + i) * a.nb + b;
          const __m256 dx = _mm256_set1_ps(a.dx[ib]);
          for (int k = 0; k < H; k++)
            acc[i][g] = _mm256_fmadd_ps(rows8(s[i][g][k][0], s[i][g][k][1]), _mm256_mul_ps(ds[k], dx), acc[i][g]);
          if constexpr (R::mins) acc[i][g] = _mm256_fnmadd_ps(dmm, _mm256_set1_ps(a.dx[ib] * (float)a.sx32[ib]), acc[i][g]);
        }
      }
    }
  }
  for (int i = 0; i < MR; i++)
    for (int g = 0; g < NG; g++) out[i][g] = acc[i][g];
}

inline void store_rows(float* yp, int64_t r0, int64_t n0, int64_t n1, __m256 r) {  // rows of [n0, n1) only
  alignas(32) float v[8];
  _mm256_store_ps(v, r);
  for (int j = 0; j < kGroup; j++)
    if (r0 + j >= n0 && r0 + j < n1) yp[j] = v[j];
}

template <WeightType T, int MR, int NG>
void run_tile(const GroupedAct& a, int64_t i0, const PackedMatrix& w, int64_t nsb, int64_t groups, int64_t g, float* y,
              int64_t ldy, int64_t n0, int64_t n1) {
  __m256 out[MR][NG];
  tile<T, MR, NG>(a, i0, grouped_view(w.data(), T, nsb, groups, g), nsb, out);
  for (int i = 0; i < MR; i++)
    for (int k = 0; k < NG; k++) store_rows(y + (i0 + i) * ldy + (g + k) * kGroup, (g + k) * kGroup, n0, n1, out[i][k]);
}

// Decode: two groups of a super-group at once where [n0, n1) covers them, else one. Prefill: the same
// with two activation rows per tile (16 registers of sums hold two rows x two groups).
template <WeightType T>
void matmul_t(const GroupedAct& a, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nsb = w.cols / ggml_block_elems(T), groups = ngroups(w.rows), g_end = (n1 + kGroup - 1) / kGroup;
  for (int64_t g = n0 / kGroup; g < g_end;) {
    const bool two = g + 2 <= g_end && (g + 1) / kSuper == g / kSuper && (g + 1) < groups;
    int64_t i = 0;
    for (; i + 2 <= m; i += 2)
      two ? run_tile<T, 2, 2>(a, i, w, nsb, groups, g, y, ldy, n0, n1) : run_tile<T, 2, 1>(a, i, w, nsb, groups, g, y, ldy, n0, n1);
    if (i < m)
      two ? run_tile<T, 1, 2>(a, i, w, nsb, groups, g, y, ldy, n0, n1) : run_tile<T, 1, 1>(a, i, w, nsb, groups, g, y, ldy, n0, n1);
    g += two ? 2 : 1;
  }
}

}  // namespace

void grouped_ggml_quantize_act_avx2(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act, void* qa) {
  // Bit for bit ggml_quantize_act_wide (VCVTPS2DQ rounds to nearest even, as nearbyint), 32 columns at a time.
  const int64_t nb = w.ld / 32;
  int16_t* q = static_cast<int16_t*>(qa);
  float* dx = reinterpret_cast<float*>(q + m * w.ld);
  int32_t* sx = reinterpret_cast<int32_t*>(dx + m * nb);
  int32_t* sx32 = sx + m * 2 * nb;
  const float top = act == ActType::I16 ? 32767.f : 127.f;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  auto hsum = [](__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
  };
  for (int64_t i = 0; i < m; i++)
    for (int64_t b = 0; b < nb; b++) {
      const float* xb = x + i * ldx + 32 * b;
      __m256 xv[4], mx = _mm256_setzero_ps();
      for (int k = 0; k < 4; k++) xv[k] = _mm256_loadu_ps(xb + 8 * k), mx = _mm256_max_ps(mx, _mm256_and_ps(xv[k], abs_mask));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const float d = amax / top;
      const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
      __m256i qv[4];
      for (int k = 0; k < 4; k++) qv[k] = _mm256_cvtps_epi32(_mm256_mul_ps(xv[k], id));
      for (int k = 0; k < 2; k++) {  // 16 int32 -> 16 int16 in order (PACKSSDW interleaves 128-bit lanes)
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(qv[2 * k], qv[2 * k + 1]), 0xd8);
        _mm256_storeu_si256((__m256i*)(q + i * w.ld + 32 * b + 16 * k), p);
      }
      const int32_t s0 = hsum(_mm256_add_epi32(qv[0], qv[1])), s1 = hsum(_mm256_add_epi32(qv[2], qv[3]));
      dx[i * nb + b] = d;
      sx[i * 2 * nb + 2 * b] = s0, sx[i * 2 * nb + 2 * b + 1] = s1;
      sx32[i * nb + b] = s0 + s1;
    }
}

void grouped_ggml_matmul_avx2(const void* qa, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                              int64_t n1) {
  n1 = std::min(n1, w.rows);
  if (n0 >= n1) return;
  const GroupedAct a = grouped_act(qa, m, w);
  with_grouped_type(w.type, [&](auto t) { matmul_t<decltype(t)::value>(a, m, w, y, ldy, n0, n1); });
}

}  // namespace quant
}  // namespace corelm
