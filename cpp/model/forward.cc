// The forward pass: a batch of sequences' new tokens through every layer, the matrix products over all
// tokens together on the pool's chunked regions, attention per sequence over its blocks of the KV cache.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "model/model.h"

namespace corelm {

// The bytes of w's quantized input for m rows (0: float weights); a stacked matrix's parts' inputs one
// after the other, each 64-byte aligned.
static size_t act_bytes(const KernelTable& k, const PackedMatrix& w, int64_t m, ActType act) {
  if (w.parts.empty()) return k.quant_act_bytes(w, m, act);
  size_t total = 0;
  for (const PackedMatrix& p : w.parts) total += (k.quant_act_bytes(p, m, act) + 63) / 64 * 64;
  return total;
}

void Model::set_act_type(ActType a) {
  pool_.quiesce();  // a descheduled pool thread may still read the old buffers
  cfg_.act_type = a;
  scratch_tokens_ = 0;
}

void Model::ensure_scratch(int64_t n) {
  if (n <= scratch_tokens_) return;
  pool_.quiesce();  // a descheduled pool thread may still read the old buffers
  const int64_t T = n, nth = pool_.size();
  const int64_t qkv_dim = (cfg_.n_heads + 2 * cfg_.n_kv_heads) * cfg_.head_dim;
  x_.assign(T * cfg_.dim, 0.f);
  xb_.assign(nth * T * cfg_.dim, 0.f);
  qkv_.assign(T * qkv_dim, 0.f);
  att_.assign(T * cfg_.n_heads * cfg_.head_dim, 0.f);
  const int64_t dense_ffn = cfg_.moe() ? 0 : cfg_.ffn_dim;  // experts have buffers of their own
  hb_.assign(cfg_.gated_mlp ? nth * T * 2 * dense_ffn : 0, 0.f);
  act_.assign(T * dense_ffn, 0.f);
  proj_.assign(cfg_.post_norms || allreduce_ ? T * cfg_.dim : 0, 0.f);
  // room for any matrix's quantized input of up to T rows (0 bytes with float weights)
  qact_ld_ = 0;
  auto fit = [&](const PackedMatrix& w) {
    for (int64_t m = 1; m <= T; m++) qact_ld_ = std::max(qact_ld_, (act_bytes(kt_, w, m, cfg_.act_type) + 63) / 64 * 64);
  };
  for (const LayerWeights& L : layers_)
    for (const PackedMatrix* w : {&L.wqkv, &L.wo, &L.w_gate_up, &L.w_up, &L.w_down}) fit(*w);
  if (lm_head_.storage) fit(lm_head_);
  qact_ = qact_ld_ ? aligned_buffer(nth * qact_ld_) : nullptr;
  scores_.assign(nth * (cfg_.n_heads / cfg_.n_kv_heads) * cfg_.max_seq_len, 0.f);
  out_rows_.assign(T * cfg_.dim, 0.f);
  if (cfg_.moe()) {
    const int64_t E = cfg_.n_experts, rows = T * cfg_.n_experts_used;
    moe_norm_.assign(T * cfg_.dim, 0.f);
    router_logits_.assign(T * E, 0.f);
    moe_in_.assign(rows * cfg_.dim, 0.f);
    moe_act_.assign(rows * cfg_.ffn_dim, 0.f);
    moe_out_.assign(rows * cfg_.dim, 0.f);
    row_of_.assign(rows, 0);
    row_token_.assign(rows, 0);
    row_weight_.assign(rows, 0.f);
    slot_expert_.assign(E, 0);
    slot_row0_.assign(E + 1, 0);
    slot_qa_.assign(E + 1, 0);
    moe_qa_done_.assign(nth * E, 0);
    routing_.assign(cfg_.n_layers * rows, 0);
  }
  tok_seq_.assign(T, 0);
  tok_pos_.assign(T, 0);
  scratch_tokens_ = T;
}

int64_t Model::logit_rows(const SeqSlice* seqs, int64_t n_seqs) const {
  int64_t rows = 0;
  for (int64_t i = 0; i < n_seqs; i++) rows += seqs[i].all_logits ? seqs[i].n_tokens : 1;
  return rows;
}

void Model::forward_batch(const int32_t* tokens, const SeqSlice* seqs, int64_t n_seqs, float* logits) {
  require(n_seqs >= 1, "forward_batch needs at least one sequence");
  require(!cfg_.encoder(), "an encoder has no logits: its forward gives hidden states (hidden_batch)");
  check_batch(tokens, seqs, n_seqs);
  run(tokens, seqs, n_seqs, logits);
}

void Model::hidden_batch(const int32_t* tokens, const SeqSlice* seqs, int64_t n_seqs, float* hidden) {
  require(n_seqs >= 1, "hidden_batch needs at least one sequence");
  require(hidden != nullptr, "hidden_batch needs an output");
  require(!receive_ && !send_, "hidden states of a pipeline stage are not the model's output");
  check_batch(tokens, seqs, n_seqs);
  for (int64_t i = 0; i < n_seqs; i++)  // an encoder's tokens attend to the whole input: it must all be here
    require(!cfg_.encoder() || seqs[i].pos == 0, "an encoder's sequence must be whole in one pass, from position 0");
  run(tokens, seqs, n_seqs, nullptr, hidden);
}

void Model::check_batch(const int32_t* tokens, const SeqSlice* seqs, int64_t n_seqs) const {
  require(ready_, "model weights are incomplete: call finalize() after setting every weight");
  const int64_t B = kv_.block_size();
  int64_t t = 0;
  for (int64_t i = 0; i < n_seqs; i++) {
    const SeqSlice& s = seqs[i];
    require(s.n_tokens >= 1, "every sequence in a batch needs at least one token");
    const int64_t end = s.pos + s.n_tokens;  // one past the last position
    require(s.adapter == -1 || loras_.count(s.adapter), "no LoRA adapter with id " + std::to_string(s.adapter));
    // a rank's shard holds a slice of each projection's rows or columns, which the adapters' A and B are not cut to
    require(s.adapter == -1 || !allreduce_, "LoRA adapters do not run on a tensor-parallel shard");
    require(s.pos >= 0 && s.pos <= cfg_.max_seq_len && s.n_tokens <= cfg_.max_seq_len - s.pos,
            "tokens at positions " + std::to_string(s.pos) + ".." + std::to_string(end - 1) +
                " do not fit the context of " + std::to_string(cfg_.max_seq_len) + " tokens");
    require(s.blocks && s.n_blocks * B >= end, "the sequence's block table is too short for position " +
                                                   std::to_string(end - 1));
    for (int64_t b = 0; b < (end + B - 1) / B; b++)
      require(s.blocks[b] >= 0 && s.blocks[b] < kv_.n_blocks(),
              "block id " + std::to_string(s.blocks[b]) + " is outside the KV cache of " +
                  std::to_string(kv_.n_blocks()) + " blocks");
    for (int64_t j = 0; j < s.n_tokens; j++, t++)
      require(tokens[t] >= 0 && tokens[t] < cfg_.vocab_size,
              "token id " + std::to_string(tokens[t]) + " is outside the vocabulary of " +
                  std::to_string(cfg_.vocab_size));
  }
}

// The kernels' parallel regions (ThreadPool::parallel_chunks). Each task reads only the model's own
// buffers in compute() and writes the shared outputs only in commit(): under the dynamic schedule a
// chunk may be computed twice (by a descheduled thread and by the caller that redid it), and only
// one of them commits. compute() leaves token t's results at scratch + t * ld; the kernels index
// outputs by absolute row, hence the `scratch - first row` pointers.
namespace {

// Target bytes of weights per chunk: small enough that threads can balance each other's leftovers,
// large enough that a chunk's claim and commit stay a few percent of streaming it.
constexpr int64_t kChunkBytes = 96 << 10;

// Chunks of whole multiples of `align` units reading about kChunkBytes of a matrix; each unit gives
// `cols` floats per token.
Chunking chunking(const PackedMatrix& w, int64_t units, int64_t align, int64_t tokens, int64_t cols) {
  const double unit_bytes = (double)w.bytes() / (double)units;
  return Chunking{units, align, (int64_t)(kChunkBytes / std::max(1.0, unit_bytes)), tokens, cols, unit_bytes};
}

// Normalizes all T tokens of x into the buffer index's own copy, so no barrier is needed before a matmul.
// Without a norm (post-LN models normalize the stream itself after each block) the rows are x itself.
struct NormedInput {
  const KernelTable* k;
  const float *x, *norm, *bias;  // norm null: no norm; bias non-null: LayerNorm
  float* xb;       // [buffers][ld_buf]
  int64_t ld_buf, T, d;
  float eps;
  const float* rows(int buf) const { return norm ? xb + (size_t)buf * ld_buf : x; }
  void prepare(int buf) const {
    if (!norm) return;
    float* out = xb + (size_t)buf * ld_buf;
    for (int64_t t = 0; t < T; t++)
      bias ? k->layernorm(out + t * d, x + t * d, norm, bias, d, eps) : k->rmsnorm(out + t * d, x + t * d, norm, d, eps);
  }
};

// A task's matmul y = x @ W^T. With quantized weights, x is quantized once per region and buffer
// index (prepare) into the index's own buffer, and every chunk its thread computes reads that.
struct TaskMatmul {
  const KernelTable* k;
  const PackedMatrix* w;
  uint8_t* qa;  // [buffers][ld_qa]; null: float weights, matmul reads x
  size_t ld_qa;
  ActType act;
  // A table may take some batches of a quantized w through matmul (0 bytes of input: AMX prefill).
  void prepare(int buf, const float* x, int64_t m, int64_t ldx) const {
    if (!qa) return;
    if (w->parts.empty()) {
      if (k->quant_act_bytes(*w, m, act)) k->quantize_act(x, m, ldx, *w, act, qa + buf * ld_qa);
      return;
    }
    uint8_t* at = qa + buf * ld_qa;  // a stacked matrix: each part's own input (act_bytes)
    for (const PackedMatrix& p : w->parts) {
      const size_t n = k->quant_act_bytes(p, m, act);
      if (n) k->quantize_act(x, m, ldx, p, act, at);
      at += (n + 63) / 64 * 64;
    }
  }
  void run(int buf, const float* x, int64_t m, int64_t ldx, float* y, int64_t ldy, int64_t n0, int64_t n1) const {
    if (w->parts.empty()) {
      if (!qa || !k->quant_act_bytes(*w, m, act)) return k->matmul(x, m, ldx, *w, y, ldy, n0, n1);
      return k->matmul_quant(qa + buf * ld_qa, m, act, *w, y, ldy, n0, n1);
    }
    const uint8_t* at = qa ? qa + buf * ld_qa : nullptr;
    int64_t r0 = 0;  // the part's first row; the kernels index y by the part's own rows, hence y + r0
    for (const PackedMatrix& p : w->parts) {
      const size_t n = k->quant_act_bytes(p, m, act);
      const int64_t a = std::max(n0, r0), b = std::min(n1, r0 + p.rows);
      if (a < b) {
        if (n)
          k->matmul_quant(at, m, act, p, y + r0, ldy, a - r0, b - r0);
        else
          k->matmul(x, m, ldx, p, y + r0, ldy, a - r0, b - r0);
      }
      if (at) at += (n + 63) / 64 * 64;
      r0 += p.rows;
    }
  }
};

// Rotate-half RoPE of one head over its first 2 * half dims.
inline void rope_head(float* v, const float* cs, const float* sn, int64_t half) {
  for (int64_t i = 0; i < half; i++) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cs[i] - b * sn[i];
    v[i + half] = b * cs[i] + a * sn[i];
  }
}

// Attention norm, q/k/v projection, bias, the q/k head norms (when the family has them) and RoPE by
// whole heads; the commit also writes keys and values to the cache. With norms over the whole of q and
// k (qk_norm_whole) it stops after the bias: those need every head (Model::qk_norm_whole).
struct QkvTask {
  NormedInput in;
  TaskMatmul mm;
  const float *bias, *rope_cos, *rope_sin;  // bias may be null
  const float *q_norm, *k_norm;             // [hd] each, or null
  const int64_t *tok_pos, *tok_seq;
  float* qkv;  // [T][qkv_dim]
  KVCache* kv;
  const SeqSlice* seqs;
  int64_t layer, hd, nh, nkv, block_size, rope_half;  // rope_half: pairs rotated per head
  bool projection_only;
  const LoraPass* lora;  // null: no sequence has an adapter
  void prepare(int buf) const { in.prepare(buf), mm.prepare(buf, in.rows(buf), in.T, in.d); }
  void compute(int buf, int64_t h0, int64_t h1, float* s, int64_t ld) const {
    const int64_t half = rope_half;
    mm.run(buf, in.rows(buf), in.T, in.d, s - h0 * hd, ld, h0 * hd, h1 * hd);
    if (lora) lora->add(buf, LoraSite::Qkv, layer, s - h0 * hd, ld, h0 * hd, h1 * hd);
    for (int64_t t = 0; t < in.T; t++) {
      const float* cs = rope_cos + tok_pos[t] * half;
      const float* sn = rope_sin + tok_pos[t] * half;
      for (int64_t h = h0; h < h1; h++) {
        float* v = s + t * ld + (h - h0) * hd;
        if (bias)
          for (int64_t i = 0; i < hd; i++) v[i] += bias[h * hd + i];
        if (h >= nh + nkv || projection_only) continue;  // values: no norm, no rotation
        if (q_norm) in.k->rmsnorm(v, v, h < nh ? q_norm : k_norm, hd, in.eps);
        rope_head(v, cs, sn, half);
      }
    }
  }
  void commit(int64_t h0, int64_t h1, const float* s, int64_t ld) const {
    const int64_t qkv_dim = (nh + 2 * nkv) * hd;
    for (int64_t t = 0; t < in.T; t++) {
      std::memcpy(qkv + t * qkv_dim + h0 * hd, s + t * ld, (h1 - h0) * hd * sizeof(float));
      if (projection_only) continue;
      const int64_t p = tok_pos[t];
      const SeqSlice& seq = seqs[tok_seq[t]];
      for (int64_t h = std::max(h0, nh); h < h1; h++)  // keys and values go to the cache
        kv->store(layer, seq.blocks[p / block_size], p % block_size, h < nh + nkv ? h - nh : h - nh - nkv,
                  h >= nh + nkv, s + t * ld + (h - h0) * hd);
    }
  }
};

// MLP norm, the fused gate/up projection (into the buffer index's own rows of hb) and SiLU(gate) * up
// (into scratch), by whole gate/up block pairs.
struct GateUpTask {
  NormedInput in;
  TaskMatmul mm;
  float* hb;   // [buffers][T][2 * f]
  float* act;  // [T][f]
  int64_t f, block;
  Activation activation;
  const LoraPass* lora;  // null: no sequence has an adapter
  int64_t layer;
  void prepare(int buf) const { in.prepare(buf), mm.prepare(buf, in.rows(buf), in.T, in.d); }
  void compute(int buf, int64_t b0, int64_t b1, float* s, int64_t ld) const {
    const int64_t T = in.T, n0 = 2 * b0 * block, n1 = std::min(2 * b1 * block, 2 * f), ldh = n1 - n0;
    // the claim's gate/up outputs packed [T][ldh]: rows 2f apart folded into a few L1 sets
    float* h = hb + (size_t)buf * T * 2 * f;
    mm.run(buf, in.rows(buf), T, in.d, h - n0, ldh, n0, n1);
    if (lora) lora->add(buf, LoraSite::GateUp, layer, h - n0, ldh, n0, n1);
    for (int64_t t = 0; t < T; t++)
      for (int64_t b = b0; b < b1; b++) {
        const int64_t c = std::min(block, f - b * block);
        const float* g = h + t * ldh + 2 * (b - b0) * block;
        (activation == Activation::GeluTanh ? in.k->gelu_tanh_mul : in.k->silu_mul)(s + t * ld + (b - b0) * block, g,
                                                                                     g + c, c);
      }
  }
  void commit(int64_t b0, int64_t b1, const float* s, int64_t ld) const {
    const int64_t width = std::min(b1 * block, f) - b0 * block;
    for (int64_t t = 0; t < in.T; t++) std::memcpy(act + t * f + b0 * block, s + t * ld, width * sizeof(float));
  }
};

// y = in @ W^T by output rows; the commit adds y to x (the residual stream) or stores it (logits).
struct MatmulTask {
  TaskMatmul mm;
  const float* in;
  int64_t m, ld_in;
  float* out;  // [m][n_out]
  int64_t n_out;
  bool accumulate;
  float softcap = 0.f;  // > 0: stores softcap * tanh(y / softcap) (Gemma 2's logits)
  const float* bias = nullptr;  // [n_out] added to y, or null
  bool gelu = false;            // stores gelu(y + bias) (BERT's MLP)
  const LoraPass* lora = nullptr;  // adds its products of (site, layer) to y, before the bias
  LoraSite site = LoraSite::Wo;
  int64_t layer = 0;
  void prepare(int buf) const { mm.prepare(buf, in, m, ld_in); }
  void compute(int buf, int64_t n0, int64_t n1, float* s, int64_t ld) const {
    mm.run(buf, in, m, ld_in, s - n0, ld, n0, n1);
    if (lora) lora->add(buf, site, layer, s - n0, ld, n0, n1);
    if (bias)
      for (int64_t t = 0; t < m; t++)
        for (int64_t i = 0; i < n1 - n0; i++) s[t * ld + i] += bias[n0 + i];
    if (gelu)
      for (int64_t t = 0; t < m; t++) mm.k->gelu(s + t * ld, n1 - n0);
  }
  void commit(int64_t n0, int64_t n1, const float* s, int64_t ld) const {
    for (int64_t t = 0; t < m; t++) {
      float* y = out + t * n_out + n0;
      const float* r = s + t * ld;
      if (accumulate)
        for (int64_t i = 0; i < n1 - n0; i++) y[i] += r[i];
      else if (softcap > 0)
        for (int64_t i = 0; i < n1 - n0; i++) y[i] = softcap * std::tanh(r[i] / softcap);
      else
        std::memcpy(y, r, (n1 - n0) * sizeof(float));
    }
  }
};

// The experts a mixture-of-experts region runs (Model::moe): slot s is expert expert[s], with rows
// [row0[s], row0[s + 1]) of the row buffers and its quantized input at qa_off[s] of a buffer index's
// own buffer (qa_off[s + 1] == qa_off[s]: float weights, no quantized input). The next region rewrites
// these arrays, and a descheduled thread finishing a dropped chunk of this one may overlap it: compute()
// clamps what it reads from them to this region's bounds, so such a thread only computes garbage into
// its own buffers.
struct ExpertSlots {
  const KernelTable* k;
  const ExpertWeights* experts;
  const int32_t* expert;
  const int64_t* row0;
  const size_t* qa_off;
  int64_t n_experts, count;
  int64_t max_rows, cap_rows;  // the largest slot's rows (the scratch holds that many), the buffers' rows
  const float* x;              // [cap_rows][ldx] the input rows
  int64_t ldx;
  uint8_t* qa;                 // [buffers][ld_qa]
  size_t ld_qa;
  uint8_t* done;               // [buffers][n_experts] slot s's input quantized into buf's buffer yet
  ActType act;
  bool gate_up;                // the experts' w_gate_up, or their w_down

