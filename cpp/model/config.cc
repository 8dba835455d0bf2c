#include "model/config.h"

#include <cmath>

namespace corelm {

void ModelConfig::validate() const {
  require(vocab_size > 0 && dim > 0 && ffn_dim > 0 && n_layers > 0, "model dimensions must be positive");
  require(lm_head_rows >= 0 && lm_head_rows <= vocab_size, "lm_head_rows must be in [0, vocab_size]");
  require(!(lm_head_rows && tie_embeddings), "a slice of lm_head needs a separate lm_head, not tied embeddings");
  require(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0,
          "n_heads must be a positive multiple of n_kv_heads");
  require(head_dim > 0 && head_dim % 2 == 0, "head_dim must be positive and even");
  require(rope_dim >= 0 && rope_dim <= head_dim && rope_dim % 2 == 0, "rope_dim must be even and in [0, head_dim]");
  require((int64_t)rope_inv_freq.size() == rotary_dim() / 2, "rope_inv_freq must have rope_dim/2 entries");
  require(rope_inv_freq_local.empty() || rope_inv_freq_local.size() == rope_inv_freq.size(),
          "rope_inv_freq_local must be empty or as long as rope_inv_freq");
  require(sliding_layers.empty() || (int64_t)sliding_layers.size() == n_layers,
          "sliding_layers must be empty or have n_layers entries");
  for (float v : {rope_attn_factor, embed_scale})
    require(std::isfinite(v) && v > 0, "rope_attn_factor and embed_scale must be finite and > 0");
  for (float v : {attn_scale, attn_softcap, final_softcap})
    require(std::isfinite(v) && v >= 0, "attn_scale, attn_softcap and final_softcap must be finite and >= 0");
  require(activation == Activation::Silu || activation == Activation::GeluTanh || activation == Activation::Gelu,
          "unknown activation");
  require(gated_mlp == (activation != Activation::Gelu), "gelu is the activation of an MLP without a gate, and only");
  require(!(moe() && !gated_mlp), "experts are gated MLPs");
  require(n_positions >= 0 && n_positions <= (1 << 24) && n_token_types >= 0 && n_token_types <= 1024,
          "n_positions must be in [0, 16M] and n_token_types in [0, 1024]");
  require(n_positions == 0 || max_seq_len <= n_positions,
          "max_seq_len must not exceed n_positions (the learned positions)");
  require(causal || lm_head_rows == 0, "an encoder has no lm_head to slice");
  require(!(qk_norm && qk_norm_whole), "qk_norm and qk_norm_whole exclude each other");
  require(n_experts >= 0 && n_experts <= 1024, "n_experts must be in [0, 1024]");
  require(n_experts == 0 ? n_experts_used == 0 : n_experts_used >= 1 && n_experts_used <= n_experts,
          "n_experts_used must be in [1, n_experts] (0 without experts)");
  require(max_seq_len > 0 && max_seq_len <= (1 << 24), "max_seq_len must be in [1, 16M]");
  require(std::isfinite(norm_eps) && norm_eps >= 0, "norm_eps must be finite and >= 0");
  require(n_threads >= 1 && n_threads <= 1024, "n_threads must be in [1, 1024]");
  require(act_type == ActType::I8 || act_type == ActType::I16, "act_type must be I8 or I16");
  require(sliding_window >= 0, "sliding_window must be >= 0");
  require(kv_block_size >= 1 && kv_block_size <= 4096, "kv_block_size must be in [1, 4096]");
  require(kv_sparsity >= 0 && kv_sparsity < 1, "kv_sparsity must be in [0, 1)");
  require(kv_blocks >= 0 && kv_blocks <= (1 << 24), "kv_blocks must be in [0, 16M]");
  // Sizes used in index arithmetic must stay far from overflow.
  require(vocab_size < (1 << 24) && dim < (1 << 20) && ffn_dim < (1 << 22) && n_layers < 4096 &&
              n_heads < 4096 && head_dim < 4096,
          "model dimensions are implausibly large");
}

}  // namespace corelm
