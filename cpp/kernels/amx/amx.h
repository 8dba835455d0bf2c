// AMX GEMM kernels (AMX-BF16 TDPBF16PS and AMX-INT8 TDPBSSD) and their detection.
//
// One kernel source (amx_gemm.inc) is compiled twice: `native` against the real tile intrinsics
// (amx_native.cc, the only file built with -mamx-*), and `emulated` against the scalar emulation of
// amx_emulation.h (amx_emulated.cc, baseline ISA), which runs anywhere and is what the tests use to
// check packing, blocking and tails. `native` may only be called when amx_available().
//
// Weight layouts (W is out_features x in_features, y = x . W^T):
// - BF16: k_pad = K rounded up to 32, n_pad = N rounded up to 16. Tiles [n_pad/16][k_pad/32] of
//   1 KiB, each the B operand of TDPBF16PS in the VNNI order {k/2, n, 2}:
//       tile(nt, kb)[r][c][i] = bf16(W[16*nt + c][32*kb + 2*r + i])   (0 past N or K)
//   The column tiles of one nt are contiguous over kb, so a 16-column panel is one stream.
// - INT8: k_pad = K rounded up to 64. Tiles [n_pad/16][k_pad/64] of 1 KiB, TDPBSSD's B order {k/4, n, 4}:
//       tile(nt, kb)[r][c][i] = Wq[16*nt + c][64*kb + 4*r + i]
//   plus fp32 scales [n_pad][n_groups]: one per `group` consecutive K values of a row (group = K:
//   one scale per row; otherwise group is a multiple of 64 that divides K).
// Activations: BF16 takes fp32 x [M][ldx] and rounds it to bf16 (nearest even) per call. INT8 takes
// int8 xq [M][ldx] with fp32 scales xs [M][n_groups] (same groups as W), so
//       y[m][n] = sum_g xs[m][g] * ws[n][g] * sum_{k in g} xq[m][k] * wq[n][k]   (exact int32 inner sums)
// K tails are zero padding (the weights at pack time, x in a per-call copy); M and N tails use tile
// configurations with fewer rows / fewer column bytes, so no padded output is ever written.
// Kernel step: 2x2 C tiles of 16x16 (tmm0..3), A tiles tmm4/5, B tiles tmm6/7: 32x32 outputs per
// pass over K. n0 must be a multiple of 16 (the caller's column split); y has row stride ldy.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kernels/kernels.h"

