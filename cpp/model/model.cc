#include "model/model.h"

#include "kernels/quant_formats.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace corelm {

static void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

void ModelConfig::validate() const {
  require(vocab_size > 0 && dim > 0 && ffn_dim > 0 && n_layers > 0, "model dimensions must be positive");
  require(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0,
          "n_heads must be a positive multiple of n_kv_heads");
  require(head_dim > 0 && head_dim % 2 == 0, "head_dim must be positive and even");
  require((int64_t)rope_inv_freq.size() == head_dim / 2, "rope_inv_freq must have head_dim/2 entries");
  require(max_seq_len > 0 && max_seq_len <= (1 << 24), "max_seq_len must be in [1, 16M]");
  require(std::isfinite(norm_eps) && norm_eps >= 0, "norm_eps must be finite and >= 0");
  require(n_threads >= 1 && n_threads <= 1024, "n_threads must be in [1, 1024]");
  require(act_type == ActType::I8 || act_type == ActType::I16, "act_type must be I8 or I16");
  require(sliding_window >= 0, "sliding_window must be >= 0");
  require(kv_block_size >= 1 && kv_block_size <= 4096, "kv_block_size must be in [1, 4096]");
  require(kv_blocks >= 0 && kv_blocks <= (1 << 24), "kv_blocks must be in [0, 16M]");
  // Sizes used in index arithmetic must stay far from overflow.
  require(vocab_size < (1 << 24) && dim < (1 << 20) && ffn_dim < (1 << 22) && n_layers < 4096 &&
              n_heads < 4096 && head_dim < 4096,
          "model dimensions are implausibly large");
}

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
      kv_(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, default_kv_blocks(cfg), cfg.kv_block_size, cfg.kv_type) {
  layers_.resize(cfg_.n_layers);
  pack_threads_ = [this](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
    pool_.parallel([&](int tid, int nth) {
      int64_t b0, b1;
      split_range(n, tid, nth, 1, &b0, &b1);
      if (b0 < b1) body(b0, b1);
    });
  };
  const int64_t half = cfg_.head_dim / 2;
  rope_cos_.resize(cfg_.max_seq_len * half);
  rope_sin_.resize(cfg_.max_seq_len * half);
  for (int64_t p = 0; p < cfg_.max_seq_len; p++)
    for (int64_t i = 0; i < half; i++) {
      float angle = (float)p * cfg_.rope_inv_freq[i];  // one fp32 rounding, as transformers computes it
      rope_cos_[p * half + i] = (float)std::cos((double)angle);
      rope_sin_[p * half + i] = (float)std::sin((double)angle);
    }
  place_kv_cache();
  split_kv_heads();
}

// ---------------------------------------------------------------------------------------------
// NUMA placement (runtime/numa.h): weights by rows, the KV cache by blocks, each node's part on it

// Only under Distribute or Isolate, and only where there is more than one node to choose from;
// CORELM_NUMA_FORCE=1 places anyway, so a one-node machine can test the path (everything on node 0).
bool Model::numa_places_memory() const {
  const char* force = std::getenv("CORELM_NUMA_FORCE");
  return !numa_.shares.empty() && (system_topology().nodes.size() > 1 || (force && std::string(force) == "1"));
}

void Model::place(const std::string& name, const void* base, size_t bytes, std::vector<RowRange> byte_ranges,
                  bool strict) {
  // a small buffer shares its pages with other data (even when it happens to start on a page boundary,
  // about 1 in 64 posix_memalign calls): left where it is
  if (!aligned_buffer_owns_pages(bytes) || (uintptr_t)base % page_bytes() != 0) return;
  PlacedBuffer p{name, base, bytes, std::move(byte_ranges), ""};
  for (const RowRange& r : p.byte_ranges) {
    std::string err = numa_place(static_cast<const char*>(base) + r.begin, r.end - r.begin, r.node, strict);
    if (!err.empty() && p.error.empty()) p.error = err;
  }
  placed_.push_back(std::move(p));
}

