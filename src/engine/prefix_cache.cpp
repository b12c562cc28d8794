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

bool PrefixCache::insert(std::vector<int> tokens, std::unique_ptr<SequenceCache> state,
                         std::vector<float> logits) {
  if (!state || tokens.empty() || !enabled()) return false;
  const size_t b = state->bytes() + logits.size() * sizeof(float) + tokens.size() * sizeof(int);
  if (b > budget_) return false;
  // The same tokens again: the new state replaces the old one.
  for (size_t i = 0; i < entries_.size(); ++i)
    if (entries_[i]->tokens == tokens) {
      bytes_ -= entries_[i]->bytes;
      entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
  evict_to(budget_ - b, max_entries_ - 1);
  auto e = std::make_unique<Entry>();
  e->tokens = std::move(tokens);
  e->state = std::move(state);
  e->logits = std::move(logits);
  e->bytes = b;
  e->used = ++clock_;
  bytes_ += b;
  entries_.push_back(std::move(e));
  return true;
}

void PrefixCache::evict_to(size_t bytes, size_t entries) {
  while (!entries_.empty() && (bytes_ > bytes || entries_.size() > entries)) {
    auto lru = std::min_element(entries_.begin(), entries_.end(),
                                [](const auto& a, const auto& b) { return a->used < b->used; });
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
