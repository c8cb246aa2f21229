// A Llama-family layer stack's cached forward as one C++ call (CPU, eager inference).
//
// Why: with int8 weights and float32 activations a decode token of the default model costs about
// 3.3 ms on a 2-core AVX2 EPYC, of which the 25 matmuls take ~0.9 ms and attention ~0.2 ms: the
// rest is Python around ~150 small ops a forward (module calls, views, splits, RoPE, cache writes).
// llama.cpp's whole token is ~1.2 ms there. This file runs the same ops, in the same order, on the
// same kernels, from C++: every aten op, the few-row ops (specdecode_int8::int8_linear, int4_linear), the W8A8
// ops (specdecode_a8::w8a8_linear, w4a8_linear) and the
// RMSNorm kernel (specdecode_norm::rms_norm) are called through PyTorch's dispatcher exactly as the
// Python modules call them, so the results are bit-identical to models/llama.py's forward, and a
// row's result still does not depend on the rows beside it wherever the Python path's did not.
//
// It serves what models/native_stack.py checks: standard attention (GQA, optional q/k norm and
// biases), a dense SwiGLU MLP, dense, packed bf16, int8, int4, w8a8 or w4a8 linear layers, any cached
// batch (contiguous cache rows writing the same columns by slices; a ragged one by index writes and,
// rows out of order, a gather), not exact mode.
//
// The lean path (`Stack::lean_forward`): where every linear layer is a w8a8 / w4a8 one or a bf16 one
// the few-row bf16 kernel takes at this width, and the cached attention kernel serves (one sequence,
// a decode or verification width), a layer calls the kernels' own functions (a8_gemm.h,
// bf16_gemm.h, cached_attention.h, rms_norm.h: the code their ops run, built with the same flags) on
// pointers into reused buffers, and does the views, cache writes, residual sums and
// the SwiGLU product in plain loops: ~75 aten calls a layer (views, slices, splits, allocations,
// the ops' own checks) become one (the SiLU, PyTorch's, for its exp). Same numbers, fewer calls:
// on the default model at W4A8 (2-core EPYC, alternating builds) a one-token forward measured
// 0.53-1.06 -> 0.30-0.40 ms, a 4-token one 0.97-1.46 -> 0.68-0.81 ms and an MTP drafting step
// 0.136-0.145 -> 0.100-0.115 ms (BENCHMARKS.md, fourteenth pass).
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kv_records.h"
#include "rms_norm.h"
// The lean path needs what the w8a8 / w4a8 kernels need (and the attention kernel's AVX2 + FMA).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX2__) && defined(__FMA__)
#define SPECDECODE_LEAN_PATH 1
#include "a8_gemm.h"
#include "bf16w_gemm.h"
#include "cached_attention.h"
#include "swiglu.h"
#else
#define SPECDECODE_LEAN_PATH 0
#endif
// Its bf16 layers call the few-row bf16 kernel (AVX-512 BF16).
#if SPECDECODE_LEAN_PATH && defined(__AVX512BF16__)
#define SPECDECODE_LEAN_BF16 1
#include "bf16_gemm.h"
#else
#define SPECDECODE_LEAN_BF16 0
#endif

namespace {

using OptTensor = std::optional<torch::Tensor>;

// sampling.py inverse_cdf's rule on q [n] (mass >= 0): the first index whose running float64 sum
// exceeds u * the total, kept below the total (which u * total may round up to); -1 where none does
// (a q of no mass). Sequential float64 sums, as torch's cumsum adds them, so the same index. The sums
// are one chain of dependent adds (~10 us for 8,192 tokens here): made once and kept, then searched.
int64_t first_above(const float* q, int64_t n, double u) {
  thread_local std::vector<double> cdf;
  cdf.resize(n);
  double running = 0.0;
  for (int64_t i = 0; i < n; ++i) cdf[i] = running += q[i];
  const double threshold = std::min(u * running, std::nextafter(running, 0.0));
  const auto above = std::upper_bound(cdf.begin(), cdf.end(), threshold);  // sorted: the mass is >= 0
  return above == cdf.end() ? -1 : above - cdf.begin();
}

// sampling.py inverse_cdf for float32 probs [N, V] and float64 u [N] -> int64 [N] (V - 1 for a row of
// no mass, as its clamped searchsorted): the same tokens without its eight tensor ops, which cost
// ~55 us a sampled token after a forward had left the caches cold.
torch::Tensor inverse_cdf_rows(const torch::Tensor& probs, const torch::Tensor& u) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_contiguous() && probs.device().is_cpu(),
              "inverse_cdf: contiguous float32 CPU probs [N, V]");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == at::kDouble && u.is_contiguous() && u.numel() == probs.size(0),
              "inverse_cdf: contiguous float64 u [N]");
  const int64_t N = probs.size(0), V = probs.size(1);
  auto out = torch::empty({N}, torch::TensorOptions().dtype(torch::kLong));
  const float* p = probs.data_ptr<float>();
  const double* draws = u.data_ptr<double>();
  int64_t* tokens = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) {
    const int64_t i = first_above(p + r * V, V, draws[r]);
    tokens[r] = i >= 0 ? i : V - 1;
  }
  return out;
}

// speculative/verify/chain.py _one_sampled_row's rule once p is computed: p [k + 1, V] and q [k, V]
// (none: one-hot drafts) float32, the row's drafts, u [k] float32 and u_final -> (accepted drafts,
// final token). Draft j is accepted while u[j] q[j, x_j] < p[j, x_j] (float32 products and compares,
// as the tensor ops make them); the final token is drawn by inverse CDF from max(0, p - q) at the
// rejected position (q one-hot: p without the drafted token) where that has mass (a positive sum, no
// NaN), else from p there. The same tokens as the ~15 tensor ops it replaces (~75 us after a forward).
std::pair<int64_t, int64_t> verify_sampled_row(const torch::Tensor& p, const OptTensor& q, const std::vector<int64_t>& drafts,
                                               int64_t num_draft, const torch::Tensor& u, double u_final) {
  TORCH_CHECK(p.dim() == 2 && p.scalar_type() == at::kFloat && p.is_contiguous() && p.device().is_cpu(),
              "verify_sampled_row: contiguous float32 CPU p [k + 1, V]");
  const int64_t V = p.size(1);
  TORCH_CHECK(num_draft >= 0 && num_draft < p.size(0) && static_cast<int64_t>(drafts.size()) >= num_draft,
              "verify_sampled_row: num_draft drafts and k + 1 rows of p");
  TORCH_CHECK(u.scalar_type() == at::kFloat && u.is_contiguous() && u.numel() >= num_draft, "verify_sampled_row: float32 u [k]");
  TORCH_CHECK(!q.has_value() || (q->scalar_type() == at::kFloat && q->is_contiguous() && q->dim() == 2 &&
                                 q->size(1) == V && q->size(0) >= num_draft),
              "verify_sampled_row: contiguous float32 q [k, V]");
  const float* pp = p.data_ptr<float>();
  const float* qq = q.has_value() ? q->data_ptr<float>() : nullptr;
  const float* uu = u.data_ptr<float>();
  int64_t accepted = 0;
  while (accepted < num_draft) {
    const int64_t x = drafts[accepted];
    TORCH_CHECK(x >= 0 && x < V, "verify_sampled_row: a draft outside the vocabulary");
    const float lhs = qq ? uu[accepted] * qq[accepted * V + x] : uu[accepted];
    if (!(lhs < pp[accepted * V + x])) break;
    ++accepted;
  }
  const float* dist = pp + accepted * V;
  thread_local std::vector<float> residual;
  if (accepted < num_draft) {
    const int64_t x = drafts[accepted];
    residual.resize(V);
    bool positive = false, nan = false;
    for (int64_t i = 0; i < V; ++i) {
      // max(p - q, 0), keeping a NaN as clamp_ does; q one-hot: p without the drafted token
      const float d = qq ? dist[i] - qq[accepted * V + i] : (i == x ? 0.0f : dist[i]);
      const float r = std::isnan(d) ? d : std::max(d, 0.0f);
      residual[i] = r;
      positive |= r > 0.0f;
      nan |= std::isnan(r);
    }
    if (positive && !nan) dist = residual.data();
  }
  const int64_t token = first_above(dist, V, u_final);
  return {accepted, token >= 0 ? token : V - 1};
}

// specdecode_int8::int8_linear (gemv_int8_cpu.cpp), looked up once: the op must be registered (its
// extension loaded) before the first stack is built.
at::Tensor int8_linear_op(const at::Tensor& x, const at::Tensor& blocked, const at::Tensor& few_scales,
                          const OptTensor& few_bias, int64_t N, int64_t few_upto, const OptTensor& dense,
                          const OptTensor& qweight, const OptTensor& qscales, const OptTensor& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("specdecode_int8::int8_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                                         int64_t, int64_t, const OptTensor&, const OptTensor&, const OptTensor&,
                                         const OptTensor&)>();
  return op.call(x, blocked, few_scales, few_bias, N, few_upto, dense, qweight, qscales, bias);
}

// specdecode_int4::int4_linear (gemv_int4_cpu.cpp), the same for int4 layers (its extension loaded first).
at::Tensor int4_linear_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_offsets,
                          const OptTensor& few_bias, int64_t N, int64_t group, int64_t few_upto, const OptTensor& dense,
                          const OptTensor& qweight, const OptTensor& qscales, const OptTensor& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("specdecode_int4::int4_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                                         int64_t, int64_t, int64_t, const OptTensor&, const OptTensor&,
                                         const OptTensor&, const OptTensor&)>();
  return op.call(x, packed, scale_offsets, few_bias, N, group, few_upto, dense, qweight, qscales, bias);
}

// specdecode_a8::w8a8_linear / w4a8_linear (gemm_a8_cpu.cpp), the int8-activation kernels (their extension
// loaded first); both take (x, packed weights, scales (w4a8: and zeros), bias, out features).
at::Tensor a8_linear_op(int weight_bits, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& params,
                        const OptTensor& bias, int64_t N) {
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t);
  static auto w8 = c10::Dispatcher::singleton().findSchemaOrThrow("specdecode_a8::w8a8_linear", "").typed<Signature>();
  static auto w4 = c10::Dispatcher::singleton().findSchemaOrThrow("specdecode_a8::w4a8_linear", "").typed<Signature>();
  return (weight_bits == 8 ? w8 : w4).call(x, packed, params, bias, N);
}

// specdecode_bf16::gemm_bf16 (gemv_cpu.cpp), the few-row bf16 kernel (its extension loaded first).
at::Tensor gemm_bf16_op(const at::Tensor& x, const at::Tensor& blocked, const OptTensor& bias, int64_t N) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("specdecode_bf16::gemm_bf16", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t)>();
  return op.call(x, blocked, bias, N);
}

// specdecode_bf16w::gemm_bf16w (gemv_bf16w_cpu.cpp), bf16 weights with float32 activations (its extension loaded
// first).
at::Tensor gemm_bf16w_op(const at::Tensor& x, const at::Tensor& blocked, const OptTensor& bias, int64_t N) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("specdecode_bf16w::gemm_bf16w", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t)>();
  return op.call(x, blocked, bias, N);
}

// mkldnn::_linear_pointwise, oneDNN's matmul on a pre-packed weight (models/inference.py PackedLinear).
at::Tensor packed_linear_op(const at::Tensor& x, const at::Tensor& packed, const OptTensor& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, c10::string_view,
                                         c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

// specdecode_norm::rms_norm (rms_norm_cpu.cpp), the kernel models/layers.py RMSNorm calls.
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("specdecode_norm::rms_norm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x, weight, eps);
}

// specdecode_attn::cached_attention (attention_cpu.cpp), the cached attention models/llama.py calls
// where that op is built.
at::Tensor cached_attention_op(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                               const OptTensor& mask, int64_t group) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("specdecode_attn::cached_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                                         int64_t)>();
  return op.call(q, keys, values, mask, group);
}

}  // namespace

