// Packing into, and reading rows out of, the grouped quantized layout (quant_layout.h).
#include "kernels/quant_layout.h"

namespace corelm {
namespace quant {
namespace {

// Where column k of row j (of 8) sits among the 256 quant bytes of a block: piece k/4, lane j.
inline int position(int j, int k) { return 32 * (k / 4) + 4 * j + k % 4; }

inline void put_block(WeightType type, uint8_t* qs, int j, const int8_t* q) {
  for (int k = 0; k < 32; k++) {
    const int c = position(j, k);
    if (type == WeightType::Q8)
      qs[c] = (uint8_t)(q[k] + 128);
    else  // Q8-vector t = c / 64 goes to the low (even t) or high (odd t) nibbles of vector t / 2
      qs[64 * (c / 128) + c % 64] |= (uint8_t)((q[k] & 0x0f) << (4 * (c / 64 % 2)));
  }
}

// put_block for a ggml block's own quant bytes (Q8_0: 32 int8; Q4_0/Q4_1: element i in the low
// nibble of byte i, i + 16 in the high one), moved 4 bytes at a time: packing runs at every load.
// Row j's columns 4p..4p+3 are the 4 bytes at 32p + 4j (Q8); for Q4 the bytes at 4j, 32 + 4j,
// 64 + 4j, 96 + 4j hold columns {0-3, 8-11}, {4-7, 12-15}, {16-19, 24-27}, {20-23, 28-31}
// (low nibble, high nibble), as put_block places them.
inline uint32_t load4(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline void store4(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

inline void put_raw_block(WeightType type, uint8_t* qs, int j, const uint8_t* rq) {
  if (type == WeightType::Q8) {
    for (int p = 0; p < 8; p++) store4(qs + 32 * p + 4 * j, load4(rq + 4 * p) ^ 0x80808080u);
    return;
  }
  const uint32_t lo = 0x0f0f0f0fu, a = load4(rq), c = load4(rq + 4), b = load4(rq + 8), e = load4(rq + 12);
  store4(qs + 4 * j, (a & lo) | ((b & lo) << 4));
  store4(qs + 32 + 4 * j, (c & lo) | ((e & lo) << 4));
  store4(qs + 64 + 4 * j, ((a >> 4) & lo) | (b & ~lo));
  store4(qs + 96 + 4 * j, ((c >> 4) & lo) | (e & ~lo));
}

inline int get_quant(WeightType type, const uint8_t* qs, int j, int k) {
  const int c = position(j, k);
  if (type == WeightType::Q8) return (int)qs[c] - 128;
  return (qs[64 * (c / 128) + c % 64] >> (4 * (c / 64 % 2))) & 0x0f;
}

PackedMatrix empty_matrix(WeightType t, int64_t rows, int64_t cols, const KernelTable* by) {
  return new_matrix(t, rows, cols, by, [&](int64_t ld) {
    const int64_t nb = ld / kBlock, groups = ngroups(rows), full = groups / kSuper, tail = groups % kSuper;
    return (size_t)(full * super_bytes(t, nb, kSuper) + (tail ? super_bytes(t, nb, tail) : 0));
  });
}

// Row r's block b: the quant record, and the d and m entries.
struct RowBlock {
  uint8_t* qs;
  uint16_t* d;
  uint16_t* m;
};
inline RowBlock row_block(const PackedMatrix& w, int64_t r, int64_t b) {
  const GroupView v = group_view(w.data(), w.type, nblocks(w), ngroups(w.rows), r / kGroup);
  return {const_cast<uint8_t*>(v.qs + b * v.qstride), const_cast<uint16_t*>(v.d + b * v.dstride + r % kGroup),
          const_cast<uint16_t*>(v.m + b * v.dstride + r % kGroup)};
}

inline void put(const PackedMatrix& m, int64_t r, int64_t b, const int8_t* q, uint16_t d16, uint16_t m16) {
  RowBlock rb = row_block(m, r, b);
  put_block(m.type, rb.qs, (int)(r % kGroup), q);
  *rb.d = d16;
  if (m.type == WeightType::Q4M) *rb.m = m16;
}

}  // namespace

PackedMatrix grouped_pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par,
                          const KernelTable* by) {
  PackedMatrix m = empty_matrix(type, rows, cols, by);
  auto fill = [&](int64_t g0, int64_t g1) {  // whole groups of kGroup rows: disjoint bytes per range
    for (int64_t r = g0 * kGroup; r < std::min(rows, g1 * kGroup); r++)
      quantize_row(type, src + r * cols, cols, [&](int64_t b, const int8_t* q, uint16_t d16, uint16_t m16) {
        put(m, r, b, q, d16, m16);
      });
  };
  if (par)
    (*par)(ngroups(rows), fill);
  else
    fill(0, ngroups(rows));
  return m;
}

PackedMatrix grouped_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par,
                              const KernelTable* by) {
  PackedMatrix m = empty_matrix(type, rows, cols, by);
  const int64_t nb = cols / kBlock;
  const size_t bb = ggml_block_bytes(type);
  const int64_t groups = ngroups(rows);
  auto fill = [&](int64_t g0, int64_t g1) {  // whole groups of kGroup rows: disjoint bytes per range
    for (int64_t r = g0 * kGroup; r < std::min(rows, g1 * kGroup); r++) {
      const GroupView v = group_view(m.data(), type, nb, groups, r / kGroup);
      const int j = (int)(r % kGroup);
      for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = raw + ((size_t)r * nb + b) * bb;  // fp16 d, (Q4_1) fp16 m, the quants
        put_raw_block(type, const_cast<uint8_t*>(v.qs + b * v.qstride), j, blk + (type == WeightType::Q4M ? 4 : 2));
        std::memcpy(const_cast<uint16_t*>(v.d) + b * v.dstride + j, blk, 2);
        if (type == WeightType::Q4M) std::memcpy(const_cast<uint16_t*>(v.m) + b * v.dstride + j, blk + 2, 2);
      }
    }
  };
  if (par)
    (*par)(groups, fill);
  else
    fill(0, groups);
  return m;
}

void grouped_row_to_f32(const PackedMatrix& w, int64_t row, float* out) {
  for (int64_t b = 0; b * kBlock < w.cols; b++) {
    RowBlock rb = row_block(w, row, b);
    const float d = f16_to_f32(*rb.d), mn = w.type == WeightType::Q4M ? f16_to_f32(*rb.m) : 0.f;
    for (int64_t k = 0; k < kBlock && b * kBlock + k < w.cols; k++)
      out[b * kBlock + k] = dequant_value(w.type, get_quant(w.type, rb.qs, (int)(row % kGroup), (int)k), d, mn);
  }
}

}  // namespace quant
}  // namespace corelm
