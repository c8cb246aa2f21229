// The bf16-weight, float32-activation matmul (gemv_bf16w_cpu.cpp explains why): `gemm_rows` on raw
// pointers. gemv_bf16w_cpu.cpp registers it as an op; decode_stack_cpu.cpp's lean path calls it
// directly, so both compute the same numbers (include this file only from sources built with the same
// flags).
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "pair_groups.h"

namespace bf16w_kernels {
namespace {

using pair_groups::kGroupN;
constexpr int kVectors = kGroupN / 16;

// Outputs [n0, n0 + 64) for R rows (x rows ldx apart, y rows ldy apart); wgroup [K / 2, 64, 2] bf16 as 32-bit
// pairs: output n's weights for inputs 2p (low half) and 2p + 1 (high half). Each output's sum is one chain
// of FMAs over the inputs in order, x[0] w[0] first: exact products of bf16 weights (widened by a shift,
// no rounding) and float32 activations, so a row's result depends on nothing but its own inputs.
template <int R>
inline void group_rows(const float* x, int64_t ldx, const uint32_t* wgroup, int64_t K, int64_t n0, int64_t N,
                       const float* bias, float* y, int64_t ldy) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[R][kVectors];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t* w = wgroup + p * kGroupN;
    __m512 even[kVectors], odd[kVectors];
#pragma GCC unroll 4
    for (int j = 0; j < kVectors; ++j) {
      const __m512i v = _mm512_loadu_si512(w + 16 * j);
      even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      odd[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_set1_ps(x[r * ldx + 2 * p]), x1 = _mm512_set1_ps(x[r * ldx + 2 * p + 1]);
#pragma GCC unroll 4
      for (int j = 0; j < kVectors; ++j)
        acc[r][j] = _mm512_fmadd_ps(x1, odd[j], _mm512_fmadd_ps(x0, even[j], acc[r][j]));
    }
  }
  const int64_t valid = std::min<int64_t>(kGroupN, N - n0);
  for (int r = 0; r < R; ++r) {
    alignas(64) float sums[kGroupN];
#pragma GCC unroll 4
    for (int j = 0; j < kVectors; ++j) _mm512_store_ps(sums + 16 * j, acc[r][j]);
    float* out = y + r * ldy + n0;
    if (bias != nullptr)
      for (int64_t n = 0; n < valid; ++n) out[n] = sums[n] + bias[n0 + n];
    else
      std::memcpy(out, sums, valid * sizeof(float));
  }
}

// y [M, N] = x [M, K] @ W^T (+ bias [N]), W in the blocked layout [ceil(N / 64), K / 2, 64, 2] bf16.
void gemm_rows(const float* x, int64_t M, const at::BFloat16* wblocked, int64_t N, int64_t K, const float* bias,
               float* y) {
  pair_groups::for_group_tiles(M, N, [&](auto rows, int64_t g, int64_t m) {
    const uint32_t* wgroup = reinterpret_cast<const uint32_t*>(wblocked + g * K * kGroupN);
    group_rows<decltype(rows)::value>(x + m * K, K, wgroup, K, g * kGroupN, N, bias, y + m * N, N);
  });
}

void check_blocked(const torch::Tensor& w, int64_t N, int64_t K) {
  pair_groups::check_blocked(w, N, K, "bf16-weight matmul");
}

}  // namespace
}  // namespace bf16w_kernels
