// The few-row bf16 matmul kernel (gemv_cpu.cpp explains the layout and why): `gemm_rows` on raw
// pointers. gemv_cpu.cpp registers it as an op; decode_stack_cpu.cpp's lean path calls it directly,
// so both compute the same numbers (include this file only from sources built with the same flags).
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "pair_groups.h"

namespace bf16_kernels {
namespace {

using pair_groups::kGroupN;
constexpr int kVectors = kGroupN / 16;

// Outputs [n0, n0 + 64) for R rows (x rows ldx apart, y rows ldy apart); wgroup [K / 2, 64, 2].
template <int R>
inline void group_rows(const at::BFloat16* x, int64_t ldx, const at::BFloat16* wgroup, int64_t K, int64_t n0,
                       int64_t N, const at::BFloat16* bias, at::BFloat16* y, int64_t ldy) {
  __m512 acc[R][kVectors];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const at::BFloat16* w = wgroup + p * 2 * kGroupN;
    __m512bh wv[kVectors];
#pragma GCC unroll 4
    for (int j = 0; j < kVectors; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * 32);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  const int64_t valid = std::min<int64_t>(kGroupN, N - n0);
  for (int r = 0; r < R; ++r) {
    alignas(64) float sums[kGroupN];
#pragma GCC unroll 4
    for (int j = 0; j < kVectors; ++j) _mm512_store_ps(sums + 16 * j, acc[r][j]);
    at::BFloat16* out = y + r * ldy + n0;
    for (int64_t n = 0; n < valid; ++n) {
      float v = sums[n];
      if (bias != nullptr) v += static_cast<float>(bias[n0 + n]);
      out[n] = static_cast<at::BFloat16>(v);
    }
  }
}

void gemm_rows(const at::BFloat16* x, int64_t M, const at::BFloat16* wblocked, int64_t N, int64_t K,
               const at::BFloat16* bias, at::BFloat16* y) {
  // Without prefetching the next group (`LinesAhead`): unmeasured on a CPU with AVX-512 BF16.
  pair_groups::for_group_tiles(M, N, K, wblocked, [&](auto rows, int64_t g, int64_t m, pair_groups::LinesAhead) {
    group_rows<decltype(rows)::value>(x + m * K, K, wblocked + g * K * kGroupN, K, g * kGroupN, N, bias, y + m * N, N);
  });
}

void check_blocked(const torch::Tensor& w, int64_t N, int64_t K) { pair_groups::check_blocked(w, N, K, "bf16 matmul"); }

}  // namespace
}  // namespace bf16_kernels
