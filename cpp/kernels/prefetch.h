// Software prefetch of a run of lines into L2 (included by the AVX-512 files).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace corelm {
namespace {

// Prefetches n lines from p into L2, each next address through a multiply the compiler cannot fold
// (by an opaque 1). Against the plain loop (p + 64 * l: three instructions a line), one Xeon core,
// bench_gemv_stream(rows=m) over OLMoE's expert shapes from DRAM, share of a plain read (the GGUF
// grouped kernels): one row Q4_K 0.78 -> 1.08, Q5_K 0.70 -> 0.95, Q6_K 0.73 -> 0.96; two rows 0.60 ->
// 0.72-0.83; three 0.56 -> 0.68. Why the plain loop loses is not known (this VM shows no PMU counters):
// a loop guarding each prefetch with a divide gained most of it too, prefetches spread over a chunk's
// pieces lost (0.84 -> 0.64).
inline void prefetch_lines_l2(const char* p, int64_t n) {
  uint64_t one = 1;
  __asm__("" : "+r"(one));
  for (int64_t l = 0; l < n; l++) {
    _mm_prefetch(p, _MM_HINT_T1);
    uint64_t step = 64;
    __asm__("" : "+r"(step));
    p += step * one;
    __asm__("" : "+r"(one));
  }
}

}  // namespace
}  // namespace corelm
