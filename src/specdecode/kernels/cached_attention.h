// The cached-attention kernel on raw pointers (attention_cpu.cpp explains the method and why):
// attention_cpu.cpp registers it as an op; decode_stack_cpu.cpp's lean path calls `attend` directly,
// so both compute the same numbers (include this file only from sources built with the same flags:
// its exp's multiply-subtracts contract as the build's -ffp-contract says).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "fp32_lanes.h"
#include "kv_records.h"
#include "thread_team.h"

namespace attention_kernels {
namespace {

// Query rows per KV head served here (group x tokens): the per-row cost here grows as rows x keys,
// the flash kernel's mostly fixed; measured (8/4 heads of 64, 2 threads) 2.5x faster at 2 rows,
// 1.1-1.7x at 10, even at 16 over 600 keys (fp32 scores). 16 until a limit of 8 tokens at group 2
// sent every 9-token verification (n-gram k = 8) down the eager path with PyTorch's kernel (W4A8,
// default model: 1.94 ms against 0.96 at 5 tokens). Measured then, ours / flash (us, 2 threads,
// 4 KV heads of 64, causal tail): 34 rows bf16 35 / 66 over 128 keys, 254 / 378 over 1,024, 525 / 756
// over 2,000; fp32 44 / 66, 321 / 365, 678 / 720. At 48 rows fp32 over 2,000 keys ours lost (880 /
// 858), bf16 still won (710 / 931). 40 covers 17 tokens at group 2 and 9 at group 4.
constexpr int64_t kMaxRows = 40;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 -> fp32 is exact: the bits shifted up
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 load8(const int8_t* p) {  // int8 -> fp32 is exact
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 8 vectors -> [sum of a0's lanes, ..., sum of a7's lanes], each by ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).
inline __m256 sum_lanes8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float fixed_sum8(__m256 v) {  // ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline float max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// exp(x) lane-wise for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial, the same
// constants as exact mode's kernel); lanes below -87 (and -inf) give exactly 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 hidden = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_add_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_fmadd_ps(r, _mm256_set1_ps(1.9875691500e-4f), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(hidden, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}

#if defined(__AVX512F__)
using fp32_lanes::load16;
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// [a0+a1, a2+a3, .., a14+a15, b0+b1, .., b14+b15]
inline __m512 pair_sums(__m512 a, __m512 b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

// Two levels of the keys' tree: 4 vectors of 16 partial sums (key j's in vector j, or lanes 4j ..
// 4j + 3 of each for 16 keys) -> [key 0's 4, key 1's 4, key 2's 4, key 3's 4] (or the 16 keys' sums).
inline __m512 four_keys(const __m512* acc) {
  return pair_sums(pair_sums(acc[0], acc[1]), pair_sums(acc[2], acc[3]));
}

// 16 keys' dot products, lane j holding key j's 16 partial sums -> [key 0's sum, .., key 15's], each by
// one fixed tree of pairwise sums (four keys' two levels, then the same two levels over their results).
inline __m512 sum_keys16(const __m512* acc) {
  const __m512 quarters[4] = {four_keys(acc), four_keys(acc + 4), four_keys(acc + 8), four_keys(acc + 12)};
  return four_keys(quarters);
}

// The keys of block s0.. a row sees: all 16, less those hidden by its mask or past S.
inline __mmask16 seen16(const bool* visible, int64_t s0, int64_t S) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  if (visible != nullptr && s0 + 16 <= S)  // a whole block's 16 bools (0 or 1) at once
    return _mm_test_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(visible + s0)), _mm_set1_epi8(1));
#endif
  __mmask16 seen = 0xFFFF;
  if (visible != nullptr || s0 + 16 > S)  // one by one, not past S (nor the mask's row)
    for (int j = 0; j < 16; ++j)
      if (!(s0 + j < S && (visible == nullptr || visible[s0 + j]))) seen &= static_cast<__mmask16>(~(1u << j));
  return seen;
}

// Scores against an int8 cache's keys (AVX-512): 16 keys at a time, each key's values widened to fp32
// and its dot product with the query taken in 16 lanes, the lanes summed as the bf16 kernel sums
// them, then times the key's scale and 1 / sqrt(D).
template <int DV, typename scalar_t>
float row_scores(const scalar_t* q, const int8_t* k, int64_t ks, const bool* visible, int64_t S, float scale,
                 float* scores) {
  constexpr int Z = DV / 2;  // 16-value chunks of the head (every head size `serves` takes is whole ones)
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 qz[Z];
  for (int c = 0; c < Z; ++c) qz[c] = load16(q + c * 16);
  __m512 vmax = _mm512_set1_ps(neg_inf);
  alignas(64) float key_scales[16];
  for (int64_t s0 = 0; s0 < S; s0 += 16) {
    __m512 acc[16];
    const bool tail = s0 + 16 > S;
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      const int8_t* key = k + (tail ? std::min<int64_t>(s0 + j, S - 1) : s0 + j) * ks;  // past S: a real key, hidden
      __m512 a = _mm512_mul_ps(qz[0], load16(key));
#pragma GCC unroll 16
      for (int c = 1; c < Z; ++c) a = _mm512_fmadd_ps(qz[c], load16(key + c * 16), a);
      acc[j] = a;
      key_scales[j] = record_scale(key, DV * 8);
    }
    const __m512 factors = _mm512_mul_ps(_mm512_load_ps(key_scales), _mm512_set1_ps(scale));
    const __m512 sc = _mm512_mul_ps(sum_keys16(acc), factors);  // lane j: key s0 + j
    const __m512 kept = _mm512_mask_blend_ps(seen16(visible, s0, S), _mm512_set1_ps(neg_inf), sc);
    _mm512_storeu_ps(scores + s0, kept);
    vmax = _mm512_max_ps(vmax, kept);
  }
  return _mm512_reduce_max_ps(vmax);  // a maximum: exact in any order
}

