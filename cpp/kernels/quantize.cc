// The searched Q4_1 quantizer (quantize.h). Per block: start from candidate (d, m) pairs, round the
// weights to codes, refit d and m to those codes by weighted least squares, round again, and keep the
// pair with the least weighted error, measured with d and m rounded to fp16 as stored. Candidates:
// the block's range, ranges trimmed by 3% or 6% at either end (outliers clipped), and scales stretched
// or shrunk by up to one code step (as llama.cpp's make_qkx2_quants tries).
#include "kernels/quantize.h"

#include <cmath>
#include <cstring>

#include "kernels/quant_formats.h"

namespace corelm {
namespace quant {
namespace {

struct Fit {
  float err;
  uint16_t d16, m16;
  uint8_t q[32];
};

// Codes for (d, m) as stored, their weighted error, and the least-squares (d, m) for those codes.
float round_codes(const float* x, const float* w, uint16_t d16, uint16_t m16, uint8_t* q, float* d_ls, float* m_ls) {
  const float d = f16_to_f32(d16), m = f16_to_f32(m16), id = d > 0.f ? 1.f / d : 0.f;
  float err = 0.f, sw = 0.f, sq = 0.f, sqq = 0.f, sx = 0.f, sqx = 0.f;
  for (int j = 0; j < 32; j++) {
    float t = (x[j] - m) * id;
    t = !(t >= 0.f) ? 0.f : t > 15.f ? 15.f : t;   // NaN -> 0
    const float v = (float)(int)(t + 0.5f), e = v * d + m - x[j];
    q[j] = (uint8_t)v;
    err += w[j] * e * e;
    sw += w[j], sq += w[j] * v, sqq += w[j] * v * v, sx += w[j] * x[j], sqx += w[j] * v * x[j];
  }
  const float den = sw * sqq - sq * sq;
  if (den > 0.f) {
    *d_ls = std::fmax(0.f, (sw * sqx - sq * sx) / den);
    *m_ls = (sx - *d_ls * sq) / sw;
  } else {
    *d_ls = d, *m_ls = m;
  }
  return err;
}

void try_fit(const float* x, const float* w, float d, float m, int refits, Fit* best) {
  Fit f;
  for (int it = 0; it <= refits; it++) {
    f.d16 = f32_to_f16(d), f.m16 = f32_to_f16(m);
    f.err = round_codes(x, w, f.d16, f.m16, f.q, &d, &m);
    if (f.err < best->err) *best = f;
  }
}

// One block: x[32] with error weights w[32] (>= 0, not all 0) -> a ggml Q4_1 block.
void search_block(const float* x, const float* w, uint8_t* blk) {
  float mn = x[0], mx = x[0];
  for (int j = 1; j < 32; j++) mn = std::fmin(mn, x[j]), mx = std::fmax(mx, x[j]);
  const float span = mx - mn;
  Fit best;
  best.err = INFINITY;
  best.d16 = 0, best.m16 = f32_to_f16(mn);
  std::memset(best.q, 0, 32);
  static const float kTrim[] = {0.f, 0.03f, 0.06f};
  for (float lo : kTrim)
    for (float hi : kTrim) try_fit(x, w, (span - (lo + hi) * span) / 15.f, mn + lo * span, 2, &best);
  for (int s = -10; s <= 10; s++)  // (15 + s/10) code steps per range
    if (s) try_fit(x, w, span / (15.f + 0.1f * (float)s), mn, 1, &best);
  std::memcpy(blk, &best.d16, 2);
  std::memcpy(blk + 2, &best.m16, 2);
  for (int j = 0; j < 16; j++) blk[4 + j] = (uint8_t)(best.q[j] | (best.q[j + 16] << 4));
}

}  // namespace

void quantize_q4_1_search(const float* src, const float* imp, int64_t rows, int64_t cols, uint8_t* out) {
  float w[32];
  for (int64_t r = 0; r < rows; r++) {
    const float* x = src + r * cols;
    // llama.cpp's weighting with an importance matrix: imp[k] * sqrt(sigma2 + x^2), sigma2 = twice the
    // row's mean square, so large weights of important columns are kept most precisely.
    double ss = 0.0;
    for (int64_t k = 0; k < cols; k++) ss += (double)x[k] * x[k];
    const float sigma2 = (float)(2.0 * ss / (double)cols);
    for (int64_t b = 0; b < cols / kBlock; b++) {
      const float* xb = x + b * kBlock;
      float sw = 0.f;
      for (int j = 0; j < 32; j++) {
        w[j] = imp ? std::fmax(imp[b * kBlock + j], 0.f) * std::sqrt(sigma2 + xb[j] * xb[j]) : 1.f;
        sw += w[j];
      }
      if (!(sw > 0.f) || !std::isfinite(sw))  // no usable importance here (zeros, inf, NaN): plain error
        for (int j = 0; j < 32; j++) w[j] = 1.f;
      search_block(xb, w, out + (r * (cols / kBlock) + b) * 20);
    }
  }
}

}  // namespace quant
}  // namespace corelm
