// Packing into, expanding and reading rows out of the sparse Q8/Q4 layout (sparse_quant.h). Built for
// the baseline ISA.
#include "kernels/sparse_quant.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <vector>

#include "kernels/kernel_util.h"
#include "kernels/quant_layout.h"

namespace corelm {
namespace sparse {
namespace {

using quant::GroupView;
using quant::group_view;
using quant::kBlock;

inline int64_t round64(int64_t v) { return (v + 63) / 64 * 64; }
constexpr int64_t kPositions = 256;  // a group's block: 8 rows x 32 columns

// A group's block of the dense grouped layout as 256 codes in W_t position order (the dense byte for
// Q8, the nibble for Q4).
inline void dense_codes(WeightType dt, const uint8_t* qs, uint8_t* e) {
  if (dt == WeightType::Q8) {
    std::memcpy(e, qs, kPositions);
    return;
  }
  for (int c = 0; c < kPositions; c++) e[c] = (qs[64 * (c / 128) + c % 64] >> (4 * (c / 64 % 2))) & 0x0f;
}
inline void put_dense_codes(WeightType dt, const uint8_t* e, uint8_t* qs) {
  if (dt == WeightType::Q8) {
    std::memcpy(qs, e, kPositions);
    return;
  }
  for (int u = 0; u < 2; u++)
    for (int i = 0; i < 64; i++) qs[64 * u + i] = (uint8_t)(e[128 * u + i] | e[128 * u + 64 + i] << 4);
}
inline int row_of(int c) { return c % 32 / 4; }

// Walks a record's groups: f(b, i, d, masks, codes) per block b and group i (d: the block's scales
// of all ns groups).
template <class F>
void walk_record(WeightType t, const uint8_t* rec, int64_t nb, int64_t ns, F f) {
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = quant_block(rec, b);
    const uint16_t* d = reinterpret_cast<const uint16_t*>(blk);
    const uint8_t* codes = blk + 48 * ns;
    for (int64_t i = 0; i < ns; i++) {
      uint64_t mask[4];
      std::memcpy(mask, blk + 16 * ns + 32 * i, 32);
      f(b, i, d, mask, codes);
      codes += codes_bytes(t, mask);
    }
  }
}

// The 256 codes of a group's block from its masks and codes.
inline void expand_codes(WeightType t, const uint64_t* mask, const uint8_t* codes, uint8_t* e) {
  std::memset(e, zero_code(t), kPositions);
  for (int w = 0; w < 4; w++) {
    int k = 0;
    for (uint64_t m = mask[w]; m; m &= m - 1, k++)  // the set bits, lowest first
      e[64 * w + __builtin_ctzll(m)] = t == WeightType::SQ8 ? codes[k] : (uint8_t)(codes[k] >> (4 * (w % 2)) & 0x0f);
    codes += window_advance(t, mask, w);
  }
}

// Builds the sparse matrix from the dense grouped one.
PackedMatrix sparsify(const PackedMatrix& dense, WeightType type, const ParallelFor* par, const KernelTable* by) {
  const WeightType dt = dense_type(type);
  const int64_t rows = dense.rows, nb = quant::nblocks(dense), groups = quant::ngroups(rows), supers = nsupers(rows);
  const uint8_t z = zero_code(type);
  auto run = [&](const std::function<void(int64_t, int64_t)>& body) {
    if (par && *par) (*par)(supers, body);
    else body(0, supers);
  };
  // f(b, i, masks, codes e[256]) per block and group of super-group s (masks of the non-zero codes)
  auto each_group = [&](int64_t s, auto f) {
    for (int64_t b = 0; b < nb; b++)
      for (int64_t i = 0; i < quant::kSuper && s * quant::kSuper + i < groups; i++) {
        const int64_t g = s * quant::kSuper + i;
        const GroupView v = group_view(dense.data(), dt, nb, groups, g);
        uint8_t e[kPositions];
        dense_codes(dt, v.qs + b * v.qstride, e);
        uint64_t mask[4] = {0, 0, 0, 0};
        for (int c = 0; c < kPositions; c++)
          if (e[c] != z && g * quant::kGroup + row_of(c) < rows) mask[c / 64] |= 1ull << (c % 64);
        f(b, i, v.d + b * v.dstride, mask, e);
      }
  };
  std::vector<int64_t> size(supers, 0);
  run([&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; s++) {
      const int64_t ns = std::min<int64_t>(quant::kSuper, groups - s * quant::kSuper);
      int64_t n = nb * (4 + 16 * ns);
      each_group(s, [&](int64_t, int64_t, const uint16_t*, const uint64_t* mask, const uint8_t*) {
        n += 32 + codes_bytes(type, mask);  // the masks and the codes
      });
      size[s] = round64(n);
    }
  });
  std::vector<uint64_t> off(supers + 1);
  off[0] = (uint64_t)round64(8 * (supers + 1));
  for (int64_t s = 0; s < supers; s++) off[s + 1] = off[s] + (uint64_t)size[s];
  PackedMatrix m = with_offsets(type, rows, dense.cols, dense.ld, off, by);
  uint8_t* base = static_cast<uint8_t*>(m.storage.get());
  run([&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; s++) {
      const int64_t ns = std::min<int64_t>(quant::kSuper, groups - s * quant::kSuper);
      uint8_t* const rec = base + off[s];
      uint8_t* p = rec + 4 * nb;  // the block offsets, then the blocks
      uint8_t* masks = nullptr;
      each_group(s, [&](int64_t b, int64_t i, const uint16_t* d, const uint64_t* mask, const uint8_t* e) {
        if (i == 0) {
          const uint32_t o = (uint32_t)(p - rec);
          std::memcpy(rec + 4 * b, &o, 4);
          std::memcpy(p, d, 16 * ns);
          masks = p + 16 * ns;
          p = masks + 32 * ns;
        }
        std::memcpy(masks + 32 * i, mask, 32);
        for (int w = 0; w < 4; w++) {
          int k = 0;
          for (int c = 64 * w; c < 64 * w + 64; c++) {
            if (!(mask[w] >> (c % 64) & 1)) continue;
            if (type == WeightType::SQ8) p[k] = e[c];
            else p[k] |= (uint8_t)(e[c] << (4 * (w % 2)));
            k++;
          }
          p += window_advance(type, mask, w);
        }
      });
    }
  });
  return m;
}