// Preferred, not bound: the cache fills while serving, and a full node should spill, not fail. Each
// layer's kv heads go to nodes as the attention region splits them (split_kv_heads); fewer kv heads
// than nodes leaves some nodes none.
void Model::place_kv_cache() {
  if (!numa_places_memory()) return;
  const char* names[] = {"kv.k", "kv.v", "kv.k_scale", "kv.v_scale"};
  int i = 0;
  for (const auto& buf : kv_.buffers())
    place(names[i++], buf.first, buf.second, split_per_layer(cfg_.n_layers, cfg_.n_kv_heads, buf.second, numa_.shares),
          /*strict=*/false);
}

// The pool's own split by node (its nodes and their threads, as its chunked regions use), so with the
// NUMA plan's nodes these are the ranges place_kv_cache placed.
void Model::split_kv_heads() {
  const std::vector<NodeShare> shares = pool_node_shares(pool_.thread_nodes());
  kv_head_nodes_.clear();
  if (shares.size() >= 2 && shares.size() <= (size_t)ThreadPool::kMaxGroups)
    kv_head_nodes_ = split_by_node(cfg_.n_kv_heads, 1, shares);
}

int64_t Model::row_grain(const std::string& matrix, int64_t head_dim) {
  if (matrix == "wqkv") return head_dim;
  if (matrix == "w_gate_up") return 2 * kGateUpBlock;
  if (matrix == "wo" || matrix == "w_down" || matrix == "lm_head") return kRowGrain;
  throw std::invalid_argument("no row grain for '" + matrix + "'");
}

// Bound: every matrix's node ranges follow the grain its parallel loop splits by. The embedding table
// is read a row per token by the calling thread and stays where it was written (unless tied, when it
// is lm_head).
std::vector<Model::NamedMatrix> Model::matrices_in_decode_order() {
  std::vector<NamedMatrix> out;
  for (int64_t l = 0; l < cfg_.n_layers; l++) {
    LayerWeights& L = layers_[l];
    const std::string p = "layers." + std::to_string(l) + ".";
    const std::pair<const char*, PackedMatrix*> kinds[] = {
        {"wqkv", &L.wqkv}, {"wo", &L.wo}, {"w_gate_up", &L.w_gate_up}, {"w_down", &L.w_down}};
    for (const auto& k : kinds) out.push_back({p + k.first, k.first, k.second});
  }
  out.push_back({"lm_head", "lm_head", &lm_head_});
  out.push_back({"tok_embeddings", "", &tok_embeddings_});  // read a row per token; shares lm_head's bytes when tied
  return out;
}

void Model::place_weights() {
  if (!numa_places_memory()) return;
  for (const NamedMatrix& nm : matrices_in_decode_order()) {
    if (nm.kind.empty()) continue;
    const PackedMatrix& m = *nm.m;
    std::vector<RowRange> bytes;
    for (const RowRange& r : numa_.ranges(m.rows, row_grain(nm.kind, cfg_.head_dim)))
      bytes.push_back({r.node, (int64_t)row_offset(r.begin, m.rows, m.nbytes), (int64_t)row_offset(r.end, m.rows, m.nbytes)});
    place(nm.name, m.data(), m.nbytes, std::move(bytes), /*strict=*/true);
  }
}

static std::string numa_summary(const NumaLayout& n, bool placing, const std::vector<PlacedBuffer>& placed) {
  std::string s = std::string("numa ") + numa_policy_name(n.policy) + ": ";
  if (n.shares.empty())
    return s + (n.policy == NumaPolicy::Default ? "" : "threads are not pinned, so ") + "memory stays where first touch puts it";
  std::string nodes;
  for (const NodeShare& sh : n.shares)
    nodes += (nodes.empty() ? "" : ", ") + std::to_string(sh.node) + " (" + std::to_string(sh.threads) + " threads)";
  s += "threads on node " + nodes + "; ";
  if (!placing)
    return s + (system_topology().nodes.size() > 1 ? "nothing placed" : "one NUMA node, nothing to place");
  int failed = 0;
  std::string first_error;
  for (const PlacedBuffer& p : placed)
    if (!p.error.empty()) first_error = first_error.empty() ? p.error : first_error, failed++;
  s += std::to_string(placed.size()) + " buffers placed by node";
  if (failed) s += ", " + std::to_string(failed) + " failed (" + first_error + ")";
  return s;
}

