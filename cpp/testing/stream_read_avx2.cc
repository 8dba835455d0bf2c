// stream_read_sum with AVX: eight independent adds per 256 bytes.
#include <immintrin.h>

#include "testing/stream_read.h"

namespace corelm {
namespace avx2 {

float stream_read_sum(const void* p, size_t bytes) {
  const float* f = static_cast<const float*>(p);
  const size_t n = bytes / 4;
  __m256 s[8];
  for (auto& v : s) v = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int j = 0; j < 8; j++) s[j] = _mm256_add_ps(s[j], _mm256_load_ps(f + i + 8 * j));
  for (int j = 1; j < 8; j++) s[0] = _mm256_add_ps(s[0], s[j]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s[0]);
  float t = 0;
  for (float v : lanes) t += v;
  for (; i < n; i++) t += f[i];
  return t;
}

}  // namespace avx2
}  // namespace corelm
