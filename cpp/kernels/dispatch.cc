// CPU feature detection and the choice of kernel table. Runs once; the wheel is built for the
// baseline ISA and only the files in kernels/<isa>/ use wider instructions.
#include "kernels/tuning.h"
#include "kernels/kernels.h"
#include "kernels/amx/amx.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#if defined(CORELM_HAVE_X86)
#include <cpuid.h>
#endif

namespace corelm {


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
