#include "runtime/topology.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <numeric>
#include <set>
#include <thread>
#include <tuple>

#include <dirent.h>
#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace corelm {

namespace {

// The kernel's NR_CPUS is at most 8192 today; anything far above is a malformed list, and capping it
// keeps a hostile "0-2000000000" from allocating gigabytes.
constexpr int kMaxCpuId = 1 << 16;

// sysfs files are a few bytes; a fake tree could hold anything, so read at most this much.
constexpr std::streamsize kMaxFileBytes = 1 << 16;

bool read_text(const std::string& path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::string s(kMaxFileBytes, '\0');
  f.read(&s[0], kMaxFileBytes);
  if (f.bad()) return false;
  s.resize((size_t)f.gcount());
  *out = s;
  return true;
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n"), e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

// A decimal integer, optionally negative, nothing else but surrounding whitespace.
bool parse_int(const std::string& text, long long lo, long long hi, long long* out) {
  std::string s = trim(text);
  size_t i = 0;
  bool neg = false;
  if (i < s.size() && s[i] == '-') neg = true, i++;
  if (i == s.size() || s.size() - i > 18) return false;
  long long v = 0;
  for (; i < s.size(); i++) {
    if (s[i] < '0' || s[i] > '9') return false;
    v = v * 10 + (s[i] - '0');
  }
  v = neg ? -v : v;
  if (v < lo || v > hi) return false;
  *out = v;
  return true;
}

bool read_int(const std::string& path, long long lo, long long hi, long long* out) {
  std::string s;
  return read_text(path, &s) && parse_int(s, lo, hi, out);
}

bool read_cpu_list(const std::string& path, std::vector<int>* out) {
  std::string s;
  return read_text(path, &s) && parse_cpu_list(s, out);
}

// The numbers N of the entries "<prefix>N" in a directory, ascending; empty when it cannot be read.
std::vector<int> numbered_entries(const std::string& dir, const char* prefix) {
  std::vector<int> ids;
  DIR* d = opendir(dir.c_str());
  if (!d) return ids;
  const size_t plen = strlen(prefix);
  while (dirent* e = readdir(d)) {
    long long v;
    if (strncmp(e->d_name, prefix, plen) == 0 && parse_int(e->d_name + plen, 0, kMaxCpuId - 1, &v) &&
        std::string(e->d_name + plen).find_first_not_of("0123456789") == std::string::npos)
      ids.push_back((int)v);
  }
  closedir(d);
  std::sort(ids.begin(), ids.end());
  return ids;
}

bool contains(const std::vector<int>& sorted, int v) { return std::binary_search(sorted.begin(), sorted.end(), v); }

std::vector<int> intersect(const std::vector<int>& a, const std::vector<int>& b) {
  std::vector<int> r;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(r));
  return r;
}

struct UnionFind {
  std::vector<int> parent;
  explicit UnionFind(size_t n) : parent(n) { std::iota(parent.begin(), parent.end(), 0); }
  int find(int x) {
    while (parent[x] != x) x = parent[x] = parent[parent[x]];
    return x;
  }
  void join(int a, int b) {
    a = find(a), b = find(b);
    if (a != b) parent[std::max(a, b)] = std::min(a, b);
  }
};

// CPUID leaf 0x1A describes the core that executes it, so a helper thread visits each CPU it may
// run on. Returns false when the CPU is not a hybrid x86 or no CPU could be probed.
bool probe_core_types_cpuid(Topology* topo) {
#if defined(__linux__) && (defined(__x86_64__) || defined(__i386__))
  unsigned a, b, c, d;
  if (__get_cpuid_max(0, nullptr) < 0x1A) return false;
  __cpuid_count(7, 0, a, b, c, d);
  if (!(d & (1u << 15))) return false;  // CPUID.7.EDX[15]: hybrid part
  const std::vector<int> allowed = process_allowed_cpus();
  std::map<int, CoreType> found;
  std::thread probe([&] {
    for (int cpu : allowed) {
      if (!pin_current_thread(cpu) || sched_getcpu() != cpu) continue;
      unsigned ea, eb, ec, ed;
      __cpuid_count(0x1A, 0, ea, eb, ec, ed);
      const unsigned kind = ea >> 24;  // 0x20: Atom (E-core), 0x40: Core (P-core)
      if (kind == 0x40) found[cpu] = CoreType::Performance;
      if (kind == 0x20) found[cpu] = CoreType::Efficiency;
    }
  });
  probe.join();
  for (LogicalCpu& c : topo->cpus) {
    auto it = found.find(c.id);
    if (it != found.end()) c.type = it->second;
  }
  return !found.empty();
#else
  (void)topo;
  return false;
#endif
}

}  // namespace

