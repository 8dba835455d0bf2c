#include "model/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace corelm {

KVCache::KVCache(int64_t n_layers, int64_t n_kv_heads, int64_t head_dim, int64_t n_blocks, int64_t block_size,
                 KVType type)
    : n_layers_(n_layers), n_kv_heads_(n_kv_heads), head_dim_(head_dim), n_blocks_(n_blocks),
      block_size_(block_size), type_(type), esz_(type == KVType::F32 ? 4 : type == KVType::BF16 ? 2 : 1) {
  if (n_blocks < 1 || block_size < 1) throw std::invalid_argument("the KV cache needs at least one block");
  if (head_dim < 1 || head_dim > kMaxHeadDim) throw std::invalid_argument("the KV cache's head_dim is out of range");
  const size_t rows = (size_t)n_layers * n_blocks * n_kv_heads * block_size;
  // 4 KiB pages: a sequence's first token writes into every layer's and kv head's region, and with
  // 2 MiB pages that alone would make 2 MiB per region resident (192 MiB for Qwen2.5-0.5B's 24 layers).
  k_ = aligned_buffer(rows * head_dim * esz_, /*huge_pages=*/false);
  v_ = aligned_buffer(rows * head_dim * esz_, /*huge_pages=*/false);
  if (type == KVType::I8) {
    k_scale_ = aligned_buffer(rows * sizeof(RowScale), false);
    v_scale_ = aligned_buffer(rows * sizeof(RowScale), false);
  }
}

size_t KVCache::bytes() const {
  const size_t rows = (size_t)n_layers_ * n_blocks_ * n_kv_heads_ * block_size_;
  return rows * (2 * head_dim_ * esz_ + (type_ == KVType::I8 ? 2 * sizeof(RowScale) : 0));
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

void KVCache::store(int64_t layer, int64_t block, int64_t slot, int64_t kv_head, bool value, const float* x) {
  const size_t row = index(layer, block, kv_head, slot);
  // values are rows; keys are transposed within their block (channel d of slot s at d * block_size + s)
  const size_t first = value ? row * head_dim_ : index(layer, block, kv_head, 0) * head_dim_ + slot;
  const size_t stride = value ? 1 : block_size_;
  char* base = static_cast<char*>((value ? v_ : k_).get());
  switch (type_) {
    case KVType::F32:
      for (int64_t i = 0; i < head_dim_; i++) reinterpret_cast<float*>(base)[first + i * stride] = x[i];
      break;
    case KVType::BF16:
      for (int64_t i = 0; i < head_dim_; i++) reinterpret_cast<uint16_t*>(base)[first + i * stride] = f32_to_bf16(x[i]);
      break;
    case KVType::I8: {
      float rotated[kMaxHeadDim];
      int8_t q[kMaxHeadDim];
      std::memcpy(rotated, x, head_dim_ * sizeof(float));
      hadamard(rotated, head_dim_);
      static_cast<RowScale*>((value ? v_scale_ : k_scale_).get())[row] = quantize_row_i8(rotated, head_dim_, q);
      for (int64_t i = 0; i < head_dim_; i++) reinterpret_cast<int8_t*>(base)[first + i * stride] = q[i];
      break;
    }
  }
}

// Block by block over [start, end]: scores for all G heads at once, softmax per head, then the
// weighted sum of values for all G heads at once.
void KVCache::attend(const KernelTable& kt, int64_t layer, int64_t kv_head, const int32_t* blocks, int64_t start,
                     int64_t end, const float* q, int64_t G, float scale, float softcap, float* scores,
                     float* out) const {
  const int64_t n = end - start + 1, hd = head_dim_, bs = block_size_;
  const char* kb = static_cast<const char*>(k_.get());
  const char* vb = static_cast<const char*>(v_.get());
  const RowScale* ks = static_cast<const RowScale*>(k_scale_.get());
  const RowScale* vs = static_cast<const RowScale*>(v_scale_.get());
  const bool i8 = type_ == KVType::I8;
  // per thread: the scaled (for int8 also rotated) queries [G][hd], their sums [G], int8 values'
  // probabilities times the row scale [G][bs] and the probability-weighted offsets [G]
  thread_local std::vector<float> work;
  work.resize(G * (hd + bs + 2));
  float *qs = work.data(), *q_sum = qs + G * hd, *p_scaled = q_sum + G, *zero_sum = p_scaled + G * bs;
  // int8 rows hold Hk: q . k = (Hq) . (step * k8 + zero) = step * ((Hq) . k8) + zero * sum(Hq)
  for (int64_t g = 0; g < G; g++) {
    float* qg = qs + g * hd;
    for (int64_t i = 0; i < hd; i++) qg[i] = q[g * hd + i] * scale;
    q_sum[g] = zero_sum[g] = 0.f;
    if (i8) {
      hadamard(qg, hd);
      for (int64_t i = 0; i < hd; i++) q_sum[g] += qg[i];
    }
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
  // A sequence's blocks are scattered, and at batch sizes that matter they come from DRAM: ask for
  // the next block while this one is computed (the prefetchers only catch up inside a block).
  const size_t block_bytes = (size_t)bs * hd * esz_;
  auto prefetch_block = [&](const char* base, int64_t first_row) {
    if (first_row < 0) return;
    const char* p = base + (size_t)first_row * hd * esz_;
    for (size_t off = 0; off < block_bytes; off += 64) __builtin_prefetch(p + off);
  };
  pieces([&](size_t row, int64_t off, int64_t cnt, int64_t next) {
    const size_t block_first = row - row % bs;  // rows of a block are consecutive
    prefetch_block(kb, next);
    prefetch_block(vb, (int64_t)block_first);  // this block's values, read once the scores are done
    const char* kp = kb + (block_first * hd + row % bs) * esz_;
    kt.kv_scores(type_, qs, G, hd, kp, bs, cnt, scores + off, n);
    if (i8)
      for (int64_t i = 0; i < cnt; i++) {  // each row's fp16 step and offset converted once for all heads
        const float step = ks[row + i].scale(), zero = ks[row + i].zero();
        for (int64_t g = 0; g < G; g++) {
          float& s = scores[g * n + off + i];
          s = s * step + zero * q_sum[g];
        }
      }
  });
  if (softcap > 0)  // Gemma 2: scores squashed into (-cap, cap)
    for (int64_t i = 0; i < G * n; i++) scores[i] = softcap * std::tanh(scores[i] / softcap);
  for (int64_t g = 0; g < G; g++) kt.softmax(scores + g * n, n);
  std::memset(out, 0, G * hd * sizeof(float));
  pieces([&](size_t row, int64_t off, int64_t cnt, int64_t) {
    const char* vp = vb + row * hd * esz_;
    if (!i8) return kt.kv_accum(type_, scores + off, n, G, vp, cnt, hd, out);
    for (int64_t i = 0; i < cnt; i++) {
      const float step = vs[row + i].scale(), zero = vs[row + i].zero();
      for (int64_t g = 0; g < G; g++) {
        const float p = scores[g * n + off + i];
        p_scaled[g * bs + i] = p * step;
        zero_sum[g] += p * zero;  // sum_j p_j * zero_j, added to every output element below
      }
    }
    kt.kv_accum(type_, p_scaled, bs, G, vp, cnt, hd, out);
  });
  if (i8)  // out holds sum_j p_j Hv_j: rotate it back
    for (int64_t g = 0; g < G; g++) {
      for (int64_t i = 0; i < hd; i++) out[g * hd + i] += zero_sum[g];
      hadamard(out + g * hd, hd);
    }
}

}  // namespace corelm
