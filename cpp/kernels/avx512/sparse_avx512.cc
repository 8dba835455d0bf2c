// AVX-512 kernels for sparse bf16 weights (kernels/sparse_layout.h). Built with AVX-512 flags; the
// instructions beyond them (VBMI2, BITALG, AVX512_BF16) run only where CPUID reports them, and other
// AVX-512 CPUs expand with plain code into the dense kernels.
//
// Decode (one activation row) streams the sparse records directly: each row's 32 weights of a chunk
// are expanded in registers from its non-zeros under its mask, then multiplied as the dense bf16 GEMV
// multiplies (two fp32 FMAs on the widened weights, in its order), so a sparse matrix gives exactly
// the dense matrix's bits while memory delivers only the masks and the non-zeros. Two ways to expand:
// VPEXPANDW, or VPOPCNTW ranks of the set bits and VPERMW. On Zen 4 both cost ~3.6 cycles per 32
// weights, the ranks slightly less, so AMD CPUs with BITALG take the ranks; on the Xeon with AMX a
// 50%-sparse matrix in L3 streams at 13 GB/s with the ranks and 16.5 with VPEXPANDW,
// so every other CPU takes VPEXPANDW.
// Decode prefetches the records ahead (sparse_layout.h: prefetch_ahead).
// The AVX512_BF16 table (bf16_dot) multiplies a small batch (2..kRowExactRows rows) as its dense
// kernels do, with VDPBF16PS on activations rounded to bf16, straight from the records: one
// expansion per weight for the whole batch. Everything else expands a few hundred rows at a time into
// the dense layout and hands them to the table's dense matmul (panel GEMM, VDPBF16PS), which
// reuses them across every activation row and gives the dense matrix's bits.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/tuning.h"
#include "kernels/avx512/kernels_avx512_bf16.h"
#include "kernels/decode_store.h"
#include "kernels/kernel_util.h"
#include "kernels/sparse_layout.h"

