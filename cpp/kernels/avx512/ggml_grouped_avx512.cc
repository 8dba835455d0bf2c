// AVX-512 matmul of the GGUF block types in the grouped layout (ggml_grouped.h): Q4_K, Q5_K, Q6_K,
// IQ4_XS, Q5_0, IQ4_NL. As the int16 Q4 kernels (quant_avx512.cc): a chunk's 4-bit codes of 8 rows,
// 32 bytes at a time widened to int16, each piece (8 rows x 4 columns) multiplied by a broadcast of
// its 4 activations with VPDPWSSD, so every row's sum stays in its own pair of lanes; the high bits
// (Q5_*, Q6_K) are ORed in from their plane and the IQ4 codes looked up (VPERMW) before that. Per
// chunk and 8 rows, one FMA adds cvt(sum) * (d * s) * dx and, with minimums, one more takes
// (dm * mn) * dx * sum(xq) off. Activations are int16 (int8 precision for ActType::I8), the code
// offset (Q6_K 32, Q5_0 16) comes off as -offset * sum(xq) in the integer sums. Decode (one row, VNNI)
// splits each int16 activation into two bytes and multiplies the codes as bytes (VPDPBUSD, as the int8
// path): the same integer sums, half the unpacking.
// GEMV and GEMM compute each (row, token) with the same operations in the same order, so a token's
// result does not depend on its batch. At the end, panel_bf16_pairs_avx512: these types and q8/q4/q4m
// (the same piece order) dequantized to bf16 for the amx table's prompts.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "kernels/avx512/int_dot.h"
#include "kernels/decode_store.h"
#include "kernels/ggml_grouped.h"
#include "kernels/kernel_util.h"
#include "kernels/prefetch.h"

namespace corelm {
namespace quant {
namespace {

// Piece p's high bits (from the plane widened to int16) moved to bit 4 (and 5), ORed into w.
template <WeightType T>
inline __m512i add_high(__m512i w, __m512i plane, int p) {
  const __m512i mask = _mm512_set1_epi16(Tr<T>::hi == 1 ? 0x10 : 0x30);
  const int at = Tr<T>::hi == 1 ? p : 2 * (p % 4);  // where the piece's bits sit in its plane byte
  const __m512i moved = at <= 4 ? _mm512_slli_epi16(plane, 4 - at) : _mm512_srli_epi16(plane, at - 4);
  return _mm512_ternarylogic_epi32(moved, mask, w, 0xEA);  // (moved & mask) | w
}

// Calls piece(p, w) for the 8 pieces of chunk c of super-block sb for NG groups from group view v:
// w[g] the piece's values of group g as int16 (u, or the IQ4 table's v).
// kFrom..kTo: the quarters uh (32 bytes each) to walk; quarters 0-1 hold pieces 0-3, quarters 2-3 pieces 4-7.
template <WeightType T, int NG, class Piece, int kFrom = 0, int kTo = 4>
inline void for_pieces(const GroupedView& v, int64_t sb, int c, Piece piece) {
  const __m512i m4 = _mm512_set1_epi16(0x0f);
  const __m512i table = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)kIq4Values)));
  const uint8_t* qs = v.qs(sb, c);
  const uint8_t* hp = v.hi(sb, c);
  __m512i plane[NG];
  if constexpr (Tr<T>::hi == 1)
    for (int g = 0; g < NG; g++) plane[g] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(hp + g * 32)));
  __m512i lo[NG], hi[NG];
#pragma GCC unroll 4
  for (int uh = kFrom; uh < kTo; uh++) {  // 32 bytes at 32 * uh: pieces 4u + h (low nibbles), 4u + 2 + h (high)
    const int u = uh >> 1, h = uh & 1;
    for (int g = 0; g < NG; g++) {
      const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qs + g * 128 + 32 * uh)));
      lo[g] = _mm512_and_si512(b, m4), hi[g] = _mm512_srli_epi16(b, 4);
      if constexpr (Tr<T>::hi == 2)
        plane[g] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(hp + g * 64 + 32 * u)));
      if constexpr (Tr<T>::hi > 0) {
        lo[g] = add_high<T>(lo[g], plane[g], 4 * u + h);
        hi[g] = add_high<T>(hi[g], plane[g], 4 * u + 2 + h);
      }
      if constexpr (Tr<T>::table) {
        lo[g] = _mm512_permutexvar_epi16(lo[g], table);
        hi[g] = _mm512_permutexvar_epi16(hi[g], table);
      }
    }
    piece(4 * u + h, lo);
    piece(4 * u + 2 + h, hi);
  }
}

// The int8 path's order: calls pair(u, k, w) for u = 0, 1 and k = 0, 1, w[g] the 64 code bytes of
// pieces 4u + 2k and 4u + 2k + 1 of group g (one 32-byte piece per 256-bit half) as unsigned bytes: u,
// or the IQ4 table's v + 128.
template <WeightType T, int NG, class Pair>
inline void for_pairs(const GroupedView& v, int64_t sb, int c, Pair pair) {
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const __m512i table = _mm512_broadcast_i32x4(_mm_add_epi8(_mm_loadu_si128((const __m128i*)kIq4Values), _mm_set1_epi8((char)0x80)));
  const uint8_t* qs = v.qs(sb, c);
  const uint8_t* hp = v.hi(sb, c);
  // where pieces p0, p0 + 1's high bits sit in their plane byte, as left shifts (negative: right)
  auto high = [&](__m512i w, __m512i plane, int p0) {
    const int a0 = Tr<T>::hi == 1 ? p0 : 2 * (p0 % 4), a1 = Tr<T>::hi == 1 ? p0 + 1 : a0 + 2;
    const __m512i mask = _mm512_set1_epi8(Tr<T>::hi == 1 ? 0x10 : 0x30);
    const __m512i moved = a1 <= 4 ? _mm512_sllv_epi16(plane, _mm512_inserti64x4(_mm512_set1_epi16((short)(4 - a0)), _mm256_set1_epi16((short)(4 - a1)), 1))
                                  : _mm512_srlv_epi16(plane, _mm512_inserti64x4(_mm512_set1_epi16((short)(a0 - 4)), _mm256_set1_epi16((short)(a1 - 4)), 1));
    return _mm512_ternarylogic_epi32(moved, mask, w, 0xEA);  // (moved & mask) | w
  };
  for (int u = 0; u < 2; u++) {
    __m512i lo[NG], hi[NG];
    for (int g = 0; g < NG; g++) {
      const __m512i b = _mm512_loadu_si512((const void*)(qs + g * 128 + 64 * u));
      lo[g] = _mm512_and_si512(b, m4), hi[g] = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
      if constexpr (Tr<T>::hi > 0) {
        const uint8_t* pl = Tr<T>::hi == 1 ? hp + g * 32 : hp + g * 64 + 32 * u;
        const __m512i plane = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)pl));
        lo[g] = high(lo[g], plane, 4 * u), hi[g] = high(hi[g], plane, 4 * u + 2);
      }
      if constexpr (Tr<T>::table) lo[g] = _mm512_shuffle_epi8(table, lo[g]), hi[g] = _mm512_shuffle_epi8(table, hi[g]);
    }
    pair(u, 0, lo);
    pair(u, 1, hi);
  }
}

