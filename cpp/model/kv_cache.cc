#include "model/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace corelm {

KVCache::KVCache(int64_t n_layers, int64_t n_kv_heads, int64_t head_dim, int64_t n_blocks, int64_t block_size,
                 KVType type, int64_t n_keep)
    : n_layers_(n_layers), n_kv_heads_(n_kv_heads), head_dim_(head_dim), n_blocks_(n_blocks),
      block_size_(block_size), type_(type), n_keep_(n_keep > 0 ? n_keep : head_dim),
      mask_words_(kv_mask_words(head_dim)), esz_(type == KVType::F32 ? 4 : type == KVType::BF16 ? 2 : 1) {
  if (n_blocks < 1 || block_size < 1) throw std::invalid_argument("the KV cache needs at least one block");
  if (head_dim < 1 || head_dim > kMaxHeadDim) throw std::invalid_argument("the KV cache's head_dim is out of range");
  if (n_keep_ > head_dim) throw std::invalid_argument("the KV cache cannot keep more than head_dim elements a row");
  // sparse int8 rows are chosen and stored unrotated: rotated first, Qwen2.5-0.5B's KL from the fp32
  // cache at 2k tokens grew 15x at sparsity 0.3 (docs/quality.md)
  rotated_ = type == KVType::I8 && !sparse();
  const size_t rows = (size_t)n_layers * n_blocks * n_kv_heads * block_size;
  // 4 KiB pages: a sequence's first token writes into every layer's and kv head's region, and with
  // 2 MiB pages that alone would make 2 MiB per region resident (192 MiB for Qwen2.5-0.5B's 24 layers).
  // Sparse values: the kernels' slack after the last row.
  const size_t slack = sparse() ? kKVSparseSlack : 0;
  k_ = aligned_buffer(rows * n_keep_ * esz_ + slack, /*huge_pages=*/false);
  v_ = aligned_buffer(rows * n_keep_ * esz_ + slack, /*huge_pages=*/false);
  if (type == KVType::I8) {
    k_scale_ = aligned_buffer(rows * sizeof(RowScale), false);
    v_scale_ = aligned_buffer(rows * sizeof(RowScale), false);
  }
  if (sparse()) {
    k_mask_ = aligned_buffer(rows * mask_words_ * 4, false);
    v_mask_ = aligned_buffer(rows * mask_words_ * 4, false);
  }
}

size_t KVCache::bytes() const {
  const size_t rows = (size_t)n_layers_ * n_blocks_ * n_kv_heads_ * block_size_;
  const size_t row = n_keep_ * esz_ + (type_ == KVType::I8 ? sizeof(RowScale) : 0) + (sparse() ? mask_words_ * 4 : 0);
  return rows * 2 * row;
}

// A block's rows of one (layer, kv head) are consecutive in every buffer (dense keys transposed inside
// the block, so still the same bytes), so a block is n_layers * n_kv_heads pieces per buffer.
template <class F>
void KVCache::for_block_pieces(int64_t block, F&& f) const {
  if (block < 0 || block >= n_blocks_) throw std::out_of_range("KV block index out of range");
  const std::pair<void*, size_t> bufs[] = {  // (base, bytes per token row)
      {k_.get(), n_keep_ * esz_},       {v_.get(), n_keep_ * esz_},
      {k_scale_.get(), sizeof(RowScale)}, {v_scale_.get(), sizeof(RowScale)},
      {k_mask_.get(), mask_words_ * 4}, {v_mask_.get(), mask_words_ * 4}};
  for (const auto& [base, row_bytes] : bufs) {
    if (!base) continue;  // no scales (not int8) or masks (dense)
    for (int64_t l = 0; l < n_layers_; l++)
      for (int64_t h = 0; h < n_kv_heads_; h++)
        f(static_cast<char*>(base) + index(l, block, h, 0) * row_bytes, block_size_ * row_bytes);
  }
}

size_t KVCache::block_bytes() const { return bytes() / n_blocks_; }

void KVCache::read_block(int64_t block, uint8_t* out) const {
  for_block_pieces(block, [&](const char* p, size_t n) { std::memcpy(out, p, n), out += n; });
}

void KVCache::write_block(int64_t block, const uint8_t* in) {
  for_block_pieces(block, [&](char* p, size_t n) { std::memcpy(p, in, n), in += n; });
}

