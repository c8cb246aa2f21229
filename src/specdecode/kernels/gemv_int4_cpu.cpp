// Few-row int4 weight-only matmuls for decoding (CPU, AVX2 + FMA): y[M, N] = x[M, K] @ W[N, K]^T for the
// 1-16 rows of a decode, drafting or verification step, W int4 in groups of g inputs:
// w = (q - 8) * s + z = q * s + o with q in [0, 15] and o = z - 8 s per (output, group).
//
// Why: on an AVX2-only CPU float32 activations multiply int4 layers by their dense dequantised copy
// (4 bytes a weight), and PyTorch's int4 kernel serves bf16 only: the QAT int4 drafters spent 60% of a
// speculative step drafting. Same scheme as the int8 kernel (gemv_int8_cpu.cpp): weights in groups of 64
// outputs, [ceil(N / 64), K, 32] bytes, for each input one 32-byte line whose 32-bit word j holds
// outputs 8j .. 8j + 7 at bits 4i .. 4i + 3; a tile of R rows x NB blocks of 8 outputs keeps R x NB
// accumulators of sum_k x[k] * q[k] over the current input group and R x NB totals, to which each
// finished group adds acc * s + xsum * o (xsum: the row's input sum over the group). Widening 8
// weights is one broadcast load, a variable shift, an and and a conversion.
//
// Two more layouts, of input pairs, for AVX-512 CPUs: the lane layout (float activations, any AVX-512:
// the same sums as this one, bit for bit, at about half the time) and the pair layout (bf16 activations,
// AVX-512 BF16). Python's `gemv_int4_cpu.packer` picks the one a build serves.
//
// Each output is computed by the same sequence of operations whatever tile it sits in, so a row's
// output does not depend on the rows beside it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "lines_ahead.h"

namespace {

using lines_ahead::LinesAhead;

constexpr int64_t kGroup = 64;  // output channels per group of the layout (32 bytes per input)
constexpr int kMaxTileRows = 4;  // accumulators and totals of 4 rows fill the 16 ymm registers

// A tile's R rows of `width` fp32 sums (row r at sums + r * width) plus the bias, as outputs n0 .. of y.
template <typename out_t>
inline void store_rows(const float* sums, int R, int64_t width, int64_t n0, int64_t N, const float* bias, out_t* y) {
  const int64_t outputs = std::min<int64_t>(width, N - n0);
  for (int r = 0; r < R; ++r) {
    for (int64_t i = 0; i < outputs; ++i) {
      float v = sums[r * width + i];
      if (bias != nullptr) v += bias[n0 + i];
      y[r * N + n0 + i] = static_cast<out_t>(v);
    }
  }
}

// f(std::integral_constant<int, R>{}) with R = min(rows, kMax), rows >= 1: a tile of as many rows as fit.
template <int kMax, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (kMax > 1) {
    if (rows < kMax) return with_rows<kMax - 1>(rows, f);
  }
  f(std::integral_constant<int, kMax>{});
}

// The packed weights' layout: the AVX2 one ([ceil(N / 64), K, 32] uint8), the lane layout ([.., K / 2, 16]
// int32) or the pair layout ([.., K / 2, 64] uint8).
enum class Layout { kAvx2, kLanes, kPairs };

inline Layout layout_of(const torch::Tensor& packed) {
  if (packed.scalar_type() == at::kInt) return Layout::kLanes;
  return packed.dim() == 3 && packed.size(2) == 64 ? Layout::kPairs : Layout::kAvx2;
}

// Each row's input sum per group, in input order: [M * K / group] fp32.
template <typename in_t>
std::vector<float> group_sums(const in_t* x, int64_t M, int64_t K, int64_t group) {
  const int64_t groups = K / group;
  std::vector<float> xsum(M * groups);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t kg = 0; kg < groups; ++kg) {
      float s = 0.0f;
      for (int64_t k = kg * group; k < (kg + 1) * group; ++k) s += static_cast<float>(x[r * K + k]);
      xsum[r * groups + kg] = s;
    }
  }
  return xsum;
}