const char* core_type_name(CoreType t) {
  return t == CoreType::Performance ? "P" : t == CoreType::Efficiency ? "E" : "?";
}

bool parse_cpu_list(const std::string& text, std::vector<int>* out) {
  std::vector<int> ids;
  std::string s = trim(text);
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    pos = comma == std::string::npos ? s.size() : comma + 1;
    size_t dash = item.find('-');
    long long lo, hi;
    if (dash == std::string::npos) {
      if (!parse_int(item, 0, kMaxCpuId - 1, &lo)) return false;
      hi = lo;
    } else if (!parse_int(item.substr(0, dash), 0, kMaxCpuId - 1, &lo) ||
               !parse_int(item.substr(dash + 1), 0, kMaxCpuId - 1, &hi) || hi < lo) {
      return false;
    }
    for (long long v = lo; v <= hi; v++) ids.push_back((int)v);
    if (ids.size() > (size_t)kMaxCpuId) return false;
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  *out = std::move(ids);
  return true;
}

int64_t parse_cache_size(const std::string& text) {
  std::string s = trim(text);
  int64_t mult = 1;
  if (!s.empty() && (s.back() == 'K' || s.back() == 'M' || s.back() == 'G')) {
    mult = s.back() == 'K' ? 1LL << 10 : s.back() == 'M' ? 1LL << 20 : 1LL << 30;
    s.pop_back();
  }
  long long v;
  if (!parse_int(s, 0, 1LL << 40, &v)) return -1;
  return v * mult;
}

const LogicalCpu* Topology::cpu(int id) const {
  auto it = std::lower_bound(cpus.begin(), cpus.end(), id, [](const LogicalCpu& c, int v) { return c.id < v; });
  return it != cpus.end() && it->id == id ? &*it : nullptr;
}

int Topology::threads_per_core() const {
  size_t n = 1;
  for (const PhysicalCore& c : cores) n = std::max(n, c.cpus.size());
  return (int)n;
}

std::vector<int> Topology::cores_in_node(int node) const {
  std::vector<int> r;
  for (size_t i = 0; i < cores.size(); i++)
    if (cores[i].node == node) r.push_back((int)i);
  return r;
}

namespace {

// read_topology in steps, each filling part of one Topology: online CPUs, then per-CPU packages and
// nodes, then the cores they group into, their types, and the caches.
class TopologyReader {
 public:
  explicit TopologyReader(const std::string& root) : root_(root), cpu_dir_(root + "/devices/system/cpu") {}

  Topology read(bool probe_cpuid) {
    read_online();
    read_packages_and_nodes();
    group_cores();
    read_core_types(probe_cpuid);
    read_caches();
    std::set<int> packages, nodes;
    for (const LogicalCpu& c : t_.cpus) packages.insert(c.package), nodes.insert(c.node);
    t_.packages.assign(packages.begin(), packages.end());
    t_.nodes.assign(nodes.begin(), nodes.end());
    return std::move(t_);
  }

 private:
  void note(const std::string& s) { t_.notes.push_back(s); }
  int index_of(int id) const {  // id must be online
    return (int)(std::lower_bound(online_.begin(), online_.end(), id) - online_.begin());
  }
  std::string topology_file(int cpu, const char* name) const {
    return cpu_dir_ + "/cpu" + std::to_string(cpu) + "/topology/" + name;
  }

