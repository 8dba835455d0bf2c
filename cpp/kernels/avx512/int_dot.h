// Integer dot-product pieces the AVX-512 quantized kernels share (unnamed namespace: each file's own
// copy). VNNI instructions by inline assembly: the files are built without -mavx512vnni, so nothing
// else can use them where the CPU lacks them.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/kernels.h"

namespace corelm {
namespace quant {
namespace {

bool use_vnni() {
  static const bool v = cpu_features().os_avx512 && cpu_features().avx512_vnni && !std::getenv("CORELM_NO_VNNI");
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

// One row of nb blocks of 32 int16 activations split into bytes for VPDPBUSD, x = 256 * hi + lo (hi
// the signed high byte, lo the unsigned low one), and each block's sum of hi: decode's same integer
// sums from weights kept as bytes. Kept in buf.
struct SplitAct {
  const int8_t* hi;
  const uint8_t* lo;
  const int32_t* shi;
};
inline SplitAct split_int16(const int16_t* q, int64_t nb, std::vector<uint8_t>& buf) {
  buf.resize(68 * nb);
  int8_t* hi = reinterpret_cast<int8_t*>(buf.data());
  uint8_t* lo = buf.data() + 32 * nb;
  int32_t* shi = reinterpret_cast<int32_t*>(buf.data() + 64 * nb);
  for (int64_t b = 0; b < nb; b++) {
    const __m512i x = _mm512_loadu_si512((const void*)(q + 32 * b));
    const __m512i h = _mm512_srai_epi16(x, 8);
    _mm256_storeu_si256((__m256i*)(hi + 32 * b), _mm512_cvtepi16_epi8(h));
    _mm256_storeu_si256((__m256i*)(lo + 32 * b), _mm512_cvtepi16_epi8(x));  // truncation: the low byte
    shi[b] = _mm512_reduce_add_epi32(_mm512_madd_epi16(h, _mm512_set1_epi16(1)));
  }
  return {hi, lo, shi};
}

}  // namespace
}  // namespace quant
}  // namespace corelm
