// Matmuls with int8 activations (CPU, AVX-512 VNNI): activations quantised to int8 per row and block of
// 32 inputs (s_x = max |x| over the block / 127, xq = round(x / s_x): llama.cpp's Q8_0 activations) times
//   w8a8: int8 weights per output channel,  y[m, n] = s_w[n] * sum_b s_x[m, b] * P[m, n, b] (+ bias[n]),
//         P = sum over block b of xq * q (int32, exact);
//   w4a8: int4 weights in groups of 32 (w = (q - 8) * s + z, q in [0, 15], s and z bf16 per output and group),
//         y[m, n] = sum_b s_x[m, b] * ((P - 8 X) * s[n, b] + z[n, b] * X) (+ bias[n]), X = the block's code sum,
// at every width (decode, drafting, verification, prefill).
//
// Why: with bf16 activations every weight-only kernel issues one `vdpbf16ps` (32 multiply-adds) per
// 32 weights and row, so verifying 5-9 tokens on an int8/int4 target costs what it does in bf16 while
// one token costs less: speculation's ratio shrinks. `vpdpbusd` does 64 int8 multiply-adds an
// instruction on bytes as stored (int4: a nibble mask), so a row costs half, and the weights stream
// once per tile of rows.
//
// Layouts: w8a8 weights as unsigned bytes q + 128, [ceil(N / 16), K / 4, 16, 4]: one 64-byte line per 16
// outputs and 4 inputs, the operand `vpdpbusd` takes (unsigned x signed); the +128 comes back out as
// -128 * X, the value each block's int32 sums start from. w4a8 weights [ceil(N / 16), K / 8, 16, 4]
// bytes, low nibbles the line of inputs 8t .. 8t + 3, high nibbles 8t + 4 .. 8t + 7 (q unsigned as is;
// the sums start from -8 X), scales and zeros bf16 [ceil(N / 16), K / 32, 2, 16]. A tile of R rows x NB
// lines keeps R x NB int32 block sums and R x NB fp32 totals in registers.
//
// Exact by construction: P is an exact integer, and every output takes the same sequence of fp32
// operations (per block, in input order: w8a8 one FMA; w4a8 a product and two FMAs) whatever tile and
// width it is computed in, so a row's output is bitwise the same alone, in a verify batch or in a
// prefill. kernels/gemm_a8_cpu.py `reference_w8a8` / `reference_w4a8` compute the same numbers with
// PyTorch ops.
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
constexpr int kMaxTileRows = 4;    // rows per tile (a wider step takes several)
// Lines per tile of a one-row call: one weight stream per tile, many tiles (measured on the default
// model's matmuls at one row: w4a8 0.77 -> 0.55 ms against the multi-row tiles, w8a8 0.98 -> 0.82;
// four lines a tile: 1.08 ms, w4a8).
constexpr int kOneRowTileLines = 1;