  void prepare(int buf) const { std::memset(done + buf * n_experts, 0, n_experts); }
  // Slot s's first row and row count, within bounds.
  int64_t rows(int64_t s, int64_t* r0) const {
    const int64_t a = std::clamp<int64_t>(row0[s], 0, cap_rows), b = std::clamp<int64_t>(row0[s + 1], a, cap_rows);
    *r0 = a;
    return std::min(b - a, max_rows);
  }
  // y[i * ldy + n] for slot s's rows i and its expert's output rows n in [n0, n1).
  void matmul(int buf, int64_t s, float* y, int64_t ldy, int64_t n0, int64_t n1) const {
    const int32_t e = expert[s];
    const ExpertWeights& ew = experts[e >= 0 && e < n_experts ? e : 0];
    const PackedMatrix& w = gate_up ? ew.w_gate_up : ew.w_down;
    int64_t r0;
    const int64_t m = rows(s, &r0);
    const size_t off = qa_off[s], end = qa_off[s + 1];
    if (m <= 0) return;
    if (end <= off) return k->matmul(x + r0 * ldx, m, ldx, w, y, ldy, n0, n1);
    if (end > ld_qa || k->quant_act_bytes(w, m, act) > end - off) return;
    uint8_t* q = qa + buf * ld_qa + off;
    uint8_t& ready = done[buf * n_experts + s];
    if (!ready) k->quantize_act(x + r0 * ldx, m, ldx, w, act, q), ready = 1;
    k->matmul_quant(q, m, act, w, y, ldy, n0, n1);
  }
};

// The units of an expert region: (slot, row block), nb blocks per slot. Expert-major (u = s * nb + b)
// by default, so a chunk is a run of one expert's consecutive rows, one kernel call streaming them.
// Block-major (u = b * count + s) when the pool splits by node: a split of the units in multiples of
// count is then a split of every expert's rows, as the NUMA placement binds them.
struct ExpertUnits {
  int64_t count, nb;
  bool block_major;
  // Calls fn(slot, b0, b1, u) for each run of units [u, u + b1 - b0) of one slot's consecutive blocks.
  template <class F>
  void runs(int64_t u0, int64_t u1, F&& fn) const {
    for (int64_t u = u0; u < u1;) {
      if (block_major) {
        fn(u % count, u / count, u / count + 1, u);
        u++;
        continue;
      }
      const int64_t slot = u / nb, b0 = u % nb, b1 = std::min(nb, b0 + (u1 - u));
      fn(slot, b0, b1, u);
      u += b1 - b0;
    }
  }
};

// The experts' gate/up projections and activation, into act [rows][f]: a block is a gate/up block pair.
struct ExpertGateUpTask {
  ExpertSlots sl;
  ExpertUnits units;
  float* act;
  int64_t f, block;
  Activation activation;
  void prepare(int buf) const { sl.prepare(buf); }
  void compute(int buf, int64_t u0, int64_t u1, float* s, int64_t ld) const {
    units.runs(u0, u1, [&](int64_t slot, int64_t b0, int64_t b1, int64_t u) {
      float* out = s + (u - u0) * 2 * block;  // block b's gate then up outputs at out + (b - b0) * 2 * block
      sl.matmul(buf, slot, out - 2 * b0 * block, ld, 2 * b0 * block, std::min(2 * b1 * block, 2 * f));
      int64_t r0;
      const int64_t m = sl.rows(slot, &r0);
      for (int64_t b = b0; b < b1; b++) {
        const int64_t c = std::min(block, f - b * block);
        for (int64_t i = 0; i < m; i++) {  // the activation over gate's outputs, in place
          float* g = out + i * ld + (b - b0) * 2 * block;
          (activation == Activation::GeluTanh ? sl.k->gelu_tanh_mul : sl.k->silu_mul)(g, g, g + c, c);
        }
      }
    });
  }
  void commit(int64_t u0, int64_t u1, const float* s, int64_t ld) const {
    units.runs(u0, u1, [&](int64_t slot, int64_t b0, int64_t b1, int64_t u) {
      const int64_t r0 = sl.row0[slot], m = sl.row0[slot + 1] - r0;
      for (int64_t b = b0; b < b1; b++) {
        const int64_t c = std::min(block, f - b * block);
        for (int64_t i = 0; i < m; i++)
          std::memcpy(act + (r0 + i) * f + b * block, s + i * ld + (u - u0 + b - b0) * 2 * block, c * sizeof(float));
      }
    });
  }
};

// The experts' down projections, each row times its routing weight, into out [rows][d]: a block is
// grain output rows.
struct ExpertDownTask {
  ExpertSlots sl;
  ExpertUnits units;
  float* out;
  const float* weight;  // [rows]
  int64_t d, grain;
  void prepare(int buf) const { sl.prepare(buf); }
  void compute(int buf, int64_t u0, int64_t u1, float* s, int64_t ld) const {
    units.runs(u0, u1, [&](int64_t slot, int64_t b0, int64_t b1, int64_t u) {
      sl.matmul(buf, slot, s + (u - u0) * grain - b0 * grain, ld, b0 * grain, std::min(d, b1 * grain));
    });
  }
  void commit(int64_t u0, int64_t u1, const float* s, int64_t ld) const {
    units.runs(u0, u1, [&](int64_t slot, int64_t b0, int64_t b1, int64_t u) {
      const int64_t r0 = sl.row0[slot], m = sl.row0[slot + 1] - r0, n0 = b0 * grain, n = std::min(d, b1 * grain) - n0;
      for (int64_t i = 0; i < m; i++) {
        const float w = weight[r0 + i], *y = s + i * ld + (u - u0) * grain;
        float* o = out + (r0 + i) * d + n0;
        for (int64_t j = 0; j < n; j++) o[j] = w * y[j];
      }
    });
  }
};

}  // namespace

