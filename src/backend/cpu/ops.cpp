#include <cmath>
#include <vector>

#include "backend/cpu/kernels.h"

namespace lily::cpu {

float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
float silu(float x) { return x / (1.f + std::exp(-x)); }
float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

void rms_norm(const float* x, const float* weight, int n, float eps, float* y) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.f / std::sqrt(static_cast<float>(ss / n) + eps);
  for (int i = 0; i < n; ++i) y[i] = x[i] * inv * weight[i];
}

void rope_table(int rotary_dim, int position, float theta, float* cos_out, float* sin_out) {
  const int half = rotary_dim / 2;
  for (int i = 0; i < half; ++i) {
    // inv_freq in f32 as transformers computes it; the angle in f32 too.
    const float inv_freq = static_cast<float>(
        1.0 / std::pow(static_cast<double>(theta), (2.0 * i) / rotary_dim));
    const float angle = static_cast<float>(position) * inv_freq;
    cos_out[i] = std::cos(angle);
    sin_out[i] = std::sin(angle);
  }
}

void rope_apply(float* head, int rotary_dim, const float* c, const float* s) {
  const int half = rotary_dim / 2;
  for (int i = 0; i < half; ++i) {
    const float x1 = head[i], x2 = head[i + half];
    head[i] = x1 * c[i] - x2 * s[i];
    head[i + half] = x2 * c[i] + x1 * s[i];
  }
}

void rope_neox(float* head, int rotary_dim, int position, float theta) {
  std::vector<float> c(rotary_dim / 2), s(rotary_dim / 2);
  rope_table(rotary_dim, position, theta, c.data(), s.data());
  rope_apply(head, rotary_dim, c.data(), s.data());
}

}  // namespace lily::cpu
