// Repacking GGUF blocks into the grouped layout of ggml_grouped.h, and reading rows back.
#include "kernels/ggml_grouped.h"

namespace corelm {
namespace quant {
namespace {

// The byte offsets of a block's fp16 d (and dmin) in the file.
inline int d_offset(WeightType t) { return t == WeightType::Q6_K ? 208 : 0; }

inline uint64_t load8(const uint8_t* p) {
  uint64_t x;
  std::memcpy(&x, p, 8);
  return x;
}

inline void store4(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// Bit b of m (b < 8) as bit 4 of byte b: eight codes' fifth bits at once.
inline uint64_t fifth_bits(uint64_t m) {
  uint64_t out = 0;
  for (int b = 0; b < 8; b++) out |= ((m >> b) & 1u) << (8 * b + 4);
  return out;
}

// The 32 codes u of chunk c (the stored bits: v = u - offset, or the IQ4 table's entry for u), eight to a
// word: u[8k..8k+7] in the bytes of w[k]. Whole words at a time, per type: packing is most of a load.
template <WeightType T>
inline void chunk_code_words(const uint8_t* blk, int c, uint64_t w[4]) {
  constexpr uint64_t lo4 = 0x0f0f0f0f0f0f0f0full;
  auto nibbles = [&](const uint8_t* qs) {  // element k < 16 in the low nibble of qs[k], k + 16 in the high
    for (int k = 0; k < 2; k++) w[k] = load8(qs + 8 * k) & lo4, w[k + 2] = (load8(qs + 8 * k) >> 4) & lo4;
  };
  auto bit4 = [&](const uint8_t* qh) {
    for (int k = 0; k < 4; k++) w[k] |= fifth_bits(qh[k]);
  };
  if constexpr (T == WeightType::Q5_0) {
    nibbles(blk + 6), bit4(blk + 2);
  } else if constexpr (T == WeightType::Q5_1) {
    nibbles(blk + 8), bit4(blk + 4);
  } else if constexpr (T == WeightType::IQ4_NL) {
    nibbles(blk + 2);
  } else if constexpr (T == WeightType::IQ4_XS) {
    nibbles(blk + 8 + 16 * c);
  } else if constexpr (T == WeightType::Q4_K) {
    const uint8_t* q = blk + 16 + 32 * (c / 2);
    for (int k = 0; k < 4; k++) w[k] = (load8(q + 8 * k) >> (4 * (c % 2))) & lo4;
  } else if constexpr (T == WeightType::Q5_K) {
    const uint8_t* q = blk + 48 + 32 * (c / 2);
    for (int k = 0; k < 4; k++)
      w[k] = ((load8(q + 8 * k) >> (4 * (c % 2))) & lo4) |
             (((load8(blk + 16 + 8 * k) >> c) & 0x0101010101010101ull) << 4);
  } else {
    static_assert(T == WeightType::Q6_K, "a grouped type");
    const int h = c / 4, q = c % 4;
    const uint8_t *ql = blk + 64 * h + 32 * (q % 2), *qhb = blk + 128 + 32 * h;
    for (int k = 0; k < 4; k++)
      w[k] = ((load8(ql + 8 * k) >> (4 * (q / 2))) & lo4) |
             (((load8(qhb + 8 * k) >> (2 * q)) & 0x0303030303030303ull) << 4);
  }
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
        uint64_t w[4];
        chunk_code_words<T>(blk, c, w);
        uint8_t* qs = const_cast<uint8_t*>(v.qs(sb, c));
        uint8_t* hi = const_cast<uint8_t*>(v.hi(sb, c));
        // Row j's bytes of the chunk, each written whole (rows own disjoint bytes). nibble_at puts pieces
        // p and p + 2 (4 columns each) in one byte, p low, of the 32-byte quarter 2 (p / 4) + p % 2: the
        // pieces of w[2h] and w[2h + 1] share quarters 2h (low words) and 2h + 1 (high words).
        constexpr uint64_t lo4 = 0x0f0f0f0f0f0f0f0full;
        for (int h = 0; h < 2; h++) {
          const uint64_t b = (w[2 * h] & lo4) | ((w[2 * h + 1] & lo4) << 4);
          store4(qs + 64 * h + 4 * j, (uint32_t)b);
          store4(qs + 64 * h + 32 + 4 * j, (uint32_t)(b >> 32));
        }
        if constexpr (tr.hi_bits == 1) {  // bit p of byte i: the fifth bit of column 4p + i
          uint64_t t = 0;  // piece 2k in the low word at bit 2k, piece 2k + 1 in the high word
          for (int k = 0; k < 4; k++) t |= ((w[k] >> 4) & 0x0101010101010101ull) << (2 * k);
          store4(hi + 4 * j, (uint32_t)t | ((uint32_t)(t >> 32) << 1));
        }
        if constexpr (tr.hi_bits == 2) {  // bits 2(p % 4)..+1 of byte i of half p / 4: bits 4-5 of 4p + i
          for (int h = 0; h < 2; h++) {
            const uint64_t t = ((w[2 * h] >> 4) & 0x0303030303030303ull) | (((w[2 * h + 1] >> 4) & 0x0303030303030303ull) << 4);
            store4(hi + 32 * h + 4 * j, (uint32_t)t | ((uint32_t)(t >> 32) << 2));
          }
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