// Tiles: R rows x NB blocks of 8 outputs from output n0 of a layout group; w at the tile's first
// block (stride 32 bytes per input), so [R x NB] block offsets are j * 4 bytes.
template <int R, int NB, typename out_t>
inline void tile(const float* x, const float* xsum, const uint8_t* w, int64_t K, int64_t group, const float* so,
                 int64_t n0, int64_t N, const float* bias, out_t* y) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i low4 = _mm256_set1_epi32(0xF);
  const int64_t groups = K / group;
  __m256 total[R * NB];
#pragma GCC unroll 16
  for (int i = 0; i < R * NB; ++i) total[i] = _mm256_setzero_ps();
  for (int64_t kg = 0; kg < groups; ++kg) {
    __m256 acc[R * NB];
#pragma GCC unroll 16
    for (int i = 0; i < R * NB; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k = kg * group; k < (kg + 1) * group; ++k) {
      const uint8_t* line = w + k * 32;
      __m256 wv[NB];
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        const __m256i word = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(line + j * 4));
        wv[j] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(word, shifts), low4));
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) acc[r * NB + j] = _mm256_fmadd_ps(xb, wv[j], acc[r * NB + j]);
      }
    }
    // so [groups][2][64] for this layout group: scales, then offsets, of its 64 outputs.
    const float* s = so + kg * 2 * kGroup;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_set1_ps(xsum[r * groups + kg]);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        const __m256 t = _mm256_fmadd_ps(acc[r * NB + j], _mm256_loadu_ps(s + j * 8), total[r * NB + j]);
        total[r * NB + j] = _mm256_fmadd_ps(xs, _mm256_loadu_ps(s + kGroup + j * 8), t);
      }
    }
  }
  alignas(32) float sums[R * NB * 8];
#pragma GCC unroll 16
  for (int i = 0; i < R * NB; ++i) _mm256_store_ps(sums + i * 8, total[i]);
  store_rows(sums, R, NB * 8, n0, N, bias, y);
}

template <int R, typename out_t>
inline void group_rows(const float* x, const float* xsum, const uint8_t* wgroup, int64_t K, int64_t group,
                       const float* so, int64_t g, int64_t N, const float* bias, out_t* y) {
  constexpr int NB = R == 1 ? 4 : R == 2 ? 2 : 1;
  for (int64_t j = 0; j < kGroup / 8; j += NB) {
    const int64_t n0 = g * kGroup + j * 8;
    if (n0 >= N) break;
    tile<R, NB>(x, xsum, wgroup + j * 4, K, group, so + j * 8, n0, N, bias, y);
  }
}

template <typename out_t>
void gemm_rows(const float* x, int64_t M, const uint8_t* packed, const float* scale_offsets, int64_t N, int64_t K,
               int64_t group, const float* bias, out_t* y) {
  const int64_t groups = K / group, layout_groups = (N + kGroup - 1) / kGroup;
  const std::vector<float> xsum = group_sums(x, M, K, group);
  at::parallel_for(0, layout_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* wgroup = packed + g * K * 32;
      const float* so = scale_offsets + g * groups * 2 * kGroup;
      for (int64_t m = 0; m < M; m += kMaxTileRows) {
        const float* xm = x + m * K;
        const float* sm = xsum.data() + m * groups;
        out_t* ym = y + m * N;
        with_rows<kMaxTileRows>(M - m, [&](auto R) { group_rows<R()>(xm, sm, wgroup, K, group, so, g, N, bias, ym); });
      }
    }
  });
}