  // The "online" list, else the cpuN directories, else what the C++ runtime reports.
  void read_online() {
    if (!read_cpu_list(cpu_dir_ + "/online", &online_) || online_.empty()) {
      online_ = numbered_entries(cpu_dir_, "cpu");
      if (online_.empty()) {
        const int n = std::max(1u, std::thread::hardware_concurrency());
        for (int i = 0; i < n; i++) online_.push_back(i);
        note("no CPU list in sysfs: assuming " + std::to_string(n) + " CPUs");
      } else {
        note("devices/system/cpu/online unreadable: using the cpuN directories");
      }
    }
    t_.cpus.resize(online_.size());
    for (size_t i = 0; i < online_.size(); i++) t_.cpus[i].id = online_[i];
  }

  // Packages from physical_package_id (0 when missing, or -1 as on some ARM boards). Nodes from each
  // nodeN/cpulist: a CPU in no list joins the lowest node, one in two lists the first.
  void read_packages_and_nodes() {
    int no_package = 0;
    for (LogicalCpu& c : t_.cpus) {
      long long pkg;
      if (!read_int(topology_file(c.id, "physical_package_id"), 0, kMaxCpuId, &pkg)) pkg = 0, no_package++;
      c.package = (int)pkg;
    }
    if (no_package) note(std::to_string(no_package) + " CPUs without a package id: package 0");

    const std::string node_dir = root_ + "/devices/system/node";
    std::vector<int> node_of(online_.size(), -1);
    int lowest = -1;
    for (int node : numbered_entries(node_dir, "node")) {
      std::vector<int> list;
      if (!read_cpu_list(node_dir + "/node" + std::to_string(node) + "/cpulist", &list)) {
        note("node" + std::to_string(node) + "/cpulist unreadable");
        continue;
      }
      for (int id : intersect(list, online_)) {
        int& slot = node_of[index_of(id)];
        if (slot < 0) slot = node, lowest = lowest < 0 ? node : std::min(lowest, node);
      }
    }
    if (lowest < 0) note("no NUMA node lists: one node");
    int orphans = 0;
    for (size_t i = 0; i < online_.size(); i++) {
      if (node_of[i] < 0) node_of[i] = std::max(lowest, 0), orphans++;
      t_.cpus[i].node = node_of[i];
    }
    if (lowest >= 0 && orphans) note(std::to_string(orphans) + " CPUs in no node list");
  }

  // Cores are the classes of "shares a core with": the sibling lists when they are readable (they are
  // right even where core_id repeats across dies), else equal (package, die, core_id), else the CPU
  // alone. Ordered by their first CPU.
  void group_cores() {
    const size_t n = online_.size();
    UnionFind same_core(n);
    std::map<std::tuple<long long, long long, long long>, int> by_core_id;
    int no_siblings = 0;
    for (size_t i = 0; i < n; i++) {
      const int id = online_[i];
      std::vector<int> sib;
      long long die = 0, core_id;
      if ((read_cpu_list(topology_file(id, "core_cpus_list"), &sib) ||
           read_cpu_list(topology_file(id, "thread_siblings_list"), &sib)) &&
          contains(sib, id)) {
        for (int s : intersect(sib, online_)) same_core.join((int)i, index_of(s));
        continue;
      }
      no_siblings++;
      if (!read_int(topology_file(id, "core_id"), 0, 1LL << 31, &core_id)) continue;
      if (!read_int(topology_file(id, "die_id"), 0, kMaxCpuId, &die)) die = 0;
      auto key = std::make_tuple((long long)t_.cpus[i].package, die, core_id);
      auto it = by_core_id.emplace(key, (int)i).first;
      same_core.join((int)i, it->second);
    }
    if (no_siblings) note(std::to_string(no_siblings) + " CPUs without SMT sibling lists");

    std::map<int, int> core_of_root;  // the root of a class is its lowest index, so cores come in order
    for (size_t i = 0; i < n; i++) {
      auto it = core_of_root.emplace(same_core.find((int)i), (int)t_.cores.size()).first;
      if (it->second == (int)t_.cores.size()) {
        PhysicalCore pc;
        pc.package = t_.cpus[i].package;
        pc.node = t_.cpus[i].node;
        t_.cores.push_back(pc);
      }
      PhysicalCore& pc = t_.cores[it->second];
      t_.cpus[i].core = it->second;
      t_.cpus[i].smt_index = (int)pc.cpus.size();
      pc.cpus.push_back(online_[i]);
    }
  }

