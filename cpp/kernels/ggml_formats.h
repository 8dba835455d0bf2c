// The GGUF block types kept in their own bytes (row-major, as the file stores them): Q5_0, Q5_1,
// the K-quants Q2_K..Q6_K and IQ4_NL / IQ4_XS. Every kernel table multiplies them straight from the
// file's blocks (no repacking, no other format), so this header is their one description: the byte
// layout of each block, how 32 consecutive weights ("a chunk") decode into small integers and
// integer scales, and the reference dequantization, in gguf.quants' order of float operations.
//
// A chunk of 32 weights decodes to
//   v[32]   signed integers (|v| <= 127)
//   s[h]    the integer scale of half h (weights 16h..16h+15; both halves equal where sub-blocks are 32)
//   mn[h]   the integer minimum of half h (0 where the type has none)
//   d, dm   the block's float scale and minimum scale (fp16 in the file; Q5_1 stores dm = -m)
// and weight k of half h is d*s[h]*v[k] - dm*mn[h].
//
// matmul semantics (every table, every m): each activation row is quantized per 32 columns exactly as
// for Q8/Q4/Q4M (quant_formats.h: dx = absmax/127 int8 or absmax/32767 int16), and
//   y = sum over chunks and halves of (d*s[h]) * dx * sum(v*xq) - (dm*mn[h]) * dx * sum(xq)
// with the integer sums exact: the dot of the dequantized weights with the dequantized activations.
//
// Plain C++, included by baseline-ISA code and the ISA files (unnamed namespace: each its own copy).
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/quant_formats.h"
#include "kernels/sparse_layout.h"

