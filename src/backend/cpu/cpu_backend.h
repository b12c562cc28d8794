#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"

namespace lily {

// act: the inputs of quantized matmuls: "f32" (the reference), "q16" /
// "q8" (integer codes per group on AVX-512 VNNI; cpu/kernels.h), or "auto" /
// "" (q16 where the CPU has AVX-512 VNNI or AVX2, else f32).
std::unique_ptr<Backend> make_cpu_backend(std::unique_ptr<ModelWeights> weights, int threads,
                                          const std::string& act = "auto");

}  // namespace lily
