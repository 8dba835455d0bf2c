// The grouped layout of the GGUF block types that the AVX-512 and AVX2 tables repack (Q4_K, Q5_K,
// Q6_K, IQ4_XS, Q5_0, Q5_1, IQ4_NL): quant_layout.h's rows in groups of 8 and super-groups of kSuper groups, its
// 4-bit quant bytes, and every other bit and scale of the file kept exactly (ggml_formats.h defines
// the values). Decode then multiplies 8 rows at once with no horizontal sums, as for Q4/Q4M.
//
// A super-group (ns groups) is, super-block after super-block (256 columns; 32 for Q5_0/Q5_1/IQ4_NL):
//   header  D[ns][8] fp16 (the file's d of each row), Dm[ns][8] fp16 (Q4_K/Q5_K: dmin; Q5_1: -m,
//           the minimum with its sign bit flipped, exactly), S[ns][nsc][8] int8 (the sub-block scales
//           s, nsc per super-block and row: 8, Q6_K 16), M[ns][chunks][8] uint8 (Q4_K/Q5_K: the
//           minimums mn; Q5_1's are all 1, not stored: its header is 32 bytes a row), padded to 64 bytes
//   then per chunk of 32 columns
//           qs[ns][128]  the low 4 bits of each code u, in quant_layout.h's Q4 order
//           hi[ns][HB]   Q5_*: bit 4 of u (HB 32: byte i bit p = piece p's byte i); Q6_K: bits 4-5
//                        (HB 64: byte 32v + i, bits 2f..2f+1 = piece 4v + f's byte i), padded to 64
// A piece p (0..7) is the 32 bytes of 8 rows x columns 4p..4p+3 (row j in bytes 4j..4j+3), as the
// AVX-512 int16 kernels walk a block. The value is v = u - kOffset[type] (Q6_K 32, Q5_0 16), or the
// IQ4 table's entry for u.
#pragma once
#include <cstdint>
#include <type_traits>

#include "kernels/ggml_formats.h"
#include "kernels/quant_layout.h"