// A pool thread descheduled in the middle of a chunk may still read the weights and buffers.
Model::~Model() { pool_.quiesce(); }

// ---------------------------------------------------------------------------------------------
// Weights

static std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); i++) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}

static void check_shape(const std::string& name, const std::vector<int64_t>& got, std::vector<int64_t> want) {
  require(got == want, "weight " + name + " has shape " + shape_str(got) + ", expected " + shape_str(want));
}

void Model::set_weight(const std::string& name, const float* data, const std::vector<int64_t>& shape) {
  require(!ready_, "weights can't change after finalize()");
  if (!pending_raw_.empty()) raw_partners_to_f32(name);
  const int64_t d = cfg_.dim, hd = cfg_.head_dim, q_rows = cfg_.n_heads * hd, kv_rows = cfg_.n_kv_heads * hd;
  auto vec = [&](int64_t n) { return std::vector<float>(data, data + n); };
  if (name == "tok_embeddings") {
    check_shape(name, shape, {cfg_.vocab_size, d});
    tok_embeddings_ = kt_.pack(data, cfg_.vocab_size, d, cfg_.weight_type, &pack_threads_);
    if (cfg_.tie_embeddings) lm_head_ = tok_embeddings_;
  } else if (name == "lm_head") {
    require(!cfg_.tie_embeddings, "lm_head given for a model with tied embeddings");
    check_shape(name, shape, {cfg_.vocab_size, d});
    lm_head_ = kt_.pack(data, cfg_.vocab_size, d, cfg_.weight_type, &pack_threads_);
  } else if (name == "norm") {
    check_shape(name, shape, {d});
    norm_ = vec(d);
  } else {
    // layers.{i}.{part}
    require(name.rfind("layers.", 0) == 0, "unknown weight " + name);
    size_t dot = name.find('.', 7);
    require(dot != std::string::npos && dot > 7, "unknown weight " + name);
    std::string idx = name.substr(7, dot - 7), part = name.substr(dot + 1);
    require(idx.size() <= 6 && std::all_of(idx.begin(), idx.end(), ::isdigit), "unknown weight " + name);
    int64_t i = std::stoll(idx);
    require(i < cfg_.n_layers, "weight " + name + " is beyond the model's " + std::to_string(cfg_.n_layers) + " layers");
    LayerWeights& L = layers_[i];
    std::string prefix = "layers." + idx + ".";
    if (part == "attn_norm" || part == "ffn_norm") {
      check_shape(name, shape, {d});
      (part == "attn_norm" ? L.attn_norm : L.ffn_norm) = vec(d);
    } else if (part == "wq" || part == "wk" || part == "wv") {
      check_shape(name, shape, {part == "wq" ? q_rows : kv_rows, d});
      pending_[name] = vec(shape[0] * d);
      std::string nq = prefix + "wq", nk = prefix + "wk", nv = prefix + "wv";
      if (pending_.count(nq) && pending_.count(nk) && pending_.count(nv)) {
        std::vector<float> fused;
        fused.reserve((q_rows + 2 * kv_rows) * d);
        for (auto* n : {&nq, &nk, &nv}) fused.insert(fused.end(), pending_[*n].begin(), pending_[*n].end());
        L.wqkv = kt_.pack(fused.data(), q_rows + 2 * kv_rows, d, cfg_.weight_type, &pack_threads_);
        pending_.erase(nq), pending_.erase(nk), pending_.erase(nv);
      }
    } else if (part == "bq" || part == "bk" || part == "bv") {
      require(cfg_.attention_bias, "weight " + name + " given for a model without attention bias");
      int64_t rows = part == "bq" ? q_rows : kv_rows;
      check_shape(name, shape, {rows});
      if (L.bqkv.empty()) L.bqkv.assign(q_rows + 2 * kv_rows, 0.f);
      int64_t off = part == "bq" ? 0 : part == "bk" ? q_rows : q_rows + kv_rows;
      std::copy(data, data + rows, L.bqkv.begin() + off);
    } else if (part == "wo") {
      check_shape(name, shape, {d, q_rows});
      L.wo = kt_.pack(data, d, q_rows, cfg_.weight_type, &pack_threads_);
    } else if (part == "w_gate" || part == "w_up") {
      const int64_t f = cfg_.ffn_dim;
      check_shape(name, shape, {f, d});
      pending_[name] = vec(f * d);
      std::string ng = prefix + "w_gate", nu = prefix + "w_up";
      if (pending_.count(ng) && pending_.count(nu)) {
        // Interleave blocks of gate and up rows so the thread that computes a block of gate outputs
        // also has the matching up outputs and can apply SiLU(gate) * up without a barrier.
        const std::vector<float>&g = pending_[ng], &u = pending_[nu];
        std::vector<float> fused((size_t)2 * f * d);
        float* out = fused.data();
        for (int64_t b = 0; b < f; b += kGateUpBlock) {
          int64_t c = std::min(kGateUpBlock, f - b);
          std::memcpy(out, g.data() + b * d, c * d * sizeof(float)), out += c * d;
          std::memcpy(out, u.data() + b * d, c * d * sizeof(float)), out += c * d;
        }
        L.w_gate_up = kt_.pack(fused.data(), 2 * f, d, cfg_.weight_type, &pack_threads_);
        pending_.erase(ng), pending_.erase(nu);
      }
    } else if (part == "w_down") {
      check_shape(name, shape, {d, cfg_.ffn_dim});
      L.w_down = kt_.pack(data, d, cfg_.ffn_dim, cfg_.weight_type, &pack_threads_);
    } else {
      throw std::invalid_argument("unknown weight " + name);
    }
  }
}

