// AVX-512 kernels for the block-quantized formats (Q8, Q4, Q4M; arithmetic in quant_formats.h).
//
// Layout: quant_layout.h (rows in groups of 8, four groups interleaved block by block, one stream).
// A group's 256 quant bytes of a block are four vectors W_t (t = 0..3) whose 32-bit lane l holds row
// l%8, columns 8t + 4*(l/8) + 0..3. So one VPDPBUSD of W_t against an activation vector holding
// columns 8t..8t+3 in lanes 0..7 and 8t+4..8t+7 in lanes 8..15 adds four products to every row's two
// partial sums at once, and the per-row scale is a broadcast of 8 values to both halves: no
// horizontal sums inside the loop. Q8 stores q + 128 (VPDPBUSD multiplies unsigned weights by
// signed activations; the 128*sum(xq) this adds is taken back once per block). Q4/Q4M hold the u4
// quants of W_{2u} in the low and of W_{2u+1} in the high nibbles of vector u; Q4 subtracts
// 8*sum(xq) per block, Q4M adds m*dx*sum(xq).
//
// The activations are quantized once per matmul (avx512_quantize_act, bit-identical to
// quant::quantize_activations; the model shares one quantization among a thread's row ranges) and
// used in the lane order above. Decode streams a super-group at a time; prefill (m > 1) runs
// register tiles of several activation rows x two groups over L1/L2-sized chunks (see gemm below).
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/tuning.h"
#include "kernels/avx512/int_dot.h"
#include "kernels/avx512/panel_gemm.h"
#include "kernels/decode_store.h"
#include "kernels/ggml_grouped.h"
#include "kernels/prefetch.h"
#include "kernels/quant_layout.h"
#include "kernels/sparse_quant.h"

namespace corelm {
namespace quant {
namespace {

// Decode's software prefetch (kernel_util.h): the block row about kPrefetchBytes ahead into L2, its
// lines in one chain (prefetch.h). One Xeon core, bench_gemv_stream on Qwen2.5-1.5B's shapes, share of
// a plain read: q4 0.88 -> 1.06, q8 0.85 -> 1.05 (int8 activations 0.90 -> 1.03, 0.81 -> 1.05); two
// threads 0.82 -> 1.01-1.03. Off by default on AMD, where the one AVX-512 core measured (Zen 4, an
// earlier prefetch into L1) streamed faster with the hardware prefetchers alone.
constexpr int64_t kPrefetchBytes = 8192;
const bool kPrefetch = decode_prefetch(!cpu_features().amd);
const bool kGroupMajor = decode_group_major(cpu_features().amd);

// The block row kPrefetchBytes ahead of the one at qs (qstride bytes), when prefetching.
inline void prefetch_ahead(const uint8_t* qs, int64_t qstride) {
  if (kPrefetch) prefetch_lines_l2(reinterpret_cast<const char*>(qs) + kPrefetchBytes, (qstride + 63) / 64);
}

// ---------------------------------------------------------------------------------------------
// One block of activations (the `left` floats from x that exist, zeros after) quantized bit for bit
// as quant::quantize_activations: the 32 int8 in the low 256 bits, its scale and its sum of quants.
inline __m512i quantize_act_block(const float* x, int64_t left, float* d, int32_t* s) {
  const __mmask16 m0 = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
  const __mmask16 m1 = left >= 32 ? (__mmask16)0xffff : left <= 16 ? (__mmask16)0 : (__mmask16)((1u << (left - 16)) - 1u);
  const __m512 sign = _mm512_set1_ps(-0.f);
  __m512 x0 = _mm512_maskz_loadu_ps(m0, x), x1 = _mm512_maskz_loadu_ps(m1, x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
  *d = amax / 127.f;
  const __m512 idv = _mm512_set1_ps(*d != 0.f ? 1.f / *d : 0.f);
  __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, idv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, idv));
  *s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  return _mm512_castsi256_si512(_mm256_setr_m128i(_mm512_cvtepi32_epi8(q0), _mm512_cvtepi32_epi8(q1)));
}

// A block's 32 int8 activations (low 256 bits of `bytes`) in W_t lane order for t = 0..3: lanes
// 0..7 = columns 8t..8t+3, lanes 8..15 = 8t+4..8t+7.
inline __m512i spread(__m512i bytes, int t) {
  const __m512i idx = _mm512_setr_epi32(2 * t, 2 * t, 2 * t, 2 * t, 2 * t, 2 * t, 2 * t, 2 * t, 2 * t + 1,
                                        2 * t + 1, 2 * t + 1, 2 * t + 1, 2 * t + 1, 2 * t + 1, 2 * t + 1, 2 * t + 1);
  return _mm512_permutexvar_epi32(idx, bytes);
}
inline void spread_block(__m512i bytes, int32_t* out) {  // all four, to out[16t..16t+15]
  for (int t = 0; t < 4; t++) _mm512_store_si512((void*)(out + 16 * t), spread(bytes, t));
}

// What each half of a row's sum gets per block for the stored weight offset: the weights are the
// stored bytes minus 128 (Q8) or minus 8 (Q4), so the dot with the stored bytes is too large by
// 128*sum(xq) or 8*sum(xq); half of it comes off each half.
inline int32_t half_correction(WeightType type, int32_t s) {
  return (type == WeightType::Q8 ? -64 : type == WeightType::Q4 ? -4 : 0) * s;
}

// Activations quantized once per matmul (avx512_quantize_act), shared by every [n0, n1) call on it:
// plain int8 rows, which decode spreads into W_t lane order in registers (four VPERMD per block for
// the whole super-group) and the GEMM a strip at a time into L1. (Decode used to keep every block
// spread, 256 bytes per block: at K = 4864 that is 38 KiB, more than L1, re-read from L2 for every
// super-group; on Zen 4 the kernel alone then streamed q4 at 0.47-0.63 of a plain read, now 0.82.)
// Per row and block: dx, dxs = dx * sum(xq) (multiplies Q4M's minimum) and corr, added to both
// halves of each row's sum.
struct QuantAct {
  int8_t* q;  // [m][nb][32]
  float *dx, *dxs;
  int32_t* corr;  // dx, dxs, corr: [m][nb]
};

inline size_t act_bytes(int64_t m, int64_t nb) { return (size_t)((32 + 12) * m * nb + 63) / 64 * 64; }  // quants, dx, dxs, corr

// The view of a 64-byte aligned buffer of act_bytes(m, nb).
inline QuantAct act_view(void* buf, int64_t m, int64_t nb) {
  int8_t* q = static_cast<int8_t*>(buf);
  float* dx = reinterpret_cast<float*>(q + 32 * m * nb);
  return {q, dx, dx + m * nb, reinterpret_cast<int32_t*>(dx + 2 * m * nb)};
}

void quantize_act(const float* x, int64_t m, int64_t ldx, int64_t K, int64_t nb, WeightType type, const QuantAct& qa) {
  for (int64_t i = 0; i < m; i++)
    for (int64_t b = 0; b < nb; b++) {
      float d;
      int32_t s;
      const __m512i bytes = quantize_act_block(x + i * ldx + b * kBlock, K - b * kBlock, &d, &s);
      _mm256_store_si256((__m256i*)(qa.q + (i * nb + b) * kBlock), _mm512_castsi512_si256(bytes));
      qa.dx[i * nb + b] = d;
      qa.dxs[i * nb + b] = d * (float)s;
      qa.corr[i * nb + b] = half_correction(type, s);
    }
}

inline __m512 scales8x2(const uint16_t* p) {  // 8 fp16 -> both halves of a vector
  return _mm512_broadcast_f32x8(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)));
}

