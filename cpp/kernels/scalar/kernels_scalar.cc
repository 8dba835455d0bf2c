// The reference kernels: plain loops, the definition every other ISA is tested against.
#include <cmath>
#include <cstring>

#include "kernels/kernels.h"
#include "kernels/quant_formats.h"

namespace corelm {
namespace {

// Layout: plain row-major, ld = cols.
PackedMatrix pack(const float* src, int64_t rows, int64_t cols, WeightType type) {
  if (quant::is_quant(type)) return quant::scalar_pack(src, rows, cols, type);
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

inline float weight_at(const PackedMatrix& w, int64_t row, int64_t col) {
  size_t i = (size_t)row * w.ld + col;
  if (w.type == WeightType::BF16) return bf16_to_f32(static_cast<const uint16_t*>(w.data())[i]);
  return static_cast<const float*>(w.data())[i];
}

void matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy,
            int64_t n0, int64_t n1) {
  if (quant::is_quant(w.type)) return quant::scalar_matmul(x, m, ldx, w, y, ldy, n0, n1);
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

float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
  return acc;
}

void axpy(float* y, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

float dot_bf16(const float* a, const uint16_t* b, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; i++) acc += a[i] * bf16_to_f32(b[i]);
  return acc;
}

float dot_i8(const float* a, const int8_t* b, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; i++) acc += a[i] * (float)b[i];
  return acc;
}

void axpy_bf16(float* y, float a, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] += a * bf16_to_f32(x[i]);
}

void axpy_i8(float* y, float a, const int8_t* x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] += a * (float)x[i];
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
  if (quant::is_quant(w.type)) return quant::scalar_row_to_f32(w, row, out);
  for (int64_t k = 0; k < w.cols; k++) out[k] = weight_at(w, row, k);
}

}  // namespace

const KernelTable kScalarKernels = {"scalar", pack, matmul, rmsnorm, silu_mul, dot, axpy, dot_bf16, dot_i8,
                                    axpy_bf16, axpy_i8, softmax, row_to_f32, quant::scalar_pack_raw};

}  // namespace corelm