#if defined(__AVX512F__)
// float32 activations on an AVX-512 CPU: the lane layout [ceil(N / 64), K / 2, 16] int32, one line of 16 words
// per input pair p whose word l holds at bits 4i .. 4i + 3 the nibble of output 16 (i / 2) + l, input
// 2p + i % 2. Eight shifts (by 4i) of the line and one vpermps each of the table {0, 1, .., 15} (its index
// is the low 4 bits of each lane: no mask) give eight vectors of 16 weights as fp32: 2 instructions per 16
// weights, where the AVX2 form takes 4 per 8 and was compute-bound. Scales and zeros are bf16 (the pair
// layout's), 1 bit per weight at groups of 32 where fp32 scales and offsets read 2; each group's offset
// z - 8 s is made in fp32 as `pack` makes it. Each output's sum runs over its inputs in order, one FMA
// chain per group from zero, then acc * s + xsum * (z - 8 s), as in the AVX2 form: the same results, bit
// for bit, at half its time or less (BENCHMARKS.md "forty-fourth pass").
constexpr bool kLaneKernel = true;

template <int n>
inline void zero_all(__m512 (&v)[n]) {
#pragma GCC unroll 24
  for (int i = 0; i < n; ++i) v[i] = _mm512_setzero_ps();
}

// A tile's R rows x n / R vectors of 16 sums (row-major), plus the bias, as outputs n0 .. of y.
template <int R, int n, typename out_t>
inline void store_tile(const __m512 (&total)[n], int64_t n0, int64_t N, const float* bias, out_t* y) {
  alignas(64) float sums[n * 16];
#pragma GCC unroll 24
  for (int i = 0; i < n; ++i) _mm512_store_ps(sums + i * 16, total[i]);
  store_rows(sums, R, n / R * 16, n0, N, bias, y);
}

inline __m512 load_bf16(const at::BFloat16* p) {  // 16 bf16 values as fp32 (exact: a 16-bit shift)
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Tiles: R rows x NV vectors of 16 outputs, vectors V0 .. V0 + NV - 1 of a layout group (first output n0).
template <int R, int NV, int V0, typename out_t>
inline void lane_tile(const float* x, const float* xsum, const int32_t* w, int64_t K, int64_t group,
                      const at::BFloat16* sz, int64_t n0, int64_t N, const float* bias, out_t* y,
                      const LinesAhead& ahead) {
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t groups = K / group, pairs_per_group = group / 2;
  __m512 total[R * NV];
  zero_all(total);
  for (int64_t kg = 0; kg < groups; ++kg) {
    __m512 acc[R * NV];
    zero_all(acc);
    for (int64_t p = kg * pairs_per_group; p < (kg + 1) * pairs_per_group; ++p) {
      if (ahead.first != nullptr) ahead.at(p);
      const __m512i line = _mm512_loadu_si512(w + p * 16);
#pragma GCC unroll 2
      for (int u = 0; u < 2; ++u) {  // input 2p, then 2p + 1: each output's sum in input order
        __m512 xb[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) xb[r] = _mm512_set1_ps(x[r * K + 2 * p + u]);
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) {
          const int shift = 4 * (2 * (V0 + j) + u);
          const __m512 wv = _mm512_permutexvar_ps(shift == 0 ? line : _mm512_srli_epi32(line, shift), table);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[r * NV + j] = _mm512_fmadd_ps(xb[r], wv, acc[r * NV + j]);
        }
      }
    }
    const at::BFloat16* s = sz + kg * 2 * kGroup;  // this layout group's scales, then zeros, of its 64 outputs
    __m512 scale[NV], offset[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      scale[j] = load_bf16(s + (V0 + j) * 16);
      offset[j] = _mm512_sub_ps(load_bf16(s + kGroup + (V0 + j) * 16), _mm512_mul_ps(_mm512_set1_ps(8.0f), scale[j]));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(xsum[r * groups + kg]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j)
        total[r * NV + j] =
            _mm512_fmadd_ps(xs, offset[j], _mm512_fmadd_ps(acc[r * NV + j], scale[j], total[r * NV + j]));
    }
  }
  store_tile<R>(total, n0, N, bias, y);
}

