// The int8-activation matmul kernels (gemm_a8_cpu.cpp explains the formats and why): `gemm<W8>` and
// `gemm<W4>` on raw pointers. gemm_a8_cpu.cpp registers them as ops; decode_stack_cpu.cpp's lean path
// calls them directly, so both compute the same numbers (include this file only from sources built
// with the same flags).
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "fp32_lanes.h"
#include "lines_ahead.h"
#include "thread_team.h"

namespace a8_kernels {
namespace {

using lines_ahead::LinesAhead;

constexpr int64_t kBlock = 32;     // inputs sharing one activation scale
constexpr int64_t kLine = 16;      // outputs per 64-byte weight line (x 4 inputs)
// Rows per tile: a call's rows split as evenly as possible into tiles of at most 5 (5 -> 5, 6 -> 3 + 3,
// 7 -> 4 + 3, 8 -> 4 + 4, 9 -> 5 + 4). A 5-row tile is 2 lines wide (its sums and totals fill the
// registers). Measured one thread, gate_up of the default model: 5 rows w4a8 51.5 -> 46.5 us, w8a8
// 49.2 -> 39.2 (against 4 + 1); 6 rows as 3 + 3 w4a8 58.5 -> 56.2, w8a8 52.7 -> 48.3 (against 4 + 2);
// 6-row tiles spill.
constexpr int kMaxTileRows = 5;
constexpr int kFiveRowTileLines = 2;
// Lines per tile of a one-row call: one weight stream per tile, many tiles (measured on the default
// model's matmuls at one row: w4a8 0.77 -> 0.55 ms against the multi-row tiles, w8a8 0.98 -> 0.82;
// four lines a tile: 1.08 ms, w4a8).
constexpr int kOneRowTileLines = 1;

using fp32_lanes::load16;

// One row of x [K] -> its codes xq [K] (int8), block scales sx [K / 32] and the blocks' code sums
// codesum [K / 32]. Division (not a reciprocal) and round-to-nearest-
// even, as the reference's `x / s_x` and `torch.round`; an all-zero block gets scale 1 (codes 0).
template <typename in_t>
inline void quantize_row(const in_t* x, int64_t K, int8_t* xq, float* sx, int32_t* codesum) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m512 lo = load16(x + b * kBlock), hi = load16(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
    float s = amax / 127.0f;
    if (s == 0.0f) s = 1.0f;
    const __m512 sv = _mm512_set1_ps(s);
    const __m512i lim = _mm512_set1_epi32(127), neg = _mm512_set1_epi32(-127);
    const __m512i qlo = _mm512_max_epi32(neg, _mm512_min_epi32(lim, _mm512_cvt_roundps_epi32(
        _mm512_div_ps(lo, sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    const __m512i qhi = _mm512_max_epi32(neg, _mm512_min_epi32(lim, _mm512_cvt_roundps_epi32(
        _mm512_div_ps(hi, sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock + 16), _mm512_cvtsepi32_epi8(qhi));
    sx[b] = s;
    codesum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  }
}

// The quantised rows of one call: R rows from `m0` are at xq + m0 * K, sx + m0 * blocks, codesum + m0 * blocks.
struct Rows {
  const int8_t* xq;
  const float* sx;
  const int32_t* codesum;
  int64_t K, blocks;
};

// The end of a tile: lines j of `total` (R x NB, row-major) plus the bias as outputs of y (row stride N).
template <int R, int NB, typename out_t>
inline void store_tile(const __m512* total, int64_t line0, int64_t N, const float* bias, out_t* y) {
  alignas(64) float out[16];
  for (int j = 0; j < NB; ++j) {
    const int64_t n0 = (line0 + j) * kLine, outputs = std::min<int64_t>(kLine, N - n0);
    for (int r = 0; r < R; ++r) {
      const __m512 v = bias != nullptr ? _mm512_add_ps(total[r * NB + j], _mm512_loadu_ps(bias + n0)) : total[r * NB + j];
      _mm512_store_ps(out, v);
      for (int64_t i = 0; i < outputs; ++i) y[r * N + n0 + i] = static_cast<out_t>(out[i]);
    }
  }
}

// A block's R x NB int32 sums start at -offset * (the row's code sum over the block): the weights' offset
// (w8a8: 128, w4a8: 8) taken back out, so they end as sum xq * q for the signed weights.
template <int R, int NB>
inline void start_sums(__m512i* sum, const Rows& rows, int64_t b, int32_t offset) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512i s0 = _mm512_set1_epi32(-offset * rows.codesum[r * rows.blocks + b]);
#pragma GCC unroll 3
    for (int j = 0; j < NB; ++j) sum[r * NB + j] = s0;
  }
}

// w8a8: R rows x NB lines of 16 outputs from line `line0`. `scales` (per output) are padded to whole
// lines; the output is total * s_w, or one FMA with the bias.
struct W8 {
  static constexpr int kTileLines = 3;  // 4 rows x 3 lines: 12 int32 sums, 12 fp32 totals, 3 weights, 1 broadcast
  // Whether a call of 2-5 rows (one row tile, 2-3 lines wide) prefetches the next tile: it would issue as
  // many prefetches as weight loads, and took 1.03-1.14x the time without at 2-5 rows (the default model's
  // shapes; 0.85-0.97x from 8 rows, where the later row tiles compute from cache).
  static constexpr bool kPrefetchOneWideTile = false;
  static int64_t line_bytes(int64_t K) { return K * kLine; }

  template <int R, int NB, typename out_t>
  static void tile(const Rows& rows, const uint8_t* w, const void* params, int64_t line0, int64_t N, const float* bias,
                   out_t* y, const LinesAhead& ahead) {
    const float* scales = static_cast<const float*>(params);
    const int64_t K = rows.K, blocks = rows.blocks, lb = line_bytes(K);
    const uint8_t* wl = w + line0 * lb;
    __m512 total[R * NB];
#pragma GCC unroll 12
    for (int i = 0; i < R * NB; ++i) total[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      if (ahead.first != nullptr) ahead.at(b);
      __m512i sum[R * NB];
      start_sums<R, NB>(sum, rows, b, 128);
      const uint8_t* wb = wl + b * kBlock * kLine;
#pragma GCC unroll 8
      for (int t = 0; t < kBlock / 4; ++t) {  // 4 inputs a step
        __m512i wv[NB];
#pragma GCC unroll 3
        for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(wb + j * lb + t * 64);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, rows.xq + r * K + b * kBlock + t * 4, 4);
          const __m512i xb = _mm512_set1_epi32(four);
#pragma GCC unroll 3
          for (int j = 0; j < NB; ++j) sum[r * NB + j] = _mm512_dpbusd_epi32(sum[r * NB + j], wv[j], xb);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 sx = _mm512_set1_ps(rows.sx[r * blocks + b]);
#pragma GCC unroll 3
        for (int j = 0; j < NB; ++j)
          total[r * NB + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r * NB + j]), sx, total[r * NB + j]);
      }
    }
    for (int j = 0; j < NB; ++j) {
      const __m512 sw = _mm512_loadu_ps(scales + (line0 + j) * kLine);
      for (int r = 0; r < R; ++r) {
        // the bias enters by the same FMA at every width; store_tile then adds none
        total[r * NB + j] = bias != nullptr
                                ? _mm512_fmadd_ps(total[r * NB + j], sw, _mm512_loadu_ps(bias + (line0 + j) * kLine))
                                : _mm512_mul_ps(total[r * NB + j], sw);
      }
    }
    store_tile<R, NB>(total, line0, N, nullptr, y);
  }
};

// w4a8: the same tiles over nibbles; `params` the bf16 scales and zeros [lines, K / 32, 2, 16].
struct W4 {
  static constexpr int kTileLines = 2;  // 4 rows x 2 lines: 8 sums, 8 totals, 4 unpacked lines, 2 broadcasts
  static constexpr bool kPrefetchOneWideTile = true;  // 2-5 rows: 0.87-0.96x the time without
  static int64_t line_bytes(int64_t K) { return K * kLine / 2; }

