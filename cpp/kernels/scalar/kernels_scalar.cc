// The reference kernels: plain loops, the definition every other ISA is tested against.
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/ggml_formats.h"
#include "kernels/sparse_layout.h"

namespace corelm {
namespace {

// Layout: plain row-major, ld = cols.
PackedMatrix pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par) {
  if (sparse::is_sparse(type)) return sparse::pack(src, rows, cols, type, par, &kScalarKernels);
  if (quant::is_raw_type(type)) return quant::scalar_pack(src, rows, cols, type, par);
  PackedMatrix m;
  m.type = type;
  m.rows = rows;
  m.cols = cols;
  m.ld = cols;
  m.nbytes = (size_t)rows * cols * (type == WeightType::BF16 ? 2 : 4);
  m.packed_by = &kScalarKernels;
  m.storage = aligned_buffer(m.nbytes);
  if (type == WeightType::F32) {
    std::memcpy(m.storage.get(), src, m.nbytes);
  } else {
    uint16_t* dst = static_cast<uint16_t*>(m.storage.get());
    for (int64_t i = 0; i < rows * cols; i++) dst[i] = f32_to_bf16(src[i]);
  }
  return m;
}

PackedMatrix pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par) {
  if (type != WeightType::BF16) return quant::scalar_pack_raw(type, raw, rows, cols, par);
  PackedMatrix m;  // bf16 rows are the layout
  m.type = type;
  m.rows = rows;
  m.cols = cols;
  m.ld = cols;
  m.nbytes = (size_t)rows * cols * 2;
  m.packed_by = &kScalarKernels;
  m.storage = aligned_buffer(m.nbytes);
  std::memcpy(m.storage.get(), raw, m.nbytes);
  return m;
}

inline float weight_at(const PackedMatrix& w, int64_t row, int64_t col) {
  size_t i = (size_t)row * w.ld + col;
  if (w.type == WeightType::BF16) return bf16_to_f32(static_cast<const uint16_t*>(w.data())[i]);
  return static_cast<const float*>(w.data())[i];
}

// Sparse weights: each row expanded, then summed in column order as a dense row is.
void sparse_matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0,
                   int64_t n1) {
  std::vector<float> row(w.cols);
  for (int64_t n = n0; n < n1 && n < w.rows; n++) {
    sparse::row_to_f32(w, n, row.data());
    for (int64_t i = 0; i < m; i++) {
      float acc = 0.f;
      for (int64_t k = 0; k < w.cols; k++) acc += x[i * ldx + k] * row[k];
      y[i * ldy + n] = acc;
    }
  }
}

void matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy,
            int64_t n0, int64_t n1) {
  if (sparse::is_sparse(w.type)) return sparse_matmul(x, m, ldx, w, y, ldy, n0, n1);
  if (quant::is_raw_type(w.type)) return quant::scalar_matmul(x, m, ldx, w, y, ldy, n0, n1);
  for (int64_t i = 0; i < m; i++)
    for (int64_t n = n0; n < n1; n++) {
      float acc = 0.f;
      for (int64_t k = 0; k < w.cols; k++) acc += x[i * ldx + k] * weight_at(w, n, k);
      y[i * ldy + n] = acc;
    }
}

void rmsnorm(float* out, const float* x, const float* weight, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
  float scale = 1.f / std::sqrt(ss / (float)n + eps);
  for (int64_t i = 0; i < n; i++) out[i] = weight[i] * (x[i] * scale);
}

void silu_mul(float* out, const float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

void gelu_tanh_mul(float* out, const float* gate, const float* up, int64_t n) {
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  for (int64_t i = 0; i < n; i++) {
    const float x = gate[i];
    out[i] = 0.5f * x * (1.f + std::tanh(c * (x + 0.044715f * x * x * x))) * up[i];
  }
}

void layernorm(float* out, const float* x, const float* weight, const float* bias, int64_t n, float eps) {
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < n; i++) sum += x[i];
  const double mean = sum / (double)n;
  for (int64_t i = 0; i < n; i++) sq += (x[i] - mean) * (x[i] - mean);
  const double scale = 1.0 / std::sqrt(sq / (double)n + eps);
  for (int64_t i = 0; i < n; i++) out[i] = (float)((x[i] - mean) * scale) * weight[i] + bias[i];
}