void check_type(WeightType type) {
  if (!is_sparse_quant(type)) throw std::invalid_argument("not a sparse quantized weight type");
}

}  // namespace

PackedMatrix quant_pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par,
                        const KernelTable* by) {
  check_type(type);
  return sparsify(quant::grouped_pack(src, rows, cols, dense_type(type), par, by), type, par, by);
}

PackedMatrix quant_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par,
                            const KernelTable* by) {
  check_type(type);
  return sparsify(quant::grouped_pack_raw(dense_type(type), raw, rows, cols, par, by), type, par, by);
}

size_t dense_bytes(const PackedMatrix& w, DenseLayout layout, int64_t s0, int64_t s1) {
  const WeightType dt = dense_type(w.type);
  const int64_t nb = quant::nblocks(w), groups = quant::ngroups(w.rows);
  const int64_t r0 = s0 * kQuantSuperRows, r1 = std::min(w.rows, s1 * kQuantSuperRows);
  if (layout == DenseLayout::GgmlRows) return (size_t)(r1 - r0) * nb * quant::ggml_block_bytes(dt);
  size_t n = 0;
  for (int64_t s = s0; s < s1; s++)
    n += quant::super_bytes(dt, nb, std::min<int64_t>(quant::kSuper, groups - s * quant::kSuper));
  return n;
}

void expand_supers(const PackedMatrix& w, DenseLayout layout, int64_t s0, int64_t s1, uint8_t* dst) {
  const WeightType dt = dense_type(w.type);
  const int64_t nb = quant::nblocks(w), groups = quant::ngroups(w.rows), r0 = s0 * kQuantSuperRows;
  const size_t bb = quant::ggml_block_bytes(dt);
  for (int64_t s = s0; s < s1; s++) {
    const int64_t ns = std::min<int64_t>(quant::kSuper, groups - s * quant::kSuper);
    const int64_t rb = quant::row_bytes(dt, ns);
    walk_record(w.type, quant_record(w, s), nb, ns, [&](int64_t b, int64_t i, const uint16_t* d, const uint64_t* mask,
                                                        const uint8_t* codes) {
      uint8_t e[kPositions];
      expand_codes(w.type, mask, codes, e);
      if (layout == DenseLayout::Grouped) {
        uint8_t* row = dst + b * rb;
        put_dense_codes(dt, e, row + i * quant::qs_bytes(dt));
        std::memcpy(row + ns * quant::qs_bytes(dt) + 16 * i, d + 8 * i, 16);
        return;
      }
      for (int j = 0; j < quant::kGroup; j++) {  // ggml blocks of row r: d, then the quants
        const int64_t r = (s * quant::kSuper + i) * quant::kGroup + j;
        if (r >= w.rows) break;
        uint8_t* blk = dst + ((r - r0) * nb + b) * bb;
        std::memcpy(blk, d + 8 * i + j, 2);
        for (int k = 0; k < kBlock; k++) {
          const uint8_t c = e[32 * (k / 4) + 4 * j + k % 4];
          if (dt == WeightType::Q8) blk[2 + k] = (uint8_t)(c ^ 0x80);  // int8 q
          else if (k < 16) blk[2 + k] = c;
          else blk[2 + k - 16] |= (uint8_t)(c << 4);
        }
      }
    });
    if (layout == DenseLayout::Grouped) dst += quant::super_bytes(dt, nb, ns);
  }
}

