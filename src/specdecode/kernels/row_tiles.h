// The row tiles of the broadcast-form kernels (bf16_gemm.h, bf16w_gemm.h): M rows as tiles of 6 rows,
// then one tile of the rest, each `tile(std::integral_constant<int, R>{}, first_row)`, so a tile's row
// count is a compile-time constant (its accumulators stay in registers).
#pragma once
#include <cstdint>
#include <type_traits>

namespace row_tiles {

constexpr int kMaxRows = 6;  // 6 x 4 accumulators and a group's weight vectors fit 32 zmm registers

template <typename Tile>
inline void for_row_tiles(int64_t M, Tile&& tile) {
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows) tile(std::integral_constant<int, kMaxRows>{}, m);
  switch (M - m) {
    case 5: tile(std::integral_constant<int, 5>{}, m); break;
    case 4: tile(std::integral_constant<int, 4>{}, m); break;
    case 3: tile(std::integral_constant<int, 3>{}, m); break;
    case 2: tile(std::integral_constant<int, 2>{}, m); break;
    case 1: tile(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

}  // namespace row_tiles
