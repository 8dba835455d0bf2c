// Block-quantized weight formats (Q8, Q4, Q4M): the arithmetic every kernel table agrees on.
// Blocks are 32 weights along K (a row's last block is zero-padded), each with an fp16 scale:
//   Q8:  w = d * q,        q int8 in [-127, 127]  (ggml Q8_0: d = absmax/127, q = round(x/d))
//   Q4:  w = d * (q - 8),  q u4 in [0, 15]        (ggml Q4_0: d = max/-8 with max the signed value
//                                                  of largest |x|, q = min(15, trunc(x/d + 8.5)))
//   Q4M: w = d * q + m,    q u4 in [0, 15]        (ggml Q4_1: d = (max-min)/15, m = min,
//                                                  q = min(15, trunc((x-min)/d + 0.5)))
// The quantizers follow ggml's reference code (fp32 d for rounding, fp16 d stored), so a GGUF
// Q8_0/Q4_0/Q4_1 block re-quantized from its own dequantized values gives back the same block.
//
// matmul semantics (every table, every m): each activation row is quantized per block of 32 like
// ggml's Q8_0 but with an fp32 scale: dx = absmax/127 (ActType::I8; I16: absmax/32767, xq int16),
// xq = round-to-nearest-even(x * (1/dx)) (0 when absmax is 0), and y[n] = sum over blocks of
// dw*dx*sum(wq*xq) (+ m*dx*sum(xq) for Q4M), the block's integer sum exact in int32,
// i.e. the dot of the dequantized weights with the dequantized activations. A row's result does not
// depend on how many rows come with it (decode m == 1, prefill m > 1), up to fp32 summation order.
//
// This header is included by baseline-ISA code and by the ISA files; keep it plain C++.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/kernels.h"

