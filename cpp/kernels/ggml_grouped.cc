// Repacking GGUF blocks into the grouped layout of ggml_grouped.h, and reading rows back.
#include "kernels/ggml_grouped.h"

namespace corelm {
namespace quant {
namespace {

// The byte offsets of a block's fp16 d (and dmin) in the file.
inline int d_offset(WeightType t) { return t == WeightType::Q6_K ? 208 : 0; }

inline int code_of(WeightType t, int v, const GroupedTraits& tr) {
  if (!tr.table) return v + tr.offset;
  for (int u = 0; u < 16; u++)
    if (kIq4Values[u] == v) return u;
  return 0;
}

// Byte and shift of column k of row j (of 8) among a chunk's 128 nibble bytes (quant_layout.h's Q4).
inline void nibble_at(int j, int k, int* byte, int* shift) {
  const int p = k / 4, i = 4 * j + k % 4;
  *byte = 64 * (p / 4) + 32 * (p % 2) + i;
  *shift = 4 * ((p / 2) % 2);
}

}  // namespace

PackedMatrix grouped_ggml_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols,
                                   const ParallelFor* par, const KernelTable* by) {
  check_raw(type, (size_t)rows * ggml_row_bytes(type, cols), rows, cols);
  const GroupedTraits tr = grouped_traits(type);
  const int64_t be = ggml_block_elems(type), nsb = cols / be, groups = ngroups(rows);
  const size_t bb = ggml_type_block_bytes(type), rb = ggml_row_bytes(type, cols);
  PackedMatrix m;
  m.type = type;
  m.rows = rows;
  m.cols = cols;
  m.ld = cols;
  const int64_t full = groups / kSuper, tail = groups % kSuper;
  m.nbytes = (size_t)(full * nsb * grouped_sb_bytes(tr, kSuper) + (tail ? nsb * grouped_sb_bytes(tr, tail) : 0));
  m.packed_by = by;
  m.storage = aligned_buffer(m.nbytes);  // zeroed: rows past the matrix stay 0
  uint8_t* base = static_cast<uint8_t*>(m.storage.get());
  auto fill = [&](int64_t g0, int64_t g1) {  // whole groups: disjoint bytes per range
    Chunk ch;
    for (int64_t r = g0 * kGroup; r < std::min(rows, g1 * kGroup); r++) {
      const GroupedView v = grouped_view(base, type, nsb, groups, r / kGroup);
      const int j = (int)(r % kGroup);
      for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t* blk = raw + r * rb + sb * bb;
        std::memcpy(const_cast<uint16_t*>(v.D(sb)) + j, blk + d_offset(type), 2);
        if (tr.mins) {  // Q5_1: -m (w = d*u - (-m)*1), its sign bit flipped: exact
          uint16_t dm;
          std::memcpy(&dm, blk + 2, 2);
          const_cast<uint16_t*>(v.Dm(sb))[j] = type == WeightType::Q5_1 ? (uint16_t)(dm ^ 0x8000u) : dm;
        }
        for (int c = 0; c < tr.chunks; c++) {
          decode_chunk(type, blk, c, &ch);
          if (tr.scales)
            for (int h = 0; h < (tr.halves ? 2 : 1); h++)
              const_cast<int8_t*>(v.S(sb, tr.halves ? 2 * c + h : c))[j] = (int8_t)ch.s[h];
          if (tr.mins) const_cast<uint8_t*>(v.M(sb, c))[j] = (uint8_t)ch.mn[0];
          uint8_t* qs = const_cast<uint8_t*>(v.qs(sb, c));
          uint8_t* hi = const_cast<uint8_t*>(v.hi(sb, c));
          for (int k = 0; k < 32; k++) {
            const int u = code_of(type, ch.v[k], tr);
            int byte, shift;
            nibble_at(j, k, &byte, &shift);
            qs[byte] |= (uint8_t)((u & 0xf) << shift);
            const int p = k / 4, i = 4 * j + k % 4;
            if (tr.hi_bits == 1) hi[i] |= (uint8_t)(((u >> 4) & 1) << p);
            if (tr.hi_bits == 2) hi[32 * (p / 4) + i] |= (uint8_t)(((u >> 4) & 3) << (2 * (p % 4)));
          }
        }
      }
    }
  };
  if (par)
    (*par)(groups, fill);
  else
    fill(0, groups);
  return m;
}

void grouped_ggml_row_to_f32(const PackedMatrix& w, int64_t row, float* out) {
  const WeightType type = w.type;
  const GroupedTraits tr = grouped_traits(type);
  const int64_t be = ggml_block_elems(type), nsb = w.cols / be;
  const GroupedView v = grouped_view(w.data(), type, nsb, ngroups(w.rows), row / kGroup);
  const int j = (int)(row % kGroup);
  for (int64_t sb = 0; sb < nsb; sb++) {
    const float d = f16_to_f32(v.D(sb)[j]), dm = tr.mins ? f16_to_f32(v.Dm(sb)[j]) : 0.f;
    for (int c = 0; c < tr.chunks; c++) {
      const uint8_t *qs = v.qs(sb, c), *hi = v.hi(sb, c);
      const float dmm = unfused_product(dm, tr.mins ? (float)v.M(sb, c)[j] : 0.f);
      for (int k = 0; k < 32; k++) {
        int byte, shift;
        nibble_at(j, k, &byte, &shift);
        int u = (qs[byte] >> shift) & 0xf;
        const int p = k / 4, i = 4 * j + k % 4;
        if (tr.hi_bits == 1) u |= ((hi[i] >> p) & 1) << 4;
        if (tr.hi_bits == 2) u |= ((hi[32 * (p / 4) + i] >> (2 * (p % 4))) & 3) << 4;
        const int val = tr.table ? kIq4Values[u] : u - tr.offset;
        const int s = tr.scales ? v.S(sb, tr.halves ? 2 * c + k / 16 : c)[j] : 1;
        const float ds = unfused_product(d, (float)s);
        out[sb * be + 32 * c + k] = unfused_product(ds, (float)val) - dmm;
      }
    }
  }
}

}  // namespace quant
}  // namespace corelm