// The four W_t vectors of one block.
template <WeightType T>
inline void load_w(const uint8_t* qs, __m512i w[4]) {
  if constexpr (T == WeightType::Q8) {
    for (int t = 0; t < 4; t++) w[t] = _mm512_load_si512((const void*)(qs + 64 * t));
  } else {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int u = 0; u < 2; u++) {
      __m512i p = _mm512_load_si512((const void*)(qs + 64 * u));
      w[2 * u] = _mm512_and_si512(p, m4);
      w[2 * u + 1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), m4);
    }
  }
}

// Block b of NG groups of one super-group (v: the first of them): each activation vector is loaded
// once for all NG groups; row sums (times the scales) and Q4M's minimum terms (low half only) go to
// acc, in the order the GEMM's tile adds them, so one row gets the same bits from either.
template <WeightType T, bool VNNI, int NG>
inline void gemv_block(const QuantAct& qx, const GroupView& v, int64_t b, __m512 acc[NG]) {
  constexpr int64_t QSB = qs_bytes(T);
  __m512i xq[4];
  const __m512i xb = _mm512_castsi256_si512(_mm256_load_si256((const __m256i*)(qx.q + b * kBlock)));
  for (int t = 0; t < 4; t++) xq[t] = spread(xb, t);
  const __m512i c = _mm512_set1_epi32(qx.corr[b]);
  const __m512 d = _mm512_set1_ps(qx.dx[b]);
  const uint8_t* qs = v.qs + b * v.qstride;
  const uint16_t* dp = v.d + b * v.dstride;
  prefetch_ahead(qs, v.qstride);
  for (int g = 0; g < NG; g++) {
    __m512i wv[4];
    load_w<T>(qs + g * QSB, wv);
    __m512i s = c;
    for (int t = 0; t < 4; t++) s = dpbusd<VNNI>(s, wv[t], xq[t]);
    acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scales8x2(dp + 8 * g), d), acc[g]);
    if constexpr (T == WeightType::Q4M)
      acc[g] = _mm512_fmadd_ps(_mm512_zextps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(v.m + b * v.dstride + 8 * g)))),
                               _mm512_set1_ps(qx.dxs[b]), acc[g]);
  }
}

constexpr int64_t kKC = 16;  // blocks per K chunk, shared with the GEMM (below), whose order decode follows

// NG groups of one super-group against the whole of x: out[g] = the group's 8 row results. Summed as
// the GEMM sums a row: one fp32 accumulator per K chunk of kKC blocks, its halves added at the chunk's
// end and the chunks added in order, so a token's logits do not depend on how many rows its step has
// (the NG groups' chains keep the FMAs busy: decode waits for memory, not for them).
template <WeightType T, bool VNNI, int NG>
inline void gemv_groups(const QuantAct& qx, const GroupView& v, int64_t nb, __m256 out[NG]) {
  for (int64_t b0 = 0; b0 < nb; b0 += kKC) {
    __m512 acc[NG];
    for (int g = 0; g < NG; g++) acc[g] = _mm512_setzero_ps();
    const int64_t b1 = std::min(nb, b0 + kKC);
    for (int64_t b = b0; b < b1; b++) gemv_block<T, VNNI, NG>(qx, v, b, acc);
    for (int g = 0; g < NG; g++) {
      const __m256 r = _mm256_add_ps(_mm512_castps512_ps256(acc[g]), _mm512_extractf32x8_ps(acc[g], 1));
      out[g] = b0 == 0 ? r : _mm256_add_ps(r, out[g]);
    }
  }
}

// Stores the rows of a group (first row r0) that fall in [n0, n1); adds to y unless `first`.
inline void store_rows(float* yp, int64_t r0, int64_t n0, int64_t n1, __m256 r, bool first) {
  __mmask8 keep = 0;
  for (int j = 0; j < kGroup; j++) keep |= (__mmask8)((r0 + j >= n0 && r0 + j < n1) << j);
  if (!first) r = _mm256_add_ps(r, _mm256_maskz_loadu_ps(keep, yp));
  _mm256_mask_storeu_ps(yp, keep, r);
}

// Decode's result for group g: its rows in [n0, n1), a whole group past the caches (decode_store.h;
// the walk ends with end_decode_stores).
inline void store_decode_group(float* y, int64_t g, int64_t n0, int64_t n1, __m256 r) {
  const bool whole = g * kGroup >= n0 && g * kGroup + kGroup <= n1;
  if (!(whole && stream_rows8(y + g * kGroup, r))) store_rows(y + g * kGroup, g * kGroup, n0, n1, r, true);
}

// Decode's walk over rows [n0, n1): whole super-groups at once, the groups of a partly covered one
// one by one; groups_of(std::integral_constant<int, NG>, view, out) computes NG groups' 8 rows each.
template <WeightType T, class GroupsOf>
void gemv_rows(const PackedMatrix& w, float* y, int64_t n0, int64_t n1, GroupsOf groups_of) {
  const int64_t nb = nblocks(w), groups = ngroups(w.rows), g_end = (n1 + kGroup - 1) / kGroup;
  for (int64_t g = n0 / kGroup; g < g_end;) {
    const GroupView v = group_view(w.data(), T, nb, groups, g);
    __m256 r[kSuper];
    int ng = 1;
    if (g == v.first && v.ns == kSuper && g + kSuper <= g_end) {
      groups_of(std::integral_constant<int, kSuper>(), v, r);
      ng = kSuper;
    } else {
      groups_of(std::integral_constant<int, 1>(), v, r);
    }
    for (int i = 0; i < ng; i++, g++) store_decode_group(y, g, n0, n1, r[i]);
  }
  end_decode_stores();
}

template <WeightType T, bool VNNI>
void gemv(const QuantAct& qx, const PackedMatrix& w, float* y, int64_t n0, int64_t n1) {
  gemv_rows<T>(w, y, n0, n1, [&](auto ng, const GroupView& v, __m256* r) {
    gemv_groups<T, VNNI, decltype(ng)::value>(qx, v, nblocks(w), r);
  });
}

// ---------------------------------------------------------------------------------------------
// Prefill (m > 1): int8 GEMM. The activation rows come quantized (each row exactly as decode
// quantizes it, so a token's result does not depend on the batch). Then, per chunk of kKC
// blocks along K and per chunk of weight groups that stays in L2, each strip of up to kMR rows is
// spread into W_t lane order in an L1 buffer and register tiles of kMR rows x 2 groups sweep the
// chunk: per block, the two groups' quants are loaded (Q4: nibbles unpacked) once for every row of
// the strip and each row's four activation vectors once for both groups; four VPDPBUSD per (row,
// group, block), then int32 -> fp32 times the two scales.

constexpr int kMR = 6;                         // activation rows per tile
// kKC (above): blocks per K chunk, the strip's 6 x 16 x 256 B in L1
constexpr int64_t kChunkBytes = 384 << 10;     // weight bytes per (K chunk, group chunk): L2

// Where the next chunk of weights starts, for the L2 prefetch in tile (none: group < 0).
struct NextChunk {
  int64_t group, block;
};

