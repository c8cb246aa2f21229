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
// biases), a dense SwiGLU MLP, dense, packed bf16, int8, int4, w8a8 or w4a8 linear layers, a batch whose sequences are contiguous
// cache rows writing the same columns (decode, chain verification, prefill of one sequence), not
// exact mode.
// RoPE's products and sum must round separately, as PyTorch's ops round them (the build passes
// -ffp-contract=fast for the other kernels).
#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace {

using OptTensor = std::optional<torch::Tensor>;

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
// layout up to `few_upto` rows), or a dense weight: an nn.Linear, a FusedLinear, a quantised
// layer's dequantised copy (at::linear).
struct Linear {
  int bits = 0;  // 0: dense; 8 or 4: the few-row op of that width; 16: packed bf16/fp16
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

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (wide && x.numel() >= wide_from * x.size(-1)) return (*wide)(x);
    if (bits == 16) {  // PackedLinear._matmul
      const int64_t K = x.size(-1);
      if (few_blocked.has_value() && x.numel() <= few_upto * K) {
        auto out_shape = x.sizes().vec();
        out_shape.back() = out_features;
        return gemm_bf16_op(x.reshape({-1, K}), *few_blocked, bias, out_features).view(out_shape);
      }
      return packed_linear_op(x, weight, bias);
    }
    if (a8_bits != 0) return a8_linear_op(a8_bits, x, weight, few_scales, bias, out_features);
    if (bits == 8)
      return int8_linear_op(x, weight, few_scales, few_bias, out_features, few_upto, dense, qweight, qscales, bias);
    if (bits == 4)
      return int4_linear_op(x, weight, few_scales, few_bias, out_features, group, few_upto, dense, qweight, qscales,
                            bias);
    return at::linear(x, weight, bias);
  }
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
  Linear l;
  l.a8_bits = static_cast<int>(weight_bits);
  l.weight = std::move(packed);
  l.few_scales = std::move(params);
  l.bias = std::move(bias);  // padded fp32, as the ops take it
  l.out_features = out_features;
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

// models/layers.py apply_rope, y = x * cos + cat(-x2, x1) * sin (rotate-half), in one loop instead of
// seven ops: each product and the sum rounded to the dtype as PyTorch's mul, mul and add round them
// (float arithmetic, no FMA: fp-contract is off in this file). x, out [B, T, H, D] and cos, sin
// [B, T, 1, D] with any strides but a contiguous last dimension; `out` may be a permuted view (the
// GQA-folded query layout is written directly).
template <typename scalar_t>
void rope_rows(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& out) {
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  const auto xs = x.strides(), os = out.strides(), cs = cos.strides(), ss = sin.strides();
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* cp = cos.data_ptr<scalar_t>();
  const scalar_t* sp = sin.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const scalar_t* c = cp + b * cs[0] + t * cs[1];
      const scalar_t* sn = sp + b * ss[0] + t * ss[1];
      for (int64_t h = 0; h < H; ++h) {
        const scalar_t* xr = xp + b * xs[0] + t * xs[1] + h * xs[2];
        scalar_t* o = op + b * os[0] + t * os[1] + h * os[2];
        for (int64_t d = 0; d < D; ++d) {
          const float rotated = d < half ? -static_cast<float>(xr[d + half]) : static_cast<float>(xr[d - half]);
          const scalar_t a = static_cast<scalar_t>(static_cast<float>(xr[d]) * static_cast<float>(c[d]));
          const scalar_t r = static_cast<scalar_t>(rotated * static_cast<float>(sn[d]));
          o[d] = static_cast<scalar_t>(static_cast<float>(a) + static_cast<float>(r));
        }
      }
    }
  }
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

