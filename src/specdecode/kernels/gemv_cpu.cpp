// Few-row bf16 matmuls for decoding and verification (CPU, AVX-512 BF16): y[M, N] = x[M, K] @ W[N, K]^T
// for the 1-16 rows of a decode, drafting or verification step.
//
// One row multiplies every weight once, so its cost is reading the weights; a verification of R rows
// should cost about the same, since each weight read can serve all R rows. oneDNN's packed bf16 matmul
// read the default model's 25 layers in 1.6-1.8 ms at 1-5 rows and 2.2 at 9 here (2 threads, the layers
// in turn: weights from memory), where this kernel's first version (a dot product per output, reduced
// at the end) took 1.12 ms at one row but 1.97 / 2.96 at 2 / 5. This one: 1.37-1.49 ms at 1-4 rows,
// 1.71 at 8, 2.55 at 16, oneDNN 2.23-2.40 / 2.68 / 3.27 in the same run (benchmarks/few_row_kernel.py).
//
// This one is the broadcast form. Layout (made at load time): [ceil(N / 64), K / 2, 64, 2], the 64
// outputs of a group, two inputs each, contiguous per input pair (256 bytes), so a group is one
// front-to-back stream. A tile of R <= 6 rows x 64 outputs keeps R x 4 fp32 accumulators in zmm
// registers; for each input pair it loads the group's 4 weight vectors once and, per row, broadcasts
// the row's two inputs and multiplies them into the accumulators with vdpbf16ps (the pair's two
// products added to the fp32 sums). More rows take further tiles, which read the group's weights
// from L2. No horizontal reduction: lane n of an accumulator is output n's sum.
//
// Each row's outputs are the same chain of vdpbf16ps over the input pairs in order, whatever M is
// or which tile the row sits in, so a row's result does not depend on the rows beside it.
#include <torch/extension.h>

#include "bf16_gemm.h"

using bf16_kernels::check_blocked;
using bf16_kernels::gemm_rows;

// x [M, K] bf16, w blocked bf16, bias [N] bf16 or None -> y [M, N] bf16
torch::Tensor gemm_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                        int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 2-D input");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  check_blocked(w, N, K);
  auto y = torch::empty({M, N}, xc.options());
  const at::BFloat16* b = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  gemm_rows(xc.data_ptr<at::BFloat16>(), M, w.data_ptr<at::BFloat16>(), N, K, b, y.data_ptr<at::BFloat16>());
  return y;
}

// Registered with the dispatcher (torch.ops.specdecode_bf16.gemm_bf16): models/inference.py's PackedLinear
// and the C++ layer stack (decode_stack_cpu.cpp) call the same op.
TORCH_LIBRARY(specdecode_bf16, m) {
  m.def("gemm_bf16(Tensor x, Tensor blocked, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode_bf16, CPU, m) { m.impl("gemm_bf16", &gemm_bf16); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Nothing here: the op is registered with the dispatcher above (torch.ops.specdecode_bf16).
}
