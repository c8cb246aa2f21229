// Width- and batch-invariant attention for exact mode (CPU).
//
// Each query row (one head of one new token) is computed by one thread with the same
// sequence of float operations whatever the batch, the number of new tokens or the number of
// key columns in the forward:
//   scores: for every key s, a sequential FMA chain over the head dimension (16 keys per
//           vector, one lane per key), times the scale; keys the mask hides are -inf;
//   softmax: the row max (exact), exp by a fixed polynomial, the sum in 16 lanes fixed by the
//           key's column (extra masked columns add exact zeros), then a fixed pairwise tree;
//   values: a sequential sum over the visible keys in column order, vectorised over the head
//           dimension; keys whose weight is exactly 0 are skipped.
// Every loop over lanes has a constant trip count of 16, so no element is ever computed by a
// scalar remainder loop with different instructions. PyTorch's flash kernel picks its block
// sizes by the number of queries and keys, which is why plain decoding and verification
// disagree in their last bits without this.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxHeadDim = 512;

// 16 floats as one value (GCC/Clang vector extensions: AVX-512, two AVX2 halves or NEON
// quarters; the arithmetic is lane-wise, so a lane's result never depends on the others).
typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));

inline vfloat load16(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

inline float fixed_sum16(vfloat a) {
  float b[8], c[4];
  for (int i = 0; i < 8; ++i) b[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) c[i] = b[i] + b[i + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// exp(x) lane-wise for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial);
// lanes below -87 (and -inf) give exactly 0.
inline vfloat exp_nonpositive(vfloat x) {
  const vint hidden = x < -87.0f;
  x = hidden ? vfloat{} - 87.0f : x;
  const float round_magic = 12582912.0f;  // 1.5 * 2^23: adding and subtracting rounds to the nearest integer
  const vfloat n = (x * 1.44269504088896341f + round_magic) - round_magic;
  const vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vfloat p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vfloat y = p * r * r + r + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return hidden ? vfloat{} : y * two_n;
}

// One group of RG query rows that share a mask row (heads of one token on one KV head): scores,
// softmax and the value sum. The group is always the same heads of the same token, so a row is
// computed with the same instructions (and the same skipped keys) whatever else the call holds.
template <int RG>
void attend_group(const float* qf /* [RG][D] */, const float* kt /* [Sp/16][D][16] */, const float* vf /* [S][Dp] */,
                  const bool* visible /* [S] */, float* scores /* [RG][Sp] */, float* acc_out /* [RG][Dp] */,
                  float* sums /* [RG] */, int64_t D, int64_t Dp, int64_t S, int64_t Sp, float scale) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  vfloat mv[RG];  // lane-wise running max (max is exact in any order)
  for (int r = 0; r < RG; ++r) mv[r] = vfloat{} + neg_inf;
  // Scores: two key blocks at a time, RG x 2 independent FMA chains, each in head-dimension order.
  for (int64_t j = 0; j < Sp; j += 2 * kLanes) {
    const bool two = j + kLanes < Sp;
    vfloat a0[RG] = {}, a1[RG] = {};
    const float* b0 = kt + j * D;
    const float* b1 = kt + (j + kLanes) * D;
    for (int64_t d = 0; d < D; ++d) {
      const vfloat k0 = load16(b0 + d * kLanes);
      const vfloat k1 = two ? load16(b1 + d * kLanes) : vfloat{};
      for (int r = 0; r < RG; ++r) {
        const float qd = qf[r * D + d];
        a0[r] += qd * k0;
        a1[r] += qd * k1;
      }
    }
    for (int64_t i = 0; i < (two ? 2 : 1); ++i) {
      vint seen;
      for (int64_t l = 0; l < kLanes; ++l) {
        const int64_t s = j + i * kLanes + l;
        seen[l] = (s < S && visible[s]) ? -1 : 0;
      }
      for (int r = 0; r < RG; ++r) {
        const vfloat sc = seen ? (i ? a1[r] : a0[r]) * scale : vfloat{} + neg_inf;
        store16(scores + r * Sp + j + i * kLanes, sc);
        mv[r] = sc > mv[r] ? sc : mv[r];
      }
    }
  }
  float m[RG];
  for (int r = 0; r < RG; ++r) {
    m[r] = neg_inf;
    for (int64_t l = 0; l < kLanes; ++l) m[r] = mv[r][l] > m[r] ? mv[r][l] : m[r];
  }
  for (int r = 0; r < RG; ++r) {
    float* row = scores + r * Sp;
    vfloat lanes = {};
    for (int64_t j = 0; j < Sp; j += kLanes) {
      const vfloat p = m[r] == neg_inf ? vfloat{} : exp_nonpositive(load16(row + j) - m[r]);
      store16(row + j, p);
      lanes += p;
    }
    sums[r] = fixed_sum16(lanes);
  }
  // Values: keys in column order; RG x Dp/16 independent chains.
  vfloat acc[RG][kMaxHeadDim / kLanes] = {};
  const int64_t Dv = Dp / kLanes;
  for (int64_t s = 0; s < S; ++s) {
    float w[RG];
    bool any = false;
    for (int r = 0; r < RG; ++r) {
      w[r] = scores[r * Sp + s];
      any = any || w[r] != 0.0f;
    }
    if (!any) continue;
    const float* v = vf + s * Dp;
    for (int64_t jv = 0; jv < Dv; ++jv) {
      const vfloat vv = load16(v + jv * kLanes);
      for (int r = 0; r < RG; ++r) acc[r][jv] += w[r] * vv;
    }
  }
  for (int r = 0; r < RG; ++r)
    for (int64_t jv = 0; jv < Dv; ++jv) store16(acc_out + r * Dp + jv * kLanes, acc[r][jv]);
}

// Keys [S] x [D] (row stride `stride`) -> float blocks of 16 keys [Sp / 16][D][16], zero past S.
// Pure data movement (no arithmetic), so how it is done changes no result: 16 x 16 tiles are
// transposed in registers by four stages of two-vector shuffles when D is a multiple of 16.
struct TransposeMasks {
  vint lo[4], hi[4];  // stage with block b = 8, 4, 2, 1
  TransposeMasks() {
    for (int stage = 0; stage < 4; ++stage) {
      const int b = 8 >> stage;
      for (int l = 0; l < 16; ++l) {
        lo[stage][l] = (l & b) ? 16 + l - b : l;
        hi[stage][l] = (l & b) ? 16 + l : l + b;
      }
    }
  }
};

inline void transpose16(vfloat* rows) {
  static const TransposeMasks masks;
  vint r[16];
  std::memcpy(r, rows, sizeof(r));
  for (int stage = 0; stage < 4; ++stage) {
    const int b = 8 >> stage;
    for (int i = 0; i < 16; ++i) {
      if (i & b) continue;
      const vint a = r[i], c = r[i + b];
      r[i] = __builtin_shuffle(a, c, masks.lo[stage]);
      r[i + b] = __builtin_shuffle(a, c, masks.hi[stage]);
    }
  }
  std::memcpy(rows, r, sizeof(r));
}

template <typename scalar_t>
void transpose_keys(const scalar_t* k, int64_t stride, int64_t S, int64_t Sp, int64_t D, float* kt) {
  if (D % kLanes != 0) {
    for (int64_t s = 0; s < Sp; ++s) {
      float* block = kt + (s / kLanes) * D * kLanes + s % kLanes;
      for (int64_t d = 0; d < D; ++d) block[d * kLanes] = s < S ? static_cast<float>(k[s * stride + d]) : 0.0f;
    }
    return;
  }
  vfloat tile[16];
  for (int64_t j = 0; j < Sp; j += kLanes) {
    for (int64_t c = 0; c < D; c += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) {  // row l = key j + l, dims c .. c + 15
        const int64_t s = j + l;
        if (s < S) {
          const scalar_t* src = k + s * stride + c;
          for (int64_t e = 0; e < kLanes; ++e) tile[l][e] = static_cast<float>(src[e]);
        } else {
          tile[l] = vfloat{};
        }
      }
      transpose16(tile);  // tile[e][l] = dim c + e of key j + l
      for (int64_t e = 0; e < kLanes; ++e) store16(kt + (j * D + (c + e) * kLanes), tile[e]);
    }
  }
}

template <typename scalar_t>
void attention_kernel(const scalar_t* q, const scalar_t* cache_k, const int64_t* ks, const scalar_t* cache_v,
                      const int64_t* vs, const int64_t* slots, const bool* mask, scalar_t* out, int64_t B, int64_t T,
                      int64_t H, int64_t KVH, int64_t D, int64_t S, float scale) {
  const int64_t G = H / KVH;
  const int64_t Sp = (S + kLanes - 1) / kLanes * kLanes, Dp = (D + kLanes - 1) / kLanes * kLanes;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    // Per task (one sequence, one KV head): its keys as float blocks of 16 [Sp / 16][D][16]
    // (one lane per key), its values as float rows [S][Dp], then the heads of one token at a time,
    // in fixed groups of at most 4.
    std::vector<float> kt(Sp * D), vf(S * Dp), qf(4 * D), scores(4 * Sp), acc(4 * Dp), sums(4);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kvh = task % KVH, slot = slots[b];
      transpose_keys(cache_k + slot * ks[0] + kvh * ks[2], ks[1], S, Sp, D, kt.data());
      for (int64_t s = 0; s < S; ++s) {
        const scalar_t* src = cache_v + slot * vs[0] + s * vs[1] + kvh * vs[2];
        float* dst = &vf[s * Dp];
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
        for (int64_t d = D; d < Dp; ++d) dst[d] = 0.0f;
      }
      for (int64_t t = 0; t < T; ++t) {
        const bool* visible = mask + (b * T + t) * S;
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
          const int64_t rg = std::min<int64_t>(4, G - g0);
          for (int64_t r = 0; r < rg; ++r) {
            const scalar_t* src = q + ((b * T + t) * H + kvh * G + g0 + r) * D;
            for (int64_t d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(src[d]);
          }
          switch (rg) {
            case 1: attend_group<1>(qf.data(), kt.data(), vf.data(), visible, scores.data(), acc.data(), sums.data(), D, Dp, S, Sp, scale); break;
            case 2: attend_group<2>(qf.data(), kt.data(), vf.data(), visible, scores.data(), acc.data(), sums.data(), D, Dp, S, Sp, scale); break;
            case 3: attend_group<3>(qf.data(), kt.data(), vf.data(), visible, scores.data(), acc.data(), sums.data(), D, Dp, S, Sp, scale); break;
            default: attend_group<4>(qf.data(), kt.data(), vf.data(), visible, scores.data(), acc.data(), sums.data(), D, Dp, S, Sp, scale); break;
          }
          for (int64_t r = 0; r < rg; ++r) {
            scalar_t* dst = out + ((b * T + t) * H + kvh * G + g0 + r) * D;
            const float denom = sums[r] > 0.0f ? sums[r] : 1.0f;
            for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[r * Dp + d] / denom);
          }
        }
      }
    }
  });
}

}  // namespace

