#include "engine/prefix_cache.h"

#include <algorithm>

namespace lily::engine {

size_t common_prefix(std::span<const int> a, std::span<const int> b) {
  const size_t n = std::min(a.size(), b.size());
  return static_cast<size_t>(
      std::mismatch(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(n), b.begin()).first -
      a.begin());
}

void PrefixCache::configure(size_t budget_bytes, int max_entries) {
  budget_ = budget_bytes;
  max_entries_ = static_cast<size_t>(std::max(0, max_entries));
  evict_to(budget_, max_entries_);
}

const PrefixCache::Entry* PrefixCache::find_prefix(std::span<const int> prompt) {
  Entry* best = nullptr;
  for (auto& e : entries_) {
    const size_t n = e->tokens.size();
    if (n == 0 || n > prompt.size()) continue;
    if (n == prompt.size() && e->logits.empty()) continue;
    if (best && n <= best->tokens.size()) continue;
    if (common_prefix(e->tokens, prompt) == n) best = e.get();
  }
  if (best) best->used = ++clock_;
  return best;
}

std::pair<const PrefixCache::Entry*, size_t> PrefixCache::find_common(std::span<const int> tokens) {
  Entry* best = nullptr;
  size_t best_len = 0;
  for (auto& e : entries_) {
    const size_t n = common_prefix(e->tokens, tokens);
    if (n == 0) continue;
    if (n > best_len || (n == best_len && e->used > best->used)) {
      best = e.get();
      best_len = n;
    }
  }
  if (best) best->used = ++clock_;
  return {best, best_len};
}

size_t PrefixCache::reach(std::span<const int> tokens, bool cut) const {
  size_t best = 0;
  for (const auto& e : entries_) {
    const size_t n = common_prefix(e->tokens, tokens);
    if (cut || n == e->tokens.size()) best = std::max(best, n);
  }
  return best;
}

const PrefixCache::Entry* PrefixCache::insert(std::vector<int> tokens,
                                              std::unique_ptr<SequenceCache> state,
                                              std::vector<float> logits, const Entry* keep) {
  if (!state || tokens.empty() || !enabled()) return nullptr;
  const size_t b = state->bytes() + logits.size() * sizeof(float) + tokens.size() * sizeof(int);
  if (b > budget_) return nullptr;
  auto same = std::find_if(entries_.begin(), entries_.end(),
                           [&](const auto& e) { return e->tokens == tokens; });
  if (same != entries_.end() && same->get() == keep) keep = nullptr;  // replaced by its new state
  if (keep && (keep->bytes + b > budget_ || max_entries_ < 2)) return nullptr;
  // The same tokens again: the new state replaces the old one.
  if (same != entries_.end()) {
    bytes_ -= (*same)->bytes;
    entries_.erase(same);
  }
  evict_to(budget_ - b, max_entries_ - 1, keep);
  auto e = std::make_unique<Entry>();
  e->tokens = std::move(tokens);
  e->state = std::move(state);
  e->logits = std::move(logits);
  e->bytes = b;
  e->used = ++clock_;
  bytes_ += b;
  entries_.push_back(std::move(e));
  return entries_.back().get();
}

void PrefixCache::evict_to(size_t bytes, size_t entries, const Entry* keep) {
  while (!entries_.empty() && (bytes_ > bytes || entries_.size() > entries)) {
    auto lru = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it)
      if (it->get() != keep && (lru == entries_.end() || (*it)->used < (*lru)->used)) lru = it;
    if (lru == entries_.end()) return;  // only `keep` is left
    bytes_ -= (*lru)->bytes;
    entries_.erase(lru);
    ++evictions_;
  }
}

void PrefixCache::clear() {
  entries_.clear();
  bytes_ = 0;
}

}  // namespace lily::engine
