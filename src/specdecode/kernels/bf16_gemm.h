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

#include "row_tiles.h"

namespace bf16_kernels {
namespace {

constexpr int64_t kGroupN = 64;  // output channels per group (4 vectors of 16 fp32 sums)
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
  const int64_t groups = (N + kGroupN - 1) / kGroupN;
  const int64_t group_elems = K * kGroupN;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const at::BFloat16* wgroup = wblocked + g * group_elems;
      const int64_t n0 = g * kGroupN;
      // tiles of up to 6 rows: 6 x 4 accumulators + 4 weights + a broadcast fit 32 registers
      row_tiles::for_row_tiles(M, [&](auto rows, int64_t m) {
        group_rows<decltype(rows)::value>(x + m * K, K, wgroup, K, n0, N, bias, y + m * N, N);
      });
    }
  });
}

void check_blocked(const torch::Tensor& w, int64_t N, int64_t K) {
  TORCH_CHECK(K % 2 == 0, "input size must be even, got ", K);
  const int64_t groups = (N + kGroupN - 1) / kGroupN;
  TORCH_CHECK(w.is_contiguous() && w.numel() == groups * kGroupN * K, "weights are not in the blocked layout");
}

}  // namespace
}  // namespace bf16_kernels
