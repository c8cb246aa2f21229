// The layout and traversal the broadcast-form kernels share (bf16_gemm.h: bf16 activations, vdpbf16ps;
// bf16w_gemm.h: float32 activations): bf16 weights [ceil(N / 64), K / 2, 64, 2], a group of 64 outputs'
// next input pair contiguous (one 256-byte line per pair, each group one stream), the missing outputs
// zero. A call of M rows runs, per group, tiles of up to 6 rows (6 x 4 fp32 accumulators and the group's
// weight vectors fit 32 zmm registers), each with its row count a compile-time constant.
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <type_traits>

namespace pair_groups {

constexpr int64_t kGroupN = 64;  // output channels per group (4 vectors of 16 fp32 sums)
constexpr int kMaxRows = 6;

// tile(std::integral_constant<int, R>{}, group g, first row m) for every group and row tile of an M x N
// call. Each thread takes whole groups and runs every row tile on them: a group's weights are read from
// memory once and from L2 for the tiles after the first.
template <typename Tile>
inline void for_group_tiles(int64_t M, int64_t N, Tile&& tile) {
  const int64_t groups = (N + kGroupN - 1) / kGroupN;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      int64_t m = 0;
      for (; m + kMaxRows <= M; m += kMaxRows) tile(std::integral_constant<int, kMaxRows>{}, g, m);
      switch (M - m) {
        case 5: tile(std::integral_constant<int, 5>{}, g, m); break;
        case 4: tile(std::integral_constant<int, 4>{}, g, m); break;
        case 3: tile(std::integral_constant<int, 3>{}, g, m); break;
        case 2: tile(std::integral_constant<int, 2>{}, g, m); break;
        case 1: tile(std::integral_constant<int, 1>{}, g, m); break;
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
