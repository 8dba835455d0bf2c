#include "model/model.h"

#include <algorithm>
#include <atomic>
#include <chrono>
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
  // Pieces taken first come first served: while weights load, the GGUF tokenizer's Python thread shares
  // the cores, so halves fixed up front would leave one thread waiting for a descheduled other. The
  // workers sleep at once after each tensor, instead of spinning through the loader's Python between.
  pack_threads_ = [this](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
    const int64_t piece = std::max<int64_t>(1, n / (8 * pool_.size()));
    std::atomic<int64_t> next{0};
    pool_.parallel([&](int, int) {
      for (int64_t b0; (b0 = next.fetch_add(piece, std::memory_order_relaxed)) < n;)
        body(b0, std::min(n, b0 + piece));
    });
    pool_.park();
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
Model::~Model() {
  promoter_.stop.store(true);
  if (promoter_.thread.joinable()) promoter_.thread.join();
  pool_.quiesce();
}

namespace {
// When a forward of any model last started or ended, and how many run now: the promoter moves a page
// only after kQuietNs without one (a decode step's gap is a few ms), so a move (~15 ms, a VM's slow
// memory) never lands inside a request.
std::atomic<int64_t> g_forward_stamp_ns{0};
std::atomic<int> g_forwards_running{0};
constexpr int64_t kQuietNs = 100'000'000;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

Model::ForwardMark::ForwardMark() {
  g_forwards_running.fetch_add(1);
  g_forward_stamp_ns.store(now_ns());
}
Model::ForwardMark::~ForwardMark() {
  g_forward_stamp_ns.store(now_ns());
  g_forwards_running.fetch_sub(1);
}

void Model::start_huge_page_promotion() {
  // The weights' address ranges; those finalize() put end to end in one buffer (each on the next page
  // or 64 bytes, kernels.h: pack_contiguously) merged, so its 2 MiB pages count whole
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  for (const auto& [name, at, bytes] : weight_spans()) ranges.push_back({at, at + bytes});
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uintptr_t, uintptr_t>> merged;
  for (const auto& r : ranges)
    if (!merged.empty() && r.first <= merged.back().second + 4096 + 64)
      merged.back().second = std::max(merged.back().second, r.second);
    else
      merged.push_back(r);
  auto whole_pages = [](uintptr_t a, uintptr_t b) -> size_t {  // bytes of the 2 MiB pages inside [a, b)
    constexpr uintptr_t kHuge = 2 << 20;
    const uintptr_t first = (a + kHuge - 1) / kHuge, end = b / kHuge;
    return end > first ? (end - first) * kHuge : 0;
  };
  for (const auto& [a, b] : merged) promoter_.total += (int64_t)whole_pages(a, b);
  if (promoter_.total == 0) return;
  promoter_.running.store(true);
  g_forward_stamp_ns.store(now_ns());  // the rest of the load (tokenizer, KV cache) counts as busy too
  promoter_.thread = std::thread([this, merged] {
    make_current_thread_idle_priority();  // only CPU time nothing else wants: never delays a token
    for (const auto& [a, b] : merged) {
      bool unsupported = false;
      promoter_.done.fetch_add((int64_t)collapse_into_huge_pages(reinterpret_cast<void*>(a), b - a, [this] {
        while (!promoter_.stop.load() && (g_forwards_running.load() > 0 || now_ns() - g_forward_stamp_ns.load() < kQuietNs))
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        return !promoter_.stop.load();
      }, &unsupported));
      if (unsupported || promoter_.stop.load()) break;
    }
    promoter_.running.store(false);
  });
}

Model::HugePagePromotion Model::huge_page_promotion() const {
  return {promoter_.total, promoter_.done.load(), promoter_.running.load()};
}

void Model::set_pipeline(Transfer receive, Transfer send) {
  pool_.quiesce();
  receive_ = std::move(receive);
  send_ = std::move(send);
}

void Model::set_allreduce(Allreduce allreduce) {
  pool_.quiesce();
  allreduce_ = std::move(allreduce);
  scratch_tokens_ = 0;  // the partial sums need proj_: the scratch is sized anew at the next forward
}

}  // namespace corelm