void Model::run(const int32_t* tokens, const SeqSlice* seqs, int64_t n_seqs, float* logits, float* hidden) {
  const ForwardMark busy;
  int64_t T = 0;
  for (int64_t i = 0; i < n_seqs; i++) T += seqs[i].n_tokens;
  ensure_scratch(T);
  routing_tokens_ = cfg_.moe() ? T : 0;
  bool all_logits = false;
  lora_tok_.assign(T, nullptr);
  for (int64_t i = 0, t = 0; i < n_seqs; i++) {
    all_logits |= seqs[i].all_logits;
    const LoraAdapter* adapter = seqs[i].adapter >= 0 ? loras_.at(seqs[i].adapter).get() : nullptr;
    for (int64_t j = 0; j < seqs[i].n_tokens; j++, t++)
      tok_seq_[t] = i, tok_pos_[t] = seqs[i].pos + j, lora_tok_[t] = adapter;
  }
  // Rows whose every logit is asked for are a speculative proposal being checked against what decode
  // would give: a few of them run through the table that computes each row with decode's bits.
  const KernelTable& k = all_logits && T <= kRowExactRows && kt_.row_exact ? *kt_.row_exact : kt_;
  run_kt_ = &k;
  const int64_t d = cfg_.dim, hd = cfg_.head_dim, nh = cfg_.n_heads, nkv = cfg_.n_kv_heads;
  const int64_t f = cfg_.ffn_dim, GB = kGateUpBlock;
  LoraPass lora(k, LoraShapes{d, nh * hd, nkv * hd, f}, lora_tok_, pool_, lora_u_, lora_tmp_);
  // the sequences' adapters' x A^T of a site, before its region (null: no adapter in this pass)
  auto lora_down = [&](LoraSite site, int64_t layer, const float* in, int64_t ld) -> const LoraPass* {
    if (!lora.active()) return nullptr;
    lora.down(pool_, site, layer, in, ld);
    return &lora;
  };
  float* x = x_.data();
  if (receive_) {   // a later pipeline stage: the hidden states of the layers before this one's
    receive_(x, T * d);
  } else {
    for (int64_t t = 0; t < T; t++) {
      k.row_to_f32(tok_embeddings_, tokens[t], x + t * d);
      if (cfg_.embed_scale != 1.f)
        for (int64_t i = 0; i < d; i++) x[t * d + i] *= cfg_.embed_scale;
      const float* pos = cfg_.n_positions ? pos_embeddings_.data() + tok_pos_[t] * d : nullptr;
      for (int64_t i = 0; pos && i < d; i++) x[t * d + i] += pos[i];
      for (int64_t i = 0; i < (int64_t)type_embedding_.size(); i++) x[t * d + i] += type_embedding_[i];
    }
  }
  // The stream's own norm (post-LN models: after the embeddings and after every block's residual add)
  auto norm_stream = [&](const std::vector<float>& w, const std::vector<float>& b) {
    pool_.parallel([&](int tid, int nth) {
      int64_t t0, t1;
      split_range(T, tid, nth, 1, &t0, &t1);
      for (int64_t t = t0; t < t1; t++)
        b.empty() ? k.rmsnorm(x + t * d, x + t * d, w.data(), d, cfg_.norm_eps)
                  : k.layernorm(x + t * d, x + t * d, w.data(), b.data(), d, cfg_.norm_eps);
    });
  };
  const bool post_ln = cfg_.norm_after_residual;
  if (post_ln && !receive_) norm_stream(embed_norm_, embed_norm_bias_);

  auto normed = [&](const std::vector<float>& w, const std::vector<float>& b) {
    return NormedInput{&k, x, post_ln ? nullptr : w.data(), b.empty() ? nullptr : b.data(), xb_.data(),
                       scratch_tokens_ * d, T, d, cfg_.norm_eps};
  };
  // the same for a matrix whose input is normalized in its region: normalized here first (buffer index 0's
  // copy, which the region's prepare rewrites with the same values)
  auto lora_down_normed = [&](LoraSite site, int64_t layer, const NormedInput& in) -> const LoraPass* {
    if (!lora.active()) return nullptr;
    in.prepare(0);
    return lora_down(site, layer, in.rows(0), d);
  };
  // a normalized input's rows, normalized here first as lora_down_normed does
  auto note_normed = [&](int64_t layer, const char* part, const NormedInput& in) {
    if (!record_squares_) return;
    in.prepare(0);
    note_input(layer, -1, part, in.rows(0), T, d, d);
  };
  auto task_matmul = [&](const PackedMatrix& w) {
    // an input of its own for this pass's rows or a single one (lm_head): a table may want one for some
    // row counts only (the amx table: a prompt's sparse rows)
    const bool quantized = act_bytes(k, w, T, cfg_.act_type) != 0 || act_bytes(k, w, 1, cfg_.act_type) != 0;
    return TaskMatmul{&k, &w, quantized ? static_cast<uint8_t*>(qact_.get()) : nullptr, qact_ld_, cfg_.act_type};
  };
  // x += in @ W^T; with post-norms x += rmsnorm(in @ W^T) * post_norm, which needs whole rows first, as
  // does a tensor-parallel rank's partial product (summed across the ranks before anything else)
  // (a bias, where the family has one, is added once: after the ranks' sum)
  auto matmul_residual = [&](const float* in, int64_t ld, const PackedMatrix& w, const std::vector<float>& post_norm,
                             const std::vector<float>& bias, LoraSite site, int64_t layer) {
    const bool post = !post_norm.empty(), whole_rows = post || allreduce_;
    MatmulTask task{task_matmul(w), in, T, ld, whole_rows ? proj_.data() : x, d, !whole_rows};
    task.bias = bias.empty() || allreduce_ ? nullptr : bias.data();
    task.lora = lora_down(site, layer, in, ld), task.site = site, task.layer = layer;
    pool_.parallel_chunks(task, chunking(w, d, k.row_grain, T, 1));
    if (!whole_rows) return;
    if (allreduce_) allreduce_(proj_.data(), T * d);
    for (int64_t t = 0; t < T; t++) {
      float* p = proj_.data() + t * d;
      if (allreduce_ && !bias.empty())
        for (int64_t i = 0; i < d; i++) p[i] += bias[i];
      if (post) k.rmsnorm(p, p, post_norm.data(), d, cfg_.norm_eps);
      for (int64_t i = 0; i < d; i++) x[t * d + i] += p[i];
    }
  };

  for (int64_t l = 0; l < cfg_.n_layers; l++) {
    const LayerWeights& L = layers_[l];
    const bool local_rope = cfg_.sliding_layer(l) && !rope_cos_local_.empty();
    const NormedInput attn_in = normed(L.attn_norm, L.attn_norm_bias);
    const QkvTask qkv{attn_in, task_matmul(L.wqkv), L.bqkv.empty() ? nullptr : L.bqkv.data(),
                      (local_rope ? rope_cos_local_ : rope_cos_).data(), (local_rope ? rope_sin_local_ : rope_sin_).data(),
                      L.q_norm.empty() ? nullptr : L.q_norm.data(), L.k_norm.empty() ? nullptr : L.k_norm.data(),
                      tok_pos_.data(), tok_seq_.data(), qkv_.data(), &kv_, seqs, l, hd, nh, nkv, kv_.block_size(),
                      cfg_.n_positions ? 0 : cfg_.rotary_dim() / 2, cfg_.qk_norm_whole,
                      lora_down_normed(LoraSite::Qkv, l, attn_in)};
    note_normed(l, "wq", attn_in);
    pool_.parallel_chunks(qkv, chunking(L.wqkv, nh + 2 * nkv, 1, T, hd));
    if (cfg_.qk_norm_whole) qk_norm_whole(l, seqs, T);
    attention(l, seqs, T);
    note_input(l, -1, "wo", att_.data(), T, nh * hd, nh * hd);
    matmul_residual(att_.data(), nh * hd, L.wo, L.post_attn_norm, L.bo, LoraSite::Wo, l);
    if (post_ln) norm_stream(L.attn_norm, L.attn_norm_bias);
    if (cfg_.moe()) {
      moe(l, T);
      continue;
    }
    if (cfg_.gated_mlp) {
      const int64_t blocks = (f + GB - 1) / GB;
      const NormedInput ffn_in = normed(L.ffn_norm, L.ffn_norm_bias);
      note_normed(l, "w_gate", ffn_in);
      pool_.parallel_chunks(GateUpTask{ffn_in, task_matmul(L.w_gate_up), hb_.data(), act_.data(), f, GB, cfg_.activation,
                                       lora_down_normed(LoraSite::GateUp, l, ffn_in), l},
                            chunking(L.w_gate_up, blocks, 1, T, GB));
    } else {  // act = gelu(x W_up^T + b_up), x the stream itself (post-LN: the gateless MLP's only users)
      require(post_ln, "an MLP without a gate is built for post-LN models only");
      MatmulTask up{task_matmul(L.w_up), x, T, d, act_.data(), f, false};
      up.bias = L.b_up.empty() ? nullptr : L.b_up.data();
      up.gelu = true;
      note_input(l, -1, "w_up", x, T, d, d);
      pool_.parallel_chunks(up, chunking(L.w_up, f, k.row_grain, T, 1));
    }
    note_input(l, -1, "w_down", act_.data(), T, f, f);
    matmul_residual(act_.data(), f, L.w_down, L.post_ffn_norm, L.b_down, LoraSite::Down, l);
    if (post_ln) norm_stream(L.ffn_norm, L.ffn_norm_bias);
  }

  if (send_) return send_(x, T * d);   // a pipeline stage before the last: its layers' output goes on
  if (hidden) {  // every token's state after the final norm (post-LN: the stream is normed already)
    for (int64_t t = 0; t < T; t++) {
      float* h = hidden + t * d;
      if (norm_.empty())
        std::memcpy(h, x + t * d, d * sizeof(float));
      else if (cfg_.layer_norm)
        k.layernorm(h, x + t * d, norm_.data(), norm_bias_.data(), d, cfg_.norm_eps);
      else
        k.rmsnorm(h, x + t * d, norm_.data(), d, cfg_.norm_eps);
    }
    return;
  }
  if (!logits) return;
  // the rows whose logits are wanted, normalized, then one matmul over the vocabulary
  int64_t rows = 0;
  for (int64_t i = 0, t = 0; i < n_seqs; t += seqs[i].n_tokens, i++) {
    const int64_t first = seqs[i].all_logits ? t : t + seqs[i].n_tokens - 1;
    for (int64_t r = first; r < t + seqs[i].n_tokens; r++, rows++)
      k.rmsnorm(out_rows_.data() + rows * d, x + r * d, norm_.data(), d, cfg_.norm_eps);
  }
  note_input(-1, -1, "lm_head", out_rows_.data(), rows, d, d);
  pool_.parallel_chunks(MatmulTask{task_matmul(lm_head_), out_rows_.data(), rows, d, logits, cfg_.logits_size(), false,
                                   cfg_.final_softcap},
                        chunking(lm_head_, cfg_.logits_size(), k.row_grain, rows, 1));
}