// 8 int8 activations x[0..7] as VPDPBUSD takes them against a pair: x[0..3] in lanes 0-7, x[4..7] in 8-15.
inline __m512i spread8(const int8_t* x) {
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  return _mm512_permutexvar_epi32(idx, _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i*)x)));
}
inline __m256 rows8_i8(__m512i acc) {  // lanes j and j + 8 summed -> 8 floats, row j in lane j
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1)));
}

inline __m256 rows8(__m512i acc) {  // a row's pair of lanes summed -> 8 floats, row j in lane j
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm256_cvtepi32_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi32(even, pair_sums(acc))));
}
// One row of nb blocks of 32 int16 activations split into bytes for VPDPBUSD, x = 256 * hi + lo (hi
// the signed high byte, lo the unsigned low one), and each block's sum of hi: decode's same integer
// sums from weights kept as bytes. Kept in buf.
struct SplitAct {
  const int8_t* hi;
  const uint8_t* lo;
  const int32_t* shi;
};
inline SplitAct split_int16(const int16_t* q, int64_t nb, std::vector<uint8_t>& buf) {
  buf.resize(68 * nb);
  int8_t* hi = reinterpret_cast<int8_t*>(buf.data());
  uint8_t* lo = buf.data() + 32 * nb;
  int32_t* shi = reinterpret_cast<int32_t*>(buf.data() + 64 * nb);
  for (int64_t b = 0; b < nb; b++) {
    const __m512i x = _mm512_loadu_si512((const void*)(q + 32 * b));
    const __m512i h = _mm512_srai_epi16(x, 8);
    _mm256_storeu_si256((__m256i*)(hi + 32 * b), _mm512_cvtepi16_epi8(h));
    _mm256_storeu_si256((__m256i*)(lo + 32 * b), _mm512_cvtepi16_epi8(x));  // truncation: the low byte
    shi[b] = _mm512_reduce_add_epi32(_mm512_madd_epi16(h, _mm512_set1_epi16(1)));
  }
  return {hi, lo, shi};
}

inline __m256 s8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline __m256 u8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline __m256 f16x8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// Decode's software prefetch: the super-block about kPrefetchBytes ahead, a chunk's share of its lines
// per chunk, into L2 (T1). Unlike the Q4/Q4M stream (quant_avx512.cc), this one needs it on Zen 4, one
// thread, bench_gemv_stream on Qwen2.5-1.5B's shapes (GB/s of a 31-33 GB/s read): none Q4_K 10, Q6_K 6;
// into L1 (T0) 25 / 15.5, whose few miss buffers cap Q6_K's larger stride; into L2 25.4 / 24.2
// (Q5_0 21.3 -> 24.2, Q5_1 21.9 -> 26.4). 4 to 16 KiB ahead measured alike into L2.
// CORELM_DECODE_PREFETCH=0 turns it off (kernel_util.h).
constexpr int64_t kPrefetchBytes = 8192;
const bool kPrefetch = decode_prefetch(true);

// How a tile multiplies: int16 activations against codes widened to int16 (VPDPWSSD), int8 ones against
// the codes as bytes (VPDPBUSD, pairs of pieces), or int16 ones split into bytes (SplitAct; one row).
enum ActForm { kWide, kBytes, kSplit };