// The matrices fused with `name` (q/k/v, gate/up), itself included; empty for any other weight.
static std::vector<std::string> fused_partners(const std::string& name) {
  size_t dot = name.rfind('.');
  if (name.rfind("layers.", 0) != 0 || dot == std::string::npos) return {};
  const std::string prefix = name.substr(0, dot + 1), part = name.substr(dot + 1);
  if (part == "wq" || part == "wk" || part == "wv") return {prefix + "wq", prefix + "wk", prefix + "wv"};
  if (part == "w_gate" || part == "w_up") return {prefix + "w_gate", prefix + "w_up"};
  return {};
}

// A float partner arrived: its pending raw partners are dequantized so they fuse as fp32.
void Model::raw_partners_to_f32(const std::string& name) {
  for (const std::string& p : fused_partners(name)) {
    auto it = pending_raw_.find(p);
    if (it == pending_raw_.end()) continue;
    const int64_t cols = cfg_.dim;  // every fused matrix has dim columns
    const int64_t rows = (int64_t)(it->second.second.size() / quant::ggml_block_bytes(it->second.first) / (cols / 32));
    std::vector<float> f((size_t)rows * cols);
    quant::dequantize_ggml(it->second.first, it->second.second.data(), rows, cols, f.data());
    pending_raw_.erase(it);
    set_weight(p, f.data(), {rows, cols});
  }
}