inline __m512 load_fp32(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_fp32(const at::BFloat16* p) {  // 16 bf16 values as fp32 (exact: a 16-bit shift)
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// One row of x [K] -> its codes xq [K] (int8), block scales sx [K / 32] and the blocks' code sums
// codesum [K / 32]. Division (not a reciprocal) and round-to-nearest-
// even, as the reference's `x / s_x` and `torch.round`; an all-zero block gets scale 1 (codes 0).
template <typename in_t>
inline void quantize_row(const in_t* x, int64_t K, int8_t* xq, float* sx, int32_t* codesum) {
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
  static int64_t line_bytes(int64_t K) { return K * kLine; }

  template <int R, int NB, typename out_t>
  static void tile(const Rows& rows, const uint8_t* w, const void* params, int64_t line0, int64_t N, const float* bias,
                   out_t* y) {
    const float* scales = static_cast<const float*>(params);
    const int64_t K = rows.K, blocks = rows.blocks, lb = line_bytes(K);
    const uint8_t* wl = w + line0 * lb;
    __m512 total[R * NB];
#pragma GCC unroll 12
    for (int i = 0; i < R * NB; ++i) total[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
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
  static int64_t line_bytes(int64_t K) { return K * kLine / 2; }

  template <int R, int NB, typename out_t>
  static void tile(const Rows& rows, const uint8_t* w, const void* params, int64_t line0, int64_t N, const float* bias,
                   out_t* y) {
    const at::BFloat16* scale_zeros = static_cast<const at::BFloat16*>(params);
    const int64_t K = rows.K, blocks = rows.blocks, lb = line_bytes(K);
    const uint8_t* wl = w + line0 * lb;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 total[R * NB];
#pragma GCC unroll 8
    for (int i = 0; i < R * NB; ++i) total[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
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
        scale[j] = load_fp32(sz);
        zero[j] = load_fp32(sz + kLine);
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
                       const float* bias, out_t* y) {
  if constexpr (F::kTileLines >= 3) {
    if (NB == 3) return F::template tile<R, 3>(rows, w, params, line0, N, bias, y);
  }
  if (NB == 2) return F::template tile<R, 2>(rows, w, params, line0, N, bias, y);
  F::template tile<R, 1>(rows, w, params, line0, N, bias, y);
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
  const int64_t tile_lines_count = M == 1 ? kOneRowTileLines : F::kTileLines;
  const int64_t tiles = (lines + tile_lines_count - 1) / tile_lines_count;
  // Each thread takes whole column tiles and runs every row tile on them: a tile's weights are read
  // from memory once and from L1/L2 for the row tiles after the first.
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t line0 = t * tile_lines_count;
      const int NB = static_cast<int>(std::min<int64_t>(tile_lines_count, lines - line0));
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTileRows) {
        const int R = static_cast<int>(std::min<int64_t>(kMaxTileRows, M - m0));
        const Rows rows{xq.data() + m0 * K, sx.data() + m0 * blocks, codesum.data() + m0 * blocks, K, blocks};
        out_t* yr = y + m0 * N;
        switch (R) {
          case 1: tile_lines<F, 1>(NB, rows, w, params, line0, N, bias, yr); break;
          case 2: tile_lines<F, 2>(NB, rows, w, params, line0, N, bias, yr); break;
          case 3: tile_lines<F, 3>(NB, rows, w, params, line0, N, bias, yr); break;
          default: tile_lines<F, 4>(NB, rows, w, params, line0, N, bias, yr); break;
        }
      }
    }
  });
}

// The checks and the call both ops share: x [..., K] (fp32 / bf16) -> [..., N] in x's dtype.
template <typename F>
torch::Tensor linear(const char* name, const torch::Tensor& x, const torch::Tensor& packed, int64_t inputs_per_row,
                     const void* params, const std::optional<torch::Tensor>& bias, int64_t out_features) {
  const int64_t K = x.size(-1), N = out_features, lines = (N + kLine - 1) / kLine;
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), name,
              ": CPU float32 or bfloat16 activations, got ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(K % kBlock == 0, name, ": the input size must be a multiple of ", kBlock, ", got ", K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == lines && packed.size(1) == K / inputs_per_row && packed.size(2) == kLine &&
                  packed.size(3) == 4,
              name, ": packed weight of shape [", lines, ", ", K / inputs_per_row, ", 16, 4] uint8 expected, got ",
              packed.sizes(), " ", packed.scalar_type());
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == lines * kLine, name,
                ": fp32 bias padded to ", lines * kLine, " expected");
  const torch::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (M > 0) {
    if (x.scalar_type() == at::kFloat)
      gemm<F>(rows.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(), params, N, b, y.data_ptr<float>());
    else
      gemm<F>(rows.data_ptr<at::BFloat16>(), M, K, packed.data_ptr<uint8_t>(), params, N, b,
              y.data_ptr<at::BFloat16>());
  }
  return y.view(out_shape);
}

// packed [ceil(N/16), K/4, 16, 4] uint8 (q + 128); scales, bias fp32 padded to ceil(N/16) * 16.
torch::Tensor w8a8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const std::optional<torch::Tensor>& bias, int64_t out_features) {
  const int64_t lines = (out_features + kLine - 1) / kLine;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == lines * kLine,
              "w8a8_linear: fp32 scales padded to ", lines * kLine, " expected");
  return linear<W8>("w8a8_linear", x, packed, 4, scales.data_ptr<float>(), bias, out_features);
}

// packed [ceil(N/16), K/8, 16, 4] uint8 (two nibbles a byte); scale_zeros bf16 [ceil(N/16), K/32, 2, 16];
// bias fp32 padded to ceil(N/16) * 16.
torch::Tensor w4a8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_zeros,
                          const std::optional<torch::Tensor>& bias, int64_t out_features) {
  const int64_t lines = (out_features + kLine - 1) / kLine, K = x.size(-1);
  TORCH_CHECK(scale_zeros.scalar_type() == at::kBFloat16 && scale_zeros.is_contiguous() &&
                  scale_zeros.numel() == lines * (K / kBlock) * 2 * kLine,
              "w4a8_linear: bf16 scales and zeros of shape [", lines, ", ", K / kBlock, ", 2, 16] expected");
  return linear<W4>("w4a8_linear", x, packed, 8, scale_zeros.data_ptr<at::BFloat16>(), bias, out_features);
}

}  // namespace

TORCH_LIBRARY(specdecode_a8, m) {
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int out_features) -> Tensor");
  m.def("w4a8_linear(Tensor x, Tensor packed, Tensor scale_zeros, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode_a8, CPU, m) {
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("w4a8_linear", &w4a8_linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
