// The kernel dispatch table: every instruction-set variant fills the same table, and the rest of
// corelm calls kernels only through it. Kernels know vectors and packed matrices, not models.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/names.h"
#include "formats/traits.h"  // WeightType and its traits rows
#include "kernels/memory.h"  // aligned buffers and 2 MiB pages for what the tables pack

namespace corelm {

// How a quantized matmul takes its input: each row per block of 32 as int8 (scale absmax/127, the
// cheapest) or int16 (absmax/32767: ~15 bits, near fp32; on AVX2 about as cheap, VPMADDWD against
// widened weights). Semantics in kernels/quant_formats.h.
enum class ActType : int { I8 = 0, I16 = 1 };
inline constexpr EnumName<ActType> kActTypeNames[] = {{ActType::I8, "int8"}, {ActType::I16, "int16"}};
inline const char* act_type_name(ActType a) { return name_of(kActTypeNames, a); }
inline ActType parse_act_type(const std::string& name) { return parse_name(kActTypeNames, name, "activations"); }

// How the KV cache stores keys and values; int8 rows carry a scale and offset the caller applies.
enum class KVType : int { F32 = 0, BF16 = 1, I8 = 2 };
inline constexpr EnumName<KVType> kKVTypeNames[] = {{KVType::F32, "fp32"}, {KVType::BF16, "bf16"}, {KVType::I8, "int8"}};
inline const char* kv_type_name(KVType t) { return name_of(kKVTypeNames, t); }
inline KVType parse_kv_type(const std::string& name) { return parse_name(kKVTypeNames, name, "kv cache type"); }

struct KernelTable;

// Runs body(i0, i1) over disjoint ranges covering [0, n), possibly on several threads: how the model
// lends its thread pool to a packer (loading a 0.5B model is mostly repacking) without the kernels
// needing a threading layer of their own.
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t, int64_t)>& body)>;

// A weight matrix W[rows][cols] (out_features x in_features), stored in the layout of the kernel
// table that packed it. Only that table's kernels look inside; model code treats it as opaque.
struct PackedMatrix {
  WeightType type = WeightType::F32;
  int64_t rows = 0, cols = 0;
  int64_t ld = 0;                           // layout-specific leading dimension (elements)
  size_t nbytes = 0;
  const KernelTable* packed_by = nullptr;
  std::shared_ptr<void> storage;            // 64-byte aligned
  // Non-empty: the matrix is these matrices' rows one after the other (each with its own type and
  // storage; nbytes their sum, storage empty), as q, k and v kept in different GGUF types are. Kernels
  // take the parts one at a time; the model, which stacks them, walks them (model/forward.cc).
  std::vector<PackedMatrix> parts;
  const void* data() const { return storage.get(); }
  size_t bytes() const { return nbytes; }
};

// Moves the storage of the matrices under 2 MiB into one buffer, end to end in the given order (those
// large enough to own their pages on pages of their own, as aligned_buffer gives them), so the small
// ones stream on 2 MiB pages too; larger ones already have 2 MiB-aligned mappings of their own, and
// copying them cost a second allocation and copy of the whole model at load. Matrices sharing storage
// keep sharing it. Without memory for the one buffer, leaves them where they are.
void pack_contiguously(const std::vector<PackedMatrix*>& ms);

