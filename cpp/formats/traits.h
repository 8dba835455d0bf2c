// One row per weight type: its names (the core's, Model.set_weight_raw's, GGUF's with its id), its block
// (weights and bytes), what kind of storage it is, the dense type a sparse one stands for and where its
// blocks keep their fp16 scales. Everything else reads these rows: the kernels' predicates (is_quant,
// is_ggml_block, ...), the packers' and loaders' sizes, and Python (_core.weight_formats(): corelm.options,
// the GGUF parser and the loaders' NaN checks). The byte layouts and reference dequantizers themselves are
// kernels/quant_formats.h's (Q8/Q4/Q4M), ggml_formats.h's (GGUF blocks), sparse_layout.h's and
// sparse_quant.h's. Plain constexpr data: it includes nothing of the kernels, model or runtime.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/names.h"

namespace corelm {

// Q8/Q4/Q4M: blocks of 32 along K with fp16 scales, repacked per table (kernels/quant_formats.h).
// Q5_0 .. IQ4_XS: GGUF's own blocks, multiplied as the file stores them (kernels/ggml_formats.h).
// SBF16: unstructured-sparse bf16 (kernels/sparse_layout.h); taken raw as dense bf16 rows.
// SQ8/SQ4: unstructured-sparse Q8/Q4 (kernels/sparse_quant.h): the dense format's codes with the zero
// codes dropped (its scales kept), so the same products; taken raw as dense Q8_0/Q4_0 blocks.
enum class WeightType : int {
  F32 = 0, BF16 = 1, Q8 = 2, Q4 = 3, Q4M = 4,
  Q5_0 = 5, Q5_1 = 6, Q2_K = 7, Q3_K = 8, Q4_K = 9, Q5_K = 10, Q6_K = 11, IQ4_NL = 12, IQ4_XS = 13,
  SBF16 = 14,  // sparse bf16: a bitmap of the non-zeros and the non-zeros (kernels/sparse_layout.h)
  SQ8 = 15, SQ4 = 16  // sparse Q8/Q4: a bitmap of the non-zero codes and those codes (kernels/sparse_quant.h)
};

// What kind of storage a type is: one of the first five, plus kGrouped where it applies.
enum WeightKind : uint32_t {
  kFloatRows = 1u << 0,    // plain values, row after row (F32, BF16)
  kQuantBlocks = 1u << 1,  // corelm's Q8/Q4/Q4M: quantized from floats, or GGUF's Q8_0/Q4_0/Q4_1 repacked
  kGgmlBlocks = 1u << 2,   // GGUF blocks multiplied as the file stores them, never packed from floats
  kSparseRows = 1u << 3,   // SBF16
  kSparseQuant = 1u << 4,  // SQ8, SQ4
  kGrouped = 1u << 5,      // a GGUF block type the AVX-512 and AVX2 tables repack (kernels/ggml_grouped.h)
};

struct WeightTraits {
  WeightType value;     // value and name as common/names.h's EnumName, so its lookups read this table
  const char* name;     // the core's name (option_names()["weight_type"], Model.weight_type)
  const char* raw;      // what Model.set_weight_raw takes it as (GGUF's name, or corelm's); null: not raw
  const char* ggml;     // the GGUF tensor type with these bytes per block; null: none
  int ggml_id;          // that type's number in a GGUF file; -1: none
  int64_t block;        // weights per block along a row (1: single values; K-quants' super-blocks: 256)
  int64_t block_bytes;  // bytes per block, scales included (sparse types: their dense form's)
  uint32_t kind;        // WeightKind bits
  WeightType dense;     // the dense type whose products a sparse type gives; the type itself otherwise
  int scale_at;         // byte offset of a block's fp16 scale d; -1: none (float rows)
  int min_at;           // byte offset of its fp16 minimum (Q5_1: -m; K-quants: dmin); -1: none
};

inline constexpr WeightTraits kWeightTraits[] = {
    // value             name      raw       ggml      id  block bytes kind                      dense         d    m
    {WeightType::F32,    "fp32",   nullptr,  "F32",     0,   1,   4,  kFloatRows,               WeightType::F32,   -1, -1},
    {WeightType::BF16,   "bf16",   "BF16",   "BF16",   30,   1,   2,  kFloatRows,               WeightType::BF16,  -1, -1},
    {WeightType::Q8,     "q8",     "Q8_0",   "Q8_0",    8,  32,  34,  kQuantBlocks,             WeightType::Q8,     0, -1},
    {WeightType::Q4,     "q4",     "Q4_0",   "Q4_0",    2,  32,  18,  kQuantBlocks,             WeightType::Q4,     0, -1},
    {WeightType::Q4M,    "q4m",    "Q4_1",   "Q4_1",    3,  32,  20,  kQuantBlocks,             WeightType::Q4M,    0,  2},
    {WeightType::Q5_0,   "q5_0",   "Q5_0",   "Q5_0",    6,  32,  22,  kGgmlBlocks | kGrouped,   WeightType::Q5_0,   0, -1},
    {WeightType::Q5_1,   "q5_1",   "Q5_1",   "Q5_1",    7,  32,  24,  kGgmlBlocks | kGrouped,   WeightType::Q5_1,   0,  2},
    {WeightType::Q2_K,   "q2_k",   "Q2_K",   "Q2_K",   10, 256,  84,  kGgmlBlocks,              WeightType::Q2_K,  80, 82},
    {WeightType::Q3_K,   "q3_k",   "Q3_K",   "Q3_K",   11, 256, 110,  kGgmlBlocks,              WeightType::Q3_K, 108, -1},
    {WeightType::Q4_K,   "q4_k",   "Q4_K",   "Q4_K",   12, 256, 144,  kGgmlBlocks | kGrouped,   WeightType::Q4_K,   0,  2},
    {WeightType::Q5_K,   "q5_k",   "Q5_K",   "Q5_K",   13, 256, 176,  kGgmlBlocks | kGrouped,   WeightType::Q5_K,   0,  2},
    {WeightType::Q6_K,   "q6_k",   "Q6_K",   "Q6_K",   14, 256, 210,  kGgmlBlocks | kGrouped,   WeightType::Q6_K, 208, -1},
    {WeightType::IQ4_NL, "iq4_nl", "IQ4_NL", "IQ4_NL", 20,  32,  18,  kGgmlBlocks | kGrouped,   WeightType::IQ4_NL, 0, -1},
    {WeightType::IQ4_XS, "iq4_xs", "IQ4_XS", "IQ4_XS", 23, 256, 136,  kGgmlBlocks | kGrouped,   WeightType::IQ4_XS, 0, -1},
    {WeightType::SBF16,  "sbf16",  "SBF16",  nullptr,  -1,   1,   2,  kSparseRows,              WeightType::BF16,  -1, -1},
    {WeightType::SQ8,    "sq8",    "SQ8",    nullptr,  -1,  32,  34,  kSparseQuant,             WeightType::Q8,     0, -1},
    {WeightType::SQ4,    "sq4",    "SQ4",    nullptr,  -1,  32,  18,  kSparseQuant,             WeightType::Q4,     0, -1},
};
inline constexpr size_t kNumWeightTypes = sizeof(kWeightTraits) / sizeof(kWeightTraits[0]);

// Row i is WeightType i (the lookup below indexes), and each row's columns fit together.
constexpr bool weight_traits_consistent() {
  constexpr uint32_t kOne = kFloatRows | kQuantBlocks | kGgmlBlocks | kSparseRows | kSparseQuant;
  for (size_t i = 0; i < kNumWeightTypes; i++) {
    const WeightTraits& r = kWeightTraits[i];
    const uint32_t one = r.kind & kOne;
    if ((size_t)r.value != i || one == 0 || (one & (one - 1)) != 0 || r.block < 1 || r.block_bytes < 1) return false;
    if ((r.ggml == nullptr) != (r.ggml_id < 0)) return false;
    if ((r.kind & kGrouped) && !(r.kind & kGgmlBlocks)) return false;
    if ((r.kind & (kQuantBlocks | kGgmlBlocks | kSparseQuant)) && (r.block % 32 != 0 || r.scale_at < 0)) return false;
    const bool sparse = r.kind & (kSparseRows | kSparseQuant);
    if (sparse == (r.dense == r.value) || (int)r.dense >= (int)kNumWeightTypes) return false;
    if (sparse && (kWeightTraits[(int)r.dense].block != r.block ||
                   kWeightTraits[(int)r.dense].block_bytes != r.block_bytes)) return false;
  }
  return true;
}
static_assert(weight_traits_consistent(), "kWeightTraits: a row out of order or with columns that disagree");

constexpr const WeightTraits& traits(WeightType t) { return kWeightTraits[(int)t]; }
constexpr bool has_kind(WeightType t, uint32_t kinds) { return (traits(t).kind & kinds) != 0; }

inline const char* weight_type_name(WeightType t) { return traits(t).name; }
inline WeightType parse_weight_type(const std::string& name) { return parse_name(kWeightTraits, name, "weight type"); }
// The type Model.set_weight_raw and dequantize_gguf take by this name (GGUF's for its block types).
inline WeightType parse_raw_weight_type(const std::string& name) {
  return parse_name(kWeightTraits, name, "raw weights' GGUF type", &WeightTraits::raw);
}

}  // namespace corelm
