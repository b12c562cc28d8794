// Choosing the next token from a row of logits, on the CPU.
//
// Pipeline, in this order (temperature == 0 stops after step 1 with argmax):
//   0. logit_bias (OpenAI): a fixed value added to the logit of listed
//      tokens, on a copy of the logits (-100 bans a token in practice,
//      +100 forces it); sampling and greedy alike.
//   1. Penalties, on the same copy:
//      * repetition_penalty (Hugging Face semantics) over every distinct token
//        of the history, prompt AND generated: a positive logit is divided by
//        the penalty, a negative one multiplied by it. 1 = off.
//      * frequency_penalty and presence_penalty (OpenAI semantics) over the
//        GENERATED tokens only (history[prompt_len:]):
//          logit -= frequency_penalty * count + presence_penalty * (count > 0)
//        0 = off. Repetition is applied first, then these two.
//   2. temperature: logits / temperature.
//   3. top_k (0 = off): keep the k highest logits.
//   4. top_p (1 = off): over the softmax of what is left, keep the smallest
//      set of most probable tokens whose probability sums to at least top_p
//      (the token that crosses top_p is kept; at least one token always is).
//   5. min_p (0 = off): keep tokens whose probability is at least
//      min_p * (probability of the most likely token).
//   6. Draw from what is left, in proportion to exp(logit / temperature).
// Ties are broken towards the lower token id everywhere (argmax, top-k,
// top-p), so the kept set and its order do not depend on the sort algorithm.
//
// Reproducibility: the draw uses std::mt19937_64 seeded with params.seed (or
// from std::random_device when has_seed is false); one 64-bit output per
// sampled token, turned into a double in [0, 1) as (x >> 11) * 2^-53 rather
// than through std::uniform_real_distribution, whose algorithm the standard
// leaves open. The same seed, parameters, logits and history give the same
// tokens (across platforms too, up to last-bit differences between libm exp
// implementations). Each non-greedy sample() consumes exactly one draw,
// whatever the filters; greedy sampling consumes none.
//
// Cost for a vocabulary of V: one copy of the row and, unless top-k is on,
// one exp per token (O(V)). Top-k is one pass with a k-heap (k <= 1024) or
// nth_element, plus a sort of k. Top-p without top-k is two passes that
// bucket the tokens by weight (1/8 nat per bucket), then sorts only the
// bucket where the mass crosses top_p. Nothing sorts the whole vocabulary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/sampling.h"

namespace lily::engine {

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy
  float top_p = 1.0f;        // (0, 1]
  float min_p = 0.0f;        // [0, 1]
  int top_k = 0;             // 0 = off
  float repetition_penalty = 1.0f;  // > 0; 1 = off
  float presence_penalty = 0.0f;    // [-2, 2]
  float frequency_penalty = 0.0f;   // [-2, 2]
  uint64_t seed = 0;
  bool has_seed = false;
  // (token id, value in [-100, 100]) added to that token's logit; an id may
  // appear once. Ids beyond the vocabulary fail at sample().
  std::vector<std::pair<int, float>> logit_bias;

  // Defaults from a model's generation_config.json: temperature, top_p,
  // top_k, min_p, repetition_penalty when present (null or missing fields
  // keep the defaults above). "do_sample": false means greedy (temperature 0);
  // a missing do_sample is taken as sampling, since a server default should
  // follow the sampling values the model ships. Fails on a field of the
  // wrong type.
  static SamplingParams from_generation_config(const nlohmann::json& config);

  // A message naming the first out-of-range field, or nullopt if all are
  // valid.
  std::optional<std::string> validation_error() const;
  // Throws lily::Error with validation_error()'s message.
  void validate() const;

  bool greedy() const { return temperature == 0.0f; }
};

