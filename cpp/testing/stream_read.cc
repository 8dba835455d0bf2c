// stream_read_sum: the widest plain read this CPU runs (testing/stream_read.h).
#include "testing/stream_read.h"

#include "kernels/kernels.h"

namespace corelm {

float stream_read_sum(const void* p, size_t bytes) {
#if defined(CORELM_HAVE_X86)
  const CpuFeatures& f = cpu_features();
  if (f.os_avx512 && f.avx512f) return avx512::stream_read_sum(p, bytes);
  if (f.os_avx && f.avx2) return avx2::stream_read_sum(p, bytes);
#endif
  const float* x = static_cast<const float*>(p);
  float t = 0;
  for (size_t i = 0; i < bytes / 4; i++) t += x[i];
  return t;
}

}  // namespace corelm