PackedMatrix dense_view(const PackedMatrix& w, DenseLayout layout, int64_t s0, int64_t s1, uint8_t* dst) {
  PackedMatrix v;
  v.type = dense_type(w.type);
  v.rows = std::min(w.rows, s1 * kQuantSuperRows) - s0 * kQuantSuperRows;
  v.cols = w.cols;
  v.ld = w.ld;
  v.nbytes = dense_bytes(w, layout, s0, s1);
  v.packed_by = w.packed_by;
  v.storage = std::shared_ptr<void>(std::shared_ptr<void>(), dst);  // not owned
  return v;
}

PackedMatrix as_dense_type(const PackedMatrix& w) {
  PackedMatrix v = w;
  v.type = dense_type(w.type);
  return v;
}

void quant_matmul_panels(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                         int64_t n0, int64_t n1, DenseLayout layout, DenseMatmulQuant dense, ExpandSupers expand) {
  n1 = std::min(n1, w.rows);
  if (n0 >= n1) return;
  // Super-groups per panel: the dense bytes of about 128 KiB for one row (read back from L2 once),
  // 2 MiB for more (each dense call sets up its activations anew).
  const size_t per_super = dense_bytes(w, layout, 0, 1), target = m == 1 ? (128 << 10) : (2 << 20);
  const int64_t step = std::max<int64_t>(1, (int64_t)(target / std::max<size_t>(1, per_super)));
  thread_local std::vector<uint8_t, AlignedAlloc<uint8_t>> buf;
  for (int64_t s0 = n0 / kQuantSuperRows; s0 * kQuantSuperRows < n1; s0 += step) {
    const int64_t s1 = std::min((n1 + kQuantSuperRows - 1) / kQuantSuperRows, s0 + step);
    const size_t need = dense_bytes(w, layout, s0, s1) + 64;
    if (buf.size() < need) buf.resize(need);
    if (expand && layout == DenseLayout::Grouped) expand(w, s0, s1, buf.data());
    else expand_supers(w, layout, s0, s1, buf.data());
    const PackedMatrix v = dense_view(w, layout, s0, s1, buf.data());
    const int64_t r0 = s0 * kQuantSuperRows;
    dense(qa, m, act, v, y + r0, ldy, std::max(n0, r0) - r0, std::min(n1, r0 + v.rows) - r0);
  }
}

void quant_row_to_f32(const PackedMatrix& w, int64_t row, float* out) {
  const int64_t s = row / kQuantSuperRows;
  thread_local std::vector<uint8_t, AlignedAlloc<uint8_t>> buf;
  buf.resize(dense_bytes(w, DenseLayout::Grouped, s, s + 1));
  expand_supers(w, DenseLayout::Grouped, s, s + 1, buf.data());
  quant::grouped_row_to_f32(dense_view(w, DenseLayout::Grouped, s, s + 1, buf.data()), row % kQuantSuperRows, out);
}

int64_t count_quant_nonzeros(const PackedMatrix& w) {
  int64_t n = 0;
  const int64_t nb = quant::nblocks(w), groups = quant::ngroups(w.rows);
  for (int64_t s = 0; s < nsupers(w.rows); s++)
    walk_record(w.type, quant_record(w, s), nb, std::min<int64_t>(quant::kSuper, groups - s * quant::kSuper),
                [&](int64_t, int64_t, const uint16_t*, const uint64_t* mask, const uint8_t*) {
                  for (int t = 0; t < 4; t++) n += __builtin_popcountll(mask[t]);
                });
  return n;
}

}  // namespace sparse
}  // namespace corelm
