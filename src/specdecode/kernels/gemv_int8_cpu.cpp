// Few-row int8 weight-only matmuls for decoding (CPU, AVX2 + FMA or AVX-512F):
// y[M, N] = (x[M, K] @ Q[N, K]^T) * s[N] for the 1-16 rows of a decode, drafting or verification step,
// Q int8 per output channel with scale s.
//
// Why: on an AVX2-only CPU (AMD EPYC, no AVX-512) PyTorch's `_weight_int8pack_mm` takes about
// 2.2 weights a cycle per core (the default model's 512 -> 8192 head: 311 us at one row, in cache);
// a decode step reads every weight once, so that rate, not memory, bounds it. Here the weights sit
// in a layout made at load time,
//   grouped [ceil(N / 64), K, 64]: for each input k, a group's 64 output channels are one 64-byte line,
// read front to back in one stream per group, groups split over threads. A tile of R rows x NB blocks
// of 8 outputs keeps R * NB fp32 accumulators (one ymm per row and block) in registers; each input
// widens NB x 8 int8 weights to fp32 (vpmovsxbd + vcvtdq2ps), broadcasts each row's x[k] and adds
// x[k] * w into every accumulator with one FMA (the "broadcast" form: no horizontal sums). The tiles,
// 1 x 8, 2 x 4, 3..6 x 2 (rows in tiles of 6), are sized so accumulators, weights and broadcasts fit
// the 16 ymm registers (a spilled accumulator measured 1.4x slower) while the FMAs outnumber the
// widenings: the default model's 25 matmuls measured 1.2x faster at 1 row and 1.4x at 5-6 rows than
// the earlier layout, which summed 8 inputs per lane and reduced lanes at the end.
//
// On an AVX-512 CPU a second form of the same computation takes a group's whole line for up to 6 rows
// (16-lane FMAs; below, `gemm_rows_avx512`): the same results, bit for bit.
//
// Each output is the sum over k in order (one FMA chain from zero), then times its scale, plus its
// bias, whatever tile it sits in, so a row's output does not depend on the rows beside it.
//
// The weights a thread reads next are prefetched into L2 (lines_ahead.h): a one-row call 16 KB ahead of
// its stream, which took 0.72-0.73x the time of none (the default model's and the 1B model's matmuls, in
// one process: the 1B model's int8 weights streamed at 17 GB/s, 23 with it); a call of several tiles splits
// the thread's next group between them.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "lines_ahead.h"

namespace {

using lines_ahead::LinesAhead;

constexpr int64_t kGroup = 64;  // output channels per group (one 64-byte line per input)
constexpr int kMaxTileRows = 6;  // rows per tile beyond which a step takes several tiles

inline __m256 widen(const int8_t* w) {  // 8 int8 -> 8 fp32 (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

// A tile's R rows of `width` sums (row r at sums + r * width) times their outputs' scales, plus the bias,
// as outputs n0 .. of y (row stride N): one piece of code for both vector forms, so they round alike.
template <typename out_t>
inline void store_scaled(const float* sums, int R, int64_t width, int64_t n0, int64_t N, const float* scales,
                         const float* bias, out_t* y) {
  const int64_t outputs = std::min<int64_t>(width, N - n0);
  for (int r = 0; r < R; ++r) {
    for (int64_t i = 0; i < outputs; ++i) {
      float v = sums[r * width + i] * scales[n0 + i];
      if (bias != nullptr) v += bias[n0 + i];
      y[r * N + n0 + i] = static_cast<out_t>(v);
    }
  }
}

// R rows (x fp32, row stride K) x NB blocks of 8 outputs from n0, w at the tile's first block in its
// group (stride kGroup per input); y row stride N.
template <int R, int NB, typename out_t>
inline void tile(const float* x, const int8_t* w, int64_t K, int64_t n0, int64_t N, const float* scales,
                 const float* bias, out_t* y, const LinesAhead& ahead) {
  __m256 acc[R * NB];
#pragma GCC unroll 16
  for (int i = 0; i < R * NB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k, w += kGroup) {
    if (ahead.first != nullptr) ahead.at(k);
    // Source order picks the live registers: widen first when NB <= R, else broadcast first.
    if constexpr (NB <= R) {
      __m256 wv[NB];
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) wv[j] = widen(w + j * 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) acc[r * NB + j] = _mm256_fmadd_ps(xb, wv[j], acc[r * NB + j]);
      }
    } else {
      __m256 xb[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) xb[r] = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        const __m256 wv = widen(w + j * 8);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r * NB + j] = _mm256_fmadd_ps(xb[r], wv, acc[r * NB + j]);
      }
    }
  }
  alignas(32) float sums[R * NB * 8];  // stored with fixed indices, so no accumulator lives in memory in the loop
