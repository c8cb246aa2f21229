// RMSNorm of rows (rms_norm_cpu.cpp's op; also called directly by decode_stack_cpu.cpp's lean path, so
// both compute the same numbers: include this file only from sources built with the same flags).
//
// Each row's sum of squares runs over 16 partial sums in a fixed order and a fixed tree, whatever
// the number of rows or threads, so a row's output does not depend on its neighbours.
#pragma once
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>

namespace rms_kernels {
namespace {

constexpr int kLanes = 16;

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* w, scalar_t* y, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * D;
      scalar_t* yr = y + r * D;
      float acc[kLanes] = {0};
      int64_t i = 0;
      for (; i + kLanes <= D; i += kLanes) {
#pragma GCC unroll 16
        for (int j = 0; j < kLanes; ++j) {
          const float v = static_cast<float>(xr[i + j]);
          acc[j] += v * v;
        }
      }
      for (int j = 0; i < D; ++i, ++j) {
        const float v = static_cast<float>(xr[i]);
        acc[j] += v * v;
      }
      for (int width = kLanes / 2; width > 0; width /= 2) {
        for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
      }
      const float rstd = 1.0f / std::sqrt(acc[0] / static_cast<float>(D) + eps);
      for (int64_t k = 0; k < D; ++k) {
        const scalar_t normed = static_cast<scalar_t>(static_cast<float>(xr[k]) * rstd);  // the cast back
        yr[k] = static_cast<scalar_t>(static_cast<float>(w[k]) * static_cast<float>(normed));  // the scale
      }
    }
  });
}

}  // namespace
}  // namespace rms_kernels