// row_scores over an int8 cache for two query rows at once: each key's values widened once for both,
// 4 keys at a time, each quarter's accumulators reduced to its first two tree levels before the next
// (16 accumulators a row otherwise: a pair's would not fit the registers with the queries). Each key's
// tree and factors are row_scores', so each row's scores and maximum are too, bit for bit. Heads up
// to 64 (`paired_scores`).
template <int DV, typename scalar_t>
std::pair<float, float> pair_scores(const scalar_t* q0, const scalar_t* q1, const int8_t* k, int64_t ks,
                                    const bool* visible0, const bool* visible1, int64_t S, float scale,
                                    float* scores0, float* scores1) {
  constexpr int Z = DV / 2;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 qa[Z], qb[Z];
  for (int c = 0; c < Z; ++c) qa[c] = load16(q0 + c * 16), qb[c] = load16(q1 + c * 16);
  __m512 vmax0 = _mm512_set1_ps(neg_inf), vmax1 = vmax0;
  alignas(64) float key_scales[16];
  for (int64_t s0 = 0; s0 < S; s0 += 16) {
    const bool tail = s0 + 16 > S;
    __m512 quarters0[4], quarters1[4];
    for (int quarter = 0; quarter < 4; ++quarter) {
      __m512 acc0[4], acc1[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int64_t s = s0 + quarter * 4 + j;
        const int8_t* key = k + (tail ? std::min<int64_t>(s, S - 1) : s) * ks;  // past S: a real key, hidden
        __m512 values = load16(key);
        __m512 a0 = _mm512_mul_ps(qa[0], values), a1 = _mm512_mul_ps(qb[0], values);
#pragma GCC unroll 16
        for (int c = 1; c < Z; ++c) {
          values = load16(key + c * 16);
          a0 = _mm512_fmadd_ps(qa[c], values, a0), a1 = _mm512_fmadd_ps(qb[c], values, a1);
        }
        acc0[j] = a0, acc1[j] = a1;
        key_scales[quarter * 4 + j] = record_scale(key, DV * 8);
      }
      quarters0[quarter] = four_keys(acc0), quarters1[quarter] = four_keys(acc1);
    }
    const __m512 factors = _mm512_mul_ps(_mm512_load_ps(key_scales), _mm512_set1_ps(scale));
    const __m512 kept0 = _mm512_mask_blend_ps(seen16(visible0, s0, S), _mm512_set1_ps(neg_inf),
                                              _mm512_mul_ps(four_keys(quarters0), factors));
    const __m512 kept1 = _mm512_mask_blend_ps(seen16(visible1, s0, S), _mm512_set1_ps(neg_inf),
                                              _mm512_mul_ps(four_keys(quarters1), factors));
    _mm512_storeu_ps(scores0 + s0, kept0);
    _mm512_storeu_ps(scores1 + s0, kept1);
    vmax0 = _mm512_max_ps(vmax0, kept0), vmax1 = _mm512_max_ps(vmax1, kept1);
  }
  return {_mm512_reduce_max_ps(vmax0), _mm512_reduce_max_ps(vmax1)};
}
#endif

