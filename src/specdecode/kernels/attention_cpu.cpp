// Attention over a KV cache for the few query rows of a decode, drafting or verification step (CPU,
// AVX2 + FMA), a drop-in for the scaled_dot_product_attention call of models/llama.py's cached path
// (and of the C++ layer stack, which calls this same op, so both stay bit-identical).
//
// Why: PyTorch's CPU flash kernel costs 35-47 us a layer for one token over ~250 keys and 60-90 us for
// five (default model, 8 query / 4 KV heads of 64), mostly fixed cost: the work is ~0.26 M
// multiply-adds per token and layer. Here: 14-18 us and 53-61 us. Here one task per (sequence, KV head), split over threads, runs
// each of its query rows (group x T: the heads sharing the KV head, row g * T + t for token t) alone:
//   scores: 8 keys at a time, one 8-lane FMA chain per key over the head dimension in order, the 8
//           chains' lanes summed by one fixed tree into a vector of 8 scores, times 1/sqrt(D); keys
//           the mask hides (and past S) are -inf;
//   softmax: the row max (exact), exp by a fixed polynomial (Cephes expf), the sum in 8 lanes by key
//           column (hidden keys add exact zeros), then a fixed tree;
//   values: a sequential sum over the visible keys in column order, vectorised over the head
//           dimension, divided by the sum at the end.
// A row's result therefore depends on its own query, its keys and its mask row only: not on the
// other rows, the batch or the number of tokens in the step. More than kMaxRows rows (prefill) or a
// head size this code does not cover take PyTorch's kernel, as do other dtypes and devices.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

// Query rows per KV head served here (group x tokens): the per-row cost here grows as rows x keys,
// the flash kernel's mostly fixed; measured (8/4 heads of 64, 2 threads) 2.5x faster at 2 rows,
// 1.1-1.7x at 10, even at 16 over 600 keys.
constexpr int64_t kMaxRows = 12;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 -> fp32 is exact: the bits shifted up
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 vectors -> [sum of a0's lanes, ..., sum of a7's lanes], each by ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).
inline __m256 sum_lanes8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float fixed_sum8(__m256 v) {  // ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline float max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// exp(x) lane-wise for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial, the same
// constants as exact mode's kernel); lanes below -87 (and -inf) give exactly 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 hidden = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_add_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_fmadd_ps(r, _mm256_set1_ps(1.9875691500e-4f), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(hidden, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}

// One query row against S keys of one KV head. DV = D / 8 vectors per head. k(s), v(s): key and value
// s (stride ks / vs elements); visible: the row's mask (nullptr: every key); scores: [S rounded up to 8].
template <int DV, typename scalar_t>
void attend_row(const scalar_t* q, const scalar_t* k, int64_t ks, const scalar_t* v, int64_t vs, const bool* visible,
                int64_t S, float scale, float* scores, scalar_t* out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m256 qv[DV];
  for (int c = 0; c < DV; ++c) qv[c] = load8(q + c * 8);
  __m256 vmax = _mm256_set1_ps(neg_inf);
  const __m256 hide = _mm256_set1_ps(neg_inf);
  for (int64_t s0 = 0; s0 < S; s0 += 8) {
    __m256 acc[8];
    const bool tail = s0 + 8 > S;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const scalar_t* key = k + (tail ? std::min<int64_t>(s0 + j, S - 1) : s0 + j) * ks;  // past S: a real key, hidden
      __m256 a = _mm256_mul_ps(qv[0], load8(key));
#pragma GCC unroll 32
      for (int c = 1; c < DV; ++c) a = _mm256_fmadd_ps(qv[c], load8(key + c * 8), a);
      acc[j] = a;
    }
    const __m256 sc = _mm256_mul_ps(sum_lanes8(acc), _mm256_set1_ps(scale));
    // Hidden keys (mask false, or past S) become -inf, the others keep their score exactly.
    __m256i seen = _mm256_set1_epi32(-1);
    if (visible != nullptr || tail) {
      alignas(32) int32_t flags[8];
      for (int j = 0; j < 8; ++j) flags[j] = (s0 + j < S && (visible == nullptr || visible[s0 + j])) ? -1 : 0;
      seen = _mm256_load_si256(reinterpret_cast<const __m256i*>(flags));
    }
    const __m256 kept = _mm256_blendv_ps(hide, sc, _mm256_castsi256_ps(seen));
    _mm256_storeu_ps(scores + s0, kept);
    vmax = _mm256_max_ps(vmax, kept);
  }
  const float m = max8(vmax);
  if (m == neg_inf) {  // a row that sees no key (never in a decode step): zeros, not NaNs
    for (int64_t d = 0; d < DV * 8; ++d) out[d] = static_cast<scalar_t>(0.0f);
    return;
  }
  __m256 lanes = _mm256_setzero_ps();
  for (int64_t s0 = 0; s0 < S; s0 += 8) {
    const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + s0), _mm256_set1_ps(m)));
    _mm256_storeu_ps(scores + s0, p);
    lanes = _mm256_add_ps(lanes, p);
  }
  const float sum = fixed_sum8(lanes);
  __m256 acc[DV];
  for (int c = 0; c < DV; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    if (scores[s] == 0.0f) continue;  // hidden (or underflowed) keys add nothing
    const __m256 p = _mm256_set1_ps(scores[s]);
    const scalar_t* value = v + s * vs;
    for (int c = 0; c < DV; ++c) acc[c] = _mm256_fmadd_ps(p, load8(value + c * 8), acc[c]);
  }
  alignas(32) float row[DV * 8];
  const __m256 denom = _mm256_set1_ps(sum);
  for (int c = 0; c < DV; ++c) _mm256_store_ps(row + c * 8, _mm256_div_ps(acc[c], denom));
  for (int64_t d = 0; d < DV * 8; ++d) out[d] = static_cast<scalar_t>(row[d]);
}