#pragma GCC unroll 16
  for (int i = 0; i < R * NB; ++i) _mm256_store_ps(sums + i * 8, acc[i]);
  store_scaled(sums, R, NB * 8, n0, N, scales, bias, y);
}

constexpr int tile_blocks(int64_t R) { return R == 1 ? 8 : R == 2 ? 4 : 2; }  // NB of an R-row tile

// Tiles (passes over a group's weights) of an M-row call.
inline int64_t group_passes(int64_t M) {
  int64_t passes = 0;
  for (int64_t m = 0; m < M; m += kMaxTileRows)
    passes += kGroup / 8 / tile_blocks(std::min<int64_t>(M - m, kMaxTileRows));
  return passes;
}

// Every output of group g for R rows, tile by tile; `ahead(pass)` what the pass prefetches (`pass` counts on).
template <int R, typename out_t, typename Ahead>
inline void group_rows(const float* x, const int8_t* wgroup, int64_t K, int64_t g, int64_t N, const float* scales,
                       const float* bias, out_t* y, int64_t& pass, const Ahead& ahead) {
  constexpr int NB = tile_blocks(R);
  for (int64_t j = 0; j < kGroup / 8; j += NB) {
    const int64_t n0 = g * kGroup + j * 8;
    if (n0 >= N) break;
    tile<R, NB>(x, wgroup + j * 8, K, n0, N, scales, bias, y, ahead(pass++));
  }
}

template <typename out_t>
void gemm_rows_avx2(const float* x, int64_t M, const int8_t* wgrouped, int64_t N, int64_t K, const float* scales,
                    const float* bias, out_t* y) {
  const int64_t groups = (N + kGroup - 1) / kGroup, group_bytes = K * kGroup, passes = group_passes(M);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    const int8_t* range_end = wgrouped + end * group_bytes;
    for (int64_t g = begin; g < end; ++g) {
      const int8_t* wgroup = wgrouped + g * group_bytes;
      const int8_t* next = g + 1 < end ? wgroup + group_bytes : nullptr;
      // One pass (one row) streams ahead of its reads (a line a step); more split the next group.
      auto ahead = [&](int64_t pass) {
        return passes == 1 ? lines_ahead::stream(wgroup, range_end, 1)
                           : lines_ahead::share(next, group_bytes, passes, K, pass);
      };
      int64_t pass = 0;
      for (int64_t m = 0; m < M; m += kMaxTileRows) {
        const float* xm = x + m * K;
        out_t* ym = y + m * N;
        switch (std::min<int64_t>(M - m, kMaxTileRows)) {
          case 6: group_rows<6>(xm, wgroup, K, g, N, scales, bias, ym, pass, ahead); break;
          case 5: group_rows<5>(xm, wgroup, K, g, N, scales, bias, ym, pass, ahead); break;
          case 4: group_rows<4>(xm, wgroup, K, g, N, scales, bias, ym, pass, ahead); break;
          case 3: group_rows<3>(xm, wgroup, K, g, N, scales, bias, ym, pass, ahead); break;
          case 2: group_rows<2>(xm, wgroup, K, g, N, scales, bias, ym, pass, ahead); break;
          default: group_rows<1>(xm, wgroup, K, g, N, scales, bias, ym, pass, ahead); break;
        }
      }
    }
  });
}

