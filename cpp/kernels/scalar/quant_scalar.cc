// Reference kernels for the block-quantized formats. Layout: row-major ggml blocks, i.e. row r holds
// ceil(cols/32) blocks of block_q8_0 {fp16 d; int8 qs[32]}, block_q4_0 {fp16 d; u8 qs[16]} or
// block_q4_1 {fp16 d; fp16 m; u8 qs[16]} (element j in the low nibble of qs[j], j+16 in the high
// one), so a GGUF tensor is already in this layout. ld = padded columns.
#include <vector>

#include "kernels/ggml_formats.h"
#include "kernels/sparse_quant.h"

namespace corelm {
namespace quant {
namespace {

void encode_block(WeightType t, const int8_t* q, uint16_t d16, uint16_t m16, uint8_t* blk) {
  std::memcpy(blk, &d16, 2);
  if (t == WeightType::Q8) {
    std::memcpy(blk + 2, q, 32);
    return;
  }
  uint8_t* qs = blk + 2;
  if (t == WeightType::Q4M) {
    std::memcpy(blk + 2, &m16, 2);
    qs += 2;
  }
  for (int j = 0; j < 16; j++) qs[j] = (uint8_t)((q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4));
}

PackedMatrix empty_matrix(WeightType t, int64_t rows, int64_t cols) {
  return new_matrix(t, rows, cols, &kScalarKernels,
                    [&](int64_t ld) { return (size_t)rows * (ld / kBlock) * ggml_block_bytes(t); });
}

const uint8_t* block_at(const PackedMatrix& w, int64_t row, int64_t b) {
  const int64_t nb = w.ld / kBlock;
  return static_cast<const uint8_t*>(w.data()) + ((size_t)row * nb + b) * ggml_block_bytes(w.type);
}

}  // namespace

PackedMatrix scalar_pack(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par) {
  if (sparse::is_sparse_quant(type)) return sparse::quant_pack(src, rows, cols, type, par, &kScalarKernels);
  require_packable(type);
  PackedMatrix m = empty_matrix(type, rows, cols);
  const size_t bb = ggml_block_bytes(type);
  uint8_t* dst = static_cast<uint8_t*>(m.storage.get());
  auto fill = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
      quantize_row(type, src + r * cols, cols, [&](int64_t b, const int8_t* q, uint16_t d16, uint16_t m16) {
        encode_block(type, q, d16, m16, dst + ((size_t)r * (m.ld / kBlock) + b) * bb);
      });
  };
  if (par)
    (*par)(rows, fill);
  else
    fill(0, rows);
  return m;
}

PackedMatrix scalar_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par) {
  if (sparse::is_sparse(type)) return sparse::pack_raw(type, raw, rows, cols, par, &kScalarKernels);
  if (sparse::is_sparse_quant(type)) return sparse::quant_pack_raw(type, raw, rows, cols, par, &kScalarKernels);
  if (is_ggml_block(type)) return ggml_pack_raw(type, raw, rows, cols, &kScalarKernels);
  check_raw(type, (size_t)rows * (cols / kBlock) * ggml_block_bytes(type), rows, cols);
  PackedMatrix m = empty_matrix(type, rows, cols);
  std::memcpy(m.storage.get(), raw, m.nbytes);
  return m;
}

void scalar_row_to_f32(const PackedMatrix& w, int64_t row, float* out) {
  if (sparse::is_sparse_quant(w.type)) return sparse::quant_row_to_f32(w, row, out);
  if (is_ggml_block(w.type)) return ggml_row_to_f32(w, row, out);
  int8_t q[32];
  for (int64_t b = 0; b * kBlock < w.cols; b++) {
    uint16_t d16 = 0, m16 = 0;
    decode_ggml_block(w.type, block_at(w, row, b), q, &d16, &m16);
    const float d = f16_to_f32(d16), mn = f16_to_f32(m16);
    for (int64_t j = 0; j < kBlock && b * kBlock + j < w.cols; j++) out[b * kBlock + j] = dequant_value(w.type, q[j], d, mn);
  }
}

