// The decoder-only transformer (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3; ModelConfig says which of
// the families' features are on): weights by layer, the KV cache and the forward pass. The model knows
// layers, not instruction sets: every matrix is an opaque PackedMatrix and all math goes through the
// kernel table.
//   model.cc      construction            weights.cc    weight names, fusion, packing
//   placement.cc  NUMA placement          forward.cc    the forward pass
//   config.cc     ModelConfig::validate
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kernels/kernels.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/lora.h"
#include "model/weights.h"
#include "runtime/numa.h"
#include "runtime/thread_pool.h"
#include "runtime/topology.h"

namespace corelm {

// Where the NUMA policy puts the threads and their shares of the memory (runtime/numa.h).
//
// Weights: a matrix's rows are cut into ranges(rows, row_grain) and each range is bound to its node; the
// pool's chunked regions let each thread claim its own node's rows first and take another node's only
// when its own are gone (a thread with node -1 takes any), so a node's weight rows are read from its own
// memory. KV cache: every layer's kv heads are split by node the same way (split_per_layer over
// n_kv_heads, for every block alike), and attention gives node j's threads the tasks of node j's kv
// heads first.
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
  int32_t adapter = -1;             // the LoRA adapter its tokens go through (Model::add_lora); -1: the base model
};

// One projection of a LoRA adapter as add_lora takes it: the internal weight name it adapts
// ("layers.<i>.wq", ...), A [rank, in] and B [out, rank], row-major fp32.
struct LoraWeights {
  std::string name;
  const float* a;
  std::vector<int64_t> a_shape;
  const float* b;
  std::vector<int64_t> b_shape;
};

class Model {
 public:
  explicit Model(const ModelConfig& cfg);
  ~Model();

  // Where the weights went to 4 KiB pages because 2 MiB ones came slowly (kernels.h: huge_pages_came_slow),
  // finalize() starts a thread of idle priority that moves them onto 2 MiB pages (decode up to 25% faster
  // there). Bytes to move, bytes moved, and whether it still runs.
  struct HugePagePromotion {
    int64_t total = 0, done = 0;
    bool running = false;
  };
  HugePagePromotion huge_page_promotion() const;

  // Takes one weight by internal name (see docs/architecture.md) as a row-major fp32 array.
  void set_weight(const std::string& name, const float* data, const std::vector<int64_t>& shape);
  // Takes a matrix as raw GGUF blocks (type Q8, Q4 or Q4M for Q8_0, Q4_0, Q4_1) and repacks them
  // without a float round trip; fused partners of different types meet as fp32 instead.
  void set_weight_raw(const std::string& name, WeightType type, const uint8_t* raw, size_t nbytes,
                      const std::vector<int64_t>& shape);
  void finalize();  // throws if any weight is missing
  // LoRA adapters (lora.h), applied to the sequences whose SeqSlice names them, never merged into the
  // weights: y += (x A^T)(scale B)^T after each targeted projection. Between forwards only.
  void add_lora(int32_t id, int64_t rank, float scale, const std::vector<LoraWeights>& targets);
  void remove_lora(int32_t id);
  std::vector<int32_t> lora_ids() const;
  bool ready() const { return ready_; }