namespace corelm {
namespace quant {
namespace {

struct GroupedTraits {
  int chunks;     // chunks of 32 columns per super-block
  int hi_bits;    // bits of u above the low 4
  int offset;     // v = u - offset (table types: 0, the table gives v)
  bool table;     // IQ4: v = kIq4Values[u]
  bool halves;    // sub-block scales per 16 columns
  bool mins;      // Dm
  bool scales;    // S (else s = 1)
  bool min_codes; // M, the integer minimums under Dm (Q5_1's are all 1: not stored)
};
// The one list of grouped types and their traits; other types get chunks = 0.
constexpr GroupedTraits grouped_traits(WeightType t) {
  switch (t) {
    case WeightType::Q4_K: return {8, 0, 0, false, false, true, true, true};
    case WeightType::Q5_K: return {8, 1, 0, false, false, true, true, true};
    case WeightType::Q6_K: return {8, 2, 32, false, true, false, true, false};
    case WeightType::IQ4_XS: return {8, 0, 0, true, false, false, true, false};
    case WeightType::Q5_0: return {1, 1, 16, false, false, false, false, false};
    case WeightType::Q5_1: return {1, 1, 0, false, false, true, false, false};
    case WeightType::IQ4_NL: return {1, 0, 0, true, false, false, false, false};
    default: return {0, 0, 0, false, false, false, false, false};
  }
}
inline bool is_grouped_ggml(WeightType t) { return has_kind(t, kGrouped); }
// The rows marked kGrouped are the types listed here, each a super-block of `chunks` chunks of 32.
constexpr bool grouped_traits_match_rows() {
  for (const WeightTraits& r : kWeightTraits)
    if ((grouped_traits(r.value).chunks > 0) != ((r.kind & kGrouped) != 0) ||
        ((r.kind & kGrouped) && grouped_traits(r.value).chunks * 32 != r.block))
      return false;
  return true;
}
static_assert(grouped_traits_match_rows(), "grouped_traits and formats/traits.h's kGrouped rows disagree");

// Calls f(std::integral_constant<WeightType, T>()) for grouped type t (nothing for another type): how
// the kernels instantiate one matmul per type.
template <class F>
inline void with_grouped_type(WeightType t, F f) {
  switch (t) {
#define CORELM_GROUPED(T) \
  case WeightType::T: return f(std::integral_constant<WeightType, WeightType::T>());
    CORELM_GROUPED(Q4_K)
    CORELM_GROUPED(Q5_K)
    CORELM_GROUPED(Q6_K)
    CORELM_GROUPED(IQ4_XS)
    CORELM_GROUPED(Q5_0)
    CORELM_GROUPED(Q5_1)
    CORELM_GROUPED(IQ4_NL)
#undef CORELM_GROUPED
    default: return;
  }
}

// Bytes per group of each part, and of a super-block's header and chunk row for ns groups.
inline int64_t grouped_nsc(const GroupedTraits& g) { return g.scales ? g.chunks * (g.halves ? 2 : 1) : 0; }
inline int64_t grouped_header_bytes(const GroupedTraits& g, int64_t ns) {
  return (ns * (16 + (g.mins ? 16 : 0) + (g.min_codes ? 8 * g.chunks : 0) + 8 * grouped_nsc(g)) + 63) / 64 * 64;
}
inline int64_t grouped_hi_bytes(const GroupedTraits& g) { return g.hi_bits * 32; }
inline int64_t grouped_chunk_bytes(const GroupedTraits& g, int64_t ns) {
  return (ns * (128 + grouped_hi_bytes(g)) + 63) / 64 * 64;
}
inline int64_t grouped_sb_bytes(const GroupedTraits& g, int64_t ns) {
  return grouped_header_bytes(g, ns) + g.chunks * grouped_chunk_bytes(g, ns);
}
// A whole matrix of `groups` 8-row groups: full super-groups, then a partial one.
inline size_t grouped_bytes(const GroupedTraits& g, int64_t nsb, int64_t groups) {
  const int64_t full = groups / kSuper, tail = groups % kSuper;
  return (size_t)(full * nsb * grouped_sb_bytes(g, kSuper) + (tail ? nsb * grouped_sb_bytes(g, tail) : 0));
}

// Where group g (of `groups`) of a matrix with nsb super-blocks per row starts: its super-group's
// first super-block, the group's index in it (i) and the super-group's size (ns).
struct GroupedView {
  const uint8_t* base;  // the super-group's first super-block header
  int64_t i, ns, first;
  int64_t sb_bytes, header_bytes, chunk_bytes;
  GroupedTraits tr;
  const uint16_t* D(int64_t sb) const { return reinterpret_cast<const uint16_t*>(base + sb * sb_bytes) + 8 * i; }
  const uint16_t* Dm(int64_t sb) const { return reinterpret_cast<const uint16_t*>(base + sb * sb_bytes) + 8 * ns + 8 * i; }
  const int8_t* S(int64_t sb, int64_t k) const {  // k: chunk (or chunk * 2 + half)
    return reinterpret_cast<const int8_t*>(base + sb * sb_bytes + ns * (16 + (tr.mins ? 16 : 0))) +
           (i * grouped_nsc(tr) + k) * 8;
  }
  const uint8_t* M(int64_t sb, int64_t c) const {
    return base + sb * sb_bytes + ns * (32 + 8 * grouped_nsc(tr)) + (i * tr.chunks + c) * 8;
  }
  const uint8_t* qs(int64_t sb, int64_t c) const { return base + sb * sb_bytes + header_bytes + c * chunk_bytes + i * 128; }
  const uint8_t* hi(int64_t sb, int64_t c) const {
    return base + sb * sb_bytes + header_bytes + c * chunk_bytes + ns * 128 + i * grouped_hi_bytes(tr);
  }
};
inline GroupedView grouped_view(const void* data, WeightType t, int64_t nsb, int64_t groups, int64_t g) {
  const GroupedTraits tr = grouped_traits(t);
  const int64_t s = g / kSuper, first = s * kSuper, ns = std::min<int64_t>(kSuper, groups - first);
  const uint8_t* base = static_cast<const uint8_t*>(data) + (size_t)s * nsb * grouped_sb_bytes(tr, kSuper);
  return {base, g - first, ns, first, grouped_sb_bytes(tr, ns), grouped_header_bytes(tr, ns), grouped_chunk_bytes(tr, ns), tr};
}

// ggml_formats.h's activation layout as the grouped kernels take it: int16 quants (q), or int8 ones
// (q8, the AVX-512 int8 path; q8 null otherwise).
struct GroupedAct {
  const int16_t* q;
  const int8_t* q8;
  const float* dx;
  const int32_t *sx, *sx32;
  int64_t ld, nb;
};
inline GroupedAct grouped_act(const void* qa, int64_t m, const PackedMatrix& w, ActType elems = ActType::I16) {
  const float* dx = reinterpret_cast<const float*>(static_cast<const uint8_t*>(qa) + m * w.ld * act_elem_bytes(elems));
  const int32_t* sx = reinterpret_cast<const int32_t*>(dx + m * (w.ld / 32));
  const bool i8 = elems == ActType::I8;
  return {i8 ? nullptr : static_cast<const int16_t*>(qa), i8 ? static_cast<const int8_t*>(qa) : nullptr, dx, sx,
          sx + m * (w.ld / 16), w.ld, w.ld / 32};
}

// The grouped_traits of T at compile time, for the kernels.
template <WeightType T>
struct Tr {
  static constexpr GroupedTraits g = grouped_traits(T);
  static constexpr bool table = g.table, halves = g.halves, mins = g.mins, scales = g.scales, min_codes = g.min_codes;
  static constexpr int hi = g.hi_bits, offset = g.offset, chunks = g.chunks;
  static constexpr int nsc = scales ? chunks * (halves ? 2 : 1) : 0;
  static constexpr int hi_bytes = 32 * hi;
};

}  // namespace

// Raw GGUF rows of a grouped type repacked (on par's threads when given) for table `by`, and a row
// read back as fp32 (bit for bit ggml_row_to_f32's).
PackedMatrix grouped_ggml_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols,
                                   const ParallelFor* par, const KernelTable* by);
void grouped_ggml_row_to_f32(const PackedMatrix& w, int64_t row, float* out);
#if defined(CORELM_HAVE_X86)
// ggml_quantize_act (act I8) or ggml_quantize_act_wide (I16), vectorized (the same bytes); w.cols must be
// whole blocks of 32, as every grouped type's rows are.
void grouped_ggml_quantize_act_avx512(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act,
                                      void* qa);
void grouped_ggml_quantize_act_avx2(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act,
                                    void* qa);
// y = x W^T for rows [n0, n1) from ggml_quantize_act_wide's activations.
// y = x W^T for rows [n0, n1): AVX-512 from grouped_ggml_quantize_act_avx512's activations (int8 ones for
// act I8), AVX2 from ggml_quantize_act_wide's.
void grouped_ggml_matmul_avx512(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                                int64_t n0, int64_t n1);
// 16 rows of w (panel p: groups 2p and 2p + 1; rows past the matrix 0) as bf16 pairs, AMX-BF16's B
// operand in amx.h's tile order: dst[(k / 2) * 32 + 2 * (row % 16) + k % 2] for k < w.ld, each value
// the table's row_to_f32's rounded to bf16 (nearest even). Q8, Q4, Q4M and the grouped types on a CPU with
// AVX512_BF16; false (nothing written) otherwise.
bool panel_bf16_pairs_avx512(const PackedMatrix& w, int64_t panel, uint16_t* dst);
void grouped_ggml_matmul_avx2(const void* qa, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                              int64_t n1);
#endif

}  // namespace quant
}  // namespace corelm