  template <int R, int NB, typename out_t>
  static void tile(const Rows& rows, const uint8_t* w, const void* params, int64_t line0, int64_t N, const float* bias,
                   out_t* y, const LinesAhead& ahead) {
    const at::BFloat16* scale_zeros = static_cast<const at::BFloat16*>(params);
    const int64_t K = rows.K, blocks = rows.blocks, lb = line_bytes(K);
    const uint8_t* wl = w + line0 * lb;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 total[R * NB];
#pragma GCC unroll 12
    for (int i = 0; i < R * NB; ++i) total[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      if (ahead.first != nullptr) ahead.at(b);
      __m512i sum[R * NB];
      start_sums<R, NB>(sum, rows, b, 8);
      const uint8_t* wb = wl + b * kBlock * kLine / 2;
#pragma GCC unroll 4
      for (int t = 0; t < kBlock / 8; ++t) {  // 8 inputs a step: a packed line's low, then high nibbles
        __m512i lo[NB], hi[NB];
#pragma GCC unroll 2
        for (int j = 0; j < NB; ++j) {
          const __m512i packed = _mm512_loadu_si512(wb + j * lb + t * 64);
          lo[j] = _mm512_and_si512(packed, low4);
          hi[j] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          int32_t four_lo, four_hi;
          std::memcpy(&four_lo, rows.xq + r * K + b * kBlock + t * 8, 4);
          std::memcpy(&four_hi, rows.xq + r * K + b * kBlock + t * 8 + 4, 4);
          const __m512i xlo = _mm512_set1_epi32(four_lo), xhi = _mm512_set1_epi32(four_hi);
#pragma GCC unroll 2
          for (int j = 0; j < NB; ++j)
            sum[r * NB + j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum[r * NB + j], lo[j], xlo), hi[j], xhi);
        }
      }
      __m512 scale[NB], zero[NB];
#pragma GCC unroll 2
      for (int j = 0; j < NB; ++j) {
        const at::BFloat16* sz = scale_zeros + ((line0 + j) * blocks + b) * 2 * kLine;
        scale[j] = load16(sz);
        zero[j] = load16(sz + kLine);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 sx = _mm512_set1_ps(rows.sx[r * blocks + b]);
        const __m512 xsum = _mm512_set1_ps(static_cast<float>(rows.codesum[r * blocks + b]));
#pragma GCC unroll 2
        for (int j = 0; j < NB; ++j) {  // (P - 8 X) * s + z * X, then times s_x into the total
          const __m512 block = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r * NB + j]), scale[j], _mm512_mul_ps(zero[j], xsum));
          total[r * NB + j] = _mm512_fmadd_ps(block, sx, total[r * NB + j]);
        }
      }
    }
    store_tile<R, NB>(total, line0, N, bias, y);
  }
};

