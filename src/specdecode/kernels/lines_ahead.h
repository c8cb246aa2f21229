// Software prefetch of the weights a kernel's thread reads next, spread over the work it does now. The
// few-row kernels stream each weight from memory once and reuse it from cache for the call's later row
// tiles; without this, memory idled while those computed, and the first tile of the next weights waited
// on it (bf16 weights, float32 activations, the default model's 25 matmuls: 0.76-0.97x the time at 1-20
// rows; BENCHMARKS.md "forty-third pass").
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace lines_ahead {

constexpr int64_t kLineBytes = 64;

// What one pass over the current weights prefetches: `per_step` lines at each of its steps, from `first`.
struct LinesAhead {
  const char* first = nullptr;  // the line prefetched at step 0; null: this pass prefetches nothing
  const char* end = nullptr;    // past the next weights' last byte
  int64_t per_step = 0;

  void at(int64_t step) const {
    const char* line = first + step * per_step * kLineBytes;
    for (int64_t i = 0; i < per_step && line < end; ++i, line += kLineBytes) _mm_prefetch(line, _MM_HINT_T1);
  }
};

// Pass `pass` of `passes` (the call's row tiles over the current weights), each of `steps` steps: the
// next weights [next, next + bytes) split evenly between them, into L2. next null: nothing to prefetch.
inline LinesAhead share(const void* next, int64_t bytes, int64_t passes, int64_t steps, int64_t pass) {
  if (next == nullptr || passes <= 0 || steps <= 0) return {};
  const int64_t lines = (bytes + kLineBytes - 1) / kLineBytes;
  const int64_t per_step = (lines + passes * steps - 1) / (passes * steps);
  const char* region = static_cast<const char*>(next);
  return {region + pass * steps * per_step * kLineBytes, region + bytes, per_step};
}

}  // namespace lines_ahead
