// A persistent thread pool: workers spin briefly waiting for the next parallel region (a decode step
// runs a few hundred of them, so waking threads through the kernel each time would dominate), then
// sleep on a condition variable. The calling thread takes part in every region.
//
// Two kinds of region:
//
// parallel(fn): n_threads slots, fn(slot, n_threads) runs once per slot. Threads claim slots from a
// shared counter instead of owning one each, so a thread that the OS descheduled before the region
// began does not stall it: whoever is running takes its slot. The region ends when every slot is done.
//
// parallel_chunks(task, chunking): the kernels' regions. The work (rows, heads, blocks) is cut into
// chunks of `grain` units; how chunks reach threads is the pool's Schedule:
//   Static   the chunks are split into n_threads equal contiguous slots, claimed as above.
//   Dynamic  each thread owns a contiguous home range of chunks sized by its measured speed (work per
//            busy nanosecond, smoothed, re-measured every region), claims most of what is left of it
//            from the front (consecutive chunks, one kernel call), and when it runs out steals single
//            chunks from the back of the others' ranges. A thread that
//            the OS deschedules while it computes a chunk (another process on its core, for
//            milliseconds) would still stall the region, so the caller, once every chunk is claimed,
//            redoes chunks that stay unfinished well past their expected time. Whoever finishes first
//            commits: the chunk's state word goes to the region's generation by one CAS, and only the
//            winner writes the shared outputs. A late finisher's CAS fails and its result is dropped.
// Redo needs tasks whose compute() is idempotent and writes only the thread's scratch; see ChunkTask.
//
// Node-local rows (NUMA): given each thread's node, a region's units are first cut into one
// contiguous range per node (split_by_node over the threads per node, in multiples of align: the same
// ranges Model::place_weights binds to that node's memory), each cut into its own chunks. A thread's
// home range lies inside its node's range: static splits the node's units equally among the node's
// threads, dynamic its chunks by their speeds. A thread claims its own node's work first (its own
// range, then stealing from threads of its node) and only then another node's. A thread with node -1
// has no home range and takes any. Fewer than two nodes: one range of all units, as without NUMA.
//
// Workers are pinned one per physical core by the thread plan (runtime/topology.h): thread t of the
// plan is worker t for t >= 1, and plan[0] is left free for the calling thread, which is not pinned
// unless pin_caller asks for it (pinning a Python thread would outlive the pool and be inherited by
// every process it starts). Pinning keeps a worker's slice of the weights in its own core's caches
// across regions and keeps two workers off one core's SMT siblings. The model passes its NUMA plan
// (NumaLayout::thread_cpus and thread_node); other pools use the default plan.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "common/names.h"
#include "runtime/numa.h"

