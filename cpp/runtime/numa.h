// NUMA placement: which node's memory holds each thread's share of the weights and of the KV cache,
// and the system calls that put pages there.
//
// The decision is pure, so tests run it on fake topologies: the nodes of a thread plan, each weighted
// by its pinned threads; a matrix's rows cut into one contiguous range per node in proportion to
// those weights, in whole groups of the grain its parallel loop splits by (so a node's threads can
// take their rows without touching another node's); the KV cache's kv heads cut the same way, per layer.
//
// Applying it needs no libnuma: mbind(2) through syscall() with MPOL_MF_MOVE puts the pages of each
// range on its node (pages already touched are migrated, later ones are allocated there), and
// move_pages(2) without target nodes reads back where each page is.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/topology.h"

namespace corelm {

struct NodeShare {
  int node = 0;
  int threads = 0;
};

// The nodes the pinned threads of a plan run on (-1 entries and CPUs the topology does not know are
// skipped), ascending, with how many threads each has.
std::vector<NodeShare> node_shares(const Topology& topo, const std::vector<int>& plan);
// The same from each thread's node (-1: none).
std::vector<NodeShare> node_shares(const std::vector<int>& thread_node);

// The node of each thread of a plan; -1 where the thread is not pinned.
std::vector<int> thread_nodes(const Topology& topo, const std::vector<int>& plan);

struct RowRange {
  int node = 0;
  int64_t begin = 0, end = 0;  // [begin, end)
};

// [0, rows) as one contiguous range per share, in the shares' order, sized in proportion to their
// threads in whole groups of grain rows (only the last range may end on a partial group). A share
// too small for one group gets an empty range. No shares: no ranges.
std::vector<RowRange> split_by_node(int64_t rows, int64_t grain, const std::vector<NodeShare>& shares);

// A buffer of `layers` equal parts, each of `rows` equal rows (the KV cache: [layer][kv_head][...]):
// each part's rows split by node (split_by_node, grain 1), as byte ranges, part by part.
std::vector<RowRange> split_per_layer(int64_t layers, int64_t rows, size_t bytes, const std::vector<NodeShare>& shares);

// The byte offset of row r in a packed matrix of `rows` rows and `nbytes` bytes. Every layout stores
// rows in order, each group of rows (1 row-major, 8 or 16 in the wide float layouts, 32 in the
// interleaved quantized ones) in an equal stride, so this is exact when r and rows are multiples of the
// group, and otherwise off by less than one group (placement is by pages anyway).
size_t row_offset(int64_t r, int64_t rows, size_t nbytes);

size_t page_bytes();

// Puts the pages whose first byte lies in [addr, addr + bytes) on `node`: strict binds them
// (MPOL_BIND: allocation fails rather than going elsewhere), otherwise only prefers the node
// (MPOL_PREFERRED: falls back when it is full). Pages already touched are moved. The caller must own
// the whole page that holds the last byte (a page-aligned mapping does). Returns "" or the reason it
// failed (mbind's errno, or no mbind on this system).
std::string numa_place(const void* addr, size_t bytes, int node, bool strict);

// The node of each page whose first byte lies in [addr, addr + bytes) (the pages numa_place moves),
// by move_pages(2); a negative errno for a page without one (-ENOENT: never touched). Empty when
// the call fails.
std::vector<int> numa_page_nodes(const void* addr, size_t bytes);

}  // namespace corelm
