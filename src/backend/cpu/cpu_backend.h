#pragma once

#include <memory>

#include "backend/backend.h"

namespace lily {

std::unique_ptr<Backend> make_cpu_backend(std::unique_ptr<ModelWeights> weights, int threads);

}  // namespace lily