template <typename F, int R, typename out_t>
inline void tile_lines(int NB, const Rows& rows, const uint8_t* w, const void* params, int64_t line0, int64_t N,
                       const float* bias, out_t* y, const LinesAhead& ahead) {
  if constexpr (F::kTileLines >= 3 && R < 5) {
    if (NB == 3) return F::template tile<R, 3>(rows, w, params, line0, N, bias, y, ahead);
  }
  if (NB == 2) return F::template tile<R, 2>(rows, w, params, line0, N, bias, y, ahead);
  F::template tile<R, 1>(rows, w, params, line0, N, bias, y, ahead);
}

template <typename F, typename in_t, typename out_t>
void gemm(const in_t* x, int64_t M, int64_t K, const uint8_t* w, const void* params, int64_t N, const float* bias,
          out_t* y) {
  const int64_t blocks = K / kBlock, lines = (N + kLine - 1) / kLine;
  std::vector<int8_t> xq(M * K);
  std::vector<float> sx(M * blocks);
  std::vector<int32_t> codesum(M * blocks);
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x + m * K, K, xq.data() + m * K, sx.data() + m * blocks, codesum.data() + m * blocks);
  const int64_t row_tiles = (M + kMaxTileRows - 1) / kMaxTileRows;
  const int64_t rows_small = M / row_tiles, rows_large = rows_small + 1, large_tiles = M % row_tiles;
  const int64_t widest_tile = large_tiles > 0 ? rows_large : rows_small;
  const int64_t tile_lines_count = M == 1 ? kOneRowTileLines : widest_tile == 5 ? kFiveRowTileLines : F::kTileLines;
  const int64_t tiles = (lines + tile_lines_count - 1) / tile_lines_count;
  const int64_t line_bytes = F::line_bytes(K);
  const bool prefetch = M == 1 || row_tiles > 1 || F::kPrefetchOneWideTile;
  // Each thread takes whole column tiles and runs every row tile on them: a tile's weights are read
  // from memory once and from L1/L2 for the row tiles after the first, which all prefetch a share of
  // the thread's next column tile (lines_ahead.h; w8a8 calls of one wide row tile do not).
  thread_team::parallel_for(tiles, [&](thread_team::Claims& claims) {
    for (int64_t t = claims.next(); t >= 0; t = claims.next()) {
      const int64_t line0 = t * tile_lines_count, after = claims.ahead(), next0 = after * tile_lines_count;
      const int NB = static_cast<int>(std::min<int64_t>(tile_lines_count, lines - line0));
      const uint8_t* next = after >= 0 && prefetch ? w + next0 * line_bytes : nullptr;
      const int64_t next_bytes = std::min<int64_t>(tile_lines_count, lines - next0) * line_bytes;
      for (int64_t tile = 0, m0 = 0; tile < row_tiles; ++tile) {
        const LinesAhead ahead = lines_ahead::share(next, next_bytes, row_tiles, blocks, tile);
        const int R = static_cast<int>(tile < large_tiles ? rows_large : rows_small);
        const Rows rows{xq.data() + m0 * K, sx.data() + m0 * blocks, codesum.data() + m0 * blocks, K, blocks};
        out_t* yr = y + m0 * N;
        switch (R) {
          case 1: tile_lines<F, 1>(NB, rows, w, params, line0, N, bias, yr, ahead); break;
          case 2: tile_lines<F, 2>(NB, rows, w, params, line0, N, bias, yr, ahead); break;
          case 3: tile_lines<F, 3>(NB, rows, w, params, line0, N, bias, yr, ahead); break;
          case 4: tile_lines<F, 4>(NB, rows, w, params, line0, N, bias, yr, ahead); break;
          default: tile_lines<F, 5>(NB, rows, w, params, line0, N, bias, yr, ahead); break;
        }
        m0 += R;
      }
    }
  });
}