// In-place orthonormal Walsh-Hadamard transform of x[n] in blocks of the largest power of two dividing n
// (the whole row when n is a power of two). It is its own inverse. int8 rows are stored rotated: the
// rotation spreads a row's outlier channels over all its elements, which narrows [min, max] and so the
// int8 step; dot products are unchanged ((Hq) . (Hk) = q . k) and sum_j p_j H v_j = H sum_j p_j v_j.
static void hadamard(float* x, int64_t n) {
  const int64_t block = n & -n;
  const float norm = 1.f / std::sqrt((float)block);
  for (int64_t b = 0; b < n; b += block) {
    float* y = x + b;
    for (int64_t h = 1; h < block; h *= 2)
      for (int64_t i = 0; i < block; i += 2 * h)
        for (int64_t j = i; j < i + h; j++) {
          const float a = y[j], c = y[j + h];
          y[j] = a + c, y[j + h] = a - c;
        }
    for (int64_t i = 0; i < block; i++) y[i] *= norm;
  }
}

// The largest fp16 <= v, for v clamped to fp16's finite range.
static uint16_t f16_at_most(float v) {
  v = std::fmin(std::fmax(v, -65504.f), 65504.f);
  const uint16_t h = quant::f32_to_f16(v);
  const float f = quant::f16_to_f32(h);
  if (f <= v) return h;
  if (f > 0.f) return (uint16_t)(h - 1);             // positive: one step toward zero
  if (f == 0.f) return 0x8001;                       // the negative fp16 closest to zero
  return (uint16_t)(h + 1);                          // negative: one step away from zero
}

RowScale quantize_row_i8(const float* x, int64_t n, int8_t* q) {
  float lo = x[0], hi = x[0];
  for (int64_t i = 1; i < n; i++) lo = std::fmin(lo, x[i]), hi = std::fmax(hi, x[i]);  // fmin/fmax skip NaN
  if (!std::isfinite(lo) || !std::isfinite(hi)) lo = hi = 0.f;    // inf/NaN rows: no usable range
  RowScale r;
  r.lo_f16 = f16_at_most(lo);
  const float lo16 = quant::f16_to_f32(r.lo_f16);
  r.step_f16 = (uint16_t)(f16_at_most(-((hi - lo16) / 255.f)) ^ 0x8000);  // the smallest fp16 >= step
  const float step = r.scale(), inv = step > 0 ? 1.f / step : 0.f;
  for (int64_t i = 0; i < n; i++) {
    const float u = std::fmin(std::fmax((x[i] - lo16) * inv, 0.f), 255.f);  // also maps NaN to 0
    q[i] = (int8_t)(std::lrintf(u) - 128);
  }
  return r;
}

RowScale quantize_row_i8_symmetric(const float* x, int64_t n, int8_t* q) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; i++) amax = std::fmax(amax, std::fabs(x[i]));  // fmax skips NaN
  // at most 64000: lo = -128 step stays inside fp16's range, so it is exact and zero() is exactly 0
  amax = std::isfinite(amax) ? std::fmin(amax, 64000.f) : 0.f;
  RowScale r;
  r.step_f16 = (uint16_t)(f16_at_most(-(amax / 127.f)) ^ 0x8000);  // the smallest fp16 >= amax / 127
  const float step = quant::f16_to_f32(r.step_f16), inv = step > 0 ? 1.f / step : 0.f;
  r.lo_f16 = quant::f32_to_f16(-128.f * step);
  for (int64_t i = 0; i < n; i++) {
    const float u = std::fmin(std::fmax(x[i] * inv, -127.f), 127.f);
    q[i] = std::isnan(u) ? 0 : (int8_t)std::lrintf(u);
  }
  return r;
}

// The n_keep largest-magnitude elements of x[n] (ties: the lower channel; NaN as the largest) as a
// bitmap, and those elements compacted in channel order into kept.
static void choose_kept(const float* x, int64_t n, int64_t n_keep, uint32_t* mask, float* kept) {
  int32_t idx[KVCache::kMaxHeadDim];
  for (int64_t i = 0; i < n; i++) idx[i] = (int32_t)i;
  auto mag = [&](int32_t i) { return std::isnan(x[i]) ? INFINITY : std::fabs(x[i]); };
  std::nth_element(idx, idx + n_keep - 1, idx + n, [&](int32_t a, int32_t b) {
    const float ma = mag(a), mb = mag(b);
    return ma > mb || (ma == mb && a < b);
  });
  std::memset(mask, 0, kv_mask_words(n) * 4);
  for (int64_t i = 0; i < n_keep; i++) mask[idx[i] / 32] |= 1u << (idx[i] % 32);
  for (int64_t d = 0, r = 0; d < n; d++)
    if (mask[d / 32] >> (d % 32) & 1) kept[r++] = x[d];
}

