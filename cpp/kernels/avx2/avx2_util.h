// Small AVX2 helpers shared by the AVX2 kernel files; include only from files built with AVX2 flags.
// (Unnamed namespace: each file's own copy, see kernels/kernel_util.h.)
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace corelm {
namespace {

// Lanes [lo, hi) set, for masked loads and stores of a vector's part.
inline __m256i lane_mask(int64_t lo, int64_t hi) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_and_si256(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32((int)lo - 1)),
                          _mm256_cmpgt_epi32(_mm256_set1_epi32((int)hi), idx));
}
inline __m256i tail_mask(int64_t n) { return lane_mask(0, n); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

}  // namespace
}  // namespace corelm
