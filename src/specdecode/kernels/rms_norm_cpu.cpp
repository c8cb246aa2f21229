// RMSNorm in one pass per row (CPU): y = dtype(w * dtype(x * rsqrt(mean(x^2) + eps))), the rounding
// steps of models/layers.py RMSNorm (normalise in float32, cast, scale in the dtype) in one call.
//
// Why: PyTorch runs that as five to seven ops (the float copy, rms_norm's own pow / mean / add /
// rsqrt / mul, the cast, the scale); for the one 512-wide row of a decode step they took 29 us in
// bf16 and 14 us in float32 on an AVX2-only AMD EPYC (measured), 13 times per forward of the
// default model.
// The rows' loop is rms_norm.h's (decode_stack_cpu.cpp calls it too).
#include <torch/extension.h>

#include "rms_norm.h"

using rms_kernels::rms_norm_rows;

// x [..., D] (any strides; copied when its rows are not contiguous), weight [D] in x's dtype -> y [..., D]
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight [D] for x [..., D]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and input dtypes differ");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto y = torch::empty_like(xc);
  const int64_t D = x.size(-1);
  const int64_t rows = D == 0 ? 0 : xc.numel() / D;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, D,
                            static_cast<float>(eps));
  });
  return y;
}

// Also a dispatcher op, for C++ callers (decode_stack_cpu.cpp); Python calls the function directly.
TORCH_LIBRARY(specdecode_norm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode_norm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (float32 statistics, the dtype's rounding steps)");
}
