#include "engine/sequence.h"

#include <algorithm>

#include "core/error.h"

namespace lily {

Sequence::Sequence(Backend& backend, int max_positions)
    : backend_(backend), max_positions_(max_positions), cache_(backend.new_cache(max_positions)) {
  if (max_positions <= 0) fail("context size must be positive (got ", max_positions, ")");
}

namespace {
void no_pending_draft(const SequenceCache& cache) {
  if (cache.draft_pending()) fail("internal: the sequence has a draft run not yet accepted");
}
}  // namespace

void Sequence::check_append(std::span<const int> tokens) const {
  no_pending_draft(*cache_);
  if (tokens.empty()) fail("append: no tokens");
  if (size() + static_cast<long>(tokens.size()) > max_positions_)
    fail("sequence of ", size() + tokens.size(), " tokens exceeds the context limit of ",
         max_positions_);
  const int V = backend_.config().vocab_size;
  for (int t : tokens)
    if (t < 0 || t >= V) fail("token id ", t, " is outside the vocabulary [0, ", V, ")");
}

std::vector<float> Sequence::append(std::span<const int> tokens, LogitsMode mode) {
  check_append(tokens);
  const int V = backend_.config().vocab_size;
  const size_t rows = mode == LogitsMode::All ? tokens.size() : 1;
  std::vector<float> logits(rows * V);
  backend_.forward(*cache_, tokens, mode, logits.data());
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  return logits;
}

int Sequence::append_sample(int token, const TokenSampling& s, bool& drew) {
  check_append(std::span<const int>(&token, 1));
  const int id = backend_.forward_sample(*cache_, token, s, drew);
  tokens_.push_back(token);
  return id;
}

std::vector<float> Sequence::append_draft(std::span<const int> tokens) {
  check_append(tokens);
  std::vector<float> logits(tokens.size() * static_cast<size_t>(backend_.config().vocab_size));
  backend_.forward_draft(*cache_, tokens, logits.data());
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  return logits;
}

void Sequence::append_draft_sample(std::span<const int> tokens, std::span<const TokenSampling> s, int* ids,
                                   int* drew) {
  check_append(tokens);
  backend_.forward_draft_sample(*cache_, tokens, s, ids, drew);
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
}

void Sequence::accept_draft(int n) {
  const int T = cache_->draft_pending();
  backend_.accept_draft(*cache_, n);
  tokens_.resize(tokens_.size() - static_cast<size_t>(T - n));
}

Sequence::Snapshot Sequence::snapshot() const {
  no_pending_draft(*cache_);
  return {tokens_, cache_->clone()};
}

void Sequence::restore(const std::vector<int>& tokens, const SequenceCache& cache) {
  if (static_cast<int>(tokens.size()) != cache.n_past())
    fail("internal: a snapshot of ", tokens.size(), " tokens holds ", cache.n_past(), " positions");
  if (cache.n_past() > max_positions_)
    fail("internal: a snapshot of ", cache.n_past(), " positions exceeds the context limit of ", max_positions_);
  no_pending_draft(*cache_);
  tokens_.clear();  // a failed copy leaves an empty sequence, not a half-copied one
  backend_.copy_cache(cache, *cache_);
  tokens_ = tokens;
}

void Sequence::truncate(int n) {
  if (n < 0 || n > size()) fail("internal: truncating ", size(), " tokens to ", n);
  if (n == size()) return;
  no_pending_draft(*cache_);
  backend_.truncate(*cache_, n);
  tokens_.resize(static_cast<size_t>(n));
}

void Sequence::reset() {
  tokens_.clear();
  cache_->forget_draft();
  try {
    backend_.truncate(*cache_, 0);  // also clears what a failed step or copy left
  } catch (const Error&) {
    cache_ = backend_.new_cache(max_positions_);  // never keep a state that may be stale
  }
}

int argmax(std::span<const float> logits) {
  return static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

std::vector<int> generate_greedy(Sequence& seq, std::span<const int> prompt, int max_new,
                                 std::span<const int> stop_ids) {
  std::vector<int> out;
  if (max_new <= 0) return out;
  std::vector<float> logits = seq.append(prompt);
  for (;;) {
    int next = argmax(logits);
    out.push_back(next);
    if (static_cast<int>(out.size()) >= max_new ||
        std::find(stop_ids.begin(), stop_ids.end(), next) != stop_ids.end())
      break;
    logits = seq.append(std::span<const int>(&next, 1));
  }
  return out;
}

}  // namespace lily
