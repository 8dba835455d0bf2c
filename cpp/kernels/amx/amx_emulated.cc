// The AMX kernels compiled against the scalar tile emulation (amx_emulation.h): the same source as
// amx_native.cc, built for the baseline ISA, so every machine can test the packing and blocking.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels/amx/amx.h"
#include "kernels/kernels.h"
#include "kernels/amx/amx_emulation.h"

namespace corelm {
namespace amx {
namespace emulated {

using namespace ::amx_emu;

#define CORELM_AMX_BARRIER() ((void)0)

static void cvt_row_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

#include "kernels/amx/amx_gemm.inc"

}  // namespace emulated
}  // namespace amx
}  // namespace corelm