// Scores sc of keys s0 .. s0 + 7 stored at scores + s0, -inf where a key is hidden (mask false, or past
// S), the others exactly; returns what was stored. A whole block's 8 mask bools are read as one word
// (building the lanes by 8 scalar stores and a vector load stalled on store forwarding: 30% of the
// scores' time at 10 rows a KV head).
static_assert(sizeof(bool) == 1, "the masks are read as bytes");
inline __m256 keep_seen8(__m256 sc, const bool* visible, int64_t s0, int64_t S, float* scores) {
  __m256i seen = _mm256_set1_epi32(-1);
  if (s0 + 8 > S) {  // the last block: only the keys before S, read one by one (not past the mask's row)
    alignas(32) int32_t flags[8];
    for (int j = 0; j < 8; ++j) flags[j] = (s0 + j < S && (visible == nullptr || visible[s0 + j])) ? -1 : 0;
    seen = _mm256_load_si256(reinterpret_cast<const __m256i*>(flags));
  } else if (visible != nullptr) {
    int64_t bools;  // bool is 0 or 1
    std::memcpy(&bools, visible + s0, sizeof(bools));
    seen = _mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bools)), _mm256_setzero_si256());
  }
  const __m256 kept = _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), sc,
                                       _mm256_castsi256_ps(seen));
  _mm256_storeu_ps(scores + s0, kept);
  return kept;
}

// Phase 1 for one query row against S keys of one KV head: scores[s] = q . k(s) / sqrt(D), -inf where
// the key is hidden (mask false, or past S); returns the row's maximum. DV = D / 8 vectors per head;
// k(s): key s (stride ks elements); visible: the row's mask (nullptr: every key); scores: [S rounded
// up to 16].
template <int DV, typename scalar_t>
float row_scores(const scalar_t* q, const scalar_t* k, int64_t ks, const bool* visible, int64_t S, float scale,
                 float* scores) {
  __m256 qv[DV];
  for (int c = 0; c < DV; ++c) qv[c] = load8(q + c * 8);
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t s0 = 0; s0 < S; s0 += 8) {
    __m256 acc[8];
    const bool tail = s0 + 8 > S;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const scalar_t* key = k + (tail ? std::min<int64_t>(s0 + j, S - 1) : s0 + j) * ks;  // past S: a real key, hidden
      __m256 a = _mm256_mul_ps(qv[0], load8(key));
#pragma GCC unroll 32
      for (int c = 1; c < DV; ++c) a = _mm256_fmadd_ps(qv[c], load8(key + c * 8), a);
      acc[j] = a;
    }
    vmax = _mm256_max_ps(vmax, keep_seen8(_mm256_mul_ps(sum_lanes8(acc), _mm256_set1_ps(scale)), visible, s0, S,
                                          scores));
  }
  return max8(vmax);
}

#if defined(__AVX512F__)
// Both 8-lane halves of a 512-bit vector: the same 8 values / lo and hi.
inline __m512 twice8(__m256 x) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(x))); }
inline __m512 join8(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
inline __m256 high8(__m512 x) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)); }

