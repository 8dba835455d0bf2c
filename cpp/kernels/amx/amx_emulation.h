// A scalar emulation of the AMX tile intrinsics, written from the instruction definitions in the
// Intel SDM (vol. 2, "TILELOADD", "TILESTORED", "TILEZERO", "LDTILECFG", "TILERELEASE", "TDPBSSD",
// "TDPBF16PS") and the AMX chapter of vol. 1. It exists so that amx_gemm.inc, the kernel source
// that the real AMX build compiles against <immintrin.h>, can be compiled a second time against
// these functions and tested on any CPU: packing, blocking, tile shapes and tails are then checked
// without the hardware. Include it inside the namespace that will include amx_gemm.inc.
//
// Definitions followed (palette 1):
// - State: 8 tiles tmm0..7, each up to 16 rows of 64 bytes, plus a configuration loaded from a
//   64-byte block: byte 0 palette_id (0 = init state, 1 = the only palette defined), byte 1
//   start_row, bytes 2..15 reserved (must be 0), bytes 16..47 colsb[16] (u16 bytes per row; only
//   tiles 0..7 usable, 8..15 must be 0), bytes 48..63 rows[16] (u8; 8..15 must be 0).
//   LDTILECFG #GPs on a bad palette, rows > 16, colsb > 64, reserved bytes set, or a tile with
//   exactly one of rows/colsb zero; it zeroes all tile data. palette 0 = TILERELEASE (init state).
// - TILELOADD tmm, [base + stride*r]: rows r < tmm.rows get colsb bytes from base + r*stride; the
//   rest of each row (bytes colsb..63) and the rows past tmm.rows are zeroed.
// - TILESTORED: writes rows r < tmm.rows, colsb bytes each, to base + r*stride.
// - TILEZERO: zeroes the tile.
// - TDPBSSD tC, tA, tB (C m x n int32, A m x k dwords of 4 s8, B k x n dwords of 4 s8):
//   #UD unless A.rows == C.rows, A.colsb == 4*B.rows, B.colsb == C.colsb (and all configured).
//   for m < C.rows, k < A.colsb/4, n < C.colsb/4:
//       C[m][n] += sext(A[m].byte[4k+i]) * sext(B[k].byte[4n+i]) summed over i = 0..3
//   The sum is a 32-bit integer with wrap-around (no saturation): done here in uint32.
// - TDPBF16PS tC, tA, tB (C fp32, A/B dwords holding a pair of bf16): same shape rules, and
//       C[m][n] = fma(A[m].bf16[2k+0], B[k].bf16[2n+0], C[m][n])
//       C[m][n] = fma(A[m].bf16[2k+1], B[k].bf16[2n+1], C[m][n])
//   in that order, k ascending, each an fp32 FMA with DAZ, FTZ, round-to-nearest-even and
//   suppressed exceptions, independent of MXCSR. A bf16 widens to fp32 exactly (<< 16); a
//   bf16/fp32 denormal input (including the accumulator) is read as a zero of the same sign, a
//   denormal result is flushed to a zero of the same sign. bf16 x bf16 products are exact in
//   fp32, so one rounding per FMA. That is the SDM's order. Measured on a Sapphire Rapids-class
//   Xeon (tests/kernels/test_amx.py probes), the hardware does not round after each product: it sums the
//   products of one instruction's row first and then adds that sum to C (C = 1, sixteen products
//   of 2^-24: SDM order gives 1, the hardware 1 + 2^-20; C = 2^-24 with the pair (1, 2^-24): both
//   give 1). Real and emulated GEMMs therefore agree to fp32 rounding, not bit for bit; the
//   emulation stays with the documented definition, and equals a sequential fp32 sum exactly.
// - Rows past C.rows and bytes past C.colsb are zeroed after each TDP* (write_row_and_zero /
//   zero_upper_rows in the SDM pseudo-code).
// Faults (#UD/#GP on the hardware) throw AmxFault here, so a wrong configuration in the kernel
// source fails a test instead of producing silently wrong numbers. The state is per thread.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace amx_emu {

struct AmxFault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TileState {
  uint8_t palette = 0;
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) uint8_t data[8][16][64] = {};
};

inline TileState& tile_state() {
  static thread_local TileState s;
  return s;
}

inline void fault(const std::string& what) { throw AmxFault("AMX emulation: " + what); }

inline void check_tile(const TileState& s, int t, const char* op) {
  if (s.palette != 1) fault(std::string(op) + ": no tile configuration loaded (#UD)");
  if (t < 0 || t > 7) fault(std::string(op) + ": tile index out of range");
  if (s.rows[t] == 0 || s.colsb[t] == 0) fault(std::string(op) + ": tmm" + std::to_string(t) + " is not configured (#UD)");
}

inline void _tile_release() { tile_state() = TileState{}; }

inline void _tile_loadconfig(const void* config) {
  const uint8_t* c = static_cast<const uint8_t*>(config);
  TileState s;
  s.palette = c[0];
  if (s.palette == 0) { tile_state() = TileState{}; return; }
  if (s.palette != 1) fault("LDTILECFG: palette " + std::to_string(c[0]) + " is not supported (#GP)");
  if (c[1] != 0) fault("LDTILECFG: start_row must be 0 outside an interrupted instruction");
  for (int i = 2; i < 16; i++)
    if (c[i]) fault("LDTILECFG: reserved byte set (#GP)");
  for (int t = 0; t < 16; t++) {
    uint16_t colsb;
    std::memcpy(&colsb, c + 16 + 2 * t, 2);
    uint8_t rows = c[48 + t];
    if (t >= 8) {
      if (colsb || rows) fault("LDTILECFG: palette 1 has 8 tiles (#GP)");
      continue;
    }
    if (rows > 16 || colsb > 64) fault("LDTILECFG: tmm" + std::to_string(t) + " larger than 16 rows x 64 bytes (#GP)");
    if ((rows == 0) != (colsb == 0)) fault("LDTILECFG: tmm" + std::to_string(t) + " has rows xor colsb zero (#GP)");
    s.rows[t] = rows;
    s.colsb[t] = colsb;
  }
  tile_state() = s;  // tile data is zeroed by LDTILECFG
}

