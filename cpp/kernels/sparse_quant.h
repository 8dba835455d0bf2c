// Unstructured-sparse Q8/Q4 weights (SQ8, SQ4; docs/model-format.md): the dense format's codes
// (quant_formats.h: the same quantizer, the same fp16 scale per block of 32 dense positions) with the
// zero codes dropped: a weight is zero exactly when its code is the zero code (Q8: q = 0; Q4: q = 8),
// so a sparse matrix holds exactly the dense quantized matrix and every kernel that expands its
// non-zeros back into the dense grouped layout (quant_layout.h) and runs the dense arithmetic gets the
// dense matrix's bits. One layout for every table (plain C++ here; the ISA files read it with their
// own instructions):
//
//   u64 offsets[supers + 1]  byte offset from the storage start to each super-group's record (the
//                            last: the end of the records), padded to 64 bytes
//   records, 64-byte aligned one per super-group of quant_layout.h (kSuper groups of 8 rows; the last
//                            may have fewer, ns):
//     u32 block[nb]          byte offset from the record's start to each block along K, so decode
//                            finds every block without the codes before it (no chain of dependent
//                            loads through the stream), then per block
//     u16 d[ns][8]           the dense layout's fp16 scales of the ns groups' rows
//     u64 mask[ns][4]        bit e of mask[i][t]: position 64t + e of group i's block, in the order
//                            the dense AVX-512 kernel's four VPDPBUSD vectors W_t hold it (row
//                            e/4 % 8, column 8t + 4(e/32) + e%4), has a non-zero code
//     codes                  group by group, each window's codes in position order: SQ8 window
//                            t = 0..3 by window, one byte each, the dense layout's stored byte
//                            (q + 128); SQ4 windows 2u and 2u + 1 (u = 0, 1) in the low and the high
//                            nibbles of the same max(n_2u, n_2u+1) bytes (n: a window's codes), as
//                            the dense layout keeps W_2u and W_2u+1 in one vector's nibbles
//   64 zero bytes            kernels may load a whole vector at the last codes
//
// So decode reads a super-group as one sequential stream (as the dense layout) and expands each
// window with one VPEXPANDB whose merge source holds the zero code; SQ4 gets a window's codes as
// bytes with an AND or a shift and an AND, where nibbles in code order took a widening shuffle and
// three more operations per window (the sparse decode's bound on the Xeon), for about 2% more bytes at
// 50% sparsity (the pair's counts differ by ~4.5 codes). Rows past the matrix have no non-zeros (and
// scale 0).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/kernels.h"
#include "kernels/quant_layout.h"
#include "kernels/sparse_layout.h"

namespace corelm {
namespace sparse {

constexpr int64_t kQuantSuper = 4;         // groups per record (quant_layout.h's kSuper)
constexpr int64_t kQuantSuperRows = 32;    // rows per record
inline int64_t nsupers(int64_t rows) { return (rows + kQuantSuperRows - 1) / kQuantSuperRows; }
inline const uint8_t* quant_record(const PackedMatrix& w, int64_t s) {
  return static_cast<const uint8_t*>(w.data()) + static_cast<const uint64_t*>(w.data())[s];
}
// The zero code as the dense layout stores it, expanded (Q8: 128 = q + 128; Q4: 8).
inline uint8_t zero_code(WeightType t) { return t == WeightType::SQ8 ? 0x80 : 0x08; }
// Bytes of a group block's codes, from its four window masks (SQ4: a pair's bytes, pair_bytes).
inline int64_t pair_bytes(const uint64_t* mask, int u) {  // 64-bit: no sign extension on decode's pointer walk
  return std::max<int64_t>(__builtin_popcountll(mask[2 * u]), __builtin_popcountll(mask[2 * u + 1]));
}
// How far the codes advance past window w (SQ4: a pair's bytes after its second window, none after its first).
inline int64_t window_advance(WeightType t, const uint64_t* mask, int w) {
  return t == WeightType::SQ8 ? __builtin_popcountll(mask[w]) : w % 2 ? pair_bytes(mask, w / 2) : 0;
}
inline int64_t codes_bytes(WeightType t, const uint64_t* mask) {
  int64_t n = 0;
  for (int w = 0; w < 4; w++) n += window_advance(t, mask, w);
  return n;
}
// Block b of a record: its scales; the masks follow at + 16 ns, the codes at + 48 ns.
inline const uint8_t* quant_block(const uint8_t* rec, int64_t b) {
  uint32_t o;
  __builtin_memcpy(&o, rec + 4 * b, 4);
  return rec + o;
}

// From floats (quantized as the dense type, then the zero codes dropped) and from dense Q8_0/Q4_0
// blocks (what the loader expands a sparse file tensor into).
PackedMatrix quant_pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par,
                        const KernelTable* by);
PackedMatrix quant_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par,
                            const KernelTable* by);

