#include "runtime/numa.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace corelm {

std::vector<NodeShare> node_shares(const Topology& topo, const std::vector<int>& plan) {
  return node_shares(thread_nodes(topo, plan));
}

std::vector<NodeShare> node_shares(const std::vector<int>& thread_node) {
  std::map<int, int> threads;
  for (int node : thread_node)
    if (node >= 0) threads[node]++;
  std::vector<NodeShare> shares;
  for (const auto& kv : threads) shares.push_back({kv.first, kv.second});
  return shares;
}

std::vector<int> thread_nodes(const Topology& topo, const std::vector<int>& plan) {
  std::vector<int> nodes;
  for (int cpu : plan) {
    const LogicalCpu* c = cpu >= 0 ? topo.cpu(cpu) : nullptr;
    nodes.push_back(c ? c->node : -1);
  }
  return nodes;
}

std::vector<RowRange> split_by_node(int64_t rows, int64_t grain, const std::vector<NodeShare>& shares) {
  std::vector<RowRange> ranges;
  int64_t total = 0;
  for (const NodeShare& s : shares) total += std::max(s.threads, 0);
  if (shares.empty() || rows <= 0 || total == 0) return ranges;
  grain = std::max<int64_t>(grain, 1);
  const int64_t groups = (rows + grain - 1) / grain;
  int64_t before = 0;  // threads of the shares already cut
  for (const NodeShare& s : shares) {
    RowRange r;
    r.node = s.node;
    r.begin = std::min(rows, groups * before / total * grain);
    before += std::max(s.threads, 0);
    r.end = std::min(rows, groups * before / total * grain);
    ranges.push_back(r);
  }
  return ranges;
}

std::vector<RowRange> split_per_layer(int64_t layers, int64_t rows, size_t bytes, const std::vector<NodeShare>& shares) {
  std::vector<RowRange> out;
  if (layers <= 0 || rows <= 0) return out;
  const size_t stride = bytes / (size_t)(layers * rows);  // bytes per row
  for (int64_t l = 0; l < layers; l++)
    for (const RowRange& r : split_by_node(rows, 1, shares))
      out.push_back({r.node, (int64_t)((l * rows + r.begin) * stride), (int64_t)((l * rows + r.end) * stride)});
  return out;
}

size_t row_offset(int64_t r, int64_t rows, size_t nbytes) {
  if (rows <= 0 || r <= 0) return 0;
  if (r >= rows) return nbytes;
  return (size_t)((unsigned __int128)nbytes * (uint64_t)r / (uint64_t)rows);
}

size_t page_bytes() {
#if defined(__linux__)
  static const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  return page;
#else
  return 4096;
#endif
}

namespace {

constexpr int kMpolPreferred = 1, kMpolBind = 2;  // <linux/mempolicy.h>
constexpr unsigned kMpolMfMove = 1u << 1;

uintptr_t page_up(uintptr_t a) { return (a + page_bytes() - 1) / page_bytes() * page_bytes(); }

}  // namespace

std::string numa_place(const void* addr, size_t bytes, int node, bool strict) {
  if (node < 0 || node >= (1 << 16)) return "node " + std::to_string(node) + " is out of range";
#if defined(__linux__) && defined(SYS_mbind)
  const uintptr_t begin = page_up((uintptr_t)addr), end = page_up((uintptr_t)addr + bytes);
  if (begin >= end) return "";  // no page starts inside the range
  const size_t bits = 8 * sizeof(unsigned long);
  std::vector<unsigned long> mask(node / bits + 1, 0);
  mask[node / bits] = 1ul << (node % bits);
  // maxnode counts one more than the mask's bits: the kernel drops the last one (as libnuma passes it).
  if (syscall(SYS_mbind, (void*)begin, (unsigned long)(end - begin), strict ? kMpolBind : kMpolPreferred,
              mask.data(), (unsigned long)(mask.size() * bits + 1), kMpolMfMove) != 0)
    return std::string("mbind: ") + std::strerror(errno);
  return "";
#else
  (void)addr, (void)bytes, (void)strict;
  return "mbind is not available on this system";
#endif
}

std::vector<int> numa_page_nodes(const void* addr, size_t bytes) {
  std::vector<int> nodes;
#if defined(__linux__) && defined(SYS_move_pages)
  std::vector<void*> pages;
  for (uintptr_t p = page_up((uintptr_t)addr); p < (uintptr_t)addr + bytes; p += page_bytes()) pages.push_back((void*)p);
  nodes.assign(pages.size(), 0);
  const size_t kBatch = 4096;  // pages per call
  for (size_t i = 0; i < pages.size(); i += kBatch) {
    const unsigned long n = (unsigned long)std::min(kBatch, pages.size() - i);
    // nodes == NULL: nothing moves, status gets each page's node or a negative errno.
    if (syscall(SYS_move_pages, 0, n, pages.data() + i, nullptr, nodes.data() + i, 0) != 0) return {};
  }
#else
  (void)addr, (void)bytes;
#endif
  return nodes;
}

}  // namespace corelm