// One linear layer as its Python module computes it: an int8 QuantizedLinear with its few-row
// kernel attached (the int8_linear op's arguments), an int4 QuantizedLinear with its few-row kernel
// attached (int4_linear's), a w8a8 / w4a8 QuantizedLinear (its op's), a PackedLinear (oneDNN's packed weight, and the few-row bf16 kernel's
// layout up to `few_upto` rows), a Bf16WeightLinear (bf16 weights in that layout, float32 activations, its
// op at every width), or a dense weight: an nn.Linear, a FusedLinear, a quantised
// layer's dequantised copy (at::linear).
struct Linear {
  int bits = 0;  // 0: dense; 8 or 4: the few-row op of that width; 16: packed bf16/fp16
  bool bf16_weights = false;  // a Bf16WeightLinear: `weight` bf16 in the blocked layout, `bias` float32
  int a8_bits = 0;  // 8 / 4: a w8a8 / w4a8 layer (its op at every width; `bits` unused)
  torch::Tensor weight;  // dense [N, K]; int8 / int4: the few-row kernel's weight layout; packed: oneDNN's
  OptTensor bias;        // dense, packed: the bias; int8 / int4: the bias in the activations' dtype (fallback paths)
  torch::Tensor few_scales;  // int8: scales; int4: scales and offsets; w8a8: scales; w4a8: scales and zeros
  OptTensor few_bias, dense, qweight, qscales;
  OptTensor few_blocked;  // packed: the few-row bf16 kernel's layout, served up to few_upto rows (or none)
  // int8 / int4: the dequantised weight as a packed layer, which forwards from wide_from rows on take
  // (QuantizedLinear.wide, verification widths)
  std::shared_ptr<const Linear> wide;
  int64_t out_features = 0, few_upto = 0, group = 0, wide_from = 0;
  int64_t in_features = 0;  // w8a8 / w4a8, packed with the few-row layout (the lean path's direct calls)

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (wide && x.numel() >= wide_from * x.size(-1)) return (*wide)(x);
    if (bf16_weights) {  // Bf16WeightLinear.forward: its op on the rows
      auto out_shape = x.sizes().vec();
      out_shape.back() = out_features;
#if SPECDECODE_LEAN_PATH
      // The kernel called directly where the op would only check and reshape: contiguous float32 rows.
      if (x.is_contiguous() && x.size(-1) == in_features && x.scalar_type() == at::kFloat && x.device().is_cpu()) {
        torch::Tensor y = torch::empty(out_shape, x.options());
        if (x.numel() > 0) direct(x.data_ptr<float>(), x.numel() / in_features, y.data_ptr<float>());
        return y;
      }
#endif
      return gemm_bf16w_op(x.reshape({-1, x.size(-1)}), weight, bias, out_features).view(out_shape);
    }
    if (bits == 16) {  // PackedLinear._matmul
      const int64_t K = x.size(-1);
      if (few_blocked.has_value() && x.numel() <= few_upto * K) {
        auto out_shape = x.sizes().vec();
        out_shape.back() = out_features;
#if SPECDECODE_LEAN_BF16
        // The kernel called directly where the op would only check and reshape: contiguous bf16 rows.
        at::ScalarType only = at::ScalarType::Undefined;
        if (x.is_contiguous() && K == in_features && x.scalar_type() == at::kBFloat16 && x.device().is_cpu() &&
            direct_rows(only) > 0) {
          torch::Tensor y = torch::empty(out_shape, x.options());
          if (x.numel() > 0) direct(x.data_ptr<at::BFloat16>(), x.numel() / K, y.data_ptr<at::BFloat16>());
          return y;
        }
#endif
        return gemm_bf16_op(x.reshape({-1, K}), *few_blocked, bias, out_features).view(out_shape);
      }
      return packed_linear_op(x, weight, bias);
    }
    if (a8_bits != 0) {
#if SPECDECODE_LEAN_PATH
      // The kernel called directly where the op would only check and reshape: contiguous rows.
      if (x.is_contiguous() && x.size(-1) == in_features && x.device().is_cpu() &&
          (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16)) {
        auto out_shape = x.sizes().vec();
        out_shape.back() = out_features;
        torch::Tensor y = torch::empty(out_shape, x.options());
        const int64_t M = x.numel() / in_features;
        if (M > 0) {
          if (x.scalar_type() == at::kFloat)
            a8(x.data_ptr<float>(), M, y.data_ptr<float>());
          else
            a8(x.data_ptr<at::BFloat16>(), M, y.data_ptr<at::BFloat16>());
        }
        return y;
      }
#endif
      return a8_linear_op(a8_bits, x, weight, few_scales, bias, out_features);
    }
    if (bits == 8)
      return int8_linear_op(x, weight, few_scales, few_bias, out_features, few_upto, dense, qweight, qscales, bias);
    if (bits == 4)
      return int4_linear_op(x, weight, few_scales, few_bias, out_features, group, few_upto, dense, qweight, qscales,
                            bias);
    return at::linear(x, weight, bias);
  }

#if SPECDECODE_LEAN_PATH
  // The most rows the lean path's direct calls (`direct`) serve: every row count for a w8a8 / w4a8
  // layer and for a bf16-weight one (float32 activations only), up to few_upto for a bf16 one with the
  // few-row kernel's layout (what its module takes there; every row count where `widened`: the stack's
  // measured lean width caps it; bf16 activations only), none otherwise. `only`: the one activation
  // dtype they serve, where one layer's kernel serves one (kUndefined: none said yet).
  int64_t direct_rows(at::ScalarType& only, bool widened = false) const {
    if (a8_bits != 0) return wide ? 0 : INT64_MAX;
    const auto restrict_to = [&only](at::ScalarType dtype) {
      const bool agrees = only == at::ScalarType::Undefined || only == dtype;
      only = dtype;
      return agrees;
    };
    if (bf16_weights) return restrict_to(at::kFloat) ? INT64_MAX : 0;
#if SPECDECODE_LEAN_BF16
    if (bits == 16 && few_blocked.has_value() && few_blocked->scalar_type() == at::kBFloat16 &&
        (!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous())))
      return restrict_to(at::kBFloat16) ? (widened ? INT64_MAX : few_upto) : 0;
#endif
    return 0;
  }

  // x [M, in_features] -> y [M, out_features] by the layer's kernel called directly (what its op
  // runs), for M within `direct_rows`.
  template <typename scalar_t>
  void direct(const scalar_t* x, int64_t M, scalar_t* y) const {
    if (a8_bits != 0) return a8(x, M, y);
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (bf16_weights) {
        const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
        return bf16w_kernels::gemm_rows(x, M, weight.data_ptr<at::BFloat16>(), out_features, in_features, b, y);
      }
    }
#if SPECDECODE_LEAN_BF16
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      const at::BFloat16* b = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
      return bf16_kernels::gemm_rows(x, M, few_blocked->data_ptr<at::BFloat16>(), out_features, in_features, b, y);
    }
#endif
    TORCH_CHECK(false, "Linear::direct: no direct kernel for this layer and dtype");
  }

  // A w8a8 / w4a8 layer's kernel called directly (what its op runs): x [M, in_features] -> y [M, out_features].
  template <typename scalar_t>
  void a8(const scalar_t* x, int64_t M, scalar_t* y) const {
    const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    const uint8_t* w = weight.data_ptr<uint8_t>();
    if (a8_bits == 8)
      a8_kernels::gemm<a8_kernels::W8>(x, M, in_features, w, few_scales.data_ptr<float>(), out_features, b, y);
    else
      a8_kernels::gemm<a8_kernels::W4>(x, M, in_features, w, few_scales.data_ptr<at::BFloat16>(), out_features, b, y);
  }
#endif
};

Linear dense_linear(torch::Tensor weight, OptTensor bias) {
  Linear l;
  l.weight = std::move(weight);
  l.bias = std::move(bias);
  l.out_features = l.weight.size(0);
  return l;
}

Linear few_rows_linear(int bits, torch::Tensor weight, torch::Tensor few_scales, OptTensor few_bias,
                       int64_t out_features, int64_t group, int64_t few_upto, OptTensor dense, OptTensor qweight,
                       OptTensor qscales, OptTensor bias) {
  Linear l;
  l.bits = bits;
  l.weight = std::move(weight);
  l.few_scales = std::move(few_scales);
  l.few_bias = std::move(few_bias);
  l.out_features = out_features;
  l.group = group;
  l.few_upto = few_upto;
  l.dense = std::move(dense);
  l.qweight = std::move(qweight);
  l.qscales = std::move(qscales);
  l.bias = std::move(bias);
  return l;
}

Linear int8_linear(torch::Tensor blocked, torch::Tensor few_scales, OptTensor few_bias, int64_t out_features,
                   int64_t few_upto, OptTensor dense, OptTensor qweight, OptTensor qscales, OptTensor bias) {
  return few_rows_linear(8, std::move(blocked), std::move(few_scales), std::move(few_bias), out_features, 0, few_upto,
                         std::move(dense), std::move(qweight), std::move(qscales), std::move(bias));
}

Linear int4_linear(torch::Tensor packed, torch::Tensor scale_offsets, OptTensor few_bias, int64_t out_features,
                   int64_t group, int64_t few_upto, OptTensor dense, OptTensor qweight, OptTensor qscales,
                   OptTensor bias) {
  return few_rows_linear(4, std::move(packed), std::move(scale_offsets), std::move(few_bias), out_features, group,
                         few_upto, std::move(dense), std::move(qweight), std::move(qscales), std::move(bias));
}

// weight_bits 8: w8a8, 4: w4a8 (QuantizedLinear.a8_arguments).
Linear a8_linear(int64_t weight_bits, torch::Tensor packed, torch::Tensor params, OptTensor bias,
                 int64_t out_features) {
  TORCH_CHECK(weight_bits == 8 || weight_bits == 4, "a8_linear: weight bits 8 or 4, got ", weight_bits);
#if SPECDECODE_LEAN_PATH
  // What the ops check on every call, checked once here for the lean path's direct calls.
  TORCH_CHECK(packed.dim() == 4, "a8_linear: a packed weight [lines, K / 4 or K / 8, 16, 4] expected");
  const int64_t K = packed.size(1) * (weight_bits == 8 ? 4 : 8);
  a8_kernels::check_layer("a8_linear", static_cast<int>(weight_bits), packed, params, bias, out_features, K);
#else
  const int64_t K = 0;  // no direct calls: the ops check their arguments
#endif
  Linear l;
  l.a8_bits = static_cast<int>(weight_bits);
  l.weight = std::move(packed);
  l.few_scales = std::move(params);
  l.bias = std::move(bias);  // padded fp32, as the ops take it
  l.out_features = out_features;
  l.in_features = K;
  return l;
}

Linear packed_linear(torch::Tensor packed, OptTensor bias, int64_t out_features, OptTensor few_blocked,
                     int64_t few_upto) {
  Linear l;
  l.bits = 16;
  l.weight = std::move(packed);
  l.bias = std::move(bias);
  l.out_features = out_features;
  l.few_blocked = std::move(few_blocked);
  l.few_upto = few_upto;
#if SPECDECODE_LEAN_BF16
  if (l.few_blocked.has_value()) {  // what the op checks on every call, checked once for the direct calls
    TORCH_CHECK(l.few_blocked->dim() == 4, "packed_linear: the few-row layout [groups, K / 2, 64, 2] expected");
    l.in_features = l.few_blocked->size(1) * 2;
    bf16_kernels::check_blocked(*l.few_blocked, out_features, l.in_features);
  }
#endif
  return l;
}

// A Bf16WeightLinear: blocked bf16 weights [ceil(N / 64), K / 2, 64, 2], float32 bias [N] or none.
Linear bf16w_linear(torch::Tensor blocked, OptTensor bias, int64_t out_features) {
  TORCH_CHECK(blocked.dim() == 4 && blocked.size(2) == 64 && blocked.size(3) == 2,
              "bf16w_linear: the blocked layout [groups, K / 2, 64, 2] expected");
  Linear l;
  l.bf16_weights = true;
  l.in_features = blocked.size(1) * 2;
  l.out_features = out_features;
#if SPECDECODE_LEAN_PATH
  // What the op checks on every call, checked once for the direct calls.
  bf16w_kernels::check_blocked(blocked, out_features, l.in_features);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == out_features),
              "bf16w_linear: a float32 bias of ", out_features, " values expected");
#endif
  l.weight = std::move(blocked);
  l.bias = std::move(bias);
  return l;
}

// An int8 / int4 layer that also keeps a wide copy (QuantizedLinear._matmul checks it first).
Linear with_wide(Linear l, Linear wide, int64_t wide_from) {
  l.wide = std::make_shared<const Linear>(std::move(wide));
  l.wide_from = wide_from;
  return l;
}

struct Layer {
  torch::Tensor input_norm, post_norm;  // [d]
  OptTensor q_norm, k_norm;             // [head_dim] (Qwen3)
  double eps;
  Linear qkv, o_proj, gate_up, down;
  int64_t num_heads, num_kv_heads, head_dim, intermediate;
};

// RoPE's products and sum must round separately, as PyTorch's ops round them (the build passes
// -ffp-contract=fast, which the kernels included above are built with, as in their own sources).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// models/layers.py apply_rope for one head's D values: y = x * cos + cat(-x2, x1) * sin (rotate-half),
// in one loop instead of seven ops: each product and the sum rounded to the dtype as PyTorch's mul,
// mul and add round them (float arithmetic, no FMA: fp-contract is off here).
template <typename scalar_t>
void rope_head(const scalar_t* xr, const scalar_t* c, const scalar_t* sn, scalar_t* o, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rotated = d < half ? -static_cast<float>(xr[d + half]) : static_cast<float>(xr[d - half]);
    const scalar_t a = static_cast<scalar_t>(static_cast<float>(xr[d]) * static_cast<float>(c[d]));
    const scalar_t r = static_cast<scalar_t>(rotated * static_cast<float>(sn[d]));
    o[d] = static_cast<scalar_t>(static_cast<float>(a) + static_cast<float>(r));
  }
}

#pragma GCC pop_options