// Rows i0..i0+MR-1 of y, groups g0..g0+NG-1, blocks [b0, b0 + nbk): xs holds the strip spread,
// [row][block - b0][4][16]. Adds to y unless `first`; stores only the rows of W in [n0, n1).
// With next.group >= 0 it also asks L2 for the same groups' blocks of the next chunk: the first row
// strip over a chunk otherwise waits for DRAM, which takes about as long as all its strips compute.
template <WeightType T, bool VNNI, int MR, int NG>
void tile(const int32_t* xs, const QuantAct& qr, int64_t i0, int64_t b0, int64_t nbk, const void* base,
          int64_t groups, int64_t nb, int64_t g0, float* y, int64_t ldy, int64_t n0, int64_t n1, bool first,
          NextChunk next) {
  constexpr int64_t QSB = qs_bytes(T);
  GroupView gv[NG], nv[NG];
  for (int g = 0; g < NG; g++) {
    gv[g] = group_view(base, T, nb, groups, g0 + g);
    if (next.group >= 0 && next.group + g >= groups) next.group = -1;
  }
  if (next.group >= 0)
    for (int g = 0; g < NG; g++) nv[g] = group_view(base, T, nb, groups, next.group + g);
  __m512 acc[MR][NG];
  for (int i = 0; i < MR; i++)
    for (int g = 0; g < NG; g++) acc[i][g] = _mm512_setzero_ps();
  for (int64_t bb = 0; bb < nbk; bb++) {
    const int64_t b = b0 + bb;
    if (next.group >= 0)  // prefetch never faults, so a shorter next chunk needs no care
      for (int g = 0; g < NG; g++) {
        const uint8_t* q = nv[g].qs + (next.block + bb) * nv[g].qstride;
        for (int64_t l = 0; l < QSB; l += 64) _mm_prefetch((const char*)q + l, _MM_HINT_T1);
        _mm_prefetch((const char*)(nv[g].d + (next.block + bb) * nv[g].dstride), _MM_HINT_T1);
      }
    __m512i wv[NG][4];
    __m512 ws[NG], mv[NG];
    for (int g = 0; g < NG; g++) {
      load_w<T>(gv[g].qs + b * gv[g].qstride, wv[g]);
      ws[g] = scales8x2(gv[g].d + b * gv[g].dstride);
      mv[g] = _mm512_setzero_ps();  // Q4M: the minimums, in the low half only (the halves are summed)
      if constexpr (T == WeightType::Q4M)
        mv[g] = _mm512_zextps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(gv[g].m + b * gv[g].dstride))));
    }
    for (int i = 0; i < MR; i++) {
      const int64_t ib = (i0 + i) * nb + b;
      const int32_t* xv = xs + 64 * (i * kKC + bb);
      __m512i xq[4];
      for (int t = 0; t < 4; t++) xq[t] = _mm512_load_si512((const void*)(xv + 16 * t));
      const __m512 dx = _mm512_set1_ps(qr.dx[ib]);
      for (int g = 0; g < NG; g++) {
        __m512i s = _mm512_set1_epi32(qr.corr[ib]);
        for (int t = 0; t < 4; t++) s = dpbusd<VNNI>(s, wv[g][t], xq[t]);
        acc[i][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ws[g], dx), acc[i][g]);
        if constexpr (T == WeightType::Q4M) acc[i][g] = _mm512_fmadd_ps(mv[g], _mm512_set1_ps(qr.dxs[ib]), acc[i][g]);
      }
    }
  }
  for (int g = 0; g < NG; g++)
    for (int i = 0; i < MR; i++)
      store_rows(y + (i0 + i) * ldy + (g0 + g) * kGroup, (g0 + g) * kGroup, n0, n1,
                 _mm256_add_ps(_mm512_castps512_ps256(acc[i][g]), _mm512_extractf32x8_ps(acc[i][g], 1)), first);
}

template <WeightType T, bool VNNI, int NG>
void tile_rows(int mr, const int32_t* xs, const QuantAct& qr, int64_t i0, int64_t b0, int64_t nbk,
               const void* base, int64_t groups, int64_t nb, int64_t g0, float* y, int64_t ldy, int64_t n0, int64_t n1,
               bool first, NextChunk nx) {
  static_assert(kMR == 6, "one case per strip height");
  switch (mr) {
    case 6: return tile<T, VNNI, 6, NG>(xs, qr, i0, b0, nbk, base, groups, nb, g0, y, ldy, n0, n1, first, nx);
    case 5: return tile<T, VNNI, 5, NG>(xs, qr, i0, b0, nbk, base, groups, nb, g0, y, ldy, n0, n1, first, nx);
    case 4: return tile<T, VNNI, 4, NG>(xs, qr, i0, b0, nbk, base, groups, nb, g0, y, ldy, n0, n1, first, nx);
    case 3: return tile<T, VNNI, 3, NG>(xs, qr, i0, b0, nbk, base, groups, nb, g0, y, ldy, n0, n1, first, nx);
    case 2: return tile<T, VNNI, 2, NG>(xs, qr, i0, b0, nbk, base, groups, nb, g0, y, ldy, n0, n1, first, nx);
    default: return tile<T, VNNI, 1, NG>(xs, qr, i0, b0, nbk, base, groups, nb, g0, y, ldy, n0, n1, first, nx);
  }
}

template <WeightType T, bool VNNI>
void gemm(const QuantAct& qr, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = nblocks(w), groups = ngroups(w.rows), g_end = (n1 + kGroup - 1) / kGroup;
  const void* base = w.data();
  thread_local std::vector<int32_t, avx512::AlignedAlloc<int32_t>> xs(kMR * kKC * 64);
  const int64_t nc = std::max<int64_t>(2, kChunkBytes / (kKC * qs_bytes(T)));  // groups per chunk
  for (int64_t b0 = 0; b0 < nb; b0 += kKC) {
    const int64_t nbk = std::min(kKC, nb - b0);
    for (int64_t c0 = n0 / kGroup; c0 < g_end; c0 += nc) {
      const int64_t c1 = std::min(c0 + nc, g_end);
      for (int64_t i0 = 0; i0 < m; i0 += kMR) {
        const int mr = (int)std::min<int64_t>(kMR, m - i0);
        for (int i = 0; i < mr; i++)
          for (int64_t bb = 0; bb < nbk; bb++)
            spread_block(_mm512_castsi256_si512(_mm256_load_si256((const __m256i*)(qr.q + ((i0 + i) * nb + b0 + bb) * kBlock))),
                         xs.data() + 64 * (i * kKC + bb));
        // the first strip prefetches the next chunk: the next groups, or the first ones of the next K chunk
        auto next = [&](int64_t g) -> NextChunk {
          if (i0 > 0) return {-1, 0};
          if (c1 < g_end) return {c1 + (g - c0), b0};
          return b0 + kKC < nb ? NextChunk{n0 / kGroup + (g - c0), b0 + kKC} : NextChunk{-1, 0};
        };
        int64_t g = c0;
        for (; g + 2 <= c1; g += 2)
          tile_rows<T, VNNI, 2>(mr, xs.data(), qr, i0, b0, nbk, base, groups, nb, g, y, ldy, n0, n1, b0 == 0, next(g));
        if (g < c1) tile_rows<T, VNNI, 1>(mr, xs.data(), qr, i0, b0, nbk, base, groups, nb, g, y, ldy, n0, n1, b0 == 0, next(g));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// int16 activations (ActType::I16; the buffer is quant_layout.h's PlainAct, quantized by the AVX2
// code). A 32-byte piece of a group's block (8 rows x 4 columns, row j in bytes 4j..4j+3) widened
// unsigned to int16 is one vector whose 32-bit lanes 2j, 2j+1 hold row j's four columns, so one
// VPDPWSSD against the piece's four activations (an 8-byte broadcast, no spreading) adds them to row
// j's two lanes. Q4 widens the packed byte once and takes the nibbles with an AND and a shift. The
// stored offset (Q8 128, Q4 8) times sum(xq) is corr, half of it put in each lane of a row; a lane
// sums 16 products of at most 255 * 32767 per block, exact in int32. The scales are spread the same
// way (each row's twice) after each block's pairs of lanes are summed in int32 (both lanes get the
// row's sum, so every table rounds the same block products the same way).
constexpr int kMR16 = 6;  // activation rows per prefill tile (x 2 groups: 12 int32 + 12 fp32 accumulators)

inline __m512 scales_pairs(const uint16_t* p) {  // 8 fp16 -> each twice, lanes 2j, 2j+1 = row j
  const __m512i idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p))));
}
inline __m256 even_lanes(__m512 f) {  // one copy of each row: lanes 0, 2, .., 14
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(even, f));
}