void Model::note_input(int64_t layer, int64_t expert, const char* part, const float* x, int64_t rows, int64_t cols,
                       int64_t ld) {
  if (!record_squares_ || rows <= 0) return;
  InputSquares& sq = squares_[weight_name(WeightName{layer, expert, part})];
  if (sq.sums.empty()) sq.sums.assign(cols, 0.0);
  require((int64_t)sq.sums.size() == cols, std::string("input squares of ") + part + " changed width");
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) sq.sums[c] += (double)x[r * ld + c] * x[r * ld + c];
  sq.rows += rows;
}

void Model::record_input_squares(bool on) {
  if (on) squares_.clear();
  record_squares_ = on;
}

std::map<std::string, Model::InputSquares> Model::input_squares() const {
  std::map<std::string, InputSquares> out;
  for (const auto& [name, sq] : squares_) {
    const WeightName w = parse_weight_name(name, cfg_.n_layers, cfg_.n_experts);
    const std::vector<std::string> parts = fused_parts(w.part);
    if (parts.empty() || parts[0] != w.part) {  // a matrix of its own (a gateless MLP's w_up among them)
      out[name] = sq;
      continue;
    }
    for (const std::string& p : parts) out[weight_name(WeightName{w.layer, w.expert, p})] = sq;
  }
  return out;
}

