// Model weights: names, fusion (q/k/v, gate/up; fp32 or raw GGUF blocks) and packing in the kernel
// table's layout.
#include "model/weights.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <stdexcept>

#include "kernels/ggml_formats.h"
#include "model/model.h"

namespace corelm {

static bool all_digits(const std::string& s) {
  return !s.empty() && s.size() <= 6 && std::all_of(s.begin(), s.end(), ::isdigit);
}

WeightName parse_weight_name(const std::string& name, int64_t n_layers, int64_t n_experts) {
  for (const char* global : {"tok_embeddings", "lm_head", "norm", "norm_bias", "pos_embeddings", "type_embeddings",
                             "embed_norm", "embed_norm_bias"})
    if (name == global) return {-1, -1, name};
  const size_t dot = name.rfind("layers.", 0) == 0 ? name.find('.', 7) : std::string::npos;
  const std::string idx = dot == std::string::npos ? "" : name.substr(7, dot - 7);
  require(all_digits(idx), "unknown weight " + name);
  const int64_t layer = std::stoll(idx);
  require(layer < n_layers, "weight " + name + " is beyond the model's " + std::to_string(n_layers) + " layers");
  std::string part = name.substr(dot + 1);
  if (part.rfind("experts.", 0) != 0) return {layer, -1, part};
  const size_t edot = part.find('.', 8);
  const std::string eidx = edot == std::string::npos ? "" : part.substr(8, edot - 8);
  require(all_digits(eidx), "unknown weight " + name);
  const int64_t expert = std::stoll(eidx);
  require(expert < n_experts, "weight " + name + " is beyond the model's " + std::to_string(n_experts) + " experts");
  part = part.substr(edot + 1);
  require(part == "w_gate" || part == "w_up" || part == "w_down", "unknown weight " + name);
  return {layer, expert, part};
}

std::string layer_weight_name(int64_t layer, const std::string& part) {
  return "layers." + std::to_string(layer) + "." + part;
}

std::string weight_name(const WeightName& w) {
  if (w.layer < 0) return w.part;
  return layer_weight_name(w.layer, w.expert < 0 ? w.part : "experts." + std::to_string(w.expert) + "." + w.part);
}

std::vector<std::string> fused_parts(const std::string& part) {
  if (part == "wq" || part == "wk" || part == "wv") return {"wq", "wk", "wv"};
  if (part == "w_gate" || part == "w_up") return {"w_gate", "w_up"};
  return {};
}

void interleave_gate_up(const void* gate, const void* up, int64_t rows, size_t row_bytes, void* out) {
  const char *g = static_cast<const char*>(gate), *u = static_cast<const char*>(up);
  char* o = static_cast<char*>(out);
  for (int64_t b = 0; b < rows; b += kGateUpBlock) {
    const size_t bytes = (size_t)std::min(kGateUpBlock, rows - b) * row_bytes;
    std::memcpy(o, g + b * row_bytes, bytes), o += bytes;
    std::memcpy(o, u + b * row_bytes, bytes), o += bytes;
  }
}

static std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); i++) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}

static void check_shape(const std::string& name, const std::vector<int64_t>& got, std::vector<int64_t> want) {
  require(got == want, "weight " + name + " has shape " + shape_str(got) + ", expected " + shape_str(want));
}

// The full names of the weights fused with w, itself included; empty for a weight not fused.
static std::vector<std::string> partner_names(const WeightName& w) {
  std::vector<std::string> out;
  if (w.layer >= 0)
    for (const std::string& p : fused_parts(w.part)) out.push_back(weight_name({w.layer, w.expert, p}));
  return out;
}

// The dense MLP's parts in a mixture-of-experts layer, or a router or expert without experts, are
// mistakes of the caller's, not weights to drop.
static void check_mlp_part(const WeightName& w, const ModelConfig& cfg, const std::string& name) {
  const bool mlp = w.part == "w_gate" || w.part == "w_up" || w.part == "w_down";
  if (cfg.moe())
    require(!(mlp && w.expert < 0), "weight " + name + " given for a mixture-of-experts model: its layers have a "
                                    "router and experts.<j>.w_gate/w_up/w_down");
  else
    require(w.part != "router", "weight " + name + " given for a model without experts");
}

// The fused gate/up and the down matrix w belongs to: the layer's dense MLP's or its expert's.
static PackedMatrix& gate_up_of(LayerWeights& L, const WeightName& w) {
  return w.expert < 0 ? L.w_gate_up : L.experts[w.expert].w_gate_up;
}
static PackedMatrix& down_of(LayerWeights& L, const WeightName& w) {
  return w.expert < 0 ? L.w_down : L.experts[w.expert].w_down;
}

