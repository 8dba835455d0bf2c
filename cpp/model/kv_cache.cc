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
  const size_t rows = (size_t)n_layers * n_blocks * n_kv_heads * block_size;
  k_ = aligned_buffer(rows * head_dim * esz_);
  v_ = aligned_buffer(rows * head_dim * esz_);
  if (type == KVType::I8) {
    k_scale_ = aligned_buffer(rows * sizeof(float));
    v_scale_ = aligned_buffer(rows * sizeof(float));
  }
}

size_t KVCache::bytes() const {
  const size_t rows = (size_t)n_layers_ * n_blocks_ * n_kv_heads_ * block_size_;
  return rows * (2 * head_dim_ * esz_ + (type_ == KVType::I8 ? 2 * sizeof(float) : 0));
}

// Symmetric int8 with one scale for the row: scale = absmax / 127.
static float quantize_row_i8(const float* x, int64_t n, int8_t* q) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; i++) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.f, inv = scale > 0 ? 1.f / scale : 0.f;
  for (int64_t i = 0; i < n; i++) q[i] = (int8_t)std::lrintf(x[i] * inv);
  return scale;
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
    case KVType::I8:
      static_cast<float*>((value ? v_scale_ : k_scale_).get())[row] =
          quantize_row_i8(x, head_dim_, reinterpret_cast<int8_t*>(dst));
      break;
  }
}

void KVCache::attend(const KernelTable& kt, int64_t layer, int64_t kv_head, const int32_t* blocks, int64_t start,
                     int64_t end, const float* q, float scale, float* scores, float* out) const {
  const int64_t n = end - start + 1, hd = head_dim_;
  const char* kb = static_cast<const char*>(k_.get());
  const char* vb = static_cast<const char*>(v_.get());
  const float* ks = static_cast<const float*>(k_scale_.get());
  const float* vs = static_cast<const float*>(v_scale_.get());
  auto row_of = [&](int64_t j) { return index(layer, blocks[j / block_size_], kv_head, j % block_size_); };
  for (int64_t i = 0; i < n; i++) {
    const size_t row = row_of(start + i);
    const void* kp = kb + row * hd * esz_;
    float s = type_ == KVType::F32    ? kt.dot(q, static_cast<const float*>(kp), hd)
              : type_ == KVType::BF16 ? kt.dot_bf16(q, static_cast<const uint16_t*>(kp), hd)
                                      : kt.dot_i8(q, static_cast<const int8_t*>(kp), hd) * ks[row];
    scores[i] = s * scale;
  }
  kt.softmax(scores, n);
  std::memset(out, 0, hd * sizeof(float));
  for (int64_t i = 0; i < n; i++) {
    const size_t row = row_of(start + i);
    const void* vp = vb + row * hd * esz_;
    if (type_ == KVType::F32)
      kt.axpy(out, scores[i], static_cast<const float*>(vp), hd);
    else if (type_ == KVType::BF16)
      kt.axpy_bf16(out, scores[i], static_cast<const uint16_t*>(vp), hd);
    else
      kt.axpy_i8(out, scores[i] * vs[row], static_cast<const int8_t*>(vp), hd);
  }
}

}  // namespace corelm
