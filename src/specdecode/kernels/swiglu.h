// SwiGLU's product silu(gate) * up of rows, on raw pointers (decode_stack_cpu.cpp's lean path), with
// the numbers PyTorch's ops give: `at::silu` then `mul_`.
//
// Why not the ops: at one token of the default model their dispatch and TensorIterator setup were most
// of the ~5 us a layer the two cost, around 1-2 us of arithmetic (a W4A8 forward of it took 0.95-0.97x
// the time at one, five and nine tokens without them). To give the same numbers this runs
// PyTorch's own AVX-512 silu kernel: x / (1 + exp(-x)) with Sleef's expf (the function libtorch_cpu
// exports and its vectorised kernel calls), 32 values at a time for float32 and 64 for bf16 (two
// vectors a step, as its loop runs), the rest of a row by the scalar formula with std::exp; bf16 rounded
// to nearest even (NaN as its vectors write it). The product is rounded to the dtype as `mul_` rounds it.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sleef.h>

#include <cmath>
#include <cstdint>

#include "fp32_lanes.h"
#include "thread_team.h"

namespace swiglu_kernels {
namespace {

// x / (1 + exp(-x)), 16 lanes (Vectorized<float>: x_vec / (kOneVec + x_vec.neg().exp())).
inline __m512 silu16(__m512 x) {
  const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(_mm512_set1_ps(-0.0f), x));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// PyTorch's vectorised float -> bf16 (vec512_bfloat16.h cvtfp32_bf16): nearest even, NaN 0xffff.
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  __m512i r = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                               _mm512_set1_epi32(0x7fff));
  r = _mm512_srli_epi32(_mm512_add_epi32(r, bits), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0xffff), r);
  return _mm512_cvtusepi32_epi16(r);
}

using fp32_lanes::load16;

// out[j] = dtype(silu(gate[j])) * up[j], rounded to the dtype, for 16 values.
inline void product16(const float* gate, const float* up, float* out) {
  _mm512_storeu_ps(out, _mm512_mul_ps(silu16(load16(gate)), load16(up)));
}
inline void product16(const at::BFloat16* gate, const at::BFloat16* up, at::BFloat16* out) {
  const __m256i s = to_bf16(silu16(load16(gate)));  // silu's bf16 output, then mul_ in float
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), to_bf16(_mm512_mul_ps(fp32_lanes::widen_bf16(s), load16(up))));
}

// One row: I values of gate and of up -> act.
template <typename scalar_t>
void product_row(const scalar_t* gate, const scalar_t* up, scalar_t* act, int64_t I) {
  constexpr int64_t kStep = std::is_same_v<scalar_t, float> ? 32 : 64;  // two of PyTorch's vectors
  int64_t j = 0;
  for (; j + kStep <= I; j += kStep)
    for (int64_t v = 0; v < kStep; v += 16) product16(gate + j + v, up + j + v, act + j + v);
  for (; j < I; ++j) {  // the scalar formula (its basic loop); mul_ rounds the product likewise
    const float x = static_cast<float>(gate[j]);
    const scalar_t s = static_cast<scalar_t>(x / (1.0f + std::exp(-x)));
    act[j] = static_cast<scalar_t>(static_cast<float>(s) * static_cast<float>(up[j]));
  }
}

// gate_up [T, 2I] (each row's gate, then its up) -> act [T, I]: silu(gate) * up. Rows split over threads
// where PyTorch's silu would split them (from its grain), on the thread team inside a region.
template <typename scalar_t>
void product_rows(const scalar_t* gate_up, int64_t T, int64_t I, scalar_t* act) {
  auto rows = [&](int64_t t) { product_row(gate_up + t * 2 * I, gate_up + t * 2 * I + I, act + t * I, I); };
  if (T * I < at::internal::GRAIN_SIZE) {
    for (int64_t t = 0; t < T; ++t) rows(t);
    return;
  }
  thread_team::parallel_for(T, [&](thread_team::Claims& claims) {
    for (int64_t t = claims.next(); t >= 0; t = claims.next()) rows(t);
  });
}

}  // namespace
}  // namespace swiglu_kernels