void Model::set_weight_raw(const std::string& name, WeightType type, const uint8_t* raw, size_t nbytes,
                           const std::vector<int64_t>& shape) {
  require(!ready_, "weights can't change after finalize()");
  require(quant::is_quant(type), "raw weights must be Q8_0, Q4_0 or Q4_1 blocks");
  require(shape.size() == 2, "raw weight " + name + " must be a matrix");
  quant::check_raw(type, nbytes, shape[0], shape[1]);
  if (name.rfind("layers.", 0) == 0) {
    size_t dot = name.find('.', 7);
    std::string idx = dot == std::string::npos ? "" : name.substr(7, dot - 7);
    require(!idx.empty() && idx.size() <= 6 && std::all_of(idx.begin(), idx.end(), ::isdigit) &&
                std::stoll(idx) < cfg_.n_layers, "unknown weight " + name);
  }
  const int64_t d = cfg_.dim, hd = cfg_.head_dim, q_rows = cfg_.n_heads * hd, kv_rows = cfg_.n_kv_heads * hd;
  const int64_t f = cfg_.ffn_dim;
  auto as_f32 = [&] {  // a weight this path does not fuse raw
    std::vector<float> v((size_t)shape[0] * shape[1]);
    quant::dequantize_ggml(type, raw, shape[0], shape[1], v.data());
    set_weight(name, v.data(), shape);
  };
  const std::vector<std::string> partners = fused_partners(name);
  const std::string part = name.substr(name.rfind('.') + 1);
  if (name == "tok_embeddings" || name == "lm_head" || part == "wo" || part == "w_down") {
    if (name == "lm_head") require(!cfg_.tie_embeddings, "lm_head given for a model with tied embeddings");
    std::vector<int64_t> want = name == "tok_embeddings" || name == "lm_head" ? std::vector<int64_t>{cfg_.vocab_size, d}
                                : part == "wo" ? std::vector<int64_t>{d, q_rows} : std::vector<int64_t>{d, f};
    if (name.rfind("layers.", 0) == 0) {
      std::string idx = name.substr(7, name.find('.', 7) - 7);
      check_shape(name, shape, want);
      PackedMatrix m = kt_.pack_raw(type, raw, shape[0], shape[1], &pack_threads_);
      LayerWeights& L = layers_[std::stoll(idx)];
      (part == "wo" ? L.wo : L.w_down) = m;
    } else {
      check_shape(name, shape, want);
      PackedMatrix m = kt_.pack_raw(type, raw, shape[0], shape[1], &pack_threads_);
      (name == "tok_embeddings" ? tok_embeddings_ : lm_head_) = m;
      if (name == "tok_embeddings" && cfg_.tie_embeddings) lm_head_ = m;
    }
    return;
  }
  if (partners.empty()) return as_f32();  // norms, biases: set_weight reports what is wrong
  check_shape(name, shape, {part == "wq" ? q_rows : part == "wk" || part == "wv" ? kv_rows : f, d});
  for (const std::string& p : partners)
    if (p != name && (pending_.count(p) || (pending_raw_.count(p) && pending_raw_[p].first != type))) {
      raw_partners_to_f32(name);  // partners of another type: everything fuses as fp32
      return as_f32();
    }
  pending_raw_[name] = {type, std::vector<uint8_t>(raw, raw + nbytes)};
  for (const std::string& p : partners)
    if (!pending_raw_.count(p)) return;
  // All partners are raw blocks of one type: concatenate (q, k, v) or interleave (gate/up) whole rows.
  const size_t row_bytes = (size_t)(d / 32) * quant::ggml_block_bytes(type);
  std::vector<uint8_t> fused;
  int64_t rows = 0;
  if (partners.size() == 3) {
    for (const std::string& p : partners) fused.insert(fused.end(), pending_raw_[p].second.begin(), pending_raw_[p].second.end());
    rows = q_rows + 2 * kv_rows;
  } else {
    const std::vector<uint8_t>&g = pending_raw_[partners[0]].second, &u = pending_raw_[partners[1]].second;
    fused.reserve(2 * g.size());
    for (int64_t b = 0; b < f; b += kGateUpBlock) {
      int64_t c = std::min(kGateUpBlock, f - b);
      fused.insert(fused.end(), g.begin() + b * row_bytes, g.begin() + (b + c) * row_bytes);
      fused.insert(fused.end(), u.begin() + b * row_bytes, u.begin() + (b + c) * row_bytes);
    }
    rows = 2 * f;
  }
  size_t dot = name.find('.', 7);
  LayerWeights& L = layers_[std::stoll(name.substr(7, dot - 7))];
  (partners.size() == 3 ? L.wqkv : L.w_gate_up) = kt_.pack_raw(type, fused.data(), rows, d, &pack_threads_);
  for (const std::string& p : partners) pending_raw_.erase(p);
}