namespace corelm {
namespace sparse {
namespace {

static_assert(kGroup == avx512::kGroup && kChunk == avx512::kChunk, "expanded records are the dense layout");

inline __mmask16 tail_mask(int64_t n) { return (__mmask16)((1u << n) - 1u); }

// What the CPU offers; CORELM_SPARSE_WITHOUT=bf16|bitalg|vbmi2 takes that instruction set away (and
// the ones before it in this list), and CORELM_SPARSE_EXPAND=ranks|vpexpandw picks the expansion where
// both run, so the tests run every path on one machine.
const int kWithout = tuning::sparse_without_level();
const bool kVbmi2 = cpu_features().avx512_vbmi2 && cpu_features().os_avx512 && kWithout < 3;
const bool kBitalg = kVbmi2 && cpu_features().avx512_bitalg && kWithout < 2;
const bool kBf16 = kVbmi2 && cpu_features().avx512_bf16 && kWithout < 1;
const bool kRanks = kBitalg && tuning::sparse_expand_ranks(cpu_features().amd);
const int64_t kPrefetchBytes = record_prefetch_bytes();
const bool kPrefetchL2 = record_prefetch_l2();
constexpr int kMaxRows = 3;  // activation rows per pass over a group (VDPBF16PS: 8 x 3 accumulators)

#define CORELM_SPARSE_TARGET __attribute__((target("avx512vbmi2,avx512bitalg,avx512bf16")))

// One row's 32 weights of a chunk from its non-zeros at v under its mask (the u32 at mask). PERM: ranks
// of the set bits (VPOPCNTW over the bits below each lane) pick the values with VPERMW; else
// VPEXPANDW. Both read a whole vector at v (the layout keeps slack after the records).
template <bool PERM>
CORELM_SPARSE_TARGET inline __m512i expand(const uint8_t* mask_at, const uint16_t* v) {
  __m512i raw = _mm512_loadu_si512((const void*)v);
  if constexpr (PERM) {
    uint32_t mask;
    std::memcpy(&mask, mask_at, 4);
    const __m512i below = _mm512_set_epi16(0x7fff, 0x3fff, 0x1fff, 0xfff, 0x7ff, 0x3ff, 0x1ff, 0xff, 0x7f, 0x3f, 0x1f,
                                           0xf, 7, 3, 1, 0, 0x7fff, 0x3fff, 0x1fff, 0xfff, 0x7ff, 0x3ff, 0x1ff, 0xff,
                                           0x7f, 0x3f, 0x1f, 0xf, 7, 3, 1, 0);
    const __m512i halves = _mm512_mask_blend_epi16(0xffff0000u, _mm512_set1_epi16((short)(mask & 0xffff)),
                                                   _mm512_set1_epi16((short)(mask >> 16)));
    __m512i rank = _mm512_popcnt_epi16(_mm512_and_si512(halves, below));
    rank = _mm512_mask_add_epi16(rank, 0xffff0000u, rank, _mm512_set1_epi16((short)__builtin_popcount(mask & 0xffff)));
    return _mm512_maskz_permutexvar_epi16((__mmask32)mask, rank, raw);
  } else {
    // The mask straight from memory into a k register: given the u32, the compiler loads each mask
    // once into k and moves it across for the popcounts (KMOVD, KSHIFTRQ), ~20 cycles of moves on each
    // chunk's way to the next (a 50%-sparse 896 x 896 from L2: 40 cycles per 8 x 32 chunk).
    __mmask32 k;
    __asm__("kmovd %1, %0" : "=k"(k) : "m"(*reinterpret_cast<const uint32_t*>(mask_at)));
    __asm__("" : "+v"(raw));  // keep the plain load: folded into VPEXPANDW's memory form it is slower
    return _mm512_maskz_expand_epi16(k, raw);
  }
}

// Calls row(j, mask, v) for each of a chunk's 8 rows (its mask, a u32 at mask; its non-zeros at v), each
// row's start the last one's plus its popcount, and returns the next chunk. One pointer walks the rows:
// with all 8 starts worked out first, GCC kept them in stack slots and vector registers (7 moves between
// general and vector registers a chunk, on the ports the expansion needs): an L3-resident 50%-sparse
// 896 x 4864 took 306-312 us against 264-283 now.
template <class Row>
CORELM_SPARSE_TARGET __attribute__((always_inline)) inline const uint8_t* for_rows(const uint8_t* p, Row row) {
  const uint16_t* v = reinterpret_cast<const uint16_t*>(p + kGroup * 4);
#pragma GCC unroll 8
  for (int j = 0; j < kGroup; j++) {
    row(j, p + 4 * j, v);
    uint32_t m;
    std::memcpy(&m, p + 4 * j, 4);
    v += __builtin_popcount(m);
  }
  return reinterpret_cast<const uint8_t*>(v);
}

// Group g's rows in [n0, n1) of MR activation rows, from each row's 8 accumulators (their lanes summed
// as _mm512_reduce_add_ps sums them); one row's whole group is written past the caches (decode_store.h).
inline void store_group(float* y, int64_t ldy, int64_t g, int64_t n0, int64_t n1, const __m512 (*acc)[kGroup], int MR) {
  const int64_t r0 = g * kGroup, lo = std::max<int64_t>(n0 - r0, 0), hi = std::min<int64_t>(n1 - r0, kGroup);
  const __mmask8 keep = (__mmask8)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
  for (int i = 0; i < MR; i++) {
    const __m256 s = avx512::sum8(acc[i]);
    if (!(MR == 1 && keep == 0xff && stream_rows8(y + r0, s))) _mm256_mask_storeu_ps(y + i * ldy + r0, keep, s);
  }
}

// Group g's rows of MR activation rows through VDPBF16PS: y[i * ldy + r] for the group's rows r in
// [n0, n1).
template <bool PERM, int MR>
CORELM_SPARSE_TARGET void group_dp(const float* x, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy,
                                   int64_t g, int64_t n0, int64_t n1) {
  const int64_t K = w.cols, nc = nchunks(K), full = K / kChunk;
  const __mmask16 m_lo = K % kChunk >= 16 ? (__mmask16)0xffff : tail_mask(K % 16);
  const __mmask16 m_hi = K % kChunk > 16 ? tail_mask(K % kChunk - 16) : (__mmask16)0;
  const uint8_t* p = record(w, g);
  __m512 acc[MR][kGroup];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < kGroup; j++) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < nc; c++) {
    __m512bh xb[MR];
    for (int i = 0; i < MR; i++) {
      const float* xr = x + i * ldx + c * kChunk;
      const __m512 x0 = c < full ? _mm512_loadu_ps(xr) : _mm512_maskz_loadu_ps(m_lo, xr);
      const __m512 x1 = c < full ? _mm512_loadu_ps(xr + 16) : _mm512_maskz_loadu_ps(m_hi, xr + 16);
      xb[i] = _mm512_cvtne2ps_pbh(x1, x0);
    }
    const uint8_t* const at = p;
    p = for_rows(p, [&](int j, const uint8_t* mask, const uint16_t* v) CORELM_SPARSE_TARGET {
      const __m512bh wv = (__m512bh)expand<PERM>(mask, v);
      for (int i = 0; i < MR; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xb[i]);
    });
    prefetch_ahead(at, p, kPrefetchBytes, kPrefetchL2);
  }
  store_group(y, ldy, g, n0, n1, acc, MR);
}

template <bool PERM>
void gemv_dp(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
             int64_t n1) {
  for (int64_t g = n0 / kGroup; g * kGroup < n1; g++) {
    int64_t i = 0;
    for (; i + kMaxRows <= m; i += kMaxRows) group_dp<PERM, kMaxRows>(x + i * ldx, ldx, w, y + i * ldy, ldy, g, n0, n1);
    if (m - i == 2) group_dp<PERM, 2>(x + i * ldx, ldx, w, y + i * ldy, ldy, g, n0, n1);
    if (m - i == 1) group_dp<PERM, 1>(x + i * ldx, ldx, w, y + i * ldy, ldy, g, n0, n1);
  }
  end_decode_stores();
}

// Decode without AVX512_BF16: the dense bf16 gemv (kernels_avx512.cc) on expanded weights, in its order.
template <bool PERM>
CORELM_SPARSE_TARGET void gemv_fma(const float* x, const PackedMatrix& w, float* y, int64_t n0, int64_t n1) {
  const int64_t nc = nchunks(w.cols);
  const avx512::EvenOddX xs(w.cols);
  for (int64_t g = n0 / kGroup; g * kGroup < n1; g++) {
    const uint8_t* p = record(w, g);
    __m512 acc[kGroup], acc2[kGroup];
    for (int j = 0; j < kGroup; j++) acc[j] = acc2[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
      __m512 xe, xo;
      xs.split(x, c, xe, xo);
      const uint8_t* const at = p;
      p = for_rows(p, [&](int j, const uint8_t* mask, const uint16_t* v) CORELM_SPARSE_TARGET {
        const __m512i wv = expand<PERM>(mask, v);
        acc[j] = _mm512_fmadd_ps(xe, avx512::widen_even(wv), acc[j]);
        acc2[j] = _mm512_fmadd_ps(xo, avx512::widen_odd(wv), acc2[j]);
      });
      prefetch_ahead(at, p, kPrefetchBytes, kPrefetchL2);
    }
    for (int j = 0; j < kGroup; j++) acc[j] = _mm512_add_ps(acc[j], acc2[j]);
    store_group(y, 0, g, n0, n1, &acc, 1);
  }
  end_decode_stores();
}

// Group g expanded into dst (expand_group's strides).
template <bool PERM>
CORELM_SPARSE_TARGET void expand_group_simd(const PackedMatrix& w, int64_t g, uint16_t* dst, int64_t row_stride,
                                            int64_t chunk_stride) {
  const int64_t nc = nchunks(w.cols);
  const uint8_t* p = record(w, g);
  for (int64_t c = 0; c < nc; c++, dst += chunk_stride) {
    const uint8_t* const at = p;
    p = for_rows(p, [&](int j, const uint8_t* mask, const uint16_t* v) CORELM_SPARSE_TARGET {
      _mm512_storeu_si512((void*)(dst + j * row_stride), expand<PERM>(mask, v));
    });
    prefetch_ahead(at, p, kPrefetchBytes, kPrefetchL2);
  }
}

// Rows expanded at a time for the dense kernels: whole 32-row panels, ~4 MiB of them. Each dense call
// sets up its activations anew (the VDPBF16PS GEMM rounds all of x to bf16), which at 512 KiB per call
// cost a 128-token prefill 16% on Zen 4; the expanded rows are read back once either way.
constexpr int64_t kExpandBytes = 4 << 20;
inline int64_t rows_per_expand(int64_t cols) {
  return std::max<int64_t>(32, kExpandBytes / (nchunks(cols) * kChunk * 2) / 32 * 32);
}

void expand_panels(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                   int64_t n1, DenseMatmul dense) {
  const int64_t nc = nchunks(w.cols), group_elems = nc * kGroup * kChunk, step = rows_per_expand(w.cols);
  thread_local std::vector<uint16_t, AlignedAlloc<uint16_t>> buf;
  if ((int64_t)buf.size() < step / kGroup * group_elems) buf.resize(step / kGroup * group_elems);
  for (int64_t p0 = n0 / kGroup * kGroup; p0 < n1; p0 += step) {
    const int64_t rows = std::min({step, w.rows - p0, (n1 - p0 + kGroup - 1) / kGroup * kGroup}), groups = ngroups(rows);
    for (int64_t i = 0; i < groups; i++) {
      uint16_t* dst = buf.data() + i * group_elems;
      const int64_t g = p0 / kGroup + i;
      expand_group_avx512(w, g, dst, kChunk, kGroup * kChunk);
    }
    PackedMatrix view;  // the rows as a dense bf16 matrix of the table that packed w
    view.type = WeightType::BF16;
    view.rows = std::min(rows, w.rows - p0);
    view.cols = w.cols;
    view.ld = nc * kChunk;
    view.nbytes = (size_t)groups * group_elems * 2;
    view.packed_by = w.packed_by;
    view.storage = std::shared_ptr<void>(std::shared_ptr<void>(), buf.data());  // not owned
    dense(x, m, ldx, view, y + p0, ldy, std::max(n0, p0) - p0, std::min(n1, p0 + rows) - p0);
  }
}

}  // namespace

void expand_group_avx512(const PackedMatrix& w, int64_t g, uint16_t* dst, int64_t row_stride, int64_t chunk_stride) {
  if (kRanks) expand_group_simd<true>(w, g, dst, row_stride, chunk_stride);
  else if (kVbmi2) expand_group_simd<false>(w, g, dst, row_stride, chunk_stride);
  else expand_group(w, g, dst, row_stride, chunk_stride);
}

void matmul_avx512(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                   int64_t n1, DenseMatmul dense, bool bf16_dot) {
  n1 = std::min(n1, w.rows);
  if (n0 >= n1) return;
  if (m == 1 && kVbmi2) return kRanks ? gemv_fma<true>(x, w, y, n0, n1) : gemv_fma<false>(x, w, y, n0, n1);
  if (bf16_dot && kBf16 && m <= kRowExactRows)
    return kRanks ? gemv_dp<true>(x, m, ldx, w, y, ldy, n0, n1) : gemv_dp<false>(x, m, ldx, w, y, ldy, n0, n1);
  expand_panels(x, m, ldx, w, y, ldy, n0, n1, dense);
}

}  // namespace sparse
}  // namespace corelm
