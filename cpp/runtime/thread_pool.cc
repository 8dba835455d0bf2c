#include "runtime/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>

#include "runtime/cpu_relax.h"
#include "runtime/topology.h"

namespace corelm {

// How long an idle worker polls before it sleeps: long enough to bridge the Python-side work between
// two decode steps (sampling, detokenizing), short enough not to burn a core when idle.
static constexpr auto kSpinTime = std::chrono::microseconds(2000);
// Speeds are folded into the smoothed value once a thread has been busy this long since the last
// update (single regions are too short to time well), with this weight for the new measurement.
static constexpr int64_t kMeasureNs = 100000;
static constexpr double kSmoothing = 0.125;
// The caller redoes a claimed chunk once nothing has finished for this long plus a few times the
// chunk's expected time: far below a descheduled thread's milliseconds, far above a running one's.
static constexpr int64_t kStallNs = 20000;
static constexpr double kStallChunks = 3;
// Chunks per thread: the grain shrinks to give each thread at least the first (so leftovers can be
// balanced) and grows to give it at most the second (claims and kernel calls stay few).
static constexpr int64_t kMinChunksPerThread = 4;
static constexpr int64_t kMaxChunksPerThread = 16;
// Scratch per buffer index: bounds how many chunks one claim (or one piece of a static part) spans.
// 128 KiB, so that a prefill claim's results (and the gate/up outputs under them) stay in L2 until
// the activation and the commit read them (a 128-token q4 prefill on AMX: 1 MiB 3% slower on 1 thread,
// 256 KiB alike on 1 thread and 6-8% slower on 2).
static constexpr int64_t kClaimScratchFloats = 1 << 15;
// Work (unit_work, bytes of weights for the model) one dynamic claim may span: a thread descheduled
// in the middle of a claim finishes it when it runs again, for nothing if it was redone meanwhile.
static constexpr double kClaimWork = 1 << 20;

static int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A thread's home range of chunks [front, back), tagged with the low bits of the region's generation
// so a thread still running an earlier region can never claim from this one.
static constexpr int kRangeBits = 22;
static constexpr uint64_t kRangeMask = (1ull << kRangeBits) - 1;
static constexpr int64_t kMaxChunks = (int64_t)kRangeMask;
static uint64_t pack_range(uint64_t generation, int64_t front, int64_t back) {
  return (generation << (2 * kRangeBits)) | ((uint64_t)front << kRangeBits) | (uint64_t)back;
}
static bool range_tag_is(uint64_t word, uint64_t generation) {
  return (word >> (2 * kRangeBits)) == (generation & ((1ull << (64 - 2 * kRangeBits)) - 1));
}

std::vector<NodeShare> pool_node_shares(const std::vector<int>& thread_node) {
  std::vector<NodeShare> shares = node_shares(thread_node);
  if (shares.size() < 2) shares.clear();
  return shares;
}

int chunk_groups(int64_t units, int64_t align, int64_t grain, const std::vector<NodeShare>& shares, ChunkGroup* out) {
  int n = 0;
  if (shares.size() < 2) {
    out[n++] = {-1, 0, units, 0, 0};
  } else {
    for (const RowRange& r : split_by_node(units, align, shares)) out[n++] = {r.node, r.begin, r.end, 0, 0};
  }
  int64_t chunks = 0;
  for (int g = 0; g < n; g++) {
    out[g].chunk_begin = chunks;
    chunks += (out[g].unit_end - out[g].unit_begin + grain - 1) / grain;
    out[g].chunk_end = chunks;
  }
  return n;
}

void home_ranges(const ChunkGroup* groups, int n_groups, const std::vector<int>& thread_node, Schedule schedule,
                 int64_t align, const double* weights, HomeRange* out) {
  const int n = (int)thread_node.size();
  for (int t = 0; t < n; t++) {  // each thread's group: its node's, or the only one
    out[t] = HomeRange{};
    for (int g = 0; g < n_groups; g++)
      if (n_groups == 1 || groups[g].node == thread_node[t]) out[t].group = g;
  }
  for (int g = 0; g < n_groups; g++) {
    int members = 0;
    double total = 0;
    for (int t = 0; t < n; t++)
      if (out[t].group == (int)g) members++, total += weights ? weights[t] : 1.0;
    const ChunkGroup& G = groups[g];
    double cum = 0;
    int64_t front = G.chunk_begin;
    for (int t = 0, i = 0; t < n; t++) {
      if (out[t].group != (int)g) continue;
      if (schedule == Schedule::Static) {
        split_range(G.unit_end - G.unit_begin, i, members, align, &out[t].begin, &out[t].end);
        out[t].begin += G.unit_begin, out[t].end += G.unit_begin;
      } else {
        cum += weights ? weights[t] : 1.0;
        const int64_t n_chunks = G.chunk_end - G.chunk_begin;
        const int64_t back = i == members - 1 ? G.chunk_end
                                              : std::min<int64_t>(G.chunk_end, G.chunk_begin + std::llround(cum / total * n_chunks));
        out[t].begin = front, out[t].end = std::max(front, back);
        front = out[t].end;
      }
      i++;
    }
  }
}

// The default plan where the pool pins anything, else no CPUs.
static std::vector<int> pool_plan(int n_threads, bool pin) {
  n_threads = std::max(1, n_threads);
  if (!pin) return std::vector<int>(n_threads, -1);
  return plan_threads(system_topology(), n_threads, process_allowed_cpus());
}

ThreadPool::ThreadPool(int n_threads, bool pin, bool pin_caller, Schedule schedule)
    : ThreadPool(pool_plan(n_threads, pin || pin_caller), {}, pin, pin_caller, schedule) {}

ThreadPool::ThreadPool(const std::vector<int>& plan, const std::vector<int>& thread_node, bool pin, bool pin_caller,
                       Schedule schedule)
    : n_threads_(std::max<int>(1, (int)plan.size())),
      schedule_(schedule),
      thread_cpus_(n_threads_, -1),
      scratch_store_(n_threads_),
      speed_(n_threads_, 0.0),
      shares_(n_threads_, 0.0),
      seen_work_(n_threads_, 0.0),
      pending_work_(n_threads_, 0.0),
      seen_busy_(n_threads_, 0),
      pending_busy_(n_threads_, 0),
      threads_(new ThreadState[n_threads_]) {
  for (auto& slot : region_words_)
    for (auto& w : slot) w.store(0, std::memory_order_relaxed);
  hot_.n_slots = n_threads_;
  static_part_.reset(new std::atomic<uint64_t>[n_threads_]);
  // Whole lines: the caller writes them every region, workers read what lies next to heap blocks.
  const int home_slots = (n_threads_ + 7) / 8 * 8;
  homes_.reset(static_cast<HomeRange*>(::operator new[](home_slots * sizeof(HomeRange), std::align_val_t(64))));
  for (int t = 0; t < home_slots; t++) new (&homes_[t]) HomeRange();
  for (int t = 0; t < n_threads_; t++) static_part_[t].store(0, std::memory_order_relaxed);
  set_thread_nodes(thread_node);
  if (pin_caller && !plan.empty() && plan[0] >= 0) caller_cpu_ = thread_cpus_[0] = plan[0];
  for (int t = 1; t < n_threads_; t++) {
    workers_.emplace_back([this, t] { worker_loop(t); });
    if (pin && t < (int)plan.size() && pin_thread(workers_.back().native_handle(), plan[t])) thread_cpus_[t] = plan[t];
  }
}

void ThreadPool::set_thread_nodes(const std::vector<int>& thread_node) {
  quiesce();  // a descheduled thread of an earlier region may still be stealing by the old nodes
  thread_node_.assign(n_threads_, -1);
  for (int t = 0; t < n_threads_ && t < (int)thread_node.size(); t++) thread_node_[t] = std::max(-1, thread_node[t]);
  for (int t = 0; t < n_threads_; t++) threads_[t].node = thread_node_[t];
  node_shares_ = pool_node_shares(thread_node_);
  if ((int)node_shares_.size() > kMaxGroups) node_shares_.clear();
}

// Which pool thread runs this code: workers know their index; anything else counts as the caller.
static thread_local const void* tls_pool = nullptr;
static thread_local int tls_thread = 0;
int ThreadPool::current_thread() const { return tls_pool == this ? tls_thread : 0; }

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
    hot_.state.store((generation_ + 1) << kGenShift);
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
}