// The checks of a layer's tensors as gemm<W8> (bits 8) / gemm<W4> (bits 4) reads them for N outputs
// and K inputs: packed [ceil(N/16), K/4 (w8a8) or K/8 (w4a8), 16, 4] uint8; params fp32 scales padded
// to whole lines (w8a8) or bf16 scales and zeros [ceil(N/16), K/32, 2, 16] (w4a8); the bias (if any)
// fp32 padded to whole lines. The ops check them every call, the C++ stack once.
inline void check_layer(const char* name, int bits, const at::Tensor& packed, const at::Tensor& params,
                        const std::optional<at::Tensor>& bias, int64_t N, int64_t K) {
  const int64_t lines = (N + kLine - 1) / kLine, per_row = bits == 8 ? 4 : 8;
  TORCH_CHECK(K % kBlock == 0, name, ": the input size must be a multiple of ", kBlock, ", got ", K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == lines && packed.size(1) == K / per_row && packed.size(2) == kLine &&
                  packed.size(3) == 4,
              name, ": packed weight of shape [", lines, ", ", K / per_row, ", 16, 4] uint8 expected, got ",
              packed.sizes(), " ", packed.scalar_type());
  if (bits == 8) {
    TORCH_CHECK(params.scalar_type() == at::kFloat && params.is_contiguous() && params.numel() == lines * kLine,
                name, ": fp32 scales padded to ", lines * kLine, " expected");
  } else {
    TORCH_CHECK(params.scalar_type() == at::kBFloat16 && params.is_contiguous() &&
                    params.numel() == lines * (K / kBlock) * 2 * kLine,
                name, ": bf16 scales and zeros of shape [", lines, ", ", K / kBlock, ", 2, 16] expected");
  }
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == lines * kLine),
              name, ": fp32 bias padded to ", lines * kLine, " expected");
}

}  // namespace
}  // namespace a8_kernels
