#include "backend/backend.h"

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"

namespace lily {

#ifndef LILY_HAVE_CUDA
bool cuda_device_available() { return false; }
#endif

std::string default_backend_kind() { return cuda_device_available() ? "cuda" : "cpu"; }

std::unique_ptr<Backend> make_backend(std::unique_ptr<ModelWeights> weights,
                                      const BackendOptions& options) {
  const std::string kind = options.kind == "auto" ? default_backend_kind() : options.kind;
  if (kind == "cpu") return make_cpu_backend(std::move(weights), options.threads);
  if (kind == "cuda") {
#ifdef LILY_HAVE_CUDA
    return cuda::make_cuda_backend(std::move(weights), cuda::options_from_env());
#else
    fail("backend 'cuda' is not available: lily was built without CUDA (nvcc not found)");
#endif
  }
  fail("unknown backend '", options.kind, "' (available: cpu, cuda, auto)");
}

}  // namespace lily
