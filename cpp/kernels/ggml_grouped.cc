// Repacking GGUF blocks into the grouped layout of ggml_grouped.h, and reading rows back.
#include "kernels/ggml_grouped.h"

namespace corelm {
namespace quant {
namespace {

// The byte offsets of a block's fp16 d (and dmin) in the file.
inline int d_offset(WeightType t) { return t == WeightType::Q6_K ? 208 : 0; }

inline uint32_t load4(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  return x;
}

// Bit b of m (b < 4) as bit 4 of byte b: four codes' fifth bits at once.
inline uint32_t fifth_bits(uint32_t m) {
  return ((m & 1u) | ((m & 2u) << 7) | ((m & 4u) << 14) | ((m & 8u) << 21)) << 4;
}

// The 32 codes u of chunk c (the stored bits: v = u - offset, or the IQ4 table's entry for u), four to a
// word: u[4p..4p+3] in the bytes of w[p]. Whole words at a time, per type: packing is most of a load.
template <WeightType T>
inline void chunk_code_words(const uint8_t* blk, int c, uint32_t w[8]) {
  constexpr uint32_t lo4 = 0x0f0f0f0fu;
  auto nibbles = [&](const uint8_t* qs) {  // element k < 16 in the low nibble of qs[k], k + 16 in the high
    for (int p = 0; p < 4; p++) w[p] = load4(qs + 4 * p) & lo4, w[p + 4] = (load4(qs + 4 * p) >> 4) & lo4;
  };
  auto bit4 = [&](uint32_t qh) {
    for (int p = 0; p < 8; p++) w[p] |= fifth_bits((qh >> (4 * p)) & 0xf);
  };
  if constexpr (T == WeightType::Q5_0) {
    nibbles(blk + 6), bit4(load4(blk + 2));
  } else if constexpr (T == WeightType::Q5_1) {
    nibbles(blk + 8), bit4(load4(blk + 4));
  } else if constexpr (T == WeightType::IQ4_NL) {
    nibbles(blk + 2);
  } else if constexpr (T == WeightType::IQ4_XS) {
    nibbles(blk + 8 + 16 * c);
  } else if constexpr (T == WeightType::Q4_K) {
    const uint8_t* q = blk + 16 + 32 * (c / 2);
    for (int p = 0; p < 8; p++) w[p] = (load4(q + 4 * p) >> (4 * (c % 2))) & lo4;
  } else if constexpr (T == WeightType::Q5_K) {
    const uint8_t* q = blk + 48 + 32 * (c / 2);
    for (int p = 0; p < 8; p++)
      w[p] = ((load4(q + 4 * p) >> (4 * (c % 2))) & lo4) | (((load4(blk + 16 + 4 * p) >> c) & 0x01010101u) << 4);
  } else {
    static_assert(T == WeightType::Q6_K, "a grouped type");
    const int h = c / 4, q = c % 4;
    const uint8_t *ql = blk + 64 * h + 32 * (q % 2), *qhb = blk + 128 + 32 * h;
    for (int p = 0; p < 8; p++)
      w[p] = ((load4(ql + 4 * p) >> (4 * (q / 2))) & lo4) | (((load4(qhb + 4 * p) >> (2 * q)) & 0x03030303u) << 4);
  }
}

inline void or4(uint8_t* p, uint32_t v) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  w |= v;
  std::memcpy(p, &w, 4);
}

// Byte and shift of column k of row j (of 8) among a chunk's 128 nibble bytes (quant_layout.h's Q4).
inline void nibble_at(int j, int k, int* byte, int* shift) {
  const int p = k / 4, i = 4 * j + k % 4;
  *byte = 64 * (p / 4) + 32 * (p % 2) + i;
  *shift = 4 * ((p / 2) % 2);
}

// Rows of groups [g0, g1) of the file's rows raw into the grouped layout at base (zeroed): whole groups,
// so ranges write disjoint bytes.
template <WeightType T>
void fill_groups(uint8_t* base, const uint8_t* raw, int64_t rows, int64_t nsb, int64_t groups, int64_t g0, int64_t g1) {
  constexpr GroupedTraits tr = grouped_traits(T);
  const size_t bb = ggml_type_block_bytes(T), rb = (size_t)nsb * bb;
  // this range's super-groups are contiguous bytes (one shared with the next range at most)
  const size_t sg_bytes = (size_t)nsb * grouped_sb_bytes(tr, kSuper);
  const size_t first = (size_t)(g0 / kSuper) * sg_bytes, last = std::min((size_t)((g1 + kSuper - 1) / kSuper) * sg_bytes,
                                                                          grouped_bytes(tr, nsb, groups));
  prefault_for_write(base + first, last - first);
  Chunk ch;
  for (int64_t r = g0 * kGroup; r < std::min(rows, g1 * kGroup); r++) {
    const GroupedView v = grouped_view(base, T, nsb, groups, r / kGroup);
    const int j = (int)(r % kGroup);
    for (int64_t sb = 0; sb < nsb; sb++) {
      const uint8_t* blk = raw + r * rb + sb * bb;
      std::memcpy(const_cast<uint16_t*>(v.D(sb)) + j, blk + d_offset(T), 2);
      if constexpr (tr.mins) {  // Q5_1: -m (w = d*u - (-m)*1), its sign bit flipped: exact
        uint16_t dm;
        std::memcpy(&dm, blk + 2, 2);
        const_cast<uint16_t*>(v.Dm(sb))[j] = T == WeightType::Q5_1 ? (uint16_t)(dm ^ 0x8000u) : dm;
      }
      for (int c = 0; c < tr.chunks; c++) {
        decode_int_scales(T, blk, c, &ch);
        if constexpr (tr.scales)
          for (int h = 0; h < (tr.halves ? 2 : 1); h++)
            const_cast<int8_t*>(v.S(sb, tr.halves ? 2 * c + h : c))[j] = (int8_t)ch.s[h];
        if constexpr (tr.min_codes) const_cast<uint8_t*>(v.M(sb, c))[j] = (uint8_t)ch.mn[0];
        uint32_t w[8];
        chunk_code_words<T>(blk, c, w);
        uint8_t* qs = const_cast<uint8_t*>(v.qs(sb, c));
        uint8_t* hi = const_cast<uint8_t*>(v.hi(sb, c));
        for (int p = 0; p < 8; p++) {  // piece p: columns 4p..4p+3, the 4 bytes of row j (nibble_at)
          or4(qs + 64 * (p / 4) + 32 * (p % 2) + 4 * j, (w[p] & 0x0f0f0f0fu) << (4 * ((p / 2) % 2)));
          if constexpr (tr.hi_bits == 1) or4(hi + 4 * j, ((w[p] >> 4) & 0x01010101u) << p);
          if constexpr (tr.hi_bits == 2) or4(hi + 32 * (p / 4) + 4 * j, ((w[p] >> 4) & 0x03030303u) << (2 * (p % 4)));
        }
      }
    }
  }
}

}  // namespace

PackedMatrix grouped_ggml_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols,
                                   const ParallelFor* par, const KernelTable* by) {
  check_raw(type, (size_t)rows * ggml_row_bytes(type, cols), rows, cols);
  const GroupedTraits tr = grouped_traits(type);
  const int64_t nsb = cols / ggml_block_elems(type), groups = ngroups(rows);
  PackedMatrix m;
  m.type = type;
  m.rows = rows;
  m.cols = cols;
  m.ld = cols;
  m.nbytes = grouped_bytes(tr, nsb, groups);
  m.packed_by = by;
  m.storage = aligned_buffer(m.nbytes);  // zeroed: rows past the matrix stay 0
  uint8_t* base = static_cast<uint8_t*>(m.storage.get());
  with_grouped_type(type, [&](auto t) {
    auto fill = [&](int64_t g0, int64_t g1) { fill_groups<decltype(t)::value>(base, raw, rows, nsb, groups, g0, g1); };
    if (par)
      (*par)(groups, fill);
    else
      fill(0, groups);
  });
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
      const float dmm = unfused_product(dm, tr.min_codes ? (float)v.M(sb, c)[j] : tr.mins ? 1.f : 0.f);
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
