#include "backend/backend.h"

#include <cstdio>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"

namespace lily {

#ifndef LILY_HAVE_CUDA
std::string cuda_unavailable_reason() { return "lily was built without CUDA (nvcc not found)"; }
bool cuda_device_available() { return false; }
bool cuda_device_present() { return false; }
#endif

bool Backend::can_truncate() const {
  for (LayerKind k : config().layer_kinds)
    if (k != LayerKind::FullAttention) return false;
  return true;
}

void Backend::draft_begin(SequenceCache& cache, int T) {
  if (cache.draft_tokens_ != 0) fail("internal: forward_draft while a draft run is not yet settled");
  if (T < 1) fail("forward_draft: no tokens");
  cache.draft_tokens_ = T;
}

int Backend::draft_end(SequenceCache& cache, int n) {
  const int T = cache.draft_tokens_;
  if (T == 0) fail("internal: accept_draft without a draft run");
  if (n < 1 || n > T) fail("internal: accept_draft(", n, ") after a run of ", T, " tokens");
  cache.draft_tokens_ = 0;
  return T;
}

void Backend::forward_draft(SequenceCache& cache, std::span<const int> tokens, float* logits) {
  if (cache.draft_tokens_ != 0) fail("internal: forward_draft while a draft run is not yet settled");
  const bool cut = can_truncate();
  if (!cut) cache.draft_base_ = cache.clone();
  cache.draft_run_.assign(tokens.begin(), tokens.end());
  forward(cache, tokens, LogitsMode::All, logits);
  draft_begin(cache, static_cast<int>(tokens.size()));
}

void Backend::accept_draft(SequenceCache& cache, int n) {
  const int T = draft_end(cache, n);
  std::unique_ptr<SequenceCache> base = std::move(cache.draft_base_);
  std::vector<int> run = std::move(cache.draft_run_);
  cache.draft_run_.clear();
  if (n == T) return;
  if (can_truncate()) {
    truncate(cache, cache.n_past() - (T - n));
    return;
  }
  if (!base) fail("internal: accept_draft without the state before the run");
  copy_cache(*base, cache);
  std::vector<float> scratch(static_cast<size_t>(config().vocab_size));
  forward(cache, std::span<const int>(run.data(), static_cast<size_t>(n)), LogitsMode::LastOnly,
          scratch.data());
}

bool Backend::can_sample(const TokenSampling&) const { return false; }

int Backend::forward_sample(SequenceCache&, int, const TokenSampling&, bool&) {
  fail("internal: the ", name(), " backend does not sample on its own (can_sample is false)");
}

bool Backend::can_sample_draft(const TokenSampling&) const { return false; }

void Backend::forward_draft_sample(SequenceCache&, std::span<const int>, std::span<const TokenSampling>, int*, int*) {
  fail("internal: the ", name(), " backend does not sample draft runs (can_sample_draft is false)");
}

std::string default_backend_kind() { return cuda_device_available() ? "cuda" : "cpu"; }

// "auto" settles on cpu without a word when there is no GPU at all; a GPU
// that is there but unusable is worth one line (the user may expect it).
std::string resolve_backend_kind(const std::string& kind) {
  if (kind != "auto") return kind;
  const std::string k = default_backend_kind();
  if (k == "cpu" && cuda_device_present())
    std::fprintf(stderr, "lily: using the cpu backend: %s\n", cuda_unavailable_reason().c_str());
  return k;
}

std::unique_ptr<Backend> make_backend(std::unique_ptr<ModelWeights> weights,
                                      const BackendOptions& options) {
  const std::string kind = resolve_backend_kind(options.kind);
  const std::string& kv = options.kv_cache;
  cuda::KvType kv_type = cuda::KvType::BF16;
  if (!kv.empty() && !cuda::parse_kv_type(kv, kv_type))
    fail("KV cache type '", kv, "': expected bf16, q8 or f32");
  if (kind == "cpu") {
    if (!kv.empty() && kv != "f32" && options.kind == "cpu")
      fail("KV cache type '", kv, "': the cpu backend keeps an f32 KV cache");
    return make_cpu_backend(std::move(weights), options.threads, options.cpu_act);
  }
  if (kind == "cuda") {
#ifdef LILY_HAVE_CUDA
    cuda::CudaOptions o = cuda::options_from_env();
    if (!kv.empty()) o.kv = kv_type;
    return cuda::make_cuda_backend(std::move(weights), o);
#else
    fail("backend 'cuda' is not available: ", cuda_unavailable_reason());
#endif
  }
  fail("unknown backend '", options.kind, "' (available: cpu, cuda, auto)");
}

}  // namespace lily