struct KernelTable {
  const char* name;  // "avx512_bf16", "avx512", "avx2", "scalar"
  // The rows a parallel loop over a matrix's rows (and so its NUMA split) cuts in: a multiple of what
  // this table's layouts keep together, so no chunk starts inside a group and runs its first rows slowly.
  int64_t row_grain;
  // Packs a row-major fp32 matrix into `type` (bf16 by round-to-nearest-even) in this table's layout;
  // par (may be null): threads lent to quantizing it, which splits by whole row groups.
  PackedMatrix (*pack)(const float* src, int64_t rows, int64_t cols, WeightType type, const ParallelFor* par);
  // y[i][n] = sum_k x[i][k] * W[n][k] for i < m and n in [n0, n1): the caller splits n across threads.
  void (*matmul)(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, float* y, int64_t ldy,
                 int64_t n0, int64_t n1);
  // out = x / rms(x) * weight, over n elements.
  void (*rmsnorm)(float* out, const float* x, const float* weight, int64_t n, float eps);
  // out[i] = silu(gate[i]) * up[i]
  void (*silu_mul)(float* out, const float* gate, const float* up, int64_t n);
  // out[i] = gelu_tanh(gate[i]) * up[i] (GeGLU, Gemma): gelu_tanh(x) = x * sigmoid(2u),
  // u = sqrt(2/pi) * (x + 0.044715 x^3), which is 0.5 x (1 + tanh(u)).
  void (*gelu_tanh_mul)(float* out, const float* gate, const float* up, int64_t n);
  // out = (x - mean) / sqrt(var + eps) * weight + bias over n elements (LayerNorm, BERT); out may be x.
  void (*layernorm)(float* out, const float* x, const float* weight, const float* bias, int64_t n, float eps);
  // x[i] = gelu(x[i]) = x/2 (1 + erf(x / sqrt 2)) in place (BERT's MLP); the vector tables' erf is
  // Abramowitz-Stegun 7.1.26, within 1.5e-7 of std::erf.
  void (*gelu)(float* x, int64_t n);
  // Attention over n cached tokens (part of one KV block) for the G query heads that share a kv head.
  // Keys are stored transposed, K[d * ldk + j]: one vector load is one channel of 16 consecutive tokens,
  // so scores come out 16 at a time with no horizontal sums, and each key load serves all G heads.
  // Values are rows, V[j * hd + d]. Elements are of type t; int8 scales are applied by the caller.
  //   s[g * lds + j] = sum_d q[g * hd + d] * K[d * ldk + j]           (g < G, j < n)
  void (*kv_scores)(KVType t, const float* q, int64_t G, int64_t hd, const void* k, int64_t ldk, int64_t n,
                    float* s, int64_t lds);
  //   out[g * hd + d] += sum_j p[g * ldp + j] * V[j * hd + d]
  void (*kv_accum)(KVType t, const float* p, int64_t ldp, int64_t G, const void* v, int64_t n, int64_t hd,
                   float* out);
  // The same over sparse rows (kv_sparsity): token j keeps some of its hd elements, marked in its mask
  // mask[j * kv_mask_words(hd) ...] (bit d of the LSB-first bitmap: channel d kept; no bits at d >= hd),
  // their values in channel order at val[j * nk ...] (type t; nk >= the row's popcount). Dropped
  // elements count as zero. val must have kKVSparseSlack readable bytes after the last row (AVX2
  // loads whole vectors there).
  //   s[g * lds + j] = sum_d q[g * hd + d] * K_j[d]
  void (*kv_scores_sparse)(KVType t, const float* q, int64_t G, int64_t hd, const uint32_t* mask, const void* val,
                           int64_t nk, int64_t n, float* s, int64_t lds);
  //   out[g * hd + d] += sum_j p[g * ldp + j] * V_j[d]
  void (*kv_accum_sparse)(KVType t, const float* p, int64_t ldp, int64_t G, const uint32_t* mask, const void* val,
                          int64_t nk, int64_t n, int64_t hd, float* out);
  // x = exp(x - max) / sum, in place.
  void (*softmax)(float* x, int64_t n);
  // One row of W as fp32 (embedding lookup).
  void (*row_to_f32)(const PackedMatrix& w, int64_t row, float* out);
  // Raw GGUF Q8_0/Q4_0/Q4_1 blocks ([rows][cols/32] blocks) repacked as Q8/Q4/Q4M, no float round trip;
  // on par's threads when given.
  PackedMatrix (*pack_raw)(WeightType type, const uint8_t* raw, int64_t rows, int64_t cols, const ParallelFor* par);
  // matmul in two steps for quantized w, so that the calls over parts of [0, rows) share one
  // quantization of x: quantize_act fills a 64-byte aligned buffer of quant_act_bytes(w, m, act) bytes
  // (0 for a float w: use matmul) from x [m][ldx], and matmul_quant gives from it what matmul gives
  // (matmul itself: act I8).
  size_t (*quant_act_bytes)(const PackedMatrix& w, int64_t m, ActType act);
  void (*quantize_act)(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, ActType act, void* qa);
  void (*matmul_quant)(const void* qa, int64_t m, ActType act, const PackedMatrix& w, float* y, int64_t ldy,
                       int64_t n0, int64_t n1);
  // A table reading the same layouts whose matmul gives every row of an m-row product (m <= kRowExactRows)
  // the bits of a one-row product, for passes whose rows are compared with decode's (speculative tokens
  // checked); null where this table's matmul already does.
  const KernelTable* row_exact = nullptr;
};
constexpr int64_t kRowExactRows = 32;
// A sparse KV row's bitmap: 32 channels per word.
inline int64_t kv_mask_words(int64_t hd) { return (hd + 31) / 32; }
constexpr int64_t kKVSparseSlack = 64;

extern const KernelTable kScalarKernels;
#if defined(CORELM_HAVE_X86)
extern const KernelTable kAvx512Kernels;
extern const KernelTable kAvx512Bf16Kernels;  // kAvx512Kernels with VDPBF16PS for bf16 weights (AVX512_BF16)
extern const KernelTable kAvx2Kernels;        // AVX2 + FMA + F16C
#endif

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_vnni = false, avx512_bf16 = false, avx512_vbmi2 = false, avx512_bitalg = false;
  bool amx_tile = false, amx_int8 = false, amx_bf16 = false;  // as CPUID reports them
  bool os_avx = false, os_avx512 = false, os_amx = false;      // state the OS saves (XCR0)
  bool amd = false;  // vendor AuthenticAMD: where one instruction's cost differs by vendor (sparse expand)
  std::string brand;
  std::vector<std::string> names() const;  // usable features, for `corelm info`
};

const CpuFeatures& cpu_features();
// The table chosen once from CPUID; CORELM_ISA=scalar|avx2|avx512|avx512_bf16|amx|amx_emulated in the
// environment overrides it.
const KernelTable& kernels();
// A specific table by name, or nullptr if this CPU can't run it (tests compare every table).
const KernelTable* kernels_by_name(const std::string& name);
std::vector<std::string> available_kernel_tables();

// fp32 <-> bf16, round to nearest even; NaN stays NaN. (Unnamed namespace: each ISA file's own copy.)
namespace {
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
}  // namespace

}  // namespace corelm