// Calls piece(p, w) for the 8 pieces of block row qs of G groups (group g at qs + g * QSB), w[g] the
// piece of group g widened to int16, so that one activation broadcast serves all G groups.
template <WeightType T, int G, class Piece>
inline void for_pieces16(const uint8_t* qs, Piece piece) {
  constexpr int64_t QSB = qs_bytes(T);
  __m512i w[G];
  if constexpr (T == WeightType::Q8) {
#pragma GCC unroll 8
    for (int p = 0; p < 8; p++) {
      for (int g = 0; g < G; g++) w[g] = _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i*)(qs + g * QSB + 32 * p)));
      piece(p, w);
    }
  } else {
    const __m512i m4 = _mm512_set1_epi16(0x0f);
    __m512i hi[G];
#pragma GCC unroll 4
    for (int uh = 0; uh < 4; uh++) {  // 32 bytes at 32 * uh: pieces 4u + h (low nibbles), 4u + 2 + h (high)
      const int u = uh >> 1, h = uh & 1;
      for (int g = 0; g < G; g++) {
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i*)(qs + g * QSB + 32 * uh)));
        w[g] = _mm512_and_si512(b, m4), hi[g] = _mm512_srli_epi16(b, 4);
      }
      piece(4 * u + h, w);
      piece(4 * u + 2 + h, hi);
    }
  }
}

// Decode: the NG groups of a super-group against one activation row, block row by block row as
// stored (one stream); two int32 accumulators per group (even and odd pieces) keep 2 * NG chains.
template <WeightType T, bool VNNI, bool GroupMajor, int NG>
inline void gemv16_groups(const PlainAct<int16_t>& qx, const GroupView& v, int64_t nb, __m256 out[NG]) {
  __m512 facc[NG];
  __m256 macc[NG];
  for (int g = 0; g < NG; g++) facc[g] = _mm512_setzero_ps(), macc[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* qs = v.qs + b * v.qstride;
    const uint16_t* dp = v.d + b * v.dstride;
    prefetch_ahead(qs, v.qstride);
    const int16_t* xb = qx.q + b * kBlock;
    __m512i acc[2][NG];
    for (int g = 0; g < NG; g++) acc[0][g] = _mm512_set1_epi32(qx.corr[b] / 2), acc[1][g] = _mm512_setzero_si512();
    if constexpr (GroupMajor) {  // group after group (kernel_util.h: decode_group_major)
      __m512i x[8];
      for (int p = 0; p < 8; p++) x[p] = bcast8(xb + 4 * p);
      for (int g = 0; g < NG; g++)
        for_pieces16<T, 1>(qs + g * qs_bytes(T), [&](int p, const __m512i* w) { acc[p & 1][g] = dpwssd<VNNI>(acc[p & 1][g], w[0], x[p]); });
    } else {  // the groups side by side
      for_pieces16<T, NG>(qs, [&](int p, const __m512i* w) {
        const __m512i x = bcast8(xb + 4 * p);
        for (int g = 0; g < NG; g++) acc[p & 1][g] = dpwssd<VNNI>(acc[p & 1][g], w[g], x);
      });
    }
    const __m512 d = _mm512_set1_ps(qx.dx[b]);
    for (int g = 0; g < NG; g++) {
      const __m512i a = pair_sums(_mm512_add_epi32(acc[0][g], acc[1][g]));
      facc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(scales_pairs(dp + 8 * g), d), facc[g]);
      if constexpr (T == WeightType::Q4M)
        macc[g] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(v.m + b * v.dstride + 8 * g))),
                                  _mm256_set1_ps(qx.dxs[b]), macc[g]);
    }
  }
  for (int g = 0; g < NG; g++) out[g] = _mm256_add_ps(even_lanes(facc[g]), macc[g]);
}

template <WeightType T, bool VNNI, bool GroupMajor>
void gemv16(const PlainAct<int16_t>& qx, const PackedMatrix& w, float* y, int64_t n0, int64_t n1) {
  gemv_rows<T>(w, y, n0, n1, [&](auto ng, const GroupView& v, __m256* r) {
    gemv16_groups<T, VNNI, GroupMajor, decltype(ng)::value>(qx, v, nblocks(w), r);
  });
}
template <WeightType T, bool VNNI>
void gemv16(const PlainAct<int16_t>& qx, const PackedMatrix& w, float* y, int64_t n0, int64_t n1) {
  kGroupMajor ? gemv16<T, VNNI, true>(qx, w, y, n0, n1) : gemv16<T, VNNI, false>(qx, w, y, n0, n1);
}

// A few activation rows (a sequence's check of its guesses, a few sequences decoding) against the NG
// groups of a super-group, streamed once as decode streams them, each widened piece serving all MR
// rows. Row i gets decode's bits: its int32 block sums are the same integers (one chain where decode
// keeps two; integer sums do not depend on the order), scaled and added to one fp32 sum per group in
// decode's order. The fp32 sums live in memory (MR x NG of them would not fit the registers).
template <WeightType T, bool VNNI, int MR, int NG>
inline void rows16_groups(const PlainAct<int16_t>& qx, int64_t nb, const GroupView& v, __m256 out[MR][NG]) {
  alignas(64) float facc[MR][NG][16] = {};
  __m256 macc[MR][NG];
  for (int i = 0; i < MR; i++)
    for (int g = 0; g < NG; g++) macc[i][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* qs = v.qs + b * v.qstride;
    const uint16_t* dp = v.d + b * v.dstride;
    prefetch_ahead(qs, v.qstride);
    __m512i acc[MR][NG];
    for (int i = 0; i < MR; i++)
      for (int g = 0; g < NG; g++) acc[i][g] = _mm512_set1_epi32(qx.corr[i * nb + b] / 2);
    for_pieces16<T, NG>(qs, [&](int p, const __m512i* w) {
      for (int i = 0; i < MR; i++) {
        const __m512i x = bcast8(qx.q + (i * nb + b) * kBlock + 4 * p);
        for (int g = 0; g < NG; g++) acc[i][g] = dpwssd<VNNI>(acc[i][g], w[g], x);
      }
    });
    for (int g = 0; g < NG; g++) {
      const __m512 sc = scales_pairs(dp + 8 * g);
      for (int i = 0; i < MR; i++) {
        const __m512 d = _mm512_set1_ps(qx.dx[i * nb + b]);
        _mm512_store_ps(facc[i][g], _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_sums(acc[i][g])), _mm512_mul_ps(sc, d),
                                                    _mm512_load_ps(facc[i][g])));
        if constexpr (T == WeightType::Q4M)
          macc[i][g] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(v.m + b * v.dstride + 8 * g))),
                                       _mm256_set1_ps(qx.dxs[i * nb + b]), macc[i][g]);
      }
    }
  }
  for (int i = 0; i < MR; i++)
    for (int g = 0; g < NG; g++) out[i][g] = _mm256_add_ps(even_lanes(_mm512_load_ps(facc[i][g])), macc[i][g]);
}

// Rows [n0, n1) of MR activation rows (qx's first), walked as decode walks them (gemv_rows).
template <WeightType T, bool VNNI, int MR>
void rows16(const PlainAct<int16_t>& qx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = nblocks(w), groups = ngroups(w.rows), g_end = (n1 + kGroup - 1) / kGroup;
  for (int64_t g = n0 / kGroup; g < g_end;) {
    const GroupView v = group_view(w.data(), T, nb, groups, g);
    __m256 r[MR][kSuper];
    int ng = 1;
    if (g == v.first && v.ns == kSuper && g + kSuper <= g_end) {
      rows16_groups<T, VNNI, MR, kSuper>(qx, nb, v, r);
      ng = kSuper;
    } else {
      __m256 one[MR][1];
      rows16_groups<T, VNNI, MR, 1>(qx, nb, v, one);
      for (int i = 0; i < MR; i++) r[i][0] = one[i][0];
    }
    for (int k = 0; k < ng; k++, g++)
      for (int i = 0; i < MR; i++) store_rows(y + i * ldy + g * kGroup, g * kGroup, n0, n1, r[i][k], true);
  }
}