  // The kernel's hybrid PMU lists (Intel hybrid, Linux >= 5.13), else CPUID on the real machine.
  void read_core_types(bool probe_cpuid) {
    std::vector<int> p_list, e_list;
    const bool have_p = read_cpu_list(root_ + "/devices/cpu_core/cpus", &p_list);
    const bool have_e = read_cpu_list(root_ + "/devices/cpu_atom/cpus", &e_list);
    if (have_p || have_e) {
      for (LogicalCpu& c : t_.cpus)
        c.type = contains(p_list, c.id) ? CoreType::Performance
                 : contains(e_list, c.id) ? CoreType::Efficiency : CoreType::Unknown;
      t_.type_source = "sysfs";
    } else if (probe_cpuid && root_ == "/sys" && probe_core_types_cpuid(&t_)) {
      t_.type_source = "cpuid";
    }
    // A core has one type: its first CPU's (siblings agree on real hardware).
    bool any_p = false, any_e = false;
    for (PhysicalCore& pc : t_.cores) {
      pc.type = t_.cpus[index_of(pc.cpus[0])].type;
      for (int id : pc.cpus) t_.cpus[index_of(id)].type = pc.type;
      any_p |= pc.type == CoreType::Performance;
      any_e |= pc.type == CoreType::Efficiency;
    }
    t_.hybrid = any_p && any_e;
  }

  // cpuN/cache/indexM: one CacheInfo per distinct (level, type, sharing CPUs), sorted by level, type
  // and first CPU so indices read naturally.
  void read_caches() {
    using Key = std::tuple<int, std::string, std::vector<int>>;
    std::map<Key, int64_t> sizes;
    std::vector<std::array<Key, 3>> per_cpu(online_.size());  // l1d, l2, l3 (level 0: none)
    int bad = 0;
    for (size_t i = 0; i < online_.size(); i++) {
      const int id = online_[i];
      const std::string dir = cpu_dir_ + "/cpu" + std::to_string(id) + "/cache";
      for (int idx : numbered_entries(dir, "index")) {
        const std::string d = dir + "/index" + std::to_string(idx) + "/";
        long long level;
        std::string type, size_text;
        if (!read_int(d + "level", 1, 4, &level) || !read_text(d + "type", &type) ||
            ((type = trim(type)) != "Data" && type != "Instruction" && type != "Unified")) {
          bad++;
          continue;
        }
        std::vector<int> shared;
        if (!read_cpu_list(d + "shared_cpu_list", &shared) || !contains(shared, id)) shared = {id};
        int64_t size = read_text(d + "size", &size_text) ? parse_cache_size(size_text) : -1;
        if (size < 0) size = 0, bad++;
        Key key{(int)level, type, intersect(shared, online_)};
        sizes.emplace(key, size);
        if (type != "Instruction" && level <= 3) per_cpu[i][level - 1] = key;
      }
    }
    if (bad) note(std::to_string(bad) + " unreadable cache entries ignored");

    std::vector<Key> keys;
    for (const auto& kv : sizes) keys.push_back(kv.first);
    auto rank = [](const Key& k) { return std::make_tuple(std::get<0>(k), std::get<1>(k), std::get<2>(k).front()); };
    std::sort(keys.begin(), keys.end(), [&](const Key& a, const Key& b) { return rank(a) < rank(b); });
    std::map<Key, int> index;
    for (const Key& k : keys) {
      index[k] = (int)t_.caches.size();
      CacheInfo ci;
      ci.level = std::get<0>(k), ci.type = std::get<1>(k), ci.cpus = std::get<2>(k), ci.size_bytes = sizes[k];
      t_.caches.push_back(ci);
    }
    for (size_t i = 0; i < online_.size(); i++) {
      int* dst[3] = {&t_.cpus[i].l1d, &t_.cpus[i].l2, &t_.cpus[i].l3};
      for (int l = 0; l < 3; l++)
        if (std::get<0>(per_cpu[i][l]) != 0) *dst[l] = index[per_cpu[i][l]];
    }
  }