namespace corelm {

enum class Schedule : int { Static = 0, Dynamic = 1 };
inline constexpr EnumName<Schedule> kScheduleNames[] = {{Schedule::Dynamic, "dynamic"}, {Schedule::Static, "static"}};
inline const char* schedule_name(Schedule s) { return name_of(kScheduleNames, s); }
inline Schedule parse_schedule(const std::string& name) { return parse_name(kScheduleNames, name, "schedule"); }

// How a chunked region's work is cut. units are the task's items (rows, heads, blocks); every chunk
// boundary is a multiple of align (what the task's kernels need whole, e.g. 16 rows). grain is the
// wanted chunk size, which the pool resizes (in multiples of align) so every thread has 4 to 16
// chunks: enough to balance with. A thread claims several consecutive chunks of its own at once
// (most of what is left of its range), so undisturbed it makes about two kernel calls per region.
// unit_work is a unit's relative cost (bytes of weights it reads), so speeds measured on different
// regions are comparable.
struct Chunking {
  int64_t units = 0;
  int64_t align = 1;
  int64_t grain = 1;
  int64_t tokens = 1;  // results per unit: tokens x cols floats
  int64_t cols = 1;
  double unit_work = 1;
};

// The interface parallel_chunks expects (a struct with these three const members; it must be
// trivially copyable and at most kTaskBytes, because every thread works on its own copy):
//   prepare(buf)                   once per buffer index and region, before that index's first chunk
//   compute(buf, u0, u1, s, ld)    the results of units [u0, u1) into scratch: token t's start at
//                                  s + t * ld, unit u's cols of them at offset (u - u0) * cols. It may
//                                  also write memory private to buffer index buf, and must read only
//                                  memory that stays allocated until ThreadPool::quiesce(): a
//                                  descheduled thread may still run it after the region is over (its
//                                  result is then dropped).
//   commit(u0, u1, s, ld)          writes the results of [u0, u1) (same layout, s at unit u0) to the
//                                  shared outputs; runs exactly once per unit, while the region is live.
// buf is in [0, n_threads): the thread (dynamic) or the slot (static), never used by two threads at
// once. The scratch is the pool's, one buffer per index.

// One node's part of a chunked region: units [unit_begin, unit_end) cut into chunks
// [chunk_begin, chunk_end) of grain units (the last one may be short).
struct ChunkGroup {
  int node = -1;
  int64_t unit_begin = 0, unit_end = 0, chunk_begin = 0, chunk_end = 0;
};

// The groups of a region of `units` units in multiples of align, chunks of grain units (a multiple of
// align): one per share (split_by_node), or with fewer than two shares a single group (node -1) of all.
// Writes them to out (room for max(1, shares.size())) and returns how many.
int chunk_groups(int64_t units, int64_t align, int64_t grain, const std::vector<NodeShare>& shares, ChunkGroup* out);

// The shares the pool splits by: each node's threads (nodes >= 0), ascending; empty with fewer than
// two nodes, where there is nothing to split.
std::vector<NodeShare> pool_node_shares(const std::vector<int>& thread_node);

// Each thread's home range: its index into groups (the group of its node; with one group every
// thread's; -1 for a thread whose node has none) and [begin, end) in it. Static: the group's units
// split equally among its threads in multiples of align. Dynamic: the group's chunks split in
// proportion to weights (its threads' speeds). Ranges follow thread order inside a group.
struct HomeRange {
  int group = -1;
  int64_t begin = 0, end = 0;
};
void home_ranges(const ChunkGroup* groups, int n_groups, const std::vector<int>& thread_node, Schedule schedule,
                 int64_t align, const double* weights, HomeRange* out);

class alignas(64) ThreadPool {  // whole lines: nothing around it shares the lines workers read
 public:
  static constexpr size_t kTaskBytes = 256;
  static constexpr int kMaxGroups = 8;  // nodes a region splits by; more nodes: no split by node

  // pin: pin workers to the plan's CPUs (failures, e.g. a cpuset that forbids them, are ignored).
  // pin_caller: also pin every thread that calls run() to plan[0], permanently (opt-in).
  explicit ThreadPool(int n_threads, bool pin = true, bool pin_caller = false,
                      Schedule schedule = Schedule::Dynamic);
  // A pool of plan.size() threads on a given plan (-1: not pinned), each thread's node given by
  // thread_node (see set_thread_nodes).
  ThreadPool(const std::vector<int>& plan, const std::vector<int>& thread_node, bool pin = true,
             bool pin_caller = false, Schedule schedule = Schedule::Dynamic);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  Schedule schedule() const { return schedule_; }
  // Between regions only. Buffer indices mean threads under one schedule and slots under the other,
  // so this first waits until no descheduled thread still uses its buffers.
  void set_schedule(Schedule s) {
    quiesce();
    schedule_ = s;
  }
  // Between regions only: the node whose rows each thread works on first (-1: none; a shorter list
  // leaves the rest at -1). Fewer than two distinct nodes: no split by node. The model sets its NUMA
  // plan's nodes; tests set fake ones.
  void set_thread_nodes(const std::vector<int>& thread_node);
  const std::vector<int>& thread_nodes() const { return thread_node_; }
  int current_thread() const;  // this thread's index in the pool (0: the caller or a stranger)
  // The CPU each thread is pinned to, -1 where it is not; [0] is the calling thread.
  const std::vector<int>& thread_cpus() const { return thread_cpus_; }
  // Each thread's smoothed speed as a share of the pool's (dynamic schedule; equal before any
  // measurement), and how many chunks the caller has redone, for tests and benchmarks.
  std::vector<double> speed_shares() const;
  uint64_t redone_chunks() const { return redone_; }

  // Runs fn(slot, n_threads) for every slot in [0, n_threads) and returns when all have finished.
  template <class F>
  void parallel(F&& fn) {
    using Fn = std::remove_reference_t<F>;
    run([](void* ctx, int slot, int n) { (*static_cast<Fn*>(ctx))(slot, n); }, (void*)&fn);
  }
  void run(void (*fn)(void*, int, int), void* ctx);

