// Integer dot-product pieces the AVX-512 quantized kernels share (unnamed namespace: each file's own
// copy). VNNI instructions by inline assembly: the files are built without -mavx512vnni, so nothing
// else can use them where the CPU lacks them.
#pragma once
#include <immintrin.h>

#include <cstdlib>
#include <cstring>

#include "kernels/kernels.h"
#include "kernels/tuning.h"

namespace corelm {
namespace quant {
namespace {

bool use_vnni() {
  static const bool v = cpu_features().os_avx512 && cpu_features().avx512_vnni && !tuning::no_vnni();
  return v;
}

inline __m512i bcast8(const int16_t* p) {  // 4 activations to every 64-bit lane
  long long v;
  std::memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}
inline __m512i pair_sums(__m512i a) {  // lanes 2j and 2j+1 -> both their sum, row j's
  return _mm512_add_epi32(a, _mm512_shuffle_epi32(a, _MM_PERM_CDAB));
}

// VPDPBUSD: acc += sum of 4 (u8 a * s8 b) per 32-bit lane. Without VNNI, the same sum from
// VPMADDUBSW on nibbles (no int16 saturation: 2 * 15 * 128 fits) and VPMADDWD.
template <bool VNNI>
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  if constexpr (VNNI) {
    __asm__("vpdpbusd %[b], %[a], %[acc]" : [acc] "+v"(acc) : [a] "v"(a), [b] "v"(b));
    return acc;
  } else {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i lo = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(a, m4), b), _mm512_set1_epi16(1));
    __m512i hi = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(a, 4), m4), b),
                                   _mm512_set1_epi16(16));
    return _mm512_add_epi32(acc, _mm512_add_epi32(lo, hi));
  }
}

// acc + the sums of pairs of int16 products (VPDPWSSD; without VNNI VPMADDWD + VPADDD).
template <bool VNNI>
inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  if constexpr (VNNI) {
    __asm__("vpdpwssd %[b], %[a], %[acc]" : [acc] "+v"(acc) : [a] "v"(a), [b] "v"(b));
    return acc;
  } else {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
  }
}

}  // namespace
}  // namespace quant
}  // namespace corelm
