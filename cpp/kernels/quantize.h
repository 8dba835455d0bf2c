// Error-minimising quantizers (float -> ggml blocks) for weights converted ahead of time. The block
// formats are those of quant_formats.h; these choose each block's scale (and minimum) by search
// instead of ggml's round-to-nearest from the block's range, so they cost time, not bits.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace corelm {
namespace quant {

// rows x cols floats (cols a multiple of 32) -> rows * cols/32 ggml Q4_1 blocks (20 bytes each:
// fp16 d, fp16 m, 16 bytes of nibbles), each minimising sum_j w_j * (d * q_j + m - x_j)^2 over its 32
// weights. imp: nullptr (w_j = 1: plain squared error) or one importance >= 0 per column, e.g. the
// mean square of the activations that column multiplies; then w_j = imp[col] * sqrt(sigma2 + x_j^2)
// with sigma2 twice the row's mean square (llama.cpp's weighting with an importance matrix).
// A block already on a Q4_1 grid comes back unchanged.
void quantize_q4_1_search(const float* src, const float* imp, int64_t rows, int64_t cols, uint8_t* out);

// rows x cols floats -> rows of ggml blocks of `type`, byte for byte as GGUF stores them:
//   "Q4_K", "Q5_K", "Q6_K"  (cols a multiple of 256), and the 32-weight blocks llama.cpp falls back to
//   for rows that are not: "Q5_0", "Q5_1".
// Every block's (sub-block) scales, minimums and codes are searched for the least squared error weighted
// by w_j = imp[col] * sqrt(sigma2 + x_j^2), sigma2 twice the row's mean square, as llama.cpp's quantizers
// do with an importance matrix (imp nullptr, or no positive finite importance in the block: imp = 1);
// then the K-quants' sub-block scales and minimums are quantized to their 6/8 bits by a search weighted
// by how much each one's error costs its weights.
// Non-finite weights count as 0. Throws std::invalid_argument for another type or a bad cols.
void quantize_ggml_search(const std::string& type, const float* src, const float* imp, int64_t rows, int64_t cols,
                          uint8_t* out);
// Bytes per row quantize_ggml_search writes (throws as it does).
size_t ggml_search_row_bytes(const std::string& type, int64_t cols);

}  // namespace quant
}  // namespace corelm
