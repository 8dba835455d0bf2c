// Every run-time switch of the C++ core, in one place: an environment variable each, read once. Options a
// user sets belong in LLM(...) and the CLI; these exist for tests (to reach every path on one machine),
// benchmarks and CPUs where a default guess is wrong. docs/guide.md lists them for users.
#pragma once
#include <cstdint>
#include <string>

namespace corelm {
namespace tuning {

// CORELM_ISA (default: the best table the CPU runs): the kernel table, "amx", "avx512_bf16", "avx512",
// "avx2" or "scalar"; empty when unset. A table the CPU cannot run falls back to the default.
std::string isa();
// CORELM_DISABLE_AMX (default off): any value but "0" keeps AMX tiles out.
bool disable_amx();
// CORELM_AMX_PREFILL (default 1): 0 keeps quantized prompts on the integer kernels rather than AMX bf16.
bool amx_prefill();
// CORELM_NO_VNNI (default off): set, AVX-512 integer dot products are built without VNNI.
bool no_vnni();
// CORELM_DECODE_PREFETCH=0|1 (default: the table's own): software prefetch of decode's weight stream.
bool decode_prefetch(bool table_default);
// CORELM_DECODE_GROUP_MAJOR=0|1 (default: 1 except on AMD): AVX-512 q4/q8 decode reads a block row's
// groups one after another (1) or side by side (0).
bool decode_group_major(bool amd);
// CORELM_SPARSE_PREFETCH_L2=0|1 (default: 1 except on AMD): sparse kernels prefetch into L2, not L1.
bool sparse_prefetch_l2(bool amd);
// CORELM_SPARSE_PREFETCH (default 4096 with L2 prefetch, else 2048): bytes ahead; 0: none.
int64_t sparse_prefetch_bytes(bool l2);
// CORELM_SPARSE_WITHOUT=bf16|bitalg|vbmi2 (default none): the sparse kernels act as if the CPU lacked that
// instruction set and those before it in the list (1, 2, 3; 0: none), so tests run every path.
int sparse_without_level();
// CORELM_SPARSE_EXPAND=ranks|vpexpandw (default: ranks on AMD, else vpexpandw): how sparse bf16 rows are
// expanded where both ways run; true for ranks.
bool sparse_expand_ranks(bool amd);
// CORELM_HUGE_PAGES=0|1|auto (default auto): weights never (0) or at once (1) on 2 MiB pages, or (2)
// while faulting them in stays cheap (memory.h).
int huge_pages();
// CORELM_HUGE_PAGE_SLOW_MS (default 1): what auto counts as a slow 2 MiB page fault, in seconds.
double huge_page_slow_seconds();
// CORELM_NUMA_FORCE (default 0): 1 places memory by node even on a one-node machine (tests).
bool numa_force();

}  // namespace tuning
}  // namespace corelm