  // Runs a ChunkTask over c.units units and returns when every chunk is committed.
  template <class Task>
  void parallel_chunks(const Task& task, const Chunking& c) {
    static_assert(std::is_trivially_copyable<Task>::value, "a chunk task is copied by every thread");
    static_assert(sizeof(Task) <= kTaskBytes && alignof(Task) <= 8, "chunk task too large");
    Region r;
    r.prepare = [](const void* t, int buf) { static_cast<const Task*>(t)->prepare(buf); };
    r.compute = [](const void* t, int buf, int64_t u0, int64_t u1, float* s, int64_t ld) {
      static_cast<const Task*>(t)->compute(buf, u0, u1, s, ld);
    };
    r.commit = [](const void* t, int64_t u0, int64_t u1, const float* s, int64_t ld) {
      static_cast<const Task*>(t)->commit(u0, u1, s, ld);
    };
    std::memcpy(r.task, &task, sizeof(Task));
    r.task_words = (sizeof(Task) + 7) / 8;
    run_chunks(r, c);
  }

  // Returns once no worker is inside a chunked region any more, not even a descheduled one finishing
  // a chunk whose result was already dropped. Call before freeing or reallocating anything a task's
  // compute() reads, and before destroying it.
  void quiesce();

  // Workers stop spinning for the next region and sleep at once: another pool (a speculative draft
  // model's) is about to run on the same cores. The next region wakes them as usual.
  void park() { park_.store(true, std::memory_order_relaxed); }

 private:
  // What a chunked region's threads copy (the task and how to run it), trivially copyable.
  struct Region {
    void (*prepare)(const void*, int) = nullptr;
    void (*compute)(const void*, int, int64_t, int64_t, float*, int64_t) = nullptr;
    void (*commit)(const void*, int64_t, int64_t, const float*, int64_t) = nullptr;
    int64_t units = 0, align = 1, grain = 1, chunks = 0;
    int64_t tokens = 1, cols = 1;
    int64_t max_claim = 1;  // chunks one claim may take: what the scratch holds
    double unit_work = 1;
    int64_t n_groups = 1;    // node groups in use: only those are copied
    int64_t task_words = 0;  // words of task in use: only those are copied
    alignas(8) unsigned char task[kTaskBytes];
    // Node groups, after the task so the lines a region reads stay few: group g holds units
    // [group[g].unit, group[g + 1].unit) as chunks [group[g].chunk, group[g + 1].chunk).
    struct Bound {
      int64_t unit, chunk;
    } group[kMaxGroups + 1];
  };
  // Units [*u0, *u1) of chunks [c0, c1), which lie in one group.
  static void chunk_units(const Region& r, int64_t c0, int64_t c1, int64_t* u0, int64_t* u1);
  static constexpr size_t kRegionWords = sizeof(Region) / 8;
  static constexpr int64_t kHeaderWords = offsetof(Region, task) / 8, kGroupWord = offsetof(Region, group) / 8;
  static_assert(sizeof(Region) % 8 == 0, "a region is copied in 8-byte words");

  // Per thread (and per buffer index), on its own line: its home range of the current region's
  // chunks, its busy time, its node and scratch buffer (both set only between regions).
  struct alignas(64) ThreadState {
    std::atomic<uint64_t> range{0};       // generation tag | front | back, see pack_range()
    std::atomic<uint64_t> in_region{0};   // nonzero while the thread runs a chunked region (quiesce)
    std::atomic<double> work_done{0};     // totals, written by the thread only
    std::atomic<int64_t> busy_ns{0};
    int node = -1;
    float* scratch = nullptr;             // 64-byte aligned inside scratch_store_
  };

  void worker_loop(int thread);
  // Whether thread u should be tried before others by thread t: the same node (pass 0), then the rest.
  bool steal_pass(int t, int u, int pass) const { return (threads_[u].node == threads_[t].node) == (pass == 0); }
  void pin_caller_once();
  void compute_shares(double* shares) const;
  int claim_slots(uint64_t generation, bool worker);  // returns how many slots this thread ran
  void run_chunks(const Region& r, const Chunking& c);
  void run_chunks_static(const Region& r);
  void publish(uint64_t state);
  bool load_region(uint64_t generation, Region* r) const;
  // Claims and computes chunks until none is left; returns how many this thread committed.
  int work_chunks(uint64_t generation, int thread, const Region& r, bool* prepared);
  // Claims chunks [*first, returned) of this region: consecutive ones from the front of the thread's
  // own range, else one from the back of another's; returns -1 when none is left.
  int64_t claim_chunks(uint64_t generation, int thread, const Region& r, int64_t* first);
  // Computes chunks [c0, c1) in one call and commits each one nobody has committed; returns how many.
  int run_claim(uint64_t generation, int buf, const Region& r, int64_t c0, int64_t c1);
  void wait_or_redo(uint64_t generation, const Region& r, int caller_commits, bool* prepared);
  void update_speeds();
  void ensure_chunk_buffers(int64_t chunks, int64_t scratch_floats);
  float* scratch(int buf) { return threads_[buf].scratch; }