// rope_head over x, out [B, T, H, D] and cos, sin [B, T, 1, D] with any strides but a contiguous last
// dimension; `out` may be a permuted view (the GQA-folded query layout is written directly).
template <typename scalar_t>
void rope_rows(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& out) {
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
  const auto xs = x.strides(), os = out.strides(), cs = cos.strides(), ss = sin.strides();
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* cp = cos.data_ptr<scalar_t>();
  const scalar_t* sp = sin.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        rope_head(xp + b * xs[0] + t * xs[1] + h * xs[2], cp + b * cs[0] + t * cs[1], sp + b * ss[0] + t * ss[1],
                  op + b * os[0] + t * os[1] + h * os[2], D);
}

// apply_rope(x, cos, sin) written into `out` (see rope_rows).
void apply_rope_into(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                     const torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 4 && out.dim() == 4 && x.stride(3) == 1 && out.stride(3) == 1 && cos.stride(3) == 1 && sin.stride(3) == 1 &&
                  x.size(3) % 2 == 0 && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope: x [B, T, H, D] with cos, sin [B, T, 1, D] of its dtype, last dimensions contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    rope_rows<scalar_t>(x, cos, sin, out);
  });
}

// Where a batch's tokens go in each layer's cache (see Stack::forward).
struct CacheRows {
  int64_t slot_begin, slot_end, write_start;
  const OptTensor& slot_ids;       // [B] int64: each sequence's row (ragged batches)
  const OptTensor& write_indices;  // [B, T] int64: each token's column (ragged batches)

  bool slices() const { return slot_begin >= 0 && write_start >= 0; }

  // Columns [0, num_keys) of the batch's rows [B, S, ...]: a view of contiguous rows, else a gather.
  torch::Tensor read(const torch::Tensor& cache, int64_t num_keys) const {
    if (slot_begin >= 0) return cache.slice(0, slot_begin, slot_end).slice(1, 0, num_keys);
    return cache.slice(1, 0, num_keys).index_select(0, *slot_ids);
  }
};

// engine/ragged.py _one_chain's causal mask for T new tokens at cache columns start..: mask [T, start + T]
// (row-major), token t seeing columns .. start + t.
void causal_mask(bool* mask, int64_t start, int64_t T) {
  const int64_t S = start + T;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t col = 0; col < S; ++col) mask[t * S + col] = col <= start + t;
}

class Stack {
 public:
  // cached_attention: attention by specdecode_attn::cached_attention (as the modules where it is built),
  // else PyTorch's scaled_dot_product_attention. The lean path calls every layer's kernel directly up
  // to its lean width and runs the layer's own op past it (`linear_rows`): lean_rows > 0, that many
  // rows, its bf16 layers on the few-row kernel whatever width their modules take it to (a width
  // measured on whole forwards, engine/lean_width.py); 0: the narrowest layer's kernel width.
  Stack(std::vector<Layer> layers, OptTensor final_norm, double eps, bool cached_attention, int64_t lean_rows = 0)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), eps_(eps),
        cached_attention_(cached_attention), lean_(SPECDECODE_LEAN_PATH && cached_attention) {
    const int64_t d = layers_.empty() ? 0 : layers_[0].o_proj.out_features;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      qkv_width_ = std::max(qkv_width_, l.qkv.out_features);
      heads_width_ = std::max(heads_width_, l.num_heads * l.head_dim);
      intermediate_ = std::max(intermediate_, l.intermediate);
#if SPECDECODE_LEAN_PATH
      for (const Linear* linear : {&l.qkv, &l.o_proj, &l.gate_up, &l.down})
        lean_rows_ = std::min(lean_rows_, linear->direct_rows(lean_only_dtype_, lean_rows > 0));
#endif
      // The shapes its buffers assume (layer 0's qkv may read a wider input: EAGLE-3's).
      const int64_t H = l.num_heads, KVH = l.num_kv_heads, D = l.head_dim;
      lean_ = lean_ && KVH > 0 && H % KVH == 0 && D % 2 == 0 && l.qkv.out_features == (H + 2 * KVH) * D &&
              (i == 0 || l.qkv.in_features == d) && l.o_proj.in_features == H * D && l.o_proj.out_features == d &&
              l.gate_up.in_features == d && l.gate_up.out_features == 2 * l.intermediate &&
              l.down.in_features == l.intermediate && l.down.out_features == d;
    }
    if (lean_rows > 0) lean_rows_ = std::min(lean_rows_, lean_rows);
    lean_ = lean_ && lean_rows_ > 0;
  }

  // How many forwards took the lean path (tests check that it serves).
  int64_t lean_forwards() const { return lean_forwards_; }

  // The cache this stack writes: per layer K and V [slots, max_len + 1, kv_heads, head_dim].
  void bind_cache(std::vector<torch::Tensor> k, std::vector<torch::Tensor> v) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(), "one K and one V cache per layer");
    k_ = std::move(k);
    v_ = std::move(v);
  }

  // x [B, T, d] (a model's embeddings, a block's residual input), cos/sin [B, T, 1, head_dim]; the
  // batch's slots are the cache rows [slot_begin, slot_end) and its tokens write columns
  // [write_start, write_start + T); attention reads columns [0, num_keys) under `mask`
  // [B, 1, T, num_keys] (None: every query sees every one). A ragged batch (models/layers.py
  // write_columns / read_columns): write_start -1, its tokens written at columns `write_indices`
  // [B, T] of rows `slot_ids` [B]; slot_begin -1 too where those rows are not contiguous (read by a gather). `attn_input` replaces the first layer's
  // input norm as what its attention reads (EAGLE-3). Returns the last layer's output, final-normed
  // where the stack has a final norm, and the states of `taps` (models/llama.py's numbering: i is
  // layer i's input, L the last layer's output before the final norm).
  std::pair<torch::Tensor, std::vector<torch::Tensor>> forward(torch::Tensor x, const torch::Tensor& cos,
                                                               const torch::Tensor& sin, int64_t slot_begin,
                                                               int64_t slot_end, int64_t write_start,
                                                               int64_t num_keys, const OptTensor& mask,
                                                               const std::vector<int64_t>& taps,
                                                               const OptTensor& attn_input,
                                                               const OptTensor& slot_ids = std::nullopt,
                                                               const OptTensor& write_indices = std::nullopt) {
    TORCH_CHECK(k_.size() == layers_.size(), "no cache bound");
    const CacheRows rows{slot_begin, slot_end, write_start, slot_ids, write_indices};
    TORCH_CHECK(rows.slices() || (slot_ids.has_value() && write_indices.has_value() &&
                                  (slot_begin >= 0 || slot_ids->size(0) == x.size(0))),
                "a ragged batch needs its slot ids and write indices");
#if SPECDECODE_LEAN_PATH
    if (rows.slices() && lean_serves(x, cos, sin, slot_begin, slot_end, write_start, num_keys, mask, attn_input)) {
      ++lean_forwards_;
      const std::vector<Segment> one{
          {slot_begin, write_start, x.size(1), num_keys, 0, 0, mask.has_value() ? mask->data_ptr<bool>() : nullptr}};
      return lean_forward(x, cos, sin, one, taps, attn_input);
    }
#endif
    const int64_t L = static_cast<int64_t>(layers_.size());
    std::vector<torch::Tensor> tapped(taps.size());
    auto tap = [&](int64_t i) {
      for (size_t j = 0; j < taps.size(); ++j)
        if (taps[j] == i) tapped[j] = x;
    };
    for (int64_t i = 0; i < L; ++i) {
      tap(i);
      const auto h = i == 0 && attn_input.has_value() ? *attn_input : rms_norm_op(x, layers_[i].input_norm, layers_[i].eps);
      x = layer_forward(layers_[i], x, h, cos, sin, k_[i], v_[i], rows, num_keys, mask, cached_attention_);
    }
    tap(L);
    return {final_norm_.has_value() ? rms_norm_op(x, *final_norm_, eps_) : x, tapped};
  }

  // Rows of a lean forward that attend as one sequence: `rows` tokens (rows row_begin.. of the batch's
  // x, which are the segment's in order) written at columns write_start.. of cache row `slot`,
  // attending to columns [0, num_keys) under `mask` [rows, num_keys] bool (row-major; nullptr: every
  // row sees them all); their RoPE at rows rope_row.. of cos and sin's first two dimensions flattened.
  struct Segment {
    int64_t slot, write_start, rows, num_keys, row_begin, rope_row;
    const bool* mask;
  };

  // A batch of chains as lean-path segments: sequence b's lengths[b] new tokens written at columns
  // starts[b].. of cache row slots[b], each attending to its row's columns up to its own (engine/ragged.py
  // _one_chain's causal mask, kept in this stack until its next batch), rows in sequence order; nullopt
  // where the lean path does not serve one of them (then nothing else is needed to decline the batch).
  std::optional<std::vector<Segment>> chain_segments(at::ScalarType dtype, const std::vector<int64_t>& slots,
                                                     const std::vector<int64_t>& starts,
                                                     const std::vector<int64_t>& lengths) {
#if SPECDECODE_LEAN_PATH
    const size_t B = slots.size();
    if (!lean_ || layers_.empty() || B == 0 || starts.size() != B || lengths.size() != B) return std::nullopt;
    int64_t mask_size = 0;
    for (size_t b = 0; b < B; ++b) {
      const int64_t n = lengths[b], start = starts[b];
      if (slots[b] < 0 || start < 0 || n < 1 || !lean_serves_columns(dtype, slots[b], start, n, start + n))
        return std::nullopt;
      if (n > 1) mask_size += n * (start + n);
    }
    if (masks_size_ < mask_size) masks_.reset(new bool[masks_size_ = mask_size]);
    std::vector<Segment> segments;
    segments.reserve(B);
    bool* mask = masks_.get();
    for (size_t b = 0, row = 0; b < B; row += lengths[b], ++b) {
      const int64_t n = lengths[b], start = starts[b], S = start + n;
      segments.push_back({slots[b], start, n, S, static_cast<int64_t>(row), static_cast<int64_t>(row),
                          n > 1 ? mask : nullptr});
      if (n > 1) {
        causal_mask(mask, start, n);
        mask += n * S;
      }
    }
    return segments;
#else
    return std::nullopt;
#endif
  }

  // The segments' rows as one lean forward: x [1, R, d] (segment after segment), cos and sin
  // [1, R, 1, D] (and the first layer's attention input, EAGLE-3's) -> as `forward` of each sequence
  // alone, its rows of the final-normed output [1, R, d] and of the taps. Every linear runs over the
  // R rows at once, RoPE, the cache writes and attention per sequence on its own cache row, length and
  // mask (no gather, no padding). nullopt where the lean path does not serve these inputs (the caller
  // then runs the batch through `forward`). Traced at W4A8 on 2 cores: 4 sequences' one-token ragged
  // forward cost 1.55 ms where one sequence's 5-token lean forward cost 0.70 ms.
  std::optional<std::pair<torch::Tensor, std::vector<torch::Tensor>>> lean_batch(
      const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const std::vector<Segment>& segments,
      const std::vector<int64_t>& taps, const OptTensor& attn_input = std::nullopt) {
    TORCH_CHECK(k_.size() == layers_.size(), "no cache bound");
#if SPECDECODE_LEAN_PATH
    if (segments.empty() || !lean_serves_rows(x, cos, sin, attn_input) ||
        segments.back().row_begin + segments.back().rows != x.size(1))
      return std::nullopt;
    ++lean_forwards_;
    return lean_forward(x, cos, sin, segments, taps, attn_input);
#else
    return std::nullopt;
#endif
  }

 private:
