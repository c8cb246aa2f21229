// One parallel region for a whole lean forward instead of one per kernel call, with work claimed, not
// split once (decode_stack_cpu.cpp's lean path; a8_gemm.h, cached_attention.h and pair_groups.h take
// their items through `parallel_for`).
//
// Why: a one-token forward of the default model is ~31 parallel regions (four matmuls and attention a
// layer, the head), each a few microseconds of work. An empty OpenMP region measured 1.2-1.4 us of
// fork and join on a 2-core VM (handing the loop to a spinning thread: 0.4-0.8 us), and a static split
// leaves a thread that started late, or runs slower, holding its half while the other waits. Inside a
// `region` the calling thread runs the forward as before and hands each parallel loop to the region's
// threads, which spin between loops; each thread claims its own share's items in order and then takes
// the others' from the back. An item is computed by one thread, whichever it is, so results do not
// depend on the split. A W4A8 forward of the default model took 0.95-0.98x the time at one token and
// 0.96-0.99x at five (A / A control 0.998-1.004x; BENCHMARKS.md, forty-eighth pass).
//
// Outside a region (a kernel's own op, a thread that is not the region's caller) `parallel_for` is
// at::parallel_for over fixed ranges, as before.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <thread>
#include <utility>

namespace thread_team {
namespace {

// A thread's share of a loop's items, [front, back) packed in one word: its owner claims from the front
// and another thread from the back, each by one compare-and-swap (each share on its own cache line).
struct alignas(64) Share {
  std::atomic<uint64_t> range{0};
};

inline uint64_t pack(int64_t front, int64_t back) {
  return static_cast<uint64_t>(static_cast<uint32_t>(front)) | static_cast<uint64_t>(back) << 32;
}

// The items one thread runs: `next()` until it returns -1. A thread takes its own share's items a run
// at a time (an eighth of the share: a claim is a compare-and-swap, and a one-token forward has ~1,850
// items) and then the others' one by one from their backs.
class Claims {
 public:
  // A fixed range nobody else claims from (outside a region: at::parallel_for's chunk).
  Claims(int64_t begin, int64_t end) : front_(begin), back_(end) {}
  Claims(Share* shares, int threads, int self, int64_t run)
      : shares_(shares), threads_(threads), self_(self), run_(run) {}

  // The next item: this thread's own share in order, then another share's last item; -1 when none is left.
  int64_t next() {
    if (front_ < back_) return front_++;
    if (shares_ == nullptr) return -1;
    for (int j = 0; j < threads_; ++j) {
      const bool own = j == 0;
      const auto [first, last] = take(shares_[(self_ + j) % threads_], own ? run_ : 1, own);
      if (first < last) {
        front_ = first + 1, back_ = last;
        return first;
      }
    }
    return -1;
  }

  // The item this thread claims next from its own share, or -1 (what it prefetches: another thread may
  // still take it), and the end of its share (the last weights it streams, unless it takes others').
  int64_t ahead() const {
    if (front_ < back_ || shares_ == nullptr) return front_ < back_ ? front_ : -1;
    const auto [front, back] = unpack(shares_[self_].range.load(std::memory_order_relaxed));
    return front < back ? front : -1;
  }
  int64_t end() const {
    if (shares_ == nullptr) return back_;
    return std::max(back_, unpack(shares_[self_].range.load(std::memory_order_relaxed)).second);
  }

 private:
  static std::pair<int64_t, int64_t> unpack(uint64_t range) {
    return {static_cast<uint32_t>(range), static_cast<int64_t>(range >> 32)};
  }

  // Up to `count` items off the front (or one off the back) of a share -> [first, last), empty when none.
  static std::pair<int64_t, int64_t> take(Share& share, int64_t count, bool front) {
    uint64_t range = share.range.load(std::memory_order_relaxed);
    for (;;) {
      const auto [first, back] = unpack(range);
      if (first >= back) return {0, 0};
      const int64_t last = std::min(back, first + count);
      const uint64_t rest = front ? pack(last, back) : pack(first, back - 1);
      if (share.range.compare_exchange_weak(range, rest, std::memory_order_relaxed))
        return front ? std::pair<int64_t, int64_t>{first, last} : std::pair<int64_t, int64_t>{back - 1, back};
    }
  }

  Share* shares_ = nullptr;
  int threads_ = 1, self_ = 0;
  int64_t run_ = 1;
  int64_t front_ = 0, back_ = 0;  // the items claimed and not yet run
};

// Spin until done() holds, giving the core away now and then: with more threads than cores, the thread
// waited for may be waiting for this one's core.
template <typename Done>
inline void wait_until(const Done& done) {
  for (int spins = 1; !done(); ++spins) {
    _mm_pause();
    if (spins % 1024 == 0) std::this_thread::yield();
  }
}

// The threads of one region: the caller (thread 0) posts each loop, runs its part and waits for every
// other thread to finish the loop before going on (so no thread is ever inside an older loop).
class Team {
 public:
  explicit Team(int capacity) : shares_(new Share[capacity]) {}

