// The decoder-only transformer of the Llama family (Llama, Mistral, Qwen2): weights by layer, the KV
// cache and the forward pass. The model knows layers, not instruction sets: every matrix is an opaque
// PackedMatrix and all math goes through the kernel table.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/kernels.h"
#include "model/kv_cache.h"
#include "runtime/numa.h"
#include "runtime/thread_pool.h"
#include "runtime/topology.h"

namespace corelm {

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

struct LayerWeights {
  std::vector<float> attn_norm, ffn_norm;  // [dim]
  PackedMatrix wqkv;                       // [(n_heads + 2*n_kv_heads) * head_dim, dim]: q, k, v rows fused
  std::vector<float> bqkv;                 // [(n_heads + 2*n_kv_heads) * head_dim] or empty
  PackedMatrix wo;                         // [dim, n_heads * head_dim]
  PackedMatrix w_gate_up;                  // [2 * ffn_dim, dim]: gate and up rows interleaved in blocks
  PackedMatrix w_down;                     // [dim, ffn_dim]
};

// Where the NUMA policy puts the threads and their shares of the memory (runtime/numa.h).
//
// For the scheduler: a parallel loop over n items in groups of grain (the split grains below) should
// let each thread claim the items of ranges(n, grain) for its thread_node first, and take another
// node's items only when its own are gone; a thread with node -1 takes any. A node's weight rows are
// then read from its own memory. KV blocks: a sequence whose blocks lie in a node's ranges(kv_blocks,
// 1) is attended fastest by that node's threads, so the block allocator should give a sequence blocks
// of one node, and attention tasks should go to that node.
struct NumaLayout {
  NumaPolicy policy = NumaPolicy::Default;
  std::vector<int> thread_cpus;   // the plan under this policy; [0] is the CPU left for the calling thread
  std::vector<int> thread_node;   // each thread's node; -1: not pinned
  std::vector<NodeShare> shares;  // the nodes and their threads; empty (Default policy): no split by node
  std::vector<RowRange> ranges(int64_t n, int64_t grain) const { return split_by_node(n, grain, shares); }
};

// One buffer's pages given to nodes: byte ranges from base, each with its node.
struct PlacedBuffer {
  std::string name;
  const void* base = nullptr;
  size_t bytes = 0;
  std::vector<RowRange> byte_ranges;
  std::string error;  // "" or why a range could not be placed
};

// One sequence's part of a batched forward: n_tokens new tokens at positions [pos, pos + n_tokens),
// whose keys/values go to (and are read from) the blocks of its block table.
struct SeqSlice {
  int64_t n_tokens = 0;
  int64_t pos = 0;
  const int32_t* blocks = nullptr;  // block table: position p lives in blocks[p / block_size]
  int64_t n_blocks = 0;
  bool all_logits = false;          // logits for every new token, or only the last
};

class Model {
 public:
  explicit Model(const ModelConfig& cfg);
  ~Model();

  // Takes one weight by internal name (see docs/architecture.md) as a row-major fp32 array.
  void set_weight(const std::string& name, const float* data, const std::vector<int64_t>& shape);
  // Takes a matrix as raw GGUF blocks (type Q8, Q4 or Q4M for Q8_0, Q4_0, Q4_1) and repacks them
  // without a float round trip; fused partners of different types meet as fp32 instead.
  void set_weight_raw(const std::string& name, WeightType type, const uint8_t* raw, size_t nbytes,
                      const std::vector<int64_t>& shape);
  void finalize();  // throws if any weight is missing
  bool ready() const { return ready_; }

  // Runs several sequences in one pass: matrix products over all their tokens together, attention per
  // sequence. tokens holds each sequence's new tokens in order; logits gets, per sequence, one row
  // (or n_tokens rows with all_logits) of [vocab].
  void forward_batch(const int32_t* tokens, const SeqSlice* seqs, int64_t n_seqs, float* logits);
  int64_t logit_rows(const SeqSlice* seqs, int64_t n_seqs) const;
  const KVCache& kv_cache() const { return kv_; }

  const ModelConfig& config() const { return cfg_; }
  const KernelTable& kernel_table() const { return kt_; }
  size_t weight_bytes() const;  // bytes of all packed matrices (what decode streams per token)
  // The packed matrices in the order decode reads them (layers' wqkv, wo, w_gate_up, w_down, then
  // lm_head and tok_embeddings): name, address, bytes. finalize() puts them end to end in one buffer.
  std::vector<std::tuple<std::string, uintptr_t, size_t>> weight_spans() const;
  int n_threads() const { return pool_.size(); }
  const ThreadPool& pool() const { return pool_; }
  void set_schedule(Schedule s) { pool_.set_schedule(s), cfg_.schedule = s; }
  // How quantized matmuls take their input from the next forward on (the loader picks it once it
  // knows how the weights are stored); the activation buffers are sized again.
  void set_act_type(ActType a);
  const std::vector<int>& thread_cpus() const { return pool_.thread_cpus(); }
  // The node whose rows each thread works on first (ThreadPool::set_thread_nodes): the NUMA plan's
  // under a policy; tests set fake ones to run the split by node on a one-node machine.
  void set_thread_nodes(const std::vector<int>& nodes) {
    pool_.set_thread_nodes(nodes);
    split_kv_heads();
  }