void Model::finalize() {
  auto missing = [](const std::string& what) { throw std::invalid_argument("missing weight " + what); };
  if (!tok_embeddings_.storage) missing("tok_embeddings");
  if (!lm_head_.storage) missing("lm_head");
  if (norm_.empty()) missing("norm");
  for (int64_t i = 0; i < cfg_.n_layers; i++) {
    const LayerWeights& L = layers_[i];
    std::string p = "layers." + std::to_string(i) + ".";
    if (L.attn_norm.empty()) missing(p + "attn_norm");
    if (L.ffn_norm.empty()) missing(p + "ffn_norm");
    if (!L.wqkv.storage) missing(p + "wq/wk/wv");
    if (!L.wo.storage) missing(p + "wo");
    if (!L.w_gate_up.storage) missing(p + "w_gate/w_up");
    if (!L.w_down.storage) missing(p + "w_down");
    if (cfg_.attention_bias && L.bqkv.empty()) missing(p + "bq/bk/bv");
  }
  pending_.clear();
  pending_raw_.clear();
  // Decode reads every matrix once per token in this order: one stream on 2 MiB pages instead of a
  // few hundred buffers (the small ones on 4 KiB pages). Kernel stream alone, q4, one thread: 0.8 -> 0.9
  // of a plain read (tools/bench_quant.py --stream).
  std::vector<PackedMatrix*> order;
  for (const NamedMatrix& nm : matrices_in_decode_order()) order.push_back(nm.m);
  pack_contiguously(order);
  place_weights();
  numa_status_ = numa_summary(numa_, numa_places_memory(), placed_);
  ready_ = true;
}

std::vector<std::tuple<std::string, uintptr_t, size_t>> Model::weight_spans() const {
  std::vector<std::tuple<std::string, uintptr_t, size_t>> out;
  for (const NamedMatrix& nm : const_cast<Model*>(this)->matrices_in_decode_order())
    out.emplace_back(nm.name, (uintptr_t)nm.m->data(), nm.m->nbytes);
  return out;
}

size_t Model::weight_bytes() const {
  size_t total = lm_head_.bytes();
  for (const LayerWeights& L : layers_) total += L.wqkv.bytes() + L.wo.bytes() + L.w_gate_up.bytes() + L.w_down.bytes();
  return total;
}

// ---------------------------------------------------------------------------------------------
// Forward pass

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
  hb_.assign(nth * T * 2 * cfg_.ffn_dim, 0.f);
  act_.assign(T * cfg_.ffn_dim, 0.f);
  // room for any matrix's quantized input of up to T rows (0 bytes with float weights)
  qact_ld_ = 0;
  auto fit = [&](const PackedMatrix& w) {
    for (int64_t m = 1; m <= T; m++) qact_ld_ = std::max(qact_ld_, (kt_.quant_act_bytes(w, m, cfg_.act_type) + 63) / 64 * 64);
  };
  for (const LayerWeights& L : layers_)
    for (const PackedMatrix* w : {&L.wqkv, &L.wo, &L.w_gate_up, &L.w_down}) fit(*w);
  fit(lm_head_);
  qact_ = qact_ld_ ? aligned_buffer(nth * qact_ld_) : nullptr;
  scores_.assign(nth * (cfg_.n_heads / cfg_.n_kv_heads) * cfg_.max_seq_len, 0.f);
  out_rows_.assign(T * cfg_.dim, 0.f);
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
  check_batch(tokens, seqs, n_seqs);
  run(tokens, seqs, n_seqs, logits);
}