// row_scores' 8-lane chain for two query rows at once, row 0 in the low 8 lanes of each vector and row
// 1 in the high 8: a key's chunks are read once for both rows (half the loads and FMA instructions of
// two calls). Every lane's FMA chain and each row's lane sums are row_scores', so each row's scores and
// maximum are too, bit for bit, whatever row it is paired with.
template <int DV, typename scalar_t>
std::pair<float, float> pair_scores(const scalar_t* q0, const scalar_t* q1, const scalar_t* k, int64_t ks,
                                    const bool* visible0, const bool* visible1, int64_t S, float scale,
                                    float* scores0, float* scores1) {
  __m512 qv[DV];
  for (int c = 0; c < DV; ++c) qv[c] = join8(load8(q0 + c * 8), load8(q1 + c * 8));
  __m256 vmax0 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), vmax1 = vmax0;
  for (int64_t s0 = 0; s0 < S; s0 += 8) {
    __m256 acc0[8], acc1[8];
    const bool tail = s0 + 8 > S;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const scalar_t* key = k + (tail ? std::min<int64_t>(s0 + j, S - 1) : s0 + j) * ks;  // past S: a real key, hidden
      __m512 a = _mm512_mul_ps(qv[0], twice8(load8(key)));
#pragma GCC unroll 32
      for (int c = 1; c < DV; ++c) a = _mm512_fmadd_ps(qv[c], twice8(load8(key + c * 8)), a);
      acc0[j] = _mm512_castps512_ps256(a);
      acc1[j] = high8(a);
    }
    vmax0 = _mm256_max_ps(vmax0, keep_seen8(_mm256_mul_ps(sum_lanes8(acc0), _mm256_set1_ps(scale)), visible0, s0,
                                            S, scores0));
    vmax1 = _mm256_max_ps(vmax1, keep_seen8(_mm256_mul_ps(sum_lanes8(acc1), _mm256_set1_ps(scale)), visible1, s0,
                                            S, scores1));
  }
  return {max8(vmax0), max8(vmax1)};
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)

// bf16 rows on CPUs with AVX-512 BF16: 16 keys at a time, each key's dot product in 16 lanes by
// vdpbf16ps (32 bf16 products a step, in fp32, no conversions), the 16 keys' lanes summed by one
// fixed tree of pairwise sums. A different rounding than the 8-lane fp32 chain above, the same for
// every row count.
template <int DV>
float row_scores(const at::BFloat16* q, const at::BFloat16* k, int64_t ks, const bool* visible, int64_t S,
                 float scale, float* scores) {
  // Heads that are no whole number of 32-value chunks (80) take the 8-lane chain above.
  if constexpr (DV % 4 != 0) return row_scores<DV, at::BFloat16>(q, k, ks, visible, S, scale, scores);
  constexpr int Z = DV / 4;  // 32-value chunks of the head
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512bh qz[Z];
  for (int c = 0; c < Z; ++c) qz[c] = (__m512bh)_mm512_loadu_si512(q + c * 32);
  __m512 vmax = _mm512_set1_ps(neg_inf);
  for (int64_t s0 = 0; s0 < S; s0 += 16) {
    __m512 acc[16];
    const bool tail = s0 + 16 > S;
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      const at::BFloat16* key = k + (tail ? std::min<int64_t>(s0 + j, S - 1) : s0 + j) * ks;
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qz[0], (__m512bh)_mm512_loadu_si512(key));
#pragma GCC unroll 8
      for (int c = 1; c < Z; ++c) a = _mm512_dpbf16_ps(a, qz[c], (__m512bh)_mm512_loadu_si512(key + c * 32));
      acc[j] = a;
    }
    const __m512 sc = _mm512_mul_ps(sum_keys16(acc), _mm512_set1_ps(scale));  // lane j: key s0 + j
    const __m512 kept = _mm512_mask_blend_ps(seen16(visible, s0, S), _mm512_set1_ps(neg_inf), sc);
    _mm512_storeu_ps(scores + s0, kept);
    vmax = _mm512_max_ps(vmax, kept);
  }
  return _mm512_reduce_max_ps(vmax);  // a maximum: exact in any order
}
#endif

// Phase 2: a row's scores[0, S) of maximum m become exp(score - m) (exact zeros where hidden);
// returns their sum, 0 where the row sees no key.
inline float exponentiate(float* scores, int64_t S, float m) {
  if (m == -std::numeric_limits<float>::infinity()) return 0.0f;  // sees no key (never in a decode step)
  __m256 lanes = _mm256_setzero_ps();
  for (int64_t s0 = 0; s0 < S; s0 += 8) {
    const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + s0), _mm256_set1_ps(m)));
    _mm256_storeu_ps(scores + s0, p);
    lanes = _mm256_add_ps(lanes, p);
  }
  return fixed_sum8(lanes);
}