// OLMoE's q/k norms over all heads of a token at once, then RoPE and the cache, which QkvTask left out.
void Model::qk_norm_whole(int64_t l, const SeqSlice* seqs, int64_t T) {
  const LayerWeights& L = layers_[l];
  const int64_t hd = cfg_.head_dim, nh = cfg_.n_heads, nkv = cfg_.n_kv_heads, qkv_dim = (nh + 2 * nkv) * hd;
  const int64_t half = cfg_.n_positions ? 0 : cfg_.rotary_dim() / 2, B = kv_.block_size();
  const bool local = cfg_.sliding_layer(l) && !rope_cos_local_.empty();
  const float* cos = (local ? rope_cos_local_ : rope_cos_).data();
  const float* sin = (local ? rope_sin_local_ : rope_sin_).data();
  // A tensor-parallel rank holds some of the heads: the norms' sums of squares (and their element counts)
  // are summed across the ranks first, then each rank scales its own heads.
  std::vector<float> squares;
  if (allreduce_) {
    squares.assign(2 * T + 2, 0.f);
    for (int64_t t = 0; t < T; t++) {
      const float* q = qkv_.data() + t * qkv_dim;
      double sq = 0, sk = 0;
      for (int64_t i = 0; i < nh * hd; i++) sq += (double)q[i] * q[i];
      for (int64_t i = 0; i < nkv * hd; i++) sk += (double)q[nh * hd + i] * q[nh * hd + i];
      squares[2 * t] = (float)sq, squares[2 * t + 1] = (float)sk;
    }
    squares[2 * T] = (float)(nh * hd), squares[2 * T + 1] = (float)(nkv * hd);
    allreduce_(squares.data(), 2 * T + 2);
  }
  auto norm_by = [&](float* v, const float* w, int64_t n, float sum_sq, float count) {
    const float scale = 1.f / std::sqrt(sum_sq / count + cfg_.norm_eps);
    for (int64_t i = 0; i < n; i++) v[i] = v[i] * scale * w[i];
  };
  pool_.parallel([&](int tid, int nth) {
    for (int64_t t = tid; t < T; t += nth) {
      float* q = qkv_.data() + t * qkv_dim;
      float* k = q + nh * hd;
      if (allreduce_) {
        norm_by(q, L.q_norm.data(), nh * hd, squares[2 * t], squares[2 * T]);
        norm_by(k, L.k_norm.data(), nkv * hd, squares[2 * t + 1], squares[2 * T + 1]);
      } else {
        kt_.rmsnorm(q, q, L.q_norm.data(), nh * hd, cfg_.norm_eps);
        kt_.rmsnorm(k, k, L.k_norm.data(), nkv * hd, cfg_.norm_eps);
      }
      const int64_t p = tok_pos_[t];
      for (int64_t h = 0; h < nh + nkv; h++) rope_head(q + h * hd, cos + p * half, sin + p * half, half);
      const SeqSlice& seq = seqs[tok_seq_[t]];
      for (int64_t h = 0; h < 2 * nkv; h++)
        kv_.store(l, seq.blocks[p / B], p % B, h % nkv, h >= nkv, k + h * hd);
    }
  });
}