// MR activation rows (from i0) x NG groups (from the view's group) over the whole row: out[i][g].
template <WeightType T, bool VNNI, ActForm F, int MR, int NG>
void tile(const GroupedAct& a, const SplitAct& sa, int64_t i0, const GroupedView& v, int64_t nsb, __m256 out[MR][NG]) {
  using R = Tr<T>;
  constexpr bool I8 = F == kBytes;
  static_assert(F != kSplit || (MR == 1 && VNNI && !(R::table && R::halves)), "split: one row, VNNI, per-32 table sums");
  constexpr int kOffset = I8 && R::table ? 128 : R::offset;  // int8 path: the IQ4 table stored + 128
  __m256 acc[MR][NG];
  for (int i = 0; i < MR; i++)
    for (int g = 0; g < NG; g++) acc[i][g] = _mm256_setzero_ps();
  const int64_t pf_lines = (v.sb_bytes + 63) / 64, pf_per_chunk = (pf_lines + R::chunks - 1) / R::chunks;
  const int64_t kPrefetchSuperBlocks = std::max<int64_t>(1, (kPrefetchBytes + v.sb_bytes / 2) / v.sb_bytes);
  // The super-block's fp16 scales converted once, not per chunk, where registers allow: without high-bit
  // planes (one Xeon core, bench_gemv_stream on Qwen2.5-1.5B's shapes: Q4_K 0.76 -> 0.81 of a plain read);
  // with them the chains spill (Q5_K 0.75 -> 0.70), and those re-read them from L1 per chunk.
  constexpr bool kHoist = Tr<T>::g.hi_bits == 0;
  // Two int32 chains per (row, group) (a type's halves, or even and odd pieces) where the tile has few;
  // one where MR x NG give enough independent ones (the same integer sums, half the registers: one Xeon
  // core, 2048 x 2048 from L2 at 4-16 rows, GFLOP/s: Q4_K 139 -> 151, Q5_K 111 -> 133, IQ4_XS 131 -> 145,
  // Q5_0 130 -> 154).
  constexpr int kChains = R::halves || MR * NG < 8 ? 2 : 1;
  __m256 Dsb[NG], Dmsb[NG];
  auto D_of = [&](int64_t sb, int g) { return kHoist ? Dsb[g] : f16x8(v.D(sb) + 8 * g); };
  auto Dm_of = [&](int64_t sb, int g) { return kHoist ? Dmsb[g] : f16x8(v.Dm(sb) + 8 * g); };
  for (int64_t sb = 0; sb < nsb; sb++) {
    if constexpr (kHoist)
      for (int g = 0; g < NG; g++) {
        Dsb[g] = f16x8(v.D(sb) + 8 * g);
        if constexpr (R::mins) Dmsb[g] = f16x8(v.Dm(sb) + 8 * g);
      }
    for (int c = 0; c < R::chunks; c++) {
      if (kPrefetch) {  // the super-block kPrefetchSuperBlocks ahead, a chunk's share at a time
        const char* ahead = reinterpret_cast<const char*>(v.base) + (sb + kPrefetchSuperBlocks) * v.sb_bytes;
        const int64_t l0 = c * pf_per_chunk;
        prefetch_lines_l2(ahead + 64 * l0, std::min(pf_lines, l0 + pf_per_chunk) - l0);
      }
      const int64_t b = sb * R::chunks + c;  // the chunk's index along the row
      __m512i s[MR][kChains][NG];
      for (int i = 0; i < MR; i++) {
        const int64_t ib = (i0 + i) * a.nb + b;
        for (int g = 0; g < NG; g++) {
          if constexpr (R::halves) {
            s[i][0][g] = _mm512_set1_epi32(-kOffset / 2 * a.sx[2 * ib]);
            s[i][1][g] = _mm512_set1_epi32(-kOffset / 2 * a.sx[2 * ib + 1]);
          } else {
            s[i][0][g] = _mm512_set1_epi32(-kOffset / 2 * a.sx32[ib]);
            if constexpr (kChains == 2) s[i][1][g] = _mm512_setzero_si512();
          }
        }
      }
      if constexpr (F == kSplit) {
        // 256 * sum(w * hi) + sum(w * lo): hi signed against the codes as unsigned bytes, lo unsigned
        // against them as signed ones (IQ4: the table's v, the stored v + 128 with its top bit flipped)
        __m512i h[2][NG];
        for (int g = 0; g < NG; g++) h[0][g] = _mm512_set1_epi32(R::table ? -64 * sa.shi[b] : 0), h[1][g] = _mm512_setzero_si512();
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for_pairs<T, NG>(v, sb, c, [&](int u, int k, const __m512i* w) {
          const int chain = R::halves ? u : 0;  // hi and lo already give 2 * NG chains
          const int64_t col = 32 * b + 16 * u + 8 * k;
          const __m512i xh = spread8(sa.hi + col), xl = spread8(reinterpret_cast<const int8_t*>(sa.lo) + col);
          for (int g = 0; g < NG; g++) {
            h[chain][g] = dpbusd<VNNI>(h[chain][g], w[g], xh);
            s[0][chain][g] = dpbusd<VNNI>(s[0][chain][g], xl, R::table ? _mm512_xor_si512(w[g], flip) : w[g]);
          }
        });
        for (int k = 0; k < (R::halves ? 2 : 1); k++)
          for (int g = 0; g < NG; g++) s[0][k][g] = _mm512_add_epi32(s[0][k][g], _mm512_slli_epi32(h[k][g], 8));
      } else if constexpr (I8) {
        for_pairs<T, NG>(v, sb, c, [&](int u, int k, const __m512i* w) {
          const int chain = R::halves ? u : kChains == 2 ? k : 0;  // pieces 4u..4u+3 are half u
          for (int i = 0; i < MR; i++) {
            const __m512i x = spread8(a.q8 + (i0 + i) * a.ld + 32 * b + 16 * u + 8 * k);
            for (int g = 0; g < NG; g++) s[i][chain][g] = dpbusd<VNNI>(s[i][chain][g], w[g], x);
          }
        });
      } else {
        for_pieces<T, NG>(v, sb, c, [&](int p, const __m512i* w) {
          const int k = R::halves ? p / 4 : kChains == 2 ? p & 1 : 0;
          for (int i = 0; i < MR; i++) {
            const __m512i x = bcast8(a.q + (i0 + i) * a.ld + 32 * b + 4 * p);
            for (int g = 0; g < NG; g++) s[i][k][g] = dpwssd<VNNI>(s[i][k][g], w[g], x);
          }
        });
      }
      auto rows = [](__m512i acc) { return F == kWide ? rows8(acc) : rows8_i8(acc); };
      for (int g = 0; g < NG; g++) {
        const __m256 D = D_of(sb, g);
        __m256 ds0 = D, ds1 = D;
        if constexpr (R::scales) {
          const int8_t* S = v.S(sb, R::halves ? 2 * c : c) + g * 8 * R::nsc;
          ds0 = _mm256_mul_ps(s8(S), D);
          if constexpr (R::halves) ds1 = _mm256_mul_ps(s8(S + 8), D);
        }
        __m256 dmm;
        if constexpr (R::mins) dmm = R::min_codes ? _mm256_mul_ps(u8(v.M(sb, c) + g * 8 * R::chunks), Dm_of(sb, g)) : Dm_of(sb, g);
        for (int i = 0; i < MR; i++) {
          const int64_t ib = (i0 + i) * a.nb + b;
          const __m256 dx = _mm256_set1_ps(a.dx[ib]);
          if constexpr (R::halves) {
            acc[i][g] = _mm256_fmadd_ps(rows(s[i][0][g]), _mm256_mul_ps(ds0, dx), acc[i][g]);
            acc[i][g] = _mm256_fmadd_ps(rows(s[i][1][g]), _mm256_mul_ps(ds1, dx), acc[i][g]);
          } else {
            __m512i sum = s[i][0][g];
            if constexpr (kChains == 2) sum = _mm512_add_epi32(sum, s[i][1][g]);
            acc[i][g] = _mm256_fmadd_ps(rows(sum), _mm256_mul_ps(ds0, dx), acc[i][g]);
          }
          if constexpr (R::mins) acc[i][g] = _mm256_fnmadd_ps(dmm, _mm256_set1_ps(a.dx[ib] * (float)a.sx32[ib]), acc[i][g]);
        }
      }
    }
  }
  for (int i = 0; i < MR; i++)
    for (int g = 0; g < NG; g++) out[i][g] = acc[i][g];
}