#if SPECDECODE_LEAN_PATH
  // Whether `lean_forward` serves this call: one sequence (`lean_serves_rows`) under a mask (if any)
  // [1, 1, T, num_keys] bool, its columns inside the caches (`lean_serves_columns`).
  bool lean_serves(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t slot_begin,
                   int64_t slot_end, int64_t write_start, int64_t num_keys, const OptTensor& mask,
                   const OptTensor& attn_input) const {
    if (slot_end - slot_begin != 1 || !lean_serves_rows(x, cos, sin, attn_input)) return false;
    const int64_t T = x.size(1);
    if (mask.has_value() && (mask->scalar_type() != at::kBool || !mask->is_contiguous() || mask->dim() != 4 ||
                             mask->size(0) != 1 || mask->size(1) != 1 || mask->size(2) != T || mask->size(3) != num_keys))
      return false;
    return lean_serves_columns(x.scalar_type(), slot_begin, write_start, T, num_keys);
  }

  // What every row of a lean forward needs: w8a8 / w4a8 layers or bf16 ones with the few-row kernel's
  // layout (lean_), T rows x [1, T, d] in float32 or bf16 (bf16 only for bf16 layers), contiguous, cos
  // and sin [1, T, 1, head_dim] of that dtype, and the first layer's attention input (if any) of the
  // rows' shape.
  bool lean_serves_rows(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const OptTensor& attn_input) const {
    if (!lean_ || layers_.empty() || x.dim() != 3 || x.size(0) != 1 || !x.is_contiguous() ||
        x.device().type() != at::kCPU)
      return false;
    const auto dtype = x.scalar_type();
    const int64_t T = x.size(1);
    if ((dtype != at::kFloat && dtype != at::kBFloat16) || T == 0 ||
        (lean_only_dtype_ != at::ScalarType::Undefined && dtype != lean_only_dtype_))
      return false;
    for (const torch::Tensor* t : {&cos, &sin})
      if (t->scalar_type() != dtype || t->dim() != 4 || t->size(0) != 1 || t->size(1) != T || t->stride(3) != 1)
        return false;
    const Layer& first = layers_[0];
    const torch::Tensor& h0 = attn_input.has_value() ? *attn_input : x;
    if (!h0.is_contiguous() || h0.scalar_type() != dtype || h0.dim() != 3 || h0.size(1) != T ||
        h0.size(2) != first.qkv.in_features)
      return false;
    if (x.size(2) != first.o_proj.out_features) return false;  // every layer's width (the constructor checked)
    for (const Layer& l : layers_)
      if (cos.size(3) != l.head_dim) return false;
    return true;
  }

  // The part of `lean_serves` that differs between the sequences of a batch: T tokens written at
  // columns write_start.. of cache row `slot`, attending to [0, num_keys), within every layer's caches
  // (of this dtype) and the attention kernel's reach.
  bool lean_serves_columns(at::ScalarType dtype, int64_t slot, int64_t write_start, int64_t T,
                           int64_t num_keys) const {
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      const int64_t group = l.num_heads / l.num_kv_heads;
      const bool quantized = k_[i].scalar_type() == at::kChar;  // an int8 cache: records of D values and a scale
      if (!attention_kernels::serves(group * T, l.head_dim, num_keys, quantized)) return false;
      const int64_t record = quantized ? l.head_dim + attention_kernels::kScaleBytes : l.head_dim;
      for (const torch::Tensor* cache : {&k_[i], &v_[i]})
        if (cache->scalar_type() != (quantized ? at::kChar : dtype) || cache->dim() != 4 || cache->stride(3) != 1 ||
            cache->size(2) != l.num_kv_heads || cache->size(3) != record || slot >= cache->size(0) ||
            write_start + T > cache->size(1) || num_keys > cache->size(1))
          return false;
    }
    return true;
  }

  // `lean_layers` in x's dtype, its kernels' parallel loops on the threads of one region (thread_team.h:
  // ~31 OpenMP regions a one-token forward of the default model were ~1.3 us of fork and join each) where
  // the forward makes no ATen call that would use threads, as inside a region none does: each linear on
  // its own kernel (not a bf16 layer's oneDNN op past the lean width). Batches past the SwiGLU's grain
  // run in it too: 8 sequences x 3 or 5 tokens took 0.91-0.97x a region a loop's time (A / A 0.98-1.12x).
  std::pair<torch::Tensor, std::vector<torch::Tensor>> lean_forward(const torch::Tensor& x, const torch::Tensor& cos,
                                                                    const torch::Tensor& sin,
                                                                    const std::vector<Segment>& segments,
                                                                    const std::vector<int64_t>& taps,
                                                                    const OptTensor& attn_input) {
    std::pair<torch::Tensor, std::vector<torch::Tensor>> out;
    auto run = [&] {
      out = x.scalar_type() == at::kFloat ? lean_layers<float>(x, cos, sin, segments, taps, attn_input)
                                          : lean_layers<at::BFloat16>(x, cos, sin, segments, taps, attn_input);
    };
    const int64_t T = x.numel() / x.size(-1);
    if (T <= lean_rows_)
      thread_team::region(run);
    else
      run();
    return out;
  }

  // Stack::forward for what lean_serves accepts, on the kernels' functions and plain loops (see the
  // top of this file): the same numbers as layer_forward's ops.
  // Its rows are the segments' (one sequence's chain, or a batch's chains, one after the other): the
  // linears and norms run over all T rows at once, RoPE and the cache writes per segment, and attention of
  // every segment in one parallel region.
  template <typename scalar_t>
  std::pair<torch::Tensor, std::vector<torch::Tensor>> lean_layers(const torch::Tensor& x_in, const torch::Tensor& cos,
                                                                    const torch::Tensor& sin,
                                                                    const std::vector<Segment>& segments,
                                                                    const std::vector<int64_t>& taps,
                                                                    const OptTensor& attn_input) {
    const int64_t T = x_in.numel() / x_in.size(-1), d = x_in.size(-1), L = static_cast<int64_t>(layers_.size());
    const int64_t qkv_width = qkv_width_, heads_width = heads_width_, intermediate = intermediate_;
    // Buffers, reused across calls: the residual stream x [T, d], a norm's output h, qkv [T, qkv],
    // q and k after their norms, the folded query and attention's output [KVH, group x T, D], its rows
    // [T, H x D], a projection's output [T, d], gate_up [T, 2I] and the SwiGLU product [T, I].
    const int64_t sizes[] = {T * d, T * d, T * qkv_width, T * heads_width, T * qkv_width, T * heads_width,
                             T * heads_width, T * heads_width, T * d, T * 2 * intermediate, T * intermediate};
    constexpr int kBuffers = sizeof(sizes) / sizeof(sizes[0]);
    int64_t offsets[kBuffers + 1] = {0};
    for (int j = 0; j < kBuffers; ++j) offsets[j + 1] = offsets[j] + (sizes[j] * sizeof(scalar_t) + 63) / 64 * 64;
    if (static_cast<int64_t>(workspace_.size()) < offsets[kBuffers] + 64) workspace_.resize(offsets[kBuffers] + 64);
    char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(workspace_.data()) + 63) / 64 * 64);
    auto buffer = [&](int j) { return reinterpret_cast<scalar_t*>(base + offsets[j]); };
    scalar_t *x = buffer(0), *h = buffer(1), *qkv = buffer(2), *q_normed = buffer(3), *k_normed = buffer(4),
             *folded = buffer(5), *attended = buffer(6), *attn_rows = buffer(7), *projected = buffer(8),
             *gate_up = buffer(9), *act = buffer(10);
    std::memcpy(x, x_in.data_ptr<scalar_t>(), T * d * sizeof(scalar_t));
    const auto options = x_in.options();
    std::vector<torch::Tensor> tapped(taps.size());
    auto tap = [&](int64_t i) {
      for (size_t j = 0; j < taps.size(); ++j)
        if (taps[j] == i) tapped[j] = i == 0 ? x_in : copy_rows(x, x_in.sizes(), options);
    };
    const RopeRows<scalar_t> rope{cos.data_ptr<scalar_t>(), cos.stride(1), sin.data_ptr<scalar_t>(), sin.stride(1)};
    // x = x + y, rounded to the dtype as PyTorch's add rounds it (a float sum, either order).
    auto add_into_x = [&](const scalar_t* y) {
      for (int64_t j = 0; j < T * d; ++j) x[j] = static_cast<scalar_t>(static_cast<float>(x[j]) + static_cast<float>(y[j]));
    };
    for (int64_t i = 0; i < L; ++i) {
      tap(i);
      const Layer& l = layers_[i];
      const int64_t H = l.num_heads, KVH = l.num_kv_heads, D = l.head_dim, group = H / KVH;
      const int64_t W = l.qkv.out_features, I = l.intermediate;
      const scalar_t* input = h;
      if (i == 0 && attn_input.has_value())
        input = attn_input->data_ptr<scalar_t>();
      else
        rms_kernels::rms_norm_rows(x, l.input_norm.data_ptr<scalar_t>(), h, T, d, static_cast<float>(l.eps));
      linear_rows(l.qkv, input, T, qkv, options);
      // q, k and v of token t: qkv + t * W at 0, H * D and (H + KVH) * D; their norms (Qwen3) per head.
      const scalar_t* q = qkv;
      const scalar_t* k = qkv + H * D;
      int64_t q_stride = W, k_stride = W;
      if (l.k_norm.has_value()) {
        for (int64_t t = 0; t < T; ++t)
          rms_kernels::rms_norm_rows(qkv + t * W + H * D, l.k_norm->data_ptr<scalar_t>(), k_normed + t * KVH * D, KVH,
                                     D, static_cast<float>(l.eps));
        k = k_normed, k_stride = KVH * D;
      }
      if (l.q_norm.has_value()) {
        for (int64_t t = 0; t < T; ++t)
          rms_kernels::rms_norm_rows(qkv + t * W, l.q_norm->data_ptr<scalar_t>(), q_normed + t * H * D, H, D,
                                     static_cast<float>(l.eps));
        q = q_normed, q_stride = H * D;
      }
      if (k_[i].scalar_type() == at::kChar)
        attend_layer<scalar_t, int8_t>(i, segments, q, q_stride, k, k_stride, qkv, rope, folded, attended);
      else
        attend_layer<scalar_t, scalar_t>(i, segments, q, q_stride, k, k_stride, qkv, rope, folded, attended);
      for (const Segment& seg : segments) {
        const int64_t n = seg.rows, r0 = seg.row_begin;
        const scalar_t* seg_attended = attended + r0 * H * D;
        if (n > 1)  // [n, H * D] rows (the folded layout is that already for one token)
          for (int64_t t = 0; t < n; ++t)
            for (int64_t head = 0; head < H; ++head)
              std::memcpy(attn_rows + ((r0 + t) * H + head) * D, seg_attended + (head * n + t) * D,
                          D * sizeof(scalar_t));
        else if (segments.size() > 1)
          std::memcpy(attn_rows + r0 * H * D, seg_attended, H * D * sizeof(scalar_t));
      }
      // One segment of one token: its attention's output is the row (no copy).
      const scalar_t* rows = segments.size() == 1 && T == 1 ? attended : attn_rows;
      linear_rows(l.o_proj, rows, T, projected, options);
      add_into_x(projected);
      rms_kernels::rms_norm_rows(x, l.post_norm.data_ptr<scalar_t>(), h, T, d, static_cast<float>(l.eps));
      linear_rows(l.gate_up, h, T, gate_up, options);
      swiglu_kernels::product_rows(gate_up, T, I, act);  // PyTorch's silu and mul_, without their ops
      linear_rows(l.down, act, T, projected, options);
      add_into_x(projected);
    }
    tap(L);
    torch::Tensor out = torch::empty(x_in.sizes(), options);
    if (final_norm_.has_value())
      rms_kernels::rms_norm_rows(x, final_norm_->data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), T, d,
                                 static_cast<float>(eps_));
    else
      std::memcpy(out.data_ptr<scalar_t>(), x, T * d * sizeof(scalar_t));
    return {out, tapped};
  }

  // The rows' RoPE tables: row r's cos at cos + r * cos_stride (sin likewise).
  template <typename scalar_t>
  struct RopeRows {
    const scalar_t* cos;
    int64_t cos_stride;
    const scalar_t* sin;
    int64_t sin_stride;
  };

  // Layer i's attention in a lean forward, from its q and k (row r at q + r * q_stride, k + r * k_stride,
  // after their norms) and v (in qkv [T, W]): each segment's rotated K and its V written to its cache row's
  // columns write_start + t (cache_t: the dtype, or int8 records, quantised from the rounded rotation), its
  // query rotated into the folded layout (head h = kv * group + g at row g * n + t of its KV head: (h * n +
  // t) * D), then every segment's attention in one parallel region (a region per segment cost ~2 us each
  // beside the work) -> attended [KVH, group x n, D] per segment, at row_begin x H x D.
  template <typename scalar_t, typename cache_t>
  void attend_layer(int64_t i, const std::vector<Segment>& segments, const scalar_t* q, int64_t q_stride,
                    const scalar_t* k, int64_t k_stride, const scalar_t* qkv, const RopeRows<scalar_t>& rope,
                    scalar_t* folded, scalar_t* attended) const {
    const Layer& l = layers_[i];
    const int64_t H = l.num_heads, KVH = l.num_kv_heads, D = l.head_dim, group = H / KVH, W = l.qkv.out_features;
    const int64_t ks[3] = {k_[i].stride(0), k_[i].stride(1), k_[i].stride(2)};
    const int64_t vs[3] = {v_[i].stride(0), v_[i].stride(1), v_[i].stride(2)};
    std::vector<attention_kernels::HeadSegment<scalar_t, cache_t>> heads;
    heads.reserve(segments.size());
    alignas(64) scalar_t rotated[256];  // an int8 cache's rotated key before quantising (`serves`: D <= 256)
    for (const Segment& seg : segments) {
      const int64_t n = seg.rows, r0 = seg.row_begin;
      cache_t* cache_k = k_[i].data_ptr<cache_t>() + seg.slot * ks[0];
      cache_t* cache_v = v_[i].data_ptr<cache_t>() + seg.slot * vs[0];
      scalar_t* seg_folded = folded + r0 * H * D;
      for (int64_t t = 0; t < n; ++t) {
        const scalar_t* c = rope.cos + (seg.rope_row + t) * rope.cos_stride;
        const scalar_t* sn = rope.sin + (seg.rope_row + t) * rope.sin_stride;
        const int64_t row = r0 + t;
        for (int64_t kv = 0; kv < KVH; ++kv) {
          cache_t* key = cache_k + (seg.write_start + t) * ks[1] + kv * ks[2];
          cache_t* value = cache_v + (seg.write_start + t) * vs[1] + kv * vs[2];
          const scalar_t* v = qkv + row * W + (H + KVH) * D + kv * D;
          if constexpr (attention_kernels::kQuantized<cache_t>) {
            rope_head(k + row * k_stride + kv * D, c, sn, rotated, D);
            attention_kernels::quantize_record(rotated, key, D);
            attention_kernels::quantize_record(v, value, D);
          } else {
            rope_head(k + row * k_stride + kv * D, c, sn, key, D);
            std::memcpy(value, v, D * sizeof(scalar_t));
          }
        }
        for (int64_t head = 0; head < H; ++head)
          rope_head(q + row * q_stride + head * D, c, sn, seg_folded + (head * n + t) * D, D);
      }
      heads.push_back({seg_folded, cache_k, cache_v, n, seg.num_keys, seg.mask, attended + r0 * H * D});
    }
    attention_kernels::attend_segments(heads, KVH, group, D, ks, vs);
  }

  // y [T, out] = linear(x [T, in]): its kernel called directly within the lean width, past it the
  // layer's own op at that width, as its module runs it (a bf16 layer's oneDNN matmul, which the
  // few-row kernel measured slower than there: engine/lean_width.py), its output copied into y.
  template <typename scalar_t>
  void linear_rows(const Linear& linear, const scalar_t* x, int64_t T, scalar_t* y,
                   const at::TensorOptions& options) const {
    if (T <= lean_rows_) return linear.direct(x, T, y);
    const torch::Tensor out =
        linear(at::from_blob(const_cast<scalar_t*>(x), {T, linear.in_features}, options)).contiguous();
    std::memcpy(y, out.data_ptr<scalar_t>(), T * linear.out_features * sizeof(scalar_t));
  }

  // A fresh tensor of these sizes holding rows of a buffer.
  template <typename scalar_t>
  static torch::Tensor copy_rows(const scalar_t* x, at::IntArrayRef sizes, const at::TensorOptions& options) {
    torch::Tensor out = torch::empty(sizes, options);
    std::memcpy(out.data_ptr<scalar_t>(), x, out.numel() * sizeof(scalar_t));
    return out;
  }
