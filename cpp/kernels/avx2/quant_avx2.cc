// AVX2 kernels for the block-quantized formats (Q8, Q4, Q4M; arithmetic in quant_formats.h), on the
// grouped layout the AVX-512 table uses too (quant_layout.h): a 32-byte piece of a group's block is
// 8 rows x 4 columns, one row per 32-bit lane, so a 4-byte activation broadcast against it gives
// every row four products and no horizontal sums are needed until the very end.
//
// Without VNNI the int8 dot is VPMADDUBSW (u8 x s8 -> pairs summed to int16, saturating) then
// VPMADDWD by ones (int16 pairs -> int32):
// - Q8 weights are stored as q + 128; XOR 0x80 gives q back, and |q| x (x with q's sign) keeps each
//   int16 pair below 2 * 128 * 127 < 32768 (the sign trick of ggml's AVX2 path), exact for all q.
// - Q4 nibbles (0..15) multiply the activations directly: a pair is at most 2 * 15 * 127, so a whole
//   block's eight VPMADDUBSW sums fit in int16 before one VPMADDWD; the stored offset 8 comes off as
//   8 * sum(xq) per block.
// Activations are quantized once per matmul (avx2_quantize_act), bit-identical to
// quant::quantize_activations, and kept as plain int8 rows. Decode (up to kMaxStream activation rows:
// a few sequences, or a token's two-term activations) streams a super-group (32 rows) at a time;
// prefill runs register tiles of kMR activation rows x one group over L2-sized chunks.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/avx2/avx2_util.h"
#include "kernels/kernel_util.h"
#include "kernels/ggml_grouped.h"
#include "kernels/quant_layout.h"
#include "kernels/sparse_quant.h"

