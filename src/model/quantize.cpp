#include "model/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/half.h"

namespace lily {

namespace {

float load_weight(const Matrix& m, size_t row, size_t col) {
  const uint8_t* p = m.data + m.row_bytes() * row;
  uint16_t h;
  switch (m.format) {
    case WeightFormat::F32: {
      float f;
      std::memcpy(&f, p + 4 * col, 4);
      return f;
    }
    case WeightFormat::F16:
      std::memcpy(&h, p + 2 * col, 2);
      return f16_to_f32(h);
    default:
      std::memcpy(&h, p + 2 * col, 2);
      return bf16_to_f32(h);
  }
}

void quantize_matrix(ModelWeights& w, Matrix& m, int bits, int group) {
  if (m.empty() || m.quantized()) return;
  if (m.cols % group != 0)
    fail("cannot quantize '", m.name, "': ", m.cols, " inputs are not a multiple of the group size ",
         group);
  const size_t rows = m.rows, cols = m.cols, groups = cols / group;
  const int levels = (1 << bits) - 1, per_word = 32 / bits;
  std::vector<uint8_t> codes(rows * cols * bits / 8), scales(rows * groups * 2), biases(scales.size());
  auto work = [&](size_t r0, size_t r1) {
    std::vector<float> row(cols);
    for (size_t r = r0; r < r1; ++r) {
      for (size_t c = 0; c < cols; ++c) row[c] = load_weight(m, r, c);
      for (size_t g = 0; g < groups; ++g) {
        const float* x = &row[g * group];
        auto [lo, hi] = std::minmax_element(x, x + group);
        // Round scale and bias to bf16 first so the codes are chosen against
        // the values the kernels will actually use.
        const uint16_t sb = f32_to_bf16(std::max((*hi - *lo) / levels, 1e-8f));
        const uint16_t bb = f32_to_bf16(*lo);
        const float scale = bf16_to_f32(sb), bias = bf16_to_f32(bb);
        std::memcpy(&scales[(r * groups + g) * 2], &sb, 2);
        std::memcpy(&biases[(r * groups + g) * 2], &bb, 2);
        for (int i = 0; i < group; i += per_word) {
          uint32_t word = 0;
          for (int j = 0; j < per_word; ++j) {
            float q = std::nearbyint((x[i + j] - bias) / scale);
            q = std::clamp(q, 0.f, static_cast<float>(levels));
            word |= static_cast<uint32_t>(q) << (bits * j);
          }
          std::memcpy(&codes[((r * cols) + g * group + i) * bits / 8], &word, 4);
        }
      }
    }
  };
  const size_t n_threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  const size_t chunk = (rows + n_threads - 1) / n_threads;
  for (size_t t = 0; t < n_threads && t * chunk < rows; ++t)
    threads.emplace_back(work, t * chunk, std::min(rows, (t + 1) * chunk));
  for (auto& t : threads) t.join();

  m.format = bits == 4 ? WeightFormat::Affine4 : WeightFormat::Affine8;
  m.group_size = group;
  m.scale_dtype = DType::BF16;
  w.owned_buffers.push_back(std::move(codes));
  m.data = w.owned_buffers.back().data();
  w.owned_buffers.push_back(std::move(scales));
  m.scales = w.owned_buffers.back().data();
  w.owned_buffers.push_back(std::move(biases));
  m.biases = w.owned_buffers.back().data();
}

// Several Matrix values may view one stored tensor (tied embeddings, expert
// slices of a fused tensor); each is quantized as its own rows, which is the
// same result, and a tied lm_head is re-pointed at the quantized embedding.
void quantize_mlp(ModelWeights& w, MlpWeights& m, int bits, int group) {
  quantize_matrix(w, m.gate, bits, group);
  quantize_matrix(w, m.up, bits, group);
  quantize_matrix(w, m.down, bits, group);
}

}  // namespace

QuantizeOptions parse_quantize_option(const std::string& value) {
  QuantizeOptions o;
  std::string v = value;
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (v == "q4") o.bits = 4;
  else if (v == "q8") o.bits = 8;
  else fail("option --quantize: '", value, "' is not one of q4, q8");
  return o;
}

void quantize_model(ModelWeights& w, const QuantizeOptions& o) {
  if (o.bits != 4 && o.bits != 8) fail("quantization to ", o.bits, " bits is not supported");
  // (owned_buffers may reallocate: moving an inner vector keeps its data
  // pointer, so matrices already pointing into it stay valid.)
  const int g = o.group_size, b = o.bits, rb = o.routers_at_8_bits ? 8 : o.bits;
  const bool tied = w.lm_head.data == w.embed.data;
  quantize_matrix(w, w.embed, b, g);
  if (tied) w.lm_head = w.embed;
  else quantize_matrix(w, w.lm_head, b, g);
  for (auto& L : w.layers) {
    for (Matrix* m : {&L.attn.q, &L.attn.k, &L.attn.v, &L.attn.o, &L.deltanet.in_qkv,
                      &L.deltanet.in_z, &L.deltanet.in_a, &L.deltanet.in_b, &L.deltanet.out})
      quantize_matrix(w, *m, b, g);
    if (L.is_moe) {
      quantize_matrix(w, L.moe.router, rb, g);
      for (auto& e : L.moe.experts) quantize_mlp(w, e, b, g);
      if (L.moe.has_shared) {
        quantize_mlp(w, L.moe.shared, b, g);
        quantize_matrix(w, L.moe.shared_gate, rb, g);
      }
    } else {
      quantize_mlp(w, L.mlp, b, g);
    }
  }
}

}  // namespace lily