template <int DV, typename scalar_t>
void attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values, const bool* mask,
               int64_t T, torch::Tensor& out) {
  const int64_t B = q.size(0), KVH = q.size(1), R = q.size(2), S = keys.size(1);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(DV * 8)));
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = keys.data_ptr<scalar_t>();
  const scalar_t* vp = values.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores((S + 7) / 8 * 8);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH;
      const scalar_t* k = kp + b * keys.stride(0) + h * keys.stride(2);
      const scalar_t* v = vp + b * values.stride(0) + h * values.stride(2);
      for (int64_t r = 0; r < R; ++r) {
        const bool* visible = mask == nullptr ? nullptr : mask + (b * T + r % T) * S;
        attend_row<DV>(qp + (task * R + r) * DV * 8, k, keys.stride(1), v, values.stride(1), visible, S, scale,
                       scores.data(), op + (task * R + r) * DV * 8);
      }
    }
  });
}

}  // namespace

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
  const bool served = R <= kMaxRows && (D == 64 || D == 128 || D == 32 || D == 256) && S > 0 &&
                      (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                      keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type() &&
                      keys.stride(3) == 1 && values.stride(3) == 1 && q.device().is_cpu();
  if (!served) {  // prefill widths and the rest: PyTorch's kernel, the mask expanded to the rows
    c10::optional<torch::Tensor> rows_mask;
    if (mask.has_value()) rows_mask = mask->expand({B, group, T, S}).reshape({B, 1, R, S});
    return at::scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2), rows_mask);
  }
  TORCH_CHECK(keys.size(0) == B && keys.size(2) == KVH && keys.size(3) == D && values.sizes() == keys.sizes(),
              "cached_attention: keys and values do not match q");
  torch::Tensor mask_rows;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool, "cached_attention: a bool mask");
    mask_rows = mask->expand({B, 1, T, S}).contiguous();
  }
  const auto qc = q.contiguous();
  auto out = torch::empty({B, KVH, R, D}, q.options());
  const bool* m = mask.has_value() ? mask_rows.data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "cached_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>) {
      switch (D) {
        case 32: attention<4, scalar_t>(qc, keys, values, m, T, out); break;
        case 64: attention<8, scalar_t>(qc, keys, values, m, T, out); break;
        case 128: attention<16, scalar_t>(qc, keys, values, m, T, out); break;
        default: attention<32, scalar_t>(qc, keys, values, m, T, out); break;
      }
    }
  });
  return out;
}

TORCH_LIBRARY(specdecode_attn, m) {
  m.def("cached_attention(Tensor q, Tensor keys, Tensor values, Tensor? mask, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode_attn, CPU, m) { m.impl("cached_attention", &cached_attention); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Nothing here: the op is registered with the dispatcher above (torch.ops.specdecode_attn).
}