namespace corelm {
namespace quant {
namespace {

constexpr int kPrefetchBlocks = 8;  // decode prefetches this many block rows ahead along its stream
const bool kPrefetch = decode_prefetch(true);  // kernel_util.h: Zen 3 needs it

// Decode's software prefetch: the block row kPrefetchBlocks ahead of the one at qs (qstride bytes each).
inline void prefetch_ahead(const uint8_t* qs, int64_t qstride) {
  if (!kPrefetch) return;
  for (int64_t o = 0; o < qstride; o += 64) _mm_prefetch((const char*)qs + kPrefetchBlocks * qstride + o, _MM_HINT_T0);
}

using QuantAct = PlainAct<int8_t>;  // the activation buffer: quant_layout.h
using QuantAct16 = PlainAct<int16_t>;

// One block of activations (the `left` floats from x that exist, zeros after) quantized bit for bit
// as quant::quantize_activations<E> into out[32]; returns the scale, *s the sum of the quants.
template <class E>
inline float quantize_act_block(const float* x, int64_t left, E* out, int32_t* s) {
  constexpr float kMax = sizeof(E) == 1 ? 127.f : 32767.f;
  __m256 v[4];
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) {
    v[i] = left >= 8 * (i + 1) ? _mm256_loadu_ps(x + 8 * i)
           : left > 8 * i      ? _mm256_maskload_ps(x + 8 * i, tail_mask(left - 8 * i))
                               : _mm256_setzero_ps();
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
  }
  const float d = hmax(amax) / kMax;
  const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));  // MXCSR: nearest even
  *s = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
  // int32 -> int16 (-> int8): |q| <= kMax, no saturation; the packs interleave 128-bit lanes, the permutes undo it
  const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
  if constexpr (sizeof(E) == 2) {
    _mm256_storeu_si256((__m256i*)out, _mm256_permute4x64_epi64(w01, 0xd8));
    _mm256_storeu_si256((__m256i*)(out + 16), _mm256_permute4x64_epi64(w23, 0xd8));
  } else {
    const __m256i w8 = _mm256_packs_epi16(w01, w23);
    _mm256_storeu_si256((__m256i*)out, _mm256_permutevar8x32_epi32(w8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  return d;
}

template <class E>
void quantize_act(const float* x, int64_t m, int64_t ldx, int64_t K, int64_t nb, WeightType type, const PlainAct<E>& qa) {
  // the stored offset each block sum carries (see QuantActT)
  const int32_t offset = type == WeightType::Q4 ? 8 : sizeof(E) == 2 && type == WeightType::Q8 ? 128 : 0;
  for (int64_t i = 0; i < m; i++)
    for (int64_t b = 0; b < nb; b++) {
      int32_t s;
      const int64_t ib = i * nb + b;
      const float d = quantize_act_block(x + i * ldx + b * kBlock, K - b * kBlock, qa.q + ib * kBlock, &s);
      qa.dx[ib] = d;
      qa.dxs[ib] = d * (float)s;
      qa.corr[ib] = -offset * s;
    }
}

inline __m256i bcast4(const int8_t* p) {  // 4 activation bytes to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// An empty asm that says v changed here: the sums before and after it can't be reassociated. Without
// it GCC turns a block's chained adds into a tree, keeps all 32 products live and spills most of them
// (55 stack accesses per block in the Q4 decode loop).
template <class V>
inline void pin(V& v) { __asm__("" : "+x"(v)); }

inline __m256 scales8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// ---------------------------------------------------------------------------------------------
// Decode (m <= kStreamRows rows, in strips of kMaxStream): NG groups of one super-group against MR activation rows, block by
// block in the order they are stored, so the weights are one sequential stream whatever MR is; each
// weight piece (Q8: its sign and magnitude, Q4: its nibbles) is prepared once for the MR rows and
// each activation broadcast serves two groups. out[g * MR + i] = group g's 8 results for row i.
constexpr int kMaxStream = 4;     // activation rows one pass over the weights serves
constexpr int64_t kStreamRows = 8;  // up to this many rows, strips of kMaxStream stream; more: the prefill tiles

// Decode's walk over the NG groups of a super-group, block row by block row in the order they are
// stored: pair(b, qs, dp, g0, facc) adds block b of groups g0 and g0 + 1 (the one group when NG == 1)
// for MR activation rows to facc[g * MR + i]. Two groups side by side, then the next two: from DRAM,
// one Zen 3 core read q4 at 0.90 of a plain read this way against 0.83 with all four side by side
// (0.80 one after another), q8 at 0.82 against 0.74 (tools/bench/bench_quant.py --stream).
template <int NG, int MR, class Pair>
inline void stream_blocks(const GroupView& v, int64_t nb, __m256 out[NG * MR], Pair pair) {
  __m256 facc[NG * MR];
  for (int j = 0; j < NG * MR; j++) facc[j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* qs = v.qs + b * v.qstride;
    prefetch_ahead(qs, v.qstride);
    for (int g0 = 0; g0 < NG; g0 += 2) pair(b, qs, v.d + b * v.dstride, g0, facc);
  }
  for (int j = 0; j < NG * MR; j++) out[j] = facc[j];
}

template <WeightType T, int NG, int MR>
inline void gemv_groups(const QuantAct& qx, const GroupView& v, int64_t nb, __m256 out[NG * MR]) {
  constexpr int64_t QSB = T == WeightType::Q8 ? 256 : 128;
  constexpr int kPair = NG < 2 ? NG : 2;
  // each activation broadcast serves both groups of the pair
  stream_blocks<NG, MR>(v, nb, out, [&](int64_t b, const uint8_t* qs, const uint16_t* dp, int g0, __m256* facc) {
      __m256i acc[kPair][MR];  // Q4: int16 sums until the block ends
      for (int g = 0; g < kPair; g++)
        for (int i = 0; i < MR; i++) acc[g][i] = _mm256_setzero_si256();
      if constexpr (T == WeightType::Q8) {
        for (int p = 0; p < 8; p++) {
          __m256i x4[MR];
          for (int i = 0; i < MR; i++) x4[i] = bcast4(qx.q + (i * nb + b) * kBlock + 4 * p);
          for (int g = 0; g < kPair; g++) {
            const __m256i q = _mm256_xor_si256(_mm256_load_si256((const __m256i*)(qs + (g0 + g) * QSB + 32 * p)),
                                               _mm256_set1_epi8((char)0x80));
            const __m256i aq = _mm256_abs_epi8(q);
            for (int i = 0; i < MR; i++) {
              acc[g][i] = _mm256_add_epi32(
                  acc[g][i], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(x4[i], q)), _mm256_set1_epi16(1)));
              pin(acc[g][i]);
            }
          }
        }
      } else {
        const __m256i m4 = _mm256_set1_epi8(0x0f);
        for (int u = 0; u < 2; u++)
          for (int h = 0; h < 2; h++) {
            __m256i xlo[MR], xhi[MR];
            for (int i = 0; i < MR; i++) {
              const int8_t* xb = qx.q + (i * nb + b) * kBlock;
              xlo[i] = bcast4(xb + 4 * (4 * u + h)), xhi[i] = bcast4(xb + 4 * (4 * u + 2 + h));
            }
            for (int g = 0; g < kPair; g++) {
              const __m256i w = _mm256_load_si256((const __m256i*)(qs + (g0 + g) * QSB + 64 * u + 32 * h));
              const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
              for (int i = 0; i < MR; i++) {
                acc[g][i] = _mm256_add_epi16(acc[g][i], _mm256_maddubs_epi16(lo, xlo[i]));
                acc[g][i] = _mm256_add_epi16(acc[g][i], _mm256_maddubs_epi16(hi, xhi[i]));
                pin(acc[g][i]);
              }
            }
          }
      }
      for (int g = 0; g < kPair; g++) {
        const __m256 ws = scales8(dp + 8 * (g0 + g));
        for (int i = 0; i < MR; i++) {
          const int64_t ib = i * nb + b;
          __m256i a = acc[g][i];
          if constexpr (T != WeightType::Q8) a = _mm256_madd_epi16(a, _mm256_set1_epi16(1));
          if constexpr (T == WeightType::Q4) a = _mm256_add_epi32(a, _mm256_set1_epi32(qx.corr[ib]));  // stored offset 8
          __m256& f = facc[(g0 + g) * MR + i];
          f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(ws, _mm256_set1_ps(qx.dx[ib])), f);
          if constexpr (T == WeightType::Q4M)
            f = _mm256_fmadd_ps(scales8(v.m + b * v.dstride + 8 * (g0 + g)), _mm256_set1_ps(qx.dxs[ib]), f);
        }
      }
  });
}

// Stores the rows of a group (first row r0) that fall in [n0, n1); adds to y unless `first`.
inline void store_rows(float* yp, int64_t r0, int64_t n0, int64_t n1, __m256 r, bool first) {
  if (r0 >= n0 && r0 + kGroup <= n1) {
    if (!first) r = _mm256_add_ps(r, _mm256_loadu_ps(yp));
    _mm256_storeu_ps(yp, r);
    return;
  }
  const __m256i keep = lane_mask(n0 - r0, n1 - r0);
  if (!first) r = _mm256_add_ps(r, _mm256_maskload_ps(yp, keep));
  _mm256_maskstore_ps(yp, keep, r);
}

// Rows [n0, n1) for MR activation rows: whole super-groups at once, the groups of a partly covered
// one one by one. (gemv16_groups, for int16 activations, is declared further down.)
template <WeightType T, int NG, int MR>
inline void gemv16_groups(const PlainAct<int16_t>& qx, const GroupView& v, int64_t nb, __m256 out[NG * MR]);

template <WeightType T, int MR, class E>
void gemv(const PlainAct<E>& qx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = nblocks(w), groups = ngroups(w.rows), g_end = (n1 + kGroup - 1) / kGroup;
  auto groups_of = [&](auto ng, const GroupView& v, __m256* r) {
    if constexpr (sizeof(E) == 2) gemv16_groups<T, decltype(ng)::value, MR>(qx, v, nb, r);
    else gemv_groups<T, decltype(ng)::value, MR>(qx, v, nb, r);
  };
  for (int64_t g = n0 / kGroup; g < g_end;) {
    const GroupView v = group_view(w.data(), T, nb, groups, g);
    __m256 r[kSuper * MR];
    int ng = 1;
    if (g == v.first && v.ns == kSuper && g + kSuper <= g_end) {
      groups_of(std::integral_constant<int, kSuper>(), v, r);
      ng = kSuper;
    } else {
      groups_of(std::integral_constant<int, 1>(), v, r);
    }
    for (int j = 0; j < ng; j++, g++)
      for (int i = 0; i < MR; i++) store_rows(y + i * ldy + g * kGroup, g * kGroup, n0, n1, r[j * MR + i], true);
  }
}

// ---------------------------------------------------------------------------------------------
// Prefill (m > 1): per chunk of kKC blocks along K and per chunk of groups that stays in L2, strips
// of up to kMR activation rows sweep the chunk one group at a time: each 32-byte weight piece is
// loaded (Q4: unpacked) once for the strip's rows, each row's broadcasts come from L1.
constexpr int kMR = 4;                      // activation rows per tile (16 ymm registers)
constexpr int64_t kKC = 32;                 // blocks per K chunk: a strip's 4 x 32 x 32 B in L1
constexpr int64_t kChunkBytes = 256 << 10;  // weight bytes per (K chunk, group chunk): L2

template <WeightType T, int MR>
void tile(const QuantAct& qr, int64_t nb, int64_t i0, int64_t b0, int64_t nbk, const GroupView& v, int64_t r0,
          float* y, int64_t ldy, int64_t n0, int64_t n1, bool first) {
  __m256 facc[MR];
  for (int i = 0; i < MR; i++) facc[i] = _mm256_setzero_ps();
  for (int64_t b = b0; b < b0 + nbk; b++) {
    const uint8_t* qs = v.qs + b * v.qstride;
    const __m256 ws = scales8(v.d + b * v.dstride);
    const __m256 wm = T == WeightType::Q4M ? scales8(v.m + b * v.dstride) : _mm256_setzero_ps();
    __m256i acc[MR];
    if constexpr (T == WeightType::Q8) {
      for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_si256();
      // Unrolled: as a loop GCC kept three of the four int32 sums on the stack (a store-forwarding
      // round trip per piece); unrolled they stay in registers, 1.6x the GEMM's GOP/s.
#pragma GCC unroll 8
      for (int p = 0; p < 8; p++) {
        const __m256i q = _mm256_xor_si256(_mm256_load_si256((const __m256i*)(qs + 32 * p)), _mm256_set1_epi8((char)0x80));
        const __m256i aq = _mm256_abs_epi8(q);
        for (int i = 0; i < MR; i++) {
          const __m256i x4 = bcast4(qr.q + ((i0 + i) * nb + b) * kBlock + 4 * p);
          acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(x4, q)),
                                                              _mm256_set1_epi16(1)));
          pin(acc[i]);
        }
      }
    } else {
      const __m256i m4 = _mm256_set1_epi8(0x0f);
      for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int u = 0; u < 2; u++)
        for (int h = 0; h < 2; h++) {
          const __m256i w = _mm256_load_si256((const __m256i*)(qs + 64 * u + 32 * h));
          const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
          for (int i = 0; i < MR; i++) {
            const int8_t* xb = qr.q + ((i0 + i) * nb + b) * kBlock;
            acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(lo, bcast4(xb + 4 * (4 * u + h))));
            acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(hi, bcast4(xb + 4 * (4 * u + 2 + h))));
            pin(acc[i]);
          }
        }
      for (int i = 0; i < MR; i++) acc[i] = _mm256_madd_epi16(acc[i], _mm256_set1_epi16(1));
    }
    for (int i = 0; i < MR; i++) {
      const int64_t ib = (i0 + i) * nb + b;
      if constexpr (T == WeightType::Q4) acc[i] = _mm256_add_epi32(acc[i], _mm256_set1_epi32(qr.corr[ib]));
      facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), _mm256_mul_ps(ws, _mm256_set1_ps(qr.dx[ib])), facc[i]);
      if constexpr (T == WeightType::Q4M)
        facc[i] = _mm256_fmadd_ps(wm, _mm256_set1_ps(qr.dxs[ib]), facc[i]);
    }
  }
  for (int i = 0; i < MR; i++) store_rows(y + (i0 + i) * ldy + r0, r0, n0, n1, facc[i], first);
}