// A few rows in tiles as even as the count allows, of at most 4 rows for Q4/Q4M, whose widened nibbles
// cost more, and 2 for Q8 (3 and 4-row Q8 tiles were slower: 14.2 against 15.5 GB/s at 3 rows); a tile
// of one row runs decode's kernel. Over pieces of about kChunkBytes of weights, so that the tiles after the
// first find the piece in L2.
template <WeightType T, bool VNNI>
void few_rows16(const PlainAct<int16_t>& qa, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                int64_t n1) {
  constexpr int64_t kTile = T == WeightType::Q8 ? 2 : 4;
  const int64_t nb = nblocks(w), tiles = (m + kTile - 1) / kTile;
  for_l2_pieces(w, n0, n1, kChunkBytes, [&](int64_t a, int64_t e) {
    for (int64_t t = 0, i = 0; t < tiles; t++) {
      const int64_t rows = m / tiles + (t < m % tiles);
      const PlainAct<int16_t> r{qa.q + i * nb * 32, qa.dx + i * nb, qa.dxs + i * nb, qa.corr + i * nb};
      float* yi = y + i * ldy;
      switch (rows) {
        case 4: rows16<T, VNNI, 4>(r, w, yi, ldy, a, e); break;
        case 3: rows16<T, VNNI, 3>(r, w, yi, ldy, a, e); break;
        case 2: rows16<T, VNNI, 2>(r, w, yi, ldy, a, e); break;
        default: gemv16<T, VNNI>(r, w, yi, a, e); break;
      }
      i += rows;
    }
  });
}

// Prefill: rows i0..i0+MR-1 x groups g0..g0+NG-1 over blocks [b0, b0 + nbk); each widened piece
// serves the MR rows, each activation broadcast the NG groups.
template <WeightType T, bool VNNI, int MR, int NG>
void tile16(const PlainAct<int16_t>& qr, int64_t nb, int64_t i0, int64_t b0, int64_t nbk, const void* base,
            int64_t groups, int64_t g0, float* y, int64_t ldy, int64_t n0, int64_t n1, bool first) {
  const GroupView v = group_view(base, T, nb, groups, g0);  // NG == 2 only where g0 + 1 is in the same super-group
  __m512 facc[MR][NG];
  __m256 macc[MR][NG];
  for (int i = 0; i < MR; i++)
    for (int g = 0; g < NG; g++) facc[i][g] = _mm512_setzero_ps(), macc[i][g] = _mm256_setzero_ps();
  for (int64_t b = b0; b < b0 + nbk; b++) {
    __m512i acc[MR][NG];
    for (int i = 0; i < MR; i++)
      for (int g = 0; g < NG; g++) acc[i][g] = _mm512_set1_epi32(qr.corr[(i0 + i) * nb + b] / 2);
    for_pieces16<T, NG>(v.qs + b * v.qstride, [&](int p, const __m512i* w) {
      for (int i = 0; i < MR; i++) {
        const __m512i x = bcast8(qr.q + ((i0 + i) * nb + b) * kBlock + 4 * p);
        for (int g = 0; g < NG; g++) acc[i][g] = dpwssd<VNNI>(acc[i][g], w[g], x);
      }
    });
    __m512 ws[NG];
    for (int g = 0; g < NG; g++) ws[g] = scales_pairs(v.d + b * v.dstride + 8 * g);
    for (int i = 0; i < MR; i++) {
      const int64_t ib = (i0 + i) * nb + b;
      const __m512 dx = _mm512_set1_ps(qr.dx[ib]);
      for (int g = 0; g < NG; g++) {
        facc[i][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_sums(acc[i][g])), _mm512_mul_ps(ws[g], dx), facc[i][g]);
        if constexpr (T == WeightType::Q4M)
          macc[i][g] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(v.m + b * v.dstride + 8 * g))),
                                       _mm256_set1_ps(qr.dxs[ib]), macc[i][g]);
      }
    }
  }
  for (int g = 0; g < NG; g++)
    for (int i = 0; i < MR; i++)
      store_rows(y + (i0 + i) * ldy + (g0 + g) * kGroup, (g0 + g) * kGroup, n0, n1,
                 _mm256_add_ps(even_lanes(facc[i][g]), macc[i][g]), first);
}

template <WeightType T, bool VNNI, int NG>
void tile16_rows(int mr, const PlainAct<int16_t>& qr, int64_t nb, int64_t i0, int64_t b0, int64_t nbk,
                 const void* base, int64_t groups, int64_t g0, float* y, int64_t ldy, int64_t n0, int64_t n1, bool first) {
  static_assert(kMR16 == 6, "one case per strip height");
  switch (mr) {
#define CORELM_TILE16(R) \
  case R: return tile16<T, VNNI, R, NG>(qr, nb, i0, b0, nbk, base, groups, g0, y, ldy, n0, n1, first);
    CORELM_TILE16(6)
    CORELM_TILE16(5)
    CORELM_TILE16(4)
    CORELM_TILE16(3)
    CORELM_TILE16(2)
    default: CORELM_TILE16(1)
#undef CORELM_TILE16
  }
}

// As gemm: K chunks of kKC blocks, groups in L2-sized chunks, strips of kMR16 rows; two groups per
// tile where they share a super-group (their block rows are then adjacent in memory).
template <WeightType T, bool VNNI>
void gemm16(const PlainAct<int16_t>& qr, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = nblocks(w), groups = ngroups(w.rows), g_end = (n1 + kGroup - 1) / kGroup;
  const void* base = w.data();
  const int64_t nc = std::max<int64_t>(2, kChunkBytes / (kKC * qs_bytes(T)));  // groups per chunk
  for (int64_t b0 = 0; b0 < nb; b0 += kKC) {
    const int64_t nbk = std::min(kKC, nb - b0);
    for (int64_t c0 = n0 / kGroup; c0 < g_end; c0 += nc) {
      const int64_t c1 = std::min(c0 + nc, g_end);
      for (int64_t i0 = 0; i0 < m; i0 += kMR16) {
        const int mr = (int)std::min<int64_t>(kMR16, m - i0);
        for (int64_t g = c0; g < c1;) {
          if (g + 2 <= c1 && (g + 1) / kSuper == g / kSuper) {
            tile16_rows<T, VNNI, 2>(mr, qr, nb, i0, b0, nbk, base, groups, g, y, ldy, n0, n1, b0 == 0);
            g += 2;
          } else {
            tile16_rows<T, VNNI, 1>(mr, qr, nb, i0, b0, nbk, base, groups, g, y, ldy, n0, n1, b0 == 0);
            g += 1;
          }
        }
      }
    }
  }
}

// A few rows (decode of a few sequences, a mixture of experts' expert with a few tokens): the decode
// kernel row by row over pieces of about kChunkBytes of weights, so every row after the first reads the
// piece from L2. Below kMinGemmRows rows the GEMM's tiles, whose widened weights serve too few rows to
// pay for their K-chunked order, were slower: an OLMoE-1B-7B Q4_0 decode step of 2 sequences routed to
// the same experts took 77 ms through the int16 GEMM, 33 ms so, 4 sequences 67 -> 51 ms; at 8 both
// took 97 ms; int8 was even from 4 rows on (2 threads, Zen 4). (int8 activations: int16 ones have
// few_rows16.)
constexpr int64_t kMinGemmRows = 8;

