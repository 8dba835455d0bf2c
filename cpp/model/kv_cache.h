// The KV cache in fixed-size blocks (PagedAttention's layout): a sequence's positions map to blocks
// through its block table, so sequences of any length share one pool and identical prefixes can share
// blocks. Keys and values are stored in fp32, bf16 or int8. An int8 row (one token's key or value for one
// kv head) has an fp16 step and an fp16 lower bound: x ~= lo + step * (q + 128), its 256 levels spanning the
// row's [min, max] (asymmetric: a third less error than absmax / 127 on these rows, see docs/architecture.md).
//
// Sparse rows (kv_sparsity s, SparAMX's KV sparsity): every row keeps its n_keep = head_dim - floor(s *
// head_dim) largest-magnitude elements, as a head_dim-bit mask and the kept values in channel order, so
// rows keep one size and blocks stay paged. Sparse int8 rows are not rotated (the rotation spreads a
// row's outliers over all elements, which is what magnitude pruning must not see) and are symmetric,
// x ~= step * q (lo = -128 step): an offset would apply to the kept channels only, which differ by row.
#pragma once
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/quant_formats.h"

namespace corelm {

// How an int8 row maps back to floats: x[i] ~= lo + step * (q[i] + 128) = scale() * q[i] + zero(). Both
// are fp16 (4 bytes a row, so int8 rows take 0.53 of bf16's bytes at head_dim 64); lo is rounded down and
// step up before the row is quantized with them, so their rounding only widens the range a little
// (simulated: +0.2% rms error at head_dim 64 against fp32 parameters; bf16 parameters cost +2%).
// Rows beyond fp16's range (|x| > 65504) saturate.
struct RowScale {
  uint16_t step_f16, lo_f16;
  float scale() const { return quant::f16_to_f32(step_f16); }
  float zero() const { return zero(scale()); }
  float zero(float step) const { return quant::f16_to_f32(lo_f16) + 128.f * step; }  // given scale()
};

// Quantizes n floats to int8 over their [min, max] with round-to-nearest.
RowScale quantize_row_i8(const float* x, int64_t n, int8_t* q);
// Quantizes n floats to int8 symmetrically (step >= absmax / 127, zero() exactly 0).
RowScale quantize_row_i8_symmetric(const float* x, int64_t n, int8_t* q);

class KVCache {
 public:
  static constexpr int64_t kMaxHeadDim = 4096;

  // n_keep: elements kept per sparse row; head_dim (or 0) keeps them all, the dense layout.
  KVCache(int64_t n_layers, int64_t n_kv_heads, int64_t head_dim, int64_t n_blocks, int64_t block_size, KVType type,
          int64_t n_keep = 0);
  // The elements a row keeps at kv_sparsity s (Python computes the same: engine/model_builder.py).
  static int64_t kept(int64_t head_dim, double sparsity) { return head_dim - (int64_t)std::floor(sparsity * head_dim); }

  int64_t n_blocks() const { return n_blocks_; }
  int64_t block_size() const { return block_size_; }
  KVType type() const { return type_; }
  bool sparse() const { return n_keep_ < head_dim_; }
  int64_t n_keep() const { return n_keep_; }
  size_t bytes() const;  // reserved (pages are touched only when used)

  // The storage (keys, values, int8 scales, sparse masks), each [layer][kv_head][...] with an equal
  // stride per (layer, kv_head): what NUMA placement hands to nodes by kv head, so the threads that
  // attend over a kv head read only their own node's memory.
  struct Buffer {
    const char* name;
    const void* base;
    size_t bytes;
  };
  std::vector<Buffer> buffers() const {
    const size_t rows = (size_t)n_layers_ * n_kv_heads_ * n_blocks_ * block_size_;
    std::vector<Buffer> b = {{"kv.k", k_.get(), rows * n_keep_ * esz_}, {"kv.v", v_.get(), rows * n_keep_ * esz_}};
    if (k_scale_)
      b.insert(b.end(), {{"kv.k_scale", k_scale_.get(), rows * sizeof(RowScale)},
                         {"kv.v_scale", v_scale_.get(), rows * sizeof(RowScale)}});
    if (k_mask_)
      b.insert(b.end(), {{"kv.k_mask", k_mask_.get(), rows * mask_words_ * 4},
                         {"kv.v_mask", v_mask_.get(), rows * mask_words_ * 4}});
    return b;
  }

  // One block's contents, all layers and kv heads (keys, values, int8 scales, sparse masks): the disk
  // prefix cache's unit (engine/prefix_store.py). The bytes are each buffer's [layer][kv_head] slices of
  // the block, buffer after buffer, as stored: meaningful only to a cache of the same shape and type.
  size_t block_bytes() const;
  void read_block(int64_t block, uint8_t* out) const;
  void write_block(int64_t block, const uint8_t* in);

  // Stores one token's key (or, with value, its value) for one kv head at (block, slot).
  void store(int64_t layer, int64_t block, int64_t slot, int64_t kv_head, bool value, const float* x);
  // The row stored there as floats (dequantized, rotated back, dropped elements zero): for tests.
  void load(int64_t layer, int64_t block, int64_t slot, int64_t kv_head, bool value, float* x) const;

  // For G query heads that share kv_head (q and out are [G][head_dim]):
  // out[g] = softmax(scale * q[g] . K[j]) . V[j] over positions j in [start, end] of a sequence whose
  // positions live in `blocks` (block table); softcap > 0 first maps each score s to
  // softcap * tanh(s / softcap). `scores` needs G * (end - start + 1) floats.
  void attend(const KernelTable& kt, int64_t layer, int64_t kv_head, const int32_t* blocks, int64_t start,
              int64_t end, const float* q, int64_t G, float scale, float softcap, float* scores, float* out) const;

 private:
  // f(address, bytes) for each contiguous piece of a block, in block_bytes()' order
  template <class F>
  void for_block_pieces(int64_t block, F&& f) const;

  size_t index(int64_t layer, int64_t block, int64_t kv_head, int64_t slot) const {
    return (((size_t)layer * n_kv_heads_ + kv_head) * n_blocks_ + block) * block_size_ + slot;  // token row
  }

  int64_t n_layers_, n_kv_heads_, head_dim_, n_blocks_, block_size_;
  KVType type_;
  int64_t n_keep_, mask_words_;  // n_keep_ == head_dim_: dense
  bool rotated_;                 // int8 rows hold Hx (dense int8 only)
  size_t esz_;
  std::shared_ptr<void> k_, v_;            // k: [layer][kv_head][block][head_dim][slot] (transposed in a block)
                                           // v: [layer][kv_head][block][slot][head_dim]
                                           // sparse, both: [layer][kv_head][block][slot][n_keep] (kept values)
  std::shared_ptr<void> k_scale_, v_scale_;  // [layer][kv_head][block][slot] of RowScale (int8 only)
  std::shared_ptr<void> k_mask_, v_mask_;    // sparse: [layer][kv_head][block][slot][mask_words] bitmaps
};

}  // namespace corelm
