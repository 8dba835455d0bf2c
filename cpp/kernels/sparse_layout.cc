// Packing into, and reading out of, the sparse layout (sparse_layout.h). Built for the baseline ISA.
#include "kernels/tuning.h"
#include "kernels/sparse_layout.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace corelm {
namespace sparse {
namespace {

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
inline bool nonzero(uint16_t h) { return (h & 0x7fffu) != 0; }  // -0 is dropped like +0

inline int64_t round64(int64_t v) { return (v + 63) / 64 * 64; }
inline int64_t header_bytes(int64_t groups) { return round64(8 * (groups + 1)); }

// rows_of(g, buf): group g's 8 rows as bf16, [8][cols] (rows past the matrix zero).
template <class RowsOf>
PackedMatrix build(WeightType type, int64_t rows, int64_t cols, const ParallelFor* par, const KernelTable* by,
                   RowsOf rows_of) {
  if (!is_sparse(type)) throw std::invalid_argument("not a sparse weight type");
  if (rows < 1 || cols < 1) throw std::invalid_argument("a sparse matrix needs at least one row and column");
  const int64_t groups = ngroups(rows), nc = nchunks(cols);
  auto run = [&](const std::function<void(int64_t, int64_t)>& body) {
    if (par && *par) (*par)(groups, body);
    else body(0, groups);
  };
  // Pass 1: each record's size; pass 2: the records. (Reading the rows twice is cheaper than keeping
  // every group's non-zeros between the passes.)
  std::vector<int64_t> size(groups + 1, 0);
  run([&](int64_t g0, int64_t g1) {
    std::vector<uint16_t> buf(kGroup * cols);
    for (int64_t g = g0; g < g1; g++) {
      rows_of(g, buf.data());
      int64_t nnz = 0;
      for (uint16_t h : buf) nnz += nonzero(h);
      size[g] = round64(nc * kGroup * 4 + 2 * nnz);
    }
  });
  std::vector<uint64_t> off(groups + 1);
  off[0] = (uint64_t)header_bytes(groups);
  for (int64_t g = 0; g < groups; g++) off[g + 1] = off[g] + (uint64_t)size[g];
  PackedMatrix m = with_offsets(type, rows, cols, nc * kChunk, off, by);
  uint8_t* base = static_cast<uint8_t*>(m.storage.get());
  run([&](int64_t g0, int64_t g1) {
    std::vector<uint16_t> buf(kGroup * cols);
    for (int64_t g = g0; g < g1; g++) {
      rows_of(g, buf.data());
      uint8_t* p = base + off[g];
      for (int64_t c = 0; c < nc; c++) {
        uint32_t* mask = reinterpret_cast<uint32_t*>(p);
        uint16_t* v = reinterpret_cast<uint16_t*>(p + kGroup * 4);
        for (int64_t j = 0; j < kGroup; j++) {
          uint32_t bits = 0;
          for (int64_t i = 0; i < kChunk && c * kChunk + i < cols; i++) {
            const uint16_t h = buf[j * cols + c * kChunk + i];
            if (nonzero(h)) bits |= 1u << i, *v++ = h;
          }
          mask[j] = bits;
        }
        p = reinterpret_cast<uint8_t*>(v);
      }
    }
  });
  return m;
}

}  // namespace

PackedMatrix with_offsets(WeightType type, int64_t rows, int64_t cols, int64_t ld, const std::vector<uint64_t>& off,
                          const KernelTable* by) {
  PackedMatrix m;
  m.type = type;
  m.rows = rows;
  m.cols = cols;
  m.ld = ld;
  m.nbytes = (size_t)off.back() + kSlack;
  m.packed_by = by;
  m.storage = aligned_buffer(m.nbytes);  // zeroed
  std::memcpy(m.storage.get(), off.data(), off.size() * 8);
  return m;
}

PackedMatrix pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par,
                  const KernelTable* by) {
  return build(type, rows, cols, par, by, [&](int64_t g, uint16_t* buf) {
    for (int64_t j = 0; j < kGroup; j++) {
      const int64_t r = g * kGroup + j;
      for (int64_t k = 0; k < cols; k++) buf[j * cols + k] = r < rows ? to_bf16(src[r * cols + k]) : 0;
    }
  });
}

PackedMatrix pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par,
                      const KernelTable* by) {
  return build(type, rows, cols, par, by, [&](int64_t g, uint16_t* buf) {
    const int64_t r0 = g * kGroup, n = std::min(kGroup, rows - r0);
    std::memcpy(buf, raw + (size_t)r0 * cols * 2, (size_t)n * cols * 2);
    std::memset(buf + n * cols, 0, (size_t)(kGroup - n) * cols * 2);
  });
}

void expand_group(const PackedMatrix& w, int64_t g, uint16_t* dst, int64_t row_stride, int64_t chunk_stride) {
  const int64_t nc = nchunks(w.cols);
  const uint8_t* p = record(w, g);
  for (int64_t c = 0; c < nc; c++) {
    const uint32_t* mask = reinterpret_cast<const uint32_t*>(p);
    const uint16_t* v = reinterpret_cast<const uint16_t*>(p + kGroup * 4);
    for (int64_t j = 0; j < kGroup; j++) {
      uint16_t* d = dst + j * row_stride + c * chunk_stride;
      for (int64_t i = 0; i < kChunk; i++) d[i] = (mask[j] >> i & 1u) ? *v++ : 0;
    }
    p = reinterpret_cast<const uint8_t*>(v);
  }
}

void row_to_f32(const PackedMatrix& w, int64_t row, float* out) {
  const int64_t nc = nchunks(w.cols), j = row % kGroup;
  const uint8_t* p = record(w, row / kGroup);
  for (int64_t c = 0; c < nc; c++) {
    const uint32_t* mask = reinterpret_cast<const uint32_t*>(p);
    const uint16_t* v = reinterpret_cast<const uint16_t*>(p + kGroup * 4);
    for (int64_t i = 0; i < j; i++) v += __builtin_popcount(mask[i]);
    for (int64_t i = 0; i < kChunk && c * kChunk + i < w.cols; i++) {
      uint32_t u = (mask[j] >> i & 1u) ? (uint32_t)*v++ << 16 : 0u;
      std::memcpy(out + c * kChunk + i, &u, 4);
    }
    for (int64_t i = j + 1; i < kGroup; i++) v += __builtin_popcount(mask[i]);
    p = reinterpret_cast<const uint8_t*>(v);
  }
}

#if defined(CORELM_HAVE_X86)
int64_t record_prefetch_bytes() {
  return tuning::sparse_prefetch_bytes(record_prefetch_l2());
}
bool record_prefetch_l2() {
  return tuning::sparse_prefetch_l2(cpu_features().amd);
}
#endif

int64_t count_nonzeros(const PackedMatrix& w) {
  int64_t n = 0;
  const int64_t nc = nchunks(w.cols);
  for (int64_t g = 0; g < ngroups(w.rows); g++) {
    const uint32_t* mask = reinterpret_cast<const uint32_t*>(record(w, g));
    for (int64_t c = 0; c < nc; c++) {
      int64_t chunk = 0;
      for (int64_t j = 0; j < kGroup; j++) chunk += __builtin_popcount(mask[j]);
      n += chunk;
      mask = reinterpret_cast<const uint32_t*>(reinterpret_cast<const uint8_t*>(mask) + kGroup * 4 + 2 * chunk);
    }
  }
  return n;
}

}  // namespace sparse
}  // namespace corelm
