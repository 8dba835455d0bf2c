// The AMX kernels compiled against the scalar tile emulation (amx_emulation.h): the same source as
// amx_native.cc, built for the baseline ISA, so every machine can test the packing and blocking.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels/amx/amx.h"
#include "kernels/kernel_util.h"
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

static void transpose_16x16(const void* src, int64_t lds, void* dst, int64_t ldd) {
  for (int i = 0; i < 16; i++)
    for (int j = 0; j < 16; j++)
      std::memcpy(static_cast<uint8_t*>(dst) + j * ldd + 4 * i, static_cast<const uint8_t*>(src) + i * lds + 4 * j, 4);
}

#include "kernels/amx/amx_gemm.inc"

}  // namespace emulated
}  // namespace amx
}  // namespace corelm
