// The backend boundary: one forward pass over a run of tokens of one
// sequence, against that sequence's cache. cpu/ is the portable reference;
// other backends (cuda/) implement the same interface.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/sampling.h"
#include "model/weights.h"

namespace lily {

// A sequence's model state in backend memory: KV cache of the attention
// layers, recurrent + conv state of the DeltaNet layers, and how many
// positions it holds. The engine owns it; the backend creates it.
class SequenceCache {
 public:
  virtual ~SequenceCache() = default;
  int n_past() const { return n_past_; }
  // A deep copy holding only what its positions need (KV rows [0, n_past)
  // and the recurrent state), for snapshots: prefix reuse, rollback. Its
  // memory grows on demand like any cache's.
  virtual std::unique_ptr<SequenceCache> clone() const = 0;
  // Memory the cache holds now.
  virtual size_t bytes() const = 0;
  // Tokens of a forward_draft not yet settled by accept_draft (0: none).
  int draft_pending() const { return draft_tokens_; }
  // Forgets a pending draft run's bookkeeping (after a failed step, with the
  // cache about to be cleared).
  void forget_draft() {
    draft_tokens_ = 0;
    draft_run_.clear();
    draft_base_.reset();
  }

 protected:
  friend class Backend;
  int n_past_ = 0;
  int draft_tokens_ = 0;
  // Backend's default draft bookkeeping: the run's tokens and the state
  // before it (hybrid models).
  std::vector<int> draft_run_;
  std::unique_ptr<SequenceCache> draft_base_;
};

enum class LogitsMode { LastOnly, All };

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual const ModelConfig& config() const = 0;
  // max_positions: capacity the cache may reserve up front (it may grow).
  virtual std::unique_ptr<SequenceCache> new_cache(int max_positions) = 0;
  // Appends `tokens` to the sequence at positions [n_past, n_past + n) and
  // writes logits (n x vocab for All, vocab for LastOnly) to `logits`.
  // One token runs the decode path; more run the prefill path.
  virtual void forward(SequenceCache& cache, std::span<const int> tokens, LogitsMode mode,
                       float* logits) = 0;

  // Makes `dst` hold the same state as `src` (positions [0, src.n_past())),
  // reusing dst's memory where it is large enough (and, on cuda, the decode
  // graph captured for it). Both caches come from this backend.
  virtual void copy_cache(const SequenceCache& src, SequenceCache& dst) = 0;
  // Drops positions [n, n_past), keeping the memory. n == 0 works for every
  // model and always clears the recurrent state; 0 < n < n_past only where
  // no layer carries recurrent state (can_truncate()), since a DeltaNet
  // state cannot be rolled back. Fails otherwise.
  virtual void truncate(SequenceCache& cache, int n) = 0;
  // Whether truncate() takes any n: the model has no DeltaNet layers.
  bool can_truncate() const;

  // Speculative verification. forward_draft runs `tokens` (a token and the
  // drafted tokens after it) as forward(All) does, n rows of logits, and
  // keeps what it needs to return to any position inside the run;
  // accept_draft(n) then keeps the run's first n tokens (1 <= n <= the
  // run's length) and drops the rest. Nothing else may use the cache in
  // between (other calls fail). This default keeps a copy of the state
  // before the run (hybrid models) and, when tokens are dropped, restores
  // it and runs the kept ones again; a pure-attention model's cache is cut
  // back. Backends override it with a cheaper way.
  virtual void forward_draft(SequenceCache& cache, std::span<const int> tokens, float* logits);
  virtual void accept_draft(SequenceCache& cache, int n);
  // The longest run forward_draft is worth for (the engine drafts at most
  // this many tokens minus one): 1 where a few-token forward costs far
  // more than a decode step, so that drafting cannot pay.
  virtual int max_draft_run() const { return 1; }

  // A decode step of `token` that also picks the next token on the backend
  // from the step's own logits (backend/sampling.h): only the id comes
  // back. `drew` tells whether the draw s.u was used (sampling with a
  // finite best logit), as engine::Sampler would have drawn. can_sample
  // says whether this backend takes `s` at all, from its parameters alone
  // (not its adjustments: the engine asks once a generation; with a
  // grammar it asks with an allow mask, which a backend that does not apply
  // masks refuses); the default takes nothing and forward_sample fails.
  virtual bool can_sample(const TokenSampling& s) const;
  virtual int forward_sample(SequenceCache& cache, int token, const TokenSampling& s, bool& drew);
  // forward_draft whose rows the backend samples itself: row i (the token
  // after tokens[i]) with s[i], whose adjustments follow the history up to
  // tokens[i]; ids[i] and drew[i] (0 / 1) as forward_sample's, no logits
  // back. accept_draft settles the run as after forward_draft.
  // can_sample_draft: whether this backend takes such a run with `s`.
  virtual bool can_sample_draft(const TokenSampling& s) const;
  virtual void forward_draft_sample(SequenceCache& cache, std::span<const int> tokens,
                                    std::span<const TokenSampling> s, int* ids, int* drew);

 protected:
  // For overrides: checks a forward_draft / accept_draft call and records
  // (begin) or clears (end) the pending run.
  static void draft_begin(SequenceCache& cache, int T);
  static int draft_end(SequenceCache& cache, int n);  // returns the run's length
};

struct BackendOptions {
  std::string kind = "cpu";
  int threads = 0;  // 0: all hardware threads
  // KV cache rows: "bf16", "q8" or "f32" (cuda; the cpu backend keeps f32 and
  // refuses another type when asked for by name, ignores it under "auto").
  // Empty: the backend's default (cuda: LILY_CUDA_KV, else bf16).
  std::string kv_cache;
  // cpu: the inputs of quantized matmuls, "auto" (16-bit integer codes
  // where the CPU has AVX-512 VNNI or AVX2, else f32), "f32" (the reference
  // precision), "q16" or "q8".
  std::string cpu_act = "auto";
};

// Takes ownership of the weights.
std::unique_ptr<Backend> make_backend(std::unique_ptr<ModelWeights> weights,
                                      const BackendOptions& options);

}  // namespace lily