  const std::string root_, cpu_dir_;
  std::vector<int> online_;  // ascending; t_.cpus[i].id == online_[i]
  Topology t_;
};

}  // namespace

Topology read_topology(const std::string& sysfs_root, bool probe_cpuid) {
  return TopologyReader(sysfs_root).read(probe_cpuid);
}

const Topology& system_topology() {
  static const Topology topo = read_topology("/sys", true);
  return topo;
}

std::vector<int> process_allowed_cpus() {
  std::vector<int> cpus;
#if defined(__linux__)
  // The mask must be at least the kernel's size; grow it until the kernel accepts it.
  for (int bits = 1024; bits <= kMaxCpuId; bits *= 2) {
    cpu_set_t* set = CPU_ALLOC(bits);
    if (!set) break;
    const size_t bytes = CPU_ALLOC_SIZE(bits);
    CPU_ZERO_S(bytes, set);
    if (sched_getaffinity(0, bytes, set) == 0) {
      for (int c = 0; c < bits; c++)
        if (CPU_ISSET_S(c, bytes, set)) cpus.push_back(c);
      CPU_FREE(set);
      break;
    }
    CPU_FREE(set);
    if (errno != EINVAL) break;
  }
#endif
  return cpus;
}

bool set_thread_cpus(std::thread::native_handle_type thread, const std::vector<int>& cpus) {
#if defined(__linux__)
  if (cpus.empty()) return false;
  const int top = *std::max_element(cpus.begin(), cpus.end());
  if (*std::min_element(cpus.begin(), cpus.end()) < 0 || top >= kMaxCpuId) return false;
  cpu_set_t* set = CPU_ALLOC(top + 1);
  if (!set) return false;
  const size_t bytes = CPU_ALLOC_SIZE(top + 1);
  CPU_ZERO_S(bytes, set);
  for (int c : cpus) CPU_SET_S(c, bytes, set);
  const bool ok = pthread_setaffinity_np(thread, bytes, set) == 0;
  CPU_FREE(set);
  return ok;
#else
  (void)thread, (void)cpus;
  return false;
#endif
}

bool pin_thread(std::thread::native_handle_type thread, int cpu) { return set_thread_cpus(thread, {cpu}); }

bool set_current_thread_cpus(const std::vector<int>& cpus) {
#if defined(__linux__)
  return set_thread_cpus(pthread_self(), cpus);
#else
  (void)cpus;
  return false;
#endif
}

bool pin_current_thread(int cpu) { return set_current_thread_cpus({cpu}); }

bool make_current_thread_idle_priority() {
#if defined(__linux__) && defined(SCHED_IDLE)
  sched_param p{};
  return pthread_setschedparam(pthread_self(), SCHED_IDLE, &p) == 0;
#else
  return false;
#endif
}

int current_node(const Topology& topo) {
#if defined(__linux__)
  const LogicalCpu* c = topo.cpu(sched_getcpu());
  return c ? c->node : -1;
#else
  (void)topo;
  return -1;
#endif
}