// q [B, T, H, D]; cache_k, cache_v [slots, C, KVH, D] (any strides, the head dimension contiguous);
// slot_ids [B] int64; mask [B, T, S] bool (S <= C: the key columns read). Returns [B, T, H, D] in q's dtype.
torch::Tensor exact_attention(torch::Tensor q, torch::Tensor cache_k, torch::Tensor cache_v, torch::Tensor slot_ids,
                              torch::Tensor mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && cache_k.dim() == 4 && mask.dim() == 3, "exact_attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == cache_k.scalar_type() && cache_k.scalar_type() == cache_v.scalar_type(),
              "exact_attention: q and the cache must share a dtype");
  q = q.contiguous();
  if (cache_k.stride(3) != 1) cache_k = cache_k.contiguous();
  if (cache_v.stride(3) != 1) cache_v = cache_v.contiguous();
  mask = mask.to(torch::kBool).contiguous();
  slot_ids = slot_ids.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t KVH = cache_k.size(2), C = cache_k.size(1), S = mask.size(2);
  TORCH_CHECK(D <= kMaxHeadDim, "exact_attention: head_dim above 512");
  TORCH_CHECK(H % KVH == 0 && cache_k.size(3) == D && S <= C && mask.size(0) == B && mask.size(1) == T,
              "exact_attention: shapes do not match");
  auto out = torch::empty_like(q);
  const int64_t ks[3] = {cache_k.stride(0), cache_k.stride(1), cache_k.stride(2)};
  const int64_t vs[3] = {cache_v.stride(0), cache_v.stride(1), cache_v.stride(2)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "exact_attention", [&] {
    attention_kernel<scalar_t>(q.data_ptr<scalar_t>(), cache_k.data_ptr<scalar_t>(), ks, cache_v.data_ptr<scalar_t>(),
                               vs, slot_ids.data_ptr<int64_t>(), mask.data_ptr<bool>(), out.data_ptr<scalar_t>(), B, T,
                               H, KVH, D, S, static_cast<float>(scale));
  });
  return out;
}