#endif

  // models/llama.py DecoderLayer.forward with Attention's cached path and the MLP, op for op; `h` is
  // what attention reads (the input norm of x, or EAGLE-3's attention input).
  static torch::Tensor layer_forward(const Layer& layer, const torch::Tensor& x, const torch::Tensor& h,
                                     const torch::Tensor& cos,
                                     const torch::Tensor& sin, const torch::Tensor& cache_k,
                                     const torch::Tensor& cache_v, const CacheRows& rows, int64_t num_keys,
                                     const OptTensor& mask, bool cached_attention) {
    const int64_t B = x.size(0), T = x.size(1);
    const int64_t H = layer.num_heads, KVH = layer.num_kv_heads, D = layer.head_dim;
    const auto qkv = layer.qkv(h).split_with_sizes({H * D, KVH * D, KVH * D}, -1);  // [B, T, *] views
    auto q = qkv[0].view({B, T, H, D});
    auto k = qkv[1].view({B, T, KVH, D});
    const auto v = qkv[2].view({B, T, KVH, D});
    if (layer.k_norm.has_value()) k = rms_norm_op(k, *layer.k_norm, layer.eps);
    if (layer.q_norm.has_value()) q = rms_norm_op(q, *layer.q_norm, layer.eps);
    // Cache writes and reads as models/layers.py write_columns / read_columns: slices where the rows are
    // contiguous (and, for writes, the columns shared), else an index write / a gather. A sliced write
    // gets the rotated K straight into its cache columns (the modules rotate into a new tensor, then
    // copy it there: the same values).
    // An int8 cache (records) takes the rotated K and the V quantised (write_columns does the same).
    const bool quantized = cache_k.scalar_type() == at::kChar;
    if (rows.slices() && !quantized) {
      const int64_t a = rows.slot_begin, b = rows.slot_end, start = rows.write_start;
      apply_rope_into(k, cos, sin, cache_k.slice(0, a, b).slice(1, start, start + T));
      cache_v.slice(0, a, b).slice(1, start, start + T).copy_(v);
    } else {
      auto k_rotated = torch::empty({B, T, KVH, D}, x.options());
      apply_rope_into(k, cos, sin, k_rotated);
      auto v_stored = v;
      if (quantized) {
        k_rotated = attention_kernels::quantize_records(k_rotated);
        v_stored = attention_kernels::quantize_records(v);
      }
      if (rows.slices()) {
        const int64_t a = rows.slot_begin, b = rows.slot_end, start = rows.write_start;
        cache_k.slice(0, a, b).slice(1, start, start + T).copy_(k_rotated);
        cache_v.slice(0, a, b).slice(1, start, start + T).copy_(v_stored);
      } else {
        const auto slots = rows.slot_ids->unsqueeze(1);  // [B, 1]
        cache_k.index_put_({slots, *rows.write_indices}, k_rotated);
        cache_v.index_put_({slots, *rows.write_indices}, v_stored);
      }
    }
    auto keys = rows.read(cache_k, num_keys);  // [B, S, KVH, D] (records [B, S, KVH, D + 4] in an int8 cache)
    auto values = rows.read(cache_v, num_keys);
    if (quantized && !cached_attention) {  // PyTorch's kernel reads the values
      keys = attention_kernels::dequantize_records(keys, x.scalar_type());
      values = attention_kernels::dequantize_records(values, x.scalar_type());
    }
    const int64_t group = H / KVH, S = num_keys;
    torch::Tensor attn;  // [B, T, H * D]
    if (group > 1 || cached_attention) {
      // GQA folded: the `group` query heads of one KV head become group x T queries of it; the rotated
      // query is written in that order directly (the modules rotate, then permute and copy).
      const auto folded = torch::empty({B, KVH, group * T, D}, x.options());
      apply_rope_into(q, cos, sin, folded.view({B, KVH, group, T, D}).permute({0, 3, 1, 2, 4}).view({B, T, H, D}));
      torch::Tensor out;  // [B, KVH, group * T, D]
      if (cached_attention) {
        out = cached_attention_op(folded, keys, values, mask, group);
      } else {
        OptTensor folded_mask;
        if (mask.has_value()) folded_mask = mask->expand({B, group, T, S}).reshape({B, 1, group * T, S});
        out = at::scaled_dot_product_attention(folded, keys.transpose(1, 2), values.transpose(1, 2), folded_mask);
      }
      attn = out.view({B, KVH, group, T, D}).permute({0, 3, 1, 2, 4}).reshape({B, T, -1});
    } else {
      const auto q_roped = torch::empty({B, T, H, D}, x.options());
      apply_rope_into(q, cos, sin, q_roped);
      const auto out = at::scaled_dot_product_attention(q_roped.transpose(1, 2), keys.transpose(1, 2),
                                                        values.transpose(1, 2), mask);  // [B, H, T, D]
      attn = out.transpose(1, 2).reshape({B, T, -1});
    }
    const auto x2 = residual_add(x, layer.o_proj(attn));
    const auto gate_up = layer.gate_up(rms_norm_op(x2, layer.post_norm, layer.eps))
                             .split_with_sizes({layer.intermediate, layer.intermediate}, -1);
    auto act = at::silu(gate_up[0]);  // silu(gate) * up, the product written over the silu
    act.mul_(gate_up[1]);
    return residual_add(x2, layer.down(act));
  }

  // x + y for a layer's fresh output y: written into y where that is the sum's dtype and shape (a
  // float sum is the same in either order), saving an allocation; else x + y.
  static torch::Tensor residual_add(const torch::Tensor& x, torch::Tensor y) {
    if (y.scalar_type() != x.scalar_type() || !y.sizes().equals(x.sizes())) return x + y;
    return y.add_(x);
  }

  std::vector<Layer> layers_;
  OptTensor final_norm_;
  double eps_;
  bool cached_attention_;
  bool lean_;  // the cached attention kernel serves and every layer's linears have direct kernels (lean_rows_ > 0)
  int64_t lean_rows_ = INT64_MAX;  // the most rows the lean path gives every layer's kernel directly
  // The one activation dtype some layer's direct kernel serves (bf16: the few-row bf16 kernel; float32: the
  // bf16-weight one), kUndefined where every one serves both.
  at::ScalarType lean_only_dtype_ = at::ScalarType::Undefined;
  int64_t qkv_width_ = 0, heads_width_ = 0, intermediate_ = 0;  // the widest layer's, sizing lean buffers
  int64_t lean_forwards_ = 0;
  std::vector<char> workspace_;  // lean_forward's buffers (a stack serves one forward at a time)
  std::unique_ptr<bool[]> masks_;  // chain_segments' causal masks
  int64_t masks_size_ = 0;
  std::vector<torch::Tensor> k_, v_;
};

// What one sequence's T new tokens at cache columns start .. start + T - 1 attend with: RoPE tables
// as models/layers.py RotaryEmbedding computes them, and the causal mask of engine/ragged.py
// _one_chain (none for one token: it sees every column).
struct ChainRope {
  torch::Tensor cos, sin;  // [1, T, 1, D]
  OptTensor mask;          // [1, 1, T, start + T] bool
};

// RotaryEmbedding.forward's cos and sin [B, T, 1, D] of positions [B x T] (row-major), by loops around
// its two transcendental ops: positions as float times inv_freq (a float product; a bf16 / fp16 inv_freq
// promotes to float exactly, as PyTorch promotes it), both halves, then PyTorch's cos and sin on one
// float tensor (elementwise: a row's values do not depend on the rows beside it), the attention factor
// (a float product) and the cast, rounded as `*` and `.to` round them.
std::pair<torch::Tensor, torch::Tensor> rope_tables(const torch::Tensor& inv_freq, double attention_factor,
                                                    const std::vector<int64_t>& positions, int64_t B, int64_t T,
                                                    at::ScalarType dtype) {
  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.scalar_type() != at::kDouble, "rope: a 1-D float inv_freq");
  const auto frequencies = inv_freq.to(torch::kFloat).contiguous();
  const float* f = frequencies.data_ptr<float>();
  const int64_t half = frequencies.numel(), D = 2 * half;
  const auto emb = torch::empty({B, T, 1, D}, torch::TensorOptions().dtype(torch::kFloat));
  float* e = emb.data_ptr<float>();
  for (int64_t t = 0; t < B * T; ++t) {
    const float position = static_cast<float>(positions[t]);
    for (int64_t i = 0; i < half; ++i) e[t * D + i] = e[t * D + half + i] = position * f[i];
  }
  torch::Tensor cos = emb.cos(), sin = emb.sin();
  if (attention_factor != 1.0 || dtype != at::kFloat) {
    const float factor = static_cast<float>(attention_factor);
    auto cast = [&](const torch::Tensor& values) {
      torch::Tensor out = torch::empty_like(values, values.options().dtype(dtype));
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "rope", [&] {
        const float* v = values.data_ptr<float>();
        scalar_t* o = out.data_ptr<scalar_t>();
        for (int64_t j = 0; j < B * T * D; ++j)
          o[j] = static_cast<scalar_t>(attention_factor != 1.0 ? v[j] * factor : v[j]);
      });
      return out;
    };
    cos = cast(cos);
    sin = cast(sin);
  }
  return {cos, sin};
}

// The position of every row of chains of lengths[b] tokens from starts[b], chain after chain.
std::vector<int64_t> chain_positions(const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths) {
  std::vector<int64_t> positions;
  for (size_t b = 0; b < starts.size(); ++b)
    for (int64_t t = 0; t < lengths[b]; ++t) positions.push_back(starts[b] + t);
  return positions;
}

// rope_tables of positions 0 .. capacity - 1 in one dtype, computed once and grown on demand (to twice
// the capacity, or to what is asked): a row's values depend only on its position, so a forward's rows
// taken from it are what rope_tables computes for them, bit for bit, as a view (consecutive positions)
// or a gather, where rope_tables' own ATen ops had cost ~10 us a forward or drafting step (W4A8 MTP
// drafting, 2 cores: cold after the weights streamed through the caches). The weights' Watch rebuilds
// the chain (and this table) when the rotary embedding's inv_freq is replaced.
class RopeTable {
 public:
  RopeTable(torch::Tensor inv_freq, double attention_factor)
      : inv_freq_(std::move(inv_freq)), attention_factor_(attention_factor) {}

  // cos, sin [1, T, 1, D] of positions start .. start + T - 1 (views of the table)
  std::pair<torch::Tensor, torch::Tensor> consecutive(int64_t start, int64_t T, at::ScalarType dtype) {
    cover(start + T, dtype);
    return {cos_.slice(0, start, start + T).unsqueeze(0), sin_.slice(0, start, start + T).unsqueeze(0)};
  }

