// Synthetic models: the exact shapes and MLX affine layout of real
// checkpoints (4-bit, group 64, bf16 scales and biases, 8-bit router and
// shared-expert gate) with random weights made in memory. Benchmarks run on
// them because real weights are not available offline; the work and the bytes
// moved per token are those of the real model.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/weights.h"

namespace lily {

// "qwen3.6-35b-a3b" (Qwen3.6-35B-A3B, qwen3_5_moe) and "qwen3-30b-a3b"
// (Qwen3-30B-A3B, qwen3_moe).
std::vector<std::string> synthetic_model_names();
ModelConfig synthetic_config(const std::string& name);

// materialize = true: random weights in host memory (any backend can run
// them). materialize = false: matrices carry shape and format only (data ==
// nullptr) and layout "synthetic"; the cuda backend generates their contents
// on the device, which is much faster for a 20 GB model. Small vectors (norms,
// conv taps, gate constants) are always filled.
std::unique_ptr<ModelWeights> make_synthetic_model(const std::string& name, uint64_t seed,
                                                   bool materialize);

}  // namespace lily