void Model::check_batch(const int32_t* tokens, const SeqSlice* seqs, int64_t n_seqs) const {
  require(ready_, "model weights are incomplete: call finalize() after setting every weight");
  const int64_t B = kv_.block_size();
  int64_t t = 0;
  for (int64_t i = 0; i < n_seqs; i++) {
    const SeqSlice& s = seqs[i];
    require(s.n_tokens >= 1, "every sequence in a batch needs at least one token");
    const int64_t end = s.pos + s.n_tokens;  // one past the last position
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
struct NormedInput {
  const KernelTable* k;
  const float *x, *norm;
  float* xb;       // [buffers][ld_buf]
  int64_t ld_buf, T, d;
  float eps;
  const float* rows(int buf) const { return xb + (size_t)buf * ld_buf; }
  void prepare(int buf) const {
    float* out = xb + (size_t)buf * ld_buf;
    for (int64_t t = 0; t < T; t++) k->rmsnorm(out + t * d, x + t * d, norm, d, eps);
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
  void prepare(int buf, const float* x, int64_t m, int64_t ldx) const {
    if (qa) k->quantize_act(x, m, ldx, *w, act, qa + buf * ld_qa);
  }
  void run(int buf, const float* x, int64_t m, int64_t ldx, float* y, int64_t ldy, int64_t n0, int64_t n1) const {
    if (!qa) return k->matmul(x, m, ldx, *w, y, ldy, n0, n1);
    k->matmul_quant(qa + buf * ld_qa, m, act, *w, y, ldy, n0, n1);
  }
};

// Attention norm, q/k/v projection, bias and RoPE by whole heads; the commit also writes keys and
// values to the cache.
struct QkvTask {
  NormedInput in;
  TaskMatmul mm;
  const float *bias, *rope_cos, *rope_sin;  // bias may be null
  const int64_t *tok_pos, *tok_seq;
  float* qkv;  // [T][qkv_dim]
  KVCache* kv;
  const SeqSlice* seqs;
  int64_t layer, hd, nh, nkv, block_size;
  void prepare(int buf) const { in.prepare(buf), mm.prepare(buf, in.rows(buf), in.T, in.d); }
  void compute(int buf, int64_t h0, int64_t h1, float* s, int64_t ld) const {
    const int64_t half = hd / 2;
    mm.run(buf, in.rows(buf), in.T, in.d, s - h0 * hd, ld, h0 * hd, h1 * hd);
    for (int64_t t = 0; t < in.T; t++) {
      const float* cs = rope_cos + tok_pos[t] * half;
      const float* sn = rope_sin + tok_pos[t] * half;
      for (int64_t h = h0; h < h1; h++) {
        float* v = s + t * ld + (h - h0) * hd;
        if (bias)
          for (int64_t i = 0; i < hd; i++) v[i] += bias[h * hd + i];
        if (h < nh + nkv) {  // rotate-half RoPE on q and k heads
          for (int64_t i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cs[i] - b * sn[i];
            v[i + half] = b * cs[i] + a * sn[i];
          }
        }
      }
    }
  }
  void commit(int64_t h0, int64_t h1, const float* s, int64_t ld) const {
    const int64_t qkv_dim = (nh + 2 * nkv) * hd;
    for (int64_t t = 0; t < in.T; t++) {
      std::memcpy(qkv + t * qkv_dim + h0 * hd, s + t * ld, (h1 - h0) * hd * sizeof(float));
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
  void prepare(int buf) const { in.prepare(buf), mm.prepare(buf, in.rows(buf), in.T, in.d); }
  void compute(int buf, int64_t b0, int64_t b1, float* s, int64_t ld) const {
    const int64_t T = in.T;
    float* h = hb + (size_t)buf * T * 2 * f;
    mm.run(buf, in.rows(buf), T, in.d, h, 2 * f, 2 * b0 * block, std::min(2 * b1 * block, 2 * f));
    for (int64_t t = 0; t < T; t++)
      for (int64_t b = b0; b < b1; b++) {
        const int64_t c = std::min(block, f - b * block);
        const float* g = h + t * 2 * f + 2 * b * block;
        in.k->silu_mul(s + t * ld + (b - b0) * block, g, g + c, c);
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
  void prepare(int buf) const { mm.prepare(buf, in, m, ld_in); }
  void compute(int buf, int64_t n0, int64_t n1, float* s, int64_t ld) const {
    mm.run(buf, in, m, ld_in, s - n0, ld, n0, n1);
  }
  void commit(int64_t n0, int64_t n1, const float* s, int64_t ld) const {
    for (int64_t t = 0; t < m; t++) {
      float* y = out + t * n_out + n0;
      const float* r = s + t * ld;
      if (accumulate)
        for (int64_t i = 0; i < n1 - n0; i++) y[i] += r[i];
      else
        std::memcpy(y, r, (n1 - n0) * sizeof(float));
    }
  }
};

}  // namespace

void Model::run(const int32_t* tokens, const SeqSlice* seqs, int64_t n_seqs, float* logits) {
  int64_t T = 0;
  for (int64_t i = 0; i < n_seqs; i++) T += seqs[i].n_tokens;
  ensure_scratch(T);
  for (int64_t i = 0, t = 0; i < n_seqs; i++)
    for (int64_t j = 0; j < seqs[i].n_tokens; j++, t++) tok_seq_[t] = i, tok_pos_[t] = seqs[i].pos + j;
  const KernelTable& k = kt_;
  const int64_t d = cfg_.dim, hd = cfg_.head_dim, nh = cfg_.n_heads, nkv = cfg_.n_kv_heads;
  const int64_t f = cfg_.ffn_dim, GB = kGateUpBlock;
  float* x = x_.data();
  for (int64_t t = 0; t < T; t++) k.row_to_f32(tok_embeddings_, tokens[t], x + t * d);

  auto normed = [&](const std::vector<float>& w) {
    return NormedInput{&k, x, w.data(), xb_.data(), scratch_tokens_ * d, T, d, cfg_.norm_eps};
  };
  auto task_matmul = [&](const PackedMatrix& w) {
    const bool quantized = k.quant_act_bytes(w, 1, cfg_.act_type) != 0;
    return TaskMatmul{&k, &w, quantized ? static_cast<uint8_t*>(qact_.get()) : nullptr, qact_ld_, cfg_.act_type};
  };
  auto matmul_residual = [&](const float* in, int64_t ld, const PackedMatrix& w) {
    pool_.parallel_chunks(MatmulTask{task_matmul(w), in, T, ld, x, d, true}, chunking(w, d, kRowGrain, T, 1));
  };

  for (int64_t l = 0; l < cfg_.n_layers; l++) {
    const LayerWeights& L = layers_[l];
    const QkvTask qkv{normed(L.attn_norm), task_matmul(L.wqkv), L.bqkv.empty() ? nullptr : L.bqkv.data(), rope_cos_.data(),
                      rope_sin_.data(), tok_pos_.data(), tok_seq_.data(), qkv_.data(), &kv_, seqs, l, hd, nh,
                      nkv, kv_.block_size()};
    pool_.parallel_chunks(qkv, chunking(L.wqkv, nh + 2 * nkv, 1, T, hd));
    attention(l, seqs, T);
    matmul_residual(att_.data(), nh * hd, L.wo);
    const int64_t blocks = (f + GB - 1) / GB;
    pool_.parallel_chunks(GateUpTask{normed(L.ffn_norm), task_matmul(L.w_gate_up), hb_.data(), act_.data(), f, GB},
                          chunking(L.w_gate_up, blocks, 1, T, GB));
    matmul_residual(act_.data(), f, L.w_down);
  }

  if (!logits) return;
  // the rows whose logits are wanted, normalized, then one matmul over the vocabulary
  int64_t rows = 0;
  for (int64_t i = 0, t = 0; i < n_seqs; t += seqs[i].n_tokens, i++) {
    const int64_t first = seqs[i].all_logits ? t : t + seqs[i].n_tokens - 1;
    for (int64_t r = first; r < t + seqs[i].n_tokens; r++, rows++)
      k.rmsnorm(out_rows_.data() + rows * d, x + r * d, norm_.data(), d, cfg_.norm_eps);
  }
  pool_.parallel_chunks(MatmulTask{task_matmul(lm_head_), out_rows_.data(), rows, d, logits, cfg_.vocab_size, false},
                        chunking(lm_head_, cfg_.vocab_size, kRowGrain, rows, 1));
}

// Causal (optionally sliding-window) grouped-query attention of every new token over its own sequence.
// A task is one token's query heads that share a kv head (or a part of them when there are too few
// tasks to keep the threads busy), so each key and value read serves several heads.
void Model::attention(int64_t l, const SeqSlice* seqs, int64_t T) {
  const int64_t hd = cfg_.head_dim, nh = cfg_.n_heads, nkv = cfg_.n_kv_heads, group = nh / nkv;
  const int64_t qkv_dim = (nh + 2 * nkv) * hd;
  const float scale = 1.f / std::sqrt((float)hd);
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
    const int64_t p = tok_pos_[t];
    const int64_t start = cfg_.sliding_window > 0 ? std::max<int64_t>(0, p - cfg_.sliding_window + 1) : 0;
    kv_.attend(kt_, l, kvh, seqs[tok_seq_[t]].blocks, start, p, qkv_.data() + t * qkv_dim + h0 * hd, G, scale, s,
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