  // Runs several sequences in one pass: matrix products over all their tokens together, attention per
  // sequence. tokens holds each sequence's new tokens in order; logits gets, per sequence, one row
  // (or n_tokens rows with all_logits) of [vocab].
  void forward_batch(const int32_t* tokens, const SeqSlice* seqs, int64_t n_seqs, float* logits);
  int64_t logit_rows(const SeqSlice* seqs, int64_t n_seqs) const;
  // The same pass, ending in every token's final hidden state (after the final norm, where the model has
  // one) in place of logits: hidden gets [tokens][dim]. Embedding models pool these (encoders can only
  // do this); an encoder's sequence must be whole in one pass, from position 0.
  void hidden_batch(const int32_t* tokens, const SeqSlice* seqs, int64_t n_seqs, float* hidden);
  // Tensor parallelism: this model holds one rank's shard (a slice of the heads, of the MLP's rows and of
  // the vocabulary), so each attention and MLP output is a partial sum. `allreduce` sums n floats in
  // place across the ranks, in an order fixed so every rank gets the same bits; it is called on the
  // forward's calling thread, between parallel regions, twice a layer. Empty: one process holds it all.
  using Allreduce = std::function<void(float* data, int64_t n)>;
  void set_allreduce(Allreduce allreduce);
  const Allreduce& allreduce() const { return allreduce_; }
  // Pipeline parallelism: this model holds consecutive layers of a larger one. `receive` fills the hidden
  // states [tokens][dim] from the stage before, in place of the embeddings; `send` hands them to the stage
  // after, and the forward ends there (no logits). Called on the forward's calling thread. Empty: none.
  using Transfer = std::function<void(float* data, int64_t n)>;
  void set_pipeline(Transfer receive, Transfer send);
  std::pair<Transfer, Transfer> pipeline() const { return {receive_, send_}; }
  const KVCache& kv_cache() const { return kv_; }
  KVCache& kv_cache() { return kv_; }  // between forwards only (the disk prefix cache's block copies)
  // The experts the last forward routed its tokens to: [n_layers][its tokens][n_experts_used], each
  // token's in falling probability (empty without experts). For tests against the reference's routing.
  std::vector<int32_t> last_routing() const {
    return std::vector<int32_t>(routing_.begin(), routing_.begin() + cfg_.n_layers * routing_tokens_ * cfg_.n_experts_used);
  }
  int64_t last_routing_tokens() const { return routing_tokens_; }

  // Calibration statistics (importance-weighted quantization, python/corelm/calibrate.py): while on, every
  // forward adds, for each matrix it multiplies, each input column's sum of squares over the rows it
  // multiplied (an expert's: the rows routed to it) and the row count, in double, on the calling thread
  // between the regions. on starts afresh; off keeps what was recorded. Off costs nothing. (A
  // tensor-parallel shard's or pipeline stage's names are its own matrices' and layers'.)
  struct InputSquares {
    std::vector<double> sums;  // [cols]
    int64_t rows = 0;
  };
  void record_input_squares(bool on);
  bool recording_input_squares() const { return record_squares_; }
  // By internal weight name; the parts of a fused matrix share one input and each get its statistics
  // (wq, wk and wv; w_gate and w_up; an expert's w_gate and w_up).
  std::map<std::string, InputSquares> input_squares() const;

  const ModelConfig& config() const { return cfg_; }
  const KernelTable& kernel_table() const { return kt_; }
  size_t weight_bytes() const;  // bytes of all packed matrices (what decode streams per token without experts)
  // What one token's decode reads: weight_bytes() with n_experts_used of each layer's experts (of mean
  // size) instead of all of them.
  size_t active_weight_bytes() const;
  // The packed matrices in the order decode reads them (layers' wqkv, wo, w_gate_up, w_down, then
  // lm_head and tok_embeddings): name, address, bytes. finalize() puts them end to end in one buffer.
  std::vector<std::tuple<std::string, uintptr_t, size_t>> weight_spans() const;
  int n_threads() const { return pool_.size(); }
  const ThreadPool& pool() const { return pool_; }
  // The workers sleep at once instead of spinning for the next forward (another model runs next).
  void park_threads() { pool_.park(); }
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

  // The row grains the parallel loops split matrices by, which the NUMA split follows: wqkv by whole
  // heads (head_dim rows), w_gate_up by gate/up block pairs (2 * kGateUpBlock rows), wo, w_down and
  // lm_head by the kernel table's row_grain (what its layouts keep together).
  // row_grain("wqkv" | "wo" | "w_gate_up" | "w_down" | "lm_head", head_dim, table).
  static int64_t row_grain(const std::string& matrix, int64_t head_dim, const KernelTable& kt);

  const NumaLayout& numa_layout() const { return numa_; }
  const std::vector<PlacedBuffer>& numa_placed() const { return placed_; }
  const std::string& numa_status() const { return numa_status_; }

