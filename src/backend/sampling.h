// Choosing the next token on the backend, from a decode step's own logits
// (Backend::forward_sample): nothing but the token id comes back to the
// host, where engine::Sampler (engine/sampler.h) would first copy the whole
// row (a vocabulary of 248,320 logits is ~1 MB a token). The pipeline is the
// Sampler's, for the cases a backend takes:
//   work = logits (NaN as -inf; -inf where the allow mask, when given,
//   has the id's bit clear: a grammar's mask, engine/generator.cpp), then
//   per listed id (ascending ids):
//     += bias, then (rep) work > 0 ? work / rep_penalty : work * rep_penalty,
//     then -= sub   (the caller folds logit_bias, the repetition penalty and
//                    frequency / presence penalties into these, computing sub
//                    in the Sampler's float arithmetic);
//   greedy (temperature 0): argmax, lowest id on ties;
//   else the top_k (1 <= top_k < vocabulary) highest, most likely first
//   (lower id first on ties), weights exp((work - max) / temperature) in
//   double, top_p over them in that order, then min_p, then the draw u in
//   [0, 1) walked in the same order: the Sampler's "listed" path step for
//   step, so the same draw picks the same token (up to last-bit
//   differences between the two exp implementations);
//   or, with top_k 0, the Sampler's path over the whole vocabulary: the
//   weights of every id; top_p by buckets of an eighth of a nat of
//   (max - work) / temperature (512, the last open), every id of the
//   buckets before the one where the mass reaches top_p x total kept, and
//   of that one the best while the mass before them is below the target;
//   then min_p; the draw walks the earlier buckets' ids in id order, then
//   the crossing bucket's best first (without top_p: every id in id
//   order). The same draw picks the same token up to last-bit differences
//   of the sums, which a backend may add in another order.
// With TokenSampling::logprobs, the chosen id's log-probability and the
// most likely ids' come back with it (TokenLogprobs), under the raw row as
// engine::logprob_of / top_logprobs give them: a request for logprobs
// needs no row on the host either.
// Plain structs: included by the CUDA sources (C++17) as well.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace lily {

// A sampled token's log-probabilities, under the row's raw logits (before
// any adjustment, mask or temperature; NaN as -inf), as
// engine::logprob_of / engine::top_logprobs give them from the row.
struct TokenLogprobs {
  float logprob = 0.f;                     // the chosen id's
  std::vector<std::pair<int, float>> top;  // the `logprobs` most likely ids, most likely first (lower id on ties)
};

// The most alternatives a backend must report (OpenAI's top_logprobs cap).
constexpr int kMaxBackendLogprobs = 20;

struct LogitAdjust {
  enum : uint32_t { kBias = 1, kRep = 2, kSub = 4 };
  int32_t id = 0;
  uint32_t ops = 0;  // kBias | kRep | kSub
  float bias = 0.f;
  float sub = 0.f;
};

struct TokenSampling {
  float temperature = 0.f;  // 0: greedy
  int top_k = 1;            // sampling: 1 <= top_k < vocabulary, or 0: all of it (greedy ignores it)
  float top_p = 1.f;
  float min_p = 0.f;
  float rep_penalty = 1.f;  // for the kRep entries
  std::vector<LogitAdjust> adjust;  // ascending ids, each at most once
  // Empty: every id may be chosen. Else (vocabulary + 31) / 32 words, bit
  // (id % 32) of word id / 32 set where id may be chosen. A backend that
  // does not apply it refuses a request that has one (can_sample).
  std::vector<uint32_t> allow;
  // With allow empty: when set, a backend that takes masks calls it to fill
  // allow once the step is queued, before the mask is needed, so that the
  // host computes a grammar's mask while the device runs the step.
  std::function<void(std::vector<uint32_t>& allow)> allow_fill;
  double u = 0.0;  // the draw (sampling only)
  // -1: no log-probabilities. Else 0..kMaxBackendLogprobs: the backend
  // writes the chosen id's log-probability and this many alternatives to
  // *logprobs_out (which must then be set) before its call returns.
  int logprobs = -1;
  TokenLogprobs* logprobs_out = nullptr;
};

// The words of an allow mask over a vocabulary of `vocab` ids.
constexpr size_t allow_words(size_t vocab) { return (vocab + 31) / 32; }

// The longest top_k a backend's sampler must take (engine requests above it
// stay on the host).
constexpr int kMaxBackendTopK = 128;

}  // namespace lily
