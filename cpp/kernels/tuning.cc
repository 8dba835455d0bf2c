// The switches of tuning.h: the only place the C++ core reads its environment.
#include "kernels/tuning.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace corelm {
namespace tuning {
namespace {

const char* env(const char* name) { return std::getenv(name); }

// Starting with "0" or "1" -> false or true; anything else (unset included) -> fallback.
bool zero_one(const char* name, bool fallback) {
  const char* e = env(name);
  return e && (e[0] == '0' || e[0] == '1') ? e[0] == '1' : fallback;
}

}  // namespace

std::string isa() {
  const char* e = env("CORELM_ISA");
  return e ? e : "";
}
bool disable_amx() {
  const char* e = env("CORELM_DISABLE_AMX");
  return e && *e && std::strcmp(e, "0") != 0;
}
bool amx_prefill() {
  static const bool v = [] { const char* e = env("CORELM_AMX_PREFILL"); return !(e && e[0] == '0'); }();
  return v;
}
bool no_vnni() {
  static const bool v = env("CORELM_NO_VNNI") != nullptr;
  return v;
}
bool decode_prefetch(bool table_default) { return zero_one("CORELM_DECODE_PREFETCH", table_default); }
bool decode_group_major(bool amd) { return zero_one("CORELM_DECODE_GROUP_MAJOR", !amd); }
bool sparse_prefetch_l2(bool amd) {
  static const bool v = [amd] { const char* e = env("CORELM_SPARSE_PREFETCH_L2"); return e ? std::atoi(e) != 0 : !amd; }();
  return v;
}
int64_t sparse_prefetch_bytes(bool l2) {
  static const int64_t v = [l2] {
    const char* e = env("CORELM_SPARSE_PREFETCH");
    return e ? std::max<int64_t>(0, std::atoll(e)) : l2 ? int64_t{4096} : int64_t{2048};
  }();
  return v;
}
int sparse_without_level() {
  static const int v = [] {
    const char* e = env("CORELM_SPARSE_WITHOUT");
    const std::string s = e ? e : "";
    return s == "vbmi2" ? 3 : s == "bitalg" ? 2 : s == "bf16" ? 1 : 0;
  }();
  return v;
}
bool sparse_expand_ranks(bool amd) {
  const char* e = env("CORELM_SPARSE_EXPAND");
  return e ? std::strcmp(e, "ranks") == 0 : amd;
}
int huge_pages() {
  const char* e = env("CORELM_HUGE_PAGES");
  return e && std::strcmp(e, "0") == 0 ? 0 : e && std::strcmp(e, "1") == 0 ? 1 : 2;
}
double huge_page_slow_seconds() {
  static const double s = [] {
    const char* e = env("CORELM_HUGE_PAGE_SLOW_MS");
    char* end = nullptr;
    const double ms = e ? std::strtod(e, &end) : 1.0;
    return e && end != e && ms >= 0 ? 1e-3 * ms : 1e-3;
  }();
  return s;
}
bool numa_force() {
  const char* e = env("CORELM_NUMA_FORCE");
  return e && std::strcmp(e, "1") == 0;
}

}  // namespace tuning
}  // namespace corelm