// The ids of a history (a prompt, then generated tokens) counted, kept
// across calls for the penalties: sync() compares the history with the one
// counted last and counts only the difference (a generation appends a
// token; a draft run's rows add their drafts, and the next call drops the
// refused ones), so a token costs a compare of the history, not a sort of
// it. Vocabulary-sized counts and bitsets (the ids come out ascending).
class TokenCounts {
 public:
  // Fails on an id outside [0, vocab).
  void sync(std::span<const int> history, size_t prompt_len, size_t vocab);
  // fn(id) for each id in the history, ascending.
  template <typename Fn>
  void for_each_seen(Fn fn) const;
  // fn(id, count) for each id generated (history[prompt_len:]), ascending.
  template <typename Fn>
  void for_each_generated(Fn fn) const;
  size_t seen_ids() const { return seen_ids_; }  // distinct ids in the history

 private:
  void add(int id, bool generated, int step);
  size_t vocab_ = 0, prompt_len_ = 0, seen_ids_ = 0;
  std::vector<int> counted_;                // the history counted
  std::vector<uint32_t> seen_, generated_;  // counts by id
  std::vector<uint64_t> seen_bits_, generated_bits_;
};

class Sampler {
 public:
  // Validates params (throws lily::Error).
  explicit Sampler(const SamplingParams& params);

  // Picks the next token. history = prompt tokens followed by the generated
  // tokens; history[prompt_len:] are the generated ones (prompt_len is
  // clamped to history.size()). Fails if the logits are empty, if a history
  // token is outside the vocabulary, or if no logit is finite.
  int sample(std::span<const float> logits, std::span<const int> history = {},
             size_t prompt_len = 0);

  const SamplingParams& params() const { return params_; }

  // The same choice made by the backend from its own logits
  // (Backend::forward_sample; backend/sampling.h): the request for this
  // history, the adjustments folded from logit_bias and the penalties in
  // sample()'s arithmetic; sampling without top_k (or with top_k not below
  // the vocabulary) asks for the whole vocabulary (top_k 0). nullopt where
  // the backend's pipeline does not cover the parameters (top_k above
  // kMaxBackendTopK and below the vocabulary). Fails as sample() would on a
  // logit_bias id outside the vocabulary.
  std::optional<TokenSampling> backend_request(std::span<const int> history, size_t prompt_len,
                                               size_t vocab);
  // The request's parameters alone (no adjustments): what a backend's
  // can_sample looks at; nullopt as backend_request.
  std::optional<TokenSampling> backend_params(size_t vocab) const;
  // Puts the next samples' draws into rows[i].u (sampling; greedy draws
  // nothing), one a row, as successive sample() calls would draw them; once
  // the backend has chosen, backend_done(n) keeps the first n draws (those
  // the choices the caller takes used) and gives the rest back: a sample()
  // that returns before drawing, a draft run's rows past the first
  // mismatch.
  void backend_draw(std::span<TokenSampling> rows);
  void backend_draw(TokenSampling& r) { backend_draw(std::span<TokenSampling>(&r, 1)); }
  void backend_done(int draws_used);

 private:
  void apply_penalties(std::span<const int> history, size_t prompt_len);
  // What frequency and presence penalties take off a logit seen `count` times.
  float penalty_sub(float count) const;
  bool penalised() const;
  // order_ = the n most likely tokens of work_, most likely first.
  void select_top(size_t n);
  double uniform();

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::mt19937_64 rng_before_draw_;  // backend_draw's state, for backend_done
  std::vector<float> work_;
  std::vector<int> order_;
  std::vector<double> weights_;
  TokenCounts counts_;
  std::vector<int> crossing_;
};

// Index of the largest logit, the lowest on ties (NaN counts as -inf).
int argmax(std::span<const float> logits);

// log(sum(exp(logits))), computed stably in double; NaN counts as -inf.
double log_sum_exp(std::span<const float> logits);

// Log-probability of token id under softmax(logits): the raw logits, before
// any penalty or temperature, as OpenAI reports logprobs.
float logprob_of(std::span<const float> logits, int id);

// The n most likely tokens and their log-probabilities, most likely first
// (ties: lower id first); n is clamped to the vocabulary size.
std::vector<std::pair<int, float>> top_logprobs(std::span<const float> logits, size_t n);

// Both of the above with one log-sum-exp: id's log-probability and the n
// most likely ids' (the same values).
TokenLogprobs token_logprobs(std::span<const float> logits, int id, size_t n);

}  // namespace lily::engine
