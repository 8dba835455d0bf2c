// The AMX kernels on the real tile instructions. The only file built with -mamx-* (plus the
// AVX-512 flags its x -> bf16 conversion uses); callers must check corelm::amx::available() first.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels/amx/amx.h"

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

#include "kernels/amx/amx_gemm.inc"

}  // namespace native
}  // namespace amx
}  // namespace corelm
