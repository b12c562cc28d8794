// Drafts for speculative decoding by prompt lookup: the tokens that followed
// the latest earlier occurrence of the output's last few tokens in the
// prompt or the output so far. No extra weights; it pays where the output
// repeats its context (quoting, editing code or a document, extracting
// fields, structured output), and costs nothing where it finds no match.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace lily::engine {

class PromptLookup {
 public:
  // n-grams from max_ngram down to min_ngram tokens are tried, longest first.
  explicit PromptLookup(int min_ngram = 2, int max_ngram = 4);

  // Up to k tokens to follow `history`: the continuation of the most recent
  // earlier occurrence of its longest matching suffix. The history only
  // grows between calls (one PromptLookup per generation): what was indexed
  // is not checked again; a shorter history starts the index afresh.
  // Empty when no suffix of at least min_ngram tokens occurred before.
  std::vector<int> propose(const std::vector<int>& history, int k);

 private:
  static uint64_t key(const int* tokens, int n);

  int min_n_, max_n_;
  // Per n - min_n: n-gram key -> position right after its latest occurrence.
  std::vector<std::unordered_map<uint64_t, uint32_t>> last_;
  size_t indexed_ = 0;  // n-grams ending before this position are indexed
};

}  // namespace lily::engine
