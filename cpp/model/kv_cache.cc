#include "model/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace corelm {

const char* kv_type_name(KVType t) { return t == KVType::I8 ? "int8" : t == KVType::BF16 ? "bf16" : "fp32"; }

KVCache::KVCache(int64_t n_layers, int64_t n_kv_heads, int64_t head_dim, int64_t n_blocks, int64_t block_size,
                 KVType type)
    : n_layers_(n_layers), n_kv_heads_(n_kv_heads), head_dim_(head_dim), n_blocks_(n_blocks),
      block_size_(block_size), type_(type), esz_(type == KVType::F32 ? 4 : type == KVType::BF16 ? 2 : 1) {
  if (n_blocks < 1 || block_size < 1) throw std::invalid_argument("the KV cache needs at least one block");
  if (head_dim < 1 || head_dim > kMaxHeadDim) throw std::invalid_argument("the KV cache's head_dim is out of range");
  const size_t rows = (size_t)n_layers * n_blocks * n_kv_heads * block_size;
  k_ = aligned_buffer(rows * head_dim * esz_);
  v_ = aligned_buffer(rows * head_dim * esz_);
  if (type == KVType::I8) {
    k_scale_ = aligned_buffer(rows * sizeof(RowScale));
    v_scale_ = aligned_buffer(rows * sizeof(RowScale));
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
  char* dst = static_cast<char*>((value ? v_ : k_).get()) + row * head_dim_ * esz_;
  switch (type_) {
    case KVType::F32:
      std::memcpy(dst, x, head_dim_ * sizeof(float));
      break;
    case KVType::BF16:
      for (int64_t i = 0; i < head_dim_; i++) reinterpret_cast<uint16_t*>(dst)[i] = f32_to_bf16(x[i]);
      break;
    case KVType::I8: {
      float rotated[kMaxHeadDim];
      std::memcpy(rotated, x, head_dim_ * sizeof(float));
      hadamard(rotated, head_dim_);
      static_cast<RowScale*>((value ? v_scale_ : k_scale_).get())[row] =
          quantize_row_i8(rotated, head_dim_, reinterpret_cast<int8_t*>(dst));
      break;
    }
  }
}

void KVCache::attend(const KernelTable& kt, int64_t layer, int64_t kv_head, const int32_t* blocks, int64_t start,
                     int64_t end, const float* q, float scale, float* scores, float* out) const {
  const int64_t n = end - start + 1, hd = head_dim_;
  const char* kb = static_cast<const char*>(k_.get());
  const char* vb = static_cast<const char*>(v_.get());
  const RowScale* ks = static_cast<const RowScale*>(k_scale_.get());
  const RowScale* vs = static_cast<const RowScale*>(v_scale_.get());
  auto row_of = [&](int64_t j) { return index(layer, blocks[j / block_size_], kv_head, j % block_size_); };
  // int8 rows hold Hk: q . k = (Hq) . (scale * k8 + zero) = scale * ((Hq) . k8) + zero * sum(Hq)
  float q_rot[kMaxHeadDim], q_sum = 0.f;
  if (type_ == KVType::I8) {
    std::memcpy(q_rot, q, hd * sizeof(float));
    hadamard(q_rot, hd);
    for (int64_t i = 0; i < hd; i++) q_sum += q_rot[i];
    q = q_rot;
  }
  for (int64_t i = 0; i < n; i++) {
    const size_t row = row_of(start + i);
    const void* kp = kb + row * hd * esz_;
    float s = type_ == KVType::F32    ? kt.dot(q, static_cast<const float*>(kp), hd)
              : type_ == KVType::BF16 ? kt.dot_bf16(q, static_cast<const uint16_t*>(kp), hd)
                                      : kt.dot_i8(q, static_cast<const int8_t*>(kp), hd) * ks[row].scale() +
                                            ks[row].zero() * q_sum;
    scores[i] = s * scale;
  }
  kt.softmax(scores, n);
  std::memset(out, 0, hd * sizeof(float));
  float zero_sum = 0.f;  // int8 rows: sum_j p_j * zero_j, added to every output element at the end
  for (int64_t i = 0; i < n; i++) {
    const size_t row = row_of(start + i);
    const void* vp = vb + row * hd * esz_;
    if (type_ == KVType::F32)
      kt.axpy(out, scores[i], static_cast<const float*>(vp), hd);
    else if (type_ == KVType::BF16)
      kt.axpy_bf16(out, scores[i], static_cast<const uint16_t*>(vp), hd);
    else {
      kt.axpy_i8(out, scores[i] * vs[row].scale(), static_cast<const int8_t*>(vp), hd);
      zero_sum += scores[i] * vs[row].zero();
    }
  }
  if (type_ == KVType::I8) {  // out holds sum_j p_j Hv_j: rotate it back
    for (int64_t i = 0; i < hd; i++) out[i] += zero_sum;
    hadamard(out, hd);
  }
}

}  // namespace corelm