void KVCache::store(int64_t layer, int64_t block, int64_t slot, int64_t kv_head, bool value, const float* x) {
  const size_t row = index(layer, block, kv_head, slot);
  float r[kMaxHeadDim];
  std::memcpy(r, x, head_dim_ * sizeof(float));
  if (rotated_) hadamard(r, head_dim_);
  int64_t n = head_dim_;  // elements written
  if (sparse()) {
    uint32_t* mask = static_cast<uint32_t*>((value ? v_mask_ : k_mask_).get()) + row * mask_words_;
    choose_kept(r, head_dim_, n_keep_, mask, r);  // compacting in place: kept[r] is never ahead of x[d]
    n = n_keep_;
  }
  // dense values are rows; dense keys are transposed within their block (channel d of slot s at
  // d * block_size + s); sparse rows are rows of n_keep
  const bool transposed = !value && !sparse();
  const size_t first = transposed ? index(layer, block, kv_head, 0) * head_dim_ + slot : row * n;
  const size_t stride = transposed ? block_size_ : 1;
  char* base = static_cast<char*>((value ? v_ : k_).get());
  switch (type_) {
    case KVType::F32:
      for (int64_t i = 0; i < n; i++) reinterpret_cast<float*>(base)[first + i * stride] = r[i];
      break;
    case KVType::BF16:
      for (int64_t i = 0; i < n; i++) reinterpret_cast<uint16_t*>(base)[first + i * stride] = f32_to_bf16(r[i]);
      break;
    case KVType::I8: {
      int8_t q[kMaxHeadDim];
      static_cast<RowScale*>((value ? v_scale_ : k_scale_).get())[row] =
          sparse() ? quantize_row_i8_symmetric(r, n, q) : quantize_row_i8(r, n, q);
      for (int64_t i = 0; i < n; i++) reinterpret_cast<int8_t*>(base)[first + i * stride] = q[i];
      break;
    }
  }
}

void KVCache::load(int64_t layer, int64_t block, int64_t slot, int64_t kv_head, bool value, float* x) const {
  const size_t row = index(layer, block, kv_head, slot);
  const bool transposed = !value && !sparse();
  const size_t first = transposed ? index(layer, block, kv_head, 0) * head_dim_ + slot : row * n_keep_;
  const size_t stride = transposed ? block_size_ : 1;
  const char* base = static_cast<const char*>((value ? v_ : k_).get());
  float r[kMaxHeadDim];
  for (int64_t i = 0; i < n_keep_; i++) {
    const size_t at = first + i * stride;
    switch (type_) {
      case KVType::F32: r[i] = reinterpret_cast<const float*>(base)[at]; break;
      case KVType::BF16: r[i] = bf16_to_f32(reinterpret_cast<const uint16_t*>(base)[at]); break;
      case KVType::I8: {
        const RowScale s = static_cast<const RowScale*>((value ? v_scale_ : k_scale_).get())[row];
        r[i] = s.scale() * reinterpret_cast<const int8_t*>(base)[at] + s.zero();
        break;
      }
    }
  }
  if (!sparse()) {
    std::memcpy(x, r, head_dim_ * sizeof(float));
  } else {
    const uint32_t* mask = static_cast<const uint32_t*>((value ? v_mask_ : k_mask_).get()) + row * mask_words_;
    for (int64_t d = 0, i = 0; d < head_dim_; d++) x[d] = mask[d / 32] >> (d % 32) & 1 ? r[i++] : 0.f;
  }
  if (rotated_) hadamard(x, head_dim_);
}