// ---------------------------------------------------------------------------------------------
// int16 activations (ActType::I16). A weight piece's stored bytes are widened unsigned to int16 by
// unpacking against zero, 16 bytes per register in each 128-bit lane's order: lo holds rows 0,1 (lane
// 0) and 4,5 (lane 1), hi rows 2,3 and 6,7, each row's four columns side by side. VPMADDWD against the
// piece's four activations (one 8-byte broadcast) adds two columns per int32 lane, and one VPHADDD at
// the block's end gives rows 0..7 in order. The unsigned read adds the stored offset (Q8 128, Q4 8)
// times the block's activation sum, which corr takes off. A lane sums 16 products of at most
// 255 * 32767 per block, so int32 holds a block exactly. On Zen 3 VPMADDWD issues about twice as
// often as VPMADDUBSW, so a Q8 piece costs about what the int8 path's sign trick does.
inline __m256i bcast8(const int16_t* p) {  // 4 activations to every 64-bit lane
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_set1_epi64x(v);
}

// acc0/acc1 (rows 0,1,4,5 / 2,3,6,7) += one piece (stored bytes, 8 rows x 4 columns) times x.
inline void dot16(__m256i& acc0, __m256i& acc1, __m256i lo, __m256i hi, __m256i x) {
  acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(lo, x));
  acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(hi, x));
  pin(acc0), pin(acc1);
}

