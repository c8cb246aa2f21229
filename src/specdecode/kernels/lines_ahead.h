// Software prefetch of the weights a kernel's thread reads next, spread over the work it does now. The
// few-row kernels stream each weight from memory once and reuse it from cache for the call's later row
// tiles; without this, memory idled while those computed, and the first tile of the next weights waited
// on it (bf16 weights, float32 activations, the default model's 25 matmuls: 0.76-0.97x the time at 1-20
// rows; BENCHMARKS.md "forty-third pass").
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace lines_ahead {

constexpr int64_t kLineBytes = 64;

// What one pass over the current weights prefetches: `per_step` lines at every `every`-th step (a power of
// two), from `first` up to `end`.
struct LinesAhead {
  const char* first = nullptr;  // the line prefetched at step 0; null: this pass prefetches nothing
  const char* end = nullptr;    // past the last line this pass prefetches
  int64_t per_step = 0;
  int64_t every = 1;

  void at(int64_t step) const {
    if (step & (every - 1)) return;
    const char* line = first + step / every * per_step * kLineBytes;
    for (int64_t i = 0; i < per_step && line < end; ++i, line += kLineBytes) _mm_prefetch(line, _MM_HINT_T1);
  }
};

// A one-pass call's prefetch distance, ahead of where it reads in its stream of weights. Measured with the
// bf16-weight kernel against none, in one process: the next whole group (64-720 KB ahead) took 1.02-1.12x
// the time at one row (1.12x the 1B model's, its weights streaming from memory), 16 KB ahead 0.98-0.99x;
// at 4 rows 16 KB ahead 0.81-0.83x, the next group 0.84-1.01x.
constexpr int64_t kStreamAhead = 16 * 1024;

// One pass reading `per_step` lines a step from `reading`: the same lines kStreamAhead further on, up to
// `end` (the thread's last weights).
inline LinesAhead stream(const void* reading, const void* end, int64_t per_step) {
  return {static_cast<const char*>(reading) + kStreamAhead, static_cast<const char*>(end), per_step};
}

// Pass `pass` of `passes` (the call's tiles over the current weights), each of `steps` steps: the next
// weights [next, next + bytes) split evenly between them, into L2. next null: nothing to prefetch.
inline LinesAhead share(const void* next, int64_t bytes, int64_t passes, int64_t steps, int64_t pass) {
  if (next == nullptr || passes <= 0 || steps <= 0) return {};
  const int64_t lines = (bytes + kLineBytes - 1) / kLineBytes;
  const int64_t pass_lines = (lines + passes - 1) / passes;
  int64_t per_step = (pass_lines + steps - 1) / steps, every = 1;
  if (pass_lines < steps)  // fewer lines than steps: one line every `every` steps
    while (2 * every * pass_lines <= steps) every *= 2;
  const char* first = static_cast<const char*>(next) + pass * pass_lines * kLineBytes;
  return {first, std::min(first + pass_lines * kLineBytes, static_cast<const char*>(next) + bytes), per_step, every};
}

}  // namespace lines_ahead