// A mixture-of-experts MLP over T tokens: the router's logits, each token's top k experts, its rows
// grouped by expert (so each chosen expert's weights are read once for all its tokens), the experts'
// gate/up and down projections over those groups, and each token's weighted sum added to x.
void Model::moe(int64_t l, int64_t T) {
  const LayerWeights& L = layers_[l];
  const KernelTable& k = kt_;
  const int64_t d = cfg_.dim, f = cfg_.ffn_dim, E = cfg_.n_experts, K = cfg_.n_experts_used, GB = kGateUpBlock;
  float* x = x_.data();
  for (int64_t t = 0; t < T; t++) k.rmsnorm(moe_norm_.data() + t * d, x + t * d, L.ffn_norm.data(), d, cfg_.norm_eps);
  note_input(l, -1, "router", moe_norm_.data(), T, d, d);
  pool_.parallel_chunks(MatmulTask{TaskMatmul{&k, &L.router, nullptr, 0, cfg_.act_type}, moe_norm_.data(), T, d,
                                   router_logits_.data(), E, false},
                        chunking(L.router, E, k.row_grain, T, 1));

  // Routing: softmax over all experts, the top K (ties to the lower index), optionally renormalized.
  // (A NaN logit, from broken weights, is never picked over a number, and never makes an index invalid.)
  std::vector<int64_t> count(E, 0);
  std::vector<int32_t> chosen(K);
  std::vector<float> prob(E);
  std::vector<char> taken(E);
  for (int64_t t = 0; t < T; t++) {
    const float* z = router_logits_.data() + t * E;
    float mx = z[0], sum = 0.f;
    for (int64_t e = 1; e < E; e++) mx = std::max(mx, z[e]);
    for (int64_t e = 0; e < E; e++) sum += (prob[e] = std::exp(z[e] - mx));
    for (int64_t e = 0; e < E; e++) prob[e] /= sum;
    std::fill(taken.begin(), taken.end(), 0);
    float picked = 0.f;
    for (int64_t i = 0; i < K; i++) {
      int32_t best = -1;
      for (int64_t e = 0; e < E; e++)
        if (!taken[e] && (best < 0 || prob[e] > prob[best] || (std::isnan(prob[best]) && !std::isnan(prob[e]))))
          best = (int32_t)e;
      chosen[i] = best;
      taken[best] = 1;
      row_weight_[t * K + i] = prob[best];  // by (token, i) for now; by row below
      picked += prob[best];
    }
    for (int64_t i = 0; i < K; i++) {
      row_of_[t * K + i] = routing_[(l * T + t) * K + i] = chosen[i];
      if (cfg_.moe_norm_topk) row_weight_[t * K + i] /= picked;
      count[chosen[i]]++;
    }
  }
  // Group the rows by expert: slot s is the s-th expert with rows, its rows in token order.
  int64_t slots = 0, max_rows = 0;
  std::vector<int64_t> next(E);
  slot_row0_[0] = 0;
  for (int64_t e = 0; e < E; e++) {
    if (!count[e]) continue;
    next[e] = slot_row0_[slots];
    slot_expert_[slots] = (int32_t)e;
    slot_row0_[slots + 1] = slot_row0_[slots] + count[e];
    max_rows = std::max(max_rows, count[e]);
    slots++;
  }
  std::vector<float> by_token(row_weight_.begin(), row_weight_.begin() + T * K);
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < K; i++) {
      const int64_t r = next[row_of_[t * K + i]]++;
      row_of_[t * K + i] = r;
      row_token_[r] = t;
      row_weight_[r] = by_token[t * K + i];
      std::memcpy(moe_in_.data() + r * d, moe_norm_.data() + t * d, d * sizeof(float));
    }

  // Each slot's quantized input, one after the other in a thread's buffer (0 bytes: float weights).
  auto place_inputs = [&](bool gate_up) {
    size_t off = 0;
    for (int64_t s = 0; s < slots; s++) {
      const ExpertWeights& ew = L.experts[slot_expert_[s]];
      slot_qa_[s] = off;
      off += (k.quant_act_bytes(gate_up ? ew.w_gate_up : ew.w_down, slot_row0_[s + 1] - slot_row0_[s], cfg_.act_type) + 63) / 64 * 64;
    }
    slot_qa_[slots] = off;
    if (off > moe_qa_ld_) {
      pool_.quiesce();  // a descheduled pool thread may still read the old buffer
      moe_qa_ld_ = off + off / 2;
      moe_qa_ = aligned_buffer(pool_.size() * moe_qa_ld_);
    }
  };
  auto slots_for = [&](bool gate_up, const std::vector<float>& in, int64_t ld_in) {
    return ExpertSlots{&k, L.experts.data(), slot_expert_.data(), slot_row0_.data(), slot_qa_.data(), E, slots,
                       max_rows, T * K, in.data(), ld_in, static_cast<uint8_t*>(moe_qa_.get()), moe_qa_ld_,
                       moe_qa_done_.data(), cfg_.act_type, gate_up};
  };
  // chunks of about kChunkBytes of one expert's weights (ExpertUnits)
  const bool block_major = pool_splits_by_node_;
  auto expert_chunking = [&](const PackedMatrix& w, int64_t blocks, int64_t cols) {
    const double unit_bytes = (double)w.bytes() / (double)blocks;
    return Chunking{blocks * slots, block_major ? slots : 1, (int64_t)(kChunkBytes / std::max(1.0, unit_bytes)),
                    max_rows, cols, unit_bytes};
  };
  const ExpertWeights& first = L.experts[slot_expert_[0]];
  const int64_t up_blocks = (f + GB - 1) / GB, down_blocks = (d + k.row_grain - 1) / k.row_grain;
  auto note_experts = [&](const char* part, const std::vector<float>& in, int64_t cols) {
    for (int64_t s = 0; s < slots && record_squares_; s++)
      note_input(l, slot_expert_[s], part, in.data() + slot_row0_[s] * cols, slot_row0_[s + 1] - slot_row0_[s], cols,
                 cols);
  };
  note_experts("w_gate", moe_in_, d);
  place_inputs(true);
  pool_.parallel_chunks(ExpertGateUpTask{slots_for(true, moe_in_, d), {slots, up_blocks, block_major}, moe_act_.data(),
                                         f, GB, cfg_.activation},
                        expert_chunking(first.w_gate_up, up_blocks, 2 * GB));
  note_experts("w_down", moe_act_, f);
  place_inputs(false);
  pool_.parallel_chunks(ExpertDownTask{slots_for(false, moe_act_, f), {slots, down_blocks, block_major}, moe_out_.data(),
                                       row_weight_.data(), d, k.row_grain},
                        expert_chunking(first.w_down, down_blocks, k.row_grain));

  // x += each token's rows, in its routing order; a tensor-parallel rank sums its partial rows first and
  // adds them once the ranks' sums are in
  float* out = allreduce_ ? proj_.data() : x;
  if (allreduce_) std::fill(proj_.begin(), proj_.begin() + T * d, 0.f);
  auto add_rows = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++)
      for (int64_t i = 0; i < K; i++) {
        const float* o = moe_out_.data() + row_of_[t * K + i] * d;
        for (int64_t j = 0; j < d; j++) out[t * d + j] += o[j];
      }
  };
  if (T * K * d < (1 << 16)) {
    add_rows(0, T);
  } else {
    pool_.parallel([&](int tid, int nth) {
      int64_t t0, t1;
      split_range(T, tid, nth, 1, &t0, &t1);
      add_rows(t0, t1);
    });
  }
  if (!allreduce_) return;
  allreduce_(proj_.data(), T * d);
  for (int64_t i = 0; i < T * d; i++) x[i] += proj_[i];
}