// Block by block over [start, end]: scores for all G heads at once, softmax per head, then the
// weighted sum of values for all G heads at once.
void KVCache::attend(const KernelTable& kt, int64_t layer, int64_t kv_head, const int32_t* blocks, int64_t start,
                     int64_t end, const float* q, int64_t G, float scale, float softcap, float* scores,
                     float* out) const {
  const int64_t n = end - start + 1, hd = head_dim_, bs = block_size_, nk = n_keep_, mw = mask_words_;
  const char* kb = static_cast<const char*>(k_.get());
  const char* vb = static_cast<const char*>(v_.get());
  const uint32_t* km = static_cast<const uint32_t*>(k_mask_.get());
  const uint32_t* vm = static_cast<const uint32_t*>(v_mask_.get());
  const RowScale* ks = static_cast<const RowScale*>(k_scale_.get());
  const RowScale* vs = static_cast<const RowScale*>(v_scale_.get());
  const bool i8 = type_ == KVType::I8;
  // per thread: the scaled (for rotated int8 also rotated) queries [G][hd], their sums [G], int8 values'
  // probabilities times the row scale [G][bs], the probability-weighted offsets [G], and a piece's int8
  // rows' steps and offsets [bs] each
  thread_local std::vector<float> work;
  work.resize(G * (hd + bs + 2) + 2 * bs);
  float *qs = work.data(), *q_sum = qs + G * hd, *p_scaled = q_sum + G, *zero_sum = p_scaled + G * bs;
  float *step = zero_sum + G, *zero = step + bs;
  auto row_scales = [&](const RowScale* rs, int64_t cnt) {  // once per row for all heads
    for (int64_t i = 0; i < cnt; i++) {
      step[i] = rs[i].scale();
      zero[i] = rs[i].zero(step[i]);
    }
  };
  // int8 rows hold Hk: q . k = (Hq) . (step * k8 + zero) = step * ((Hq) . k8) + zero * sum(Hq)
  // (sparse int8 rows have zero = 0, so the sum over all channels is never used for them)
  for (int64_t g = 0; g < G; g++) {
    float* qg = qs + g * hd;
    for (int64_t i = 0; i < hd; i++) qg[i] = q[g * hd + i] * scale;
    q_sum[g] = zero_sum[g] = 0.f;
    if (rotated_) hadamard(qg, hd);
    if (i8)
      for (int64_t i = 0; i < hd; i++) q_sum[g] += qg[i];
  }
  // walks [start, end] in pieces that stay inside one block: f(first row, token offset, count, next
  // piece's first row or -1)
  auto pieces = [&](auto&& f) {
    for (int64_t j = start; j <= end;) {
      const int64_t slot = j % bs, cnt = std::min(bs - slot, end + 1 - j);
      const int64_t next = j + cnt <= end ? (int64_t)index(layer, blocks[(j + cnt) / bs], kv_head, 0) : -1;
      f(index(layer, blocks[j / bs], kv_head, slot), j - start, cnt, next);
      j += cnt;
    }
  };
  // A sequence's blocks are scattered, and at batch sizes that matter they come from L3 or DRAM: each
  // pass asks for its next block while this one is computed (the prefetchers only catch up inside a
  // block). The values are asked for in their own pass, not during the scores (one layer's 4,096 bf16
  // tokens from L3: 144-149 us a call, against 162-186 with the values fetched beside the keys).
  const size_t row_bytes = (size_t)nk * esz_;
  auto prefetch = [&](const void* base, size_t bytes_per_row, int64_t first_row) {
    if (first_row < 0) return;
    const char* p = static_cast<const char*>(base) + (size_t)first_row * bytes_per_row;
    for (size_t off = 0; off < (size_t)bs * bytes_per_row; off += 64) __builtin_prefetch(p + off);
  };
  auto prefetch_block = [&](bool value, int64_t first_row) {
    prefetch(value ? vb : kb, row_bytes, first_row);
    if (sparse()) prefetch(value ? vm : km, mw * 4, first_row);
  };
  pieces([&](size_t row, int64_t off, int64_t cnt, int64_t next) {
    const size_t block_first = row - row % bs;  // rows of a block are consecutive
    prefetch_block(false, next);
    if (sparse())
      kt.kv_scores_sparse(type_, qs, G, hd, km + row * mw, kb + row * row_bytes, nk, cnt, scores + off, n);
    else
      kt.kv_scores(type_, qs, G, hd, kb + (block_first * hd + row % bs) * esz_, bs, cnt, scores + off, n);
    if (i8) {  // head by head over the piece's rows: contiguous loops, no conversion inside
      row_scales(ks + row, cnt);
      for (int64_t g = 0; g < G; g++) {
        float* s = scores + g * n + off;
        const float qg = q_sum[g];
        for (int64_t i = 0; i < cnt; i++) s[i] = s[i] * step[i] + zero[i] * qg;
      }
    }
  });
  if (softcap > 0)  // Gemma 2: scores squashed into (-cap, cap)
    for (int64_t i = 0; i < G * n; i++) scores[i] = softcap * std::tanh(scores[i] / softcap);
  for (int64_t g = 0; g < G; g++) kt.softmax(scores + g * n, n);
  std::memset(out, 0, G * hd * sizeof(float));
  pieces([&](size_t row, int64_t off, int64_t cnt, int64_t next) {
    prefetch_block(true, next);
    const char* vp = vb + row * row_bytes;
    const float* p = scores + off;
    int64_t ldp = n;
    if (i8) {
      row_scales(vs + row, cnt);
      for (int64_t g = 0; g < G; g++) {
        const float* pg = scores + g * n + off;
        float* ps = p_scaled + g * bs;
        float z = zero_sum[g];
        for (int64_t i = 0; i < cnt; i++) ps[i] = pg[i] * step[i];
        for (int64_t i = 0; i < cnt; i++) z += pg[i] * zero[i];  // sum_j p_j * zero_j, added to every output below
        zero_sum[g] = z;
      }
      p = p_scaled, ldp = bs;
    }
    if (sparse())
      kt.kv_accum_sparse(type_, p, ldp, G, vm + row * mw, vp, nk, cnt, hd, out);
    else
      kt.kv_accum(type_, p, ldp, G, vp, cnt, hd, out);
  });
  if (i8)  // out holds sum_j p_j (Hv_j - zero_j): add the offsets and rotate it back
    for (int64_t g = 0; g < G; g++) {
      for (int64_t i = 0; i < hd; i++) out[g * hd + i] += zero_sum[g];
      if (rotated_) hadamard(out + g * hd, hd);
    }
}

}  // namespace corelm