class Stack {
 public:
  // cached_attention: attention by specdecode_attn::cached_attention (as the modules where it is built),
  // else PyTorch's scaled_dot_product_attention.
  Stack(std::vector<Layer> layers, OptTensor final_norm, double eps, bool cached_attention)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), eps_(eps),
        cached_attention_(cached_attention) {}

  // The cache this stack writes: per layer K and V [slots, max_len + 1, kv_heads, head_dim].
  void bind_cache(std::vector<torch::Tensor> k, std::vector<torch::Tensor> v) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(), "one K and one V cache per layer");
    k_ = std::move(k);
    v_ = std::move(v);
  }

  // x [B, T, d] (a model's embeddings, a block's residual input), cos/sin [B, T, 1, head_dim]; the
  // batch's slots are the cache rows [slot_begin, slot_end) and its tokens write columns
  // [write_start, write_start + T); attention reads columns [0, num_keys) under `mask`
  // [B, 1, T, num_keys] (None: every query sees every one). `attn_input` replaces the first layer's
  // input norm as what its attention reads (EAGLE-3). Returns the last layer's output, final-normed
  // where the stack has a final norm, and the states of `taps` (models/llama.py's numbering: i is
  // layer i's input, L the last layer's output before the final norm).
  std::pair<torch::Tensor, std::vector<torch::Tensor>> forward(torch::Tensor x, const torch::Tensor& cos,
                                                               const torch::Tensor& sin, int64_t slot_begin,
                                                               int64_t slot_end, int64_t write_start,
                                                               int64_t num_keys, const OptTensor& mask,
                                                               const std::vector<int64_t>& taps,
                                                               const OptTensor& attn_input) {
    TORCH_CHECK(k_.size() == layers_.size(), "no cache bound");
    const int64_t L = static_cast<int64_t>(layers_.size());
    std::vector<torch::Tensor> tapped(taps.size());
    auto tap = [&](int64_t i) {
      for (size_t j = 0; j < taps.size(); ++j)
        if (taps[j] == i) tapped[j] = x;
    };
    for (int64_t i = 0; i < L; ++i) {
      tap(i);
      const auto h = i == 0 && attn_input.has_value() ? *attn_input : rms_norm_op(x, layers_[i].input_norm, layers_[i].eps);
      x = layer_forward(layers_[i], x, h, cos, sin, k_[i], v_[i], slot_begin, slot_end, write_start, num_keys, mask,
                        cached_attention_);
    }
    tap(L);
    return {final_norm_.has_value() ? rms_norm_op(x, *final_norm_, eps_) : x, tapped};
  }

 private:
  // models/llama.py DecoderLayer.forward with Attention's cached path and the MLP, op for op; `h` is
  // what attention reads (the input norm of x, or EAGLE-3's attention input).
  static torch::Tensor layer_forward(const Layer& layer, const torch::Tensor& x, const torch::Tensor& h,
                                     const torch::Tensor& cos,
                                     const torch::Tensor& sin, const torch::Tensor& cache_k,
                                     const torch::Tensor& cache_v, int64_t slot_begin, int64_t slot_end,
                                     int64_t write_start, int64_t num_keys, const OptTensor& mask,
                                     bool cached_attention) {
    const int64_t B = x.size(0), T = x.size(1);
    const int64_t H = layer.num_heads, KVH = layer.num_kv_heads, D = layer.head_dim;
    const auto qkv = layer.qkv(h).split_with_sizes({H * D, KVH * D, KVH * D}, -1);  // [B, T, *] views
    auto q = qkv[0].view({B, T, H, D});
    auto k = qkv[1].view({B, T, KVH, D});
    const auto v = qkv[2].view({B, T, KVH, D});
    if (layer.k_norm.has_value()) k = rms_norm_op(k, *layer.k_norm, layer.eps);
    if (layer.q_norm.has_value()) q = rms_norm_op(q, *layer.q_norm, layer.eps);
    // Cache writes and reads as models/layers.py write_columns / read_columns (slices, no gather); the
    // rotated K goes straight into its cache columns (the modules rotate into a new tensor, then copy
    // it there: the same values).
    apply_rope_into(k, cos, sin, cache_k.slice(0, slot_begin, slot_end).slice(1, write_start, write_start + T));
    cache_v.slice(0, slot_begin, slot_end).slice(1, write_start, write_start + T).copy_(v);
    const auto keys = cache_k.slice(0, slot_begin, slot_end).slice(1, 0, num_keys);  // [B, S, KVH, D]
    const auto values = cache_v.slice(0, slot_begin, slot_end).slice(1, 0, num_keys);
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
  std::vector<torch::Tensor> k_, v_;
};

// What one sequence's T new tokens at cache columns start .. start + T - 1 attend with: RoPE tables
// as models/layers.py RotaryEmbedding computes them, and the causal mask of engine/ragged.py
// _one_chain (none for one token: it sees every column).
struct ChainRope {
  torch::Tensor cos, sin;  // [1, T, 1, D]
  OptTensor mask;          // [1, 1, T, start + T] bool
};

