// bf16 weights, float32 activations (CPU, AVX-512F or AVX2 + FMA): y[M, N] = x[M, K] @ W[N, K]^T in float32 for
// checkpoints stored in bf16, served on CPUs without bf16 arithmetic (no AVX-512 BF16, no AMX), where
// `dtype="auto"` serves float32.
//
// Why: float32 serving reads each bf16 weight as 4 bytes. On a 2-core Intel Xeon without AVX-512 BF16,
// PyTorch's float32 matmuls read the default model's 25 layers (92 MB as float32) in 5.3 ms at one row,
// 17 GB/s. This kernel keeps the weights as bf16 (half the bytes) in the few-row bf16 kernel's blocked
// layout [ceil(N / 64), K / 2, 64, 2] and widens each to float32 on the fly: a bf16 value is the top half
// of its float32, so widening is a shift (the even input of a pair) or a mask (the odd one), exact.
// Products and sums are float32 FMAs, so the result is the float32 model's up to summation order.
//
// Each output's sum is one FMA chain over the inputs in order whatever M is or which row tile the row
// sits in, so a row's result does not depend on the rows beside it.
#include <torch/extension.h>

#include "bf16w_gemm.h"

namespace {

using GemmRows = void (*)(const float*, int64_t, const at::BFloat16*, int64_t, int64_t, const float*, float*);

// x [M, K] float32, w blocked bf16, bias [N] float32 or None -> y [M, N] float32, by `gemm_rows`.
torch::Tensor run(GemmRows gemm_rows, const torch::Tensor& x, const torch::Tensor& w,
                  const c10::optional<torch::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "bf16-weight matmul: 2-D float32 CPU input expected");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  bf16w_kernels::check_blocked(w, N, K);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "bf16-weight matmul: a float32 bias of ", N, " values expected");
  auto y = torch::empty({M, N}, xc.options());
  if (M > 0)
    gemm_rows(xc.data_ptr<float>(), M, w.data_ptr<at::BFloat16>(), N, K,
              bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

// The widest vector form this build has (AVX-512F where the CPU has it, else AVX2 + FMA).
torch::Tensor gemm_bf16w(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                         int64_t N) {
  return run(&bf16w_kernels::gemm_rows, x, w, bias, N);
}

// The AVX2 form on any CPU this build runs on: on AVX-512 CPUs, what an AVX2-only CPU computes (bit for bit
// the same numbers; tests, and benchmarks/few_row_kernel.py --kind bf16w's bf16w_avx2 column).
torch::Tensor gemm_bf16w_avx2(const torch::Tensor& x, const torch::Tensor& w,
                              const c10::optional<torch::Tensor>& bias, int64_t N) {
  return run(&bf16w_kernels::gemm_rows_with<bf16w_kernels::Avx2>, x, w, bias, N);
}

}  // namespace

// Registered with the dispatcher (torch.ops.specdecode_bf16w.gemm_bf16w): models/inference.py's
// Bf16WeightLinear and the C++ layer stack (decode_stack_cpu.cpp) call the same op.
TORCH_LIBRARY(specdecode_bf16w, m) {
  m.def("gemm_bf16w(Tensor x, Tensor blocked, Tensor? bias, int out_features) -> Tensor");
  m.def("gemm_bf16w_avx2(Tensor x, Tensor blocked, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode_bf16w, CPU, m) {
  m.impl("gemm_bf16w", &gemm_bf16w);
  m.impl("gemm_bf16w_avx2", &gemm_bf16w_avx2);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Nothing here: the op is registered with the dispatcher above (torch.ops.specdecode_bf16w).
}