// Where a table's dense kernels read the expanded rows: the grouped layout (AVX-512, AVX2) or
// row-major ggml blocks (the scalar table).
enum class DenseLayout { Grouped, GgmlRows };
// Super-groups [s0, s1) expanded into dst (64-byte aligned, dense_bytes(w, s0, s1) bytes) in that
// layout, and the dense matrix of those rows that reads it (not owning dst; packed_by w's table).
size_t dense_bytes(const PackedMatrix& w, DenseLayout layout, int64_t s0, int64_t s1);
void expand_supers(const PackedMatrix& w, DenseLayout layout, int64_t s0, int64_t s1, uint8_t* dst);
PackedMatrix dense_view(const PackedMatrix& w, DenseLayout layout, int64_t s0, int64_t s1, uint8_t* dst);
// w with its dense type (for sizing and quantizing activations, which depend on the type only).
PackedMatrix as_dense_type(const PackedMatrix& w);

using DenseMatmulQuant = void (*)(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y,
                                  int64_t ldy, int64_t n0, int64_t n1);
using ExpandSupers = void (*)(const PackedMatrix& w, int64_t s0, int64_t s1, uint8_t* dst);
// The table's two-step matmul on a sparse matrix: panels of super-groups expanded (expand: a faster
// expand_supers for the grouped layout, or null) into scratch, each multiplied by `dense` for all m rows.
void quant_matmul_panels(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                         int64_t n0, int64_t n1, DenseLayout layout, DenseMatmulQuant dense, ExpandSupers expand);
void quant_row_to_f32(const PackedMatrix& w, int64_t row, float* out);
int64_t count_quant_nonzeros(const PackedMatrix& w);

namespace {  // each ISA file's own copy, built with its flags (see kernels/kernel_util.h)
// expand_supers' walk for the grouped layout: copies each block's scales to dst and calls
// group(masks, codes, qs) for each group's block (qs: where the dense layout puts its quants), which
// writes them and returns the next group's codes.
template <class Group>
inline void expand_grouped(const PackedMatrix& w, int64_t s0, int64_t s1, uint8_t* dst, Group group) {
  const WeightType dt = dense_type(w.type);
  const int64_t nb = quant::nblocks(w), groups = quant::ngroups(w.rows), qsb = quant::qs_bytes(dt);
  for (int64_t s = s0; s < s1; s++) {
    const int64_t ns = std::min<int64_t>(quant::kSuper, groups - s * quant::kSuper), rb = quant::row_bytes(dt, ns);
    const uint8_t* rec = quant_record(w, s);
    for (int64_t b = 0; b < nb; b++, dst += rb) {
      const uint8_t* blk = quant_block(rec, b);
      std::memcpy(dst + ns * qsb, blk, 16 * ns);
      const uint8_t* p = blk + 48 * ns;
      for (int64_t i = 0; i < ns; i++) p = group(blk + 16 * ns + 32 * i, p, dst + i * qsb);
    }
  }
}
}  // namespace

#if defined(CORELM_HAVE_X86)
// expand_supers (grouped) with VPEXPANDB where the CPU has VBMI2, else plain code (the same bytes).
void expand_supers_avx512(const PackedMatrix& w, int64_t s0, int64_t s1, uint8_t* dst);
// The same with PSHUFB, 8 positions at a time (the AVX2 table's).
void expand_supers_avx2(const PackedMatrix& w, int64_t s0, int64_t s1, uint8_t* dst);
#endif

}  // namespace sparse
}  // namespace corelm