// Causal (optionally sliding-window) grouped-query attention of every new token over its own sequence.
// A task is one token's query heads that share a kv head (or a part of them when there are too few
// tasks to keep the threads busy), so each key and value read serves several heads.
void Model::attention(int64_t l, const SeqSlice* seqs, int64_t T) {
  const int64_t hd = cfg_.head_dim, nh = cfg_.n_heads, nkv = cfg_.n_kv_heads, group = nh / nkv;
  const int64_t qkv_dim = (nh + 2 * nkv) * hd;
  const float scale = cfg_.attn_scale > 0 ? cfg_.attn_scale : 1.f / std::sqrt((float)hd);
  const int64_t window = cfg_.sliding_layer(l) ? cfg_.sliding_window : 0;
  // Fewer (token, kv head) pairs than threads (decode of a few sequences): split each pair's query
  // heads into just enough parts for every thread to get one task. More parts would have two threads
  // read the same keys and values: with 2 threads and 2 kv heads, 2 parts instead of 1 made a q4 decode
  // at 128-830 tokens of context 8% slower (qwen2.5-0.5B shapes).
  const int64_t parts = std::clamp<int64_t>((pool_.size() + T * nkv - 1) / (T * nkv), 1, group);
  const int64_t per = (group + parts - 1) / parts;  // query heads per task
  // task -> (token, kv head kvh0 + (task / parts) % n_kv, part task % parts); later tokens see more keys,
  // so tasks are dealt in token-major order and striding balances the causal triangle across threads
  auto attend = [&](int64_t task, int64_t kvh0, int64_t n_kv, float* s) {
    const int64_t t = task / (parts * n_kv), kvh = kvh0 + task / parts % n_kv, part = task % parts;
    const int64_t h0 = kvh * group + part * per, G = std::min(per, group - part * per);
    if (G <= 0) return;
    const SeqSlice& seq = seqs[tok_seq_[t]];
    // causal: the token's own position; an encoder's tokens see their whole input
    const int64_t p = cfg_.causal ? tok_pos_[t] : seq.pos + seq.n_tokens - 1;
    const int64_t start = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
    kv_.attend(kt_, l, kvh, seq.blocks, start, p, qkv_.data() + t * qkv_dim + h0 * hd, G, scale,
               cfg_.attn_softcap, s,
               att_.data() + t * nh * hd + h0 * hd);
  };
  const size_t scores_per_thread = (size_t)group * cfg_.max_seq_len;
  if (kv_head_nodes_.empty()) {
    pool_.parallel([&](int tid, int nth) {
      float* s = scores_.data() + tid * scores_per_thread;
      for (int64_t task = tid; task < T * nkv * parts; task += nth) attend(task, 0, nkv, s);
    });
    return;
  }
  // Split by node: node j's tasks are those of the kv heads placed on node j, claimed one at a time
  // from that node's counter. A thread takes its own node's first, then the other nodes' in turn; a
  // thread without a node starts at the first.
  const int n = (int)kv_head_nodes_.size();
  std::atomic<int64_t> next[ThreadPool::kMaxGroups];
  for (int g = 0; g < n; g++) next[g].store(0, std::memory_order_relaxed);
  pool_.parallel([&](int slot, int) {
    float* s = scores_.data() + slot * scores_per_thread;
    const int node = pool_.thread_nodes()[pool_.current_thread()];
    int home = 0;
    for (int g = 0; g < n; g++)
      if (kv_head_nodes_[g].node == node) home = g;
    for (int i = 0; i < n; i++) {
      const int g = (home + i) % n;
      const int64_t kvh0 = kv_head_nodes_[g].begin, n_kv = kv_head_nodes_[g].end - kv_head_nodes_[g].begin;
      for (int64_t task; (task = next[g].fetch_add(1, std::memory_order_relaxed)) < T * n_kv * parts;)
        attend(task, kvh0, n_kv, s);
    }
  });
}

}  // namespace corelm
