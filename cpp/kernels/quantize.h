// Error-minimising quantizers (float -> ggml blocks) for weights converted ahead of time. The block
// formats are those of quant_formats.h; these choose each block's scale (and minimum) by search
// instead of ggml's round-to-nearest from the block's range, so they cost time, not bits.
#pragma once
#include <cstdint>

namespace corelm {
namespace quant {

// rows x cols floats (cols a multiple of 32) -> rows * cols/32 ggml Q4_1 blocks (20 bytes each:
// fp16 d, fp16 m, 16 bytes of nibbles), each minimising sum_j w_j * (d * q_j + m - x_j)^2 over its 32
// weights. imp: nullptr (w_j = 1: plain squared error) or one importance >= 0 per column, e.g. the
// mean square of the activations that column multiplies; then w_j = imp[col] * sqrt(sigma2 + x_j^2)
// with sigma2 twice the row's mean square (llama.cpp's weighting with an importance matrix).
// A block already on a Q4_1 grid comes back unchanged.
void quantize_q4_1_search(const float* src, const float* imp, int64_t rows, int64_t cols, uint8_t* out);

}  // namespace quant
}  // namespace corelm