namespace corelm {
namespace amx {

enum class Format : int { BF16 = 0, INT8 = 1 };

struct AmxMatrix {
  Format format = Format::BF16;
  int64_t n = 0, k = 0;          // logical shape
  int64_t n_pad = 0, k_pad = 0;  // n to 16, k to 32 (bf16) or 64 (int8)
  int64_t group = 0, n_groups = 0;  // int8 only
  std::shared_ptr<void> tiles;   // 64-byte aligned, n_pad/16 * k_pad/(32|64) tiles of 1 KiB
  std::shared_ptr<void> scales;  // int8: float[n_pad][n_groups]
  const uint8_t* tile_data() const { return static_cast<const uint8_t*>(tiles.get()); }
  const float* scale_data() const { return static_cast<const float*>(scales.get()); }
  size_t bytes() const;
};

// par (may be null): threads lent to packing, split by panels of 16 rows.
AmxMatrix pack_bf16(const float* w, int64_t n, int64_t k, const ParallelFor* par = nullptr);
// wq: int8 [n][k] row-major; scales: float [n][k/group] (group == k or 0: one per row).
AmxMatrix pack_int8(const int8_t* wq, const float* scales, int64_t n, int64_t k, int64_t group);

// The INT8 activation format: symmetric int8 per row, or per `group` K values of a row (group == 0 or K:
// one scale per row): scales[i][g] = absmax / 127, q = x / scale rounded to nearest even (0 for an all-zero
// group, scale 0). q is [m][k] row-major, scales [m][k / group].
void quantize_rows_s8(const float* x, int64_t m, int64_t k, int64_t ldx, int64_t group, int8_t* q, float* scales);

struct Status {
  bool cpu = false;         // CPUID: AMX-TILE, AMX-INT8 and AMX-BF16
  bool os = false;          // XCR0: XTILECFG and XTILEDATA state enabled
  bool permission = false;  // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) granted
  bool compiled = false;    // this build has the native kernels
  std::string reason;       // why AMX is not available ("" when it is)
};
// Checks CPUID/XCR0 and asks the kernel for the tile-data permission, once per process.
const Status& status();
inline bool available() { const Status& s = status(); return s.cpu && s.os && s.permission && s.compiled; }
// Throws std::runtime_error naming status().reason unless available(): for callers that ask for the
// real tiles by name.
void require_available();

// Rows [r0, r0 + rows) of a weight matrix as bf16, row-major with ld elements per row and each row
// zero from K up to ld: what bf16_gemm_rows multiplies. r0 is a multiple of 8; the source may write
// up to 32 rows (whole groups of 8) into dst.
using RowSource = void (*)(const void* ctx, int64_t r0, int64_t rows, uint16_t* dst, int64_t ld);

// Panel p (rows 16p..16p+15, zero past the matrix) of a weight matrix as BF16 tiles, [k_pad/32][16][32]
// (the tile order above, 1 KiB per 32 columns): what bf16_gemm_panels multiplies.
using PanelSource = void (*)(const void* ctx, int64_t panel, uint16_t* dst);

// bf16_gemm_panels: bf16_gemm for a W of n x k that is not stored as tiles but produced 16 rows at a
// time by src (quantized weights dequantized to bf16 for a prefill). n0 must be a multiple of 16.
// bf16_tiles_of_rows: x as bf16_gemm_rows's B tiles ([ceil(m/16)][ceil(k/32)] KiB), built once for many
// calls (xt = it; x is then not read).
// bf16_gemm_rows: y[:, n0:n1] = x . W^T for a W of n x k that is not stored as tiles but produced 32 rows
// at a time by src (sparse weights expanded on the fly). The rows are the A operand and x, rounded to
// bf16 and transposed into tiles (per call, or once for many: xt), is B; each fp32 sum runs over K in
// the order bf16_gemm uses, so it has the bits of bf16_gemm on the same weights.
// bf16_rows: x [m][ldx] rounded to bf16 (nearest even), rows of k rounded up to 32 with a zero tail: the
// A operand the BF16 GEMMs build per call, built once for many calls (a = it; x is then not read).
#define CORELM_AMX_DECLARE_KERNELS                                                                 \
  void bf16_rows(const float* x, int64_t m, int64_t ldx, int64_t k, uint16_t* a);                    \
  void bf16_gemm(const float* x, int64_t m, int64_t ldx, const AmxMatrix& w, float* y, int64_t ldy, \
                 int64_t n0, int64_t n1, const uint16_t* a = nullptr);                             \
  void bf16_gemm_panels(const float* x, int64_t m, int64_t ldx, int64_t n, int64_t k, PanelSource src,   \
                        const void* ctx, float* y, int64_t ldy, int64_t n0, int64_t n1,              \
                        const uint16_t* a = nullptr);                                                \
  void bf16_tiles_of_rows(const float* x, int64_t m, int64_t ldx, int64_t k, uint16_t* xt);          \
  void bf16_gemm_rows(const float* x, int64_t m, int64_t ldx, int64_t n, int64_t k, RowSource src,    \
                      const void* ctx, float* y, int64_t ldy, int64_t n0, int64_t n1,                \
                      const uint16_t* xt = nullptr);                                                 \
  void int8_gemm(const int8_t* xq, int64_t m, int64_t ldx, const float* xs, const AmxMatrix& w,     \
                 float* y, int64_t ldy, int64_t n0, int64_t n1);                                   \
  void int8_gemm_i32(const int8_t* xq, int64_t m, int64_t ldx, const AmxMatrix& w, int32_t* y,      \
                     int64_t ldy, int64_t n0, int64_t n1);                                          \
  void single_dp(bool int8, uint8_t* c, int rc, int cbc, const uint8_t* a, int ra, int cba,          \
                 const uint8_t* b, int rb, int cbb);

namespace emulated { CORELM_AMX_DECLARE_KERNELS }

// The kernel table that multiplies bf16 weights (stored as AMX-BF16 tiles) with these kernels, for any
// number of activation rows, and a prompt's quantized and sparse weights as bf16 (amx_table.cc); it
// leaves every other product and op to the best non-AMX table (whose name kernel_table_base gives). native: the real tiles, only when available(); otherwise the
// emulation (slow: for tests, by the name "amx_emulated").
const KernelTable* kernel_table(bool native);
const char* kernel_table_base();
namespace native { CORELM_AMX_DECLARE_KERNELS }  // defined only when CORELM_HAVE_AMX_BUILD

}  // namespace amx
}  // namespace corelm
