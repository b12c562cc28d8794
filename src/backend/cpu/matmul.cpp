#include <algorithm>
#include <cstring>
#include <vector>

#include "backend/cpu/kernels.h"
#include "core/half.h"

namespace lily::cpu {

namespace {

inline float load_scale(const uint8_t* p, DType dt, size_t i) {
  uint16_t h;
  switch (dt) {
    case DType::F32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case DType::F16:
      std::memcpy(&h, p + 2 * i, 2);
      return f16_to_f32(h);
    default:
      std::memcpy(&h, p + 2 * i, 2);
      return bf16_to_f32(h);
  }
}

}  // namespace

void dequantize_row(const Matrix& w, int row, float* out) {
  const uint8_t* src = w.data + w.row_bytes() * row;
  const int n = w.cols;
  switch (w.format) {
    case WeightFormat::F32:
      std::memcpy(out, src, sizeof(float) * n);
      return;
    // Tensors need not be 2-byte aligned in the file (the safetensors header
    // length is arbitrary), so halves are loaded with memcpy.
    case WeightFormat::BF16:
      for (int i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = bf16_to_f32(h);
      }
      return;
    case WeightFormat::F16:
      for (int i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = f16_to_f32(h);
      }
      return;
    case WeightFormat::Affine4:
    case WeightFormat::Affine8: {
      const int bits = w.bits();
      const uint32_t mask = (1u << bits) - 1;
      const int per_word = 32 / bits;
      const size_t groups = w.groups_per_row();
      const size_t g0 = groups * row;
      for (size_t g = 0; g < groups; ++g) {
        const float scale = load_scale(w.scales, w.scale_dtype, g0 + g);
        const float bias = load_scale(w.biases, w.scale_dtype, g0 + g);
        const int base = static_cast<int>(g) * w.group_size;
        for (int i = 0; i < w.group_size; i += per_word) {
          uint32_t word;
          std::memcpy(&word, src + (static_cast<size_t>(base + i) * bits) / 8, 4);
          for (int j = 0; j < per_word; ++j) {
            out[base + i + j] = scale * static_cast<float>((word >> (bits * j)) & mask) + bias;
          }
        }
      }
      return;
    }
  }
}

void matmul(ThreadPool& pool, const Matrix& w, const float* x, int T, size_t x_stride, float* y,
            size_t y_stride) {
  const int rows = w.rows, cols = w.cols;
  // Enough rows per task that the per-task overhead stays small.
  const size_t grain = std::max<size_t>(1, 16384 / std::max(1, cols));
  pool.parallel_for(rows, grain, [&](size_t r0, size_t r1) {
    thread_local std::vector<float> row;
    row.resize(cols);
    for (size_t r = r0; r < r1; ++r) {
      dequantize_row(w, static_cast<int>(r), row.data());
      const float* wr = row.data();
      for (int t = 0; t < T; ++t) {
        const float* xt = x + t * x_stride;
        // Eight partial sums let the compiler vectorise without -ffast-math.
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int c = 0;
        for (; c + 8 <= cols; c += 8)
          for (int j = 0; j < 8; ++j) acc[j] += wr[c + j] * xt[c + j];
        float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (; c < cols; ++c) s += wr[c] * xt[c];
        y[t * y_stride + r] = s;
      }
    }
  });
}

}  // namespace lily::cpu