inline void store_rows(float* yp, int64_t r0, int64_t n0, int64_t n1, __m256 r) {  // rows of [n0, n1) only
  __mmask8 keep = 0;
  for (int j = 0; j < kGroup; j++) keep |= (__mmask8)((r0 + j >= n0 && r0 + j < n1) << j);
  _mm256_mask_storeu_ps(yp, keep, r);
}

template <WeightType T, bool VNNI, ActForm F, int MR, int NG>
void run_tile(const GroupedAct& a, const SplitAct& sa, int64_t i0, const PackedMatrix& w, int64_t nsb, int64_t groups,
              int64_t g, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  __m256 out[MR][NG];
  tile<T, VNNI, F, MR, NG>(a, sa, i0, grouped_view(w.data(), T, nsb, groups, g), nsb, out);
  for (int i = 0; i < MR; i++)
    for (int k = 0; k < NG; k++) store_rows(y + (i0 + i) * ldy + (g + k) * kGroup, (g + k) * kGroup, n0, n1, out[i][k]);
}

// A small batch's rows (2 to kRowExactRows: a guess's check, batched decode) against one whole super-group,
// int16 activations with VNNI: MR rows x kSuper groups of int32 chains in registers, the fp32 sums in
// memory (tile() kept both in registers and spilled: 158 stack references in its 4-row loop to 128
// VPDPWSSD), and the scales applied to two groups a register. Each row's result comes from the same
// integer sums through the same fp32 operations, lane for lane and in the same order, as tile()'s and
// decode's, so it has decode's bits. dxs[ib]: dx * sx32 of block ib, rounded as tile() rounds it.
template <WeightType T, int MR>
void tile_rows(const GroupedAct& a, const float* dxs, int64_t i0, const GroupedView& v, int64_t nsb,
               float out[MR][kSuper * kGroup]) {
  using R = Tr<T>;
  static_assert(kSuper % 2 == 0, "the scales go on pairs of groups");
  constexpr int NG = kSuper, NP = kSuper / 2, kHalves = R::halves ? 2 : 1;
  alignas(64) float acc[MR][NP][16];
  for (int i = 0; i < MR; i++)
    for (int q = 0; q < NP; q++) _mm512_store_ps(acc[i][q], _mm512_setzero_ps());
  // a pair of groups' int32 chains -> 16 row sums, group 2q's 8 rows then group 2q + 1's
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  auto two = [](const void* p, int64_t apart) {  // 8 bytes of group 2q and 8 of group 2q + 1
    const uint8_t* b = static_cast<const uint8_t*>(p);
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)b), _mm_loadl_epi64((const __m128i*)(b + apart)));
  };
  const int64_t pf_lines = (v.sb_bytes + 63) / 64, pf_per_chunk = (pf_lines + R::chunks - 1) / R::chunks;
  const int64_t kPrefetchSuperBlocks = std::max<int64_t>(1, (kPrefetchBytes + v.sb_bytes / 2) / v.sb_bytes);
  for (int64_t sb = 0; sb < nsb; sb++) {
    for (int c = 0; c < R::chunks; c++) {
      if (kPrefetch) {
        const char* ahead = reinterpret_cast<const char*>(v.base) + (sb + kPrefetchSuperBlocks) * v.sb_bytes;
        const int64_t l0 = c * pf_per_chunk;
        prefetch_lines_l2(ahead + 64 * l0, std::min(pf_lines, l0 + pf_per_chunk) - l0);
      }
      const int64_t b = sb * R::chunks + c;
      const int16_t* xb = a.q + i0 * a.ld + 32 * b;
#pragma GCC unroll 2
      for (int half = 0; half < kHalves; half++) {  // Q6_K: pieces 0-3 then 4-7, each half with its scale
        __m512i s[MR][NG];
        for (int i = 0; i < MR; i++) {
          const int64_t ib = (i0 + i) * a.nb + b;
          const __m512i init = _mm512_set1_epi32(-R::offset / 2 * (R::halves ? a.sx[2 * ib + half] : a.sx32[ib]));
          for (int g = 0; g < NG; g++) s[i][g] = init;
        }
        auto piece = [&](int p, const __m512i* w) {
          for (int i = 0; i < MR; i++) {
            const __m512i x = bcast8(xb + i * a.ld + 4 * p);
            for (int g = 0; g < NG; g++) s[i][g] = dpwssd<true>(s[i][g], w[g], x);
          }
        };
        if (kHalves == 1) for_pieces<T, NG, decltype(piece), 0, 4>(v, sb, c, piece);
        else if (half == 0) for_pieces<T, NG, decltype(piece), 0, 2>(v, sb, c, piece);
        else for_pieces<T, NG, decltype(piece), 2, 4>(v, sb, c, piece);
        for (int q = 0; q < NP; q++) {
          const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(v.D(sb) + 16 * q)));
          __m512 ds = D;
          if constexpr (R::scales)
            ds = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(two(v.S(sb, R::halves ? 2 * c + half : c) + 2 * q * 8 * R::nsc, 8 * R::nsc))), D);
          __m512 dmm = _mm512_setzero_ps();
          if constexpr (R::mins) {
            dmm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(v.Dm(sb) + 16 * q)));
            if constexpr (R::min_codes)
              dmm = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(two(v.M(sb, c) + 2 * q * 8 * R::chunks, 8 * R::chunks))), dmm);
          }
          for (int i = 0; i < MR; i++) {
            const int64_t ib = (i0 + i) * a.nb + b;
            const __m512i sum = _mm512_add_epi32(_mm512_permutex2var_epi32(s[i][2 * q], even, s[i][2 * q + 1]),
                                                 _mm512_permutex2var_epi32(s[i][2 * q], odd, s[i][2 * q + 1]));
            __m512 r = _mm512_load_ps(acc[i][q]);
            r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(ds, _mm512_set1_ps(a.dx[ib])), r);
            if constexpr (R::mins)
              if (half == kHalves - 1) r = _mm512_fnmadd_ps(dmm, _mm512_set1_ps(dxs[ib]), r);
            _mm512_store_ps(acc[i][q], r);
          }
        }
      }
    }
  }
  for (int i = 0; i < MR; i++)
    for (int q = 0; q < NP; q++) _mm512_storeu_ps(out[i] + 16 * q, _mm512_load_ps(acc[i][q]));
}

