// The roofline's reference: a plain read of `bytes` (64-byte aligned, a multiple of 64) summed as floats,
// eight independent vector adds per step (as shared/bench/peers' membw), so a benchmark can set a
// kernel's weight stream against what a read of as many bytes costs. Not a model kernel, hence not
// in the KernelTable: stream_read_sum picks the widest variant this CPU runs.
#pragma once
#include <cstddef>

namespace corelm {

float stream_read_sum(const void* p, size_t bytes);

namespace avx512 {
float stream_read_sum(const void* p, size_t bytes);  // testing/stream_read_avx512.cc
}
namespace avx2 {
float stream_read_sum(const void* p, size_t bytes);  // testing/stream_read_avx2.cc
}

}  // namespace corelm