  static constexpr int64_t kGateUpBlock = 16;  // rows of gate, then of up, alternating
  // The row grains the parallel loops split matrices by, which the NUMA split follows: wqkv by whole
  // heads (head_dim rows), w_gate_up by gate/up block pairs (2 * kGateUpBlock rows), wo, w_down and
  // lm_head by kRowGrain rows (a multiple of what the kernels keep together: the AVX-512 quantized
  // layout interleaves 32 rows, so a chunk starting inside them would run its first rows slowly).
  // row_grain("wqkv" | "wo" | "w_gate_up" | "w_down" | "lm_head", head_dim).
  static constexpr int64_t kRowGrain = 32;
  static int64_t row_grain(const std::string& matrix, int64_t head_dim);

  const NumaLayout& numa_layout() const { return numa_; }
  const std::vector<PlacedBuffer>& numa_placed() const { return placed_; }
  const std::string& numa_status() const { return numa_status_; }

 private:
  void check_batch(const int32_t* tokens, const SeqSlice* seqs, int64_t n_seqs) const;
  void run(const int32_t* tokens, const SeqSlice* seqs, int64_t n_seqs, float* logits);
  void attention(int64_t layer, const SeqSlice* seqs, int64_t n_tokens);
  void ensure_scratch(int64_t n);
  bool numa_places_memory() const;
  void place(const std::string& name, const void* base, size_t bytes, std::vector<RowRange> byte_ranges, bool strict);
  void place_kv_cache();
  void split_kv_heads();
  void place_weights();
  // The packed matrices in the order decode reads them: (name, kind for row_grain or "" for
  // tok_embeddings, matrix). The one list finalize(), place_weights() and weight_spans() walk.
  struct NamedMatrix {
    std::string name, kind;
    PackedMatrix* m;
  };
  std::vector<NamedMatrix> matrices_in_decode_order();

  ModelConfig cfg_;
  const KernelTable& kt_;
  NumaLayout numa_;  // before pool_: the pool is to run the same plan (see docs/architecture.md)
  ThreadPool pool_;
  ParallelFor pack_threads_;  // pool_ lent to the packers while weights load
  bool ready_ = false;

  PackedMatrix tok_embeddings_;  // [vocab, dim]
  PackedMatrix lm_head_;         // [vocab, dim]; shares storage with tok_embeddings_ when tied
  std::vector<float> norm_;      // [dim]
  std::vector<LayerWeights> layers_;
  std::map<std::string, std::vector<float>> pending_;  // wq/wk/wv/w_gate/w_up until fused
  std::map<std::string, std::pair<WeightType, std::vector<uint8_t>>> pending_raw_;  // the same, raw blocks
  void raw_partners_to_f32(const std::string& name);

  std::vector<float> rope_cos_, rope_sin_;  // [max_seq_len][head_dim / 2]
  KVCache kv_;
  // The kv heads each node's threads attend over first (the pool's nodes, split as place_kv_cache
  // places them); empty where the pool does not split by node.
  std::vector<RowRange> kv_head_nodes_;

  // Scratch for one chunk of at most scratch_tokens_ tokens ("the wave of activations").
  int64_t scratch_tokens_ = 0;
  std::vector<float> x_;        // [T][dim] residual stream
  std::vector<float> xb_;       // [n_threads][T][dim] each thread's own normalized copy (saves a barrier)
  std::vector<float> qkv_;      // [T][qkv_dim]
  std::vector<float> att_;      // [T][n_heads * head_dim]
  std::vector<float> hb_;       // [n_threads][T][2 * ffn_dim] each thread's gate/up rows (interleaved)
  std::vector<float> act_;      // [T][ffn_dim]
  std::shared_ptr<void> qact_;  // [n_threads][qact_ld_] each thread's quantized matmul input (quantized weights)
  size_t qact_ld_ = 0;
  std::vector<float> scores_;   // [n_threads][query heads per kv head][max_seq_len]
  std::vector<int64_t> tok_seq_, tok_pos_;  // [T] each token's sequence and position
  std::vector<float> out_rows_;  // [rows][dim] normalized rows whose logits are wanted

  std::vector<PlacedBuffer> placed_;
  std::string numa_status_;
};

}  // namespace corelm