template <WeightType T, int MR>
void run_tile_rows(const GroupedAct& a, const float* dxs, int64_t i0, const PackedMatrix& w, int64_t nsb, int64_t groups,
                   int64_t g, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  alignas(64) float out[MR][kSuper * kGroup];
  tile_rows<T, MR>(a, dxs, i0, grouped_view(w.data(), T, nsb, groups, g), nsb, out);
  for (int i = 0; i < MR; i++)
    for (int k = 0; k < kSuper; k++)
      store_rows(y + (i0 + i) * ldy + (g + k) * kGroup, (g + k) * kGroup, n0, n1, _mm256_load_ps(out[i] + 8 * k));
}

// A small batch against a whole super-group with tile_rows: tiles of at most 6 rows, as even as the count
// allows (6 rows' 24 chains spill a little and still beat 3 + 3; 8 in one tile lose to 4 + 4:
// bench_gemv_stream over Qwen2.5-1.5B's shapes, GB/s, 2 threads Q4_K 6 rows 12.5 -> 15.0, 8 rows 11.1 ->
// 10.5).
template <WeightType T>
void rows_supergroup(const GroupedAct& a, const float* dxs, int64_t m, const PackedMatrix& w, int64_t nsb,
                     int64_t groups, int64_t g, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t tiles = (m + 5) / 6;
  for (int64_t t = 0, i = 0; t < tiles; t++) {
    const int64_t rows = m / tiles + (t < m % tiles);
    switch (rows) {
      case 6: run_tile_rows<T, 6>(a, dxs, i, w, nsb, groups, g, y, ldy, n0, n1); break;
      case 5: run_tile_rows<T, 5>(a, dxs, i, w, nsb, groups, g, y, ldy, n0, n1); break;
      case 4: run_tile_rows<T, 4>(a, dxs, i, w, nsb, groups, g, y, ldy, n0, n1); break;
      case 3: run_tile_rows<T, 3>(a, dxs, i, w, nsb, groups, g, y, ldy, n0, n1); break;
      case 2: run_tile_rows<T, 2>(a, dxs, i, w, nsb, groups, g, y, ldy, n0, n1); break;
      default: run_tile_rows<T, 1>(a, dxs, i, w, nsb, groups, g, y, ldy, n0, n1); break;
    }
    i += rows;
  }
}

// Decode of one whole super-group (one activation row): whole groups of [n0, n1) written past the
// caches (decode_store.h; the caller ends with end_decode_stores).
template <WeightType T, bool VNNI, ActForm F>
void decode_tile(const GroupedAct& a, const SplitAct& sa, const PackedMatrix& w, int64_t nsb, int64_t groups, int64_t g,
                 float* y, int64_t n0, int64_t n1) {
  __m256 out[1][kSuper];
  tile<T, VNNI, F, 1, kSuper>(a, sa, 0, grouped_view(w.data(), T, nsb, groups, g), nsb, out);
  for (int k = 0; k < kSuper; k++) {
    const int64_t r0 = (g + k) * kGroup;
    if (!(r0 >= n0 && r0 + kGroup <= n1 && stream_rows8(y + r0, out[0][k]))) store_rows(y + r0, r0, n0, n1, out[0][k]);
  }
}

// Activation rows per tile (against 2 groups, or a small batch's kSuper): at most kMR, as even as the
// count allows (8 rows: 4 + 4, 7: 4 + 3), since much of a tile's cost is widening the codes, which its
// rows share. With at most 4, 5 rows went as 4 + 1 and 6 as 4 + 2: bench_gemv_stream over Qwen2.5-1.5B's
// shapes, 2 threads, GB/s of weights, Q4_K 5 rows 10.5-12.7 -> 14.6-15.2, 6 rows 8.3-11.9 -> 12.8-12.9
// (Q6_K 12.3-12.6 -> 14.6-14.7 and 11.1-11.5 -> 12.5-12.7), 1-4 rows alike; 6 rows' 24 int32 chains
// still fit the registers.
constexpr int kMR = 6;

template <WeightType T, bool VNNI, ActForm F, int NG>
void rows_tiles(const GroupedAct& a, int64_t m, const PackedMatrix& w, int64_t nsb, int64_t groups, int64_t g, float* y,
                int64_t ldy, int64_t n0, int64_t n1) {
  const SplitAct none{};
  const int64_t tiles = (m + kMR - 1) / kMR;
  for (int64_t t = 0, i = 0; t < tiles; t++) {
    const int64_t rows = m / tiles + (t < m % tiles);
    switch (rows) {
      case 6: run_tile<T, VNNI, F, 6, NG>(a, none, i, w, nsb, groups, g, y, ldy, n0, n1); break;
      case 5: run_tile<T, VNNI, F, 5, NG>(a, none, i, w, nsb, groups, g, y, ldy, n0, n1); break;
      case 4: run_tile<T, VNNI, F, 4, NG>(a, none, i, w, nsb, groups, g, y, ldy, n0, n1); break;
      case 3: run_tile<T, VNNI, F, 3, NG>(a, none, i, w, nsb, groups, g, y, ldy, n0, n1); break;
      case 2: run_tile<T, VNNI, F, 2, NG>(a, none, i, w, nsb, groups, g, y, ldy, n0, n1); break;
      default: run_tile<T, VNNI, F, 1, NG>(a, none, i, w, nsb, groups, g, y, ldy, n0, n1); break;
    }
    i += rows;
  }
}

