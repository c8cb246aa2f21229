// An int8 KV cache's records (kv_cache_dtype "int8"): quantising and dequantising them in plain C++, with
// no vector intrinsics, so every build of the C++ layer stack has them (cached_attention.h's kernel reads
// them with AVX-512; decode_stack_cpu.cpp's module path writes them on any CPU).
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace attention_kernels {
namespace {

// An int8 KV cache (kv_cache_dtype "int8"): each (token, KV head) is one record of D int8 values and
// then their float32 scale (4 bytes, unaligned), x ~ value x scale with scale = max |x| / 127, rounded
// half to even (models/layers.py quantize_kv computes the same numbers with PyTorch's ops). Half the
// bytes of a bf16 cache and a quarter of a float32 one: attention over a deep context streams them.
constexpr int64_t kScaleBytes = 4;
template <typename cache_t>
constexpr bool kQuantized = std::is_same_v<cache_t, int8_t>;

inline float record_scale(const int8_t* record, int64_t D) {
  float scale;
  std::memcpy(&scale, record + D, sizeof(float));
  return scale;
}

// x [D] -> one record (D values, then the scale).
template <typename scalar_t>
void quantize_record(const scalar_t* x, int8_t* record, int64_t D) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const float scale = amax / 127.0f;
  const float divisor = scale > 0.0f ? scale : 1.0f;  // an all-zero head (or one that underflows) stays zero
  for (int64_t d = 0; d < D; ++d) {
    const float rounded = std::nearbyint(static_cast<float>(x[d]) / divisor);
    record[d] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, rounded)));
  }
  std::memcpy(record + D, &scale, sizeof(float));
}

// An int8 cache's records [.., D + 4] -> their values [.., D] in `dtype` (value x scale in float32, then
// rounded): what PyTorch's attention reads where the cached-attention kernel does not serve (models/layers.py
// dequantize_kv computes the same).
inline torch::Tensor dequantize_records(const torch::Tensor& records, at::ScalarType dtype) {
  const int64_t D = records.size(-1) - kScaleBytes;
  const auto scales = records.narrow(-1, D, kScaleBytes).contiguous().view(at::kFloat);  // [.., 1]
  return records.narrow(-1, 0, D).to(at::kFloat).mul(scales).to(dtype);
}

// x [.., D] (float32 or bf16) -> its records [.., D + 4] by quantize_record.
inline torch::Tensor quantize_records(const torch::Tensor& x) {
  const int64_t D = x.size(-1), rows = x.numel() / std::max<int64_t>(D, 1);
  auto sizes = x.sizes().vec();
  sizes.back() = D + kScaleBytes;
  auto records = torch::empty(sizes, x.options().dtype(at::kChar));
  const auto xc = x.contiguous();
  int8_t* out = records.data_ptr<int8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quantize_records", [&] {
    const scalar_t* in = xc.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) quantize_record(in + r * D, out + r * (D + kScaleBytes), D);
  });
  return records;
}

}  // namespace
}  // namespace attention_kernels
