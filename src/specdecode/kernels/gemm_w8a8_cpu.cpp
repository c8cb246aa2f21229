// W8A8 matmuls (CPU, AVX-512 VNNI): int8 weights per output channel times activations quantised to
// int8 per row and block of 32 inputs, at every width (decode, drafting, verification, prefill):
//   y[m, n] = s_w[n] * sum_b s_x[m, b] * P[m, n, b] (+ bias[n]),  P = sum over block b of xq * q  (int32)
// with s_x = max |x| over the block / 127 and xq = round(x / s_x) (llama.cpp's Q8_0 activations).
//
// Why: with bf16 activations every weight-only kernel issues one `vdpbf16ps` (32 multiply-adds) per
// 32 weights and row, so verifying 5-9 tokens on an int8 target costs what it does in bf16 while one
// token costs less: speculation's ratio shrinks. `vpdpbusd` does 64 int8 multiply-adds an instruction
// on weights as stored (no widening), so a row costs half, and the weights stream once per tile of rows.
//
// Layout: weights as unsigned bytes q + 128, [ceil(N / 16), K / 4, 16, 4]: one 64-byte line per 16
// outputs and 4 inputs, the operand `vpdpbusd` takes (unsigned x signed); the +128 comes back out as
// -128 * (the block's sum of xq), the value each block's int32 accumulators start from. A tile of R rows
// x NB lines keeps R x NB int32 block sums and R x NB fp32 totals in registers; each finished block adds
// float(P) * s_x to the total with one FMA.
//
// Exact by construction: P is an exact integer, and every output takes the same sequence of fp32
// operations (one FMA per block in input order, then times s_w, or one FMA with the bias) whatever tile
// and width it is computed in, so a row's output is bitwise the same alone, in a verify batch or in a
// prefill. kernels/gemm_w8a8_cpu.py `reference` computes the same numbers with PyTorch ops.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;     // inputs sharing one activation scale
constexpr int64_t kLine = 16;      // outputs per 64-byte weight line (x 4 inputs)
constexpr int kMaxTileRows = 4;    // 4 rows x 3 lines: 12 int32 sums, 12 fp32 totals, 3 weights, 1 broadcast
constexpr int kTileLines = 3;

inline __m512 load_fp32(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_fp32(const at::BFloat16* p) {  // 16 bf16 values as fp32 (exact: a 16-bit shift)
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// One row of x [K] -> its codes xq [K] (int8), block scales sx [K / 32] and the blocks' start values
// start [K / 32] = -128 * (sum of the block's codes). Division (not a reciprocal) and round-to-nearest-
// even, as the reference's `x / s_x` and `torch.round`; an all-zero block gets scale 1 (codes 0).
template <typename in_t>
inline void quantize_row(const in_t* x, int64_t K, int8_t* xq, float* sx, int32_t* start) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m512 lo = load_fp32(x + b * kBlock), hi = load_fp32(x + b * kBlock + 16);
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
    start[b] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  }
}

// R rows x NB lines of 16 outputs from line `line0`: xq / sx / start hold the R rows (row strides K,
// K / 32, K / 32); scales and bias are padded to whole lines; y row stride N.
template <int R, int NB, typename out_t>
inline void tile(const int8_t* xq, const float* sx, const int32_t* start, int64_t K, const uint8_t* w, int64_t line0,
                 int64_t N, const float* scales, const float* bias, out_t* y) {
  const int64_t blocks = K / kBlock, line_bytes = K * kLine;
  const uint8_t* wl = w + line0 * line_bytes;
  __m512 total[R * NB];
#pragma GCC unroll 12
  for (int i = 0; i < R * NB; ++i) total[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i sum[R * NB];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i s0 = _mm512_set1_epi32(start[r * blocks + b]);
#pragma GCC unroll 3
      for (int j = 0; j < NB; ++j) sum[r * NB + j] = s0;
    }
    const uint8_t* wb = wl + b * kBlock * kLine;
#pragma GCC unroll 8
    for (int t = 0; t < kBlock / 4; ++t) {  // 4 inputs a step
      __m512i wv[NB];
#pragma GCC unroll 3
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(wb + j * line_bytes + t * 64);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * K + b * kBlock + t * 4, 4);
        const __m512i xb = _mm512_set1_epi32(four);
#pragma GCC unroll 3
        for (int j = 0; j < NB; ++j) sum[r * NB + j] = _mm512_dpbusd_epi32(sum[r * NB + j], wv[j], xb);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(sx[r * blocks + b]);
#pragma GCC unroll 3
      for (int j = 0; j < NB; ++j)
        total[r * NB + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r * NB + j]), s, total[r * NB + j]);
    }
  }
  alignas(64) float out[16];
  for (int j = 0; j < NB; ++j) {
    const int64_t n0 = (line0 + j) * kLine, outputs = std::min<int64_t>(kLine, N - n0);
    const __m512 sw = _mm512_loadu_ps(scales + n0);
    for (int r = 0; r < R; ++r) {
      const __m512 v = bias != nullptr ? _mm512_fmadd_ps(total[r * NB + j], sw, _mm512_loadu_ps(bias + n0))
                                       : _mm512_mul_ps(total[r * NB + j], sw);
      _mm512_store_ps(out, v);
      for (int64_t i = 0; i < outputs; ++i) y[r * N + n0 + i] = static_cast<out_t>(out[i]);
    }
  }
}