std::vector<double> ThreadPool::speed_shares() const {
  std::vector<double> shares(n_threads_);
  compute_shares(shares.data());
  return shares;
}

void ThreadPool::compute_shares(double* shares) const {
  double known = 0, sum = 0;
  for (double s : speed_) known += s > 0, sum += s;
  const double unknown = known > 0 ? sum / known : 1.0;  // a thread not measured yet counts as average
  double total = 0;
  for (int t = 0; t < n_threads_; t++) total += shares[t] = speed_[t] > 0 ? speed_[t] : unknown;
  for (int t = 0; t < n_threads_; t++) shares[t] /= total;
}

void ThreadPool::pin_caller_once() {
  if (caller_cpu_ >= 0 && std::this_thread::get_id() != pinned_caller_) {
    pin_current_thread(caller_cpu_);
    pinned_caller_ = std::this_thread::get_id();
  }
}

void ThreadPool::quiesce() {
  for (int t = 1; t < n_threads_; t++)
    while (threads_[t].in_region.load(std::memory_order_acquire)) std::this_thread::yield();
}

void ThreadPool::publish(uint64_t state) {
  park_.store(false, std::memory_order_relaxed);
  hot_.state.store(state, std::memory_order_seq_cst);  // publishes the region; Dekker pair with sleepers_
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(mu_);  // pairs with the sleeper's re-check under the mutex
    cv_.notify_all();
  }
}