inline void _tile_storeconfig(void* config) {
  const TileState& s = tile_state();
  uint8_t c[64] = {};
  c[0] = s.palette;
  for (int t = 0; t < 8; t++) {
    std::memcpy(c + 16 + 2 * t, &s.colsb[t], 2);
    c[48 + t] = s.rows[t];
  }
  std::memcpy(config, c, 64);
}

inline void _tile_zero(int t) {
  TileState& s = tile_state();
  check_tile(s, t, "TILEZERO");
  std::memset(s.data[t], 0, sizeof(s.data[t]));
}

inline void _tile_loadd(int t, const void* base, long stride) {
  TileState& s = tile_state();
  check_tile(s, t, "TILELOADD");
  std::memset(s.data[t], 0, sizeof(s.data[t]));
  for (int r = 0; r < s.rows[t]; r++)
    std::memcpy(s.data[t][r], static_cast<const uint8_t*>(base) + (long)r * stride, s.colsb[t]);
}
inline void _tile_stream_loadd(int t, const void* base, long stride) { _tile_loadd(t, base, stride); }

inline void _tile_stored(int t, void* base, long stride) {
  TileState& s = tile_state();
  check_tile(s, t, "TILESTORED");
  for (int r = 0; r < s.rows[t]; r++)
    std::memcpy(static_cast<uint8_t*>(base) + (long)r * stride, s.data[t][r], s.colsb[t]);
}

inline void check_dp_shapes(const TileState& s, int c, int a, int b, const char* op) {
  check_tile(s, c, op);
  check_tile(s, a, op);
  check_tile(s, b, op);
  if (c == a || c == b || a == b) fault(std::string(op) + ": tile operands must differ (#UD)");
  if (s.rows[a] != s.rows[c]) fault(std::string(op) + ": A.rows != C.rows (#UD)");
  if (s.colsb[a] != 4 * s.rows[b]) fault(std::string(op) + ": A.colsb != 4 * B.rows (#UD)");
  if (s.colsb[b] != s.colsb[c]) fault(std::string(op) + ": B.colsb != C.colsb (#UD)");
  if (s.colsb[c] % 4 || s.colsb[a] % 4) fault(std::string(op) + ": colsb not a multiple of 4 (#UD)");
}

// Rows past C.rows and bytes past C.colsb are zeroed after the operation.
inline void zero_past(TileState& s, int c) {
  for (int r = 0; r < 16; r++) {
    int from = r < s.rows[c] ? s.colsb[c] : 0;
    std::memset(s.data[c][r] + from, 0, 64 - from);
  }
}

inline void _tile_dpbssd(int c, int a, int b) {
  TileState& s = tile_state();
  check_dp_shapes(s, c, a, b, "TDPBSSD");
  const int M = s.rows[c], N = s.colsb[c] / 4, K = s.colsb[a] / 4;
  for (int m = 0; m < M; m++) {
    for (int k = 0; k < K; k++) {
      const int8_t* x = reinterpret_cast<const int8_t*>(s.data[a][m] + 4 * k);
      for (int n = 0; n < N; n++) {
        const int8_t* y = reinterpret_cast<const int8_t*>(s.data[b][k] + 4 * n);
        uint32_t acc;
        std::memcpy(&acc, s.data[c][m] + 4 * n, 4);
        for (int i = 0; i < 4; i++) acc += (uint32_t)((int32_t)x[i] * (int32_t)y[i]);
        std::memcpy(s.data[c][m] + 4 * n, &acc, 4);
      }
    }
  }
  zero_past(s, c);
}

// fp32 from its bits, with denormals read as signed zero (DAZ).
inline float daz(uint32_t u) {
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float ftz(float f) {  // a denormal result becomes a signed zero (FTZ)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return daz(u);
}
inline float bf16_daz(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return daz((uint32_t)h << 16);
}

inline void _tile_dpbf16ps(int c, int a, int b) {
  TileState& s = tile_state();
  check_dp_shapes(s, c, a, b, "TDPBF16PS");
  const int M = s.rows[c], N = s.colsb[c] / 4, K = s.colsb[a] / 4;
  for (int m = 0; m < M; m++) {
    for (int k = 0; k < K; k++) {
      const uint8_t* x = s.data[a][m] + 4 * k;
      for (int n = 0; n < N; n++) {
        const uint8_t* y = s.data[b][k] + 4 * n;
        uint32_t cu;
        std::memcpy(&cu, s.data[c][m] + 4 * n, 4);
        float acc = daz(cu);
        acc = ftz(std::fma(bf16_daz(x), bf16_daz(y), acc));
        acc = ftz(std::fma(bf16_daz(x + 2), bf16_daz(y + 2), acc));
        std::memcpy(s.data[c][m] + 4 * n, &acc, 4);
      }
    }
  }
  zero_past(s, c);
}

}  // namespace amx_emu
