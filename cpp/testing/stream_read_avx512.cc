// stream_read_sum with AVX-512: eight independent adds per 512 bytes.
#include <immintrin.h>

#include "testing/stream_read.h"

namespace corelm {
namespace avx512 {

float stream_read_sum(const void* p, size_t bytes) {
  const float* f = static_cast<const float*>(p);
  const size_t n = bytes / 4;
  __m512 s[8];
  for (auto& v : s) v = _mm512_setzero_ps();
  size_t i = 0;
  for (; i + 128 <= n; i += 128)
    for (int j = 0; j < 8; j++) s[j] = _mm512_add_ps(s[j], _mm512_load_ps(f + i + 16 * j));
  for (int j = 1; j < 8; j++) s[0] = _mm512_add_ps(s[0], s[j]);
  float t = _mm512_reduce_add_ps(s[0]);
  for (; i < n; i++) t += f[i];
  return t;
}

}  // namespace avx512
}  // namespace corelm