// Calls piece(p, lo, hi) for the 8 pieces of the blocks of G groups (group g at qs + g * gstride),
// lo[g] and hi[g] the piece of group g widened to int16 (Q4: its nibbles), so one activation broadcast
// serves all G groups.
template <WeightType T, int G, class Piece>
inline void for_pieces16(const uint8_t* qs, int64_t gstride, Piece piece) {
  const __m256i zero = _mm256_setzero_si256();
  __m256i lo[G], hi[G];
  if constexpr (T == WeightType::Q8) {
#pragma GCC unroll 8
    for (int p = 0; p < 8; p++) {
      for (int g = 0; g < G; g++) {
        __m256i w = _mm256_load_si256((const __m256i*)(qs + g * gstride + 32 * p));
        pin(w);  // one load for both halves (GCC otherwise loads the piece twice)
        lo[g] = _mm256_unpacklo_epi8(w, zero), hi[g] = _mm256_unpackhi_epi8(w, zero);
      }
      piece(p, lo, hi);
    }
  } else {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
#pragma GCC unroll 4
    for (int uh = 0; uh < 4; uh++) {  // 32 bytes at 32 * uh: pieces 4u + h (low nibbles), 4u + 2 + h (high)
      const int u = uh >> 1, h = uh & 1;
      __m256i hi4[G];
      for (int g = 0; g < G; g++) {
        const __m256i w = _mm256_load_si256((const __m256i*)(qs + g * gstride + 32 * uh));
        const __m256i lo4 = _mm256_and_si256(w, m4);
        hi4[g] = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
        lo[g] = _mm256_unpacklo_epi8(lo4, zero), hi[g] = _mm256_unpackhi_epi8(lo4, zero);
      }
      piece(4 * u + h, lo, hi);
      for (int g = 0; g < G; g++) lo[g] = _mm256_unpacklo_epi8(hi4[g], zero), hi[g] = _mm256_unpackhi_epi8(hi4[g], zero);
      piece(4 * u + 2 + h, lo, hi);
    }
  }
}

