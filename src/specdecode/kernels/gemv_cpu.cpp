// Few-row bf16 matmuls for decoding (CPU, AVX-512 BF16): y[M, N] = x[M, K] @ W[N, K]^T for the
// 1-2 rows of a decode or drafting step.
//
// One row multiplies every weight once, so the cost is reading the weights: oneDNN's packed bf16
// matmul reads them at 25-29 GB/s at one row here (2 threads, the default model's 25 layers
// in turn), where the caches give 50. This kernel streams them from a layout made at load time,
//   blocked [N / 16, K / 32, 16, 32]: 16 output channels' next 32 inputs are one contiguous 1 KB,
// so the matrix is read front to back in one stream, split over threads by blocks of outputs.
// A block keeps R x J = 16 fp32 accumulators in registers (R <= 4 rows at a time, J = 16 / R
// outputs per pass; later passes read the block from L1/L2), multiplies with vdpbf16ps (pairs of
// bf16 products summed into fp32) and reduces all 16 accumulators in one shuffle tree.
// Measured (BENCHMARKS.md): 1.08-1.34 ms against oneDNN's 1.52-1.76 at one row, 1.20-1.73 /
// 1.54-1.89 at two; from three rows on oneDNN (AMX or AVX-512 GEMM) is faster, so a served layer
// takes this kernel for eager forwards of 1-2 rows where its shape measured faster
// (models/inference.py attach_few_row_kernels).
//
// Each row's result is computed by the same instruction sequence whatever M is (the rows of a
// group only share the weights' loads), so a row's output does not depend on its neighbours.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kBlockN = 16;  // output channels per block
constexpr int64_t kBlockK = 32;  // inputs per step (one vdpbf16ps)
constexpr int64_t kMaxRows = 4;  // rows sharing one pass over a block's weights

// Sums of 16 vectors' lanes as one vector, lane i holding one vector's sum (`ReduceOrder` says
// which). Each vector's lanes are added in the same pattern wherever it sits among the 16, so a
// row's results do not depend on the rows reduced beside it.
inline __m512 reduce16x16(__m512 v[16]) {
  __m512 a[8], b[4], c[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // [v0.q0+v0.q2, v0.q1+v0.q3, v1.q0+v1.q2, v1.q1+v1.q3]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // four vectors' sums over quads
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // pairs within 128-bit lanes
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

// Which of the 16 vectors each lane of reduce16x16 holds, found once by reducing labelled vectors.
struct ReduceOrder {
  __m512i to_vector;  // permutation: lane i of the output = lane to_vector[i] of the reduction
  ReduceOrder() {
    __m512 v[16];
    for (int i = 0; i < 16; ++i) v[i] = _mm512_set1_ps(static_cast<float>(i) / 16.0f);
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, reduce16x16(v));
    alignas(64) int32_t perm[16];
    for (int lane = 0; lane < 16; ++lane) perm[static_cast<int>(lanes[lane] + 0.5f)] = lane;
    to_vector = _mm512_load_si512(perm);
  }
};

const ReduceOrder& reduce_order() {
  static const ReduceOrder order;
  return order;
}

// Outputs [n0, n0 + J) of one block for R rows, J = 16 / R (R = 3 takes J = 4 and pads): R x J
// accumulators over all K stay in registers, and one reduction gives all their sums. Blocks of
// 16 outputs take 16 / J passes; later passes read the block's weights from L1/L2, not memory.
template <int R, int J>
inline void block_rows(const at::BFloat16* x, int64_t ldx, const at::BFloat16* wblock, int64_t K, int64_t n0, int64_t j0,
                       int64_t N, const at::BFloat16* bias, at::BFloat16* y, int64_t ldy) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t steps = K / kBlockK;
  for (int64_t s = 0; s < steps; ++s) {
    const at::BFloat16* w = wblock + (s * kBlockN + j0) * kBlockK;
    __m512bh xv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      xv[r] = (__m512bh)_mm512_loadu_si512(x + r * ldx + s * kBlockK);
#pragma GCC unroll 16
    for (int j = 0; j < J; ++j) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * kBlockK);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r * J + j] = _mm512_dpbf16_ps(acc[r * J + j], xv[r], wv);
    }
  }
  alignas(64) float sums[16];  // sums[r * J + j]: row r, output n0 + j0 + j
  _mm512_store_ps(sums, _mm512_permutexvar_ps(reduce_order().to_vector, reduce16x16(acc)));
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < J; ++j) {
      const int64_t n = n0 + j0 + j;
      if (n >= N) break;
      float v = sums[r * J + j];
      if (bias != nullptr) v += static_cast<float>(bias[n]);
      y[r * ldy + n] = static_cast<at::BFloat16>(v);
    }
  }
}

// One block of 16 outputs for R rows, in passes of J outputs.
template <int R>
inline void block(const at::BFloat16* x, int64_t ldx, const at::BFloat16* wblock, int64_t K, int64_t n0, int64_t N,
                  const at::BFloat16* bias, at::BFloat16* y, int64_t ldy) {
  constexpr int J = R == 1 ? 16 : (R == 2 ? 8 : 4);
  for (int64_t j0 = 0; j0 < kBlockN; j0 += J)
    block_rows<R, J>(x, ldx, wblock, K, n0, j0, N, bias, y, ldy);
}

void gemm_rows(const at::BFloat16* x, int64_t M, const at::BFloat16* wblocked, int64_t N, int64_t K,
               const at::BFloat16* bias, at::BFloat16* y) {
  const int64_t blocks = (N + kBlockN - 1) / kBlockN;
  const int64_t block_elems = K * kBlockN;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const at::BFloat16* wblock = wblocked + b * block_elems;
      const int64_t n0 = b * kBlockN;
      int64_t m = 0;
      for (; m + kMaxRows <= M; m += kMaxRows)
        block<4>(x + m * K, K, wblock, K, n0, N, bias, y + m * N, N);
      switch (M - m) {
        case 3: block<3>(x + m * K, K, wblock, K, n0, N, bias, y + m * N, N); break;
        case 2: block<2>(x + m * K, K, wblock, K, n0, N, bias, y + m * N, N); break;
        case 1: block<1>(x + m * K, K, wblock, K, n0, N, bias, y + m * N, N); break;
        default: break;
      }
    }
  });
}

void check_blocked(const torch::Tensor& w, int64_t N, int64_t K) {
  TORCH_CHECK(K % kBlockK == 0, "input size must be a multiple of ", kBlockK, ", got ", K);
  const int64_t blocks = (N + kBlockN - 1) / kBlockN;
  TORCH_CHECK(w.is_contiguous() && w.numel() == blocks * kBlockN * K, "weights are not in the blocked layout");
}

}  // namespace

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