ChainRope chain_rope(const torch::Tensor& inv_freq, double attention_factor, int64_t start, int64_t T,
                     at::ScalarType dtype) {
  const auto options = torch::TensorOptions().dtype(torch::kLong);
  const int64_t S = start + T;
  const auto positions = torch::arange(start, S, options).unsqueeze(0);  // [1, T], also the columns written
  OptTensor mask;
  if (T > 1)
    mask = torch::arange(S, options).unsqueeze(0).le(positions.select(0, 0).unsqueeze(-1)).unsqueeze(0).unsqueeze(0);
  const auto freqs = positions.unsqueeze(-1).to(torch::kFloat) * inv_freq;  // [1, T, D/2]
  const auto emb = torch::cat({freqs, freqs}, -1).unsqueeze(2);             // [1, T, 1, D]
  auto cos = emb.cos(), sin = emb.sin();
  if (attention_factor != 1.0) {
    cos = cos * attention_factor;
    sin = sin * attention_factor;
  }
  return {cos.to(dtype), sin.to(dtype), mask};
}

// A model's forward for one sequence's contiguous new tokens as one C++ call (models/native_stack.py
// NativeChain, for engine/runner.py): embedding, RoPE, the layer stack, then the LM head at the last
// `num_logits` rows in float32, what Runner._forward computes for such a batch, op for op. Around the
// stack, that Python cost ~0.3-0.4 ms a forward on a 2-core EPYC (its objects are cold after the
// stack's weights streamed through the caches).
class ChainForward {
 public:
  ChainForward(torch::Tensor embedding, torch::Tensor inv_freq, double attention_factor, Linear head)
      : embedding_(std::move(embedding)), inv_freq_(std::move(inv_freq)), attention_factor_(attention_factor),
        head_(std::move(head)) {}

  // tokens [1, T] int64 at cache columns start .. of row `slot` -> (final-normed hidden [1, T, d], the
  // states of `taps`, logits [1, num_logits, V] float32 of the last num_logits tokens).
  std::tuple<torch::Tensor, std::vector<torch::Tensor>, torch::Tensor> forward(
      Stack& stack, const torch::Tensor& tokens, int64_t slot, int64_t start, int64_t num_logits,
      const std::vector<int64_t>& taps) {
    const int64_t T = tokens.size(1);
    const auto x = at::embedding(embedding_, tokens);  // [1, T, d]
    const auto rope = chain_rope(inv_freq_, attention_factor_, start, T, x.scalar_type());
    auto [hidden, tapped] = stack.forward(x, rope.cos, rope.sin, slot, slot + 1, start, start + T, rope.mask, taps,
                                          std::nullopt);
    // Runner._forward: the last num_logits rows (a gather: contiguous), then compute_logits (row_linear, float).
    const auto selected = hidden.slice(1, T - num_logits, T).contiguous();  // [1, N, d]
    const auto logits = head_(selected.reshape({-1, selected.size(-1)})).view({1, num_logits, -1}).to(torch::kFloat);
    return {hidden, tapped, logits};
  }

 private:
  torch::Tensor embedding_, inv_freq_;
  double attention_factor_;
  Linear head_;
};

// One chain-drafting step with a greedy pick, as one C++ call: a feature drafter's (EAGLE, EAGLE-3,
// MTP) or a draft model's (speculative/propose/native_step.py). The proposers' Python step (entry
// and mask building, embedding, RoPE tables, input norms and concatenation, the layers, the head,
// softmax / argmax / max over the vocabulary) costs ~0.8 ms of ops around ~0.3 ms of matmuls on a
// 2-core EPYC; this runs the same ops in the same order, so the drafter's output and its argmax
// are bit-identical to the modules'. The drafted token's probability (its confidence, for p_min
// and D-Cut) is 1 / sum(exp(logits - max)) over the scored tokens: equal to the softmax's maximum up
// to rounding.
class DraftStep {
 public:
  // embedding [V, d]: the target's; inv_freq, attention_factor: the drafter's RotaryEmbedding.
  // eagle3 (attn_input): attention reads cat(norm(e; embed_norm), norm(f; feature_norm)) and f is the
  // residual; else x = fc(cat(e', f')) with e', f' normed where a norm is given (MTP), raw (EAGLE);
  // a draft model (no features): x = e, and its stack ends in its final norm.
  // head_norm (optional) then head scores the draft vocabulary; head_ids [n] maps a scored row to
  // its target token id (a reduced head), absent when the head scores the whole vocabulary.
  DraftStep(torch::Tensor embedding, torch::Tensor inv_freq, double attention_factor, bool attn_input,
            OptTensor embed_norm, double embed_eps, OptTensor feature_norm, double feature_eps,
            std::optional<Linear> fc, OptTensor head_norm, double head_eps, Linear head, OptTensor head_ids)
      : embedding_(std::move(embedding)), inv_freq_(std::move(inv_freq)), attention_factor_(attention_factor),
        attn_input_(attn_input), embed_norm_(std::move(embed_norm)), embed_eps_(embed_eps),
        feature_norm_(std::move(feature_norm)), feature_eps_(feature_eps), fc_(std::move(fc)),
        head_norm_(std::move(head_norm)), head_eps_(head_eps), head_(std::move(head)), head_ids_(std::move(head_ids)) {}

