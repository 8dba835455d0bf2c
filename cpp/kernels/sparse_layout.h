// Unstructured-sparse weights (SparAMX's idea, docs/model-format.md): a bitmap of the non-zeros and
// the non-zeros themselves, in the order the kernels consume them, so decode reads about
// (1 - s) * 16 + 1 bits per bf16 weight at sparsity s instead of 16. One layout for every table
// (plain C++ here; each ISA file reads it with its own instructions):
//
//   u64 offsets[groups + 1]   byte offset from the storage start to each group's record (the last:
//                             the end of the records), padded to 64 bytes
//   records, 64-byte aligned  rows in groups of 8; per 32-column chunk c of the group,
//     u32 mask[8]             bit i of mask[j]: column 32c + i of row 8g + j is non-zero
//     the non-zeros (bf16)    row 0's in column order, then row 1's, ..., row 7's
//   64 zero bytes             kernels may load a whole vector at the last non-zeros
//
// Expanding a record chunk by chunk gives the AVX-512 table's dense bf16 layout ([group][chunk][8][32]),
// so that table multiplies expanded rows with its dense arithmetic and gets the dense matrix's bits.
// A sparse matrix comes from floats (pack: rounded to bf16, exact zeros dropped) or raw as dense bf16
// rows (pack_raw, what the loader expands a sparse file tensor into).
#pragma once
#include <cstdint>
#include <vector>
#if defined(CORELM_HAVE_X86)
#include <xmmintrin.h>
#endif

#include "kernels/kernels.h"
#if defined(CORELM_HAVE_X86)
#include "kernels/prefetch.h"
#endif

namespace corelm {
namespace sparse {

constexpr int64_t kGroup = 8;   // rows per record
constexpr int64_t kChunk = 32;  // columns per mask word
constexpr int64_t kSlack = 64;  // zero bytes after the records

inline bool is_sparse(WeightType t) { return has_kind(t, kSparseRows); }
// Sparse Q8/Q4 (kernels/sparse_quant.h), and the dense type whose products a sparse type gives.
inline bool is_sparse_quant(WeightType t) { return has_kind(t, kSparseQuant); }
inline WeightType dense_type(WeightType t) { return traits(t).dense; }
inline int64_t ngroups(int64_t rows) { return (rows + kGroup - 1) / kGroup; }
inline int64_t nchunks(int64_t cols) { return (cols + kChunk - 1) / kChunk; }
inline const uint64_t* offsets(const PackedMatrix& w) { return static_cast<const uint64_t*>(w.data()); }
inline const uint8_t* record(const PackedMatrix& w, int64_t g) {
  return static_cast<const uint8_t*>(w.data()) + offsets(w)[g];
}

// A zeroed matrix of a sparse type whose storage starts with the records' offsets `off` (the last:
// their end), with kSlack bytes after the records.
PackedMatrix with_offsets(WeightType type, int64_t rows, int64_t cols, int64_t ld, const std::vector<uint64_t>& off,
                          const KernelTable* by);
PackedMatrix pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par,
                  const KernelTable* by);
PackedMatrix pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par,
                      const KernelTable* by);
// Group g's rows as dense bf16: row j's chunk c at dst + j * row_stride + c * chunk_stride (elements;
// columns past the matrix and rows past it zero). The AVX-512 table's layout, [nchunks][8][32], is
// (kChunk, kGroup * kChunk); row-major rows of ld elements (what the AMX table multiplies) are (ld, kChunk).
void expand_group(const PackedMatrix& w, int64_t g, uint16_t* dst, int64_t row_stride = kChunk,
                  int64_t chunk_stride = kGroup * kChunk);
void row_to_f32(const PackedMatrix& w, int64_t row, float* out);
// The non-zeros stored (for reports and tests).
int64_t count_nonzeros(const PackedMatrix& w);

#if defined(CORELM_HAVE_X86)
// Where a chunk's non-zeros start depends on the popcounts of the chunk before, so the out-of-order
// core cannot run ahead of the stream as it does over dense rows. The kernels that stream records
// (decode, and expanding them for a prompt) prefetch them record_prefetch_bytes() ahead
// (CORELM_SPARSE_PREFETCH; 0: none; default 4 KiB into L2, 2 KiB elsewhere): after each chunk, the
// lines that far past the bytes [from, to) just read. Without it a 50%-sparse matrix streamed from DRAM
// at 0.5 (AVX-512) and 0.25 (AVX2) of a plain read on the Xeon with AMX, with it 0.72 and 0.62.
// The AVX-512
// kernels take the lines into L2 as one chain (prefetch.h: prefetch_lines_l2) where
// record_prefetch_l2() (CORELM_SPARSE_PREFETCH_L2=0|1; default: not on AMD, where it is unmeasured): on
// the Xeon the sparse q8/q4 streams went from 0.60 to 0.71 (1 thread) and 0.55 to 0.73 (2) of their
// roofline, sparse bf16 0.62 to 0.65; 4 KiB ahead instead of 2 took sbf16 50% to 0.72-0.74 and sq8 to
// 0.74-0.76. A prefetch past the matrix's end touches nothing: prefetches do not fault.
int64_t record_prefetch_bytes();
bool record_prefetch_l2();
inline void prefetch_ahead(const uint8_t* from, const uint8_t* to, int64_t distance, bool l2 = false) {
  const uintptr_t first = ((uintptr_t)from + distance + 63) & ~(uintptr_t)63, end = (uintptr_t)to + distance;
  if (distance <= 0 || first >= end) return;
  if (l2) return prefetch_lines_l2(reinterpret_cast<const char*>(first), (int64_t)(end - first + 63) / 64);
  for (uintptr_t a = first; a < end; a += 64) _mm_prefetch((const char*)a, _MM_HINT_T0);
}

// The tables' matmuls for sparse weights. dense: the table's own matmul, which takes bf16 panels
// expanded from the sparse layout (the AVX-512 table's layout for matmul_avx512, the AVX2 table's for
// matmul_avx2) wherever the sparse kernel does not multiply directly. bf16_dot: the table multiplies
// bf16 weights of a small batch by activations rounded to bf16 (VDPBF16PS), as the sparse kernel may.
using DenseMatmul = void (*)(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy,
                             int64_t n0, int64_t n1);
void matmul_avx512(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                   int64_t n1, DenseMatmul dense, bool bf16_dot);
// expand_group with VBMI2/BITALG where the CPU has them (the same values).
void expand_group_avx512(const PackedMatrix& w, int64_t g, uint16_t* dst, int64_t row_stride, int64_t chunk_stride);
void matmul_avx2(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                 int64_t n1, DenseMatmul dense);
#endif

}  // namespace sparse
}  // namespace corelm