namespace corelm {
namespace quant {

// Every raw type a table takes (pack_raw), by its traits row's raw name: GGUF block types by ggml's
// names (Q8_0/Q4_0/Q4_1 are repacked as Q8/Q4/Q4M, the others kept as stored), BF16 rows (packed with no
// float round trip) and SBF16 as dense bf16 rows and SQ8/SQ4 as dense Q8_0/Q4_0 blocks, which the packer
// makes sparse.
inline WeightType type_of_ggml(const std::string& name) { return parse_raw_weight_type(name); }

namespace {

// The types multiplied straight from their GGUF blocks.
inline bool is_ggml_block(WeightType t) { return has_kind(t, kGgmlBlocks); }
// The packing types of the quantized code (quantized, GGUF blocks, sparse).
inline bool is_raw_type(WeightType t) { return has_kind(t, kQuantBlocks | kGgmlBlocks | kSparseRows | kSparseQuant); }
// Raw bf16 rows: SBF16's, and BF16 matrices taken without a float round trip (not a packing type of
// the quantized code, so not is_raw_type).
inline bool is_bf16_rows(WeightType t) { return traits(t).dense == WeightType::BF16; }

// Weights per block along a row (a K-quant's super-block is 256) and bytes per block (a bf16 row's
// block is one weight; SQ8 and SQ4 come as dense Q8_0 and Q4_0 blocks).
inline int64_t ggml_block_elems(WeightType t) { return traits(t).block; }
inline size_t ggml_type_block_bytes(WeightType t) { return (size_t)traits(t).block_bytes; }
inline size_t ggml_row_bytes(WeightType t, int64_t cols) {
  return (size_t)(cols / ggml_block_elems(t)) * ggml_type_block_bytes(t);
}

// IQ4_NL / IQ4_XS: the 16 values a 4-bit code stands for.
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

struct Chunk {
  int8_t v[32];
  int32_t s[2], mn[2];
  float d, dm;
};

// Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j (0..7) from the 12 packed bytes.
inline void k4_scale_min(const uint8_t* q, int j, int32_t* sc, int32_t* m) {
  if (j < 4) {
    *sc = q[j] & 63, *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}
// Q3_K: the 6-bit scale of sub-block i (0..15), minus 32.
inline int32_t k3_scale(const uint8_t* q, int i) {
  const int lo = i < 8 ? q[i] & 0xF : q[i - 8] >> 4, hi = (q[8 + i % 4] >> (2 * (i / 4))) & 3;
  return (lo | (hi << 4)) - 32;
}
// IQ4_XS: the 6-bit scale of sub-block j (0..7), minus 32.
inline int32_t iq4xs_scale(const uint8_t* blk, int j) {
  uint16_t sh;
  std::memcpy(&sh, blk + 2, 2);
  return (((blk[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4)) - 32;
}

// Whether a type's halves may have different scales (sub-blocks of 16), and whether it has minimums.
inline bool has_half_scales(WeightType t) {
  return t == WeightType::Q2_K || t == WeightType::Q3_K || t == WeightType::Q6_K;
}
inline bool has_minimums(WeightType t) {
  return t == WeightType::Q5_1 || t == WeightType::Q2_K || t == WeightType::Q4_K || t == WeightType::Q5_K;
}

// The integer scales s and minimums mn of chunk c (0 .. block_elems/32 - 1) of the block at blk.
inline void decode_int_scales(WeightType t, const uint8_t* blk, int c, Chunk* o) {
  o->s[0] = o->s[1] = 1;
  o->mn[0] = o->mn[1] = 0;
  switch (t) {
    case WeightType::Q5_1:
      o->mn[0] = o->mn[1] = 1;
      return;
    case WeightType::IQ4_XS:
      o->s[0] = o->s[1] = iq4xs_scale(blk, c);
      return;
    case WeightType::Q4_K:
    case WeightType::Q5_K:
      k4_scale_min(blk + 4, c, &o->s[0], &o->mn[0]);
      o->s[1] = o->s[0], o->mn[1] = o->mn[0];
      return;
    case WeightType::Q6_K:
      o->s[0] = (int8_t)blk[192 + 2 * c], o->s[1] = (int8_t)blk[192 + 2 * c + 1];
      return;
    case WeightType::Q3_K:
      o->s[0] = k3_scale(blk + 96, 2 * c), o->s[1] = k3_scale(blk + 96, 2 * c + 1);
      return;
    case WeightType::Q2_K:
      for (int i = 0; i < 2; i++) o->s[i] = blk[2 * c + i] & 0xF, o->mn[i] = blk[2 * c + i] >> 4;
      return;
    default:  // Q5_0, IQ4_NL: s = 1, no minimum
      return;
  }
}

// The scales of chunk c of the block at blk: the integer ones and d, dm (o->v untouched).
inline void decode_scales(WeightType t, const uint8_t* blk, int c, Chunk* o) {
  decode_int_scales(t, blk, c, o);
  const int m_at = traits(t).min_at;
  o->d = f16_at(blk + traits(t).scale_at);
  o->dm = m_at < 0 ? 0.f : t == WeightType::Q5_1 ? -f16_at(blk + m_at) : f16_at(blk + m_at);
}

// Chunk c of the block at blk: its 32 values and its scales.
inline void decode_chunk(WeightType t, const uint8_t* blk, int c, Chunk* o) {
  decode_scales(t, blk, c, o);
  const int h = c / 4, q = c % 4;  // Q2_K..Q6_K: chunk c is quarter q of half h of the super-block
  auto nibble = [](const uint8_t* qs, int k) { return (k < 16 ? qs[k] : qs[k - 16] >> 4) & 0xF; };
  switch (t) {
    case WeightType::Q5_0:
    case WeightType::Q5_1: {
      const bool one = t == WeightType::Q5_1;
      uint32_t qh;
      std::memcpy(&qh, blk + (one ? 4 : 2), 4);
      for (int k = 0; k < 32; k++) {
        const int code = nibble(blk + (one ? 8 : 6), k) | (((qh >> k) & 1) << 4);
        o->v[k] = (int8_t)(one ? code : code - 16);
      }
      return;
    }
    case WeightType::IQ4_NL:
      for (int k = 0; k < 32; k++) o->v[k] = kIq4Values[nibble(blk + 2, k)];
      return;
    case WeightType::IQ4_XS:
      for (int k = 0; k < 32; k++) o->v[k] = kIq4Values[nibble(blk + 8 + 16 * c, k)];
      return;
    case WeightType::Q4_K:
    case WeightType::Q5_K: {
      const bool five = t == WeightType::Q5_K;
      const uint8_t* qs = blk + (five ? 48 : 16) + 32 * (c / 2);
      for (int k = 0; k < 32; k++)
        o->v[k] = (int8_t)(((qs[k] >> (4 * (c % 2))) & 0xF) | (five ? ((blk[16 + k] >> c) & 1) << 4 : 0));
      return;
    }
    case WeightType::Q6_K: {
      const uint8_t *ql = blk + 64 * h + 32 * (q % 2), *qh = blk + 128 + 32 * h;
      for (int k = 0; k < 32; k++)
        o->v[k] = (int8_t)((((ql[k] >> (4 * (q / 2))) & 0xF) | (((qh[k] >> (2 * q)) & 3) << 4)) - 32);
      return;
    }
    case WeightType::Q3_K:
      for (int k = 0; k < 32; k++)
        o->v[k] = (int8_t)(((blk[32 + 32 * h + k] >> (2 * q)) & 3) - (((blk[k] >> c) & 1) ? 0 : 4));
      return;
    case WeightType::Q2_K:
      for (int k = 0; k < 32; k++) o->v[k] = (int8_t)((blk[16 + 32 * h + k] >> (2 * q)) & 3);
      return;
    default:
      return;
  }
}

// One row of `cols` weights to fp32, bit for bit as gguf.quants dequantizes it: the half's scale
// d*s (and minimum dm*mn) rounded to float first, then times v (minus the minimum).
inline void dequantize_ggml_row(WeightType t, const uint8_t* row, int64_t cols, float* out) {
  const int64_t be = ggml_block_elems(t);
  const size_t bb = ggml_type_block_bytes(t);
  Chunk ch;
  for (int64_t b = 0; b < cols / be; b++)
    for (int c = 0; c < be / 32; c++) {
      decode_chunk(t, row + b * bb, c, &ch);
      for (int h = 0; h < 2; h++) {
        const float ds = unfused_product(ch.d, (float)ch.s[h]), dmm = unfused_product(ch.dm, (float)ch.mn[h]);
        for (int k = 16 * h; k < 16 * h + 16; k++) {
          const float w = unfused_product(ds, (float)ch.v[k]);
          out[b * be + 32 * c + k] = w - dmm;  // Q5_1: w - (-m), the same float as w + m
        }
      }
    }
}

// The GGUF-block types come only as GGUF blocks (pack_raw), never from floats (pack).
inline void require_packable(WeightType t) {
  if (is_ggml_block(t))
    throw std::invalid_argument(std::string(weight_type_name(t)) + " weights are taken only as GGUF blocks, not packed from floats");
}

// Raw GGUF blocks of any raw type, rows x cols, to fp32 row-major (for fusing matrices of different types).
inline void dequantize_ggml(WeightType t, const uint8_t* raw, int64_t rows, int64_t cols, float* out) {
  if (is_bf16_rows(t)) {
    for (int64_t i = 0; i < rows * cols; i++) {
      const uint32_t u = (uint32_t)(raw[2 * i] | raw[2 * i + 1] << 8) << 16;
      std::memcpy(out + i, &u, 4);
    }
    return;
  }
  if (is_ggml_block(t)) {
    for (int64_t r = 0; r < rows; r++) dequantize_ggml_row(t, raw + r * ggml_row_bytes(t, cols), cols, out + r * cols);
    return;
  }
  t = sparse::dense_type(t);  // SQ8, SQ4: dense Q8_0, Q4_0 blocks
  const size_t bb = ggml_block_bytes(t);
  int8_t q[32];
  for (int64_t r = 0; r < rows; r++)
    for (int64_t b = 0; b < cols / kBlock; b++) {
      uint16_t d16 = 0, m16 = 0;
      decode_ggml_block(t, raw + (r * (cols / kBlock) + b) * bb, q, &d16, &m16);
      const float d = f16_to_f32(d16), m = f16_to_f32(m16);
      for (int j = 0; j < 32; j++) out[r * cols + b * kBlock + j] = dequant_value(t, q[j], d, m);
    }
}

// Validates a raw buffer of type t for rows x cols: whole blocks per row and the exact byte count.
inline void check_raw(WeightType t, size_t nbytes, int64_t rows, int64_t cols) {
  if (!is_raw_type(t) && !is_bf16_rows(t)) throw std::invalid_argument("not a raw weight type");
  const int64_t be = ggml_block_elems(t);
  if (cols % be != 0)
    throw std::invalid_argument("raw " + std::string(weight_type_name(t)) + " rows must have a multiple of " +
                                std::to_string(be) + " columns, got " + std::to_string(cols));
  const size_t want = (size_t)rows * ggml_row_bytes(t, cols);
  if (nbytes != want)
    throw std::invalid_argument("raw buffer has " + std::to_string(nbytes) + " bytes, expected " + std::to_string(want));
}

}  // namespace
}  // namespace quant
}  // namespace corelm

// The tables' halves for these types. The matrix is the file's blocks, row after row (ld = cols); the
// quantized activations (one layout for every table, filled by ggml_quantize_act) are per row the
// quants [ld] (int8 or int16), then for all rows dx [m][ld/32], the sums of quants per 16 columns
// sx [m][ld/16] and per 32 columns sx32 [m][ld/32] (int32).
namespace corelm {
namespace quant {
PackedMatrix ggml_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const KernelTable* by);
void ggml_row_to_f32(const PackedMatrix& w, int64_t row, float* out);
size_t ggml_act_bytes(const PackedMatrix& w, int64_t m, ActType act);
void ggml_quantize_act(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act, void* qa);
// The same layout with int16 quants whatever act is (int8 precision for ActType::I8), as kernels that
// widen to int16 anyway take them; ggml_act_bytes(w, m, ActType::I16) bytes.
void ggml_quantize_act_wide(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act, void* qa);
void ggml_matmul_quant_scalar(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                              int64_t n0, int64_t n1);
#if defined(CORELM_HAVE_X86)
void ggml_matmul_quant_avx2(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                            int64_t n0, int64_t n1);
#endif
}  // namespace quant
}  // namespace corelm