  // tokens [1, T] int64 and features [1, T, d] (a feature drafter's; position t takes token t + 1 and
  // feature t): drafter positions start .. start + T - 1 of cache row `slot`, through `layers` (the
  // drafter's block, or the draft model's stack) -> (o [1, T, d], the drafted token after the last
  // position, its probability).
  std::tuple<torch::Tensor, int64_t, double> step(Stack& layers, const torch::Tensor& tokens,
                                                  const OptTensor& features, int64_t slot, int64_t start) {
    const int64_t T = tokens.size(1), S = start + T;
    const auto rope = chain_rope(inv_freq_, attention_factor_, start, T, embedding_.scalar_type());
    // The drafter's forward (speculative/propose/drafters/eagle/model.py).
    auto e = at::embedding(embedding_, tokens);  // [1, T, d]
    torch::Tensor x;
    OptTensor attn_input;
    if (!features.has_value()) {
      x = e;
    } else if (attn_input_) {
      x = *features;
      attn_input = torch::cat({rms_norm_op(e, *embed_norm_, embed_eps_), rms_norm_op(x, *feature_norm_, feature_eps_)}, -1);
    } else {
      const auto f = feature_norm_.has_value() ? rms_norm_op(*features, *feature_norm_, feature_eps_) : *features;
      if (embed_norm_.has_value()) e = rms_norm_op(e, *embed_norm_, embed_eps_);
      x = (*fc_)(torch::cat({e, f}, -1));
    }
    const auto out = layers.forward(x, rope.cos, rope.sin, slot, slot + 1, start, S, rope.mask, {}, attn_input).first;
    // The head at the last position (EagleProposer.vocab_logits; a draft model's compute_logits).
    auto h = out.select(1, T - 1);  // [1, d]
    if (head_norm_.has_value()) h = rms_norm_op(h, *head_norm_, head_eps_);
    const auto scores = head_(h.reshape({-1, h.size(-1)})).to(torch::kFloat).contiguous();  // [1, n]
    // The first maximum (NaN counts as the largest, as torch.argmax), which is the full vocabulary's
    // argmax as the reduced head's ids ascend; then its probability.
    const float* s = scores.data_ptr<float>();
    int64_t best = 0;
    for (int64_t i = 1, n = scores.size(-1); i < n && !std::isnan(s[best]); ++i)
      if (s[i] > s[best] || std::isnan(s[i])) best = i;
    const double top = (scores - s[best]).exp_().sum().reciprocal().item<float>();
    const int64_t token = head_ids_.has_value() ? head_ids_->data_ptr<int64_t>()[best] : best;
    return {out, token, top};
  }

 private:
  torch::Tensor embedding_, inv_freq_;
  double attention_factor_;
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
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Linear>(m, "Linear");
  m.def("dense_linear", &dense_linear, "a dense layer: at::linear(x, weight, bias)", py::arg("weight"),
        py::arg("bias"));
  m.def("int8_linear", &int8_linear, "an int8 layer: specdecode_int8::int8_linear with these arguments");
  m.def("int4_linear", &int4_linear, "an int4 layer: specdecode_int4::int4_linear with these arguments");
  m.def("a8_linear", &a8_linear, "a w8a8 (weight_bits 8) or w4a8 (4) layer: specdecode_a8's op with these arguments");
  m.def("with_wide", &with_wide, "the layer, from wide_from rows on the layer `wide` (its packed dense copy)");
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
      .def(py::init<std::vector<Layer>, OptTensor, double, bool>())
      .def("bind_cache", &Stack::bind_cache)
      .def("forward", &Stack::forward);
  py::class_<DraftStep>(m, "DraftStep")
      .def(py::init<torch::Tensor, torch::Tensor, double, bool, OptTensor, double, OptTensor, double,
                    std::optional<Linear>, OptTensor, double, Linear, OptTensor>())
      .def("step", &DraftStep::step);
  py::class_<ChainForward>(m, "ChainForward")
      .def(py::init<torch::Tensor, torch::Tensor, double, Linear>())
      .def("forward", &ChainForward::forward);
}
