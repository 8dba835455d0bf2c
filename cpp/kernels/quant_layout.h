// The grouped layout of the block-quantized formats (Q8, Q4, Q4M) that the AVX-512 and AVX2 kernel
// tables share (arithmetic in quant_formats.h). Plain C++: the packers are built for the baseline ISA
// and each ISA file includes this header for the addressing.
//
// Rows go in groups of 8, groups in super-groups of kSuper (the last super-group may have fewer, ns).
// A super-group is nb block rows, one per 32-column block, each
//   qs[ns][QSB]  the groups' quants (QSB = 256 bytes for Q8, 128 for Q4/Q4M)
//   d[ns][8]     fp16 scales of each group's 8 rows
//   m[ns][8]     fp16 minimums (Q4M only)
// padded to 64 bytes, and super-groups follow each other: decode, which multiplies a super-group's
// groups at once, reads the whole matrix as one sequential stream. Rows past the matrix are zeros.
//
// A group's quants of one block, in 32-byte pieces p = 0..7: piece p holds columns 4p..4p+3 of the
// 8 rows, row j in bytes 4j..4j+3. So one 32-bit lane is one row, and a 4-byte activation broadcast
// against a piece adds four products to each of the 8 rows (AVX2: VPMADDUBSW + VPMADDWD); a 64-byte
// vector holds pieces 2t and 2t+1, i.e. rows in lanes 0..7 for columns 8t..8t+3 and again in lanes
// 8..15 for 8t+4..8t+7 (AVX-512: one VPDPBUSD against activations spread the same way).
// Q8 stores q + 128 (unsigned, for VPDPBUSD). Q4/Q4M store 128 bytes: byte i of 64-byte vector u
// holds in its low nibble the value of byte i of Q8-vector 2u and in its high nibble that of 2u+1.
#pragma once
#include <algorithm>
#include <cstdint>

#include "kernels/quant_formats.h"

namespace corelm {
namespace quant {
namespace {  // each ISA file's own copy, built with its flags (see kernels/kernel_util.h)

constexpr int64_t kGroup = 8;
// Decode multiplies a super-group's kSuper groups at once (each activation load serves 32 rows).
// With each group a record of its own (quants, then scales) decode read a dozen short streams at
// once (4 KB each at 896 columns), which the hardware prefetcher kept retraining on: one core got
// ~24 GB/s of Q4 in the model's shapes against ~33 for a plain read (tools/bench/bench_quant.py --stream).
constexpr int kSuper = 4;

constexpr int64_t qs_bytes(WeightType t) { return t == WeightType::Q8 ? 256 : 128; }
inline int64_t nblocks(const PackedMatrix& w) { return w.ld / kBlock; }
inline int64_t ngroups(int64_t rows) { return (rows + kGroup - 1) / kGroup; }
// Bytes of a block row of ns groups, and of a super-group of them.
inline int64_t row_bytes(WeightType t, int64_t ns) {
  return (ns * (qs_bytes(t) + 16 * (t == WeightType::Q4M ? 2 : 1)) + 63) / 64 * 64;
}
inline int64_t super_bytes(WeightType t, int64_t nb, int64_t ns) { return nb * row_bytes(t, ns); }

// Where group g's data starts, and the strides from one block to the next: group g + i of the same
// super-group is at qs + i * QSB, d + 8 * i, m + 8 * i.
struct GroupView {
  const uint8_t* qs;      // block 0
  const uint16_t *d, *m;  // block 0 (m: Q4M only)
  int64_t qstride;        // bytes from block b to b + 1 (a block row)
  int64_t dstride;        // the same in fp16 entries (d and m)
  int64_t ns;             // groups in this super-group
  int64_t first;          // the super-group's first group
};
inline GroupView group_view(const void* base, WeightType t, int64_t nb, int64_t groups, int64_t g) {
  const int64_t s = g / kSuper, first = s * kSuper, ns = std::min<int64_t>(kSuper, groups - first), i = g - first;
  const uint8_t* rec = static_cast<const uint8_t*>(base) + (size_t)s * super_bytes(t, nb, kSuper);
  const uint16_t* d = reinterpret_cast<const uint16_t*>(rec + ns * qs_bytes(t));
  const int64_t rb = row_bytes(t, ns);
  return {rec + i * qs_bytes(t), d + 8 * i, d + ns * 8 + 8 * i, rb, rb / 2, ns, first};
}

// The quantized activations as the AVX2 kernels (int8 and int16) and the AVX-512 int16 kernels take
// them (avx2_quantize_act writes it): per row and block the 32 quants, dx, dxs = dx * sum(xq) (times
// Q4M's minimum) and corr, the int32 added to each row's block sum for the stored offset (I8: Q4
// -8 * sum(xq), else 0; I16, which reads the stored bytes unsigned: Q8 -128 * sum(xq), Q4 -8 * sum(xq),
// Q4M 0). Rows are whole blocks, so a block's quants are 32-byte (int8) or 64-byte (int16) aligned.
template <class E>
struct PlainAct {
  E* q;  // [m][nb][32]
  float *dx, *dxs;
  int32_t* corr;  // dx, dxs, corr: [m][nb]
};

inline size_t plain_act_bytes(int64_t m, int64_t nb, size_t elem) { return ((32 * elem + 12) * m * nb + 63) / 64 * 64; }

template <class E>
inline PlainAct<E> plain_act_view(void* buf, int64_t m, int64_t nb) {
  E* q = static_cast<E*>(buf);
  float* dx = reinterpret_cast<float*>(q + 32 * m * nb);
  return {q, dx, dx + m * nb, reinterpret_cast<int32_t*>(dx + 2 * m * nb)};
}

// Rows [n0, n1) of w in pieces of about `bytes` of its weights (whole super-groups): f(a, e) for each
// piece [a, e), so that several passes over a piece (a few activation rows, some at a time) find it in L2.
template <class F>
inline void for_l2_pieces(const PackedMatrix& w, int64_t n0, int64_t n1, int64_t bytes, F f) {
  const int64_t align = kGroup * kSuper;
  const int64_t piece = std::max<int64_t>(align, (int64_t)(bytes / std::max<size_t>(1, w.nbytes / w.rows)) / align * align);
  for (int64_t a = n0; a < n1;) {
    const int64_t e = std::min(n1, (a / align + piece / align) * align);
    f(a, e);
    a = e;
  }
}

}  // namespace

// The grouped layout's packers and row reader; `by` is the table the matrix is handed to.
PackedMatrix grouped_pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par,
                          const KernelTable* by);
PackedMatrix grouped_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par,
                              const KernelTable* by);
void grouped_row_to_f32(const PackedMatrix& w, int64_t row, float* out);

}  // namespace quant
}  // namespace corelm
