#include "backend/backend.h"

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

namespace lily {

std::unique_ptr<Backend> make_backend(std::unique_ptr<ModelWeights> weights,
                                      const BackendOptions& options) {
  if (options.kind == "cpu") return make_cpu_backend(std::move(weights), options.threads);
  fail("unknown backend '", options.kind, "' (available: cpu)");
}

}  // namespace lily