namespace {

// The cores threads may use under a policy, in plan order: node (ascending, so the first node that
// has an allowed CPU comes first; under Distribute the nodes take turns: each node's first core, then
// each node's second...), then P, unknown, E, then first CPU. Under Isolate only the home node's
// cores. Each entry is (node, the core's allowed CPUs ascending).
std::vector<std::pair<int, std::vector<int>>> usable_cores(const Topology& topo, std::vector<int> allowed,
                                                           const PlanPolicy& policy) {
  std::sort(allowed.begin(), allowed.end());
  std::vector<int> ok;
  for (const LogicalCpu& c : topo.cpus)
    if (allowed.empty() || contains(allowed, c.id)) ok.push_back(c.id);
  auto rank = [](CoreType t) { return t == CoreType::Performance ? 0 : t == CoreType::Unknown ? 1 : 2; };
  std::vector<std::tuple<int, int, int, int>> order;  // node, type rank, first CPU, core index
  bool any_non_e = false;
  for (size_t i = 0; i < topo.cores.size(); i++) {
    const PhysicalCore& pc = topo.cores[i];
    std::vector<int> mine = intersect(pc.cpus, ok);
    if (mine.empty()) continue;
    any_non_e |= pc.type != CoreType::Efficiency;
    order.emplace_back(pc.node, rank(pc.type), mine[0], (int)i);
  }
  std::sort(order.begin(), order.end());
  std::vector<std::pair<int, std::vector<int>>> cores;
  for (const auto& o : order) {
    const PhysicalCore& pc = topo.cores[std::get<3>(o)];
    // Without P-cores to fall back on, "no E-cores" would mean no threads at all: ignore it then.
    if (!policy.e_cores && any_non_e && pc.type == CoreType::Efficiency) continue;
    cores.emplace_back(pc.node, intersect(pc.cpus, ok));
  }
  if (cores.empty()) return cores;
  if (policy.numa == NumaPolicy::Isolate) {
    int home = cores[0].first;
    for (const auto& c : cores)
      if (c.first == policy.home_node) home = c.first;
    cores.erase(std::remove_if(cores.begin(), cores.end(), [&](const auto& c) { return c.first != home; }),
                cores.end());
  } else if (policy.numa == NumaPolicy::Distribute) {
    std::map<int, int> seen;  // node -> cores of it so far
    std::vector<std::pair<int, int>> turn(cores.size());  // (turn within its node, node)
    for (size_t i = 0; i < cores.size(); i++) turn[i] = {seen[cores[i].first]++, cores[i].first};
    std::vector<size_t> idx(cores.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return turn[a] < turn[b]; });
    std::vector<std::pair<int, std::vector<int>>> dealt;
    for (size_t i : idx) dealt.push_back(cores[i]);
    cores = std::move(dealt);
  }
  return cores;
}

}  // namespace

int default_thread_count(const Topology& topo, const std::vector<int>& allowed, const PlanPolicy& policy) {
  auto cores = usable_cores(topo, allowed, policy);
  if (cores.empty()) return 1;
  if (policy.numa == NumaPolicy::Distribute) return (int)cores.size();
  int count = 0;
  for (const auto& c : cores) count += c.first == cores[0].first;
  return count;
}
std::vector<int> plan_threads(const Topology& topo, int n_threads, const std::vector<int>& allowed,
                              const PlanPolicy& policy) {
  if (n_threads <= 0) n_threads = default_thread_count(topo, allowed, policy);
  std::vector<int> seq;
  auto cores = usable_cores(topo, allowed, policy);
  for (const auto& c : cores) seq.push_back(c.second[0]);
  if (policy.smt_siblings)
    for (size_t k = 1, more = 1; more; k++) {  // second siblings of every core, then third...
      more = 0;
      for (const auto& c : cores)
        if (k < c.second.size()) seq.push_back(c.second[k]), more = 1;
    }
  std::vector<int> plan(n_threads, -1);
  for (int i = 0; i < n_threads && i < (int)seq.size(); i++) plan[i] = seq[i];
  return plan;
}

}  // namespace corelm
