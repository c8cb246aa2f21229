// 16 values as fp32 lanes of a 512-bit vector, from float32 or bf16 (the bf16 -> fp32 widening is
// exact: the bits shifted up): one definition for the AVX-512 kernels that read either dtype.
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#if defined(__AVX512F__)
namespace fp32_lanes {
namespace {

inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

}  // namespace
}  // namespace fp32_lanes
#endif