  // cos, sin [1, R, 1, D] of positions [R]
  std::pair<torch::Tensor, torch::Tensor> rows(const std::vector<int64_t>& positions, at::ScalarType dtype) {
    cover(positions.empty() ? 0 : *std::max_element(positions.begin(), positions.end()) + 1, dtype);
    const auto index = torch::from_blob(const_cast<int64_t*>(positions.data()),
                                        {static_cast<int64_t>(positions.size())}, torch::kLong);
    return {cos_.index_select(0, index).unsqueeze(0), sin_.index_select(0, index).unsqueeze(0)};
  }

 private:
  void cover(int64_t end, at::ScalarType dtype) {
    if (end <= capacity_ && dtype == dtype_) return;
    capacity_ = std::max<int64_t>(end, dtype == dtype_ ? 2 * capacity_ : 0);
    std::vector<int64_t> positions(capacity_);
    std::iota(positions.begin(), positions.end(), int64_t{0});
    auto [cos, sin] = rope_tables(inv_freq_, attention_factor_, positions, 1, capacity_, dtype);
    cos_ = cos[0], sin_ = sin[0], dtype_ = dtype;  // [capacity, 1, D]
  }

  torch::Tensor inv_freq_;
  double attention_factor_;
  torch::Tensor cos_, sin_;
  int64_t capacity_ = 0;
  at::ScalarType dtype_ = at::ScalarType::Undefined;
};

ChainRope chain_rope(RopeTable& table, int64_t start, int64_t T, at::ScalarType dtype) {
  auto [cos, sin] = table.consecutive(start, T, dtype);
  const int64_t S = start + T;
  OptTensor mask;  // none for one token: it sees every column
  if (T > 1) {
    mask = torch::empty({1, 1, T, S}, torch::TensorOptions().dtype(torch::kBool));
    causal_mask(mask->data_ptr<bool>(), start, T);
  }
  return {cos, sin, mask};
}

// at::embedding(table, tokens) for tokens [B, T] int64: the rows copied into a fresh [B, T, d] tensor.
torch::Tensor embed(const torch::Tensor& table, const torch::Tensor& tokens) {
  if (table.dim() != 2 || !table.is_contiguous() || tokens.scalar_type() != at::kLong || !tokens.is_contiguous() ||
      tokens.dim() != 2)
    return at::embedding(table, tokens);
  const int64_t T = tokens.numel(), V = table.size(0), d = table.size(1), bytes = d * table.element_size();
  torch::Tensor out = torch::empty({tokens.size(0), tokens.size(1), d}, table.options());
  const int64_t* ids = tokens.data_ptr<int64_t>();
  const char* rows = static_cast<const char*>(table.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(ids[t] >= 0 && ids[t] < V, "embedding: token id ", ids[t], " outside the vocabulary [0, ", V, ")");
    std::memcpy(o + t * bytes, rows + ids[t] * bytes, bytes);
  }
  return out;
}

// torch::cat({norm(a), norm(b)}, -1) for a, b [1, T, *] (a norm absent: the rows as they are), the
// norms rms_norm_op's rows written straight into the halves.
torch::Tensor join_normed(const torch::Tensor& a, const OptTensor& a_norm, double a_eps, const torch::Tensor& b,
                          const OptTensor& b_norm, double b_eps) {
  const auto dtype = a.scalar_type();
  if (b.scalar_type() != dtype || a.dim() != 3 || b.dim() != 3 || a.size(1) != b.size(1) ||
      (a_norm.has_value() && a_norm->scalar_type() != dtype) || (b_norm.has_value() && b_norm->scalar_type() != dtype)) {
    const auto na = a_norm.has_value() ? rms_norm_op(a, *a_norm, a_eps) : a;
    return torch::cat({na, b_norm.has_value() ? rms_norm_op(b, *b_norm, b_eps) : b}, -1);
  }
  const auto ac = a.contiguous(), bc = b.contiguous();
  const int64_t T = a.size(1), da = a.size(2), db = b.size(2), width = da + db;
  torch::Tensor out = torch::empty({1, T, width}, a.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "join_normed", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    auto half = [&](const torch::Tensor& x, const OptTensor& norm, double eps, int64_t offset, int64_t n) {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      for (int64_t t = 0; t < T; ++t) {
        if (norm.has_value())
          rms_kernels::rms_norm_rows(xp + t * n, norm->data_ptr<scalar_t>(), o + t * width + offset, 1, n,
                                     static_cast<float>(eps));
        else
          std::memcpy(o + t * width + offset, xp + t * n, n * sizeof(scalar_t));
      }
    };
    half(ac, a_norm, a_eps, 0, da);
    half(bc, b_norm, b_eps, da, db);
  });
  return out;
}

std::vector<int64_t> argmax_rows(const torch::Tensor& logits);  // defined after DraftStep

// rows [R, w] of B sequences, lengths[b] rows each in order -> the last counts[b] rows of each, in
// order [sum counts, w].
torch::Tensor tail_rows(const torch::Tensor& rows, const std::vector<int64_t>& lengths,
                        const std::vector<int64_t>& counts) {
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  torch::Tensor out = torch::empty({total, rows.size(1)}, rows.options());
  const int64_t bytes = rows.size(1) * rows.element_size();
  const char* from = static_cast<const char*>(rows.data_ptr());
  char* to = static_cast<char*>(out.data_ptr());
  for (size_t b = 0; b < lengths.size(); from += lengths[b++] * bytes) {
    std::memcpy(to, from + (lengths[b] - counts[b]) * bytes, counts[b] * bytes);
    to += counts[b] * bytes;
  }
  return out;
}

// rows [R, w] of B sequences, lengths[b] rows each in order -> [B, width, w]: sequence b's rows, then
// copies of its last (a view where every sequence has `width`).
torch::Tensor pad_segments(const torch::Tensor& rows, const std::vector<int64_t>& lengths, int64_t width) {
  const int64_t B = static_cast<int64_t>(lengths.size()), w = rows.size(1);
  if (rows.size(0) == B * width) return rows.view({B, width, w});
  torch::Tensor out = torch::empty({B, width, w}, rows.options());
  const int64_t bytes = w * rows.element_size();
  const char* from = static_cast<const char*>(rows.data_ptr());
  char* to = static_cast<char*>(out.data_ptr());
  for (int64_t b = 0; b < B; from += lengths[b] * bytes, ++b) {
    std::memcpy(to + b * width * bytes, from, lengths[b] * bytes);
    for (int64_t t = lengths[b]; t < width; ++t)
      std::memcpy(to + (b * width + t) * bytes, from + (lengths[b] - 1) * bytes, bytes);
  }
  return out;
}

// Tapped states, each [.., d] -> their concatenation [.., n x d] in order (the raw feature an EAGLE-3 or
// DFlash drafter reads), each state then a view of it; nullopt without taps. A torch.cat of the states
// after the call was ~36 us of cold host work a step in a line profile (EAGLE-3, W4A8, 4 in flight).
std::optional<torch::Tensor> tap_block(std::vector<torch::Tensor>& tapped) {
  if (tapped.empty()) return std::nullopt;
  if (tapped.size() == 1) return tapped[0];
  auto block = torch::cat(tapped, -1);
  const int64_t d = tapped[0].size(-1);
  for (size_t j = 0; j < tapped.size(); ++j) tapped[j] = block.narrow(-1, static_cast<int64_t>(j) * d, d);
  return block;
}

