// Few-row int8 weight-only matmuls for decoding (CPU, AVX2 + FMA): y[M, N] = (x[M, K] @ Q[N, K]^T) * s[N]
// for the 1-4 rows of a decode or drafting step, Q int8 per output channel with scale s.
//
// Why: on an AVX2-only CPU (AMD EPYC Zen 3, no AVX-512) PyTorch's `_weight_int8pack_mm` takes about
// 2.2 weights a cycle per core (the default model's 512 -> 8192 head: 311 us at one row, in cache);
// a decode step reads every weight once, so that rate, not memory, bounds it. Here the weights sit
// in a layout made at load time,
//   blocked [N / 8, K / 8, 8, 8]: 8 output channels' next 8 inputs are one 64-byte line,
// read front to back in one stream, split over threads by blocks of outputs. A block keeps R x J = 8
// fp32 accumulators (R <= 4 rows at a time, J = 8 / R outputs per pass; later passes read the block
// from L1/L2); each step sign-extends 8 int8 weights to fp32 (vpmovsxbd + vcvtdq2ps) and multiplies
// them into the accumulator with one FMA. The scale multiplies the finished sum.
//
// Every accumulator is reduced by the same tree wherever it sits, and each row's sums take the same
// sequence of operations whatever M is (rows of a group share only the weights' loads), so a row's
// output does not depend on its neighbours.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kBlockN = 8;  // output channels per block
constexpr int64_t kBlockK = 8;  // inputs per step (one ymm of fp32)
constexpr int64_t kMaxRows = 4;  // rows sharing one pass over a block's weights

// The lanes' sum by one fixed tree: (a0 + a4) + (a2 + a6) + ((a1 + a5) + (a3 + a7)).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline __m256 widen(const int8_t* w) {  // 8 int8 -> 8 fp32 (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

// Outputs [n0 + j0, n0 + j0 + J) of one block for R rows (x fp32, row stride K).
template <int R, int J, typename out_t>
inline void block_rows(const float* x, const int8_t* wblock, int64_t K, int64_t n0, int64_t j0, int64_t N,
                       const float* scales, const float* bias, out_t* y, int64_t ldy) {
  __m256 acc[R * J];
#pragma GCC unroll 8
  for (int i = 0; i < R * J; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t steps = K / kBlockK;
  for (int64_t s = 0; s < steps; ++s) {
    const int8_t* w = wblock + (s * kBlockN + j0) * kBlockK;
    __m256 xv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * K + s * kBlockK);
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) {
      const __m256 wv = widen(w + j * kBlockK);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r * J + j] = _mm256_fmadd_ps(xv[r], wv, acc[r * J + j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < J; ++j) {
      const int64_t n = n0 + j0 + j;
      if (n >= N) break;
      float v = hsum(acc[r * J + j]) * scales[n];
      if (bias != nullptr) v += bias[n];
      y[r * ldy + n] = static_cast<out_t>(v);
    }
  }
}

template <int R, typename out_t>
inline void block(const float* x, const int8_t* wblock, int64_t K, int64_t n0, int64_t N, const float* scales,
                  const float* bias, out_t* y, int64_t ldy) {
  constexpr int J = kBlockN / R;
  for (int64_t j0 = 0; j0 < kBlockN; j0 += J) block_rows<R, J>(x, wblock, K, n0, j0, N, scales, bias, y, ldy);
}

template <typename out_t>
void gemm_rows(const float* x, int64_t M, const int8_t* wblocked, int64_t N, int64_t K, const float* scales,
               const float* bias, out_t* y) {
  const int64_t blocks = (N + kBlockN - 1) / kBlockN;
  const int64_t block_elems = K * kBlockN;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int8_t* wblock = wblocked + b * block_elems;
      const int64_t n0 = b * kBlockN;
      int64_t m = 0;
      for (; m + kMaxRows <= M; m += kMaxRows) block<4>(x + m * K, wblock, K, n0, N, scales, bias, y + m * N, N);
      switch (M - m) {
        case 3:
          block<2>(x + m * K, wblock, K, n0, N, scales, bias, y + m * N, N);
          block<1>(x + (m + 2) * K, wblock, K, n0, N, scales, bias, y + (m + 2) * N, N);
          break;
        case 2: block<2>(x + m * K, wblock, K, n0, N, scales, bias, y + m * N, N); break;
        case 1: block<1>(x + m * K, wblock, K, n0, N, scales, bias, y + m * N, N); break;
        default: break;
      }
    }
  });
}

}  // namespace

// x [M, K] bf16/fp16/fp32, w blocked int8, scales [N] fp32, bias [N] fp32 or None -> y [M, N] in x's dtype
torch::Tensor gemm_int8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                        const c10::optional<torch::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && w.scalar_type() == at::kChar, "2-D input and int8 blocked weights");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "fp32 scales, one per output");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "fp32 bias, one per output");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlockK == 0 && w.is_contiguous() && w.dim() == 4 && w.size(0) == (N + kBlockN - 1) / kBlockN &&
                  w.size(1) == K / kBlockK && w.size(2) == kBlockN && w.size(3) == kBlockK,
              "weights are not in the blocked layout [ceil(N / 8), K / 8, 8, 8]");
  auto xf = x.to(at::kFloat).contiguous();  // a few KB: widened once, not per weight
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto y = torch::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gemm_int8", [&] {
    gemm_rows<scalar_t>(xf.data_ptr<float>(), M, w.data_ptr<int8_t>(), N, K, scales.data_ptr<float>(), b,
                        y.data_ptr<scalar_t>());
  });
  return y;
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
  m.def("int8_linear(Tensor x, Tensor blocked, Tensor few_scales, Tensor? few_bias, int out_features, int few_upto, "
        "Tensor? dense, Tensor? qweight, Tensor? qscales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode_int8, CPU, m) {
  m.impl("gemm_int8", &gemm_int8);
  m.impl("int8_linear", &int8_linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Nothing here: the ops are registered with the dispatcher above (torch.ops.specdecode_int8).
}