void gelu(float* x, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] = 0.5f * x[i] * (1.f + std::erf(x[i] * 0.70710678118654752f));
}

// One cached element as fp32 (int8: the raw level; the caller applies the row's scale).
inline float kv_at(KVType t, const void* p, int64_t i) {
  switch (t) {
    case KVType::F32: return static_cast<const float*>(p)[i];
    case KVType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case KVType::I8: return (float)static_cast<const int8_t*>(p)[i];
  }
  return 0.f;
}

void kv_scores(KVType t, const float* q, int64_t G, int64_t hd, const void* k, int64_t ldk, int64_t n, float* s,
               int64_t lds) {
  for (int64_t g = 0; g < G; g++)
    for (int64_t j = 0; j < n; j++) {
      float acc = 0.f;
      for (int64_t d = 0; d < hd; d++) acc += q[g * hd + d] * kv_at(t, k, d * ldk + j);
      s[g * lds + j] = acc;
    }
}

void kv_accum(KVType t, const float* p, int64_t ldp, int64_t G, const void* v, int64_t n, int64_t hd, float* out) {
  for (int64_t g = 0; g < G; g++)
    for (int64_t j = 0; j < n; j++)
      for (int64_t d = 0; d < hd; d++) out[g * hd + d] += p[g * ldp + j] * kv_at(t, v, j * hd + d);
}

// Sparse rows: the kept channels in order, each with the index of its value (the reference sums in
// channel order, as kv_scores does, so a dense row with the dropped elements zero gives the same bits).
void kv_scores_sparse(KVType t, const float* q, int64_t G, int64_t hd, const uint32_t* mask, const void* val,
                      int64_t nk, int64_t n, float* s, int64_t lds) {
  const int64_t mw = kv_mask_words(hd);
  for (int64_t g = 0; g < G; g++)
    for (int64_t j = 0; j < n; j++) {
      float acc = 0.f;
      for (int64_t d = 0, r = j * nk; d < hd; d++)
        if (mask[j * mw + d / 32] >> (d % 32) & 1) acc += q[g * hd + d] * kv_at(t, val, r++);
      s[g * lds + j] = acc;
    }
}

void kv_accum_sparse(KVType t, const float* p, int64_t ldp, int64_t G, const uint32_t* mask, const void* val,
                     int64_t nk, int64_t n, int64_t hd, float* out) {
  const int64_t mw = kv_mask_words(hd);
  for (int64_t g = 0; g < G; g++)
    for (int64_t j = 0; j < n; j++)
      for (int64_t d = 0, r = j * nk; d < hd; d++)
        if (mask[j * mw + d / 32] >> (d % 32) & 1) out[g * hd + d] += p[g * ldp + j] * kv_at(t, val, r++);
}

void softmax(float* x, int64_t n) {
  float mx = x[0];
  for (int64_t i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
  float sum = 0.f;
  for (int64_t i = 0; i < n; i++) sum += (x[i] = std::exp(x[i] - mx));
  float inv = 1.f / sum;
  for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

void row_to_f32(const PackedMatrix& w, int64_t row, float* out) {
  if (sparse::is_sparse(w.type)) return sparse::row_to_f32(w, row, out);
  if (quant::is_raw_type(w.type)) return quant::scalar_row_to_f32(w, row, out);
  for (int64_t k = 0; k < w.cols; k++) out[k] = weight_at(w, row, k);
}

}  // namespace

const KernelTable kScalarKernels = {"scalar", /*row_grain: as the other tables*/ 32, pack, matmul, rmsnorm, silu_mul, gelu_tanh_mul, layernorm, gelu, kv_scores,
                                    kv_accum, kv_scores_sparse, kv_accum_sparse, softmax, row_to_f32, pack_raw,
                                    quant::scalar_quant_act_bytes, quant::scalar_quantize_act,
                                    quant::scalar_matmul_quant};

}  // namespace corelm
