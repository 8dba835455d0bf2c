// The AMX kernels on the real tile instructions. The only file built with -mamx-* (plus the
// AVX-512 flags its x -> bf16 conversion uses); callers must check corelm::amx::available() first.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels/amx/amx.h"
#include "kernels/kernel_util.h"

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AMX_INT8__)
#error "amx_native.cc must be compiled with -mamx-tile -mamx-int8 -mamx-bf16"
#endif

namespace corelm {
namespace amx {
namespace native {

#define CORELM_AMX_BARRIER() __asm__ __volatile__("" ::: "memory")

// fp32 -> bf16, round to nearest even (VCVTNE2PS2BF16 also treats denormals as zero, as does
// TDPBF16PS when it reads them, so the GEMM result is the same as with corelm::f32_to_bf16).
static void cvt_row_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(dst + i, (__m512i)v);
  }
  if (i < n) {
    const __mmask16 lo = (__mmask16)((1u << std::min<int64_t>(16, n - i)) - 1);
    const __mmask16 hi = n - i > 16 ? (__mmask16)((1u << (n - i - 16)) - 1) : 0;
    __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, src + i + 16), _mm512_maskz_loadu_ps(lo, src + i));
    _mm512_mask_storeu_epi16(dst + i, ((__mmask32)hi << 16) | lo, (__m512i)v);
  }
}

// A 16 x 16 block of 32-bit elements transposed: rows of 4-byte pairs, then 8-byte quads, then
// 128-bit lanes regrouped twice.
static void transpose_16x16(const void* src, int64_t lds, void* dst, int64_t ldd) {
  const uint8_t* s = static_cast<const uint8_t*>(src);
  uint8_t* d = static_cast<uint8_t*>(dst);
  __m512i r[16], a[16], b[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void*)(s + i * lds));
  for (int i = 0; i < 8; i++) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // b[4 i + j], 128-bit lane L: column 4 L + j of rows 4 i .. 4 i + 3
  for (int i = 0; i < 4; i++) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int j = 0; j < 4; j++) {
    const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x88), c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xdd);
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x88), c3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xdd);
    _mm512_storeu_si512((void*)(d + j * ldd), _mm512_shuffle_i32x4(c0, c2, 0x88));
    _mm512_storeu_si512((void*)(d + (8 + j) * ldd), _mm512_shuffle_i32x4(c0, c2, 0xdd));
    _mm512_storeu_si512((void*)(d + (4 + j) * ldd), _mm512_shuffle_i32x4(c1, c3, 0x88));
    _mm512_storeu_si512((void*)(d + (12 + j) * ldd), _mm512_shuffle_i32x4(c1, c3, 0xdd));
  }
}

#include "kernels/amx/amx_gemm.inc"

}  // namespace native
}  // namespace amx
}  // namespace corelm