template <class T>
std::vector<T> Model::SpareBuffers<T>::take(size_t n) {
  // the smallest spare that holds n elements, else the largest one (grown, its old pages go back)
  auto fits = [n](const std::vector<T>& v) { return v.capacity() >= n; };
  auto before = [&](const std::vector<T>& a, const std::vector<T>& b) {
    if (fits(a) != fits(b)) return fits(a);
    return fits(a) ? a.capacity() < b.capacity() : a.capacity() > b.capacity();
  };
  auto best = std::min_element(spare.begin(), spare.end(), before);
  std::vector<T> v;
  if (best != spare.end()) v = std::move(*best), spare.erase(best);
  v.resize(n);
  return v;
}

std::vector<float> Model::copy_f32(const float* data, int64_t n) {
  std::vector<float> v = spare_f32_.take((size_t)n);
  std::copy(data, data + n, v.begin());
  return v;
}

// A partner copy that is no longer needed: its buffer goes to the spares.
void Model::drop_pending(const std::string& key) {
  if (auto it = pending_.find(key); it != pending_.end()) spare_f32_.give(std::move(it->second)), pending_.erase(it);
  if (auto it = pending_raw_.find(key); it != pending_raw_.end())
    spare_raw_.give(std::move(it->second.second)), pending_raw_.erase(it);
}

