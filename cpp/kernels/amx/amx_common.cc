// AMX weight packing (shared by the native and emulated kernels, so the emulated tests check it) and
// the run-time checks: CPUID, XCR0 and the Linux permission for the tile-data state.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "kernels/tuning.h"
#include "kernels/amx/amx.h"
#include "kernels/kernels.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace corelm {
namespace amx {

static int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

size_t AmxMatrix::bytes() const {
  const int64_t kstep = format == Format::BF16 ? 32 : 64;
  return (size_t)(n_pad / 16) * (size_t)(k_pad / kstep) * 1024 +
         (format == Format::INT8 ? (size_t)n_pad * n_groups * sizeof(float) : 0);
}

// Tiles [n_pad/16][k_pad/kstep] of 16 rows x 64 bytes; row r of tile (nt, kb) holds, for each of
// the 16 columns c, the v = 4 / sizeof(T) consecutive K values 4 r / sizeof(T) .. of W row 16 nt + c:
//     tile(nt, kb)[r][c][i] = W[16 nt + c][kstep kb + v r + i],  kstep = 64 / sizeof(T)
// Panels of 16 rows are independent, so par (may be null) splits them over threads.
template <class T, class S, class Convert>
static void pack_tiles(AmxMatrix& p, const S* w, int64_t n, int64_t k, const ParallelFor* par, Convert convert) {
  constexpr int64_t v = 4 / sizeof(T), kstep = 64 / sizeof(T);
  if (n <= 0 || k <= 0) throw std::invalid_argument("AMX pack: empty matrix");
  p.n = n;
  p.k = k;
  p.n_pad = round_up(n, 16);
  p.k_pad = round_up(k, kstep);
  const int64_t kblocks = p.k_pad / kstep;
  const size_t bytes = (size_t)(p.n_pad / 16) * kblocks * 1024;
  p.tiles = aligned_buffer(bytes);  // zeroed: the N and K padding
  T* t = static_cast<T*>(p.tiles.get());
  auto panels = [&](int64_t nt0, int64_t nt1) {
    for (int64_t row = nt0 * 16; row < std::min(n, nt1 * 16); row++) {
      T* panel = t + (row / 16) * kblocks * 16 * 16 * v + (row % 16) * v;
      for (int64_t kk = 0; kk < k; kk++)
        panel[((kk / kstep) * 16 + (kk % kstep) / v) * 16 * v + kk % v] = convert(w[row * k + kk]);
    }
  };
  if (par) (*par)(p.n_pad / 16, panels);
  else panels(0, p.n_pad / 16);
}

AmxMatrix pack_bf16(const float* w, int64_t n, int64_t k, const ParallelFor* par) {
  AmxMatrix p;
  p.format = Format::BF16;
  pack_tiles<uint16_t>(p, w, n, k, par, [](float f) { return f32_to_bf16(f); });
  return p;
}

AmxMatrix pack_int8(const int8_t* wq, const float* scales, int64_t n, int64_t k, int64_t group) {
  if (group == 0) group = k;
  if (group != k && (group <= 0 || group % 64 != 0 || k % group != 0))
    throw std::invalid_argument("AMX int8: the scale group must be K, or a multiple of 64 that divides K");
  AmxMatrix p;
  p.format = Format::INT8;
  pack_tiles<int8_t>(p, wq, n, k, nullptr, [](int8_t q) { return q; });
  p.group = group;
  p.n_groups = k / group;
  const size_t sbytes = (size_t)p.n_pad * p.n_groups * sizeof(float);
  p.scales = aligned_buffer(sbytes);
  float* s = static_cast<float*>(p.scales.get());
  std::memset(s, 0, sbytes);
  std::memcpy(s, scales, (size_t)n * p.n_groups * sizeof(float));
  return p;
}

void quantize_rows_s8(const float* x, int64_t m, int64_t k, int64_t ldx, int64_t group, int8_t* q, float* scales) {
  if (group == 0) group = k;
  if (group <= 0 || k % group != 0) throw std::invalid_argument("AMX int8: the scale group must divide K");
  const int64_t ng = k / group;
  for (int64_t i = 0; i < m; i++) {
    for (int64_t g = 0; g < ng; g++) {
      const float* src = x + i * ldx + g * group;
      int8_t* dst = q + i * k + g * group;
      float amax = 0.0f;
      for (int64_t j = 0; j < group; j++) amax = std::max(amax, std::fabs(src[j]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int64_t j = 0; j < group; j++)
        dst[j] = (int8_t)std::max(-127.0f, std::min(127.0f, std::nearbyint(src[j] * inv)));
      scales[i * ng + g] = amax / 127.0f;
    }
  }
}

static Status detect() {
  Status s;
  const CpuFeatures& f = cpu_features();
  s.cpu = f.amx_tile && f.amx_int8 && f.amx_bf16;
  s.os = f.os_amx;
#if defined(CORELM_HAVE_AMX_BUILD)
  s.compiled = true;
#endif
  if (!s.cpu) { s.reason = "the CPU has no AMX-TILE/INT8/BF16"; return s; }
  if (!s.os) { s.reason = "the OS does not enable the tile state (XCR0)"; return s; }
  if (!s.compiled) { s.reason = "this build has no AMX kernels (compiler without -mamx-tile)"; return s; }
  if (tuning::disable_amx()) {
    s.reason = "disabled by CORELM_DISABLE_AMX";
    return s;
  }
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  // Linux >= 5.16 keeps the 8 KiB tile-data state off until the process asks for it; the first tile
  // instruction without the permission raises SIGILL. The permission is process-wide.
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    s.reason = std::string("arch_prctl(ARCH_REQ_XCOMP_PERM) refused: ") + std::strerror(errno);
    return s;
  }
  unsigned long bitmask = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bitmask) != 0 || !(bitmask & (1ul << kXfeatureXtiledata))) {
    s.reason = "arch_prctl(ARCH_GET_XCOMP_PERM) does not list XTILEDATA";
    return s;
  }
  s.permission = true;
#else
  s.reason = "no way to request the tile-data permission on this OS";
#endif
  return s;
}

const Status& status() {
  static const Status s = detect();
  return s;
}

void require_available() {
  if (!available()) throw std::runtime_error("AMX is not available on this machine: " + status().reason);
}

}  // namespace amx
}  // namespace corelm
