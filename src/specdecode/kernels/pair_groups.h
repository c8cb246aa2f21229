// The layout and traversal the broadcast-form kernels share (bf16_gemm.h: bf16 activations, vdpbf16ps;
// bf16w_gemm.h: float32 activations): bf16 weights [ceil(N / 64), K / 2, 64, 2], a group of 64 outputs'
// next input pair contiguous (one 256-byte line per pair, each group one stream), the missing outputs
// zero. A call of M rows runs, per group, tiles of up to 6 rows (6 x 4 fp32 accumulators and the group's
// weight vectors fit 32 zmm registers), each with its row count a compile-time constant.
//
// Past 6 rows a group's tiles prefetch the thread's next group into L2 while they compute (`LinesAhead`),
// so the memory stream runs under the arithmetic instead of between it: without it a group's first tile
// waited on memory and the tiles after it computed from L2 with the stream idle. One tile prefetches a
// fixed distance ahead in its stream.
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "lines_ahead.h"
#include "thread_team.h"

namespace pair_groups {

constexpr int64_t kGroupN = 64;  // output channels per group (4 vectors of 16 fp32 sums)
constexpr int kMaxRows = 6;
constexpr int64_t kLinesPerPair = kGroupN * 2 * 2 / lines_ahead::kLineBytes;  // a pair's 256 bytes
using lines_ahead::LinesAhead;

// tile(std::integral_constant<int, R>{}, group g, first row m, LinesAhead) for every group and row tile of
// an M x N call whose blocked weights (K inputs) start at `weights`. Each thread takes whole groups and
// runs every row tile on them: a group's weights come from memory once (prefetched by the group before
// it on the thread, but for its first) and from L2 for the tiles after the first.
template <typename Tile>
inline void for_group_tiles(int64_t M, int64_t N, int64_t K, const void* weights, Tile&& tile) {
  const int64_t groups = (N + kGroupN - 1) / kGroupN;
  const int64_t group_bytes = K * kGroupN * 2;  // K / 2 pairs of 64 x 2 bf16
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  const char* base = static_cast<const char*>(weights);
  thread_team::parallel_for(groups, [&](thread_team::Claims& claims) {
    for (int64_t g = claims.next(); g >= 0; g = claims.next()) {
      const int64_t after = claims.ahead();
      const char* range_end = base + std::max(g + 1, claims.end()) * group_bytes;
      const char* next = after >= 0 ? base + after * group_bytes : nullptr;
      // One tile streams ahead of its reads; more split the next group (each its share over its K / 2
      // pair steps).
      auto ahead = [&](int64_t m) {
        if (tiles == 1) return lines_ahead::stream(base + g * group_bytes, range_end, kLinesPerPair);
        return lines_ahead::share(next, group_bytes, tiles, K / 2, m / kMaxRows);
      };
      int64_t m = 0;
      for (; m + kMaxRows <= M; m += kMaxRows) tile(std::integral_constant<int, kMaxRows>{}, g, m, ahead(m));
      switch (M - m) {
        case 5: tile(std::integral_constant<int, 5>{}, g, m, ahead(m)); break;
        case 4: tile(std::integral_constant<int, 4>{}, g, m, ahead(m)); break;
        case 3: tile(std::integral_constant<int, 3>{}, g, m, ahead(m)); break;
        case 2: tile(std::integral_constant<int, 2>{}, g, m, ahead(m)); break;
        case 1: tile(std::integral_constant<int, 1>{}, g, m, ahead(m)); break;
        default: break;
      }
    }
  });
}

// `name`'s weights w must be bf16 in the layout for N outputs and K inputs.
inline void check_blocked(const torch::Tensor& w, int64_t N, int64_t K, const char* name) {
  TORCH_CHECK(K % 2 == 0, name, ": the input size must be even, got ", K);
  const int64_t groups = (N + kGroupN - 1) / kGroupN;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.numel() == groups * kGroupN * K, name,
              ": bf16 weights in the blocked layout [", groups, ", ", K / 2, ", 64, 2] expected");
}

}  // namespace pair_groups
