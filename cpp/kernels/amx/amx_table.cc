// The AMX kernel table (amx.h, kernel_table): bf16 weights live as AMX-BF16 tiles and every matmul on
// them, decode's single row included (the tile configuration shrinks to m rows), runs TDPBF16PS; every
// other weight format and every other op is the best non-AMX table's, called through.
//
// Built for the baseline ISA: it only calls the AMX kernels (amx_native.cc, amx_emulated.cc) and the
// other tables.
#include <algorithm>
#include <vector>

#include "kernels/amx/amx.h"
#include "kernels/kernels.h"
#include "kernels/sparse_layout.h"

namespace corelm {
namespace amx {
namespace {

const KernelTable* base_table() {
  static const KernelTable* t = kernels_by_name(kernel_table_base());
  return t;
}

// The kernels' view of a bf16 matrix this table packed (not owning: w outlives the call).
AmxMatrix tiles_of(const PackedMatrix& w) {
  AmxMatrix a;
  a.format = Format::BF16;
  a.n = w.rows;
  a.k = w.cols;
  a.n_pad = (w.rows + 15) / 16 * 16;
  a.k_pad = w.ld;
  a.tiles = std::shared_ptr<void>(std::shared_ptr<void>(), w.storage.get());
  return a;
}

template <bool Native>
void gemm(const float* x, int64_t m, int64_t ldx, const AmxMatrix& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
#if defined(CORELM_HAVE_AMX_BUILD)
  if constexpr (Native) return native::bf16_gemm(x, m, ldx, a, y, ldy, n0, n1);
#endif
  emulated::bf16_gemm(x, m, ldx, a, y, ldy, n0, n1);
}

template <bool Native>
PackedMatrix pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par) {
  if (type != WeightType::BF16) return base_table()->pack(src, rows, cols, type, par);
  AmxMatrix a = pack_bf16(src, rows, cols, par);
  PackedMatrix m;
  m.type = WeightType::BF16;
  m.rows = rows;
  m.cols = cols;
  m.ld = a.k_pad;
  m.nbytes = a.bytes();
  m.packed_by = kernel_table(Native);
  m.storage = a.tiles;
  return m;
}

// Sparse bf16 rows expanded for bf16_gemm_rows: whole groups of 8, row-major.
template <bool Native>
void expand_rows(const void* ctx, int64_t r0, int64_t rows, uint16_t* dst, int64_t ld) {
  const PackedMatrix& w = *static_cast<const PackedMatrix*>(ctx);
  for (int64_t g = r0 / sparse::kGroup; g * sparse::kGroup < r0 + rows; g++) {
    uint16_t* d = dst + (g * sparse::kGroup - r0) * ld;
#if defined(CORELM_HAVE_X86)
    if constexpr (Native) {
      sparse::expand_group_avx512(w, g, d, ld, sparse::kChunk);
      continue;
    }
#endif
    sparse::expand_group(w, g, d, ld, sparse::kChunk);
  }
}

template <bool Native>
void matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
            int64_t n1) {
  if (sparse::is_sparse(w.type) && m > kRowExactRows) {
    // a prefill's rows against sparse weights: expanded 32 rows at a time into the tiles' A operand
    n1 = std::min(n1, w.rows);
    if (n0 >= n1) return;
#if defined(CORELM_HAVE_AMX_BUILD)
    if constexpr (Native) return native::bf16_gemm_rows(x, m, ldx, w.rows, w.cols, expand_rows<true>, &w, y, ldy, n0, n1);
#endif
    return emulated::bf16_gemm_rows(x, m, ldx, w.rows, w.cols, expand_rows<false>, &w, y, ldy, n0, n1);
  }
  if (w.type != WeightType::BF16) {
    // sparse bf16: a small batch through the base table's row-exact kernels, whose bits decode has
    const KernelTable* t = base_table();
    if (sparse::is_sparse(w.type) && t->row_exact) t = t->row_exact;
    return t->matmul(x, m, ldx, w, y, ldy, n0, n1);
  }
  if (m <= 0 || n0 >= n1) return;
  const AmxMatrix a = tiles_of(w);
  // The kernels start at a 16-row panel: a range that starts inside one gets that panel's part
  // through a scratch panel.
  const int64_t head_end = std::min(n1, (n0 + 15) / 16 * 16);
  if (n0 < head_end) {
    const int64_t p0 = n0 / 16 * 16, p1 = std::min(w.rows, p0 + 16);
    static thread_local std::vector<float> panel;
    if ((int64_t)panel.size() < m * 16) panel.resize(m * 16);
    gemm<Native>(x, m, ldx, a, panel.data() - p0, 16, p0, p1);
    for (int64_t i = 0; i < m; i++)
      std::copy(panel.data() + i * 16 + (n0 - p0), panel.data() + i * 16 + (head_end - p0), y + i * ldy + n0);
  }
  if (head_end < n1) gemm<Native>(x, m, ldx, a, y, ldy, head_end, n1);
}

// bf16 rows into tiles through one fp32 copy of the matrix (the tile packer takes floats); every other
// raw type is the base table's.
template <bool Native>
PackedMatrix pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par) {
  if (type != WeightType::BF16) return base_table()->pack_raw(type, raw, rows, cols, par);
  std::vector<float> f((size_t)rows * cols);
  for (size_t i = 0; i < f.size(); i++) f[i] = bf16_to_f32((uint16_t)(raw[2 * i] | raw[2 * i + 1] << 8));
  return pack<Native>(f.data(), rows, cols, type, par);
}

template <bool Native>
void row_to_f32(const PackedMatrix& w, int64_t row, float* out) {
  if (w.type != WeightType::BF16) return base_table()->row_to_f32(w, row, out);
  // tile(nt, kb)[r][c][i] = W[16 nt + c][32 kb + 2 r + i] (amx.h)
  const uint16_t* panel = static_cast<const uint16_t*>(w.data()) + (row / 16) * (w.ld / 32) * 512 + (row % 16) * 2;
  for (int64_t k = 0; k < w.cols; k++) out[k] = bf16_to_f32(panel[(k / 32) * 512 + ((k % 32) / 2) * 32 + k % 2]);
}

template <bool Native>
const KernelTable* table() {
  static const KernelTable t = [] {
    KernelTable k = *base_table();
    k.name = Native ? "amx" : "amx_emulated";
    k.pack = pack<Native>;
    k.pack_raw = pack_raw<Native>;
    k.matmul = matmul<Native>;
    k.row_to_f32 = row_to_f32<Native>;
    k.row_exact = nullptr;  // the base table cannot read the AMX layout
    return k;
  }();
  return &t;
}

}  // namespace

const char* kernel_table_base() {
  for (const char* n : {"avx512_bf16", "avx512", "avx2"})
    if (kernels_by_name(n)) return n;
  return "scalar";
}

const KernelTable* kernel_table(bool native) {
  if (native) return available() ? table<true>() : nullptr;
  return table<false>();
}

}  // namespace amx
}  // namespace corelm
