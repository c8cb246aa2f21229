// A Llama-family layer stack's cached forward as one C++ call (CPU, eager inference).
//
// Why: with int8 weights and float32 activations a decode token of the default model costs about
// 3.3 ms on a 2-core AVX2 EPYC, of which the 25 matmuls take ~0.9 ms and attention ~0.2 ms: the
// rest is Python around ~150 small ops a forward (module calls, views, splits, RoPE, cache writes).
// llama.cpp's whole token is ~1.2 ms there. This file runs the same ops, in the same order, on the
// same kernels, from C++: every aten op, the few-row ops (specdecode_int8::int8_linear, int4_linear) and the
// RMSNorm kernel (specdecode_norm::rms_norm) are called through PyTorch's dispatcher exactly as the
// Python modules call them, so the results are bit-identical to models/llama.py's forward, and a
// row's result still does not depend on the rows beside it wherever the Python path's did not.
//
// It serves what models/native_stack.py checks: standard attention (GQA, optional q/k norm and
// biases), a dense SwiGLU MLP, dense, int8 or int4 linear layers, a batch whose sequences are contiguous
// cache rows writing the same columns (decode, chain verification, prefill of one sequence), not
// exact mode.
// RoPE's products and sum must round separately, as PyTorch's ops round them (the build passes
// -ffp-contract=fast for the other kernels).
#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

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
// attached (int4_linear's), or a dense weight: an nn.Linear, a FusedLinear, a quantised layer's
// dequantised copy (at::linear).
struct Linear {
  int bits = 0;          // 0: dense; 8 or 4: the few-row op of that width
  torch::Tensor weight;  // dense [N, K]; int8 / int4: the few-row kernel's weight layout
  OptTensor bias;        // dense: the bias; int8 / int4: the bias in the activations' dtype (fallback paths)
  torch::Tensor few_scales;  // int8: scales; int4: scales and offsets
  OptTensor few_bias, dense, qweight, qscales;
  int64_t out_features = 0, few_upto = 0, group = 0;

  torch::Tensor operator()(const torch::Tensor& x) const {
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
    const auto k_roped = torch::empty({B, T, KVH, D}, x.options());
    apply_rope_into(k, cos, sin, k_roped);
    if (layer.q_norm.has_value()) q = rms_norm_op(q, *layer.q_norm, layer.eps);
    // Cache writes and reads as models/layers.py write_columns / read_columns (slices, no gather).
    cache_k.slice(0, slot_begin, slot_end).slice(1, write_start, write_start + T).copy_(k_roped);
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
    const auto x2 = x + layer.o_proj(attn);
    const auto gate_up = layer.gate_up(rms_norm_op(x2, layer.post_norm, layer.eps))
                             .split_with_sizes({layer.intermediate, layer.intermediate}, -1);
    return x2 + layer.down(at::silu(gate_up[0]) * gate_up[1]);
  }

  std::vector<Layer> layers_;
  OptTensor final_norm_;
  double eps_;
  bool cached_attention_;
  std::vector<torch::Tensor> k_, v_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Linear>(m, "Linear");
  m.def("dense_linear", &dense_linear, "a dense layer: at::linear(x, weight, bias)", py::arg("weight"),
        py::arg("bias"));
  m.def("int8_linear", &int8_linear, "an int8 layer: specdecode_int8::int8_linear with these arguments");
  m.def("int4_linear", &int4_linear, "an int4 layer: specdecode_int4::int4_linear with these arguments");
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
}
