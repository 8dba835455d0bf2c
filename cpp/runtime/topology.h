// CPU topology from Linux sysfs: packages, NUMA nodes, physical cores and their SMT siblings, core
// types on hybrid CPUs (P/E), caches; and the thread plan that decides which logical CPU each thread
// of a pool runs on.
//
// Everything is read below a root path ("/sys" on a real machine) so tests can point it at a fake
// tree. sysfs differs across kernels, containers and architectures, so every file is optional: a
// missing or malformed one falls back (one package, one node, each CPU its own core) and is noted,
// never thrown.
#pragma once
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "common/names.h"

namespace corelm {

enum class CoreType : uint8_t { Unknown, Performance, Efficiency };
const char* core_type_name(CoreType t);  // "P", "E" or "?"

// One cache instance: the same L3 shared by 16 CPUs appears once.
struct CacheInfo {
  int level = 0;
  std::string type;       // "Data", "Instruction" or "Unified"
  int64_t size_bytes = 0;  // 0 when the size was missing or unreadable
  std::vector<int> cpus;  // online logical CPUs that share it
};

struct LogicalCpu {
  int id = 0;         // the kernel's CPU number (cpuN)
  int package = 0;    // physical_package_id
  int node = 0;       // NUMA node
  int core = 0;       // index into Topology::cores
  int smt_index = 0;  // 0 for the first (lowest-numbered) thread of its core, 1 for its sibling...
  CoreType type = CoreType::Unknown;
  int l1d = -1, l2 = -1, l3 = -1;  // indices into Topology::caches; -1 when unknown
};

struct PhysicalCore {
  int package = 0;
  int node = 0;
  CoreType type = CoreType::Unknown;
  std::vector<int> cpus;  // its logical CPUs (SMT siblings), ascending; cpus[0] is the "first sibling"
};

struct Topology {
  std::vector<LogicalCpu> cpus;     // online CPUs, ascending id
  std::vector<PhysicalCore> cores;  // ordered by their first CPU
  std::vector<CacheInfo> caches;    // ordered by level, then first CPU
  std::vector<int> packages;        // distinct package ids, ascending
  std::vector<int> nodes;           // distinct NUMA node ids that have CPUs, ascending
  bool hybrid = false;              // some cores are P and some E
  std::string type_source;          // where core types came from: "sysfs", "cpuid" or "" (none)
  std::vector<std::string> notes;   // fallbacks taken while reading, for diagnostics

  const LogicalCpu* cpu(int id) const;  // nullptr when id is not an online CPU
  int threads_per_core() const;         // the largest SMT width seen (1 without SMT)
  std::vector<int> cores_in_node(int node) const;  // indices into cores
};

// Reads the topology below sysfs_root (devices/system/cpu, devices/system/node, devices/cpu_core and
// devices/cpu_atom). Never throws for missing or malformed files. With probe_cpuid, a hybrid x86 CPU
// whose sysfs has no cpu_core/cpu_atom lists gets its core types from CPUID leaf 0x1A, read by a
// helper thread pinned to each CPU in turn (that leaf describes only the CPU that executes it); this
// is only meaningful for the real machine, so it is off unless sysfs_root is the real "/sys".
Topology read_topology(const std::string& sysfs_root = "/sys", bool probe_cpuid = true);

// The machine's topology, read once (thread-safe).
const Topology& system_topology();

// The logical CPUs this process may run on, ascending; empty when unknown. Linux keeps the mask per
// thread: this is the calling thread's (sched_getaffinity), which is what taskset or
// os.sched_setaffinity set, and what threads it starts inherit.
std::vector<int> process_allowed_cpus();

// How a plan uses NUMA nodes (llama.cpp's --numa):
//   Default     the first allowed node's cores, then the next node's (one node unless more threads
//               are asked for than it has cores); memory is left where first touch puts it
//   Distribute  every allowed node, threads dealt to the nodes in turn so any count spreads evenly;
//               the weights are split by node (runtime/numa.h)
//   Isolate     only the home node (the node the process started on)
enum class NumaPolicy : uint8_t { Default, Distribute, Isolate };
inline constexpr EnumName<NumaPolicy> kNumaPolicyNames[] = {
    {NumaPolicy::Default, "default"}, {NumaPolicy::Distribute, "distribute"}, {NumaPolicy::Isolate, "isolate"}};
inline const char* numa_policy_name(NumaPolicy p) { return name_of(kNumaPolicyNames, p); }
inline NumaPolicy parse_numa_policy(const std::string& name) { return parse_name(kNumaPolicyNames, name, "numa"); }

struct PlanPolicy {
  // Once every allowed physical core has a thread, put further threads on SMT siblings. Off: they
  // run unpinned instead.
  bool smt_siblings = true;
  // Use E-cores of hybrid CPUs. Off: only P-cores (and unknown-type cores) are planned.
  bool e_cores = true;
  NumaPolicy numa = NumaPolicy::Default;
  // Isolate's node; -1 or a node without allowed CPUs: the first node that has one. The real
  // machine's is current_node(), the node the calling thread runs on.
  int home_node = -1;
};

// The NUMA node of the CPU the calling thread runs on; -1 when unknown.
int current_node(const Topology& topo);

// The physical cores (P+E cores on hybrid CPUs) of the first NUMA node that has an allowed CPU, the
// thread count that saturates one memory controller without crossing a node or sharing a core; of
// the home node under Isolate, of every allowed node under Distribute.
// allowed: the CPUs threads may use; empty means every CPU of the topology.
int default_thread_count(const Topology& topo, const std::vector<int>& allowed = {},
                         const PlanPolicy& policy = {});

// The logical CPU for each of n_threads threads (n_threads <= 0: the default count): physical
// cores first (the first allowed SMT sibling of each), P-cores before E-cores, one NUMA node filled
// before the next (the first allowed node first; under Distribute the nodes take turns, under
// Isolate only the home node); then SMT siblings in the same order. Threads beyond what the policy
// allows get -1, meaning "do not pin".
std::vector<int> plan_threads(const Topology& topo, int n_threads, const std::vector<int>& allowed = {},
                              const PlanPolicy& policy = {});

// Pins a thread to one logical CPU, or lets it run on a set. False (and the affinity is left alone)
// when a CPU is negative or the kernel refuses, as it does in containers whose cpuset excludes it.
bool set_thread_cpus(std::thread::native_handle_type thread, const std::vector<int>& cpus);
bool pin_thread(std::thread::native_handle_type thread, int cpu);
bool pin_current_thread(int cpu);
// Makes the calling thread run only on otherwise idle CPUs (Linux SCHED_IDLE); false where refused.
bool make_current_thread_idle_priority();
bool set_current_thread_cpus(const std::vector<int>& cpus);

// Parses a sysfs CPU list ("0-3,8,10-11\n"); false on malformed input (out is then unspecified).
bool parse_cpu_list(const std::string& text, std::vector<int>* out);
// Parses a cache size ("48K", "2048K", "1M", "512"); -1 on malformed input.
int64_t parse_cache_size(const std::string& text);

}  // namespace corelm