// models/native_stack.py Watch.current(): whether dicts[i][keys[i]] is values[i] for every i (identity),
// one loop over the dicts' tables: 41 us against the Python form's 71 for 150 triples, right after a forward.
bool watch_current(const py::list& dicts, const py::list& keys, const py::list& values) {
  const Py_ssize_t n = PyList_GET_SIZE(dicts.ptr());
  if (PyList_GET_SIZE(keys.ptr()) != n || PyList_GET_SIZE(values.ptr()) != n) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* holder = PyList_GET_ITEM(dicts.ptr(), i);
    if (!PyDict_Check(holder)) return false;
    // A borrowed reference, or nullptr where the key is missing (a lookup error is cleared: not current).
    PyObject* value = PyDict_GetItemWithError(holder, PyList_GET_ITEM(keys.ptr(), i));
    if (value != PyList_GET_ITEM(values.ptr(), i)) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

// A model's forward for one sequence's contiguous new tokens as one C++ call (models/native_stack.py
// NativeChain, for engine/runner.py): embedding, RoPE, the layer stack, then the LM head at the last
// `num_logits` rows in float32, what Runner._forward computes for such a batch, op for op. Around the
// stack, that Python cost ~0.3-0.4 ms a forward on a 2-core EPYC (its objects are cold after the
// stack's weights streamed through the caches).
class ChainForward {
 public:
  ChainForward(torch::Tensor embedding, torch::Tensor inv_freq, double attention_factor, Linear head)
      : embedding_(std::move(embedding)), rope_(std::move(inv_freq), attention_factor), head_(std::move(head)) {}

  // token_ids (T) at cache columns start .. of row `slot` -> (final-normed hidden [1, T, d], the
  // states of `taps`, logits [1, num_logits, V] float32 of the last num_logits tokens, with `argmax`
  // each logits row's argmax as torch.argmax picks it, else nothing: computed while the logits are in
  // the caches, where after the call a greedy step's argmax cost ~19 us (one row) to ~45 us (four rows) of
  // cold host work; the taps' `tap_block`).
  std::tuple<torch::Tensor, std::vector<torch::Tensor>, torch::Tensor, std::vector<int64_t>,
             std::optional<torch::Tensor>>
  forward(
      Stack& stack, const std::vector<int64_t>& token_ids, int64_t slot, int64_t start, int64_t num_logits,
      const std::vector<int64_t>& taps, bool argmax) {
    const int64_t T = static_cast<int64_t>(token_ids.size());
    // The ids as a [1, T] view of the list's copy (with a Python-side torch.tensor, the host time before
    // this call was 34-40 us a w4a8 forward; 10-13 without).
    const auto tokens = torch::from_blob(const_cast<int64_t*>(token_ids.data()), {1, T}, torch::kLong);
    const auto x = embed(embedding_, tokens);  // [1, T, d]
    const auto rope = chain_rope(rope_, start, T, x.scalar_type());
    auto [hidden, tapped] = stack.forward(x, rope.cos, rope.sin, slot, slot + 1, start, start + T, rope.mask, taps,
                                          std::nullopt);
    // Runner._forward: the last num_logits rows (a gather: contiguous), then compute_logits (row_linear, float).
    const auto selected = hidden.slice(1, T - num_logits, T).contiguous();  // [1, N, d]
    const auto logits = head_(selected.reshape({-1, selected.size(-1)})).view({1, num_logits, -1}).to(torch::kFloat);
    const auto block = tap_block(tapped);
    return {hidden, tapped, logits, argmax ? argmax_rows(logits.view({num_logits, -1})) : std::vector<int64_t>{},
            block};
  }

  // B sequences' chains (a decode step at concurrency B, or its verification): tokens [1, R] int64,
  // sequence b's lengths[b] of them in order, written at columns starts[b].. of cache row slots[b]
  // (causal), its logits at its last num_logits[b] -> as `forward` per sequence, batched: (final-normed
  // hidden [B, W, d] and taps [B, W, d], logits [B, N, V] float32, with `argmax` each sequence's
  // logits rows' argmaxes, the taps' block), W = max lengths, N = max num_logits; a row past a sequence's
  // own holds a copy of its last (Runner._forward pads logits so). nullopt where the stack's lean path does not serve
  // the batch (the caller then runs it as a ragged batch).
  using BatchOutput = std::tuple<torch::Tensor, std::vector<torch::Tensor>, torch::Tensor,
                                 std::vector<std::vector<int64_t>>, std::optional<torch::Tensor>>;
  std::optional<BatchOutput> batch(Stack& stack, const torch::Tensor& tokens, const std::vector<int64_t>& slots,
                                   const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths,
                                   const std::vector<int64_t>& num_logits, const std::vector<int64_t>& taps,
                                   bool argmax) {
    const size_t B = slots.size();
    if (starts.size() != B || lengths.size() != B || num_logits.size() != B || tokens.dim() != 2 ||
        tokens.size(0) != 1)
      return std::nullopt;
    int64_t rows = 0, width = 0, logit_rows = 0, logit_width = 0;
    for (size_t b = 0; b < B; ++b) {
      if (num_logits[b] < 1 || num_logits[b] > lengths[b]) return std::nullopt;
      rows += lengths[b], width = std::max(width, lengths[b]);
      logit_rows += num_logits[b], logit_width = std::max(logit_width, num_logits[b]);
    }
    if (rows != tokens.size(1)) return std::nullopt;
    const auto segments = stack.chain_segments(embedding_.scalar_type(), slots, starts, lengths);
    if (!segments.has_value()) return std::nullopt;
    const auto x = embed(embedding_, tokens);  // [1, R, d]
    const auto [cos, sin] = rope_.rows(chain_positions(starts, lengths), x.scalar_type());
    auto out = stack.lean_batch(x, cos, sin, *segments, taps);
    if (!out.has_value()) return std::nullopt;
    auto& [hidden, tapped] = *out;
    const int64_t d = hidden.size(-1);
    // Each sequence's last num_logits rows (all of them: the hidden states as they are), then the head.
    const auto flat = hidden.view({rows, d});
    const auto selected = logit_rows == rows ? flat : tail_rows(flat, lengths, num_logits);
    const auto logits = head_(selected).to(torch::kFloat);  // [logit_rows, V]
    std::vector<std::vector<int64_t>> choices;
    if (argmax) {
      const auto flat = argmax_rows(logits);
      choices.reserve(B);
      for (size_t b = 0, row = 0; b < B; row += num_logits[b++])
        choices.emplace_back(flat.begin() + row, flat.begin() + row + num_logits[b]);
    }
    for (auto& t : tapped) t = pad_segments(t.view({rows, d}), lengths, width);
    const auto block = tap_block(tapped);
    return std::make_tuple(pad_segments(hidden.view({rows, d}), lengths, width), tapped,
                           pad_segments(logits, num_logits, logit_width), choices, block);
  }

 private:
  torch::Tensor embedding_;
  RopeTable rope_;
  Linear head_;
};

// One chain-drafting step with a greedy pick (or a chain of steps, greedy or sampled), as one C++
// call: a feature drafter's (EAGLE, EAGLE-3, MTP) or a draft model's
// (speculative/propose/native_step.py). The proposers' Python step (entry
// and mask building, embedding, RoPE tables, input norms and concatenation, the layers, the head,
// softmax / argmax / max over the vocabulary) costs ~0.8 ms of ops around ~0.3 ms of matmuls on a
// 2-core EPYC; this runs the same ops in the same order, so the drafter's output and its argmax
// are bit-identical to the modules'. The drafted token's probability (its confidence, for p_min
// and D-Cut) is 1 / sum(exp(logits - max)) over the scored tokens: equal to the softmax's maximum up
// to rounding.
class DraftStep {
 public:
  // (the first i with the largest float(s[i]), NaN counting as the largest: torch.argmax's pick; that value).
  template <typename scalar_t>
  static std::pair<int64_t, float> first_max(const scalar_t* s, int64_t n) {
#if SPECDECODE_LEAN_PATH
    if constexpr (!std::is_same_v<scalar_t, double>) {  // double scores: the scalar loop
      const float max = scores_max(s, n, 1.0f, nullptr);
      if (std::isfinite(max)) return {first_equal(s, n, max), max};
    }
#endif
    int64_t best = 0;  // NaN or infinite scores: scalar
    float max = static_cast<float>(s[0]);
    for (int64_t i = 1; i < n && !std::isnan(max); ++i) {
      const float v = static_cast<float>(s[i]);
      if (v > max || std::isnan(v)) best = i, max = v;
    }
    return {best, max};
  }

  // embedding [V, d]: the target's; inv_freq, attention_factor: the drafter's RotaryEmbedding.
  // eagle3 (attn_input): attention reads cat(norm(e; embed_norm), norm(f; feature_norm)) and f is the
  // residual; else x = fc(cat(e', f')) with e', f' normed where a norm is given (MTP), raw (EAGLE);
  // a draft model (no features): x = e, and its stack ends in its final norm.
  // head_norm (optional) then head scores the draft vocabulary; head_ids [n] maps a scored row to
  // its target token id (a reduced head), absent when the head scores the whole vocabulary.
  DraftStep(torch::Tensor embedding, torch::Tensor inv_freq, double attention_factor, bool attn_input,
            OptTensor embed_norm, double embed_eps, OptTensor feature_norm, double feature_eps,
            std::optional<Linear> fc, OptTensor head_norm, double head_eps, Linear head, OptTensor head_ids)
      : embedding_(std::move(embedding)), rope_(std::move(inv_freq), attention_factor), attn_input_(attn_input),
        embed_norm_(std::move(embed_norm)), embed_eps_(embed_eps),
        feature_norm_(std::move(feature_norm)), feature_eps_(feature_eps), fc_(std::move(fc)),
        head_norm_(std::move(head_norm)), head_eps_(head_eps), head_(std::move(head)), head_ids_(std::move(head_ids)) {}

  // tokens [1, T] int64 and features [1, T, d] (a feature drafter's; position t takes token t + 1 and
  // feature t): drafter positions start .. start + T - 1 of cache row `slot`, through `layers` (the
  // drafter's block, or the draft model's stack) -> (o [1, T, d], the drafted token after the last
  // position, its probability).
  std::tuple<torch::Tensor, int64_t, double> step(Stack& layers, const torch::Tensor& tokens,
                                                  const OptTensor& features, int64_t slot, int64_t start) {
    const auto [out, scores] = forward(layers, tokens, features, slot, start);
    int64_t best = 0;
    double top = 0.0;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scores.scalar_type(), "draft_pick", [&] {
      std::tie(best, top) = pick(scores.data_ptr<scalar_t>(), scores.size(-1));
    });
    return {out, token_id(best), top};
  }

  // B sequences' next drafting step as one lean forward, greedy: sequence b feeds lengths[b] of tokens
  // [1, R] (and of features [1, R, d]) at drafter positions starts[b].. of cache row slots[b], causal
  // -> (o at each sequence's last position [B, d], each one's drafted token and its probability): `step`
  // of each sequence alone, batched (the linears and the head over every row at once). nullopt where the
  // stack's lean path does not serve the batch (the caller then runs the Python step).
  std::optional<std::tuple<torch::Tensor, std::vector<int64_t>, std::vector<double>>> batch(
      Stack& layers, const torch::Tensor& tokens, const OptTensor& features, const std::vector<int64_t>& slots,
      const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths) {
    const size_t B = slots.size();
    if (tokens.dim() != 2 || tokens.size(0) != 1 || starts.size() != B || lengths.size() != B) return std::nullopt;
    const int64_t R = tokens.size(1);
    if (std::accumulate(lengths.begin(), lengths.end(), int64_t{0}) != R) return std::nullopt;
    const auto segments = layers.chain_segments(embedding_.scalar_type(), slots, starts, lengths);
    if (!segments.has_value()) return std::nullopt;
    const auto [cos, sin] = rope_.rows(chain_positions(starts, lengths), embedding_.scalar_type());
    const auto [x, attn_input] = inputs(tokens, features);
    const auto out = layers.lean_batch(x, cos, sin, *segments, {}, attn_input);
    if (!out.has_value()) return std::nullopt;
    const torch::Tensor& o = out->first;  // [1, R, d]
    const auto last = tail_rows(o.view({R, o.size(-1)}), lengths, std::vector<int64_t>(B, 1));  // [B, d]
    const auto scores = head_scores(last);  // [B, n]
    std::vector<int64_t> drafted(B);
    std::vector<double> tops(B);
    const int64_t n = scores.size(-1);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scores.scalar_type(), "draft_pick", [&] {
      for (size_t b = 0; b < B; ++b) {
        const auto [best, top] = pick(scores.data_ptr<scalar_t>() + b * n, n);
        drafted[b] = token_id(best), tops[b] = top;
      }
    });
    return std::make_tuple(last, drafted, tops);
  }

  // Up to max_steps steps in one call (no Python between them): the first as `step` with token_ids
  // (T, a list) and features at `start`, step s + 1 feeding the token drafted at s (and the drafter's
  // output at its last position) at position next_start + s. Greedy, or, with temperature > 0, sampled: q =
  // softmax(scores / temperature) over the scored tokens is written to probs [max_steps, V] (row s,
  // at the tokens' ids; float32, zeros elsewhere) and step s draws by inverse CDF with uniforms[s]
  // (float64 [max_steps]; sampling.py inverse_cdf: the same sequential float64 sums), its
  // probability q's maximum. Stops after a step whose probability is below p_min (ChainDraft.record
  // drops that token, then the chain ends), and, given D-Cut's stop rule for one sequence (binned
  // [k, bins, 2], pooled [bins, 2], scale [k], theta [k - 1] float64, bin_prior:
  // speculative/policy/controller.py OneRowStop), after a step it says not to draft on from.
  // Returns the drafted tokens and probabilities of the steps run.
  std::pair<std::vector<int64_t>, std::vector<double>> chain(Stack& layers, const std::vector<int64_t>& token_ids,
                                                             OptTensor features,
                                                             int64_t slot, int64_t start, int64_t next_start,
                                                             int64_t max_steps, double p_min, OptTensor binned,
                                                             OptTensor pooled, OptTensor scale, OptTensor theta,
                                                             double bin_prior, double temperature, OptTensor uniforms,
                                                             OptTensor probs) {
    const bool rule = binned.has_value(), sampled = temperature > 0.0;
    if (rule) {
      TORCH_CHECK(pooled.has_value() && scale.has_value() && theta.has_value(), "chain: a stop rule needs every table");
      for (const OptTensor* t : {&binned, &pooled, &scale, &theta})
        TORCH_CHECK((*t)->scalar_type() == at::kDouble && (*t)->is_contiguous(), "chain: float64 contiguous tables");
      TORCH_CHECK(binned->dim() == 3 && binned->size(2) == 2 && pooled->dim() == 2 && pooled->size(0) == binned->size(1) &&
                      pooled->size(1) == 2 && scale->numel() == binned->size(0) && theta->numel() >= max_steps - 1 &&
                      binned->size(0) >= max_steps,
                  "chain: stop-rule tables of mismatched shapes");
    }
    if (sampled) {
      TORCH_CHECK(uniforms.has_value() && uniforms->scalar_type() == at::kDouble && uniforms->is_contiguous() &&
                      uniforms->numel() >= max_steps,
                  "chain: sampling needs max_steps float64 uniforms");
      TORCH_CHECK(probs.has_value() && probs->scalar_type() == at::kFloat && probs->is_contiguous() && probs->dim() == 2 &&
                      probs->size(0) >= max_steps && probs->size(1) == embedding_.size(0),
                  "chain: sampling needs a contiguous float32 probs [max_steps, V]");
    }
    std::vector<int64_t> drafted;
    std::vector<double> tops;
    double survival = 1.0, tau = 1.0;  // the rule's a and tau (DepthController.one_row_survival)
    // The first step's ids as a [1, T] view of the list's copy, each later step's as a [1, 1] view of
    // `fed` (a Python-side torch.tensor of the ids cost ~40 us, cold after the target's forward).
    int64_t fed = 0;
    torch::Tensor tokens = torch::from_blob(const_cast<int64_t*>(token_ids.data()),
                                            {1, static_cast<int64_t>(token_ids.size())}, torch::kLong);
    for (int64_t s = 0; s < max_steps; ++s) {
      const auto [out, scores] = forward(layers, tokens, features, slot, start);
      int64_t best = 0;
      double top = 0.0;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scores.scalar_type(), "draft_pick", [&] {
        std::tie(best, top) =
            sampled ? draw(scores.data_ptr<scalar_t>(), scores.size(-1), static_cast<float>(temperature),
                           uniforms->data_ptr<double>()[s], probs->data_ptr<float>() + s * probs->size(1))
                    : pick(scores.data_ptr<scalar_t>(), scores.size(-1));
      });
      const int64_t token = token_id(best);
      drafted.push_back(token);
      tops.push_back(top);
      if (top < p_min) break;
      if (rule && s + 1 < max_steps) {
        if (std::isnan(top)) break;
        const int64_t bins = pooled->size(0);
        const int64_t j = std::min<int64_t>(bins - 1, std::max<int64_t>(0, static_cast<int64_t>(top * bins)));
        const double* pooled_j = pooled->data_ptr<double>() + 2 * j;
        const double* binned_j = binned->data_ptr<double>() + 2 * (s * bins + j);
        const double prior =
            (pooled_j[0] + bin_prior * std::min(1.0, top * scale->data_ptr<double>()[s])) / (pooled_j[1] + bin_prior);
        survival *= (binned_j[0] + bin_prior * prior) / (binned_j[1] + bin_prior);
        tau += survival;
        if (!(survival / tau > theta->data_ptr<double>()[s])) break;
      }
      fed = token;
      tokens = torch::from_blob(&fed, {1, 1}, torch::kLong);
      if (features.has_value()) features = out.slice(1, out.size(1) - 1, out.size(1));
      start = next_start + s;
    }
    return {drafted, tops};
  }

 private:
  // The drafter's forward, then its head at the last position -> (o [1, T, d], scores [1, n]).
  std::pair<torch::Tensor, torch::Tensor> forward(Stack& layers, const torch::Tensor& tokens, const OptTensor& features,
                                                  int64_t slot, int64_t start) {
    const int64_t T = tokens.size(1), S = start + T;
    const auto rope = chain_rope(rope_, start, T, embedding_.scalar_type());
    const auto [x, attn_input] = inputs(tokens, features);
    const auto out = layers.forward(x, rope.cos, rope.sin, slot, slot + 1, start, S, rope.mask, {}, attn_input).first;
    return {out, head_scores(out.select(1, T - 1))};  // [1, n]
  }

  // The drafter's input rows (speculative/propose/drafters/eagle/model.py) from tokens [1, T] and
  // features [1, T, d] -> (x, what the first layer's attention reads where not its input norm of x).
  std::pair<torch::Tensor, OptTensor> inputs(const torch::Tensor& tokens, const OptTensor& features) const {
    const auto e = embed(embedding_, tokens);  // [1, T, d]
    if (!features.has_value()) return {e, std::nullopt};
    if (attn_input_)  // attention reads cat(norm(e), norm(f)); f is the residual
      return {*features, join_normed(e, embed_norm_, embed_eps_, *features, feature_norm_, feature_eps_)};
    // x = fc(cat(e', f')), normed where a norm is given
    return {(*fc_)(join_normed(e, embed_norm_, embed_eps_, *features, feature_norm_, feature_eps_)), std::nullopt};
  }

  // The head over the drafter's outputs at the positions it drafts after, h [R, d] -> scores [R, n]
  // (EagleProposer.vocab_logits; a draft model's compute_logits).
  torch::Tensor head_scores(torch::Tensor h) const {
    if (head_norm_.has_value()) h = rms_norm_op(h, *head_norm_, head_eps_);
    return head_(h.reshape({-1, h.size(-1)})).contiguous();
  }

  // A scored row's token id (a reduced head maps it).
  int64_t token_id(int64_t row) const { return head_ids_.has_value() ? head_ids_->data_ptr<int64_t>()[row] : row; }

  // Scores s [n] -> a draw from q = softmax(float(s) / temperature): q written at the scored tokens'
  // ids of q_out [V]; (the first token whose float64 running sum of q exceeds u * its total, kept
  // below the total as in sampling.py inverse_cdf; q's maximum). Tokens of zero mass are never drawn.
  template <typename scalar_t>
  std::pair<int64_t, double> draw(const scalar_t* s, int64_t n, float temperature, double u, float* q_out) {
    scaled_.resize(n);
    float* q = scaled_.data();
    float top;
#if SPECDECODE_LEAN_PATH
    if constexpr (!std::is_same_v<scalar_t, double>) {  // double scores: the scalar loops
      const float max = scores_max(s, n, temperature, q);  // q = float(s) / temperature
      if (std::isfinite(max)) {
        top = 1.0f / exp_sum(q, n, max, q);  // q = exp(q - max); the maximum's is exactly 1
        const __m256 inverse = _mm256_set1_ps(top);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(q + i, _mm256_mul_ps(_mm256_loadu_ps(q + i), inverse));
        for (; i < n; ++i) q[i] *= top;
        return {inverse_cdf(q, n, u, q_out), top};
      }
    }
#endif
    float max = -std::numeric_limits<float>::infinity();  // NaN or infinite scores: scalar
    for (int64_t i = 0; i < n; ++i) max = std::max(max, q[i] = static_cast<float>(s[i]) / temperature);
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += q[i] = std::exp(q[i] - max);
    const float inverse = static_cast<float>(1.0 / sum);
    top = 0.0f;
    for (int64_t i = 0; i < n; ++i) top = std::max(top, q[i] *= inverse);
    return {inverse_cdf(q, n, u, q_out), top};
  }

  // q [n] (>= 0) -> q written at the scored tokens' ids of q_out [V]; the first row whose float64
  // running sum exceeds u * the total (sequential sums, as sampling.py inverse_cdf's cumsum).
  int64_t inverse_cdf(const float* q, int64_t n, double u, float* q_out) const {
    const int64_t* ids = head_ids_.has_value() ? head_ids_->data_ptr<int64_t>() : nullptr;
    if (ids) {
      for (int64_t i = 0; i < n; ++i) q_out[ids[i]] = q[i];
    } else {
      std::memcpy(q_out, q, n * sizeof(float));
    }
    const int64_t i = first_above(q, n, u);
    if (i >= 0) return i;
    int64_t last = 0;  // a row of no mass (NaN scores; no caller's q sums to zero): its last positive entry
    for (int64_t j = 0; j < n; ++j)
      if (q[j] > 0.0f) last = j;
    return last;
  }

  // Scores s [n] -> (the first maximum, NaN counting as the largest as in torch.argmax: the full
  // vocabulary's argmax too, as a reduced head's ids ascend; its probability 1 / sum(exp(s - max)),
  // the softmax's maximum up to rounding). The scores as float are the float logits exactly.
  template <typename scalar_t>
  static std::pair<int64_t, double> pick(const scalar_t* s, int64_t n) {
    const auto [best, max] = first_max(s, n);
#if SPECDECODE_LEAN_PATH
    if constexpr (!std::is_same_v<scalar_t, double>)  // double scores: the scalar loop
      if (std::isfinite(max)) return {best, static_cast<double>(1.0f / exp_sum(s, n, max, nullptr))};
#endif
    double sum = 0.0;  // NaN or infinite scores: scalar
    for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(static_cast<float>(s[i]) - max));
    return {best, static_cast<double>(static_cast<float>(1.0 / sum))};
  }