 private:
  void check_batch(const int32_t* tokens, const SeqSlice* seqs, int64_t n_seqs) const;
  void run(const int32_t* tokens, const SeqSlice* seqs, int64_t n_seqs, float* logits, float* hidden = nullptr);
  void attention(int64_t layer, const SeqSlice* seqs, int64_t n_tokens);
  void qk_norm_whole(int64_t layer, const SeqSlice* seqs, int64_t n_tokens);
  void moe(int64_t layer, int64_t n_tokens);
  void ensure_scratch(int64_t n);
  bool numa_places_memory() const;
  void place(const std::string& name, const void* base, size_t bytes, std::vector<RowRange> byte_ranges, bool strict);
  void place_kv_cache();
  void split_kv_heads();
  void place_weights();  // and says what became of it in numa_status_
  // The packed matrices in the order decode reads them: (name, kind for row_grain or "" for
  // tok_embeddings, matrix). The one list finalize(), place_weights() and weight_spans() walk.
  struct NamedMatrix {
    std::string name, kind;
    PackedMatrix* m;         // a part of a stacked matrix comes by itself:
    int64_t first_row = 0;   // its first row in the whole matrix
    int64_t whole_rows = 0;  // the whole matrix's rows (0: m is the whole matrix)
  };
  std::vector<NamedMatrix> matrices_in_decode_order();
  // Adds rows [rows][cols] (row stride ld) to the input squares of layer's (expert's) part, or of the model
  // matrix `part` with layer -1; a fused matrix's under its first part. Nothing while not recording.
  void note_input(int64_t layer, int64_t expert, const char* part, const float* x, int64_t rows, int64_t cols,
                  int64_t ld);

  ModelConfig cfg_;
  const KernelTable& kt_;
  const KernelTable* run_kt_ = &kt_;  // the table of the forward running now (kt_ or its row_exact)
  NumaLayout numa_;  // before pool_: the pool is to run the same plan (see docs/architecture.md)
  ThreadPool pool_;
  ParallelFor pack_threads_;  // pool_ lent to the packers while weights load
  struct Promoter {  // see huge_page_promotion(); joined by ~Model
    std::thread thread;
    std::atomic<bool> stop{false}, running{false};
    std::atomic<int64_t> done{0};
    int64_t total = 0;
  } promoter_;
  void start_huge_page_promotion();
  struct ForwardMark {  // held while a forward runs: the promoter waits for quiet (model.cc)
    ForwardMark();
    ~ForwardMark();
  };
  bool ready_ = false;

  PackedMatrix tok_embeddings_;  // [vocab, dim]
  PackedMatrix lm_head_;         // [vocab, dim]; shares storage with tok_embeddings_ when tied
  std::vector<float> norm_;      // [dim]
  std::vector<float> norm_bias_; // [dim] with layer_norm
  // Encoders: learned positions [n_positions][dim], token type 0's row [dim], the embeddings' norm [dim]
  std::vector<float> pos_embeddings_, type_embedding_, embed_norm_, embed_norm_bias_;
  std::vector<LayerWeights> layers_;
  std::map<std::string, std::vector<float>> pending_;  // wq/wk/wv/w_gate/w_up until fused
  std::map<std::string, std::pair<WeightType, std::vector<uint8_t>>> pending_raw_;  // the same, raw blocks
  // The buffers of those copies and of the fused matrices, kept with their pages from one layer to the
  // next: allocated afresh per layer, glibc handed them back to the OS and every layer faulted new pages
  // in (Qwen2.5-Coder-1.5B Q4_K_M: 306k page faults against 101k, ~0.9 s of a 4 s load on the VMs
  // measured). Released by finalize().
  template <class T>
  struct SpareBuffers {
    std::vector<std::vector<T>> spare;
    std::vector<T> take(size_t n);  // n elements (contents unspecified)
    void give(std::vector<T>&& v) { spare.push_back(std::move(v)); }
  };
  SpareBuffers<float> spare_f32_;
  SpareBuffers<uint8_t> spare_raw_;
  void raw_partners_to_f32(const WeightName& w);
  std::vector<float> copy_f32(const float* data, int64_t n);
  void drop_pending(const std::string& key);

