// The GGUF-block types' shared pieces (ggml_formats.h): the stored matrix, its rows as fp32, the
// activation quantizer every table uses for them, and the scalar reference matmul.
#include <cstring>

#include "kernels/ggml_formats.h"

namespace corelm {
namespace quant {

PackedMatrix ggml_pack_raw(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const KernelTable* by) {
  const size_t nbytes = (size_t)rows * ggml_row_bytes(type, cols);
  check_raw(type, nbytes, rows, cols);
  PackedMatrix m;
  m.type = type;
  m.rows = rows;
  m.cols = cols;
  m.ld = cols;
  m.nbytes = nbytes;
  m.packed_by = by;
  m.storage = aligned_buffer(nbytes);
  std::memcpy(m.storage.get(), raw, nbytes);
  return m;
}

void ggml_row_to_f32(const PackedMatrix& w, int64_t row, float* out) {
  dequantize_ggml_row(w.type, static_cast<const uint8_t*>(w.data()) + row * ggml_row_bytes(w.type, w.cols), w.cols, out);
}

namespace {
struct ActView {
  void* q;
  float* dx;
  int32_t *sx, *sx32;
};
ActView act_view(void* qa, int64_t m, ActType act, int64_t ld) {
  float* dx = reinterpret_cast<float*>(static_cast<uint8_t*>(qa) + m * ld * act_elem_bytes(act));
  int32_t* sx = reinterpret_cast<int32_t*>(dx + m * (ld / 32));
  return {qa, dx, sx, sx + m * (ld / 16)};
}

template <class Q, int kMaxQ = sizeof(Q) == 1 ? 127 : 32767>
void quantize_rows(const float* x, int64_t m, int64_t ldx, int64_t cols, const ActView& a) {
  const int64_t nb = cols / 32;
  for (int64_t i = 0; i < m; i++) {
    Q* q = static_cast<Q*>(a.q) + i * cols;
    quantize_activations<Q, kMaxQ>(x + i * ldx, cols, q, a.dx + i * nb, a.sx32 + i * nb);
    for (int64_t h = 0; h < 2 * nb; h++) {
      int32_t s = 0;
      for (int k = 0; k < 16; k++) s += q[16 * h + k];
      a.sx[i * 2 * nb + h] = s;
    }
  }
}

template <class Q>
void matmul_rows(const ActView& a, int64_t m, const PackedMatrix& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = w.cols / 32, be = ggml_block_elems(w.type);
  const size_t bb = ggml_type_block_bytes(w.type), rb = ggml_row_bytes(w.type, w.cols);
  Chunk ch;
  for (int64_t i = 0; i < m; i++) {
    const Q* xq = static_cast<const Q*>(a.q) + i * w.cols;
    for (int64_t n = n0; n < n1; n++) {
      const uint8_t* row = static_cast<const uint8_t*>(w.data()) + n * rb;
      float acc = 0.f;
      for (int64_t c = 0; c < nb; c++) {
        decode_chunk(w.type, row + (c * 32 / be) * bb, (int)(c % (be / 32)), &ch);
        const float dx = a.dx[i * nb + c];
        for (int h = 0; h < 2; h++) {
          int32_t s = 0;
          for (int k = 16 * h; k < 16 * h + 16; k++) s += (int32_t)ch.v[k] * xq[32 * c + k];
          acc += ch.d * (float)ch.s[h] * dx * (float)s;
          acc -= ch.dm * (float)ch.mn[h] * dx * (float)a.sx[i * 2 * nb + 2 * c + h];
        }
      }
      y[i * ldy + n] = acc;
    }
  }
}
}  // namespace

size_t ggml_act_bytes(const PackedMatrix& w, int64_t m, ActType act) {
  if (!is_ggml_block(w.type) || m < 1) return 0;
  return ((size_t)m * (w.ld * act_elem_bytes(act) + 8 * (w.ld / 32) + 4 * (w.ld / 16)) + 63) / 64 * 64;
}

void ggml_quantize_act(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act, void* qa) {
  const ActView a = act_view(qa, m, act, w.ld);
  if (act == ActType::I16) return quantize_rows<int16_t>(x, m, ldx, w.cols, a);
  quantize_rows<int8_t>(x, m, ldx, w.cols, a);
}

void ggml_quantize_act_wide(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act, void* qa) {
  const ActView a = act_view(qa, m, ActType::I16, w.ld);
  if (act == ActType::I16) return quantize_rows<int16_t>(x, m, ldx, w.cols, a);
  quantize_rows<int16_t, 127>(x, m, ldx, w.cols, a);
}

void ggml_matmul_quant_scalar(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                              int64_t n0, int64_t n1) {
  const ActView a = act_view(const_cast<void*>(qa), m, act, w.ld);
  if (n1 > w.rows) n1 = w.rows;
  if (act == ActType::I16) return matmul_rows<int16_t>(a, m, w, y, ldy, n0, n1);
  matmul_rows<int8_t>(a, m, w, y, ldy, n0, n1);
}

}  // namespace quant
}  // namespace corelm
