// LoRA adapters, applied per sequence and never merged into the shared weights: for a targeted
// projection W of a sequence with adapter a, y = x W^T + (x A^T)(scale B)^T over that sequence's rows,
// so one batch mixes sequences of different adapters and of the base model. The one place for the
// LoRA math; the forward pass (forward.cc) calls `down` before a fused matrix's region and `add` in
// each chunk's compute, after the base product and before bias, norms, RoPE or the activation.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "runtime/thread_pool.h"

namespace corelm {

// The projections an adapter may target (internal weight parts), and the fused matrix each is part of.
inline constexpr int kLoraParts = 7;
inline constexpr const char* kLoraPartNames[kLoraParts] = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"};
enum class LoraSite { Qkv, Wo, GateUp, Down };

// One targeted projection of one layer: A [rank, in] and scale * B [out, rank], fp32 in the kernel
// table's layout (rows == 0: not targeted).
struct LoraProjection {
  PackedMatrix a, b;
};

struct LoraAdapter {
  int64_t rank = 0;
  std::vector<std::array<LoraProjection, kLoraParts>> layers;
};

// The shapes of the fused matrices the products land in: q/k/v rows stacked, gate/up interleaved in
// kGateUpBlock blocks (weights.h).
struct LoraShapes {
  int64_t dim, q_rows, kv_rows, ffn;
};

// One forward's LoRA work: the runs of consecutive tokens that share an adapter, each run's x A^T of the
// site the pass is at (u), and per buffer index the scratch of the B products.
class LoraPass {
 public:
  // tok_adapter: [T] each token's adapter (null: the base model); u_buf and tmp_buf: the model's buffers
  // for u and the scratch, grown here (after the pool is quiet) when too small.
  LoraPass(const KernelTable& k, const LoraShapes& shapes, const std::vector<const LoraAdapter*>& tok_adapter,
           ThreadPool& pool, std::vector<float>& u_buf, std::vector<float>& tmp_buf);
  bool active() const { return !runs_.empty(); }
  // u = x A^T for every run and every projection of the site in this layer (x [T][ldx]), on the pool.
  void down(ThreadPool& pool, LoraSite site, int64_t layer, const float* x, int64_t ldx);
  // y[t * ldy + n] += the B products of the site's projections for the fused output rows n in [n0, n1).
  void add(int buf, LoraSite site, int64_t layer, float* y, int64_t ldy, int64_t n0, int64_t n1) const;

 private:
  struct Run {
    int64_t t0, t1;
    const LoraAdapter* adapter;
  };
  const KernelTable& k_;
  LoraShapes shapes_;
  std::vector<Run> runs_;
  int64_t ldu_ = 0;       // u's row: the largest site's ranks
  float* u_ = nullptr;    // [T][ldu_]
  float* tmp_ = nullptr;  // [n_threads][T][kStep]
  int64_t tmp_ld_ = 0;
  static constexpr int64_t kStep = 64;  // B rows multiplied per kernel call (the scratch's width)
};

}  // namespace corelm