// Rows per tile, and vectors of 16 outputs per tile of R rows: all four up to 4 rows, else two (8 rows x 2
// vectors: 16 accumulators, 16 totals). Against tiles of at most 4 rows (two vectors past 2 rows) on a
// 2-core Ice Lake Xeon: 0.87x the time at 5 rows, 0.92-0.94x at 3-4, 0.97-0.99x at 1-2 and 8-16
// (BENCHMARKS.md "forty-fifth pass"). Each output's FMA chain is the same whatever its tile.
constexpr int kLaneTileRows = 8;
constexpr int lane_vectors(int64_t R) { return R <= 4 ? 4 : 2; }

// Tiles of R rows from vector V0 of layout group g on, NV vectors each; `ahead(pass)` what a pass prefetches.
template <int R, int NV, int V0, typename out_t, typename Ahead>
inline void lane_tiles_from(const float* x, const float* xsum, const int32_t* wgroup, int64_t K, int64_t group,
                            const at::BFloat16* sz, int64_t g, int64_t N, const float* bias, out_t* y, int64_t& pass,
                            const Ahead& ahead) {
  if (g * kGroup + V0 * 16 >= N) return;
  lane_tile<R, NV, V0>(x, xsum, wgroup, K, group, sz, g * kGroup + V0 * 16, N, bias, y, ahead(pass++));
  if constexpr (V0 + NV < 4) lane_tiles_from<R, NV, V0 + NV>(x, xsum, wgroup, K, group, sz, g, N, bias, y, pass, ahead);
}

template <typename out_t>
void lane_gemm_rows(const float* x, int64_t M, const int32_t* packed, const at::BFloat16* scale_zeros, int64_t N,
                    int64_t K, int64_t group, const float* bias, out_t* y) {
  const int64_t groups = K / group, layout_groups = (N + kGroup - 1) / kGroup, group_words = K * 8;
  int64_t passes = 0;  // tiles over a layout group's weights
  for (int64_t m = 0; m < M; m += kLaneTileRows) passes += 4 / lane_vectors(std::min<int64_t>(M - m, kLaneTileRows));
  const std::vector<float> xsum = group_sums(x, M, K, group);
  at::parallel_for(0, layout_groups, 1, [&](int64_t begin, int64_t end) {
    const int32_t* range_end = packed + end * group_words;
    for (int64_t g = begin; g < end; ++g) {
      const int32_t* wgroup = packed + g * group_words;
      const int32_t* next = g + 1 < end ? wgroup + group_words : nullptr;
      const at::BFloat16* sz = scale_zeros + g * groups * 2 * kGroup;
      // One pass (1-2 rows) streams ahead of its reads (a line a step); more split the next group.
      auto ahead = [&](int64_t pass) {
        return passes == 1 ? lines_ahead::stream(wgroup, range_end, 1)
                           : lines_ahead::share(next, group_words * 4, passes, K / 2, pass);
      };
      int64_t pass = 0;
      for (int64_t m = 0; m < M; m += kLaneTileRows) {
        const float* xm = x + m * K;
        const float* sm = xsum.data() + m * groups;
        out_t* ym = y + m * N;
        with_rows<kLaneTileRows>(M - m, [&](auto R) {
          lane_tiles_from<R(), lane_vectors(R()), 0>(xm, sm, wgroup, K, group, sz, g, N, bias, ym, pass, ahead);
        });
      }
    }
  });
}
#else
constexpr bool kLaneKernel = false;
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// bf16 activations on a CPU with AVX-512 BF16 (and VBMI): the pair layout [ceil(N / 64), K / 2, 64] bytes,
// one 64-byte line per input pair p holding each of the group's 64 outputs' q[2p] (low nibble) and
// q[2p + 1] (high), ordered so that 64-bit lane m of the line holds outputs 2m and 2m + 1 of each of its
// four vectors of 16 outputs (byte 8 m + 2 j + i: output 16 j + 2 m + i). One load of the line, then
// per vector one vpmultishiftqb picks each output's two nibbles into bytes 0 and 2 of its 32-bit lane,
// and one vpternlogq masks them and ors in 0x43 as the high bytes: bf16 0x43q = 128 + q, exact. So a
// row's sum over a group is sum x (q + 128), from which 136 * xsum is taken (sum x (q - 8)) before the
// group's scale and zero are applied: acc * s + xsum * z. Every product is exact in fp32 (bf16 x times
// an 8-bit integer); the sums are fp32. Scales and zeros are bf16 (they are bf16 values by construction,
// models/quant.py), [ceil(N / 64), K / group, 2, 64]: 1 bit per weight at groups of 32, where fp32
// scales and offsets read 2 (a third of the bytes at one row, where this kernel streams ~30-37 GB/s).
// Why: the AVX2 path widens each weight to fp32 and multiplies with FMAs, compute-bound at about
// 12 GB/s of int4 weights on a 2-core AVX-512 EPYC (a 1B model decoded at 0.47x llama.cpp's Q4_0).
constexpr bool kPairKernel = true;

