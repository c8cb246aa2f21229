// Attention over a KV cache for the few query rows of a decode, drafting or verification step (CPU,
// AVX2 + FMA; AVX-512 where built for it), a drop-in for the scaled_dot_product_attention call of
// models/llama.py's cached path (and of the C++ layer stack, which calls this same op, so both stay
// bit-identical).
//
// Why: PyTorch's CPU flash kernel costs 35-47 us a layer for one token over ~250 keys and 60-90 us for
// five (default model, 8 query / 4 KV heads of 64), mostly fixed cost: the work is ~0.26 M
// multiply-adds per token and layer. Here: 14-18 us and 53-61 us. Here one task per (sequence, KV head), split over threads, runs
// each of its query rows (group x T: the heads sharing the KV head, row g * T + t for token t) alone
// through the scores and the softmax, then the rows together through the values:
//   scores: 8 keys at a time, one 8-lane FMA chain per key over the head dimension in order, the 8
//           chains' lanes summed by one fixed tree into a vector of 8 scores, times 1/sqrt(D); keys
//           the mask hides (and past S) are -inf. bf16 on a CPU with AVX-512 BF16: 16 keys at a
//           time, a 16-lane vdpbf16ps chain per key, the lanes summed by one fixed pairwise tree;
//   softmax: the row max (exact), exp by a fixed polynomial (Cephes expf), the sum in 8 lanes by key
//           column (hidden keys add exact zeros), then a fixed tree;
//   values: a sequential sum over the visible keys in column order, vectorised over the head
//           dimension, divided by the sum at the end; with AVX-512, several rows at a time share
//           each value's load and widening (each row's sums unchanged).
// An int8 cache (AVX-512): scores as bf16's, on the keys widened to fp32 and times each key's scale;
// values weighted by probability x the value's scale (cached_attention.h, "An int8 KV cache").
// A row's result therefore depends on its own query, its keys and its mask row only: not on the
// other rows, the batch or the number of tokens in the step. More than kMaxRows rows (prefill) or a
// head size this code does not cover take PyTorch's kernel, as do other dtypes and devices.
#include <torch/extension.h>

#include "cached_attention.h"

using attention_kernels::attend;

// q [B, KVH, R, D] (R = group x T rows per KV head, row g * T + t for token t), keys and values
// [B, S, KVH, D] (views of the cache: any strides, the head dimension contiguous), mask [B, 1, T, S]
// bool or None (every key visible) -> [B, KVH, R, D], what scaled_dot_product_attention(q, keys,
// values) gives with the mask expanded to the rows (up to rounding: this kernel's sums, fixed above).
torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               const c10::optional<torch::Tensor>& mask, int64_t group) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "cached_attention: q, keys, values are 4-D");
  const int64_t B = q.size(0), KVH = q.size(1), R = q.size(2), D = q.size(3), S = keys.size(1);
  TORCH_CHECK(group >= 1 && R % group == 0, "cached_attention: rows are group x tokens");
  const int64_t T = R / group;
  // An int8 cache (kv_cache_dtype "int8"): keys and values are records of D values and their scale.
  const bool quantized = keys.scalar_type() == at::kChar;
  const int64_t record = quantized ? D + attention_kernels::kScaleBytes : D;
  TORCH_CHECK(values.scalar_type() == keys.scalar_type() && keys.size(3) == record && values.sizes() == keys.sizes(),
              "cached_attention: keys and values do not match q");
  const bool served = attention_kernels::serves(R, D, S, quantized) &&
                      (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                      (quantized || keys.scalar_type() == q.scalar_type()) && keys.stride(3) == 1 &&
                      values.stride(3) == 1 && q.device().is_cpu();
  if (!served) {  // prefill widths and the rest: PyTorch's kernel, the mask expanded to the rows
    c10::optional<torch::Tensor> rows_mask;
    if (mask.has_value()) rows_mask = mask->expand({B, group, T, S}).reshape({B, 1, R, S});
    const auto k = quantized ? attention_kernels::dequantize_records(keys, q.scalar_type()) : keys;
    const auto v = quantized ? attention_kernels::dequantize_records(values, q.scalar_type()) : values;
    return at::scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), rows_mask);
  }
  TORCH_CHECK(keys.size(0) == B && keys.size(2) == KVH, "cached_attention: keys and values do not match q");
  torch::Tensor mask_rows;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool, "cached_attention: a bool mask");
    mask_rows = mask->expand({B, 1, T, S}).contiguous();
  }
  const auto qc = q.contiguous();
  auto out = torch::empty({B, KVH, R, D}, q.options());
  const bool* m = mask.has_value() ? mask_rows.data_ptr<bool>() : nullptr;
  const int64_t ks[3] = {keys.stride(0), keys.stride(1), keys.stride(2)};
  const int64_t vs[3] = {values.stride(0), values.stride(1), values.stride(2)};
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "cached_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>) {
      if (quantized)
        attend(qc.data_ptr<scalar_t>(), B, KVH, R, D, keys.data_ptr<int8_t>(), ks, values.data_ptr<int8_t>(), vs, S,
               m, T, out.data_ptr<scalar_t>());
      else
        attend(qc.data_ptr<scalar_t>(), B, KVH, R, D, keys.data_ptr<scalar_t>(), ks, values.data_ptr<scalar_t>(), vs,
               S, m, T, out.data_ptr<scalar_t>());
    }
  });
  return out;
}

TORCH_LIBRARY(specdecode_attn, m) {
  m.def("cached_attention(Tensor q, Tensor keys, Tensor values, Tensor? mask, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode_attn, CPU, m) { m.impl("cached_attention", &cached_attention); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The op is registered with the dispatcher above (torch.ops.specdecode_attn); this only says its reach.
  m.attr("max_rows") = attention_kernels::kMaxRows;
  m.attr("serves_int8") = attention_kernels::serves(1, 64, 1, true);
  m.def("quantize_records", &attention_kernels::quantize_records, "x [.., D] -> int8 records [.., D + 4]");
}
