// LoRA adapters: registering them on the model, and the per-forward products (lora.h).
#include "model/lora.h"

#include <algorithm>
#include <cmath>

#include "model/model.h"

namespace corelm {

// ---- registering ----

static int lora_part_index(const std::string& part) {
  for (int i = 0; i < kLoraParts; i++)
    if (part == kLoraPartNames[i]) return i;
  return -1;
}

void Model::add_lora(int32_t id, int64_t rank, float scale, const std::vector<LoraWeights>& targets) {
  require(id >= 0, "a LoRA adapter id must be >= 0 (-1 is the base model)");
  require(!loras_.count(id), "LoRA adapter id " + std::to_string(id) + " is registered already");
  require(rank >= 1, "a LoRA adapter's rank must be >= 1");
  require(std::isfinite(scale), "a LoRA adapter's scale must be finite");
  require(!targets.empty(), "a LoRA adapter needs at least one target");
  const int64_t d = cfg_.dim, hd = cfg_.head_dim, q = cfg_.n_heads * hd, kv = cfg_.n_kv_heads * hd, f = cfg_.ffn_dim;
  const int64_t out_rows[kLoraParts] = {q, kv, kv, d, f, f, d}, in_cols[kLoraParts] = {d, d, d, q, d, d, f};
  auto adapter = std::make_unique<LoraAdapter>();
  adapter->rank = rank;
  adapter->layers.resize(cfg_.n_layers);
  for (const LoraWeights& t : targets) {
    const WeightName w = parse_weight_name(t.name, cfg_.n_layers);
    const int part = lora_part_index(w.part);
    require(w.layer >= 0 && part >= 0,
            "a LoRA adapter can target layers.<i>.{wq,wk,wv,wo,w_gate,w_up,w_down}, not " + t.name);
    require(part < 4 || (cfg_.gated_mlp && !cfg_.moe()),
            "LoRA targets of the MLP need a dense gated MLP (this model's is " +
                std::string(cfg_.moe() ? "a mixture of experts" : "gateless") + "): " + t.name);
    const std::vector<int64_t> a_shape{rank, in_cols[part]}, b_shape{out_rows[part], rank};
    require(t.a_shape == a_shape && t.b_shape == b_shape,
            "LoRA weights of " + t.name + " must be A [" + std::to_string(rank) + ", " + std::to_string(in_cols[part]) +
                "] and B [" + std::to_string(out_rows[part]) + ", " + std::to_string(rank) + "]");
    LoraProjection& p = adapter->layers[w.layer][part];
    require(p.a.rows == 0, "LoRA target " + t.name + " given twice");
    p.a = kt_.pack(t.a, rank, in_cols[part], WeightType::F32, nullptr);
    std::vector<float> b(t.b, t.b + out_rows[part] * rank);  // the scale folded into B once
    for (float& v : b) v *= scale;
    p.b = kt_.pack(b.data(), out_rows[part], rank, WeightType::F32, nullptr);
  }
  loras_[id] = std::move(adapter);
}

void Model::remove_lora(int32_t id) {
  require(loras_.count(id), "no LoRA adapter with id " + std::to_string(id));
  pool_.quiesce();  // a descheduled pool thread may still read its matrices
  loras_.erase(id);
}

std::vector<int32_t> Model::lora_ids() const {
  std::vector<int32_t> ids;
  for (const auto& [id, a] : loras_) ids.push_back(id);
  return ids;
}

// ---- one forward's products ----

namespace {
struct Parts {
  std::array<int, 3> part;
  std::array<int64_t, 3> offset, rows;  // offset: first fused row of a stacked part; -1 gate, -2 up
  int n;
};
}  // namespace

LoraPass::LoraPass(const KernelTable& k, const LoraShapes& shapes, const std::vector<const LoraAdapter*>& tok_adapter,
                   ThreadPool& pool, std::vector<float>& u_buf, std::vector<float>& tmp_buf)
    : k_(k), shapes_(shapes) {
  const int64_t T = (int64_t)tok_adapter.size();
  int64_t max_rank = 0;
  for (int64_t t = 0; t < T; t++) {
    const LoraAdapter* a = tok_adapter[t];
    if (!a) continue;
    max_rank = std::max(max_rank, a->rank);
    if (!runs_.empty() && runs_.back().t1 == t && runs_.back().adapter == a)
      runs_.back().t1++;
    else
      runs_.push_back(Run{t, t + 1, a});
  }
  if (runs_.empty()) return;
  ldu_ = 3 * max_rank;  // q, k and v: the site with the most projections
  tmp_ld_ = T * kStep;
  const size_t u_floats = T * ldu_, tmp_floats = pool.size() * tmp_ld_;
  if (u_buf.size() < u_floats || tmp_buf.size() < tmp_floats) {
    pool.quiesce();  // a descheduled pool thread may still read the old buffers
    u_buf.resize(std::max(u_buf.size(), u_floats));
    tmp_buf.resize(std::max(tmp_buf.size(), tmp_floats));
  }
  u_ = u_buf.data();
  tmp_ = tmp_buf.data();
}

static Parts site_parts(LoraSite site, const LoraShapes& s) {
  switch (site) {
    case LoraSite::Qkv: return Parts{{0, 1, 2}, {0, s.q_rows, s.q_rows + s.kv_rows}, {s.q_rows, s.kv_rows, s.kv_rows}, 3};
    case LoraSite::Wo: return Parts{{3, 0, 0}, {0, 0, 0}, {s.dim, 0, 0}, 1};
    case LoraSite::GateUp: return Parts{{4, 5, 0}, {-1, -2, 0}, {s.ffn, s.ffn, 0}, 2};
    case LoraSite::Down: return Parts{{6, 0, 0}, {0, 0, 0}, {s.dim, 0, 0}, 1};
  }
  return Parts{};
}

// Gate/up rows: block b holds c = min(kGateUpBlock, ffn - b * kGateUpBlock) gate rows, then c up rows.
static int64_t fused_row(int64_t offset, int64_t ffn, int64_t i) {
  if (offset >= 0) return offset + i;
  const int64_t G = kGateUpBlock, b = i / G, c = std::min(G, ffn - b * G);
  return b * 2 * G + (offset == -2 ? c : 0) + i % G;
}

// The part's rows whose fused row is below n.
static int64_t rows_before(int64_t offset, int64_t rows, int64_t n) {
  if (offset >= 0) return std::clamp<int64_t>(n - offset, 0, rows);
  const int64_t G = kGateUpBlock, b = n / (2 * G), base = b * G;
  if (base >= rows) return rows;
  const int64_t c = std::min(G, rows - base), within = n - b * 2 * G;
  return base + (offset == -1 ? std::min(within, c) : std::clamp<int64_t>(within - c, 0, c));
}

void LoraPass::down(ThreadPool& pool, LoraSite site, int64_t layer, const float* x, int64_t ldx) {
  const Parts ps = site_parts(site, shapes_);
  // units of work: (run, part, 8 rows of A), each writing its own columns of u
  struct Unit {
    const Run* run;
    const PackedMatrix* a;
    int64_t u_col, j0, j1;
  };
  std::vector<Unit> units;
  double macs = 0;
  for (const Run& r : runs_)
    for (int i = 0; i < ps.n; i++) {
      const PackedMatrix& a = r.adapter->layers[layer][ps.part[i]].a;
      for (int64_t j0 = 0; j0 < a.rows; j0 += 8) {
        units.push_back(Unit{&r, &a, i * r.adapter->rank, j0, std::min(a.rows, j0 + 8)});
        macs += (double)(r.t1 - r.t0) * (units.back().j1 - j0) * a.cols;
      }
    }
  auto run_unit = [&](const Unit& u) {
    const int64_t t0 = u.run->t0;
    k_.matmul(x + t0 * ldx, u.run->t1 - t0, ldx, *u.a, u_ + t0 * ldu_ + u.u_col, ldu_, u.j0, u.j1);
  };
  if (macs < (1 << 17)) {  // a few microseconds: less than waking the pool
    for (const Unit& u : units) run_unit(u);
    return;
  }
  pool.parallel([&](int slot, int n) {
    for (size_t i = slot; i < units.size(); i += n) run_unit(units[i]);
  });
}

void LoraPass::add(int buf, LoraSite site, int64_t layer, float* y, int64_t ldy, int64_t n0, int64_t n1) const {
  const Parts ps = site_parts(site, shapes_);
  float* tmp = tmp_ + buf * tmp_ld_;
  for (const Run& r : runs_) {
    const int64_t m = r.t1 - r.t0;
    for (int i = 0; i < ps.n; i++) {
      const PackedMatrix& b = r.adapter->layers[layer][ps.part[i]].b;
      if (!b.rows) continue;
      const int64_t offset = ps.offset[i], rows = ps.rows[i];
      const float* u = u_ + r.t0 * ldu_ + i * r.adapter->rank;
      const int64_t end = rows_before(offset, rows, n1);
      for (int64_t i0 = rows_before(offset, rows, n0); i0 < end; i0 += kStep) {
        const int64_t i1 = std::min(end, i0 + kStep);
        k_.matmul(u, m, ldu_, b, tmp - i0, kStep, i0, i1);  // tmp[t][n - i0] = (u B^T)[t][n]
        for (int64_t t = 0; t < m; t++) {
          float* yt = y + (r.t0 + t) * ldy;
          const float* dt = tmp + t * kStep;
          for (int64_t n = i0; n < i1; n++) yt[fused_row(offset, rows, n)] += dt[n - i0];
        }
      }
    }
  }
}

}  // namespace corelm