template <class Row, class Gemv>
void few_rows(int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1, Row row, Gemv gemv) {
  if (m == 1) return gemv(row(0), y, n0, n1);  // one uninterrupted stream
  for_l2_pieces(w, n0, n1, kChunkBytes, [&](int64_t a, int64_t e) {
    for (int64_t i = 0; i < m; i++) gemv(row(i), y + i * ldy, a, e);
  });
}

template <WeightType T>
void matmul16_t(const PlainAct<int16_t>& qa, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  // Up to kRowExactRows rows the few-row tiles: one Zen 5 thread, bench_gemv_stream on Qwen2.5-0.5B's
  // shapes, GB/s of weights from DRAM for 2 / 3 / 4 / 6 rows (decode's kernel row by row before) q4 22.1 /
  // 17.0 / 13.8 / 9.8 -> 25.3 / 21.2 / 16.9 / 12.7, q8 19.4 / 16.9 / 14.7 / 11.8 -> 23.0 / 19.1 / 17.6 /
  // 15.0; for 8 / 16 / 32 rows (the GEMM before) q4 5.8 / 3.8 / 2.3 -> 9.9 / 5.3 / 2.9, q8 10.8 / 7.4 /
  // 4.4 -> 12.5 / 8.0 / 4.7; in L2 too (1536 x 1536, 8-32 rows, 313-340 -> 346-349 GFLOP/s q4).
  const bool vnni = use_vnni();
  if (m == 1) return vnni ? gemv16<T, true>(qa, w, y, n0, n1) : gemv16<T, false>(qa, w, y, n0, n1);
  if (m <= kRowExactRows) return vnni ? few_rows16<T, true>(qa, m, w, y, ldy, n0, n1) : few_rows16<T, false>(qa, m, w, y, ldy, n0, n1);
  vnni ? gemm16<T, true>(qa, m, w, y, ldy, n0, n1) : gemm16<T, false>(qa, m, w, y, ldy, n0, n1);
}

template <WeightType T>
void matmul_t(const QuantAct& qa, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = nblocks(w);
  auto row = [&](int64_t i) { return QuantAct{qa.q + i * nb * 32, qa.dx + i * nb, qa.dxs + i * nb, qa.corr + i * nb}; };
  if (m >= kMinGemmRows) return use_vnni() ? gemm<T, true>(qa, m, w, y, ldy, n0, n1) : gemm<T, false>(qa, m, w, y, ldy, n0, n1);
  few_rows(m, w, y, ldy, n0, n1, row, [&](const QuantAct& r, float* yi, int64_t a, int64_t b) {
    use_vnni() ? gemv<T, true>(r, w, yi, a, b) : gemv<T, false>(r, w, yi, a, b);
  });
}


// ---------------------------------------------------------------------------------------------
// Sparse Q8/Q4 (SQ8/SQ4, kernels/sparse_quant.h). Decode (one row, int8 or int16 activations)
// streams each super-group's record once: per block the ns groups' scales and masks, then the
// non-zero codes, each 64-position window expanded in registers by one VPEXPANDB (VBMI2) over a
// merge source holding the zero code (Q4: the window's nibbles spread to bytes first) into exactly
// the W_t vectors load_w gives the dense kernel, multiplied by VPDPBUSD (int16 activations as two byte
// planes, split_act) and scaled in the dense decode's order: the dense matrix's bits. Everything else (several rows, CPUs without VBMI2)
// expands panels of super-groups into the dense layout and runs the dense kernels on them.

const bool kSparseVbmi2 = cpu_features().avx512_vbmi2 && cpu_features().os_avx512 && tuning::sparse_without_level() < 3;

#define CORELM_VBMI2_TARGET __attribute__((target("avx512vbmi2")))

// Software prefetch of the sparse stream (sparse_layout.h: record_prefetch_bytes, 0: none).
const int64_t kSparsePrefetch = sparse::record_prefetch_bytes();
const bool kSparsePrefetchL2 = sparse::record_prefetch_l2();

// One group's block (its masks at mp, its codes at p) into the four W_t vectors; returns the next
// group's codes.
template <WeightType T>
CORELM_VBMI2_TARGET inline const uint8_t* sparse_load_w(const uint8_t* mp, const uint8_t* p, __m512i w[4]) {
  uint64_t mk[4];
  std::memcpy(mk, mp, 32);
  if constexpr (T == WeightType::Q8) {
    for (int t = 0; t < 4; t++) {
      __m512i raw = _mm512_loadu_si512((const void*)p);
      __asm__("" : "+v"(raw));  // a plain load: VPEXPANDB's memory form is slower
      w[t] = _mm512_mask_expand_epi8(_mm512_set1_epi8((char)0x80), (__mmask64)mk[t], raw);
      p += _mm_popcnt_u64(mk[t]);
    }
  } else {  // windows 2u and 2u + 1 in the low and high nibbles of one run of bytes
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int u = 0; u < 2; u++) {
      __m512i raw = _mm512_loadu_si512((const void*)p);
      __asm__("" : "+v"(raw));  // one load for both windows: folded into each, the run was read twice
      w[2 * u] = _mm512_mask_expand_epi8(_mm512_set1_epi8(8), (__mmask64)mk[2 * u], _mm512_and_si512(raw, m4));
      w[2 * u + 1] = _mm512_mask_expand_epi8(_mm512_set1_epi8(8), (__mmask64)mk[2 * u + 1],
                                             _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4));
      p += sparse::pair_bytes(mk, u);
    }
  }
  return p;
}

// Block b of a record of NS groups (prefetching the bytes of one block kSparsePrefetch ahead: the next
// record's past the end).
template <int NS>
inline const uint8_t* sparse_block(const uint8_t* rec, int64_t b, int64_t nb) {
  const uint8_t* blk = sparse::quant_block(rec, b);
  if (kSparsePrefetch) sparse::prefetch_ahead(blk, b + 1 < nb ? sparse::quant_block(rec, b + 1) : blk + 48 * NS,
                                              kSparsePrefetch, kSparsePrefetchL2);
  return blk;
}

// The NS groups' W_t vectors of a block.
template <WeightType T, int NS>
CORELM_VBMI2_TARGET inline void sparse_load_groups(const uint8_t* blk, __m512i wv[NS][4]) {
  const uint8_t* p = blk + 48 * NS;
  for (int g = 0; g < NS; g++) p = sparse_load_w<T>(blk + 16 * NS + 32 * g, p, wv[g]);
}

// A record's NS groups against one int8 activation row, summed as gemv_groups sums them.
template <WeightType T, bool VNNI, int NS>
CORELM_VBMI2_TARGET void sparse_gemv_super(const QuantAct& qx, const uint8_t* rec, int64_t nb, __m256 out[NS]) {
  for (int64_t b0 = 0; b0 < nb; b0 += kKC) {
    __m512 acc[NS];
    for (int g = 0; g < NS; g++) acc[g] = _mm512_setzero_ps();
    const int64_t b1 = std::min(nb, b0 + kKC);
    for (int64_t b = b0; b < b1; b++) {
      __m512i xq[4];
      const __m512i xb = _mm512_castsi256_si512(_mm256_load_si256((const __m256i*)(qx.q + b * kBlock)));
      for (int t = 0; t < 4; t++) xq[t] = spread(xb, t);
      const __m512i c = _mm512_set1_epi32(qx.corr[b]);
      const __m512 d = _mm512_set1_ps(qx.dx[b]);
      const uint8_t* blk = sparse_block<NS>(rec, b, nb);
      const uint16_t* dp = reinterpret_cast<const uint16_t*>(blk);
      __m512i wv[NS][4];
      sparse_load_groups<T, NS>(blk, wv);
      for (int g = 0; g < NS; g++) {
        __m512i s = c;
        for (int t = 0; t < 4; t++) s = dpbusd<VNNI>(s, wv[g][t], xq[t]);
        acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scales8x2(dp + 8 * g), d), acc[g]);
      }
    }
    for (int g = 0; g < NS; g++) {
      const __m256 r = _mm256_add_ps(_mm512_castps512_ps256(acc[g]), _mm512_extractf32x8_ps(acc[g], 1));
      out[g] = b0 == 0 ? r : _mm256_add_ps(r, out[g]);
    }
  }
}

