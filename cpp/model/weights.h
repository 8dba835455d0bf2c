// A model's weights as the engine keeps them: by layer, q/k/v and gate/up fused into one matrix each,
// and the internal names they arrive under (docs/architecture.md).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/kernels.h"

namespace corelm {

struct LayerWeights {
  std::vector<float> attn_norm, ffn_norm;  // [dim]
  std::vector<float> q_norm, k_norm;       // [head_dim] with qk_norm, else empty
  std::vector<float> post_attn_norm, post_ffn_norm;  // [dim] with post_norms, else empty
  PackedMatrix wqkv;                       // [(n_heads + 2*n_kv_heads) * head_dim, dim]: q, k, v rows fused
  std::vector<float> bqkv;                 // [(n_heads + 2*n_kv_heads) * head_dim] or empty
  PackedMatrix wo;                         // [dim, n_heads * head_dim]
  PackedMatrix w_gate_up;                  // [2 * ffn_dim, dim]: gate and up rows interleaved in blocks
  PackedMatrix w_down;                     // [dim, ffn_dim]
};

// Gate and up rows are fused in blocks of this many rows, gate's then up's, alternating, so the thread
// that computes a block of gate outputs also has the matching up outputs and applies SiLU(gate) * up
// without a barrier.
constexpr int64_t kGateUpBlock = 16;

// A weight's internal name: "tok_embeddings", "lm_head", "norm", or "layers.<layer>.<part>".
struct WeightName {
  int64_t layer = -1;  // -1: a weight of the whole model
  std::string part;    // the layer's part ("wq", "attn_norm", ...), or the model weight's name
};

// The one parser of weight names. Throws std::invalid_argument for a name of neither form and for a
// layer at or beyond n_layers; whether a layer has such a part is for the caller to say.
WeightName parse_weight_name(const std::string& name, int64_t n_layers);
std::string layer_weight_name(int64_t layer, const std::string& part);  // "layers.<layer>.<part>"

// The parts fused into one matrix with `part`, itself included, in the fused matrix's order: wq, wk, wv
// (wqkv) or w_gate, w_up (w_gate_up); empty for any other part.
std::vector<std::string> fused_parts(const std::string& part);

// w_gate_up from `rows` gate rows and as many up rows of row_bytes each (fp32 rows or raw GGUF blocks
// alike): kGateUpBlock gate rows, then the same up rows, alternating. out holds 2 * rows * row_bytes.
void interleave_gate_up(const void* gate, const void* up, int64_t rows, size_t row_bytes, void* out);

}  // namespace corelm
