// Plain C++ helpers shared by the ISA files (no intrinsics). Everything here is in an unnamed
// namespace on purpose: each ISA file gets its own copy built with its own flags, so the linker can
// never hand an AVX2-only caller a shared inline instance compiled with AVX-512 instructions.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <type_traits>

#include "kernels/kernels.h"
#include "kernels/tuning.h"

namespace corelm {
namespace {

template <class T>
struct AlignedAlloc {  // 64-byte aligned scratch for aligned vector loads (thread-local vectors)
  using value_type = T;
  AlignedAlloc() = default;
  template <class U>
  AlignedAlloc(const AlignedAlloc<U>&) {}
  T* allocate(size_t n) {
    void* p = nullptr;
    if (posix_memalign(&p, 64, n * sizeof(T)) != 0) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { free(p); }
  bool operator==(const AlignedAlloc&) const { return true; }
  bool operator!=(const AlignedAlloc&) const { return false; }
};

// Whether decode's weight streams use software prefetch (each kernel keeps its own distance). It
// depends on the core, not the ISA: one Zen 3 core streams q4 at 0.58 of a plain read without it and
// ~0.8 with it (AVX2 quantized GEMV), while on Zen 4 the AVX-512 GEMVs ran faster without it (bf16
// decode 1.5x at 1 thread, q4 1.36x, with an earlier prefetch into L1),
// and a Xeon streams q4/q8 at 1.03-1.06 of a plain read with the L2 chain of prefetch.h, 0.82-0.88
// without. Each table passes its default; CORELM_DECODE_PREFETCH=0|1 overrides it (tools/hw_check.sh
// measures both on a new machine).
inline bool decode_prefetch(bool table_default) { return tuning::decode_prefetch(table_default); }

// LayerNorm in plain loops, which each ISA file's flags vectorize (a few rows per layer: no intrinsics
// needed); mean and variance in double, as the scalar reference.
inline void layernorm_loops(float* out, const float* x, const float* weight, const float* bias, int64_t n, float eps) {
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < n; i++) sum += x[i];
  const float mean = (float)(sum / (double)n);
  for (int64_t i = 0; i < n; i++) sq += (double)(x[i] - mean) * (x[i] - mean);
  const float scale = 1.f / std::sqrt((float)(sq / (double)n) + eps);
  for (int64_t i = 0; i < n; i++) out[i] = (x[i] - mean) * scale * weight[i] + bias[i];
}

// Whether the AVX-512 decode GEMVs read a super-group's block row group after group (each group's
// bytes in address order) rather than the groups side by side (one activation load for all of them).
// On a Xeon (Granite Rapids class, one core, bench_gemv_stream on Qwen2.5-0.5B's shapes, the outputs
// written past the caches: decode_store.h) the side-by-side walk, jumping between the groups' lines,
// streams int16 q4 at 0.83 of a plain read and q8 at 0.78, group after group at 0.86 and 0.86; on Zen 3
// (AVX2) pairs side by side beat group after group (quant_avx2.cc). Default: group after group except
// on AMD, whose AVX-512 cores were not measured this way; CORELM_DECODE_GROUP_MAJOR=0|1 overrides it.
inline bool decode_group_major(bool amd) { return tuning::decode_group_major(amd); }

// Calls f(std::integral_constant<int, G>) for G = g in [1, kMaxHeadTile]: the head count becomes a
// compile-time constant, so an attention tile's accumulators live in registers.
constexpr int kMaxHeadTile = 8;
template <int NG = 1, class F>
void with_head_tile(int64_t g, F&& f) {
  if constexpr (NG < kMaxHeadTile) {
    if (g != NG) return with_head_tile<NG + 1>(g, f);
  }
  f(std::integral_constant<int, NG>());
}

// f(tile, g0) over the G heads in tiles of at most kMaxHeadTile, from head g0 on.
template <class F>
void for_head_tiles(int64_t G, F&& f) {
  for (int64_t g0 = 0; g0 < G; g0 += kMaxHeadTile)
    with_head_tile(G - g0 < kMaxHeadTile ? G - g0 : kMaxHeadTile, [&](auto ng) { f(ng, g0); });
}

// f(typed pointer) for the KV cache's element type.
template <class F>
void with_kv_type(KVType t, const void* p, F&& f) {
  switch (t) {
    case KVType::F32: return f(static_cast<const float*>(p));
    case KVType::BF16: return f(static_cast<const uint16_t*>(p));
    case KVType::I8: return f(static_cast<const int8_t*>(p));
  }
}

// f(tile, g0, typed pointer): the head tiles of an attention kernel over elements of type t.
template <class F>
void for_kv_head_tiles(KVType t, const void* p, int64_t G, F&& f) {
  with_kv_type(t, p, [&](auto tp) { for_head_tiles(G, [&](auto ng, int64_t g0) { f(ng, g0, tp); }); });
}

}  // namespace
}  // namespace corelm