int ThreadPool::claim_slots(uint64_t generation, bool worker) {
  for (int ran = 0;;) {
    uint64_t s = hot_.state.load(std::memory_order_acquire);
    if ((s >> kGenShift) != generation) return ran;           // that region is over
    int slot = (int)(s & ((1u << kSlotBits) - 1));
    if (slot >= hot_.n_slots) return ran;                      // every slot is taken
    if (!hot_.state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
    hot_.fn(hot_.ctx, slot, hot_.n_slots);  // safe: the region can't end while this slot is unfinished
    ran++;
    // At once, before looking for another slot: the caller may be waiting on this very count.
    if (worker) hot_.worker_done.fetch_add(1, std::memory_order_release);
  }
}

void ThreadPool::run(void (*fn)(void*, int, int), void* ctx) {
  pin_caller_once();
  if (n_threads_ == 1) {
    fn(ctx, 0, 1);
    return;
  }
  hot_.fn = fn;
  hot_.ctx = ctx;
  const uint64_t gen = ++generation_;
  publish(gen << kGenShift);
  // When the caller's claim_slots returns, every slot is claimed; workers hold the ones it did not run.
  worker_done_target_ += n_threads_ - claim_slots(gen, /*worker=*/false);
  while (hot_.worker_done.load(std::memory_order_acquire) != worker_done_target_) cpu_relax();
}

// ---------------------------------------------------------------------------------------------
// Chunked regions

void ThreadPool::ensure_chunk_buffers(int64_t chunks, int64_t scratch_floats) {
  if (chunks <= chunk_capacity_ && scratch_floats <= scratch_capacity_) return;
  quiesce();  // a descheduled thread of an earlier region may still use the old ones
  if (chunks > chunk_capacity_) {
    const int64_t n = std::max(chunks, 2 * chunk_capacity_);
    chunk_state_.reset(new std::atomic<uint64_t>[n]);
    for (int64_t c = 0; c < n; c++) chunk_state_[c].store(0, std::memory_order_relaxed);
    chunk_capacity_ = n;
  }
  if (scratch_floats > scratch_capacity_) {
    for (int b = 0; b < n_threads_; b++) {
      scratch_store_[b].assign(scratch_floats + 16, 0.f);
      const uintptr_t p = reinterpret_cast<uintptr_t>(scratch_store_[b].data());
      threads_[b].scratch = scratch_store_[b].data() + ((64 - p % 64) % 64) / sizeof(float);
    }
    scratch_capacity_ = scratch_floats;
  }
}

void ThreadPool::run_chunks(const Region& region, const Chunking& c) {
  if (c.units <= 0) return;
  Region r = region;
  r.units = c.units;
  r.align = std::max<int64_t>(1, c.align);
  r.tokens = std::max<int64_t>(1, c.tokens);
  r.cols = std::max<int64_t>(1, c.cols);
  r.unit_work = c.unit_work > 0 ? c.unit_work : 1;
  const int64_t unit_floats = r.tokens * r.cols;
  const int64_t aligned_units = (r.units + r.align - 1) / r.align;  // the split works in these
  int64_t per_chunk = std::max<int64_t>(1, c.grain / r.align);
  per_chunk = std::max(per_chunk, aligned_units / (kMaxChunksPerThread * n_threads_));
  per_chunk = std::min(per_chunk, std::max<int64_t>(1, aligned_units / (kMinChunksPerThread * n_threads_)));
  // (each node group may add one short chunk)
  per_chunk = std::max(per_chunk, (aligned_units + kMaxChunks - kMaxGroups - 1) / (kMaxChunks - kMaxGroups));
  r.grain = per_chunk * r.align;
  // Each node's units (all of them without a split by node) cut into chunks of their own.
  n_groups_ = chunk_groups(r.units, r.align, r.grain, node_shares_, groups_);
  r.n_groups = n_groups_;
  for (int g = 0; g < n_groups_; g++) {
    r.group[g] = {groups_[g].unit_begin, groups_[g].chunk_begin};
    r.group[g + 1] = {groups_[g].unit_end, groups_[g].chunk_end};
  }
  r.chunks = groups_[n_groups_ - 1].chunk_end;
  // A claim (or a static part) spans as many chunks as kClaimScratchFloats of scratch hold, at least one.
  r.max_claim = std::max<int64_t>(1, kClaimScratchFloats / (r.grain * unit_floats));
  ensure_chunk_buffers(r.chunks, std::min(r.chunks, r.max_claim) * r.grain * unit_floats);
  if (schedule_ == Schedule::Static || n_threads_ == 1) return run_chunks_static(r);
  r.max_claim = std::min(r.max_claim, std::max<int64_t>(1, (int64_t)(kClaimWork / (r.grain * r.unit_work))));

  pin_caller_once();
  const uint64_t gen = ++generation_;
  // Home ranges in proportion to the threads' smoothed speeds (within each node).
  update_speeds();
  compute_shares(shares_.data());
  home_ranges(groups_, n_groups_, thread_node_, Schedule::Dynamic, r.align, shares_.data(), homes_.get());
  for (int t = 0; t < n_threads_; t++)
    threads_[t].range.store(pack_range(gen, homes_[t].begin, homes_[t].end), std::memory_order_relaxed);
  // The description for the workers' seqlock copy: the release fence orders the previous region's
  // publication before these stores, so a reader that sees them also sees the generation move on.
  std::atomic_thread_fence(std::memory_order_release);
  uint64_t words[kRegionWords];
  std::memcpy(words, &r, sizeof(r));
  std::atomic<uint64_t>* dst = region_words_[gen & 1];
  for (int64_t i = 0; i < kHeaderWords + r.task_words; i++) dst[i].store(words[i], std::memory_order_relaxed);
  if (r.n_groups > 1)  // one group is all units: load_region rebuilds it, reading no further line
    for (int64_t i = kGroupWord; i < kGroupWord + 2 * (r.n_groups + 1); i++) dst[i].store(words[i], std::memory_order_relaxed);
  publish((gen << kGenShift) | kChunked);

  bool prepared = false;
  const int own = work_chunks(gen, 0, r, &prepared);
  wait_or_redo(gen, r, own, &prepared);
}

// Equal parts (in multiples of align) per slot, computed in pieces of up to max_claim chunks through
// the same scratch-and-commit path as the dynamic schedule, so both give bitwise identical results.
// Split by node, part t is thread t's home range, and a thread takes its own part if nobody has, else
// another unclaimed part of its node, else any.
void ThreadPool::run_chunks_static(const Region& r) {
  const bool by_node = n_groups_ > 1;
  const uint64_t tag = by_node ? ++static_regions_ : 0;
  if (by_node) home_ranges(groups_, n_groups_, thread_node_, Schedule::Static, r.align, nullptr, homes_.get());
  // by value: a worker reads the closure's line, not another of the caller's stack
  parallel([&r, this, by_node, tag](int slot, int n) {
    if (by_node) {
      const int t = current_thread();
      slot = -1;
      for (int pass = 0; pass < 2 && slot < 0; pass++)
        for (int i = 0; i < n && slot < 0; i++) {
          const int u = (t + i) % n;
          if (steal_pass(t, u, pass) && static_part_[u].exchange(tag, std::memory_order_acq_rel) != tag) slot = u;
        }
    }
    int64_t u0, u1;
    if (by_node)
      u0 = homes_[slot].begin, u1 = homes_[slot].end;
    else
      split_range(r.units, slot, n, r.align, &u0, &u1);
    if (u0 < u1) r.prepare(r.task, slot);
    for (int64_t a = u0; a < u1; a += r.max_claim * r.grain) {
      const int64_t b = std::min(a + r.max_claim * r.grain, u1), ld = (b - a) * r.cols;
      r.compute(r.task, slot, a, b, scratch(slot), ld);
      r.commit(r.task, a, b, scratch(slot), ld);
    }
  });
}

bool ThreadPool::load_region(uint64_t generation, Region* r) const {
  uint64_t words[kRegionWords];
  const std::atomic<uint64_t>* src = region_words_[generation & 1];
  for (int64_t i = 0; i < kHeaderWords; i++) words[i] = src[i].load(std::memory_order_relaxed);
  int64_t task_words, n_groups;  // clamped: a torn copy is dropped below, but must not overrun first
  std::memcpy(&task_words, &words[offsetof(Region, task_words) / 8], 8);
  std::memcpy(&n_groups, &words[offsetof(Region, n_groups) / 8], 8);
  task_words = std::min<int64_t>(std::max<int64_t>(task_words, 0), kTaskBytes / 8);
  const int64_t group_words = n_groups > 1 ? 2 * (std::min<int64_t>(n_groups, kMaxGroups) + 1) : 0;
  for (int64_t i = kHeaderWords; i < kHeaderWords + task_words; i++) words[i] = src[i].load(std::memory_order_relaxed);
  for (int64_t i = kGroupWord; i < kGroupWord + group_words; i++) words[i] = src[i].load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  if ((hot_.state.load(std::memory_order_relaxed) >> kGenShift) != generation) return false;  // torn
  std::memcpy(static_cast<void*>(r), words, (kHeaderWords + task_words) * 8);
  std::memcpy(reinterpret_cast<char*>(r) + kGroupWord * 8, words + kGroupWord, group_words * 8);
  if (!group_words) r->n_groups = 1, r->group[0] = {0, 0}, r->group[1] = {r->units, r->chunks};
  else r->n_groups = std::min<int64_t>(r->n_groups, kMaxGroups);
  return true;
}

int64_t ThreadPool::claim_chunks(uint64_t generation, int thread, const Region& r, int64_t* first) {
  // Own range, from the front: most of what is left (a quarter stays for whoever finishes first), so
  // a thread keeps the same contiguous rows region after region in few kernel calls.
  std::atomic<uint64_t>& own = threads_[thread].range;
  uint64_t w = own.load(std::memory_order_acquire);
  for (;;) {
    if (!range_tag_is(w, generation)) return -1;  // a later region: this thread is late
    const int64_t front = (w >> kRangeBits) & kRangeMask, back = w & kRangeMask, left = back - front;
    if (left <= 0) break;
    const int64_t take = std::min(r.max_claim, std::max<int64_t>(1, left - std::max<int64_t>(1, left / 4)));
    if (own.compare_exchange_weak(w, pack_range(generation, front + take, back), std::memory_order_acq_rel)) {
      *first = front;
      return front + take;
    }
  }
  // Others' ranges, one chunk from the back, leaving the owner its contiguous front: first the
  // threads of this thread's node (its rows are in local memory), then the others.
  const int passes = r.n_groups > 1 ? 2 : 1;
  for (int pass = 0; pass < passes; pass++) {
    for (int i = 1; i < n_threads_; i++) {
      const int u = (thread + i) % n_threads_;
      if (passes > 1 && !steal_pass(thread, u, pass)) continue;
      std::atomic<uint64_t>& other = threads_[u].range;
      w = other.load(std::memory_order_acquire);
      for (;;) {
        if (!range_tag_is(w, generation)) return -1;
        const int64_t front = (w >> kRangeBits) & kRangeMask, back = w & kRangeMask;
        if (front >= back) break;
        if (other.compare_exchange_weak(w, pack_range(generation, front, back - 1), std::memory_order_acq_rel)) {
          *first = back - 1;
          return back;
        }
      }
    }
  }
  return -1;
}

// A claim's chunks are consecutive inside one group (a home range lies in one), so their units are too.
void ThreadPool::chunk_units(const Region& r, int64_t c0, int64_t c1, int64_t* u0, int64_t* u1) {
  int64_t g = 0;
  while (g + 1 < r.n_groups && c0 >= r.group[g + 1].chunk) g++;
  *u0 = r.group[g].unit + (c0 - r.group[g].chunk) * r.grain;
  *u1 = std::min(r.group[g].unit + (c1 - r.group[g].chunk) * r.grain, r.group[g + 1].unit);
}

int ThreadPool::run_claim(uint64_t generation, int buf, const Region& r, int64_t c0, int64_t c1) {
  int64_t u0, u1;
  chunk_units(r, c0, c1, &u0, &u1);
  const int64_t ld = (u1 - u0) * r.cols;
  float* s = scratch(buf);
  r.compute(r.task, buf, u0, u1, s, ld);
  int committed = 0;
  for (int64_t c = c0; c < c1; c++) {
    // Committed in this region already (by a thread that redid it), or this thread is from an earlier
    // region, every chunk of which was committed before it ended: the CAS fails, the result is dropped.
    std::atomic<uint64_t>& state = chunk_state_[c];
    uint64_t old = state.load(std::memory_order_acquire);
    if (old >= generation || !state.compare_exchange_strong(old, generation, std::memory_order_acq_rel)) continue;
    int64_t a, b;
    chunk_units(r, c, c + 1, &a, &b);
    r.commit(r.task, a, b, s + (a - u0) * r.cols, ld);
    committed++;
  }
  return committed;
}

int ThreadPool::work_chunks(uint64_t generation, int thread, const Region& r, bool* prepared) {
  int committed = 0;
  int64_t start = -1;
  double work = 0;
  for (int64_t c0, c1; (c1 = claim_chunks(generation, thread, r, &c0)) >= 0;) {
    if (start < 0) start = now_ns();
    if (!*prepared) r.prepare(r.task, thread), *prepared = true;
    const int n = run_claim(generation, thread, r, c0, c1);
    int64_t u0, u1;
    chunk_units(r, c0, c1, &u0, &u1);
    work += (double)(u1 - u0) * r.unit_work;
    committed += n;
    // At once: the caller may be waiting on this very count.
    if (thread != 0 && n) hot_.worker_done.fetch_add(n, std::memory_order_release);
  }
  if (start >= 0) {  // totals written only by this thread; the caller folds them into speeds
    ThreadState& ts = threads_[thread];
    ts.work_done.store(ts.work_done.load(std::memory_order_relaxed) + work, std::memory_order_relaxed);
    ts.busy_ns.store(ts.busy_ns.load(std::memory_order_relaxed) + now_ns() - start, std::memory_order_relaxed);
  }
  return committed;
}

void ThreadPool::wait_or_redo(uint64_t generation, const Region& r, int caller_commits, bool* prepared) {
  const uint64_t base = worker_done_target_;
  int own = caller_commits;
  const double speed = speed_[0];
  const int64_t stall_ns = kStallNs + (speed > 0 ? (int64_t)(kStallChunks * r.grain * r.unit_work / speed) : 0);
  uint64_t last_done = hot_.worker_done.load(std::memory_order_acquire);
  int64_t last_progress = -1;
  for (uint32_t i = 0;; i++) {
    const uint64_t done = hot_.worker_done.load(std::memory_order_acquire);
    if (done == base + (uint64_t)(r.chunks - own)) break;
    cpu_relax();
    if ((i & 63) != 63) continue;
    const int64_t t = now_ns();
    if (last_progress < 0 || done != last_done) {
      last_done = done, last_progress = t;
      continue;
    }
    if (t - last_progress < stall_ns) continue;
    // Nothing finished for a long while: a thread holding chunks is descheduled. Every chunk is
    // claimed by now; redo the first one not committed yet into the caller's own scratch, then look
    // again (a thread that was only slow commits the rest itself).
    for (int64_t c = 0; c < r.chunks; c++) {
      if (chunk_state_[c].load(std::memory_order_acquire) >= generation) continue;
      if (!*prepared) r.prepare(r.task, 0), *prepared = true;
      const int n = run_claim(generation, 0, r, c, c + 1);
      own += n, redone_ += n;
      break;
    }
  }
  worker_done_target_ = base + (uint64_t)(r.chunks - own);
}

void ThreadPool::update_speeds() {
  for (int t = 0; t < n_threads_; t++) {
    const double work = threads_[t].work_done.load(std::memory_order_relaxed);
    const int64_t busy = threads_[t].busy_ns.load(std::memory_order_relaxed);
    pending_work_[t] += work - seen_work_[t], pending_busy_[t] += busy - seen_busy_[t];
    seen_work_[t] = work, seen_busy_[t] = busy;
    if (pending_busy_[t] < kMeasureNs) continue;
    const double measured = pending_work_[t] / (double)pending_busy_[t];
    speed_[t] = speed_[t] > 0 ? speed_[t] + kSmoothing * (measured - speed_[t]) : measured;
    pending_work_[t] = 0, pending_busy_[t] = 0;
  }
}

void ThreadPool::worker_loop(int thread) {
  tls_pool = this, tls_thread = thread;
  uint64_t seen = 0;
  for (;;) {
    auto spin_start = std::chrono::steady_clock::now();
    uint64_t s, gen;
    for (uint32_t i = 0;; i++) {
      s = hot_.state.load(std::memory_order_acquire);
      gen = s >> kGenShift;
      if (gen != seen) break;
      cpu_relax();
      if ((i & 255) == 255 &&
          (park_.load(std::memory_order_relaxed) || std::chrono::steady_clock::now() - spin_start > kSpinTime)) {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lock, [&] { return (hot_.state.load(std::memory_order_seq_cst) >> kGenShift) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        spin_start = std::chrono::steady_clock::now();
      }
    }
    seen = gen;
    if (stop_.load()) return;
    if (!(s & kChunked)) {
      claim_slots(gen, /*worker=*/true);
      continue;
    }
    // Marked before the first claim, so quiesce() cannot miss a thread that holds a chunk.
    threads_[thread].in_region.store(1, std::memory_order_seq_cst);
    Region r;
    bool prepared = false;
    if (load_region(gen, &r)) work_chunks(gen, thread, r, &prepared);
    threads_[thread].in_region.store(0, std::memory_order_release);
  }
}

}  // namespace corelm
