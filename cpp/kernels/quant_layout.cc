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

PackedMatrix grouped_pack(const float* src, int64_t rows, int64_t cols, WeightType type, const KernelTable* by) {
  PackedMatrix m = empty_matrix(type, rows, cols, by);
  for (int64_t r = 0; r < rows; r++)
    quantize_row(type, src + r * cols, cols, [&](int64_t b, const int8_t* q, uint16_t d16, uint16_t m16) {
      put(m, r, b, q, d16, m16);
    });
  return m;
}

PackedMatrix grouped_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par,
                              const KernelTable* by) {
  PackedMatrix m = empty_matrix(type, rows, cols, by);
  const int64_t nb = cols / kBlock;
  const size_t bb = ggml_block_bytes(type);
  auto fill = [&](int64_t g0, int64_t g1) {  // whole groups of kGroup rows: disjoint bytes per range
    int8_t q[32];
    for (int64_t r = g0 * kGroup; r < std::min(rows, g1 * kGroup); r++)
      for (int64_t b = 0; b < nb; b++) {
        uint16_t d16 = 0, m16 = 0;
        decode_ggml_block(type, raw + ((size_t)r * nb + b) * bb, q, &d16, &m16);
        put(m, r, b, q, d16, m16);
      }
  };
  const int64_t groups = ngroups(rows);
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
