// How the decode GEMVs write their results, 8 fp32 rows of one group at a time (included by the
// AVX-512 files; any file built with AVX could use it). Each output line is written once per matrix,
// and the weights streamed since y was last used have evicted it: an ordinary store first reads the
// line back from DRAM and stalls the weight stream behind it, once per super-group (q4, one Xeon core,
// 32768 x 896: 0.77 of a plain read with ordinary stores, 0.90 with these). Non-temporal stores write
// without that read; end_decode_stores() orders them before the caller's barrier publishes y to other
// threads.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace corelm {
namespace {

// Writes r to p[0..7] past the caches where p is 16-byte aligned; false (nothing written) otherwise.
inline bool stream_rows8(float* p, __m256 r) {
  if ((reinterpret_cast<uintptr_t>(p) & 31) == 0) {
    _mm256_stream_ps(p, r);
    return true;
  }
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    _mm_stream_ps(p, _mm256_castps256_ps128(r));
    _mm_stream_ps(p + 4, _mm256_extractf128_ps(r, 1));
    return true;
  }
  return false;
}

inline void end_decode_stores() { _mm_sfence(); }

}  // namespace
}  // namespace corelm
