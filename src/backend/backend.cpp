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
  const std::string& kv = options.kv_cache;
  cuda::KvType kv_type = cuda::KvType::BF16;
  if (!kv.empty() && !cuda::parse_kv_type(kv, kv_type))
    fail("KV cache type '", kv, "': expected bf16, q8 or f32");
  if (kind == "cpu") {
    if (!kv.empty() && kv != "f32" && options.kind == "cpu")
      fail("KV cache type '", kv, "': the cpu backend keeps an f32 KV cache");
    return make_cpu_backend(std::move(weights), options.threads);
  }
  if (kind == "cuda") {
#ifdef LILY_HAVE_CUDA
    cuda::CudaOptions o = cuda::options_from_env();
    if (!kv.empty()) o.kv = kv_type;
    return cuda::make_cuda_backend(std::move(weights), o);
#else
    fail("backend 'cuda' is not available: lily was built without CUDA (nvcc not found)");
#endif
  }
  fail("unknown backend '", options.kind, "' (available: cpu, cuda, auto)");
}

}  // namespace lily