// Whether a KV head's rows take their scores two at a time (pair_scores), on a CPU with AVX-512: the
// 8-lane chain (not bf16's vdpbf16ps one) for heads up to 128 (a pair's query of 256 would fill the 32
// vector registers alone), an int8 cache's 16-lane loop for heads up to 64.
template <int DV, typename scalar_t, typename cache_t>
constexpr bool paired_scores() {
#if defined(__AVX512F__)
  if constexpr (kQuantized<cache_t>) return DV <= 8;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && DV % 4 == 0) return false;
#endif
  return std::is_same_v<scalar_t, cache_t> && DV <= 16;
#else
  return false;
#endif
}

// Phases 1 and 2 for one row.
template <int DV, typename scalar_t, typename cache_t>
float row_probabilities(const scalar_t* q, const cache_t* k, int64_t ks, const bool* visible, int64_t S, float scale,
                        float* scores) {
  return exponentiate(scores, S, row_scores<DV>(q, k, ks, visible, S, scale, scores));
}

// The weight of value s in a row's sum: its probability, times the value's scale in an int8 cache.
template <typename cache_t>
inline float value_weight(float p, const cache_t* value, int64_t D) {
  if constexpr (kQuantized<cache_t>) return p * record_scale(value, D);
  return p;
}

// Phase 3 for one row: out = sum over visible keys s, in order, of p(s) v(s) (each dimension's
// FMA chain), divided by `sum`; zeros where the row sees no key.
template <int DV, typename scalar_t, typename cache_t>
void row_values(const float* probs, float sum, const cache_t* v, int64_t vs, int64_t S, scalar_t* out) {
  if (sum == 0.0f) {
    for (int64_t d = 0; d < DV * 8; ++d) out[d] = static_cast<scalar_t>(0.0f);
    return;
  }
  __m256 acc[DV];
  for (int c = 0; c < DV; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    if (probs[s] == 0.0f) continue;  // hidden (or underflowed) keys add nothing
    const cache_t* value = v + s * vs;
    const __m256 p = _mm256_set1_ps(value_weight(probs[s], value, DV * 8));
    for (int c = 0; c < DV; ++c) acc[c] = _mm256_fmadd_ps(p, load8(value + c * 8), acc[c]);
  }
  alignas(32) float row[DV * 8];
  const __m256 denom = _mm256_set1_ps(sum);
  for (int c = 0; c < DV; ++c) _mm256_store_ps(row + c * 8, _mm256_div_ps(acc[c], denom));
  for (int64_t d = 0; d < DV * 8; ++d) out[d] = static_cast<scalar_t>(row[d]);
}

#if defined(__AVX512F__)