// int16 activations for the sparse decode as two byte planes, x = 256 a + b (a = x >> 8 signed, b = x & 255
// unsigned), so the expanded code bytes multiply them with VPDPBUSD as they come out of VPEXPANDB:
// sum(c x) = 256 sum(c a) + sum(c b), c the stored code as an unsigned byte against a, and b as the
// unsigned side against c as a signed one (Q4's codes 0..15 are; Q8's stored q + 128 is not, so it
// multiplies q = c ^ 0x80 and extra adds 128 sum(b) back). Widening each expanded window to int16 for
// VPDPWSSD, as the dense kernel multiplies, cost two shuffles per 32 codes on the port VPEXPANDB
// already saturates (sq4 50% from cache 11.6 GB/s). The sums are integers, so a row's block sum is the
// dense kernel's to the bit, and its scaling is gemv16_groups' (per row: float(sum) * (scale * dx)).
// The planes follow the int16 activations in the buffer quantize_act fills (one row: decode), so the
// many row chunks of a matmul share one split.
struct SplitAct {
  const int8_t* a;   // [nb][32]
  const uint8_t* b;  // [nb][32]
  const int32_t* extra;  // [nb]: corr (+ 128 sum(b) for Q8), added to each row's block sum
};
inline size_t split_act_bytes(int64_t nb) { return (size_t)(nb * 68 + 63) / 64 * 64; }
inline SplitAct split_act_view(const void* planes, int64_t nb) {
  const uint8_t* p = static_cast<const uint8_t*>(planes);
  return {reinterpret_cast<const int8_t*>(p), p + nb * 32, reinterpret_cast<const int32_t*>(p + nb * 64)};
}
void split_act(const PlainAct<int16_t>& qx, int64_t nb, WeightType type, void* planes) {
  int8_t* a = static_cast<int8_t*>(planes);
  uint8_t* b = static_cast<uint8_t*>(planes) + nb * 32;
  int32_t* extra = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(planes) + nb * 64);
  const __m512i low = _mm512_set1_epi16(0xff), ones = _mm512_set1_epi16(1);
  for (int64_t k = 0; k < nb; k++) {
    const __m512i x = _mm512_load_si512((const void*)(qx.q + k * kBlock)), lo = _mm512_and_si512(x, low);
    _mm256_store_si256((__m256i*)(a + k * kBlock), _mm512_cvtepi16_epi8(_mm512_srai_epi16(x, 8)));
    _mm256_store_si256((__m256i*)(b + k * kBlock), _mm512_cvtepi16_epi8(lo));
    extra[k] = qx.corr[k] + (type == WeightType::SQ8 ? 128 * _mm512_reduce_add_epi32(_mm512_madd_epi16(lo, ones)) : 0);
  }
}
// Decode of a sparse matrix on int16 activations reads the split planes (where the CPU runs it).
inline bool splits_act(const PackedMatrix& w, int64_t m, ActType act) {
  return sparse::is_sparse_quant(w.type) && m == 1 && act == ActType::I16 && kSparseVbmi2 && use_vnni();
}

// A record's NS groups against one int16 activation row (as split_act's planes), summed as
// gemv16_groups sums them.
template <WeightType T, int NS>
CORELM_VBMI2_TARGET void sparse_gemv16_super(const SplitAct& sx, const float* dx, const uint8_t* rec, int64_t nb,
                                             __m256 out[NS]) {
  __m256 facc[NS];
  for (int g = 0; g < NS; g++) facc[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = sparse_block<NS>(rec, b, nb);
    const uint16_t* dp = reinterpret_cast<const uint16_t*>(blk);
    __m512i wv[NS][4];
    sparse_load_groups<T, NS>(blk, wv);
    const __m512i av = _mm512_castsi256_si512(_mm256_load_si256((const __m256i*)(sx.a + b * kBlock)));
    const __m512i bv = _mm512_castsi256_si512(_mm256_load_si256((const __m256i*)(sx.b + b * kBlock)));
    __m512i xa[4], xb[4];
    for (int t = 0; t < 4; t++) xa[t] = spread(av, t), xb[t] = spread(bv, t);
    const __m256i extra = _mm256_set1_epi32(sx.extra[b]);
    const __m256 d = _mm256_set1_ps(dx[b]);
    for (int g = 0; g < NS; g++) {
      __m512i hi = _mm512_setzero_si512(), lo = _mm512_setzero_si512();
      for (int t = 0; t < 4; t++) {
        hi = dpbusd<true>(hi, wv[g][t], xa[t]);
        lo = dpbusd<true>(lo, xb[t], T == WeightType::Q8 ? _mm512_xor_si512(wv[g][t], _mm512_set1_epi8((char)0x80)) : wv[g][t]);
      }
      const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo);  // lanes j and j + 8: row j's halves
      const __m256i r = _mm256_add_epi32(_mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1)), extra);
      const __m256 sc = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dp + 8 * g))), d);
      facc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(r), sc, facc[g]);
    }
  }
  for (int g = 0; g < NS; g++) out[g] = _mm256_add_ps(facc[g], _mm256_setzero_ps());
}

// Decode's walk over the records of rows [n0, n1): super(std::integral_constant<int, NS>, record, out)
// computes a record's NS groups' 8 rows each.
template <class Super>
void sparse_gemv_rows(const PackedMatrix& w, float* y, int64_t n0, int64_t n1, Super super) {
  const int64_t groups = ngroups(w.rows);
  for (int64_t s = n0 / sparse::kQuantSuperRows; s * sparse::kQuantSuperRows < n1; s++) {
    const int64_t ns = std::min<int64_t>(kSuper, groups - s * kSuper);
    const uint8_t* rec = sparse::quant_record(w, s);
    __m256 r[kSuper];
    switch (ns) {
      case 4: super(std::integral_constant<int, 4>(), rec, r); break;
      case 3: super(std::integral_constant<int, 3>(), rec, r); break;
      case 2: super(std::integral_constant<int, 2>(), rec, r); break;
      default: super(std::integral_constant<int, 1>(), rec, r); break;
    }
    for (int64_t i = 0; i < ns; i++) {
      const int64_t g = s * kSuper + i;
      if (g * kGroup < n1 && g * kGroup + kGroup > n0) store_decode_group(y, g, n0, n1, r[i]);
    }
  }
  end_decode_stores();
}

template <WeightType T, bool VNNI>
void sparse_gemv(const QuantAct& qx, const PackedMatrix& w, float* y, int64_t n0, int64_t n1) {
  sparse_gemv_rows(w, y, n0, n1, [&](auto ns, const uint8_t* rec, __m256* r) {
    sparse_gemv_super<T, VNNI, decltype(ns)::value>(qx, rec, nblocks(w), r);
  });
}

template <WeightType T>
void sparse_gemv16(const PlainAct<int16_t>& qx, const SplitAct& sx, const PackedMatrix& w, float* y, int64_t n0,
                   int64_t n1) {
  sparse_gemv_rows(w, y, n0, n1, [&](auto ns, const uint8_t* rec, __m256* r) {
    sparse_gemv16_super<T, decltype(ns)::value>(sx, qx.dx, rec, nblocks(w), r);
  });
}

