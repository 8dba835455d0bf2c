// The spin-wait hint of busy loops (PAUSE on x86: yields the core's resources to its SMT sibling and
// leaves the loop without a memory-order flush); nothing elsewhere, so any target builds.
#pragma once

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
namespace corelm {
inline void cpu_relax() { _mm_pause(); }
}  // namespace corelm
#else
namespace corelm {
inline void cpu_relax() {}
}  // namespace corelm
#endif