#if defined(__AVX512F__)
// The AVX-512 form: a group's whole line of 64 outputs (4 zmm of 16) for up to 6 rows at once (24
// accumulators, the line's 4 widened vectors and a broadcast in 32 registers), so each group's weights are
// widened once per 6 rows where the AVX2 form widens them once per tile of 16-64 outputs; FMAs of 16 lanes.
// Each output's sum is the AVX2 form's FMA chain, then the same scaling: the same results, bit for bit.
constexpr int kWideRows = 6;

inline __m512 widen16(const int8_t* w) {  // 16 int8 -> 16 fp32 (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

template <int R, typename out_t>
inline void wide_tile(const float* x, const int8_t* w, int64_t K, int64_t n0, int64_t N, const float* scales,
                      const float* bias, out_t* y, const LinesAhead& ahead) {
  __m512 acc[R * 4];
#pragma GCC unroll 24
  for (int i = 0; i < R * 4; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k, w += kGroup) {
    if (ahead.first != nullptr) ahead.at(k);
    __m512 wv[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) wv[j] = widen16(w + j * 16);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r * 4 + j] = _mm512_fmadd_ps(xb, wv[j], acc[r * 4 + j]);
    }
  }
  alignas(64) float sums[R * kGroup];
#pragma GCC unroll 24
  for (int i = 0; i < R * 4; ++i) _mm512_store_ps(sums + i * 16, acc[i]);
  store_scaled(sums, R, kGroup, n0, N, scales, bias, y);
}

template <typename out_t>
void gemm_rows_avx512(const float* x, int64_t M, const int8_t* wgrouped, int64_t N, int64_t K, const float* scales,
                      const float* bias, out_t* y) {
  const int64_t groups = (N + kGroup - 1) / kGroup, group_bytes = K * kGroup;
  const int64_t passes = (M + kWideRows - 1) / kWideRows;  // tiles over a group's weights
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    const int8_t* range_end = wgrouped + end * group_bytes;
    for (int64_t g = begin; g < end; ++g) {
      const int8_t* wgroup = wgrouped + g * group_bytes;
      const int8_t* next = g + 1 < end ? wgroup + group_bytes : nullptr;
      for (int64_t m = 0, pass = 0; m < M; m += kWideRows, ++pass) {
        // One tile streams ahead of its reads (a line a step); more split the next group.
        const LinesAhead ahead = passes == 1 ? lines_ahead::stream(wgroup, range_end, 1)
                                             : lines_ahead::share(next, group_bytes, passes, K, pass);
        const float* xm = x + m * K;
        out_t* ym = y + m * N;
        const int64_t n0 = g * kGroup;
        switch (std::min<int64_t>(M - m, kWideRows)) {
          case 6: wide_tile<6>(xm, wgroup, K, n0, N, scales, bias, ym, ahead); break;
          case 5: wide_tile<5>(xm, wgroup, K, n0, N, scales, bias, ym, ahead); break;
          case 4: wide_tile<4>(xm, wgroup, K, n0, N, scales, bias, ym, ahead); break;
          case 3: wide_tile<3>(xm, wgroup, K, n0, N, scales, bias, ym, ahead); break;
          case 2: wide_tile<2>(xm, wgroup, K, n0, N, scales, bias, ym, ahead); break;
          default: wide_tile<1>(xm, wgroup, K, n0, N, scales, bias, ym, ahead); break;
        }
      }
    }
  });
}
#endif

// The widest vector form this build has (AVX-512F where the CPU has it), or the AVX2 one (`avx2`: what an
// AVX2-only CPU computes, the same numbers; tests and benchmarks).
template <typename out_t>
void gemm_rows(const float* x, int64_t M, const int8_t* wgrouped, int64_t N, int64_t K, const float* scales,
               const float* bias, out_t* y, bool avx2) {
#if defined(__AVX512F__)
  if (!avx2) return gemm_rows_avx512(x, M, wgrouped, N, K, scales, bias, y);
#endif
  gemm_rows_avx2(x, M, wgrouped, N, K, scales, bias, y);
}

}  // namespace