template <int R, typename out_t>
inline void tile_lines(int NB, const int8_t* xq, const float* sx, const int32_t* start, int64_t K, const uint8_t* w,
                       int64_t line0, int64_t N, const float* scales, const float* bias, out_t* y) {
  if (NB == 3) tile<R, 3>(xq, sx, start, K, w, line0, N, scales, bias, y);
  else if (NB == 2) tile<R, 2>(xq, sx, start, K, w, line0, N, scales, bias, y);
  else tile<R, 1>(xq, sx, start, K, w, line0, N, scales, bias, y);
}

template <typename in_t, typename out_t>
void gemm(const in_t* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* scales, const float* bias,
          out_t* y) {
  const int64_t blocks = K / kBlock, lines = (N + kLine - 1) / kLine;
  std::vector<int8_t> xq(M * K);
  std::vector<float> sx(M * blocks);
  std::vector<int32_t> start(M * blocks);
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, xq.data() + m * K, sx.data() + m * blocks, start.data() + m * blocks);
  const int64_t tiles = (lines + kTileLines - 1) / kTileLines;
  // Each thread takes whole column tiles and runs every row tile on them: a tile's weights (3 lines x K
  // x 16 bytes) are read from memory once and from L1/L2 for the row tiles after the first.
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t line0 = t * kTileLines;
      const int NB = static_cast<int>(std::min<int64_t>(kTileLines, lines - line0));
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTileRows) {
        const int R = static_cast<int>(std::min<int64_t>(kMaxTileRows, M - m0));
        const int8_t* q = xq.data() + m0 * K;
        const float* s = sx.data() + m0 * blocks;
        const int32_t* s0 = start.data() + m0 * blocks;
        out_t* yr = y + m0 * N;
        switch (R) {
          case 1: tile_lines<1>(NB, q, s, s0, K, w, line0, N, scales, bias, yr); break;
          case 2: tile_lines<2>(NB, q, s, s0, K, w, line0, N, scales, bias, yr); break;
          case 3: tile_lines<3>(NB, q, s, s0, K, w, line0, N, scales, bias, yr); break;
          default: tile_lines<4>(NB, q, s, s0, K, w, line0, N, scales, bias, yr); break;
        }
      }
    }
  });
}

// x [..., K] (fp32 / bf16) -> [..., N] in x's dtype. packed [ceil(N/16), K/4, 16, 4] uint8 (q + 128);
// scales, bias fp32 padded to ceil(N/16) * 16.
torch::Tensor w8a8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const std::optional<torch::Tensor>& bias, int64_t out_features) {
  const int64_t K = x.size(-1), N = out_features, lines = (N + kLine - 1) / kLine;
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "w8a8_linear: CPU float32 or bfloat16 activations, got ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(K % kBlock == 0, "w8a8_linear: the input size must be a multiple of ", kBlock, ", got ", K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == lines && packed.size(1) == K / 4 && packed.size(2) == kLine && packed.size(3) == 4,
              "w8a8_linear: packed weight of shape [", lines, ", ", K / 4, ", 16, 4] uint8 expected, got ",
              packed.sizes(), " ", packed.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == lines * kLine,
              "w8a8_linear: fp32 scales padded to ", lines * kLine, " expected");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == lines * kLine,
                "w8a8_linear: fp32 bias padded to ", lines * kLine, " expected");
  const torch::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (M > 0) {
    if (x.scalar_type() == at::kFloat)
      gemm(rows.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(), N, scales.data_ptr<float>(), b, y.data_ptr<float>());
    else
      gemm(rows.data_ptr<at::BFloat16>(), M, K, packed.data_ptr<uint8_t>(), N, scales.data_ptr<float>(), b,
           y.data_ptr<at::BFloat16>());
  }
  return y.view(out_shape);
}

}  // namespace

TORCH_LIBRARY(specdecode_w8a8, m) {
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode_w8a8, CPU, m) { m.impl("w8a8_linear", &w8a8_linear); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
