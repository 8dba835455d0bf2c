// CPU feature detection and the choice of kernel table. Runs once; the wheel is built for the
// baseline ISA and only the files in kernels/<isa>/ use wider instructions.
#include "kernels/tuning.h"
#include "kernels/kernels.h"
#include "kernels/amx/amx.h"

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <stdexcept>

#if defined(CORELM_HAVE_X86)
#include <cpuid.h>
#endif
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

#if defined(CORELM_HAVE_X86)
static uint64_t read_xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return ((uint64_t)edx << 32) | eax;
}

static CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  bool osxsave = c & (1u << 27);
  uint64_t xcr0 = osxsave ? read_xcr0() : 0;
  f.os_avx = (xcr0 & 0x6) == 0x6;
  f.os_avx512 = f.os_avx && (xcr0 & 0xe0) == 0xe0;
  f.os_amx = (xcr0 & (3ull << 17)) == (3ull << 17);  // XTILECFG + XTILEDATA
  unsigned max_leaf = __get_cpuid(0, &a, &b, &c, &d) ? a : 0;
  f.amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "AuthenticAMD"
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = b & (1u << 5);
    f.avx512f = b & (1u << 16);
    f.avx512dq = b & (1u << 17);
    f.avx512bw = b & (1u << 30);
    f.avx512vl = b & (1u << 31);
    f.avx512_vbmi2 = c & (1u << 6);
    f.avx512_vnni = c & (1u << 11);
    f.avx512_bitalg = c & (1u << 12);
    f.amx_bf16 = d & (1u << 22);
    f.amx_tile = d & (1u << 24);
    f.amx_int8 = d & (1u << 25);
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512_bf16 = a & (1u << 5);
  }
  char brand[49] = {0};
  if (__get_cpuid_max(0x80000000, nullptr) >= 0x80000004) {
    for (unsigned i = 0; i < 3; i++) {
      __cpuid(0x80000002 + i, a, b, c, d);
      std::memcpy(brand + 16 * i, &a, 4);
      std::memcpy(brand + 16 * i + 4, &b, 4);
      std::memcpy(brand + 16 * i + 8, &c, 4);
      std::memcpy(brand + 16 * i + 12, &d, 4);
    }
  }
  f.brand = brand;
  while (!f.brand.empty() && f.brand.back() == ' ') f.brand.pop_back();
  return f;
}
#else
static CpuFeatures detect() { return CpuFeatures{}; }
#endif

std::vector<std::string> CpuFeatures::names() const {
  std::vector<std::string> out;
  auto add = [&](bool on, const char* n) { if (on) out.push_back(n); };
  add(os_avx && avx2, "avx2");
  add(os_avx && fma, "fma");
  add(f16c, "f16c");
  add(os_avx512 && avx512f, "avx512f");
  add(os_avx512 && avx512bw, "avx512bw");
  add(os_avx512 && avx512vl, "avx512vl");
  add(os_avx512 && avx512dq, "avx512dq");
  add(os_avx512 && avx512_vnni, "avx512_vnni");
  add(os_avx512 && avx512_bf16, "avx512_bf16");
  add(os_avx512 && avx512_vbmi2, "avx512_vbmi2");
  add(os_avx512 && avx512_bitalg, "avx512_bitalg");
  add(os_amx && amx_tile, "amx_tile");
  add(os_amx && amx_int8, "amx_int8");
  add(os_amx && amx_bf16, "amx_bf16");
  return out;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

static bool can_run_avx512(const CpuFeatures& f) {
  return f.os_avx512 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.fma;
}

const KernelTable* kernels_by_name(const std::string& name) {
  if (name == "scalar") return &kScalarKernels;
  // AMX-BF16 for bf16 weights, the default where CPUID, XCR0 and the OS grant AMX (see
  // available_kernel_tables); "amx_emulated" is the same table on the tile emulation, for tests.
  if (name == "amx") return amx::kernel_table(true);
  if (name == "amx_emulated") return amx::kernel_table(false);
#if defined(CORELM_HAVE_X86)
  if (name == "avx512") return can_run_avx512(cpu_features()) ? &kAvx512Kernels : nullptr;
  if (name == "avx512_bf16")
    return can_run_avx512(cpu_features()) && cpu_features().avx512_bf16 ? &kAvx512Bf16Kernels : nullptr;
  if (name == "avx2") {
    const CpuFeatures& f = cpu_features();
    return f.os_avx && f.avx2 && f.fma && f.f16c ? &kAvx2Kernels : nullptr;
  }
#endif
  return nullptr;
}

std::vector<std::string> available_kernel_tables() {
  std::vector<std::string> out;
  // The first one is the default. "amx" leads where it runs: on a Xeon with AMX (tools/hw_check.sh,
  // docs/benchmarks.md) its bf16 prefill was 5x avx512_bf16's, batched decode (16 rows) 4x, and
  // single-row decode streamed the weights as fast.
  for (const char* n : {"amx", "avx512_bf16", "avx512", "avx2", "scalar"})
    if (kernels_by_name(n)) out.push_back(n);
  return out;
}

static const KernelTable& choose() {
  if (const std::string isa = tuning::isa(); !isa.empty()) {
    if (const KernelTable* t = kernels_by_name(isa.c_str())) return *t;
    // An unusable override falls back to the best table rather than failing the import.
  }
  return *kernels_by_name(available_kernel_tables().front());
}

const KernelTable& kernels() {
  static const KernelTable& t = choose();
  return t;
}

}  // namespace corelm
