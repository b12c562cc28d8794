// Model states kept between requests (the prefix cache). Each entry holds
// the tokens it was computed from, a compact copy of the backend state after
// them (KV rows + DeltaNet state) and, when known, the logits after the last
// one. A request starts from the longest entry its prompt extends (or, for
// pure-attention models, that shares the longest prefix with it: a KV cache
// can be cut back, a DeltaNet state cannot). The least recently used
// entries are evicted to stay within a byte budget and an entry count.
//
// Not thread-safe: the engine thread owns it. Entry pointers returned by the
// lookups stay valid until the next insert, configure or clear.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "backend/backend.h"

namespace lily::engine {

// Length of the common prefix of a and b.
size_t common_prefix(std::span<const int> a, std::span<const int> b);

class PrefixCache {
 public:
  struct Entry {
    std::vector<int> tokens;
    std::unique_ptr<SequenceCache> state;
    std::vector<float> logits;  // after the last token; empty when not kept
    size_t bytes = 0;
    uint64_t used = 0;  // LRU clock
  };

  PrefixCache(size_t budget_bytes, int max_entries) { configure(budget_bytes, max_entries); }

  // New limits; evicts what no longer fits.
  void configure(size_t budget_bytes, int max_entries);

  // The longest entry whose tokens are a prefix of `prompt` and that can
  // start it: shorter than the prompt, or as long when it kept its logits.
  // Marks it used. nullptr when none.
  const Entry* find_prefix(std::span<const int> prompt);
  // The entry sharing the longest common prefix with `tokens` and that
  // length (ties: the most recently used); {nullptr, 0} when none shares a
  // token. Marks it used.
  std::pair<const Entry*, size_t> find_common(std::span<const int> tokens);
  // How many of the first positions of `tokens` a kept state could restore:
  // the longest entry that is a prefix of them, or (cut: the model's caches
  // can be cut back) the longest prefix any entry shares with them.
  size_t reach(std::span<const int> tokens, bool cut) const;

  // Keeps a state, replacing an entry with the same tokens and evicting the
  // least recently used ones to stay within the limits, but never `keep`
  // (the entry the current request started from or branched at: a state
  // that only serves this prompt again must not push out the one that
  // serves every prompt sharing its beginning). Returns the new entry, or
  // nullptr (nothing kept, nothing evicted) when the state does not fit
  // beside `keep`, is alone over the budget, or the cache is off.
  const Entry* insert(std::vector<int> tokens, std::unique_ptr<SequenceCache> state,
                      std::vector<float> logits, const Entry* keep = nullptr);

  bool enabled() const { return max_entries_ > 0 && budget_ > 0; }
  size_t bytes() const { return bytes_; }
  size_t size() const { return entries_.size(); }
  size_t budget() const { return budget_; }
  uint64_t evictions() const { return evictions_; }
  void clear();

 private:
  void evict_to(size_t bytes, size_t entries, const Entry* keep = nullptr);

  std::vector<std::unique_ptr<Entry>> entries_;
  size_t budget_ = 0;
  size_t max_entries_ = 0;
  size_t bytes_ = 0;
  uint64_t clock_ = 0;
  uint64_t evictions_ = 0;
};

}  // namespace lily::engine