// Super-groups [s0, s1) expanded into the dense grouped layout with VPEXPANDB. flatten: expand_grouped
// has no target, so without it the block lambda stayed an out-of-line call per block.
template <WeightType T>
CORELM_VBMI2_TARGET __attribute__((flatten)) void sparse_expand(const PackedMatrix& w, int64_t s0, int64_t s1, uint8_t* dst) {
  sparse::expand_grouped(w, s0, s1, dst, [](const uint8_t* masks, const uint8_t* p, uint8_t* q) CORELM_VBMI2_TARGET {
    __m512i wv[4];
    p = sparse_load_w<T>(masks, p, wv);
    if constexpr (T == WeightType::Q8) {
      for (int t = 0; t < 4; t++) _mm512_storeu_si512((void*)(q + 64 * t), wv[t]);
    } else {
      for (int u = 0; u < 2; u++)
        _mm512_storeu_si512((void*)(q + 64 * u), _mm512_or_si512(wv[2 * u], _mm512_slli_epi16(wv[2 * u + 1], 4)));
    }
    return p;
  });
}

void sparse_matmul_quant(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                         int64_t n0, int64_t n1) {
  n1 = std::min(n1, w.rows);
  if (n0 >= n1) return;
  if (m == 1 && kSparseVbmi2) {  // decode: the codes expanded in registers
    const bool q8 = w.type == WeightType::SQ8, vnni = use_vnni();
    if (splits_act(w, m, act)) {  // (every CPU with VBMI2 has VNNI; CORELM_NO_VNNI expands panels)
      const int64_t nb = nblocks(w);
      const PlainAct<int16_t> a = plain_act_view<int16_t>(const_cast<void*>(qa), m, nb);
      const SplitAct sx = split_act_view(static_cast<const uint8_t*>(qa) + plain_act_bytes(m, nb, 2), nb);
      return q8 ? sparse_gemv16<WeightType::Q8>(a, sx, w, y, n0, n1) : sparse_gemv16<WeightType::Q4>(a, sx, w, y, n0, n1);
    }
    if (act != ActType::I16) {
      const QuantAct a = act_view(const_cast<void*>(qa), m, nblocks(w));
      if (vnni) return q8 ? sparse_gemv<WeightType::Q8, true>(a, w, y, n0, n1) : sparse_gemv<WeightType::Q4, true>(a, w, y, n0, n1);
      return q8 ? sparse_gemv<WeightType::Q8, false>(a, w, y, n0, n1) : sparse_gemv<WeightType::Q4, false>(a, w, y, n0, n1);
    }
  }
  sparse::quant_matmul_panels(qa, m, act, w, y, ldy, n0, n1, sparse::DenseLayout::Grouped, avx512_matmul_quant,
                              kSparseVbmi2 ? sparse::expand_supers_avx512 : nullptr);
}

}  // namespace

PackedMatrix avx512_pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par) {
  if (sparse::is_sparse_quant(type)) return sparse::quant_pack(src, rows, cols, type, par, &kAvx512Kernels);
  require_packable(type);
  return grouped_pack(src, rows, cols, type, par, &kAvx512Kernels);
}

PackedMatrix avx512_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par) {
  if (sparse::is_sparse(type)) return sparse::pack_raw(type, raw, rows, cols, par, &kAvx512Kernels);
  if (sparse::is_sparse_quant(type)) return sparse::quant_pack_raw(type, raw, rows, cols, par, &kAvx512Kernels);
  if (is_grouped_ggml(type)) return grouped_ggml_pack_raw(type, raw, rows, cols, par, &kAvx512Kernels);
  if (is_ggml_block(type)) return ggml_pack_raw(type, raw, rows, cols, &kAvx512Kernels);
  return grouped_pack_raw(type, raw, rows, cols, par, &kAvx512Kernels);
}

size_t avx512_quant_act_bytes(const PackedMatrix& w, int64_t m, ActType act) {
  if (sparse::is_sparse_quant(w.type))
    return avx512_quant_act_bytes(sparse::as_dense_type(w), m, act) + (splits_act(w, m, act) ? split_act_bytes(nblocks(w)) : 0);
  if (is_ggml_block(w.type)) return ggml_act_bytes(w, m, act);
  if (act == ActType::I16) return avx2_quant_act_bytes(w, m, act);
  return is_quant(w.type) && m >= 1 ? act_bytes(m, nblocks(w)) : 0;
}

void avx512_quantize_act(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act, void* qa) {
  if (sparse::is_sparse_quant(w.type)) {
    avx512_quantize_act(x, m, ldx, sparse::as_dense_type(w), act, qa);
    const int64_t nb = nblocks(w);
    if (splits_act(w, m, act))
      split_act(plain_act_view<int16_t>(qa, m, nb), nb, w.type, static_cast<uint8_t*>(qa) + plain_act_bytes(m, nb, 2));
    return;
  }
  if (is_grouped_ggml(w.type)) return grouped_ggml_quantize_act_avx512(x, m, ldx, w, act, qa);
  if (is_ggml_block(w.type)) return ggml_quantize_act(x, m, ldx, w, act, qa);
  if (act == ActType::I16) return avx2_quantize_act(x, m, ldx, w, act, qa);
  quantize_act(x, m, ldx, w.cols, nblocks(w), w.type, act_view(qa, m, nblocks(w)));
}

void avx512_matmul_quant(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                         int64_t n0, int64_t n1) {
  if (sparse::is_sparse_quant(w.type)) return sparse_matmul_quant(qa, m, act, w, y, ldy, n0, n1);
  if (is_grouped_ggml(w.type)) return grouped_ggml_matmul_avx512(qa, m, act, w, y, ldy, n0, n1);
  if (is_ggml_block(w.type)) return ggml_matmul_quant_avx2(qa, m, act, w, y, ldy, n0, n1);
  if (act == ActType::I16) {
    const PlainAct<int16_t> a = plain_act_view<int16_t>(const_cast<void*>(qa), m, nblocks(w));
    if (w.type == WeightType::Q8) return matmul16_t<WeightType::Q8>(a, m, w, y, ldy, n0, n1);
    if (w.type == WeightType::Q4) return matmul16_t<WeightType::Q4>(a, m, w, y, ldy, n0, n1);
    return matmul16_t<WeightType::Q4M>(a, m, w, y, ldy, n0, n1);
  }
  const QuantAct a = act_view(const_cast<void*>(qa), m, nblocks(w));
  if (w.type == WeightType::Q8) return matmul_t<WeightType::Q8>(a, m, w, y, ldy, n0, n1);
  if (w.type == WeightType::Q4) return matmul_t<WeightType::Q4>(a, m, w, y, ldy, n0, n1);
  return matmul_t<WeightType::Q4M>(a, m, w, y, ldy, n0, n1);
}

void avx512_matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy,
                   int64_t n0, int64_t n1) {
  thread_local std::vector<uint8_t, avx512::AlignedAlloc<uint8_t>> qa;
  qa.resize(avx512_quant_act_bytes(w, m, ActType::I8));
  avx512_quantize_act(x, m, ldx, w, ActType::I8, qa.data());
  avx512_matmul_quant(qa.data(), m, ActType::I8, w, y, ldy, n0, n1);
}

}  // namespace quant
}  // namespace corelm

namespace corelm {
namespace sparse {
void expand_supers_avx512(const PackedMatrix& w, int64_t s0, int64_t s1, uint8_t* dst) {
  if (!quant::kSparseVbmi2) return expand_supers(w, DenseLayout::Grouped, s0, s1, dst);
  if (w.type == WeightType::SQ8) return quant::sparse_expand<WeightType::Q8>(w, s0, s1, dst);
  quant::sparse_expand<WeightType::Q4>(w, s0, s1, dst);
}
}  // namespace sparse
}  // namespace corelm