// Tiles: R rows x NV vectors of 16 outputs, vectors j0 .. j0 + NV - 1 of a layout group (first output n0).
template <int R, int NV, typename out_t>
inline void pair_tile(const at::BFloat16* x, const float* xsum, const uint8_t* w, int64_t K, int64_t group,
                      const at::BFloat16* sz, int j0, int64_t n0, int64_t N, const float* bias, out_t* y) {
  // Vector j's pick: bytes 0, 2, 4, 6 of each 64-bit lane take the line's bits 16 j + 0, 4, 8, 12.
  __m512i picks[NV];
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j) {
    uint64_t control = 0;
    for (int b = 0; b < 4; ++b) control |= static_cast<uint64_t>(16 * (j0 + j) + 4 * b) << (16 * b);
    picks[j] = _mm512_set1_epi64(static_cast<int64_t>(control));
  }
  const __m512i low4 = _mm512_set1_epi64(static_cast<int64_t>(0x000F000F000F000FULL));
  const __m512i high = _mm512_set1_epi64(static_cast<int64_t>(0x4300430043004300ULL));
  const int64_t groups = K / group, pairs_per_group = group / 2;
  __m512 total[R * NV];
  zero_all(total);
  for (int64_t kg = 0; kg < groups; ++kg) {
    __m512 acc[R * NV];
    zero_all(acc);
    for (int64_t p = kg * pairs_per_group; p < (kg + 1) * pairs_per_group; ++p) {
      const __m512i line = _mm512_loadu_si512(w + p * 64);
      __m512bh wv[NV];
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j)  // (picked nibbles & low4) | high
        wv[j] = (__m512bh)_mm512_ternarylogic_epi64(_mm512_multishift_epi64_epi8(picks[j], line), low4, high, 0xEA);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * K + 2 * p, sizeof(pair));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) acc[r * NV + j] = _mm512_dpbf16_ps(acc[r * NV + j], xv, wv[j]);
      }
    }
    const at::BFloat16* s = sz + kg * 2 * kGroup;  // this layout group's scales, then zeros, of its 64 outputs
    __m512 scale[NV], zero[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) scale[j] = load_bf16(s + (j0 + j) * 16), zero[j] = load_bf16(s + kGroup + (j0 + j) * 16);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const float xs = xsum[r * groups + kg];
      const __m512 xsv = _mm512_set1_ps(xs), lifted = _mm512_set1_ps(-136.0f * xs);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) {
        const __m512 sums = _mm512_add_ps(acc[r * NV + j], lifted);  // sum x (q - 8)
        total[r * NV + j] = _mm512_fmadd_ps(xsv, zero[j], _mm512_fmadd_ps(sums, scale[j], total[r * NV + j]));
      }
    }
  }
  store_tile<R>(total, n0, N, bias, y);
}

