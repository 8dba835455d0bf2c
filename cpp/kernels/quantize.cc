// The searched Q4_1 quantizer (quantize.h). Per block: start from candidate (d, m) pairs, round the
// weights to codes, refit d and m to those codes by weighted least squares, round again, and keep the
// pair with the least weighted error, measured with d and m rounded to fp16 as stored. Candidates:
// the block's range, ranges trimmed by 3% or 6% at either end (outliers clipped), and scales stretched
// or shrunk by up to one code step (as llama.cpp's make_qkx2_quants tries).
#include "kernels/quantize.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

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


// ---------------------------------------------------------------------------------------------------
// K-quants (Q4_K, Q5_K, Q6_K) and the 5-bit fallbacks (Q5_0, Q5_1). The search follows llama.cpp's
// quantizers with an importance matrix (ggml-quants.c, make_qkx3_quants / make_qx_quants /
// make_qp_quants): candidate scales around the range's, codes rounded for each, the scale (and minimum)
// refit to those codes by weighted least squares, the least weighted error kept.
namespace {

inline int nearest(float v) { return (int)std::lrintf(v); }  // ties to even, as ggml's nearest_int
inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

// x[n] ~ scale * q + mn, q in 0..nmax, minimising sum w (scale q + mn - x)^2. With min_le_0 (the
// K-quants, whose minimums are stored negated against an unsigned 6-bit code) mn is kept <= 0.
// Candidates stretch the range by -0.9..+0.9 code steps. Returns scale (>= 0), sets *mn and q.
float fit_affine(const float* x, const float* w, int n, int nmax, bool min_le_0, float* mn_out, uint8_t* q) {
  float lo = x[0], hi = x[0], sw = 0.f, swx = 0.f;
  for (int i = 0; i < n; i++) lo = std::fmin(lo, x[i]), hi = std::fmax(hi, x[i]), sw += w[i], swx += w[i] * x[i];
  if (min_le_0) lo = std::fmin(lo, 0.f);
  std::memset(q, 0, n);
  *mn_out = lo;
  if (!(hi > lo)) return 0.f;
  float best_scale = (hi - lo) / nmax, best_min = lo, best_err = 0.f;
  for (int i = 0; i < n; i++) {
    q[i] = (uint8_t)clampi(nearest((x[i] - lo) / best_scale), 0, nmax);
    const float e = best_scale * q[i] + lo - x[i];
    best_err += w[i] * e * e;
  }
  uint8_t t[32];
  for (int step = 0; step <= 36; step++) {
    const float iscale = ((float)nmax - 0.9f + 0.05f * (float)step) / (hi - lo);
    float sl = 0.f, sll = 0.f, slx = 0.f;
    for (int i = 0; i < n; i++) {
      t[i] = (uint8_t)clampi(nearest(iscale * (x[i] - lo)), 0, nmax);
      sl += w[i] * t[i], sll += w[i] * t[i] * t[i], slx += w[i] * t[i] * x[i];
    }
    const float den = sw * sll - sl * sl;
    if (!(den > 0.f)) continue;
    float scale = (sw * slx - swx * sl) / den, mn = (sll * swx - sl * slx) / den;
    if (min_le_0 && mn > 0.f) mn = 0.f, scale = slx / sll;
    if (!(scale >= 0.f)) continue;
    float err = 0.f;
    for (int i = 0; i < n; i++) {
      const float e = scale * t[i] + mn - x[i];
      err += w[i] * e * e;
    }
    if (err < best_err) best_err = err, best_scale = scale, best_min = mn, std::memcpy(q, t, n);
  }
  *mn_out = best_min;
  return best_scale;
}

// x[n] ~ scale * q, q in -nmax..nmax-1 (the extra negative code goes to the largest |x|, so the scale
// may be negative), minimising sum w (scale q - x)^2 over scales (nmax +- 0.9) / max|x|, each refit by
// least squares. Returns scale, sets q (as q + nmax, the stored unsigned code).
float fit_symmetric(const float* x, const float* w, int n, int nmax, uint8_t* q) {
  float m = 0.f;
  for (int i = 0; i < n; i++)
    if (std::fabs(x[i]) > std::fabs(m)) m = x[i];
  for (int i = 0; i < n; i++) q[i] = (uint8_t)nmax;
  if (std::fabs(m) < 1e-15f) return 0.f;
  float best_scale = 0.f, best_score = 0.f;  // score = slx^2 / sll: the error it removes
  for (int s = -9; s <= 9; s++) {
    const float iscale = -((float)nmax + 0.1f * (float)s) / m;
    float slx = 0.f, sll = 0.f;
    for (int i = 0; i < n; i++) {
      const int l = clampi(nearest(iscale * x[i]), -nmax, nmax - 1);
      slx += w[i] * x[i] * l, sll += w[i] * l * l;
    }
    if (sll > 0.f && slx * slx > best_score * sll) {
      best_score = slx * slx / sll, best_scale = slx / sll;
      for (int i = 0; i < n; i++) q[i] = (uint8_t)(clampi(nearest(iscale * x[i]), -nmax, nmax - 1) + nmax);
    }
  }
  return best_scale;
}

// Integer steps L[j] in lo..hi and one float d with v[j] ~ d L[j], minimising sum cost[j] (d L[j] - v[j])^2
// (cost[j]: what an error of 1 in v[j] costs): the value of largest magnitude mapped to the limit with the
// larger magnitude, stretched by -0.5..+0.5 steps, each refit by least squares.
float fit_steps(const float* v, const float* cost, int n, int lo, int hi, int* L) {
  float m = 0.f;
  for (int j = 0; j < n; j++)
    if (std::fabs(v[j]) > std::fabs(m)) m = v[j];
  for (int j = 0; j < n; j++) L[j] = 0;
  if (std::fabs(m) < 1e-15f) return 0.f;
  const float lim = -lo > hi ? (float)lo : (float)hi;
  float best_d = m / lim, best_err = INFINITY;
  int t[16];
  auto score = [&](float d) {
    if (!(d != 0.f) || !std::isfinite(d)) return;
    float err = 0.f, slv = 0.f, sll = 0.f;
    for (int pass = 0; pass < 2; pass++) {  // the candidate, then its least-squares refit
      err = 0.f, slv = 0.f, sll = 0.f;
      for (int j = 0; j < n; j++) {
        t[j] = clampi(nearest(v[j] / d), lo, hi);
        const float e = d * t[j] - v[j];
        err += cost[j] * e * e, slv += cost[j] * t[j] * v[j], sll += cost[j] * t[j] * t[j];
      }
      if (err < best_err) best_err = err, best_d = d, std::memcpy(L, t, sizeof(int) * n);
      if (!(sll > 0.f)) return;
      d = slv / sll;
    }
  };
  for (int s = -5; s <= 5; s++) score(m / (lim + (lim > 0 ? 0.1f : -0.1f) * (float)s));
  return best_d;
}

// The types quantize_ggml_search writes; their blocks are their traits rows'.
WeightType parse_ktype(const std::string& t) {
  for (WeightType k : {WeightType::Q4_K, WeightType::Q5_K, WeightType::Q6_K, WeightType::Q5_0, WeightType::Q5_1})
    if (t == traits(k).ggml) return k;
  throw std::invalid_argument("quantize_ggml_search: no quantizer for " + t + " (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1)");
}
int block_elems(WeightType t) { return (int)traits(t).block; }
size_t block_bytes(WeightType t) { return (size_t)traits(t).block_bytes; }
void put_f16(uint8_t* p, float v) {
  const uint16_t h = f32_to_f16(v);
  std::memcpy(p, &h, 2);
}

// Q4_K / Q5_K: 8 sub-blocks of 32, each x ~ d*sc*q - dmin*m with 6-bit sc, m and an fp16 d, dmin.
void k4_block(const float* x, const float* w, bool five, uint8_t* blk) {
  const int nmax = five ? 31 : 15;
  uint8_t q[256];
  float scale[8], negmin[8], cost_s[8], cost_m[8];
  for (int j = 0; j < 8; j++) {
    float mn;
    scale[j] = fit_affine(x + 32 * j, w + 32 * j, 32, nmax, true, &mn, q + 32 * j);
    negmin[j] = -mn;
    // An error e in the sub-block's scale costs sum w q^2 e^2; in its minimum, sum w e^2.
    cost_s[j] = cost_m[j] = 0.f;
    for (int i = 32 * j; i < 32 * j + 32; i++) cost_s[j] += w[i] * q[i] * q[i], cost_m[j] += w[i];
  }
  int ls[8], lm[8];
  const float d = fit_steps(scale, cost_s, 8, 0, 63, ls), dmin = fit_steps(negmin, cost_m, 8, 0, 63, lm);
  put_f16(blk, d);
  put_f16(blk + 2, dmin);
  uint8_t* sc = blk + 4;  // the inverse of ggml_formats.h's k4_scale_min
  std::memset(sc, 0, 12);
  for (int j = 0; j < 8; j++) {
    if (j < 4) {
      sc[j] |= (uint8_t)ls[j], sc[j + 4] |= (uint8_t)lm[j];
    } else {
      sc[j + 4] = (uint8_t)((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
      sc[j - 4] |= (uint8_t)((ls[j] >> 4) << 6), sc[j] |= (uint8_t)((lm[j] >> 4) << 6);
    }
  }
  // Codes again for the scales as stored (fp16 d and dmin times the 6-bit steps).
  const float d16 = f16_to_f32(f32_to_f16(d)), dmin16 = f16_to_f32(f32_to_f16(dmin));
  for (int j = 0; j < 8; j++) {
    const float ds = d16 * (float)ls[j], dm = dmin16 * (float)lm[j];
    if (ds == 0.f) continue;  // keep the codes of the search: they decode to -dm whatever they are
    for (int i = 32 * j; i < 32 * j + 32; i++) q[i] = (uint8_t)clampi(nearest((x[i] + dm) / ds), 0, nmax);
  }
  uint8_t* qs = blk + (five ? 48 : 16);
  if (five) std::memset(blk + 16, 0, 32);
  for (int c = 0; c < 8; c++)
    for (int k = 0; k < 32; k++) {
      const uint8_t v = q[32 * c + k];
      if (c % 2 == 0) qs[32 * (c / 2) + k] = v & 0xF;
      else qs[32 * (c / 2) + k] |= (uint8_t)((v & 0xF) << 4);
      if (five) blk[16 + k] |= (uint8_t)(((v >> 4) & 1) << c);
    }
}

// Q6_K: 16 sub-blocks of 16, x ~ d*sc*(q-32) with int8 sc, 6-bit q and an fp16 d.
void q6k_block(const float* x, const float* w, uint8_t* blk) {
  uint8_t q[256];
  float scale[16], cost[16];
  for (int j = 0; j < 16; j++) {
    scale[j] = fit_symmetric(x + 16 * j, w + 16 * j, 16, 32, q + 16 * j);
    cost[j] = 0.f;
    for (int i = 16 * j; i < 16 * j + 16; i++) cost[j] += w[i] * (float)((q[i] - 32) * (q[i] - 32));
  }
  int ls[16];
  const float d = fit_steps(scale, cost, 16, -128, 127, ls);
  const float d16 = f16_to_f32(f32_to_f16(d));
  for (int j = 0; j < 16; j++) {
    const float ds = d16 * (float)ls[j];
    blk[192 + j] = (uint8_t)(int8_t)ls[j];
    if (ds == 0.f) continue;
    for (int i = 16 * j; i < 16 * j + 16; i++) q[i] = (uint8_t)(clampi(nearest(x[i] / ds), -32, 31) + 32);
  }
  put_f16(blk + 208, d);
  std::memset(blk, 0, 192);
  for (int c = 0; c < 8; c++) {  // chunk c of 32 is quarter c%4 of half c/4 (ggml_formats.h's decode_chunk)
    const int h = c / 4, p = c % 4;
    for (int k = 0; k < 32; k++) {
      const uint8_t v = q[32 * c + k];
      blk[64 * h + 32 * (p % 2) + k] |= (uint8_t)((v & 0xF) << (4 * (p / 2)));
      blk[128 + 32 * h + k] |= (uint8_t)((v >> 4) << (2 * p));
    }
  }
}

// Q5_0 (x ~ d*(q-16)) and Q5_1 (x ~ d*q + m): 32 weights, fp16 d (and m), high bits in a u32.
void q5_block(const float* x, const float* w, bool one, uint8_t* blk) {
  uint8_t q[32];
  float d, m = 0.f;
  if (one) {
    d = fit_affine(x, w, 32, 31, false, &m, q);
    const float d16 = f16_to_f32(f32_to_f16(d)), m16 = f16_to_f32(f32_to_f16(m));
    if (d16 > 0.f)
      for (int i = 0; i < 32; i++) q[i] = (uint8_t)clampi(nearest((x[i] - m16) / d16), 0, 31);
  } else {
    d = fit_symmetric(x, w, 32, 16, q);
    const float d16 = f16_to_f32(f32_to_f16(d));
    if (d16 != 0.f)
      for (int i = 0; i < 32; i++) q[i] = (uint8_t)(clampi(nearest(x[i] / d16), -16, 15) + 16);
  }
  put_f16(blk, d);
  if (one) put_f16(blk + 2, m);
  uint32_t qh = 0;
  uint8_t* qs = blk + (one ? 8 : 6);
  for (int k = 0; k < 16; k++) qs[k] = (uint8_t)((q[k] & 0xF) | ((q[k + 16] & 0xF) << 4));
  for (int k = 0; k < 32; k++) qh |= (uint32_t)(q[k] >> 4) << k;
  std::memcpy(blk + (one ? 4 : 2), &qh, 4);
}

}  // namespace

size_t ggml_search_row_bytes(const std::string& type, int64_t cols) {
  const WeightType t = parse_ktype(type);
  if (cols <= 0 || cols % block_elems(t) != 0)
    throw std::invalid_argument(type + " rows need a multiple of " + std::to_string(block_elems(t)) +
                                " columns, got " + std::to_string(cols));
  return (size_t)(cols / block_elems(t)) * block_bytes(t);
}

void quantize_ggml_search(const std::string& type, const float* src, const float* imp, int64_t rows, int64_t cols,
                          uint8_t* out) {
  const WeightType t = parse_ktype(type);
  const size_t row_bytes = ggml_search_row_bytes(type, cols);
  const int be = block_elems(t);
  std::vector<float> x(cols), w(cols);
  for (int64_t r = 0; r < rows; r++) {
    double ss = 0.0;
    for (int64_t k = 0; k < cols; k++) {
      x[k] = std::isfinite(src[r * cols + k]) ? src[r * cols + k] : 0.f;
      ss += (double)x[k] * x[k];
    }
    // llama.cpp's weighting (as quantize_q4_1_search): large weights of important columns kept most precisely.
    const float sigma2 = (float)(2.0 * ss / (double)cols);
    for (int64_t k = 0; k < cols; k++) w[k] = std::sqrt(sigma2 + x[k] * x[k]);
    uint8_t* dst = out + r * row_bytes;
    for (int64_t b = 0; b < cols / be; b++) {
      const float* xb = x.data() + b * be;
      float* wb = w.data() + b * be;
      float sw = 0.f;
      for (int i = 0; imp && i < be; i++) sw += std::fmax(imp[b * be + i], 0.f) * wb[i];
      if (sw > 0.f && std::isfinite(sw))  // else no usable importance here (zeros, inf, NaN): as without
        for (int i = 0; i < be; i++) wb[i] *= std::fmax(imp[b * be + i], 0.f);
      uint8_t* blk = dst + b * block_bytes(t);
      switch (t) {
        case WeightType::Q4_K: k4_block(xb, wb, false, blk); break;
        case WeightType::Q5_K: k4_block(xb, wb, true, blk); break;
        case WeightType::Q6_K: q6k_block(xb, wb, blk); break;
        case WeightType::Q5_0: q5_block(xb, wb, false, blk); break;
        case WeightType::Q5_1: q5_block(xb, wb, true, blk); break;
        default: break;
      }
    }
  }
}

}  // namespace quant
}  // namespace corelm