// Decode and small batches (m <= kRowExactRows: batched decode, a guess's check, a mixture-of-experts
// expert's few rows): whole super-groups of [n0, n1) in one stream each, its rows in tiles of kMR
// against all kSuper groups (the first tile reads it from memory, the others find it in L2; one row:
// decode_tile). Elsewhere, and for prompts: pairs of groups of a super-group, all rows in tiles of kMR.
// The one stream against the pairs of groups (which read each super-group twice), Q4_K from DRAM (one
// Xeon core, bench_gemv_stream rows=m over OLMoE's expert shapes): 3 rows 7.7 -> 8.8-9.1 GB/s, 4 rows
// 6.9 -> 8.4, 8 rows 4.1 -> 4.5-4.7 (Q5_K, Q6_K, IQ4_XS at 3-4 rows: +10-20%); from L3 and at 8-128
// rows from L2 alike. Two rows so (Zen 4) took 36 ms a step of Qwen2.5-1.5B Q4_K_M against 48.
template <WeightType T, bool VNNI, ActForm F>
void matmul_t(const GroupedAct& a, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nsb = w.cols / ggml_block_elems(T), groups = ngroups(w.rows), g_end = (n1 + kGroup - 1) / kGroup;
  // One int16 row with VNNI: the super-groups in bytes (split_int16), the same sums with fewer instructions:
  // Q4_K 28.5 -> 32.4, Q6_K 26.6 -> 31.9 GB/s from L3, 25.4 -> 27.6 and 24.2 -> 27.7 from DRAM (one Zen 4
  // thread, bench_gemv_stream on Qwen2.5-1.5B's shapes).
  constexpr bool kSplitRow = F == kWide && VNNI && !(Tr<T>::table && Tr<T>::halves);
  thread_local std::vector<uint8_t> split_buf;
  const SplitAct sa = kSplitRow && m == 1 ? split_int16(a.q, a.nb, split_buf) : SplitAct{};
  // A small batch's int16 rows with VNNI: tile_rows, which takes each block's dx * sx32 from here.
  constexpr bool kTileRows = F == kWide && VNNI;
  thread_local std::vector<float> dxs;
  if (kTileRows && Tr<T>::mins && m > 1 && m <= kRowExactRows) {
    dxs.resize(m * a.nb);
    for (int64_t ib = 0; ib < m * a.nb; ib++) dxs[ib] = a.dx[ib] * (float)a.sx32[ib];
  }
  for (int64_t g = n0 / kGroup; g < g_end;) {
    const int64_t first = g / kSuper * kSuper, ns = std::min<int64_t>(kSuper, groups - first);
    if (m <= kRowExactRows && g == first && ns == kSuper && g + kSuper <= g_end) {
      if (m > 1 && kTileRows) rows_supergroup<T>(a, dxs.data(), m, w, nsb, groups, g, y, ldy, n0, n1);
      else if (m > 1) rows_tiles<T, VNNI, F, kSuper>(a, m, w, nsb, groups, g, y, ldy, n0, n1);
      else if constexpr (kSplitRow) decode_tile<T, VNNI, kSplit>(a, sa, w, nsb, groups, g, y, n0, n1);
      else decode_tile<T, VNNI, F>(a, sa, w, nsb, groups, g, y, n0, n1);
      g += kSuper;
    } else if (m > 1 && g + 2 <= g_end && (g + 1) / kSuper == g / kSuper) {
      rows_tiles<T, VNNI, F, 2>(a, m, w, nsb, groups, g, y, ldy, n0, n1);
      g += 2;
    } else {
      rows_tiles<T, VNNI, F, 1>(a, m, w, nsb, groups, g, y, ldy, n0, n1);
      g += 1;
    }
  }
  if (m == 1) end_decode_stores();
}

template <WeightType T>
void matmul_vnni(const GroupedAct& a, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const bool vnni = use_vnni();
  if (a.q8) return vnni ? matmul_t<T, true, kBytes>(a, m, w, y, ldy, n0, n1) : matmul_t<T, false, kBytes>(a, m, w, y, ldy, n0, n1);
  vnni ? matmul_t<T, true, kWide>(a, m, w, y, ldy, n0, n1) : matmul_t<T, false, kWide>(a, m, w, y, ldy, n0, n1);
}

}  // namespace

void grouped_ggml_quantize_act_avx512(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act,
                                      void* qa) {
  // Bit for bit ggml_quantize_act (act I8: int8 quants) or ggml_quantize_act_wide (I16) (quant_formats.h's
  // quantize_activations: VCVTPS2DQ rounds to nearest even as nearbyint does), 32 columns at a time.
  const int64_t nb = w.ld / 32;
  int16_t* q = static_cast<int16_t*>(qa);
  float* dx = reinterpret_cast<float*>(static_cast<uint8_t*>(qa) + m * w.ld * act_elem_bytes(act));
  int32_t* sx = reinterpret_cast<int32_t*>(dx + m * nb);
  int32_t* sx32 = sx + m * 2 * nb;
  const float top = act == ActType::I16 ? 32767.f : 127.f;
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t i = 0; i < m; i++)
    for (int64_t b = 0; b < nb; b++) {
      const float* xb = x + i * ldx + 32 * b;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
      const float d = amax / top;
      const __m512 id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
      if (act == ActType::I8) {
        int8_t* q8 = reinterpret_cast<int8_t*>(qa) + i * w.ld + 32 * b;
        _mm_storeu_si128((__m128i*)q8, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(q8 + 16), _mm512_cvtepi32_epi8(q1));
      } else {
        _mm256_storeu_si256((__m256i*)(q + i * w.ld + 32 * b), _mm512_cvtepi32_epi16(q0));
        _mm256_storeu_si256((__m256i*)(q + i * w.ld + 32 * b + 16), _mm512_cvtepi32_epi16(q1));
      }
      const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
      dx[i * nb + b] = d;
      sx[i * 2 * nb + 2 * b] = s0, sx[i * 2 * nb + 2 * b + 1] = s1;
      sx32[i * nb + b] = s0 + s1;
    }
}

// ---- quantized rows as bf16 pairs (AMX-BF16's B operand, amx.h's tile order), for prefill on AMX ----

