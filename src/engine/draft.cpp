#include "engine/draft.h"

#include <algorithm>

#include "core/error.h"

namespace lily::engine {

PromptLookup::PromptLookup(int min_ngram, int max_ngram) : min_n_(min_ngram), max_n_(max_ngram) {
  if (min_n_ < 1 || max_n_ < min_n_) fail("prompt lookup: n-gram sizes ", min_n_, "..", max_n_, " are invalid");
  last_.resize(static_cast<size_t>(max_n_ - min_n_ + 1));
}

uint64_t PromptLookup::key(const int* tokens, int n) {
  uint64_t h = 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(n);
  for (int i = 0; i < n; ++i) {
    h ^= static_cast<uint32_t>(tokens[i]);
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
  }
  return h;
}

std::vector<int> PromptLookup::propose(const std::vector<int>& history, int k) {
  std::vector<int> out;
  const size_t H = history.size();
  if (k <= 0 || H < static_cast<size_t>(min_n_) + 1) return out;
  // Index the n-grams ending before the last token (the suffix must not
  // find itself), each pointing at the token after it.
  if (indexed_ > H) {
    for (auto& m : last_) m.clear();
    indexed_ = 0;
  }
  for (; indexed_ + 1 < H; ++indexed_) {
    const size_t p = indexed_;  // n-grams ending at p, followed by p + 1
    for (int n = min_n_; n <= max_n_ && p + 1 >= static_cast<size_t>(n); ++n)
      last_[n - min_n_][key(&history[p + 1 - n], n)] = static_cast<uint32_t>(p + 1);
  }
  for (int n = std::min<int>(max_n_, static_cast<int>(H) - 1); n >= min_n_; --n) {
    const int* suffix = &history[H - n];
    const auto& m = last_[n - min_n_];
    const auto it = m.find(key(suffix, n));
    if (it == m.end()) continue;
    const size_t start = it->second;  // right after the earlier occurrence
    if (start < static_cast<size_t>(n) || !std::equal(suffix, suffix + n, &history[start - n])) continue;
    for (size_t p = start; p < H && static_cast<int>(out.size()) < k; ++p) out.push_back(history[p]);
    return out;
  }
  return out;
}

}  // namespace lily::engine