  // The region's threads (OpenMP may run fewer than asked), set by the caller before its first loop.
  void start(int threads) { threads_ = threads; }

  // body(Claims&) on every thread of the team over items [0, n), split as at::parallel_for splits them.
  template <typename Body>
  void run(int64_t n, const Body& body) {
    chunk_ = (n + threads_ - 1) / threads_;
    for (int t = 0; t < threads_; ++t)
      shares_[t].range.store(pack(std::min(n, t * chunk_), std::min(n, (t + 1) * chunk_)), std::memory_order_relaxed);
    body_ = &body;
    call_ = [](const void* b, Claims& claims) { (*static_cast<const Body*>(b))(claims); };
    generation_.fetch_add(1, std::memory_order_release);  // the other threads start
    serve(0);
    const int64_t finished = ++loops_ * (threads_ - 1);
    wait_until([&] { return done_.load(std::memory_order_acquire) >= finished; });
    if (failure_) {
      std::exception_ptr failure = failure_;
      failure_ = nullptr, failed_.clear();
      std::rethrow_exception(failure);
    }
  }

  // Thread `self`'s part of every loop until the caller closes the region.
  void work(int self) {
    int64_t seen = 0;
    for (;;) {
      int64_t generation;
      wait_until([&] { return (generation = generation_.load(std::memory_order_acquire)) != seen; });
      seen = generation;
      if (closing_) return;
      serve(self);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  // Ends the region; returns the loops it ran.
  int64_t close() {
    closing_ = true;
    generation_.fetch_add(1, std::memory_order_release);
    return loops_;
  }

 private:
  void serve(int self) {
    Claims claims(shares_.get(), threads_, self, (chunk_ + 7) / 8);
    try {
      call_(body_, claims);
    } catch (...) {  // the first failure is rethrown by the caller; the others' items are still run
      if (!failed_.test_and_set()) failure_ = std::current_exception();
    }
  }

  std::unique_ptr<Share[]> shares_;
  int threads_ = 1;
  alignas(64) std::atomic<int64_t> generation_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  int64_t loops_ = 0, chunk_ = 1;  // loops posted; the current loop's share size
  const void* body_ = nullptr;
  void (*call_)(const void*, Claims&) = nullptr;
  bool closing_ = false;
  std::atomic_flag failed_ = ATOMIC_FLAG_INIT;
  std::exception_ptr failure_;
};

// The CPUs this process may run on (its affinity mask), counted once.
inline int usable_cpus() {
  static const int count = [] {
    cpu_set_t set;
    return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  }();
  return count;
}

thread_local Team* t_team = nullptr;  // the region this thread is the caller of
std::atomic<bool> g_enabled{true};    // `set_enabled` (A/B measurements)
std::atomic<int64_t> g_loops{0};      // loops run on a region's threads, all regions together

inline void set_enabled(bool enabled) { g_enabled.store(enabled); }
inline int64_t loops() { return g_loops.load(); }

// Run `caller` with a region of at::get_num_threads() threads behind it: its `parallel_for` loops run on
// them. Nested, inside another parallel region, with one thread, more threads than usable CPUs (spinning
// threads would then wait on each other's time slices: 1.08-1.28x OpenMP's time at 3 threads on 2 CPUs)
// or when disabled, `caller` runs as is.
template <typename F>
void region(const F& caller) {
  const int threads = at::get_num_threads();
  if (t_team != nullptr || threads < 2 || threads > usable_cpus() || at::in_parallel_region() ||
      !g_enabled.load(std::memory_order_relaxed))
    return caller();
  Team team(threads);
  std::exception_ptr failure;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    if (begin != 0) return team.work(at::get_thread_num());
    team.start(static_cast<int>((threads + end - 1) / end));  // each thread got `end` indices
    t_team = &team;
    try {
      caller();
    } catch (...) {
      failure = std::current_exception();
    }
    t_team = nullptr;
    g_loops.fetch_add(team.close());
  });
  if (failure) std::rethrow_exception(failure);
}

// body(Claims&) over items [0, n): on the threads of the region this thread runs, else at::parallel_for's
// fixed chunks.
template <typename Body>
void parallel_for(int64_t n, const Body& body) {
  if (n <= 0) return;
  if (t_team != nullptr && n > 1) return t_team->run(n, body);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    Claims claims(begin, end);
    body(claims);
  });
}

}  // namespace
}  // namespace thread_team