namespace {

#define CORELM_BF16_TARGET __attribute__((target("avx512bf16")))

// The per-row factor and addend of a piece's values (value = a * v + c, the product rounded by itself as
// unfused_product), spread over a piece's lanes: rows 0-3 (lo) and 4-7 (hi), 4 lanes each.
struct RowAffine {
  __m512 a_lo, a_hi, c_lo, c_hi;
  RowAffine() = default;  // a panel's second group where it has none: never read
  RowAffine(__m256 a8, __m256 c8) {
    const __m512i lo = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(4));
    a_lo = _mm512_permutexvar_ps(lo, _mm512_castps256_ps512(a8)), a_hi = _mm512_permutexvar_ps(hi, _mm512_castps256_ps512(a8));
    c_lo = _mm512_permutexvar_ps(lo, _mm512_castps256_ps512(c8)), c_hi = _mm512_permutexvar_ps(hi, _mm512_castps256_ps512(c8));
  }
};
inline __m256 unfused_mul8(__m256 a, __m256 b) {
  __m256 p = _mm256_mul_ps(a, b);
  __asm__("" : "+v"(p));  // rounded by itself: the add that follows must not fuse with it
  return p;
}

// The GGUF blocks' panels (grouped_panel_blocks, below) read a group's codes 4 chunks ahead and the next
// super-block's header (the 1.5B Q4_K_M's 128-token prefill 190.6 -> 204.5 tok/s on 1 thread, 344 -> 358
// on 2, 2 rounds alternating; 8 chunks ahead 200.2).
constexpr int64_t kPanelPrefetchChunks = 4;

// Q8 (q + 128 stored), Q4 (q - 8), Q4M (d * q + m): quant_layout.h, value as dequant_value.
// A group's blocks are a quarter of each block row, too sparse a walk for the hardware prefetchers: a
// third of the dequantization waited for the scales' line (`perf`, q4 prefill on AMX, one Xeon core).
// Prefetching the block kPanelPrefetchBlocks ahead took a 128-token q4 prefill from 747 to 786 tok/s on 1
// thread and 1341 to 1428 on 2 (3 rounds alternating; q8 unchanged); 4 to 16 blocks ahead measured alike.
constexpr int64_t kPanelPrefetchBlocks = 8;

// A piece's values (int16 v, row j in lanes 4j..4j+3) as bf16, dword 2j + h = row j, columns 4p + 2h and
// 4p + 2h + 1. kAdd: the format has an addend (where it has none, c is -0 and the adds are left out).
template <bool kAdd>
CORELM_BF16_TARGET __attribute__((always_inline)) inline __m512i piece_bf16(__m512i v, const RowAffine& r) {
  __m512 p0 = _mm512_mul_ps(r.a_lo, _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v))));
  __m512 p1 = _mm512_mul_ps(r.a_hi, _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1))));
  __asm__("" : "+v"(p0), "+v"(p1));
  if constexpr (kAdd) p0 = _mm512_add_ps(p0, r.c_lo), p1 = _mm512_add_ps(p1, r.c_hi);
  return (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
}

// Piece p of a panel's groups (q[g]: group g's int16 values, r[g] its rows' affine) into pairs 2p and
// 2p + 1. A function, not a lambda: a lambda does not inherit the caller's target attribute, so the
// calls in it were not inlined.
template <bool kAdd, bool kTwo>
CORELM_BF16_TARGET __attribute__((always_inline)) inline void emit_piece_pair(int p, const __m512i* q, const RowAffine* r,
                                                                               uint32_t* pairs) {
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i bf0 = piece_bf16<kAdd>(q[0], r[0]);
  const __m512i bf1 = kTwo ? piece_bf16<kAdd>(q[1], r[1]) : _mm512_setzero_si512();
  _mm512_storeu_si512(pairs + 2 * p * 16, _mm512_permutex2var_epi32(bf0, evens, bf1));
  _mm512_storeu_si512(pairs + (2 * p + 1) * 16, _mm512_permutex2var_epi32(bf0, odds, bf1));
}

// Both groups of a panel at once (kTwo: the panel has a second group, else its rows are zero), so that
// every pair is one whole 64-byte line: group 0's 8 rows then group 1's, one two-source permute and one
// store a line. One group at a time wrote each line in two halves, passes apart (`perf`: the
// dequantization's time sat on those permutes and stores).
template <bool kAdd, bool kTwo>
CORELM_BF16_TARGET void quant_panel_blocks(const PackedMatrix& w, int64_t g0, uint32_t* dst) {
  const WeightType t = w.type;
  const int64_t nb = nblocks(w), groups = ngroups(w.rows), qbytes = qs_bytes(t);
  const GroupView v[2] = {group_view(w.data(), t, nb, groups, g0), group_view(w.data(), t, nb, groups, kTwo ? g0 + 1 : g0)};
  const __m512i m4 = _mm512_set1_epi16(0x0f);
  const __m512i off = _mm512_set1_epi16(t == WeightType::Q8 ? 128 : t == WeightType::Q4 ? 8 : 0);
  constexpr int kGroups = kTwo ? 2 : 1;
  for (int64_t b = 0; b < nb; b++) {
    RowAffine r[2];
    const uint8_t* qs[2];
    for (int g = 0; g < kGroups; g++) {
      qs[g] = v[g].qs + b * v[g].qstride;
      const char* ahead = reinterpret_cast<const char*>(qs[g] + kPanelPrefetchBlocks * v[g].qstride);  // never faults
      for (int64_t l = 0; l < qbytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v[g].d + (b + kPanelPrefetchBlocks) * v[g].dstride), _MM_HINT_T0);
      if (kAdd) _mm_prefetch(reinterpret_cast<const char*>(v[g].m + (b + kPanelPrefetchBlocks) * v[g].dstride), _MM_HINT_T0);
      r[g] = RowAffine(f16x8(v[g].d + b * v[g].dstride), kAdd ? f16x8(v[g].m + b * v[g].dstride) : _mm256_set1_ps(-0.f));
    }
    uint32_t* pairs = dst + b * 256;
    __m512i lo[2], hi[2];
    if (t == WeightType::Q8) {
      for (int p = 0; p < 8; p++) {
        for (int g = 0; g < kGroups; g++)
          lo[g] = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qs[g] + 32 * p))), off);
        emit_piece_pair<kAdd, kTwo>(p, lo, r, pairs);
      }
      continue;
    }
    for (int uh = 0; uh < 4; uh++) {  // as for_pieces: pieces 4u + h (low nibbles), 4u + 2 + h (high)
      const int u = uh >> 1, h = uh & 1;
      for (int g = 0; g < kGroups; g++) {
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qs[g] + 32 * uh)));
        lo[g] = _mm512_sub_epi16(_mm512_and_si512(bytes, m4), off);
        hi[g] = _mm512_sub_epi16(_mm512_srli_epi16(bytes, 4), off);
      }
      emit_piece_pair<kAdd, kTwo>(4 * u + h, lo, r, pairs);
      emit_piece_pair<kAdd, kTwo>(4 * u + 2 + h, hi, r, pairs);
    }
  }
}

