// The AMX kernel table (amx.h, kernel_table): bf16 weights live as AMX-BF16 tiles and every matmul on
// them, decode's single row included (the tile configuration shrinks to m rows), runs TDPBF16PS. A
// prompt (more than kRowExactRows rows) against quantized or sparse weights runs on the tiles too, the
// weights dequantized or expanded on the fly; everything else is the best non-AMX table's, called through.
//
// Built for the baseline ISA: it only calls the AMX kernels (amx_native.cc, amx_emulated.cc) and the
// other tables.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/tuning.h"
#include "kernels/amx/amx.h"
#include "kernels/ggml_grouped.h"
#include "kernels/kernels.h"
#include "kernels/sparse_layout.h"
#include "kernels/sparse_quant.h"

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

// Quantized weights a prefill (more than kRowExactRows rows) multiplies as bf16: each value as the base
// table's row_to_f32 gives it, rounded to bf16 (8 significant bits, against 4-8 in the codes), against
// activations rounded to bf16 (llama.cpp's prefill quantizes them to 8 bits) on AMX-BF16: 4x the
// integer GEMM's prefill. The integer kernels give every table and batch the same bits; these give a
// prompt's logits that depend on how it was chunked. CORELM_AMX_PREFILL=0 keeps the integer kernels.
const bool kQuantPrefill = tuning::amx_prefill();
bool dequantizes(WeightType t) {
  return kQuantPrefill && (quant::is_quant(t) || quant::is_grouped_ggml(t) || sparse::is_sparse_quant(t));
}

// Panel p of a quantized matrix as bf16 tiles: AVX-512 where it runs; otherwise (and on the emulation,
// where it is the reference) the base table's rows.
template <bool Native>
void dequant_panel(const void* ctx, int64_t panel, uint16_t* dst) {
  const PackedMatrix& w = *static_cast<const PackedMatrix*>(ctx);
  if (sparse::is_sparse_quant(w.type)) {  // the panel's super-group expanded into the base table's dense layout
    const int64_t s = panel * 16 / sparse::kQuantSuperRows;
    const auto layout = std::strcmp(base_table()->name, "scalar") == 0 ? sparse::DenseLayout::GgmlRows
                                                                       : sparse::DenseLayout::Grouped;
    // A super-group holds two panels, which come one after the other: the second reuses the expansion
    // (the key holds the storage weakly, so a freed matrix's address reused by another never matches).
    static thread_local std::vector<uint8_t> buf;
    static thread_local std::weak_ptr<void> held;
    static thread_local const void* held_data = nullptr;
    static thread_local int64_t held_super = -1;
    const bool again = held_super == s && held_data == w.data() && !held.expired() && held.lock() == w.storage;
    if (!again) buf.resize(sparse::dense_bytes(w, layout, s, s + 1) + 64);
    uint8_t* d = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
    if (!again) {
#if defined(CORELM_HAVE_X86)
      if (Native && layout == sparse::DenseLayout::Grouped) sparse::expand_supers_avx512(w, s, s + 1, d);
      else
#endif
        sparse::expand_supers(w, layout, s, s + 1, d);
      held = w.storage, held_data = w.data(), held_super = s;
    }
    const PackedMatrix v = sparse::dense_view(w, layout, s, s + 1, d);
    return dequant_panel<Native>(&v, panel - s * sparse::kQuantSuperRows / 16, dst);
  }
#if defined(CORELM_HAVE_X86)
  if (Native && quant::panel_bf16_pairs_avx512(w, panel, dst)) return;
#endif
  const int64_t kp = (w.cols + 31) / 32 * 32;
  static thread_local std::vector<float> row;
  row.resize(w.cols);
  std::fill(dst, dst + 16 * kp, (uint16_t)0);
  for (int64_t r = 0; r < 16 && panel * 16 + r < w.rows; r++) {
    base_table()->row_to_f32(w, panel * 16 + r, row.data());
    for (int64_t k = 0; k < w.cols; k++) dst[(k / 2) * 32 + 2 * r + k % 2] = f32_to_bf16(row[k]);
  }
}

// The bf16 GEMMs start at a 16-row panel: a range that starts inside one gets that panel's part
// through a scratch panel. gemm(y, ldy, n0, n1) computes columns [n0, n1) with n0 a panel start.
template <class Gemm>
void from_panel_start(int64_t m, int64_t rows, float* y, int64_t ldy, int64_t n0, int64_t n1, Gemm gemm) {
  const int64_t head_end = std::min(n1, (n0 + 15) / 16 * 16);
  if (n0 < head_end) {
    const int64_t p0 = n0 / 16 * 16, p1 = std::min(rows, p0 + 16);
    static thread_local std::vector<float> panel;
    if ((int64_t)panel.size() < m * 16) panel.resize(m * 16);
    gemm(panel.data() - p0, 16, p0, p1);
    for (int64_t i = 0; i < m; i++)
      std::copy(panel.data() + i * 16 + (n0 - p0), panel.data() + i * 16 + (head_end - p0), y + i * ldy + n0);
  }
  if (head_end < n1) gemm(y, ldy, head_end, n1);
}

