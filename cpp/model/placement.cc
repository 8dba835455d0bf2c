// The model's NUMA placement (runtime/numa.h): which node's memory holds which rows of every matrix and
// which kv heads of the KV cache, following the pool's split by node.
#include <cstdlib>
#include <string>

#include "kernels/tuning.h"
#include "model/model.h"

namespace corelm {

// ---------------------------------------------------------------------------------------------
// NUMA placement (runtime/numa.h): weights by rows, the KV cache by kv heads, each node's part on it

// Only under Distribute or Isolate, and only where there is more than one node to choose from;
// CORELM_NUMA_FORCE=1 places anyway, so a one-node machine can test the path (everything on node 0).
bool Model::numa_places_memory() const {
  return !numa_.shares.empty() && (system_topology().nodes.size() > 1 || tuning::numa_force());
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
  for (const KVCache::Buffer& buf : kv_.buffers())
    place(buf.name, buf.base, buf.bytes, split_per_layer(cfg_.n_layers, cfg_.n_kv_heads, buf.bytes, numa_.shares),
          /*strict=*/false);
}

// Whether the pool splits its regions by node, and its own split of the kv heads (its nodes and their
// threads, as its chunked regions use), so with the
// NUMA plan's nodes these are the ranges place_kv_cache placed.
void Model::split_kv_heads() {
  const std::vector<NodeShare> shares = pool_node_shares(pool_.thread_nodes());
  kv_head_nodes_.clear();
  pool_splits_by_node_ = shares.size() >= 2;
  if (shares.size() >= 2 && shares.size() <= (size_t)ThreadPool::kMaxGroups)
    kv_head_nodes_ = split_by_node(cfg_.n_kv_heads, 1, shares);
}

int64_t Model::row_grain(const std::string& matrix, int64_t head_dim, const KernelTable& kt) {
  if (matrix == "wqkv") return head_dim;
  if (matrix == "w_gate_up") return 2 * kGateUpBlock;
  if (matrix == "wo" || matrix == "w_down" || matrix == "lm_head" || matrix == "router") return kt.row_grain;
  throw std::invalid_argument("no row grain for '" + matrix + "'");
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

// Bound: every matrix's node ranges follow the grain its parallel loop splits by. The embedding table
// is read a row per token by the calling thread and stays where it was written (unless tied, when it
// is lm_head).
void Model::place_weights() {
  for (const NamedMatrix& nm : numa_places_memory() ? matrices_in_decode_order() : std::vector<NamedMatrix>{}) {
    if (nm.kind.empty()) continue;
    const PackedMatrix& m = *nm.m;
    std::vector<RowRange> bytes;  // the whole matrix's node ranges, within this matrix (or part)
    const int64_t r0 = nm.first_row, whole = nm.whole_rows ? nm.whole_rows : m.rows;
    for (const RowRange& r : numa_.ranges(whole, row_grain(nm.kind, cfg_.head_dim, kt_))) {
      const int64_t b = std::clamp(r.begin - r0, (int64_t)0, m.rows), e = std::clamp(r.end - r0, (int64_t)0, m.rows);
      if (b < e) bytes.push_back({r.node, (int64_t)row_offset(b, m.rows, m.nbytes), (int64_t)row_offset(e, m.rows, m.nbytes)});
    }
    place(nm.name, m.data(), m.nbytes, std::move(bytes), /*strict=*/true);
  }
  numa_status_ = numa_summary(numa_, numa_places_memory(), placed_);
}

}  // namespace corelm
