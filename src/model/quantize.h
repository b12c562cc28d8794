// Load-time quantization of a bf16/f16/f32 checkpoint into lily's group-wise
// affine format, which is the MLX layout: per group of `group_size`
// consecutive inputs, w = scale * q + bias with q in [0, 2^bits - 1], codes
// packed low-bits-first into little-endian u32, scale and bias in bf16.
// Kernels therefore need no second format.
#pragma once

#include "model/weights.h"

namespace lily {

struct QuantizeOptions {
  int bits = 4;          // 4 or 8
  int group_size = 64;
  // Routers and the shared-expert gate are tiny and steer everything after
  // them; like the MLX community checkpoints, keep them at 8 bits.
  bool routers_at_8_bits = true;
};

// Quantizes every dense matrix of the model in place (its memory moves to
// weights.owned_buffers). Matrices already quantized are left as they are.
void quantize_model(ModelWeights& weights, const QuantizeOptions& options);

// Parses "q4" / "q8" (case-insensitive); fails naming the option otherwise.
QuantizeOptions parse_quantize_option(const std::string& value);

}  // namespace lily