// A block's 8 row sums (in order) with the stored offset taken off, as floats times the two scales.
inline __m256 block_sum16(__m256i acc0, __m256i acc1, int32_t corr, __m256 ws, float dx, __m256 f) {
  const __m256i r = _mm256_add_epi32(_mm256_hadd_epi32(acc0, acc1), _mm256_set1_epi32(corr));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(r), _mm256_mul_ps(ws, _mm256_set1_ps(dx)), f);
}

// Decode with int16 activations: as gemv_groups (two groups side by side, one sequential stream),
// for MR <= kMaxStream16 rows (two accumulators per group and row).
// Up to kStreamRows16 rows stream in strips of two over L2-sized pieces of the weights (for_l2_pieces),
// so that only the first strip reads a piece from memory; more go to the prefill tiles. (Strips over
// the whole matrix read it once per strip, and lost to the tiles from 3 rows on.) This table on a Zen 5
// core, bench_gemv_stream on Qwen2.5-0.5B's shapes, GB/s for 3 / 4 / 8 / 16 rows against the tiles: q4
// 6.1 / 4.9 / 3.4 / 2.1 -> 10.7 / 8.6 / 4.5 / 2.3, q8 10.9 / 10.3 / 7.0 / 4.3 -> 19.5 / 16.9 / 9.5 / 5.1.
constexpr int kMaxStream16 = 2;
constexpr int64_t kStreamRows16 = kRowExactRows;

template <WeightType T, int NG, int MR>
inline void gemv16_groups(const QuantAct16& qx, const GroupView& v, int64_t nb, __m256 out[NG * MR]) {
  constexpr int64_t QSB = T == WeightType::Q8 ? 256 : 128;
  constexpr int kPair = NG < 2 ? NG : 2;
  stream_blocks<NG, MR>(v, nb, out, [&](int64_t b, const uint8_t* qs, const uint16_t* dp, int g0, __m256* facc) {
      __m256i acc0[kPair][MR], acc1[kPair][MR];
      for (int g = 0; g < kPair; g++)
        for (int i = 0; i < MR; i++) acc0[g][i] = acc1[g][i] = _mm256_setzero_si256();
      for_pieces16<T, kPair>(qs + g0 * QSB, QSB, [&](int p, const __m256i* lo, const __m256i* hi) {
        for (int i = 0; i < MR; i++) {
          const __m256i x = bcast8(qx.q + (i * nb + b) * kBlock + 4 * p);
          for (int g = 0; g < kPair; g++) dot16(acc0[g][i], acc1[g][i], lo[g], hi[g], x);
        }
      });
      for (int g = 0; g < kPair; g++) {
        const __m256 ws = scales8(dp + 8 * (g0 + g));
        for (int i = 0; i < MR; i++) {
          const int64_t ib = i * nb + b;
          __m256& f = facc[(g0 + g) * MR + i];
          f = block_sum16(acc0[g][i], acc1[g][i], qx.corr[ib], ws, qx.dx[ib], f);
          if constexpr (T == WeightType::Q4M)
            f = _mm256_fmadd_ps(scales8(v.m + b * v.dstride + 8 * (g0 + g)), _mm256_set1_ps(qx.dxs[ib]), f);
        }
      }
  });
}

// Prefill with int16 activations: the tile of `tile` with two accumulators per row, kMR16 rows.
constexpr int kMR16 = 4;