// The products this table runs on the tiles as bf16: bf16 weights, and a prompt's quantized ones.
bool on_tiles(const PackedMatrix& w, int64_t m) {
  return w.type == WeightType::BF16 || (dequantizes(w.type) && m > kRowExactRows);
}
// A prompt's rows against sparse bf16 weights: the rows expanded into A, x as B tiles (bf16_gemm_rows).
bool sparse_prompt(const PackedMatrix& w, int64_t m) { return sparse::is_sparse(w.type) && m > kRowExactRows; }

// y[:, n0:n1] for on_tiles(w, m), from x or from its bf16 rows a (bf16_rows; x then unread).
template <bool Native>
void tiles_matmul(const float* x, const uint16_t* a, int64_t m, int64_t ldx, const PackedMatrix& w, float* y,
                  int64_t ldy, int64_t n0, int64_t n1) {
  n1 = std::min(n1, w.rows);
  if (m <= 0 || n0 >= n1) return;
  const bool bf16 = w.type == WeightType::BF16;
  const AmxMatrix t = bf16 ? tiles_of(w) : AmxMatrix();
  from_panel_start(m, w.rows, y, ldy, n0, n1, [&](float* yy, int64_t ld, int64_t p, int64_t q) {
#if defined(CORELM_HAVE_AMX_BUILD)
    if constexpr (Native) {
      if (bf16) return native::bf16_gemm(x, m, ldx, t, yy, ld, p, q, a);
      return native::bf16_gemm_panels(x, m, ldx, w.rows, w.cols, dequant_panel<true>, &w, yy, ld, p, q, a);
    }
#endif
    if (bf16) return emulated::bf16_gemm(x, m, ldx, t, yy, ld, p, q, a);
    emulated::bf16_gemm_panels(x, m, ldx, w.rows, w.cols, dequant_panel<false>, &w, yy, ld, p, q, a);
  });
}

// y[:, n0:n1] for sparse_prompt(w, m), from x or from its B tiles xt (bf16_tiles_of_rows; x then unread).
template <bool Native>
void sparse_matmul(const float* x, const uint16_t* xt, int64_t m, int64_t ldx, const PackedMatrix& w, float* y,
                   int64_t ldy, int64_t n0, int64_t n1) {
  n1 = std::min(n1, w.rows);
  if (n0 >= n1) return;
#if defined(CORELM_HAVE_AMX_BUILD)
  if constexpr (Native) return native::bf16_gemm_rows(x, m, ldx, w.rows, w.cols, expand_rows<true>, &w, y, ldy, n0, n1, xt);
#endif
  emulated::bf16_gemm_rows(x, m, ldx, w.rows, w.cols, expand_rows<false>, &w, y, ldy, n0, n1, xt);
}

template <bool Native>
void matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
            int64_t n1) {
  if (on_tiles(w, m)) return tiles_matmul<Native>(x, nullptr, m, ldx, w, y, ldy, n0, n1);
  if (sparse_prompt(w, m)) return sparse_matmul<Native>(x, nullptr, m, ldx, w, y, ldy, n0, n1);
  // sparse bf16: a small batch through the base table's row-exact kernels, whose bits decode has
  const KernelTable* t = base_table();
  if (sparse::is_sparse(w.type) && t->row_exact) t = t->row_exact;
  t->matmul(x, m, ldx, w, y, ldy, n0, n1);
}

// The two-step matmul (a region's threads share one conversion of x): for what runs on the tiles, x's
// bf16 rows (bf16_rows), for a sparse prompt x's B tiles; everything else is the base table's input.
size_t quant_act_bytes(const PackedMatrix& w, int64_t m, ActType act) {
  const int64_t kp = (w.cols + 31) / 32 * 32;
  if (on_tiles(w, m)) return (size_t)m * kp * 2;
  if (sparse_prompt(w, m)) return (size_t)(m + 15) / 16 * 16 * kp * 2;
  return base_table()->quant_act_bytes(w, m, act);
}

template <bool Native>
void quantize_act(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act, void* qa) {
  uint16_t* out = static_cast<uint16_t*>(qa);
  if (!on_tiles(w, m) && !sparse_prompt(w, m)) return base_table()->quantize_act(x, m, ldx, w, act, qa);
#if defined(CORELM_HAVE_AMX_BUILD)
  if constexpr (Native) return on_tiles(w, m) ? native::bf16_rows(x, m, ldx, w.cols, out)
                                              : native::bf16_tiles_of_rows(x, m, ldx, w.cols, out);
#endif
  on_tiles(w, m) ? emulated::bf16_rows(x, m, ldx, w.cols, out) : emulated::bf16_tiles_of_rows(x, m, ldx, w.cols, out);
}

template <bool Native>
void matmul_quant(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                  int64_t n1) {
  const uint16_t* a = static_cast<const uint16_t*>(qa);
  if (on_tiles(w, m)) return tiles_matmul<Native>(nullptr, a, m, 0, w, y, ldy, n0, n1);
  if (sparse_prompt(w, m)) return sparse_matmul<Native>(nullptr, a, m, 0, w, y, ldy, n0, n1);
  base_table()->matmul_quant(qa, m, act, w, y, ldy, n0, n1);
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
    k.quant_act_bytes = quant_act_bytes;
    k.quantize_act = quantize_act<Native>;
    k.matmul_quant = matmul_quant<Native>;
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