// ---- position-keyed sampling noise (see noise.py for the definition) -----------------------

namespace {

typedef uint32_t vuint __attribute__((vector_size(64)));

// murmur3's 32-bit finaliser, on one value or lane-wise on 16 (unsigned arithmetic wraps mod 2^32).
template <typename U>
inline U fmix32(U h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// -log(u) lane-wise for u in (0, 1) (Cephes logf: exponent split, degree-8 polynomial).
inline vfloat neg_log(vfloat u) {
  vint bits;
  std::memcpy(&bits, &u, sizeof(bits));
  vfloat e = __builtin_convertvector(((bits >> 23) & 0xFF) - 126, vfloat);
  const vint mantissa_bits = (bits & 0x7FFFFF) | 0x3F000000;  // m in [0.5, 1)
  vfloat m;
  std::memcpy(&m, &mantissa_bits, sizeof(m));
  const vint small = m < 0.707106781186547524f;
  e = small ? e - 1.0f : e;
  m = small ? m + m - 1.0f : m - 1.0f;
  const vfloat z = m * m;
  vfloat y = m * 7.0376836292e-2f - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += e * -2.12194440e-4f;
  y += z * -0.5f;
  const vfloat r = m + y + e * 0.693359375f;
  return vfloat{} - r;
}

}  // namespace

// keys [N] int64 (32-bit noise keys), positions [N] int64 -> [N, vocab] float32 Exp(1) noise.
torch::Tensor keyed_exponential(torch::Tensor keys, torch::Tensor positions, int64_t vocab) {
  keys = keys.to(torch::kLong).contiguous();
  positions = positions.to(torch::kLong).contiguous();
  const int64_t N = keys.size(0);
  auto out = torch::empty({N, vocab}, torch::kFloat);
  const int64_t* kp = keys.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t row = fmix32(fmix32(static_cast<uint32_t>(kp[i])) ^ static_cast<uint32_t>(pp[i]));
      for (int64_t v0 = 0; v0 < vocab; v0 += kLanes) {
        vuint token;
        for (int l = 0; l < kLanes; ++l) token[l] = static_cast<uint32_t>(v0 + l);
        vuint h = fmix32(row ^ fmix32(token * 0x9E3779B1u));
        h = fmix32(h ^ 0x5BD1E995u);
        const vfloat u = (__builtin_convertvector(h >> 8, vfloat) + 0.5f) * (1.0f / 16777216.0f);
        const vfloat noise = neg_log(u);
        const int64_t n = std::min<int64_t>(kLanes, vocab - v0);
        std::memcpy(op + i * vocab + v0, &noise, n * sizeof(float));
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exact_attention", &exact_attention, "width- and batch-invariant attention over a KV cache (CPU)");
  m.def("keyed_exponential", &keyed_exponential, "Exp(1) noise keyed by (key, position, token) (CPU)");
}