namespace corelm {
namespace quant {

namespace {  // each ISA file's own copy, built with its flags (see kernels/kernel_util.h)

constexpr int64_t kBlock = 32;

inline bool is_quant(WeightType t) { return has_kind(t, kQuantBlocks); }

// A zeroed matrix of `type` with ld = cols rounded up to whole blocks; bytes_for(ld) sizes it.
template <class Bytes>
inline PackedMatrix new_matrix(WeightType type, int64_t rows, int64_t cols, const KernelTable* by, Bytes bytes_for) {
  PackedMatrix m;
  m.type = type;
  m.rows = rows;
  m.cols = cols;
  m.ld = (cols + kBlock - 1) / kBlock * kBlock;
  m.nbytes = bytes_for(m.ld);
  m.packed_by = by;
  m.storage = aligned_buffer(m.nbytes);  // zeroed
  return m;
}

// ggml block bytes of the Q8/Q4/Q4M raw formats (Q8_0/Q4_0/Q4_1), which are also the scalar table's blocks.
inline size_t ggml_block_bytes(WeightType t) { return is_quant(t) ? (size_t)traits(t).block_bytes : 0; }

// IEEE half <-> float, round to nearest even (as F16C and ggml's software fallback).
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do { man <<= 1; e++; } while (!(man & 0x400u));
      u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;                      // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;                     // overflow (>= 65520) -> inf
  if (a < 0x38800000u) {                                           // subnormal or zero half
    if (a < 0x33000000u) return sign;                              // below half of the smallest subnormal
    const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
    const int shift = 126 - (int)e;                                // 14..24
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
    return sign | (uint16_t)q;
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);                      // round mantissa to 10 bits
  return sign | (uint16_t)((r - 0x38000000u) >> 13);
}

// a * b rounded to float by itself: a build that may use FMA must not fuse it into the add that
// follows (that rounds once, not twice, and moves a quant across a step at rare inputs), so every
// table's packer gives the same quants.
inline float unfused_product(float a, float b) {
  volatile float p = a * b;
  return p;
}

// One block of 32 floats -> q values (Q8: int8 as stored; Q4/Q4M: 0..15), d and m as fp16.
inline void quantize_block(WeightType t, const float* x, int8_t* q, uint16_t* d16, uint16_t* m16) {
  if (t == WeightType::Q8) {
    float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    for (int j = 0; j < 32; j++) q[j] = (int8_t)std::round(x[j] * id);
    *d16 = f32_to_f16(d);
  } else if (t == WeightType::Q4) {
    float amax = 0.f, mx = 0.f;
    for (int j = 0; j < 32; j++)
      if (std::fabs(x[j]) > amax) amax = std::fabs(x[j]), mx = x[j];
    const float d = mx / -8.f, id = d != 0.f ? 1.f / d : 0.f;
    for (int j = 0; j < 32; j++) {
      int v = (int)(int8_t)(unfused_product(x[j], id) + 8.5f);
      q[j] = (int8_t)(v < 15 ? v : 15);
    }
    *d16 = f32_to_f16(d);
  } else {
    float mn = x[0], mx = x[0];
    for (int j = 1; j < 32; j++) mn = std::fmin(mn, x[j]), mx = std::fmax(mx, x[j]);
    const float d = (mx - mn) / 15.f, id = d != 0.f ? 1.f / d : 0.f;
    for (int j = 0; j < 32; j++) {
      int v = (int)(int8_t)(unfused_product(x[j] - mn, id) + 0.5f);
      q[j] = (int8_t)(v < 15 ? v : 15);
    }
    *d16 = f32_to_f16(d);
    *m16 = f32_to_f16(mn);
  }
}

// Quantizes row `src` (cols floats) block by block, zero-padding the last block, calling
// emit(block_index, q[32], d16, m16) for each.
template <class Emit>
inline void quantize_row(WeightType t, const float* src, int64_t cols, Emit emit) {
  float buf[32];
  int8_t q[32];
  for (int64_t b = 0; b * kBlock < cols; b++) {
    const int64_t n = cols - b * kBlock < kBlock ? cols - b * kBlock : kBlock;
    std::memset(buf, 0, sizeof buf);
    std::memcpy(buf, src + b * kBlock, n * sizeof(float));
    uint16_t d16 = 0, m16 = 0;
    quantize_block(t, buf, q, &d16, &m16);
    emit(b, q, d16, m16);
  }
}

// One raw ggml block -> the same q values, d and m (no float arithmetic: bytes are moved).
inline void decode_ggml_block(WeightType t, const uint8_t* blk, int8_t* q, uint16_t* d16, uint16_t* m16) {
  std::memcpy(d16, blk, 2);
  if (t == WeightType::Q8) {
    std::memcpy(q, blk + 2, 32);
    return;
  }
  const uint8_t* qs = blk + 2;
  if (t == WeightType::Q4M) {
    std::memcpy(m16, blk + 2, 2);
    qs += 2;
  }
  for (int j = 0; j < 16; j++) {  // element j in the low nibble of qs[j], j + 16 in the high nibble
    q[j] = (int8_t)(qs[j] & 0x0f);
    q[j + 16] = (int8_t)(qs[j] >> 4);
  }
}

inline float dequant_value(WeightType t, int q, float d, float m) {
  return t == WeightType::Q8 ? d * (float)q : t == WeightType::Q4 ? d * (float)(q - 8) : d * (float)q + m;
}

// The activation quantizer of every matmul (reference; ISA versions must give the same bytes), for Q
// int8_t (ActType::I8, dx = absmax/127) or int16_t (I16, dx = absmax/32767).
// x has n floats; xq gets round_up(n, 32) values, dx and sxq one entry per block.
// kMaxQ: the largest quant (an int16 Q may hold int8-precision quants, 127).
template <class Q, int kMaxQ = sizeof(Q) == 1 ? 127 : 32767>
inline void quantize_activations(const float* x, int64_t n, Q* xq, float* dx, int32_t* sxq) {
  constexpr float kMax = (float)kMaxQ;
  for (int64_t b = 0; b * kBlock < n; b++) {
    float amax = 0.f;
    for (int64_t j = b * kBlock; j < n && j < (b + 1) * kBlock; j++) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = amax / kMax, id = d != 0.f ? 1.f / d : 0.f;
    int32_t s = 0;
    for (int64_t j = b * kBlock; j < (b + 1) * kBlock; j++) {
      int v = j < n ? (int)std::nearbyint(x[j] * id) : 0;
      xq[j] = (Q)v;
      s += v;
    }
    dx[b] = d;
    sxq[b] = s;
  }
}

inline size_t act_elem_bytes(ActType a) { return a == ActType::I16 ? 2 : 1; }

}  // namespace
}  // namespace quant
}  // namespace corelm

// The quantized halves of the kernel tables (each table's pack/matmul/row_to_f32 hands Q types here).
namespace corelm {
namespace quant {
PackedMatrix scalar_pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par);
PackedMatrix scalar_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par);
void scalar_matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy,
                   int64_t n0, int64_t n1);
void scalar_row_to_f32(const PackedMatrix& w, int64_t row, float* out);
size_t scalar_quant_act_bytes(const PackedMatrix& w, int64_t m, ActType act);
void scalar_quantize_act(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act, void* qa);
void scalar_matmul_quant(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                        int64_t n0, int64_t n1);
#if defined(CORELM_HAVE_X86)
PackedMatrix avx512_pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par);
PackedMatrix avx512_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par);
void avx512_matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy,
                   int64_t n0, int64_t n1);
size_t avx512_quant_act_bytes(const PackedMatrix& w, int64_t m, ActType act);
void avx512_quantize_act(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act, void* qa);
void avx512_matmul_quant(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                        int64_t n0, int64_t n1);
PackedMatrix avx2_pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par);
PackedMatrix avx2_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par);
void avx2_matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy,
                 int64_t n0, int64_t n1);
size_t avx2_quant_act_bytes(const PackedMatrix& w, int64_t m, ActType act);
void avx2_quantize_act(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act, void* qa);
void avx2_matmul_quant(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                      int64_t n0, int64_t n1);
#endif
}  // namespace quant
}  // namespace corelm
