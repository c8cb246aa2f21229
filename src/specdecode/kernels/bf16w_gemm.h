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

#include "row_tiles.h"

namespace bf16w_kernels {
namespace {

constexpr int64_t kGroupN = 64;  // output channels per group (4 vectors of 16 fp32 sums), the bf16 kernel's layout
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
  const int64_t groups = (N + kGroupN - 1) / kGroupN;
  const int64_t group_elems = K * kGroupN;
  // Each thread takes whole groups and runs every row tile on them: a group's weights are read from
  // memory once and from L2 for the tiles after the first.
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint32_t* wgroup = reinterpret_cast<const uint32_t*>(wblocked + g * group_elems);
      const int64_t n0 = g * kGroupN;
      // tiles of up to 6 rows: 6 x 4 accumulators + a group's 8 widened weight vectors fit 32 registers
      row_tiles::for_row_tiles(M, [&](auto rows, int64_t m) {
        group_rows<decltype(rows)::value>(x + m * K, K, wgroup, K, n0, N, bias, y + m * N, N);
      });
    }
  });
}

void check_blocked(const torch::Tensor& w, int64_t N, int64_t K) {
  TORCH_CHECK(K % 2 == 0, "bf16-weight matmul: the input size must be even, got ", K);
  const int64_t groups = (N + kGroupN - 1) / kGroupN;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.numel() == groups * kGroupN * K,
              "bf16-weight matmul: bf16 weights in the blocked layout [", groups, ", ", K / 2, ", 64, 2] expected");
}

}  // namespace
}  // namespace bf16w_kernels
