// The bf16-weight, float32-activation matmul (gemv_bf16w_cpu.cpp explains why): `gemm_rows` on raw
// pointers. gemv_bf16w_cpu.cpp registers it as an op; decode_stack_cpu.cpp's lean path calls it
// directly, so both compute the same numbers (include this file only from sources built with the same
// flags).
//
// Two vector forms of one computation: AVX-512F (16 lanes: up to 6 rows' accumulators for the group's 64
// outputs at once) and AVX2 + FMA (8 lanes, 16 registers: one row's 64 outputs at a time, the group's
// weights read again from L2 for the next row). Each output's sum is the same FMA chain in both, so they
// agree bit for bit.
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

#if defined(__AVX512F__)
struct Avx512 {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kBlockRows = 6;  // pair_groups' whole tile
  static constexpr bool kWidenFirst = true;  // 24 accumulators + 8 weight vectors; FMAs broadcast from memory
  static V zero() { return _mm512_setzero_ps(); }
  static V broadcast(float v) { return _mm512_set1_ps(v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  // 16 outputs' weights for one input pair (32-bit words: even input low, odd input high), widened exactly.
  static void widen(const uint32_t* w, V& even, V& odd) {
    const __m512i v = _mm512_loadu_si512(w);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
struct Avx2 {
  using V = __m256;
  static constexpr int kLanes = 8;
  // One row: 8 accumulators, 2 broadcast inputs and a pair's two widened vectors in 16 registers. (Blocks of
  // 2 rows x 32 outputs, each reading half of every pair's 256-byte line, measured slower: the 25 matmuls
  // at 2 rows took 1.38x the AVX-512 form's time in the same run, against 1.13-1.14x one row at a time.)
  static constexpr int kBlockRows = 1;
  static constexpr bool kWidenFirst = false;  // no broadcast memory operands: the inputs stay in registers
  static V zero() { return _mm256_setzero_ps(); }
  static V broadcast(float v) { return _mm256_set1_ps(v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void widen(const uint32_t* w, V& even, V& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};
#endif

// sums [R, 64] = R rows of x (ldx apart) times the group's 64 outputs; wgroup [K / 2, 64, 2] bf16 as 32-bit
// pairs: output n's weights for inputs 2p (low half) and 2p + 1 (high half). Each output's sum is one chain
// of FMAs over the inputs in order, x[0] w[0] first: exact products of bf16 weights (widened by a shift, no
// rounding) and float32 activations, so a row's result depends on nothing but its own inputs.
template <class Isa, int R>
inline void block_sums(const float* x, int64_t ldx, const uint32_t* wgroup, int64_t pairs, float* sums,
                       const pair_groups::LinesAhead& ahead) {
  using V = typename Isa::V;
  constexpr int C = kGroupN / Isa::kLanes;
  V acc[R][C];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) acc[r][j] = Isa::zero();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t* w = wgroup + p * kGroupN;
    if (ahead.first != nullptr) ahead.at(p);
    if constexpr (Isa::kWidenFirst) {  // every weight vector held, the inputs broadcast from memory
      V even[C], odd[C];
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) Isa::widen(w + j * Isa::kLanes, even[j], odd[j]);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const V x0 = Isa::broadcast(x[r * ldx + 2 * p]), x1 = Isa::broadcast(x[r * ldx + 2 * p + 1]);
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) acc[r][j] = Isa::fma(x1, odd[j], Isa::fma(x0, even[j], acc[r][j]));
      }
    } else {  // every input broadcast held, one weight vector at a time
      V x0[R], x1[R];
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        x0[r] = Isa::broadcast(x[r * ldx + 2 * p]);
        x1[r] = Isa::broadcast(x[r * ldx + 2 * p + 1]);
      }
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) {
        V even, odd;
        Isa::widen(w + j * Isa::kLanes, even, odd);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) acc[r][j] = Isa::fma(x1[r], odd, Isa::fma(x0[r], even, acc[r][j]));
      }
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) Isa::store(sums + r * kGroupN + j * Isa::kLanes, acc[r][j]);
}

// Outputs [n0, n0 + 64) for R rows (x rows ldx apart, y rows ldy apart), Isa::kBlockRows rows at a time.
// The tile's first block prefetches `ahead`.
template <class Isa, int R>
inline void group_rows(const float* x, int64_t ldx, const uint32_t* wgroup, int64_t K, int64_t n0, int64_t N,
                       const float* bias, float* y, int64_t ldy, const pair_groups::LinesAhead& ahead) {
  constexpr int rows = std::min(R, Isa::kBlockRows);
  static_assert(R % rows == 0, "a tile's rows must fill whole blocks");
  alignas(64) float sums[R * kGroupN];
  for (int r0 = 0; r0 < R; r0 += rows)
    block_sums<Isa, rows>(x + r0 * ldx, ldx, wgroup, K / 2, sums + r0 * kGroupN,
                          r0 == 0 ? ahead : pair_groups::LinesAhead{});
  const int64_t valid = std::min<int64_t>(kGroupN, N - n0);
  for (int r = 0; r < R; ++r) {
    float* out = y + r * ldy + n0;
    if (bias != nullptr)
      for (int64_t n = 0; n < valid; ++n) out[n] = sums[r * kGroupN + n] + bias[n0 + n];
    else
      std::memcpy(out, sums + r * kGroupN, valid * sizeof(float));
  }
}

// y [M, N] = x [M, K] @ W^T (+ bias [N]), W in the blocked layout [ceil(N / 64), K / 2, 64, 2] bf16,
// by the vector form Isa.
template <class Isa>
void gemm_rows_with(const float* x, int64_t M, const at::BFloat16* wblocked, int64_t N, int64_t K,
                    const float* bias, float* y) {
  pair_groups::for_group_tiles(M, N, K, wblocked, [&](auto rows, int64_t g, int64_t m, const auto& ahead) {
    const uint32_t* wgroup = reinterpret_cast<const uint32_t*>(wblocked + g * K * kGroupN);
    group_rows<Isa, decltype(rows)::value>(x + m * K, K, wgroup, K, g * kGroupN, N, bias, y + m * N, N, ahead);
  });
}

// The widest form this build has.
#if defined(__AVX512F__)
using BuildIsa = Avx512;
#else
using BuildIsa = Avx2;
#endif

void gemm_rows(const float* x, int64_t M, const at::BFloat16* wblocked, int64_t N, int64_t K, const float* bias,
               float* y) {
  gemm_rows_with<BuildIsa>(x, M, wblocked, N, K, bias, y);
}

void check_blocked(const torch::Tensor& w, int64_t N, int64_t K) {
  pair_groups::check_blocked(w, N, K, "bf16-weight matmul");
}

}  // namespace
}  // namespace bf16w_kernels
