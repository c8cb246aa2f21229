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

#include <optional>

#include "a8_gemm.h"

namespace {

using namespace a8_kernels;

// The checks and the call both ops share: x [..., K] (fp32 / bf16) -> [..., N] in x's dtype.
template <typename F>
torch::Tensor linear(const char* name, int bits, const torch::Tensor& x, const torch::Tensor& packed,
                     const torch::Tensor& params, const std::optional<torch::Tensor>& bias, int64_t out_features) {
  const int64_t K = x.size(-1), N = out_features;
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), name,
              ": CPU float32 or bfloat16 activations, got ", x.scalar_type(), " on ", x.device());
  check_layer(name, bits, packed, params, bias, N, K);
  const torch::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const void* p = params.data_ptr();
  if (M > 0) {
    if (x.scalar_type() == at::kFloat)
      gemm<F>(rows.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(), p, N, b, y.data_ptr<float>());
    else
      gemm<F>(rows.data_ptr<at::BFloat16>(), M, K, packed.data_ptr<uint8_t>(), p, N, b, y.data_ptr<at::BFloat16>());
  }
  return y.view(out_shape);
}

// packed [ceil(N/16), K/4, 16, 4] uint8 (q + 128); scales, bias fp32 padded to ceil(N/16) * 16.
torch::Tensor w8a8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const std::optional<torch::Tensor>& bias, int64_t out_features) {
  return linear<W8>("w8a8_linear", 8, x, packed, scales, bias, out_features);
}

// packed [ceil(N/16), K/8, 16, 4] uint8 (two nibbles a byte); scale_zeros bf16 [ceil(N/16), K/32, 2, 16];
// bias fp32 padded to ceil(N/16) * 16.
torch::Tensor w4a8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_zeros,
                          const std::optional<torch::Tensor>& bias, int64_t out_features) {
  return linear<W4>("w4a8_linear", 4, x, packed, scale_zeros, bias, out_features);
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