template <WeightType T, int MR>
void tile16(const QuantAct16& qr, int64_t nb, int64_t i0, int64_t b0, int64_t nbk, const GroupView& v, int64_t r0,
            float* y, int64_t ldy, int64_t n0, int64_t n1, bool first) {
  __m256 facc[MR];
  for (int i = 0; i < MR; i++) facc[i] = _mm256_setzero_ps();
  for (int64_t b = b0; b < b0 + nbk; b++) {
    __m256i acc0[MR], acc1[MR];
    for (int i = 0; i < MR; i++) acc0[i] = acc1[i] = _mm256_setzero_si256();
    for_pieces16<T, 1>(v.qs + b * v.qstride, 0, [&](int p, const __m256i* lo, const __m256i* hi) {
      for (int i = 0; i < MR; i++) dot16(acc0[i], acc1[i], lo[0], hi[0], bcast8(qr.q + ((i0 + i) * nb + b) * kBlock + 4 * p));
    });
    const __m256 ws = scales8(v.d + b * v.dstride);
    for (int i = 0; i < MR; i++) {
      const int64_t ib = (i0 + i) * nb + b;
      facc[i] = block_sum16(acc0[i], acc1[i], qr.corr[ib], ws, qr.dx[ib], facc[i]);
      if constexpr (T == WeightType::Q4M)
        facc[i] = _mm256_fmadd_ps(scales8(v.m + b * v.dstride), _mm256_set1_ps(qr.dxs[ib]), facc[i]);
    }
  }
  for (int i = 0; i < MR; i++) store_rows(y + (i0 + i) * ldy + r0, r0, n0, n1, facc[i], first);
}

template <WeightType T, class E>
void tile_rows(int mr, const PlainAct<E>& qr, int64_t nb, int64_t i0, int64_t b0, int64_t nbk, const GroupView& v,
               int64_t r0, float* y, int64_t ldy, int64_t n0, int64_t n1, bool first) {
  static_assert(kMR == 4 && kMR16 == 4, "one case per strip height");
  switch (mr) {
#define CORELM_TILE(R)                                                                   \
  case R:                                                                                \
    if constexpr (sizeof(E) == 2) return tile16<T, R>(qr, nb, i0, b0, nbk, v, r0, y, ldy, n0, n1, first); \
    else return tile<T, R>(qr, nb, i0, b0, nbk, v, r0, y, ldy, n0, n1, first);
    CORELM_TILE(4)
    CORELM_TILE(3)
    CORELM_TILE(2)
    default: CORELM_TILE(1)
#undef CORELM_TILE
  }
}

template <WeightType T, class E>
void gemm(const PlainAct<E>& qr, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = nblocks(w), groups = ngroups(w.rows), g_end = (n1 + kGroup - 1) / kGroup;
  const int64_t nc = std::max<int64_t>(1, kChunkBytes / (kKC * qs_bytes(T)));  // groups per chunk
  for (int64_t b0 = 0; b0 < nb; b0 += kKC) {
    const int64_t nbk = std::min(kKC, nb - b0);
    for (int64_t c0 = n0 / kGroup; c0 < g_end; c0 += nc) {
      const int64_t c1 = std::min(c0 + nc, g_end);
      for (int64_t i0 = 0; i0 < m; i0 += kMR) {
        const int mr = (int)std::min<int64_t>(kMR, m - i0);
        for (int64_t g = c0; g < c1; g++)
          tile_rows<T>(mr, qr, nb, i0, b0, nbk, group_view(w.data(), T, nb, groups, g), g * kGroup, y, ldy, n0, n1,
                       b0 == 0);
      }
    }
  }
}

// Activation rows [i0, i0 + rows) of qa as an input of their own.
template <class E>
inline PlainAct<E> act_rows(const PlainAct<E>& qa, int64_t nb, int64_t i0) {
  return {qa.q + i0 * nb * kBlock, qa.dx + i0 * nb, qa.dxs + i0 * nb, qa.corr + i0 * nb};
}

template <WeightType T, class E>
void matmul_t(const PlainAct<E>& qa, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if (m > (sizeof(E) == 2 ? kStreamRows16 : kStreamRows)) return gemm<T>(qa, m, w, y, ldy, n0, n1);
  constexpr int strip = sizeof(E) == 2 ? kMaxStream16 : kMaxStream;
  static_assert(kMaxStream == 4 && kMaxStream16 == 2, "one case per streamed row count");
  const int64_t nb = nblocks(w);
  for_l2_pieces(w, n0, n1, kChunkBytes, [&](int64_t a0, int64_t a1) {
    for (int64_t i0 = 0; i0 < m; i0 += strip) {  // strips of up to `strip` rows, one stream each
      const PlainAct<E> a = act_rows(qa, nb, i0);
      float* yi = y + i0 * ldy;
      const int64_t rows = std::min<int64_t>(strip, m - i0);
      if constexpr (sizeof(E) == 2) {
        if (rows == 1) gemv<T, 1>(a, w, yi, ldy, a0, a1);
        else gemv<T, 2>(a, w, yi, ldy, a0, a1);
      } else {
        switch (rows) {
          case 1: gemv<T, 1>(a, w, yi, ldy, a0, a1); break;
          case 2: gemv<T, 2>(a, w, yi, ldy, a0, a1); break;
          case 3: gemv<T, 3>(a, w, yi, ldy, a0, a1); break;
          default: gemv<T, 4>(a, w, yi, ldy, a0, a1); break;
        }
      }
    }
  });
}