// As quant_panel_blocks for the GGUF blocks: value = (d * s) * v - dm * mn, each product rounded by itself
// (grouped_ggml_row_to_f32). A lambda does not inherit this function's target: the piece lambda names it
// (emit_piece_pair inlines into it), and flatten inlines for_pieces and the lambda here (without both,
// each piece was an out-of-line call).
template <WeightType T, bool kTwo>
CORELM_BF16_TARGET __attribute__((flatten)) void grouped_panel_blocks(const PackedMatrix& w, int64_t g0, uint32_t* dst) {
  using R = Tr<T>;
  constexpr int NG = kTwo ? 2 : 1;
  const int64_t nsb = w.cols / ggml_block_elems(T);
  const GroupedView v = grouped_view(w.data(), T, nsb, ngroups(w.rows), g0);  // g0 even: g0 + 1 shares its super-group
  const __m512i offset = _mm512_set1_epi16((short)R::offset);
  const int64_t hi_bytes = grouped_hi_bytes(v.tr);
  for (int64_t sb = 0; sb < nsb; sb++) {
    const char* next = reinterpret_cast<const char*>(v.base + (sb + 1) * v.sb_bytes);  // prefetch never faults
    for (int64_t l = 0; l < v.header_bytes; l += 64) _mm_prefetch(next + l, _MM_HINT_T0);
    __m256 d[2], dm[2];
    for (int k = 0; k < NG; k++) d[k] = f16x8(v.D(sb) + 8 * k), dm[k] = R::mins ? f16x8(v.Dm(sb) + 8 * k) : _mm256_setzero_ps();
    for (int c = 0; c < R::chunks; c++) {
      const char* q = reinterpret_cast<const char*>(v.qs(sb, c) + kPanelPrefetchChunks * v.chunk_bytes);
      for (int l = 0; l < 128 * NG; l += 64) _mm_prefetch(q + l, _MM_HINT_T0);
      if constexpr (R::hi > 0)
        for (int k = 0; k < NG; k++)
          _mm_prefetch(reinterpret_cast<const char*>(v.hi(sb, c) + kPanelPrefetchChunks * v.chunk_bytes + k * hi_bytes), _MM_HINT_T0);
      RowAffine r0[2], r1[2];
      for (int k = 0; k < NG; k++) {
        const __m256 mn = R::min_codes ? u8(v.M(sb, c) + k * 8 * R::chunks) : _mm256_set1_ps(R::mins ? 1.f : 0.f);
        const __m256 minus = _mm256_sub_ps(_mm256_set1_ps(-0.f), unfused_mul8(dm[k], mn));
        const int8_t* S = v.S(sb, R::halves ? 2 * c : c) + k * 8 * R::nsc;
        r0[k] = RowAffine(R::scales ? unfused_mul8(d[k], s8(S)) : unfused_mul8(d[k], _mm256_set1_ps(1.f)), minus);
        r1[k] = R::halves ? RowAffine(unfused_mul8(d[k], s8(S + 8)), minus) : r0[k];
      }
      uint32_t* pairs = dst + (sb * R::chunks + c) * 256;
      for_pieces<T, NG>(v, sb, c, [&](int p, const __m512i* wv) CORELM_BF16_TARGET {
        __m512i val[2];
        for (int k = 0; k < NG; k++) val[k] = R::table ? wv[k] : _mm512_sub_epi16(wv[k], offset);
        emit_piece_pair<R::mins, kTwo>(p, val, p < 4 ? r0 : r1, pairs);
      });
    }
  }
}

CORELM_BF16_TARGET void quant_panel(const PackedMatrix& w, int64_t panel, uint32_t* dst) {
  const int64_t g0 = 2 * panel;
  const bool two = g0 + 1 < ngroups(w.rows), add = w.type == WeightType::Q4M;
  if (add) two ? quant_panel_blocks<true, true>(w, g0, dst) : quant_panel_blocks<true, false>(w, g0, dst);
  else two ? quant_panel_blocks<false, true>(w, g0, dst) : quant_panel_blocks<false, false>(w, g0, dst);
}

}  // namespace

bool panel_bf16_pairs_avx512(const PackedMatrix& w, int64_t panel, uint16_t* dst) {
  const bool grouped = is_grouped_ggml(w.type);
  if (!grouped && !is_quant(w.type)) return false;
  if (!cpu_features().avx512_bf16) return false;
  uint32_t* pairs = reinterpret_cast<uint32_t*>(dst);
  if (!grouped) {
    quant_panel(w, panel, pairs);
    return true;
  }
  const int64_t g0 = 2 * panel;
  const bool two = g0 + 1 < ngroups(w.rows);
  with_grouped_type(w.type, [&](auto t) {
    constexpr WeightType T = decltype(t)::value;
    two ? grouped_panel_blocks<T, true>(w, g0, pairs) : grouped_panel_blocks<T, false>(w, g0, pairs);
  });
  return true;
}

void grouped_ggml_matmul_avx512(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                                int64_t n0, int64_t n1) {
  n1 = std::min(n1, w.rows);
  if (n0 >= n1) return;
  const GroupedAct a = grouped_act(qa, m, w, act);
  with_grouped_type(w.type, [&](auto t) { matmul_vnni<decltype(t)::value>(a, m, w, y, ldy, n0, n1); });
}

}  // namespace quant
}  // namespace corelm