// x [M, K] bf16/fp16/fp32, w blocked int8, scales [N] fp32, bias [N] fp32 or None -> y [M, N] in x's dtype
torch::Tensor gemm_int8_with(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                             const c10::optional<torch::Tensor>& bias, int64_t N, bool avx2) {
  TORCH_CHECK(x.dim() == 2 && w.scalar_type() == at::kChar, "2-D input and int8 blocked weights");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "fp32 scales, one per output");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "fp32 bias, one per output");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.is_contiguous() && w.dim() == 3 && w.size(0) == (N + kGroup - 1) / kGroup && w.size(1) == K &&
                  w.size(2) == kGroup,
              "weights are not in the blocked layout [ceil(N / 64), K, 64]");
  auto xf = x.to(at::kFloat).contiguous();  // a few KB: widened once, not per weight
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto y = torch::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gemm_int8", [&] {
    gemm_rows<scalar_t>(xf.data_ptr<float>(), M, w.data_ptr<int8_t>(), N, K, scales.data_ptr<float>(), b,
                        y.data_ptr<scalar_t>(), avx2);
  });
  return y;
}

torch::Tensor gemm_int8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                        const c10::optional<torch::Tensor>& bias, int64_t N) {
  return gemm_int8_with(x, w, scales, bias, N, false);
}

// The AVX2 form on any CPU this build runs on (tests; benchmarks/few_row_kernel.py --kind int8's
// few_rows_avx2 column).
torch::Tensor gemm_int8_avx2(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                             const c10::optional<torch::Tensor>& bias, int64_t N) {
  return gemm_int8_with(x, w, scales, bias, N, true);
}

// An int8 layer's whole matmul, x [..., K] -> [..., N]: up to `few_upto` rows this kernel, beyond them
// the dense dequantised weight (float32 activations: at::linear) or PyTorch's int8 kernel (bf16/fp16:
// qweight [N, K] int8, qscales [N] in x's dtype); `bias` in x's dtype serves those two. A dispatcher op
// registered here, so a compiled graph calls it without Python (a Python custom op measured about 22 us
// of wrappers per call, more than the one-row matmul itself), and the width choice is no shape guard.
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& blocked, const torch::Tensor& few_scales,
                          const c10::optional<torch::Tensor>& few_bias, int64_t N, int64_t few_upto,
                          const c10::optional<torch::Tensor>& dense, const c10::optional<torch::Tensor>& qweight,
                          const c10::optional<torch::Tensor>& qscales, const c10::optional<torch::Tensor>& bias) {
  const int64_t K = x.size(-1), rows = K == 0 ? 0 : x.numel() / K;
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  if (rows <= few_upto) return gemm_int8(x.reshape({rows, K}), blocked, few_scales, few_bias, N).view(out_shape);
  if (dense.has_value()) return at::linear(x, *dense, bias);
  TORCH_CHECK(qweight.has_value() && qscales.has_value(), "int8_linear: wider than few_upto and no fallback weight");
  auto out = at::_weight_int8pack_mm(x.reshape({rows, K}), *qweight, *qscales).view(out_shape);
  return bias.has_value() ? out + *bias : out;
}

TORCH_LIBRARY(specdecode_int8, m) {
  m.def("gemm_int8(Tensor x, Tensor blocked, Tensor scales, Tensor? bias, int out_features) -> Tensor");
  m.def("gemm_int8_avx2(Tensor x, Tensor blocked, Tensor scales, Tensor? bias, int out_features) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor blocked, Tensor few_scales, Tensor? few_bias, int out_features, int few_upto, "
        "Tensor? dense, Tensor? qweight, Tensor? qscales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode_int8, CPU, m) {
  m.impl("gemm_int8", &gemm_int8);
  m.impl("gemm_int8_avx2", &gemm_int8_avx2);
  m.impl("int8_linear", &int8_linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Nothing here: the ops are registered with the dispatcher above (torch.ops.specdecode_int8).
}