  std::vector<float> rope_cos_, rope_sin_;  // [max_seq_len][rotary_dim / 2]
  std::vector<float> rope_cos_local_, rope_sin_local_;  // the sliding layers' own, when they differ
  KVCache kv_;
  // The kv heads each node's threads attend over first (the pool's nodes, split as place_kv_cache
  // places them); empty where the pool does not split by node.
  std::vector<RowRange> kv_head_nodes_;
  bool pool_splits_by_node_ = false;  // the pool's regions split their units by node first

  // Scratch for one chunk of at most scratch_tokens_ tokens ("the wave of activations").
  int64_t scratch_tokens_ = 0;
  std::vector<float> x_;        // [T][dim] residual stream
  std::vector<float> xb_;       // [n_threads][T][dim] each thread's own normalized copy (saves a barrier)
  std::vector<float> qkv_;      // [T][qkv_dim]
  std::vector<float> att_;      // [T][n_heads * head_dim]
  std::vector<float> hb_;       // [n_threads][T][2 * ffn_dim] each thread's gate/up rows (interleaved)
  std::vector<float> act_;      // [T][ffn_dim]
  Allreduce allreduce_;          // tensor parallelism's partial sums, summed across ranks (set_allreduce)
  Transfer receive_, send_;      // pipeline parallelism's hidden states from / to the next stage (set_pipeline)
  std::vector<float> proj_;     // [T][dim] attention or MLP output before its post-norm (post_norms)
  std::shared_ptr<void> qact_;  // [n_threads][qact_ld_] each thread's quantized matmul input (quantized weights)
  size_t qact_ld_ = 0;
  std::vector<float> scores_;   // [n_threads][query heads per kv head][max_seq_len]
  std::vector<int64_t> tok_seq_, tok_pos_;  // [T] each token's sequence and position
  std::vector<float> out_rows_;  // [rows][dim] normalized rows whose logits are wanted

  // Mixture of experts: T tokens' T * k routed rows, grouped by expert ("slots": the experts that got
  // rows, in expert order; slot s holds rows [slot_row0_[s], slot_row0_[s + 1]) of the row buffers).
  std::vector<float> moe_norm_;     // [T][dim] the tokens' normalized MLP input
  std::vector<float> router_logits_;  // [T][n_experts]
  std::vector<float> moe_in_;       // [T * k][dim] each row's token's input
  std::vector<float> moe_act_;      // [T * k][ffn_dim]
  std::vector<float> moe_out_;      // [T * k][dim] each row's expert output times its routing weight
  std::vector<int64_t> row_of_;     // [T][k] the rows of each token
  std::vector<int64_t> row_token_;  // [T * k]
  std::vector<float> row_weight_;   // [T * k]
  std::vector<int32_t> slot_expert_;  // [n_experts]
  std::vector<int64_t> slot_row0_;    // [n_experts + 1]
  std::vector<size_t> slot_qa_;       // [n_experts + 1] byte offsets of the slots' quantized inputs
  std::shared_ptr<void> moe_qa_;      // [n_threads][moe_qa_ld_] each thread's quantized expert inputs
  size_t moe_qa_ld_ = 0;
  std::vector<uint8_t> moe_qa_done_;  // [n_threads][n_experts] whether a slot's input is quantized yet
  std::vector<int32_t> routing_;      // [n_layers][T][k] the last forward's chosen experts
  int64_t routing_tokens_ = 0;

  bool record_squares_ = false;
  std::map<std::string, InputSquares> squares_;  // record_input_squares: by name (a fused matrix's first part)

  std::vector<PlacedBuffer> placed_;
  std::string numa_status_;

  std::map<int32_t, std::unique_ptr<LoraAdapter>> loras_;  // by id
  std::vector<const LoraAdapter*> lora_tok_;  // [T] each token's adapter in this forward (null: base)
  std::vector<float> lora_u_, lora_tmp_;      // LoraPass's buffers
};

}  // namespace corelm
