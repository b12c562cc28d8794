// Shared helpers of the CUDA tests: GPU detection (tests skip cleanly on
// machines without one) and random host matrices in every stored format.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "core/half.h"
#include "model/weights.h"

#define LILY_SKIP_WITHOUT_GPU() \
  if (!::lily::cuda_device_available()) GTEST_SKIP() << ::lily::cuda_unavailable_reason()

namespace lily::test {

inline uint16_t f32_to_f16_bits(float f) {  // normal range, round to nearest even
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t sign = (b >> 16) & 0x8000u;
  int exp = static_cast<int>((b >> 23) & 0xff) - 127 + 15;
  uint32_t mant = b & 0x7fffffu;
  if (exp <= 0) return static_cast<uint16_t>(sign);
  uint32_t m = mant >> 13, rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (m & 1))) {
    if (++m == 0x400u) {
      m = 0;
      ++exp;
    }
  }
  return static_cast<uint16_t>(sign | (uint32_t(exp) << 10) | m);
}

struct HostMatrix {
  std::vector<uint8_t> data, scales, biases;
  Matrix m;
};

// Random matrix in the given stored format (affine: random codes, positive
// scales, mixed-sign biases).
inline HostMatrix random_matrix(WeightFormat f, int rows, int cols, int group, DType sdt,
                                std::mt19937& rng, const std::string& name = "w") {
  HostMatrix h;
  Matrix& m = h.m;
  m.name = name;
  m.format = f;
  m.rows = rows;
  m.cols = cols;
  m.group_size = (f == WeightFormat::Affine4 || f == WeightFormat::Affine8) ? group : 0;
  m.scale_dtype = sdt;
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const size_t n = size_t(rows) * cols;
  auto put16 = [](std::vector<uint8_t>& v, size_t i, uint16_t x) { std::memcpy(&v[2 * i], &x, 2); };
  switch (f) {
    case WeightFormat::F32:
      h.data.resize(n * 4);
      for (size_t i = 0; i < n; ++i) {
        const float x = u(rng) * 0.2f;
        std::memcpy(&h.data[4 * i], &x, 4);
      }
      break;
    case WeightFormat::BF16:
      h.data.resize(n * 2);
      for (size_t i = 0; i < n; ++i) put16(h.data, i, f32_to_bf16(u(rng) * 0.2f));
      break;
    case WeightFormat::F16:
      h.data.resize(n * 2);
      for (size_t i = 0; i < n; ++i) put16(h.data, i, f32_to_f16_bits(u(rng) * 0.2f));
      break;
    case WeightFormat::Affine4:
    case WeightFormat::Affine8: {
      const int bits = f == WeightFormat::Affine4 ? 4 : 8;
      h.data.resize(n * bits / 8);
      for (auto& b : h.data) b = static_cast<uint8_t>(rng());
      const size_t groups = size_t(rows) * (cols / group);
      h.scales.resize(groups * 2);
      h.biases.resize(groups * 2);
      for (size_t g = 0; g < groups; ++g) {
        const float s = (0.02f + 0.01f * u(rng)) * (bits == 4 ? 1.f : 1.f / 16);
        const float b = 0.1f * u(rng);
        put16(h.scales, g, sdt == DType::F16 ? f32_to_f16_bits(s) : f32_to_bf16(s));
        put16(h.biases, g, sdt == DType::F16 ? f32_to_f16_bits(b) : f32_to_bf16(b));
      }
      break;
    }
  }
  m.data = h.data.data();
  m.scales = h.scales.empty() ? nullptr : h.scales.data();
  m.biases = h.biases.empty() ? nullptr : h.biases.data();
  return h;
}

inline std::vector<float> random_vec(size_t n, std::mt19937& rng, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// max |a - b| / max |b|.
inline double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    d = std::max(d, double(std::fabs(a[i] - b[i])));
    m = std::max(m, double(std::fabs(b[i])));
    if (std::isnan(a[i])) return INFINITY;
  }
  return m > 0 ? d / m : d;
}

}  // namespace lily::test