template <class E>
void matmul_any(const void* qa, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const PlainAct<E> a = plain_act_view<E>(const_cast<void*>(qa), m, nblocks(w));
  if (w.type == WeightType::Q8) return matmul_t<WeightType::Q8>(a, m, w, y, ldy, n0, n1);
  if (w.type == WeightType::Q4) return matmul_t<WeightType::Q4>(a, m, w, y, ldy, n0, n1);
  return matmul_t<WeightType::Q4M>(a, m, w, y, ldy, n0, n1);
}

// ---------------------------------------------------------------------------------------------
// Sparse Q8/Q4 (kernels/sparse_quant.h): panels expanded into the dense layout, 8 positions per
// PSHUFB: for each byte of a window's mask, a table gives the shuffle that moves the next codes to
// the set positions (0x80 elsewhere) and the byte mask of those positions, under which the zero code
// is filled in.
struct ExpandTables {
  uint64_t shuffle[256], bytes[256];
  ExpandTables() {
    for (int v = 0; v < 256; v++) {
      uint64_t s = 0, b = 0;
      for (int i = 0, k = 0; i < 8; i++) {
        const uint64_t set = v >> i & 1;
        s |= (set ? (uint64_t)k++ : 0x80ull) << (8 * i);
        b |= (set ? 0xffull : 0ull) << (8 * i);
      }
      shuffle[v] = s, bytes[v] = b;
    }
  }
};
const ExpandTables kExpand;

// A window of 64 codes (one byte each at src) expanded under mask into out; returns the codes read.
inline int expand_window(uint64_t mask, const uint8_t* src, uint8_t zero, uint8_t* out) {
  const __m128i z = _mm_set1_epi8((char)zero);
  int k = 0;
  for (int j = 0; j < 8; j++) {
    const unsigned mb = (unsigned)(mask >> (8 * j)) & 0xff;
    const __m128i codes = _mm_loadl_epi64((const __m128i*)(src + k));
    const __m128i v = _mm_shuffle_epi8(codes, _mm_loadl_epi64((const __m128i*)&kExpand.shuffle[mb]));
    _mm_storel_epi64((__m128i*)(out + 8 * j), _mm_or_si128(v, _mm_andnot_si128(_mm_loadl_epi64((const __m128i*)&kExpand.bytes[mb]), z)));
    k += __builtin_popcount(mb);
  }
  return k;
}

template <WeightType T>
void sparse_expand(const PackedMatrix& w, int64_t s0, int64_t s1, uint8_t* dst) {
  sparse::expand_grouped(w, s0, s1, dst, [](const uint8_t* masks, const uint8_t* p, uint8_t* q) {
    uint64_t mk[4];
    std::memcpy(mk, masks, 32);
    alignas(32) uint8_t e[256], nib[2][64 + 16];
    if constexpr (T == WeightType::Q8) {
      for (int t = 0; t < 4; t++) p += expand_window(mk[t], p, 0x80, e + 64 * t);
    } else {  // windows 2u and 2u + 1: the low and high nibbles of one run of bytes, as bytes first
      const __m256i m4 = _mm256_set1_epi8(0x0f);
      for (int u = 0; u < 2; u++) {
        for (int h = 0; h < 2; h++) {
          const __m256i x = _mm256_loadu_si256((const __m256i*)(p + 32 * h));
          _mm256_storeu_si256((__m256i*)(nib[0] + 32 * h), _mm256_and_si256(x, m4));
          _mm256_storeu_si256((__m256i*)(nib[1] + 32 * h), _mm256_and_si256(_mm256_srli_epi16(x, 4), m4));
        }
        const int n0 = expand_window(mk[2 * u], nib[0], 8, e + 128 * u);
        const int n1 = expand_window(mk[2 * u + 1], nib[1], 8, e + 128 * u + 64);
        p += std::max(n0, n1);
      }
    }
    if constexpr (T == WeightType::Q8) {
      std::memcpy(q, e, 256);
    } else {  // vector u: W_{2u} in the low nibbles, W_{2u+1} in the high ones
      for (int u = 0; u < 2; u++)
        for (int h = 0; h < 2; h++) {
          const __m256i a = _mm256_load_si256((const __m256i*)(e + 128 * u + 32 * h));
          const __m256i b = _mm256_load_si256((const __m256i*)(e + 128 * u + 64 + 32 * h));
          _mm256_storeu_si256((__m256i*)(q + 64 * u + 32 * h), _mm256_or_si256(a, _mm256_slli_epi16(b, 4)));
        }
    }
    return p;
  });
}

}  // namespace