template <int R>
inline void pair_group_rows(const at::BFloat16* x, const float* xsum, const uint8_t* wgroup, int64_t K,
                            int64_t group, const at::BFloat16* sz, int64_t g, int64_t N, const float* bias, at::BFloat16* y) {
  constexpr int NV = R == 1 ? 4 : 2;  // accumulators and totals: 2 R NV of the 32 zmm registers
  for (int j = 0; j < kGroup / 16; j += NV) {
    const int64_t n0 = g * kGroup + j * 16;
    if (n0 >= N) break;
    pair_tile<R, NV>(x, xsum, wgroup, K, group, sz, j, n0, N, bias, y);
  }
}

void pair_gemm_rows(const at::BFloat16* x, int64_t M, const uint8_t* packed, const at::BFloat16* scale_zeros, int64_t N,
                    int64_t K, int64_t group, const float* bias, at::BFloat16* y) {
  constexpr int kMaxPairRows = 6;
  const int64_t groups = K / group, layout_groups = (N + kGroup - 1) / kGroup;
  const std::vector<float> xsum = group_sums(x, M, K, group);
  at::parallel_for(0, layout_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* wgroup = packed + g * K * 32;
      const at::BFloat16* sz = scale_zeros + g * groups * 2 * kGroup;
      for (int64_t m = 0; m < M; m += kMaxPairRows) {
        const at::BFloat16* xm = x + m * K;
        const float* sm = xsum.data() + m * groups;
        at::BFloat16* ym = y + m * N;
        with_rows<kMaxPairRows>(M - m, [&](auto R) { pair_group_rows<R()>(xm, sm, wgroup, K, group, sz, g, N, bias, ym); });
      }
    }
  });
}
#else
constexpr bool kPairKernel = false;
#endif

}  // namespace

// x [M, K] bf16/fp16/fp32, packed [ceil(N/64), K, 32] uint8, scale_offsets [ceil(N/64), K/group, 2, 64]
// fp32 (scales, offsets), bias [N] fp32 or None -> y [M, N] in x's dtype. The lane layout (an AVX-512 CPU):
// packed [ceil(N/64), K/2, 16] int32, scale_offsets bf16 [ceil(N/64), K/group, 2, 64] (scales, zeros); the
// pair layout (x bf16, a CPU with AVX-512 BF16 and VBMI): packed [ceil(N/64), K/2, 64] uint8, bf16 ones.
torch::Tensor gemm_int4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_offsets,
                        const c10::optional<torch::Tensor>& bias, int64_t N, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && (packed.scalar_type() == at::kByte || packed.scalar_type() == at::kInt),
              "2-D input and uint8 (or int32) packed weights");
  const int64_t M = x.size(0), K = x.size(1), layout_groups = (N + kGroup - 1) / kGroup;
  TORCH_CHECK(group > 0 && K % group == 0, "the input size is a multiple of the group size");
  const Layout layout = layout_of(packed);
  const int64_t line = layout == Layout::kAvx2 ? 32 : layout == Layout::kPairs ? 64 : 16;
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == layout_groups &&
                  packed.size(1) * (layout == Layout::kAvx2 ? 1 : 2) == K && packed.size(2) == line,
              "weights are not in the packed layout [ceil(N / 64), K, 32] (or the lane layout [ceil(N / 64), "
              "K / 2, 16] int32, or the pair layout [ceil(N / 64), K / 2, 64])");
  TORCH_CHECK(layout != Layout::kPairs || (kPairKernel && x.scalar_type() == at::kBFloat16 && group % 2 == 0),
              "the pair layout takes bf16 activations on a CPU with AVX-512 BF16 and VBMI");
  TORCH_CHECK(layout != Layout::kLanes || (kLaneKernel && group % 2 == 0), "the lane layout needs a CPU with AVX-512");
  TORCH_CHECK(scale_offsets.scalar_type() == (layout == Layout::kAvx2 ? at::kFloat : at::kBFloat16) &&
                  scale_offsets.is_contiguous() && scale_offsets.numel() == layout_groups * (K / group) * 2 * kGroup,
              "fp32 scales and offsets [ceil(N / 64), K / group, 2, 64] (the lane and pair layouts: bf16 scales "
              "and zeros)");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "fp32 bias, one per output");
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto y = torch::empty({M, N}, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  if (layout == Layout::kPairs) {
    const auto xc = x.contiguous();
    pair_gemm_rows(xc.data_ptr<at::BFloat16>(), M, packed.data_ptr<uint8_t>(), scale_offsets.data_ptr<at::BFloat16>(),
                   N, K, group, b, y.data_ptr<at::BFloat16>());
    return y;
  }
#endif
  auto xf = x.to(at::kFloat).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gemm_int4", [&] {
#if defined(__AVX512F__)
    if (layout == Layout::kLanes)
      return lane_gemm_rows<scalar_t>(xf.data_ptr<float>(), M, packed.data_ptr<int32_t>(),
                                      scale_offsets.data_ptr<at::BFloat16>(), N, K, group, b, y.data_ptr<scalar_t>());
#endif
    gemm_rows<scalar_t>(xf.data_ptr<float>(), M, packed.data_ptr<uint8_t>(), scale_offsets.data_ptr<float>(), N, K,
                        group, b, y.data_ptr<scalar_t>());
  });
  return y;
}