#if SPECDECODE_LEAN_PATH
  // 8 lanes over the vocabulary (~8x the scalar loops, whose std::exp over 8,192 scores cost ~30 us
  // a step); what they compute differs from the scalar loops' only in rounding.
  static __m256 load_scores8(const float* p) { return attention_kernels::load8(p); }
  static __m256 load_scores8(const at::BFloat16* p) { return attention_kernels::load8(p); }
  static __m256 load_scores8(const at::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }

  // max of x = float(s) / divisor (written to x_out where given; divisor 1 is not applied), NaN where
  // any x is NaN.
  template <typename scalar_t>
  static float scores_max(const scalar_t* s, int64_t n, float divisor, float* x_out) {
    const bool divide = divisor != 1.0f;
    const __m256 d = _mm256_set1_ps(divisor);
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), unordered = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 x = load_scores8(s + i);
      if (divide) x = _mm256_div_ps(x, d);
      if (x_out) _mm256_storeu_ps(x_out + i, x);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      vmax = _mm256_max_ps(vmax, x);
    }
    float max = attention_kernels::max8(vmax);
    bool nan = _mm256_movemask_ps(unordered) != 0;
    for (; i < n; ++i) {
      float x = static_cast<float>(s[i]);
      if (divide) x /= divisor;
      if (x_out) x_out[i] = x;
      nan |= std::isnan(x);
      max = std::max(max, x);
    }
    return nan ? std::numeric_limits<float>::quiet_NaN() : max;
  }

  // The first i with float(s[i]) == max (max one of them).
  template <typename scalar_t>
  static int64_t first_equal(const scalar_t* s, int64_t n, float max) {
    const __m256 m = _mm256_set1_ps(max);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const int hits = _mm256_movemask_ps(_mm256_cmp_ps(load_scores8(s + i), m, _CMP_EQ_OQ));
      if (hits) return i + __builtin_ctz(hits);
    }
    while (i < n && static_cast<float>(s[i]) != max) ++i;
    return i;
  }

  // sum of exp(float(x) - max) (max >= every x, finite), each written to e_out where given.
  template <typename scalar_t>
  static float exp_sum(const scalar_t* x, int64_t n, float max, float* e_out) {
    const __m256 m = _mm256_set1_ps(max);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = attention_kernels::exp_nonpositive(_mm256_sub_ps(load_scores8(x + i), m));
      if (e_out) _mm256_storeu_ps(e_out + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    float total = attention_kernels::fixed_sum8(sum);
    for (; i < n; ++i) {
      const float e = std::exp(static_cast<float>(x[i]) - max);
      if (e_out) e_out[i] = e;
      total += e;
    }
    return total;
  }
#endif

  torch::Tensor embedding_;
  RopeTable rope_;
  bool attn_input_;
  OptTensor embed_norm_;
  double embed_eps_;
  OptTensor feature_norm_;
  double feature_eps_;
  std::optional<Linear> fc_;
  OptTensor head_norm_;
  double head_eps_;
  Linear head_;
  OptTensor head_ids_;
  std::vector<float> scaled_;  // draw's scratch [n]
};

std::vector<int64_t> argmax_rows(const torch::Tensor& logits) {  // [R, V] float32, contiguous
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.size(1) > 0,
              "argmax_rows: float32 [R, V > 0] contiguous");
  const int64_t rows = logits.size(0), V = logits.size(1);
  const float* data = logits.data_ptr<float>();
  std::vector<int64_t> out(rows);
  for (int64_t r = 0; r < rows; ++r) out[r] = DraftStep::first_max(data + r * V, V).first;
  return out;
}

#if SPECDECODE_LEAN_PATH
torch::Tensor silu_mul_rows(const torch::Tensor& gate_up) {  // [T, 2I] float32 or bf16, contiguous
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0 &&
                  (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16),
              "silu_mul_rows: float32 or bf16 [T, 2I] contiguous");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  torch::Tensor act = torch::empty({T, I}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat)
    swiglu_kernels::product_rows(gate_up.data_ptr<float>(), T, I, act.data_ptr<float>());
  else
    swiglu_kernels::product_rows(gate_up.data_ptr<at::BFloat16>(), T, I, act.data_ptr<at::BFloat16>());
  return act;
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Linear>(m, "Linear");
  m.def("dense_linear", &dense_linear, "a dense layer: at::linear(x, weight, bias)", py::arg("weight"),
        py::arg("bias"));
  m.def("int8_linear", &int8_linear, "an int8 layer: specdecode_int8::int8_linear with these arguments");
  m.def("int4_linear", &int4_linear, "an int4 layer: specdecode_int4::int4_linear with these arguments");
  m.def("a8_linear", &a8_linear, "a w8a8 (weight_bits 8) or w4a8 (4) layer: specdecode_a8's op with these arguments");
  m.def("with_wide", &with_wide, "the layer, from wide_from rows on the layer `wide` (its packed dense copy)");
  m.def("argmax_rows", &argmax_rows, "float32 [R, V] contiguous -> torch.argmax of each row (NaN the largest)",
        py::arg("logits"));
#if SPECDECODE_LEAN_PATH
  m.def("silu_mul_rows", &silu_mul_rows, "the lean path's SwiGLU: [T, 2I] -> silu(gate) * up [T, I] (gate, then up)",
        py::arg("gate_up"));
#endif
  m.def("inverse_cdf", &inverse_cdf_rows, "sampling.py inverse_cdf: float32 probs [N, V], float64 u [N] -> int64 [N]",
        py::arg("probs"), py::arg("u"));
  m.def("verify_sampled_row", &verify_sampled_row,
        "speculative/verify/chain.py _one_sampled_row's rule from p: (accepted drafts, final token)", py::arg("p"),
        py::arg("q"), py::arg("drafts"), py::arg("num_draft"), py::arg("u"), py::arg("u_final"));
  m.def("bf16w_linear", &bf16w_linear, "a Bf16WeightLinear: specdecode_bf16w::gemm_bf16w at every width",
        py::arg("blocked"), py::arg("bias"), py::arg("out_features"));
  m.def("packed_linear", &packed_linear,
        "a PackedLinear: specdecode_bf16::gemm_bf16 on few_blocked up to few_upto rows, else mkldnn::_linear_pointwise");
  py::class_<Layer>(m, "Layer")
      .def(py::init([](torch::Tensor input_norm, torch::Tensor post_norm, OptTensor q_norm, OptTensor k_norm,
                       double eps, Linear qkv, Linear o_proj, Linear gate_up, Linear down, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t intermediate) {
        return Layer{std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm), eps,
                     std::move(qkv), std::move(o_proj), std::move(gate_up), std::move(down), num_heads,
                     num_kv_heads, head_dim, intermediate};
      }));
  py::class_<Stack>(m, "Stack")
      .def(py::init<std::vector<Layer>, OptTensor, double, bool, int64_t>(), py::arg("layers"), py::arg("final_norm"),
           py::arg("eps"), py::arg("cached_attention"), py::arg("lean_rows") = 0)
      .def("bind_cache", &Stack::bind_cache)
      .def("forward", &Stack::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slot_begin"),
           py::arg("slot_end"), py::arg("write_start"), py::arg("num_keys"), py::arg("mask"), py::arg("taps"),
           py::arg("attn_input"), py::arg("slot_ids") = py::none(), py::arg("write_indices") = py::none())
      .def("lean_forwards", &Stack::lean_forwards);
  py::class_<DraftStep>(m, "DraftStep")
      .def(py::init<torch::Tensor, torch::Tensor, double, bool, OptTensor, double, OptTensor, double,
                    std::optional<Linear>, OptTensor, double, Linear, OptTensor>())
      .def("step", &DraftStep::step)
      .def("batch", &DraftStep::batch)
      .def("chain", &DraftStep::chain);
  m.def("watch_current", &watch_current);
#if SPECDECODE_LEAN_PATH
  m.def("set_thread_team", &thread_team::set_enabled);  // off: every loop its own OpenMP region (A/B)
  m.def("thread_team_loops", &thread_team::loops);
#endif
  py::class_<ChainForward>(m, "ChainForward")
      .def(py::init<torch::Tensor, torch::Tensor, double, Linear>())
      .def("forward", &ChainForward::forward)
      .def("batch", &ChainForward::batch);
}