// Phase 3 for RC rows of one KV head at once: each value is loaded and widened once for all of them;
// every row's arithmetic is row_values' (the same FMA chain per dimension, the same keys skipped),
// so its result is too, bit for bit.
template <int DV, int RC, typename scalar_t, typename cache_t>
void rows_values(const float* const* probs, const float* sums, const cache_t* v, int64_t vs, int64_t S,
                 scalar_t* const* outs) {
  constexpr int Z = DV / 2;  // 16-value chunks of the head
  __m512 acc[RC][Z];
  for (int r = 0; r < RC; ++r)
    for (int c = 0; c < Z; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const cache_t* value = v + s * vs;
    __m512 vz[Z];
    for (int c = 0; c < Z; ++c) vz[c] = load16(value + c * 16);
#pragma GCC unroll 8
    for (int r = 0; r < RC; ++r) {
      const float w = probs[r][s];
      if (w == 0.0f) continue;
      const __m512 p = _mm512_set1_ps(value_weight(w, value, DV * 8));
      for (int c = 0; c < Z; ++c) acc[r][c] = _mm512_fmadd_ps(p, vz[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RC; ++r) {
    alignas(64) float row[DV * 8];
    const __m512 denom = _mm512_set1_ps(sums[r]);
    for (int c = 0; c < Z; ++c) _mm512_store_ps(row + c * 16, _mm512_div_ps(acc[r][c], denom));
    for (int64_t d = 0; d < DV * 8; ++d) outs[r][d] = static_cast<scalar_t>(sums[r] == 0.0f ? 0.0f : row[d]);
  }
}
#endif

// Phase 3 for rows r .. R - 1 (probabilities and outputs `padded` / D apart): groups of RC rows
// (rows_values), then of RC / 2, .., then one at a time (row_values): the same numbers in any grouping.
template <int DV, int RC, typename scalar_t, typename cache_t>
void grouped_values(int64_t r, int64_t R, const float* probs, int64_t padded, const float* sums, const cache_t* v,
                    int64_t vs, int64_t S, scalar_t* out) {
#if defined(__AVX512F__)
  if constexpr (RC > 1 && DV % 2 == 0) {
    for (; r + RC <= R; r += RC) {
      const float* p[RC];
      scalar_t* o[RC];
      for (int i = 0; i < RC; ++i) {
        p[i] = probs + (r + i) * padded;
        o[i] = out + (r + i) * DV * 8;
      }
      rows_values<DV, RC>(p, sums + r, v, vs, S, o);
    }
    return grouped_values<DV, RC / 2>(r, R, probs, padded, sums, v, vs, S, out);
  }
#endif
  for (; r < R; ++r) row_values<DV>(probs + r * padded, sums[r], v, vs, S, out + r * DV * 8);
}

// One (sequence, KV head) task: its R query rows q [R, D] against S keys, key s at k + s * k_stride (values
// likewise; in an int8 cache, each a record), row r under mask row r % T ([T, S] row-major; nullptr: every
// key) -> out [R, D]. `probs` holds R x S rounded up to 16 floats, `sums` R.
template <int DV, typename scalar_t, typename cache_t>
void attend_head(const scalar_t* q, int64_t R, const cache_t* k, int64_t k_stride, const cache_t* v,
                 int64_t v_stride, int64_t S, const bool* mask, int64_t T, float* probs, float* sums, scalar_t* out) {
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(DV * 8)));
  const int64_t padded = (S + 15) / 16 * 16;  // every row's probabilities, then their values
  auto visible = [&](int64_t r) { return mask == nullptr ? nullptr : mask + (r % T) * S; };
  int64_t r = 0;
#if defined(__AVX512F__)
  if constexpr (paired_scores<DV, scalar_t, cache_t>()) {
    for (; r + 2 <= R; r += 2) {
      float* scores = probs + r * padded;
      const auto [m0, m1] = pair_scores<DV>(q + r * DV * 8, q + (r + 1) * DV * 8, k, k_stride, visible(r),
                                            visible(r + 1), S, scale, scores, scores + padded);
      sums[r] = exponentiate(scores, S, m0);
      sums[r + 1] = exponentiate(scores + padded, S, m1);
    }
  }
#endif
  for (; r < R; ++r)
    sums[r] = row_probabilities<DV>(q + r * DV * 8, k, k_stride, visible(r), S, scale, probs + r * padded);
  // Values in groups of rows whose accumulators fit the 32 vector registers with the values: 16 a group.
  constexpr int RC = DV >= 32 ? 1 : 16 / (DV / 2);
  grouped_values<DV, RC>(0, R, probs, padded, sums, v, v_stride, S, out);
}

// One sequence's part of a batch whose sequences attend over their own cache rows and masks (the C++
// stack's lean path): q [KVH, group x T, D] folded as `attend` takes it, its cache row's keys and values
// (head h at k + h * ks[2], key s at + s * ks[1]: the same strides for every segment), S keys, mask
// [T, S] or nullptr -> out [KVH, group x T, D].
template <typename scalar_t, typename cache_t = scalar_t>
struct HeadSegment {
  const scalar_t* q;
  const cache_t* k;
  const cache_t* v;
  int64_t T, S;
  const bool* mask;
  scalar_t* out;
};

template <int DV, typename scalar_t, typename cache_t>
void attention_segments(const std::vector<HeadSegment<scalar_t, cache_t>>& segments, int64_t KVH, int64_t group,
                        const int64_t* ks, const int64_t* vs) {
  int64_t most = 0, rows = 0;  // the largest probs buffer and row count of a task
  for (const auto& seg : segments) {
    most = std::max(most, group * seg.T * ((seg.S + 15) / 16 * 16));
    rows = std::max(rows, group * seg.T);
  }
  const int64_t tasks = static_cast<int64_t>(segments.size()) * KVH;
  thread_team::parallel_for(tasks, [&](thread_team::Claims& claims) {
    std::vector<float> probs(most), sums(rows);
    for (int64_t task = claims.next(); task >= 0; task = claims.next()) {
      const auto& seg = segments[task / KVH];
      const int64_t h = task % KVH, R = group * seg.T;
      attend_head<DV>(seg.q + h * R * DV * 8, R, seg.k + h * ks[2], ks[1], seg.v + h * vs[2], vs[1], seg.S, seg.mask,
                      seg.T, probs.data(), sums.data(), seg.out + h * R * DV * 8);
    }
  });
}

// Whether `attend` serves a head size and number of rows per KV head (else PyTorch's kernel). The
// head sizes of common models: 64 and 128 (Llama, Mistral, Qwen), 80 (Phi-2), 96 (Phi-3), 256
// (Gemma), 32 (small ones). PyTorch's kernel, which serves the rest, is slower at these widths and
// does not compute a row alike whatever the rows and keys beside it: a padded verify batch then
// rounds otherwise than plain decoding.
// An int8 cache's scores kernel is AVX-512's (elsewhere PyTorch's serves it, on the dequantised cache).
inline bool serves(int64_t rows, int64_t head_dim, int64_t num_keys, bool quantized = false) {
#if !defined(__AVX512F__)
  if (quantized) return false;
#endif
  return rows <= kMaxRows && num_keys > 0 &&
         (head_dim == 64 || head_dim == 128 || head_dim == 32 || head_dim == 80 || head_dim == 96 || head_dim == 256);
}

// The segments' (sequence, KV head) tasks split over the threads in one parallel region (every segment's
// rows `serves` first): the C++ stack's lean path attends a batch's sequences, each over its own cache row
// and mask, this way (one parallel region a sequence cost 1-10% of a 4-16-sequence decode step).
template <typename scalar_t, typename cache_t>
void attend_segments(const std::vector<HeadSegment<scalar_t, cache_t>>& segments, int64_t KVH, int64_t group,
                     int64_t D, const int64_t* ks, const int64_t* vs) {
#if !defined(__AVX512F__)
  if constexpr (kQuantized<cache_t>) {
    TORCH_CHECK(false, "cached attention over an int8 KV cache needs AVX-512 (`serves` says so)");
  } else
#endif
  switch (D) {
    case 32: return attention_segments<4>(segments, KVH, group, ks, vs);
    case 64: return attention_segments<8>(segments, KVH, group, ks, vs);
    case 80: return attention_segments<10>(segments, KVH, group, ks, vs);
    case 96: return attention_segments<12>(segments, KVH, group, ks, vs);
    case 128: return attention_segments<16>(segments, KVH, group, ks, vs);
    default: return attention_segments<32>(segments, KVH, group, ks, vs);
  }
}

// q [B, KVH, R, D] contiguous (R = group x T rows per KV head, row g * T + t for token t); key (b, s, h)
// at keys + b * ks[0] + s * ks[1] + h * ks[2] (values likewise with vs), its D elements contiguous (an int8
// cache's record: D values and the scale); mask [B, T, S] bool (row-major) or nullptr (every key visible)
// -> out [B, KVH, R, D]. `serves` first.
template <typename scalar_t, typename cache_t>
void attend(const scalar_t* q, int64_t B, int64_t KVH, int64_t R, int64_t D, const cache_t* keys, const int64_t* ks,
            const cache_t* values, const int64_t* vs, int64_t S, const bool* mask, int64_t T, scalar_t* out) {
  std::vector<HeadSegment<scalar_t, cache_t>> segments;
  segments.reserve(B);
  for (int64_t b = 0; b < B; ++b)
    segments.push_back({q + b * KVH * R * D, keys + b * ks[0], values + b * vs[0], T, S,
                        mask == nullptr ? nullptr : mask + b * T * S, out + b * KVH * R * D});
  attend_segments(segments, KVH, R / T, D, ks, vs);
}

}  // namespace
}  // namespace attention_kernels
