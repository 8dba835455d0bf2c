// Software prefetch of a run of lines into L2 (included by the AVX-512 files).
#pragma once
#include <cstdint>

namespace corelm {
namespace {

// Prefetches n lines from p into L2, each address the last one plus a step the compiler cannot see
// (asm), so the code is always one chain: prefetch, add, prefetch. Where the compiler is free to, it
// gives every prefetch its own address from one base (an unrolled lea or base + index: all of them
// ready at once), and those streams lose most of what the prefetch gains; why is not known (this VM
// shows no PMU counters). One Xeon core, bench_gemv_stream on Qwen2.5-1.5B's shapes, share of a plain
// read from DRAM, the chain against the independent addresses: q4 (int16 activations) 1.06-1.10 against
// 0.73-0.75 (0.88 with no prefetch), q8 1.04-1.06 against 0.84-0.85; the GGUF grouped kernels (session
// 23's loop, whose opaque multiply made a chain too): Q4_K 0.78 -> 1.08, Q5_K 0.70 -> 0.95, Q6_K 0.73 -> 0.96.
inline void prefetch_lines_l2(const char* p, int64_t n) {
  int64_t step = 64;
  __asm__("" : "+r"(step));
  for (int64_t l = 0; l < n; l++) {
    __asm__ volatile("prefetcht1 (%0)" : : "r"(p));
    __asm__("add %1, %0" : "+r"(p) : "r"(step));
  }
}

}  // namespace
}  // namespace corelm
