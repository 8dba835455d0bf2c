// Memory for packed weights and the engine's buffers: aligned mappings of their own, 2 MiB pages where they
// come cheaply (and the move onto them later where they don't), prefaulting, and one stream of small
// matrices. The kernel tables pack into it; the model places and promotes it (model/, runtime/numa).
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <stdexcept>

#include "kernels/kernels.h"
#include "kernels/tuning.h"

#if defined(__linux__)
#include <sys/mman.h>
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1's ABI; glibc before 2.37 lacks the name
#endif
#endif
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace corelm {

// Buffers of at least this many bytes get their own mapping: page-aligned and sharing no page with
// other data, so NUMA placement (runtime/numa.h) can move their pages without moving anything else,
// and the policy goes away with the mapping. Fresh pages are zero and untouched until written.
static constexpr size_t kOwnMappingBytes = 64 << 10;
static constexpr size_t kHugePageBytes = 2 << 20;

bool aligned_buffer_owns_pages(size_t bytes) {
#if defined(__linux__)
  return bytes >= kOwnMappingBytes;
#else
  return false;
#endif
}

#if defined(__linux__)
namespace {
// Whether buffers may ask for 2 MiB pages. Weights are streamed end to end every token, and 2 MiB pages
// take the TLB misses out of the stream (decode up to 25% faster on the Xeon). But a VM that hands freed
// memory back to its host (balloon free page reporting: Firecracker) can spend 10-17 ms of CPU on each
// fresh 2 MiB page (0.1-0.3 ms elsewhere): seconds per GB of weights, where 4 KiB pages, still backed by
// the host, load in a fraction of that. So by default (auto) buffers are faulted in 2 MiB page by page
// under the thread's CPU clock until a page takes longer than slow_huge_page_seconds(); from then on the
// process takes 4 KiB pages, and the model moves its weights onto 2 MiB pages afterwards at idle
// priority (collapse_into_huge_pages). CORELM_HUGE_PAGES=1 always asks at once (decode at full speed
// from the first token, slow loads there), 0 never.
// 1 ms; CORELM_HUGE_PAGE_SLOW_MS sets another line (0: the first page counts as slow, for tests)
double slow_huge_page_seconds() { return tuning::huge_page_slow_seconds(); }
std::atomic<int> g_huge_pages{-1};  // -1: not yet read, 0: off, 1: on, 2: on while they come cheap
std::atomic<bool> g_huge_pages_slow{false};  // auto saw a slow one

int huge_page_policy() {
  int p = g_huge_pages.load(std::memory_order_relaxed);
  if (p < 0) {
    p = tuning::huge_pages();
    int expected = -1;
    if (!g_huge_pages.compare_exchange_strong(expected, p)) p = expected;
  }
  return p;
}

// This thread's CPU seconds: the slowness is CPU time spent faulting, and a wall clock would also count
// the time another thread held the core.
double thread_cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// Faults in [start, start + bytes) 2 MiB page by page under a clock. Returns the offset of the first page
// that came slowly (bytes if none did, or where the kernel can't populate: then the packer faults them).
size_t populate_huge_until_slow(char* start, size_t bytes) {
#if defined(MADV_POPULATE_WRITE)
  for (size_t off = 0; off < bytes; off += kHugePageBytes) {
    const size_t n = std::min(kHugePageBytes, bytes - off);
    const double t0 = thread_cpu_seconds();
    if (madvise(start + off, n, MADV_POPULATE_WRITE) != 0) return bytes;
    if (thread_cpu_seconds() - t0 > slow_huge_page_seconds()) return off;
  }
#else
  (void)start;
#endif
  return bytes;
}
}  // namespace
#endif

bool huge_pages_in_use() {
#if defined(__linux__)
  return huge_page_policy() != 0;
#else
  return false;
#endif
}

bool huge_pages_came_slow() {
#if defined(__linux__)
  return g_huge_pages_slow.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

size_t collapse_into_huge_pages(void* p, size_t bytes, const std::function<bool()>& go_on, bool* unsupported) {
  size_t done = 0;
  *unsupported = false;
#if defined(__linux__)
  const uintptr_t a = ((uintptr_t)p + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  const uintptr_t b = ((uintptr_t)p + bytes) / kHugePageBytes * kHugePageBytes;
  for (uintptr_t q = a; q < b && go_on(); q += kHugePageBytes) {
    void* page = reinterpret_cast<void*>(q);
    // auto marked the 4 KiB part MADV_NOHUGEPAGE, which MADV_COLLAPSE refuses; its pages are all
    // resident, so lifting the mark lets no new fault take a slow 2 MiB page
    if (madvise(page, kHugePageBytes, MADV_HUGEPAGE) != 0 || madvise(page, kHugePageBytes, MADV_COLLAPSE) != 0) {
      if (errno == EINVAL) {  // Linux before 6.1, or THP off: nothing will move
        *unsupported = true;
        break;
      }
      continue;  // EAGAIN, ENOMEM: this page stays on 4 KiB pages
    }
    done += kHugePageBytes;
  }
#else
  (void)p, (void)bytes, (void)go_on;
  *unsupported = true;
#endif
  return done;
}

std::shared_ptr<void> aligned_buffer(size_t bytes, bool huge_pages) {
#if defined(__linux__)
  if (aligned_buffer_owns_pages(bytes)) {
    // Only 2 MiB-aligned ranges can have 2 MiB pages, so a large buffer starts on a 2 MiB boundary (the
    // unused head stays untouched). THP is often "madvise" only: a hint, ignored where unsupported.
    const int policy = huge_page_policy();
    const size_t extra = huge_pages && policy != 0 && bytes >= kHugePageBytes ? kHugePageBytes : 0, len = bytes + extra;
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    char* start = static_cast<char*>(m);
    if (extra) {
      start += (kHugePageBytes - (uintptr_t)m % kHugePageBytes) % kHugePageBytes;
      madvise(start, bytes, MADV_HUGEPAGE);
      if (policy == 2) {
        const size_t slow = populate_huge_until_slow(start, bytes);
        if (slow < bytes) {  // fresh 2 MiB pages are slow here: the rest of this buffer and later ones on 4 KiB
          g_huge_pages.store(0, std::memory_order_relaxed);
          g_huge_pages_slow.store(true, std::memory_order_relaxed);
          const size_t rest = std::min(bytes, slow + kHugePageBytes);
          if (rest < bytes) madvise(start + rest, bytes - rest, MADV_NOHUGEPAGE);
        }
      }
    }
    std::shared_ptr<void> mapping(m, [len](void* q) { munmap(q, len); });
    return std::shared_ptr<void>(mapping, start);
  }
#endif
  void* p = nullptr;
  if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  return std::shared_ptr<void>(p, free);
}

void prefault_for_write(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_POPULATE_WRITE)
  const uintptr_t page = 4096, a = (uintptr_t)p / page * page, b = ((uintptr_t)p + bytes + page - 1) / page * page;
  if (bytes) madvise(reinterpret_cast<void*>(a), b - a, MADV_POPULATE_WRITE);  // Linux 5.14+; else faults as before
#else
  (void)p, (void)bytes;
#endif
}

void release_freed_heap() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

void pack_contiguously(const std::vector<PackedMatrix*>& ms) {
  const size_t page = 4096;
  auto place_at = [&](size_t off, size_t bytes) {  // buffers that own their pages start on a page
    const size_t a = aligned_buffer_owns_pages(bytes) ? page : 64;
    return (off + a - 1) / a * a;
  };
  auto end_of = [&](size_t at, size_t bytes) {      // ... and end on one, sharing no page
    return aligned_buffer_owns_pages(bytes) ? (at + bytes + page - 1) / page * page : at + bytes;
  };
  std::map<const void*, size_t> offset;  // storage already placed (a tied lm_head and embedding)
  size_t total = 0;
  for (PackedMatrix* m : ms)
    if (m->storage && m->nbytes < kHugePageBytes && !offset.count(m->data())) {
      const size_t at = place_at(total, m->nbytes);
      offset[m->data()] = at;
      total = end_of(at, m->nbytes);
    }
  if (total == 0) return;
  std::shared_ptr<void> arena;
  try {
    arena = aligned_buffer(total);
  } catch (const std::bad_alloc&) {
    return;  // no room for a second copy while moving: the separate buffers work as they are
  }
  std::map<const void*, std::shared_ptr<void>> moved;
  for (PackedMatrix* m : ms) {
    if (!m->storage || !offset.count(m->data())) continue;
    auto it = moved.find(m->data());
    if (it == moved.end()) {
      char* dst = static_cast<char*>(arena.get()) + offset[m->data()];
      std::memcpy(dst, m->data(), m->nbytes);
      it = moved.emplace(m->data(), std::shared_ptr<void>(arena, dst)).first;
    }
    m->storage = it->second;  // the old buffer goes with its last owner
  }
}

}  // namespace corelm