PackedMatrix avx2_pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par) {
  if (sparse::is_sparse_quant(type)) return sparse::quant_pack(src, rows, cols, type, par, &kAvx2Kernels);
  require_packable(type);
  return grouped_pack(src, rows, cols, type, par, &kAvx2Kernels);
}

PackedMatrix avx2_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par) {
  if (sparse::is_sparse(type)) return sparse::pack_raw(type, raw, rows, cols, par, &kAvx2Kernels);
  if (sparse::is_sparse_quant(type)) return sparse::quant_pack_raw(type, raw, rows, cols, par, &kAvx2Kernels);
  if (is_grouped_ggml(type)) return grouped_ggml_pack_raw(type, raw, rows, cols, par, &kAvx2Kernels);
  if (is_ggml_block(type)) return ggml_pack_raw(type, raw, rows, cols, &kAvx2Kernels);
  return grouped_pack_raw(type, raw, rows, cols, par, &kAvx2Kernels);
}

size_t avx2_quant_act_bytes(const PackedMatrix& w, int64_t m, ActType act) {
  if (sparse::is_sparse_quant(w.type)) return avx2_quant_act_bytes(sparse::as_dense_type(w), m, act);
  if (is_grouped_ggml(w.type)) return ggml_act_bytes(w, m, ActType::I16);  // int16 quants either way
  if (is_ggml_block(w.type)) return ggml_act_bytes(w, m, act);
  return is_quant(w.type) && m >= 1 ? plain_act_bytes(m, nblocks(w), act_elem_bytes(act)) : 0;
}

void avx2_quantize_act(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act, void* qa) {
  if (sparse::is_sparse_quant(w.type)) return avx2_quantize_act(x, m, ldx, sparse::as_dense_type(w), act, qa);
  if (is_grouped_ggml(w.type)) return grouped_ggml_quantize_act_avx2(x, m, ldx, w, act, qa);
  if (is_ggml_block(w.type)) return ggml_quantize_act(x, m, ldx, w, act, qa);
  const int64_t nb = nblocks(w);
  if (act == ActType::I16) return quantize_act(x, m, ldx, w.cols, nb, w.type, plain_act_view<int16_t>(qa, m, nb));
  quantize_act(x, m, ldx, w.cols, nb, w.type, plain_act_view<int8_t>(qa, m, nb));
}

void avx2_matmul_quant(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                       int64_t n0, int64_t n1) {
  n1 = std::min(n1, w.rows);
  if (n0 >= n1) return;
  // sparse Q8/Q4: panels expanded into the dense layout, multiplied by the dense kernels
  if (sparse::is_sparse_quant(w.type))
    return sparse::quant_matmul_panels(qa, m, act, w, y, ldy, n0, n1, sparse::DenseLayout::Grouped, avx2_matmul_quant,
                                       sparse::expand_supers_avx2);
  if (is_grouped_ggml(w.type)) return grouped_ggml_matmul_avx2(qa, m, w, y, ldy, n0, n1);
  if (is_ggml_block(w.type)) return ggml_matmul_quant_avx2(qa, m, act, w, y, ldy, n0, n1);
  if (act == ActType::I16) return matmul_any<int16_t>(qa, m, w, y, ldy, n0, n1);
  matmul_any<int8_t>(qa, m, w, y, ldy, n0, n1);
}

void avx2_matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                 int64_t n1) {
  thread_local std::vector<uint8_t, AlignedAlloc<uint8_t>> qa;
  qa.resize(avx2_quant_act_bytes(w, m, ActType::I8));
  avx2_quantize_act(x, m, ldx, w, ActType::I8, qa.data());
  avx2_matmul_quant(qa.data(), m, ActType::I8, w, y, ldy, n0, n1);
}

}  // namespace quant
}  // namespace corelm

namespace corelm {
namespace sparse {
void expand_supers_avx2(const PackedMatrix& w, int64_t s0, int64_t s1, uint8_t* dst) {
  if (w.type == WeightType::SQ8) return quant::sparse_expand<WeightType::Q8>(w, s0, s1, dst);
  quant::sparse_expand<WeightType::Q4>(w, s0, s1, dst);
}
}  // namespace sparse
}  // namespace corelm