// Quantized activations: xq [m][ld] (int8 or int16 by act), then dx float [m][nb] and sxq int32 [m][nb].
size_t scalar_quant_act_bytes(const PackedMatrix& w, int64_t m, ActType act) {
  if (sparse::is_sparse_quant(w.type)) return scalar_quant_act_bytes(sparse::as_dense_type(w), m, act);
  if (is_ggml_block(w.type)) return ggml_act_bytes(w, m, act);
  return is_quant(w.type) && m >= 1 ? (size_t)m * (w.ld * act_elem_bytes(act) + 8 * (w.ld / kBlock)) : 0;
}

namespace {
struct ActRows {
  void* xq;
  float* dx;
  int32_t* sxq;
};
ActRows act_rows(void* qa, int64_t m, ActType act, const PackedMatrix& w) {
  float* dx = reinterpret_cast<float*>(static_cast<uint8_t*>(qa) + m * w.ld * act_elem_bytes(act));
  return {qa, dx, reinterpret_cast<int32_t*>(dx + m * (w.ld / kBlock))};
}

template <class Q>
void quantize_rows(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, const ActRows& a) {
  const int64_t nb = w.ld / kBlock;
  for (int64_t i = 0; i < m; i++)
    quantize_activations(x + i * ldx, w.cols, static_cast<Q*>(a.xq) + i * w.ld, a.dx + i * nb, a.sxq + i * nb);
}

template <class Q>
void matmul_rows(const ActRows& a, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = w.ld / kBlock;
  int8_t q[32];
  for (int64_t i = 0; i < m; i++) {
    const Q* xq = static_cast<const Q*>(a.xq) + i * w.ld;
    const float* dx = a.dx + i * nb;
    const int32_t* sxq = a.sxq + i * nb;
    for (int64_t n = n0; n < n1; n++) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; b++) {
        uint16_t d16 = 0, m16 = 0;
        decode_ggml_block(w.type, block_at(w, n, b), q, &d16, &m16);
        int32_t s = 0;
        for (int j = 0; j < 32; j++) s += (int32_t)(w.type == WeightType::Q4 ? q[j] - 8 : q[j]) * xq[b * kBlock + j];
        acc += f16_to_f32(d16) * dx[b] * (float)s;
        if (w.type == WeightType::Q4M) acc += f16_to_f32(m16) * dx[b] * (float)sxq[b];
      }
      y[i * ldy + n] = acc;
    }
  }
}
}  // namespace

void scalar_quantize_act(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act, void* qa) {
  if (sparse::is_sparse_quant(w.type)) return scalar_quantize_act(x, m, ldx, sparse::as_dense_type(w), act, qa);
  if (is_ggml_block(w.type)) return ggml_quantize_act(x, m, ldx, w, act, qa);
  const ActRows a = act_rows(qa, m, act, w);
  if (act == ActType::I16) return quantize_rows<int16_t>(x, m, ldx, w, a);
  quantize_rows<int8_t>(x, m, ldx, w, a);
}

void scalar_matmul_quant(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                         int64_t n0, int64_t n1) {
  // sparse Q8/Q4: super-groups expanded into ggml rows, multiplied as the dense rows are
  if (sparse::is_sparse_quant(w.type))
    return sparse::quant_matmul_panels(qa, m, act, w, y, ldy, n0, n1, sparse::DenseLayout::GgmlRows,
                                       scalar_matmul_quant, nullptr);
  if (is_ggml_block(w.type)) return ggml_matmul_quant_scalar(qa, m, act, w, y, ldy, n0, n1);
  const ActRows a = act_rows(const_cast<void*>(qa), m, act, w);
  if (n1 > w.rows) n1 = w.rows;
  if (act == ActType::I16) return matmul_rows<int16_t>(a, m, w, y, ldy, n0, n1);
  matmul_rows<int8_t>(a, m, w, y, ldy, n0, n1);
}

void scalar_matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy,
                   int64_t n0, int64_t n1) {
  std::vector<uint8_t> qa(scalar_quant_act_bytes(w, m, ActType::I8));
  scalar_quantize_act(x, m, ldx, w, ActType::I8, qa.data());
  scalar_matmul_quant(qa.data(), m, ActType::I8, w, y, ldy, n0, n1);
}

}  // namespace quant
}  // namespace corelm