  static constexpr int kSlotBits = 16;
  static constexpr uint64_t kChunked = 1ull << kSlotBits;  // state flag: a chunked region
  static constexpr int kGenShift = kSlotBits + 1;

  // Set at construction or between regions (after quiesce); workers read some of them.
  int n_threads_;
  Schedule schedule_;
  std::vector<std::thread> workers_;
  std::vector<int> thread_cpus_;
  int caller_cpu_ = -1;                // plan[0] when pin_caller, else -1
  std::thread::id pinned_caller_;      // the last calling thread pinned to caller_cpu_
  std::vector<int> thread_node_;       // each thread's node, -1 for none
  std::vector<NodeShare> node_shares_; // the split by node; empty: none
  std::unique_ptr<std::atomic<uint64_t>[]> static_part_;  // per part: the static region that claimed it
  // Chunk commit states (the generation that committed it) and per-buffer scratch; grown only after
  // quiesce(), since a descheduled thread may still be using them.
  std::unique_ptr<std::atomic<uint64_t>[]> chunk_state_;
  int64_t chunk_capacity_ = 0;
  std::vector<std::vector<float>> scratch_store_;
  int64_t scratch_capacity_ = 0;

  // Caller-only state, written every region, on lines of its own (and heap blocks workers never
  // read), so writing them costs no transfers.
  alignas(64) uint64_t generation_ = 0;
  uint64_t worker_done_target_ = 0;    // hot_.worker_done once the current region is over
  uint64_t static_regions_ = 0;        // static regions split by node: static_part_'s tags
  uint64_t redone_ = 0;
  std::vector<double> speed_;          // per thread: smoothed work per busy ns (0: not measured yet)
  std::vector<double> shares_;         // the current region's split
  ChunkGroup groups_[kMaxGroups];      // the current region's node groups
  int n_groups_ = 1;
  struct AlignedDelete {
    void operator()(HomeRange* p) const { ::operator delete[](p, std::align_val_t(64)); }
  };
  std::unique_ptr<HomeRange[], AlignedDelete> homes_;  // the current region's, on lines of their own
  std::vector<double> seen_work_, pending_work_;  // totals already folded into speed_, and not yet
  std::vector<int64_t> seen_busy_, pending_busy_;

  // Everything a region touches, on one cache line: the caller publishes fn/ctx with state, workers
  // claim slots and count finished ones on it. One line moving between cores per region instead of
  // three (fn/ctx, state, done) took the 2-thread region from about 0.55 to 0.35 us on a Xeon.
  struct alignas(64) Hot {
    std::atomic<uint64_t> state{0};        // (generation << kGenShift) | chunked flag | next free slot
    std::atomic<uint64_t> worker_done{0};  // slots (or chunks) finished by workers, ever: never reset,
                                           // so the caller need not write it for each region
    void (*fn)(void*, int, int) = nullptr;
    void* ctx = nullptr;
    int n_slots = 1;
  } hot_;
  static_assert(sizeof(Hot) == 64, "the region's state must fit one cache line");

  // A chunked region's description, double-buffered by generation: a worker copies it word by word
  // and keeps the copy only if the generation has not moved on meanwhile (a seqlock), so it never
  // depends on the caller's stack.
  std::atomic<uint64_t> region_words_[2][kRegionWords];
  std::unique_ptr<ThreadState[]> threads_;

  // The sleep path, off the hot line.
  alignas(64) std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> park_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

// [begin, end) of n items for slot tid of nth, in whole multiples of grain (the last may be short).
inline void split_range(int64_t n, int tid, int nth, int64_t grain, int64_t* begin, int64_t* end) {
  int64_t blocks = (n + grain - 1) / grain;
  int64_t b0 = blocks * tid / nth, b1 = blocks * (tid + 1) / nth;
  *begin = b0 * grain < n ? b0 * grain : n;
  *end = b1 * grain < n ? b1 * grain : n;
}

}  // namespace corelm
