// A model's hyper-parameters and the engine options it is built with, and their validation.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/names.h"
#include "kernels/kernels.h"
#include "runtime/thread_pool.h"
#include "runtime/topology.h"

namespace corelm {

// What every check of the model's input throws.
inline void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

// The MLP's activation: gated, SwiGLU (Llama, Qwen, Phi) or GeGLU with tanh-approximated GELU (Gemma);
// or the exact GELU of an MLP without a gate (BERT).
enum class Activation { Silu, GeluTanh, Gelu };
inline constexpr EnumName<Activation> kActivationNames[] = {
    {Activation::Silu, "silu"}, {Activation::GeluTanh, "gelu_tanh"}, {Activation::Gelu, "gelu"}};

// The hyper-parameters and the family's features (a family description, python/corelm/loader/families.py,
// says which a family switches on); the defaults are the Llama family's.
struct ModelConfig {
  int64_t vocab_size = 0;
  // Rows of lm_head this process holds: a tensor-parallel rank's slice of the vocabulary, whose logits it
  // computes (the ranks' slices side by side are the whole); 0: vocab_size.
  int64_t lm_head_rows = 0;
  int64_t dim = 0;           // hidden size
  int64_t ffn_dim = 0;       // intermediate size
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;    // grouped-query attention: n_heads / n_kv_heads query heads share a kv head
  int64_t head_dim = 0;
  float norm_eps = 1e-5f;
  bool tie_embeddings = false;
  bool attention_bias = false;     // q/k/v biases (Qwen2)
  int64_t sliding_window = 0;      // 0: attend to the whole context
  int64_t max_seq_len = 2048;      // KV cache capacity in tokens
  std::vector<float> rope_inv_freq;  // [rope_dim / 2], scaling (e.g. llama3) already applied
  int64_t rope_dim = 0;              // dims of each head rotated (partial rotary, Phi-4-mini); 0: head_dim
  float rope_attn_factor = 1.f;      // cos and sin scaled by it (LongRoPE's attention factor)
  // Sliding-window layers' own frequencies (Gemma 3: a smaller base); empty: rope_inv_freq
  std::vector<float> rope_inv_freq_local;
  // [n_layers] 1: a sliding layer (attends sliding_window tokens when that is > 0, with the local RoPE
  // table when there is one); empty: every layer is
  std::vector<uint8_t> sliding_layers;
  Activation activation = Activation::Silu;
  bool qk_norm = false;      // RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
  bool qk_norm_whole = false;  // RMSNorm over all of q and all of k before RoPE (OLMoE)
  bool post_norms = false;   // RMSNorm of the attention and MLP outputs before the residual add (Gemma 2/3)
  float embed_scale = 1.f;   // embeddings multiplied by it (Gemma: sqrt(dim))
  float attn_scale = 0.f;    // query scale; 0: 1 / sqrt(head_dim)
  float attn_softcap = 0.f;  // scores = cap * tanh(scores / cap) before the softmax (Gemma 2); 0: none
  float final_softcap = 0.f; // the same on the logits
  // Mixture of experts (Mixtral, Qwen3-MoE, OLMoE): every layer's MLP is n_experts MLPs of ffn_dim, of
  // which a router picks n_experts_used per token (softmax over all experts' logits, the top k, with
  // moe_norm_topk their weights renormalized to sum to 1); 0: one dense MLP.
  int64_t n_experts = 0;
  int64_t n_experts_used = 0;
  bool moe_norm_topk = false;
  // Encoders (BERT). An encoder has no lm_head: its forward gives hidden states (Model::hidden_batch).
  bool causal = true;            // false: every token attends to all of its sequence's tokens in the pass
  int64_t n_positions = 0;       // learned absolute positions (pos_embeddings rows) instead of RoPE; 0: RoPE
  int64_t n_token_types = 0;     // rows of type_embeddings, of which row 0 is added to every token; 0: none
  bool layer_norm = false;       // LayerNorm with a bias (<norm>_bias) in place of every RMSNorm
  // x = norm(x + block(x)) (BERT's post-LN: attn_norm and ffn_norm come after their block's residual
  // add, embed_norm after the embeddings, no final norm) in place of x + block(norm(x))
  bool norm_after_residual = false;
  bool gated_mlp = true;         // false: w_down(act(w_up x + b_up)) + b_down, with Activation::Gelu
  bool output_bias = false;      // biases on the attention output (bo) and the MLP (b_up, b_down)
  WeightType weight_type = WeightType::F32;
  // How quantized matmuls take their input (kernels.h): int8 per block of 32, or int16 (near fp32).
  ActType act_type = ActType::I8;
  int n_threads = 1;
  KVType kv_type = KVType::F32;
  double kv_sparsity = 0;          // fraction of each key and value row dropped (model/kv_cache.h)
  int64_t kv_block_size = 16;      // tokens per KV block
  int64_t kv_blocks = 0;           // blocks in the pool; 0: enough for one sequence of max_seq_len
  bool pin_threads = true;  // pin pool workers one per physical core (runtime/topology.h)
  Schedule schedule = Schedule::Dynamic;  // how the kernels' work is split across threads (thread_pool.h)
  NumaPolicy numa = NumaPolicy::Default;  // thread plan and memory placement across NUMA nodes

  void validate() const;  // throws std::invalid_argument
  int64_t rotary_dim() const { return rope_dim ? rope_dim : head_dim; }
  int64_t logits_size() const { return lm_head_rows ? lm_head_rows : vocab_size; }
  bool sliding_layer(int64_t l) const { return sliding_layers.empty() || sliding_layers[l]; }
  bool moe() const { return n_experts > 0; }
  bool encoder() const { return !causal; }
};

}  // namespace corelm
