// Work items split between threads at run time rather than in fixed halves. The two cores of the CPUs this
// project measures on do not run at one speed: alone, each core's FMA rate moved between 4.2 and 5.3 G a
// second from run to run (busy sibling hyperthreads of other tenants), and in a w4a8 verification forward
// of 5 tokens the second thread waited at the matmuls' barriers half its time while the calling thread
// computed (perf samples). With two threads the calling thread takes items upwards from the first and
// the other downwards from the last until they meet: a slower core takes fewer, and each thread's next
// item is still known ahead (its prefetch target). Which thread computes an item changes nothing in
// what it computes.
#pragma once
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>

namespace balanced {

// fn(item, next): every item in [0, n) once; `next` is the item this thread takes next unless the other
// claims it first (where its weights are worth prefetching), -1 where this thread has none left.
template <typename F>
void for_each(int64_t n, const F& fn) {
  if (n <= 0) return;
  if (n == 1 || at::get_num_threads() != 2 || at::in_parallel_region()) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) fn(i, i + 1 < end ? i + 1 : -1);
    });
    return;
  }
  std::atomic<int64_t> claimed{0};  // items taken by either thread: the two ends never cross
  at::parallel_for(0, 2, 1, [&](int64_t end_index, int64_t) {
    const bool up = end_index == 0;
    for (int64_t i = up ? 0 : n - 1, step = up ? 1 : -1;; i += step) {
      if (claimed.fetch_add(1, std::memory_order_relaxed) >= n) return;
      const int64_t next = i + step;
      fn(i, next >= 0 && next < n ? next : -1);
    }
  });
}

}  // namespace balanced