void Model::set_weight(const std::string& name, const float* data, const std::vector<int64_t>& shape) {
  require(!ready_, "weights can't change after finalize()");
  const WeightName w = parse_weight_name(name, cfg_.n_layers, cfg_.n_experts);
  check_mlp_part(w, cfg_, name);
  if (!pending_raw_.empty()) raw_partners_to_f32(w);
  const int64_t d = cfg_.dim, hd = cfg_.head_dim, q_rows = cfg_.n_heads * hd, kv_rows = cfg_.n_kv_heads * hd;
  const int64_t f = cfg_.ffn_dim;
  auto vec = [&](int64_t n) { return std::vector<float>(data, data + n); };
  const std::string& part = w.part;
  if (w.layer < 0) {
    if (part == "tok_embeddings") {
      check_shape(name, shape, {cfg_.vocab_size, d});
      tok_embeddings_ = kt_.pack(data, cfg_.vocab_size, d, cfg_.weight_type, &pack_threads_);
      if (cfg_.tie_embeddings) lm_head_ = tok_embeddings_;
    } else if (part == "lm_head") {
      require(!cfg_.tie_embeddings, "lm_head given for a model with tied embeddings");
      check_shape(name, shape, {cfg_.logits_size(), d});
      lm_head_ = kt_.pack(data, cfg_.logits_size(), d, cfg_.weight_type, &pack_threads_);
    } else if (part == "pos_embeddings" || part == "type_embeddings") {
      const bool pos = part == "pos_embeddings";
      require(pos ? cfg_.n_positions > 0 : cfg_.n_token_types > 0, "weight " + name + " given for a model without it");
      check_shape(name, shape, {pos ? cfg_.n_positions : cfg_.n_token_types, d});
      (pos ? pos_embeddings_ : type_embedding_) = vec((pos ? cfg_.n_positions : 1) * d);
    } else {  // norm, embed_norm and their biases
      require(part.find("embed_norm") != 0 || cfg_.norm_after_residual,
              "weight " + name + " given for a model without an embeddings norm");
      require(part.find("_bias") == std::string::npos || cfg_.layer_norm,
              "weight " + name + " given for a model without LayerNorm");
      check_shape(name, shape, {d});
      (part == "norm" ? norm_ : part == "norm_bias" ? norm_bias_ : part == "embed_norm" ? embed_norm_ : embed_norm_bias_) =
          vec(d);
    }
    return;
  }
  LayerWeights& L = layers_[w.layer];
  const std::string key = weight_name(w);  // "layers.01.wq" waits as "layers.1.wq"
  const std::vector<std::string> partners = partner_names(w);
  auto all_pending = [&] {
    return std::all_of(partners.begin(), partners.end(), [&](const std::string& p) { return pending_.count(p) > 0; });
  };
  if (part == "attn_norm" || part == "ffn_norm") {
    check_shape(name, shape, {d});
    (part == "attn_norm" ? L.attn_norm : L.ffn_norm) = vec(d);
  } else if (part == "attn_norm_bias" || part == "ffn_norm_bias") {
    require(cfg_.layer_norm, "weight " + name + " given for a model without LayerNorm");
    check_shape(name, shape, {d});
    (part == "attn_norm_bias" ? L.attn_norm_bias : L.ffn_norm_bias) = vec(d);
  } else if (part == "bo" || part == "b_up" || part == "b_down") {
    require(cfg_.output_bias, "weight " + name + " given for a model without output biases");
    const int64_t n = part == "b_up" ? f : d;
    check_shape(name, shape, {n});
    (part == "bo" ? L.bo : part == "b_up" ? L.b_up : L.b_down) = vec(n);
  } else if (part == "w_up" && !cfg_.gated_mlp) {
    check_shape(name, shape, {f, d});
    L.w_up = kt_.pack(data, f, d, cfg_.weight_type, &pack_threads_);
  } else if (part == "post_attn_norm" || part == "post_ffn_norm") {
    require(cfg_.post_norms, "weight " + name + " given for a model without post-norms");
    check_shape(name, shape, {d});
    (part == "post_attn_norm" ? L.post_attn_norm : L.post_ffn_norm) = vec(d);
  } else if (part == "q_norm" || part == "k_norm") {
    require(cfg_.qk_norm || cfg_.qk_norm_whole, "weight " + name + " given for a model without q/k norms");
    const int64_t n = !cfg_.qk_norm_whole ? hd : part == "q_norm" ? q_rows : kv_rows;
    check_shape(name, shape, {n});
    (part == "q_norm" ? L.q_norm : L.k_norm) = vec(n);
  } else if (part == "router") {
    check_shape(name, shape, {cfg_.n_experts, d});
    L.router = kt_.pack(data, cfg_.n_experts, d, WeightType::F32, &pack_threads_);
  } else if (part == "wq" || part == "wk" || part == "wv") {
    check_shape(name, shape, {part == "wq" ? q_rows : kv_rows, d});
    pending_[key] = copy_f32(data, shape[0] * d);
    if (all_pending()) {  // q, k and v rows one after the other
      std::vector<float> fused = spare_f32_.take((q_rows + 2 * kv_rows) * d);
      float* at = fused.data();
      for (const std::string& p : partners) at = std::copy(pending_[p].begin(), pending_[p].end(), at);
      L.wqkv = kt_.pack(fused.data(), q_rows + 2 * kv_rows, d, cfg_.weight_type, &pack_threads_);
      spare_f32_.give(std::move(fused));
      for (const std::string& p : partners) drop_pending(p);
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
    check_shape(name, shape, {f, d});
    pending_[key] = copy_f32(data, f * d);
    if (all_pending()) {
      std::vector<float> fused = spare_f32_.take((size_t)2 * f * d);
      interleave_gate_up(pending_[partners[0]].data(), pending_[partners[1]].data(), f, d * sizeof(float), fused.data());
      gate_up_of(L, w) = kt_.pack(fused.data(), 2 * f, d, cfg_.weight_type, &pack_threads_);
      spare_f32_.give(std::move(fused));
      for (const std::string& p : partners) drop_pending(p);
    }
  } else if (part == "w_down") {
    check_shape(name, shape, {d, f});
    down_of(L, w) = kt_.pack(data, d, f, cfg_.weight_type, &pack_threads_);
  } else {
    throw std::invalid_argument("unknown weight " + name);
  }
}

// A float partner of w arrived: its pending raw partners are dequantized so they fuse as fp32.
void Model::raw_partners_to_f32(const WeightName& w) {
  for (const std::string& p : partner_names(w)) {
    auto it = pending_raw_.find(p);
    if (it == pending_raw_.end()) continue;
    const int64_t cols = cfg_.dim;  // every fused matrix has dim columns
    const int64_t rows = (int64_t)(it->second.second.size() / quant::ggml_row_bytes(it->second.first, cols));
    std::vector<float> f((size_t)rows * cols);
    quant::dequantize_ggml(it->second.first, it->second.second.data(), rows, cols, f.data());
    spare_raw_.give(std::move(it->second.second));
    pending_raw_.erase(it);
    set_weight(p, f.data(), {rows, cols});
  }
}

void Model::set_weight_raw(const std::string& name, WeightType type, const uint8_t* raw, size_t nbytes,
                           const std::vector<int64_t>& shape) {
  require(!ready_, "weights can't change after finalize()");
  require(quant::is_raw_type(type) || quant::is_bf16_rows(type),
          "raw weights must be GGUF blocks or bf16 rows of a type the kernels take");
  require(shape.size() == 2, "raw weight " + name + " must be a matrix");
  quant::check_raw(type, nbytes, shape[0], shape[1]);
  const WeightName w = parse_weight_name(name, cfg_.n_layers, cfg_.n_experts);
  check_mlp_part(w, cfg_, name);
  const int64_t d = cfg_.dim, hd = cfg_.head_dim, q_rows = cfg_.n_heads * hd, kv_rows = cfg_.n_kv_heads * hd;
  const int64_t f = cfg_.ffn_dim;
  auto as_f32 = [&] {  // a weight this path does not fuse raw
    std::vector<float> v((size_t)shape[0] * shape[1]);
    quant::dequantize_ggml(type, raw, shape[0], shape[1], v.data());
    set_weight(name, v.data(), shape);
  };
  // bf16 rows for a model whose matrices are not bf16: converted as float weights are
  if (type == WeightType::BF16 && cfg_.weight_type != WeightType::BF16) return as_f32();
  const std::string& part = w.part;
  const bool model_matrix = w.layer < 0 && (part == "tok_embeddings" || part == "lm_head");
  const bool gateless_up = w.layer >= 0 && part == "w_up" && !cfg_.gated_mlp;
  if (model_matrix || gateless_up || (w.layer >= 0 && (part == "wo" || part == "w_down"))) {  // packed as they come
    if (part == "lm_head") require(!cfg_.tie_embeddings, "lm_head given for a model with tied embeddings");
    check_shape(name, shape, model_matrix ? std::vector<int64_t>{part == "lm_head" ? cfg_.logits_size() : cfg_.vocab_size, d}
                             : part == "wo" ? std::vector<int64_t>{d, q_rows}
                             : gateless_up  ? std::vector<int64_t>{f, d}
                                            : std::vector<int64_t>{d, f});
    PackedMatrix m = kt_.pack_raw(type, raw, shape[0], shape[1], &pack_threads_);
    if (!model_matrix) {
      LayerWeights& L = layers_[w.layer];
      (part == "wo" ? L.wo : gateless_up ? L.w_up : down_of(L, w)) = m;
    } else {
      (part == "tok_embeddings" ? tok_embeddings_ : lm_head_) = m;
      if (part == "tok_embeddings" && cfg_.tie_embeddings) lm_head_ = m;
    }
    return;
  }
  const std::vector<std::string> partners = partner_names(w);
  if (partners.empty()) return as_f32();  // norms, biases: set_weight reports what is wrong
  check_shape(name, shape, {part == "wq" ? q_rows : part == "wk" || part == "wv" ? kv_rows : f, d});
  const std::string key = weight_name(w);
  for (const std::string& p : partners)
    if (p != key && (pending_.count(p) || (partners.size() == 2 && pending_raw_.count(p) && pending_raw_[p].first != type))) {
      raw_partners_to_f32(w);  // float partners, or gate/up of two types: everything fuses as fp32
      return as_f32();
    }
  for (const std::string& p : partners)
    if (p != key && !pending_raw_.count(p)) {  // a partner still to come: keep a copy of this one
      std::vector<uint8_t> copy = spare_raw_.take(nbytes);
      std::memcpy(copy.data(), raw, nbytes);
      pending_raw_[key] = {type, std::move(copy)};
      return;
    }
  // The last partner is read where the caller has it (no copy), the others from their copies.
  auto type_of = [&](const std::string& p) { return p == key ? type : pending_raw_[p].first; };
  auto bytes_of = [&](const std::string& p) -> std::pair<const uint8_t*, size_t> {
    if (p == key) return {raw, nbytes};
    const std::vector<uint8_t>& v = pending_raw_[p].second;
    return {v.data(), v.size()};
  };
  // q, k and v of different types: consecutive ones of one type fused, stacked (each in its own bits).
  if (partners.size() == 3 && (type_of(partners[0]) != type_of(partners[1]) || type_of(partners[1]) != type_of(partners[2]))) {
    PackedMatrix stacked;
    stacked.cols = d;
    for (size_t i = 0; i < partners.size();) {
      const WeightType t = type_of(partners[i]);
      size_t j = i, bytes = 0;
      for (; j < partners.size() && type_of(partners[j]) == t; j++) bytes += bytes_of(partners[j]).second;
      std::vector<uint8_t> run = spare_raw_.take(bytes);
      uint8_t* at = run.data();
      for (size_t k = i; k < j; k++) {
        const auto [src, n] = bytes_of(partners[k]);
        at = std::copy(src, src + n, at);
      }
      const int64_t rows = (int64_t)(run.size() / quant::ggml_row_bytes(t, d));
      stacked.parts.push_back(kt_.pack_raw(t, run.data(), rows, d, &pack_threads_));
      stacked.rows += rows;
      stacked.nbytes += stacked.parts.back().nbytes;
      spare_raw_.give(std::move(run));
      i = j;
    }
    stacked.type = stacked.parts.front().type;
    stacked.packed_by = &kt_;
    layers_[w.layer].wqkv = std::move(stacked);
    for (const std::string& p : partners) drop_pending(p);
    return;
  }
  // All partners are raw blocks of one type: concatenate (q, k, v) or interleave (gate/up) whole rows.
  size_t bytes = 0;
  for (const std::string& p : partners) bytes += bytes_of(p).second;
  std::vector<uint8_t> fused = spare_raw_.take(bytes);
  int64_t rows = 0;
  if (partners.size() == 3) {
    uint8_t* at = fused.data();
    for (const std::string& p : partners) {
      const auto [src, n] = bytes_of(p);
      at = std::copy(src, src + n, at);
    }
    rows = q_rows + 2 * kv_rows;
  } else {
    interleave_gate_up(bytes_of(partners[0]).first, bytes_of(partners[1]).first, f, quant::ggml_row_bytes(type, d), fused.data());
    rows = 2 * f;
  }
  LayerWeights& L = layers_[w.layer];
  (partners.size() == 3 ? L.wqkv : gate_up_of(L, w)) = kt_.pack_raw(type, fused.data(), rows, d, &pack_threads_);
  spare_raw_.give(std::move(fused));
  for (const std::string& p : partners) drop_pending(p);
}

void Model::finalize() {
  auto missing = [](const std::string& what) { throw std::invalid_argument("missing weight " + what); };
  if (!tok_embeddings_.storage) missing("tok_embeddings");
  if (!lm_head_.storage && !cfg_.encoder()) missing("lm_head");
  if (norm_.empty() && !cfg_.norm_after_residual) missing("norm");  // post-LN: the last ffn_norm is the last
  if (cfg_.layer_norm && !norm_.empty() && norm_bias_.empty()) missing("norm_bias");
  if (cfg_.n_positions && pos_embeddings_.empty()) missing("pos_embeddings");
  if (cfg_.n_token_types && type_embedding_.empty()) missing("type_embeddings");
  if (cfg_.norm_after_residual && (embed_norm_.empty() || (cfg_.layer_norm && embed_norm_bias_.empty())))
    missing(cfg_.layer_norm ? "embed_norm/embed_norm_bias" : "embed_norm");
  for (int64_t i = 0; i < cfg_.n_layers; i++) {
    const LayerWeights& L = layers_[i];
    const std::string p = layer_weight_name(i, "");
    if (L.attn_norm.empty()) missing(p + "attn_norm");
    if (L.ffn_norm.empty()) missing(p + "ffn_norm");
    if (cfg_.layer_norm && (L.attn_norm_bias.empty() || L.ffn_norm_bias.empty()))
      missing(p + "attn_norm_bias/ffn_norm_bias");
    if (cfg_.output_bias && (L.bo.empty() || L.b_down.empty() || (!cfg_.gated_mlp && L.b_up.empty())))
      missing(p + (cfg_.gated_mlp ? "bo/b_down" : "bo/b_up/b_down"));
    if (!cfg_.gated_mlp && !L.w_up.storage) missing(p + "w_up");
    if (!L.wqkv.storage && L.wqkv.parts.empty()) missing(p + "wq/wk/wv");
    if (!L.wo.storage) missing(p + "wo");
    if (!cfg_.moe() && cfg_.gated_mlp && !L.w_gate_up.storage) missing(p + "w_gate/w_up");
    if (!cfg_.moe() && !L.w_down.storage) missing(p + "w_down");
    if (cfg_.moe() && !L.router.storage) missing(p + "router");
    for (size_t e = 0; e < L.experts.size(); e++) {
      if (!L.experts[e].w_gate_up.storage) missing(p + "experts." + std::to_string(e) + ".w_gate/w_up");
      if (!L.experts[e].w_down.storage) missing(p + "experts." + std::to_string(e) + ".w_down");
    }
    if (cfg_.attention_bias && L.bqkv.empty()) missing(p + "bq/bk/bv");
    if ((cfg_.qk_norm || cfg_.qk_norm_whole) && (L.q_norm.empty() || L.k_norm.empty())) missing(p + "q_norm/k_norm");
    if (cfg_.post_norms && (L.post_attn_norm.empty() || L.post_ffn_norm.empty()))
      missing(p + "post_attn_norm/post_ffn_norm");
  }
  pending_.clear();
  pending_raw_.clear();
  spare_f32_ = {};
  spare_raw_ = {};
  release_freed_heap();  // the partner copies' freed heap
  // Decode reads every matrix once per token in this order: one stream (on 2 MiB pages where the machine
  // gives them cheaply: aligned_buffer) instead of a few hundred buffers. Kernel stream alone, q4, one
  // thread: 0.8 -> 0.9 of a plain read (tools/bench/bench_quant.py --stream).
  std::vector<PackedMatrix*> order;
  for (const NamedMatrix& nm : matrices_in_decode_order()) order.push_back(nm.m);
  pack_contiguously(order);
  place_weights();
  ready_ = true;
  if (huge_pages_came_slow()) start_huge_page_promotion();
}

std::vector<std::tuple<std::string, uintptr_t, size_t>> Model::weight_spans() const {
  std::vector<std::tuple<std::string, uintptr_t, size_t>> out;
  for (const NamedMatrix& nm : const_cast<Model*>(this)->matrices_in_decode_order())
    out.emplace_back(nm.name, (uintptr_t)nm.m->data(), nm.m->nbytes);
  return out;
}

size_t Model::weight_bytes() const {
  size_t total = lm_head_.bytes();
  for (const LayerWeights& L : layers_) {
    total += L.wqkv.bytes() + L.wo.bytes() + L.w_gate_up.bytes() + L.w_up.bytes() + L.w_down.bytes() + L.router.bytes();
    for (const ExpertWeights& e : L.experts) total += e.w_gate_up.bytes() + e.w_down.bytes();
  }
  return total;
}

size_t Model::active_weight_bytes() const {
  size_t total = weight_bytes();
  for (const LayerWeights& L : layers_) {
    size_t experts = 0;
    for (const ExpertWeights& e : L.experts) experts += e.w_gate_up.bytes() + e.w_down.bytes();
    if (!L.experts.empty()) total -= experts - experts * cfg_.n_experts_used / L.experts.size();
  }
  return total;
}

std::vector<Model::NamedMatrix> Model::matrices_in_decode_order() {
  std::vector<NamedMatrix> out;
  for (int64_t l = 0; l < cfg_.n_layers; l++) {
    LayerWeights& L = layers_[l];
    // (name, kind, matrix); a mixture-of-experts layer has the router and its experts for an MLP
    std::vector<std::tuple<std::string, const char*, PackedMatrix*>> kinds = {
        {layer_weight_name(l, "wqkv"), "wqkv", &L.wqkv}, {layer_weight_name(l, "wo"), "wo", &L.wo}};
    if (!cfg_.moe()) {
      if (cfg_.gated_mlp)
        kinds.emplace_back(layer_weight_name(l, "w_gate_up"), "w_gate_up", &L.w_gate_up);
      else
        kinds.emplace_back(layer_weight_name(l, "w_up"), "w_up", &L.w_up);
      kinds.emplace_back(layer_weight_name(l, "w_down"), "w_down", &L.w_down);
    } else {
      kinds.emplace_back(layer_weight_name(l, "router"), "router", &L.router);
      for (size_t e = 0; e < L.experts.size(); e++) {
        const std::string p = layer_weight_name(l, "experts." + std::to_string(e) + ".");
        kinds.emplace_back(p + "w_gate_up", "w_gate_up", &L.experts[e].w_gate_up);
        kinds.emplace_back(p + "w_down", "w_down", &L.experts[e].w_down);
      }
    }
    for (const auto& [name, kind, m] : kinds) {
      if (m->parts.empty()) {
        out.push_back({name, kind, m});
        continue;
      }
      int64_t r0 = 0;
      for (size_t i = 0; i < m->parts.size(); i++) {
        out.push_back({name + "." + std::to_string(i), kind, &m->parts[i], r0, m->rows});
        r0 += m->parts[i].rows;
      }
    }
  }
  if (!cfg_.encoder()) out.push_back({"lm_head", "lm_head", &lm_head_});
  out.push_back({"tok_embeddings", "", &tok_embeddings_});  // read a row per token; shares lm_head's bytes when tied
  return out;
}

}  // namespace corelm
