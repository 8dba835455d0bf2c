// Shared by kernels_avx512.cc and kernels_avx512_bf16.cc: the AVX-512 fp32/bf16 weight layout and the
// AVX512_BF16 matmul. Include only from files built with AVX-512 flags.
#pragma once
#include <cstdint>

#include "kernels/kernels.h"

namespace corelm {
namespace avx512 {

// Weight layout: groups of kGroup rows, each group stored chunk by chunk: [rows/8][K/32][8][32].
// Decode reads a group as one sequential stream (several separate row streams reach only ~70% of
// a core's bandwidth; one stream gets close to all of it). K is padded to 32 and rows to 8 with zeros.
constexpr int64_t kGroup = 8, kChunk = 32;

// y = x W^T for bf16 weights and m >= 2 rows of x, rows [n0, n1) of W, through VDPBF16PS on activations
// rounded to bf16 (round to nearest even). Needs AVX512_BF16 (kernels_avx512_bf16.cc alone is built with it).
void bf16dp_matmul(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy,
                   int64_t n0, int64_t n1);

}  // namespace avx512
}  // namespace corelm
