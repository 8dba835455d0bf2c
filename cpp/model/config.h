// A model's hyper-parameters and the engine options it is built with, and their validation.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "runtime/thread_pool.h"
#include "runtime/topology.h"

namespace corelm {

// What every check of the model's input throws.
inline void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

struct ModelConfig {
  int64_t vocab_size = 0;
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
  std::vector<float> rope_inv_freq;  // [head_dim / 2], scaling (e.g. llama3) already applied
  WeightType weight_type = WeightType::F32;
  // How quantized matmuls take their input (kernels.h): int8 per block of 32, or int16 (near fp32).
  ActType act_type = ActType::I8;
  int n_threads = 1;
  KVType kv_type = KVType::F32;
  int64_t kv_block_size = 16;      // tokens per KV block
  int64_t kv_blocks = 0;           // blocks in the pool; 0: enough for one sequence of max_seq_len
  bool pin_threads = true;  // pin pool workers one per physical core (runtime/topology.h)
  Schedule schedule = Schedule::Dynamic;  // how the kernels' work is split across threads (thread_pool.h)
  NumaPolicy numa = NumaPolicy::Default;  // thread plan and memory placement across NUMA nodes

  void validate() const;  // throws std::invalid_argument
};

}  // namespace corelm
