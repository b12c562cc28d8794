// One sequence's state as the engine owns it: the tokens it holds and the
// backend cache for them (KV for attention layers, recurrent + conv state for
// DeltaNet layers). Snapshots are deep copies: DeltaNet state cannot be
// truncated the way a KV cache can, so rolling back a hybrid model means
// restoring one; a pure-attention model's sequence can also be truncated.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"

namespace lily {

class Sequence {
 public:
  // max_positions: the context limit; appending past it is refused.
  Sequence(Backend& backend, int max_positions);

  int size() const { return static_cast<int>(tokens_.size()); }
  int max_positions() const { return max_positions_; }
  const std::vector<int>& tokens() const { return tokens_; }

  // Runs `tokens` through the model in one forward (prefill path for n > 1,
  // decode path for n == 1) and returns the logits (n rows for All, else the
  // last row only).
  std::vector<float> append(std::span<const int> tokens, LogitsMode mode = LogitsMode::LastOnly);

  // Runs one token through the model and has the backend choose the next
  // one from the step's logits (Backend::forward_sample: no logits come
  // back); `drew` as there.
  int append_sample(int token, const TokenSampling& s, bool& drew);

  // Speculative verification: runs `tokens` (the next token and drafted
  // ones after it) and returns a row of logits per token; accept_draft(n)
  // then keeps the first n of them (1 <= n <= tokens.size()). In between,
  // only accept_draft and reset may be called.
  std::vector<float> append_draft(std::span<const int> tokens);
  // append_draft with the rows' next tokens chosen by the backend
  // (Backend::forward_draft_sample): ids / drew per row, no logits.
  void append_draft_sample(std::span<const int> tokens, std::span<const TokenSampling> s, int* ids, int* drew);
  void accept_draft(int n);
  int draft_pending() const { return cache_->draft_pending(); }

  struct Snapshot {
    std::vector<int> tokens;
    std::unique_ptr<SequenceCache> cache;
  };
  // A compact deep copy of the state.
  Snapshot snapshot() const;
  // Takes the snapshot's state (copied into this sequence's memory).
  void restore(const Snapshot& s) { restore(s.tokens, *s.cache); }
  void restore(const std::vector<int>& tokens, const SequenceCache& cache);
  // Keeps the first n tokens: any n for models without DeltaNet layers
  // (Backend::can_truncate), else only 0 (see reset).
  void truncate(int n);
  // Empties the sequence, keeping its memory.
  void reset();

 private:
  void check_append(std::span<const int> tokens) const;

  Backend& backend_;
  int max_positions_;
  std::vector<int> tokens_;
  std::unique_ptr<SequenceCache> cache_;
};

// Greedy continuation of `prompt` (argmax, ties to the lowest id); stops after
// max_new tokens or at an id in `stop_ids`, which is included in the output.
std::vector<int> generate_greedy(Sequence& seq, std::span<const int> prompt, int max_new,
                                 std::span<const int> stop_ids);

int argmax(std::span<const float> logits);

}  // namespace lily
