#include "model/model.h"

#include <cmath>

namespace corelm {

static int64_t default_kv_blocks(const ModelConfig& c) {
  return c.kv_blocks > 0 ? c.kv_blocks : (c.max_seq_len + c.kv_block_size - 1) / c.kv_block_size;
}

static NumaLayout numa_layout_for(const ModelConfig& cfg) {
  const Topology& topo = system_topology();
  NumaLayout n;
  n.policy = cfg.numa;
  PlanPolicy policy;
  policy.numa = cfg.numa;
  policy.home_node = current_node(topo);
  n.thread_cpus = plan_threads(topo, cfg.n_threads, process_allowed_cpus(), policy);
  n.thread_node = thread_nodes(topo, n.thread_cpus);
  // Unpinned threads go wherever the OS puts them: nothing to place memory near.
  if (cfg.numa != NumaPolicy::Default && cfg.pin_threads) n.shares = node_shares(topo, n.thread_cpus);
  return n;
}

Model::Model(const ModelConfig& cfg)
    : cfg_(cfg), kt_(kernels()), numa_((cfg.validate(), numa_layout_for(cfg))),
      // the NUMA plan's CPUs; its nodes only where memory is split by node (a policy and pinned threads)
      pool_(numa_.thread_cpus, numa_.shares.empty() ? std::vector<int>{} : numa_.thread_node, cfg.pin_threads, false,
            cfg.schedule),
      kv_(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, default_kv_blocks(cfg), cfg.kv_block_size, cfg.kv_type,
          KVCache::kept(cfg.head_dim, cfg.kv_sparsity)) {
  layers_.resize(cfg_.n_layers);
  for (LayerWeights& L : layers_) L.experts.resize(cfg_.n_experts);
  pack_threads_ = [this](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
    pool_.parallel([&](int tid, int nth) {
      int64_t b0, b1;
      split_range(n, tid, nth, 1, &b0, &b1);
      if (b0 < b1) body(b0, b1);
    });
  };
  // cos/sin of every position and rotated pair, one fp32 rounding of the angle as transformers computes
  // it; the sliding-window layers' own table where their frequencies differ (Gemma 3)
  auto rope_table = [&](const std::vector<float>& inv_freq, std::vector<float>& cos, std::vector<float>& sin) {
    const int64_t half = cfg_.rotary_dim() / 2;
    cos.resize(cfg_.max_seq_len * half);
    sin.resize(cfg_.max_seq_len * half);
    for (int64_t p = 0; p < cfg_.max_seq_len; p++)
      for (int64_t i = 0; i < half; i++) {
        const float angle = (float)p * inv_freq[i];
        cos[p * half + i] = (float)std::cos((double)angle) * cfg_.rope_attn_factor;
        sin[p * half + i] = (float)std::sin((double)angle) * cfg_.rope_attn_factor;
      }
  };
  rope_table(cfg_.rope_inv_freq, rope_cos_, rope_sin_);
  if (!cfg_.rope_inv_freq_local.empty()) rope_table(cfg_.rope_inv_freq_local, rope_cos_local_, rope_sin_local_);
  place_kv_cache();
  split_kv_heads();
}

// A pool thread descheduled in the middle of a chunk may still read the weights and buffers.
Model::~Model() { pool_.quiesce(); }

}  // namespace corelm
