// A model's weights as the engine keeps them: by layer, q/k/v and gate/up fused into one matrix each,
// and the internal names they arrive under (docs/architecture.md).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/kernels.h"

namespace corelm {

// One expert of a mixture-of-experts layer: an MLP of its own, fused as the dense one is.
struct ExpertWeights {
  PackedMatrix w_gate_up;  // [2 * ffn_dim, dim]
  PackedMatrix w_down;     // [dim, ffn_dim]
};

struct LayerWeights {
  std::vector<float> attn_norm, ffn_norm;  // [dim]
  std::vector<float> q_norm, k_norm;       // [head_dim] with qk_norm, else empty
  std::vector<float> post_attn_norm, post_ffn_norm;  // [dim] with post_norms, else empty
  PackedMatrix wqkv;                       // [(n_heads + 2*n_kv_heads) * head_dim, dim]: q, k, v rows fused
  std::vector<float> bqkv;                 // [(n_heads + 2*n_kv_heads) * head_dim] or empty
  PackedMatrix wo;                         // [dim, n_heads * head_dim]
  PackedMatrix w_gate_up;                  // [2 * ffn_dim, dim]: gate and up rows interleaved in blocks
  PackedMatrix w_down;                     // [dim, ffn_dim]
  // LayerNorm's biases (layer_norm); an MLP without a gate (gated_mlp false): w_up [ffn_dim, dim] alone;
  // output biases (output_bias): bo [dim], b_up [ffn_dim], b_down [dim]
  std::vector<float> attn_norm_bias, ffn_norm_bias;
  PackedMatrix w_up;
  std::vector<float> bo, b_up, b_down;
  // Mixture of experts, in place of w_gate_up and w_down: the router [n_experts, dim], always fp32 (its
  // logits pick the experts), and the experts.
  PackedMatrix router;
  std::vector<ExpertWeights> experts;
};

// Gate and up rows are fused in blocks of this many rows, gate's then up's, alternating, so the thread
// that computes a block of gate outputs also has the matching up outputs and applies SiLU(gate) * up
// without a barrier.
constexpr int64_t kGateUpBlock = 16;

// A weight's internal name: "tok_embeddings", "lm_head", "norm", an encoder's "pos_embeddings",
// "type_embeddings", "embed_norm", a LayerNorm's "<norm>_bias", "layers.<layer>.<part>", or an
// expert's "layers.<layer>.experts.<expert>.<part>" (part w_gate, w_up or w_down).
struct WeightName {
  int64_t layer = -1;   // -1: a weight of the whole model
  int64_t expert = -1;  // -1: not an expert's
  std::string part;     // the layer's or expert's part ("wq", "attn_norm", ...), or the model weight's name
};

// The one parser of weight names. Throws std::invalid_argument for a name of no such form and for a
// layer or expert at or beyond n_layers or n_experts; whether a layer has such a part is for the caller.
WeightName parse_weight_name(const std::string& name, int64_t n_layers, int64_t n_experts = 0);
std::string layer_weight_name(int64_t layer, const std::string& part);  // "layers.<layer>.<part>"
std::string weight_name(const WeightName& w);  // the inverse of parse_weight_name

// The parts fused into one matrix with `part`, itself included, in the fused matrix's order: wq, wk, wv
// (wqkv) or w_gate, w_up (w_gate_up); empty for any other part.
std::vector<std::string> fused_parts(const std::string& part);

// w_gate_up from `rows` gate rows and as many up rows of row_bytes each (fp32 rows or raw GGUF blocks
// alike): kGateUpBlock gate rows, then the same up rows, alternating. out holds 2 * rows * row_bytes.
void interleave_gate_up(const void* gate, const void* up, int64_t rows, size_t row_bytes, void* out);

}  // namespace corelm