// An int4 layer's whole matmul, x [..., K] -> [..., N]: up to `few_upto` rows this kernel, beyond them
// the dense dequantised weight (float32 activations: at::linear) or PyTorch's int4 kernel (bf16/fp16:
// qweight in its packed layout, qscales its scales and zeros); `bias` in x's dtype serves those two.
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_offsets,
                          const c10::optional<torch::Tensor>& few_bias, int64_t N, int64_t group, int64_t few_upto,
                          const c10::optional<torch::Tensor>& dense, const c10::optional<torch::Tensor>& qweight,
                          const c10::optional<torch::Tensor>& qscales, const c10::optional<torch::Tensor>& bias) {
  const int64_t K = x.size(-1), rows = K == 0 ? 0 : x.numel() / K;
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  // The pair layout serves bf16 activations only (a layer attached for them, called with others, falls back).
  const bool served = layout_of(packed) != Layout::kPairs || x.scalar_type() == at::kBFloat16;
  if (rows <= few_upto && served)
    return gemm_int4(x.reshape({rows, K}), packed, scale_offsets, few_bias, N, group).view(out_shape);
  if (dense.has_value()) return at::linear(x, *dense, bias);
  TORCH_CHECK(qweight.has_value() && qscales.has_value(), "int4_linear: wider than few_upto and no fallback weight");
  auto out = at::_weight_int4pack_mm_for_cpu(x.reshape({rows, K}), *qweight, group, *qscales).view(out_shape);
  return bias.has_value() ? out + *bias : out;
}

TORCH_LIBRARY(specdecode_int4, m) {
  m.def("gemm_int4(Tensor x, Tensor packed, Tensor scale_offsets, Tensor? bias, int out_features, int group) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scale_offsets, Tensor? few_bias, int out_features, int group, "
        "int few_upto, Tensor? dense, Tensor? qweight, Tensor? qscales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode_int4, CPU, m) {
  m.impl("gemm_int4", &gemm_int4);
  m.impl("int4_linear", &int4_linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The ops are registered with the dispatcher above (torch.ops.specdecode_int4).
  m.def("pair_kernel", [] { return kPairKernel; }, "whether this build has the bf16 pair-layout kernel");
  m.def("lane_kernel", [] { return kLaneKernel; }, "whether this build has the AVX-512 lane-layout kernel");
}
