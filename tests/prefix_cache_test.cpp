// The prefix cache: its bookkeeping (lookups, LRU eviction within a byte
// budget and an entry count), the backends' cache copy and truncation it
// relies on, and the generator reusing kept states across conversations on
// a hybrid model (exact-length states only, branch points) and on a
// pure-attention one (any common prefix), with the same tokens as a
// generator that reuses nothing.
#include "engine/prefix_cache.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "engine/generator.h"
#include "engine/sequence.h"
#include "engine_test_util.h"
#include "fixture_util.h"
#include "text/tokenizer.h"

namespace lily {
namespace {

using engine::PrefixCache;
using test::fixture_dir;

class FakeCache final : public SequenceCache {
 public:
  explicit FakeCache(size_t bytes) : bytes_(bytes) {}
  std::unique_ptr<SequenceCache> clone() const override {
    return std::make_unique<FakeCache>(bytes_);
  }
  size_t bytes() const override { return bytes_; }

 private:
  size_t bytes_;
};

// Entry sizes in the test below are the state's bytes + 4 per token.
std::unique_ptr<SequenceCache> fake(size_t bytes) {
  return std::make_unique<FakeCache>(bytes);
}

TEST(PrefixCache, FindsTheLongestUsablePrefix) {
  PrefixCache c(1 << 20, 8);
  EXPECT_EQ(engine::common_prefix(std::vector<int>{1, 2, 3}, std::vector<int>{1, 2, 4, 5}), 2u);
  EXPECT_EQ(engine::common_prefix(std::vector<int>{}, std::vector<int>{1}), 0u);
  ASSERT_TRUE(c.insert({1, 2}, fake(100), {}));
  ASSERT_TRUE(c.insert({1, 2, 3, 4}, fake(100), {}));
  ASSERT_TRUE(c.insert({1, 2, 3}, fake(100), {0.5f}));
  EXPECT_EQ(c.size(), 3u);

  const std::vector<int> p = {1, 2, 3, 4};
  const auto* e = c.find_prefix(p);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->tokens, (std::vector<int>{1, 2, 3})) << "as long as the prompt only with logits";
  const std::vector<int> p3 = {1, 2, 3};
  EXPECT_EQ(c.find_prefix(p3)->tokens, p3) << "the whole prompt, with its logits";
  const std::vector<int> other = {2, 1};
  EXPECT_EQ(c.find_prefix(other), nullptr);

  auto [ce, n] = c.find_common(std::vector<int>{1, 2, 3, 9});
  ASSERT_NE(ce, nullptr);
  EXPECT_EQ(n, 3u);
  EXPECT_EQ(c.find_common(other).first, nullptr);

  // Entries {1,2}, {1,2,3,4}, {1,2,3}.
  EXPECT_EQ(c.reach(std::vector<int>{1, 2, 3}, false), 3u);
  EXPECT_EQ(c.reach(std::vector<int>{1, 2, 3, 9}, false), 3u);
  EXPECT_EQ(c.reach(std::vector<int>{1, 2, 3, 4, 5}, false), 4u);
  EXPECT_EQ(c.reach(std::vector<int>{1}, false), 0u) << "a hybrid state is never cut back";
  EXPECT_EQ(c.reach(std::vector<int>{1}, true), 1u);
  EXPECT_EQ(c.reach(std::vector<int>{1, 2, 9}, true), 2u);
  EXPECT_EQ(c.reach(other, true), 0u);
}

TEST(PrefixCache, EvictsTheLeastRecentlyUsedWithinItsLimits) {
  PrefixCache c(1000, 3);
  ASSERT_TRUE(c.insert({1}, fake(296), {}));  // 300 bytes with its token
  ASSERT_TRUE(c.insert({2}, fake(296), {}));
  ASSERT_TRUE(c.insert({3}, fake(296), {}));
  EXPECT_EQ(c.bytes(), 900u);
  c.find_prefix(std::vector<int>{1, 7});      // 1 is now the most recent
  ASSERT_TRUE(c.insert({4}, fake(296), {}));  // over the budget and the count: 2 goes
  EXPECT_EQ(c.size(), 3u);
  EXPECT_EQ(c.reach(std::vector<int>{2}, false), 0u);
  EXPECT_EQ(c.reach(std::vector<int>{1}, false), 1u);
  EXPECT_EQ(c.evictions(), 1u);

  // Replacing an entry with the same tokens does not count twice.
  ASSERT_TRUE(c.insert({4}, fake(96), {}));
  EXPECT_EQ(c.size(), 3u);
  EXPECT_EQ(c.bytes(), 700u);

  // A state over the whole budget is refused and evicts nothing.
  EXPECT_FALSE(c.insert({5}, fake(1000), {}));
  EXPECT_EQ(c.size(), 3u);

  // A large one evicts as many as it needs, oldest first.
  ASSERT_TRUE(c.insert({6}, fake(596), {}));
  EXPECT_EQ(c.bytes(), 1000u);
  EXPECT_EQ(c.reach(std::vector<int>{4}, false), 1u);
  EXPECT_EQ(c.reach(std::vector<int>{6}, false), 1u);
  EXPECT_EQ(c.reach(std::vector<int>{3}, false), 0u) << "the least recently used";
  EXPECT_EQ(c.reach(std::vector<int>{1}, false), 1u);

  c.configure(0, 0);
  EXPECT_EQ(c.size(), 0u);
  EXPECT_EQ(c.bytes(), 0u);
  EXPECT_FALSE(c.enabled());
  EXPECT_FALSE(c.insert({7}, fake(1), {}));
}

TEST(PrefixCache, NeverEvictsTheEntryARequestBuildsOn) {
  PrefixCache c(1000, 8);
  const auto* base = c.insert({1}, fake(596), {});  // 600 bytes
  ASSERT_NE(base, nullptr);
  EXPECT_EQ(c.insert({1, 2}, fake(496), {}, base), nullptr) << "500 do not fit beside it";
  EXPECT_EQ(c.size(), 1u);
  EXPECT_EQ(c.evictions(), 0u);
  ASSERT_NE(c.insert({3}, fake(296), {}), nullptr);  // 900 bytes now; {1} is the older
  ASSERT_NE(c.insert({1, 2}, fake(392), {}, base), nullptr) << "{3} goes instead";
  EXPECT_EQ(c.reach(std::vector<int>{1}, false), 1u);
  EXPECT_EQ(c.reach(std::vector<int>{3}, false), 0u);
  // An entry replaced by its own new state is no obstacle.
  EXPECT_NE(c.insert({1}, fake(96), {}, base), nullptr);
}

Backend& backend_for(const std::string& fixture) { return test::fixture_backend(fixture); }

// A pure-attention cache cut back to n continues exactly as one that only
// ever held n positions; copies carry the whole state.
TEST(PrefixCache, BackendTruncatesAndCopiesCaches) {
  const auto ref = test::load_reference("qwen3", "long");
  Backend& b = backend_for("qwen3");
  ASSERT_TRUE(b.can_truncate());
  const int V = ref.vocab;
  ASSERT_GE(ref.prompt.size(), 44u);
  std::span<const int> p(ref.prompt);
  std::vector<float> want(3 * V), got(3 * V), scratch(V);

  auto a = b.new_cache(64);
  b.forward(*a, p.subspan(0, 40), LogitsMode::LastOnly, scratch.data());
  auto snap = a->clone();
  b.forward(*a, p.subspan(40, 3), LogitsMode::All, want.data());

  auto c = b.new_cache(64);
  b.forward(*c, p.subspan(0, 44), LogitsMode::LastOnly, scratch.data());
  b.truncate(*c, 40);
  EXPECT_EQ(c->n_past(), 40);
  b.forward(*c, p.subspan(40, 3), LogitsMode::All, got.data());
  EXPECT_EQ(got, want);

  // The snapshot copied into a cache holding something else.
  auto d = b.new_cache(8);
  b.forward(*d, p.subspan(10, 5), LogitsMode::LastOnly, scratch.data());
  b.copy_cache(*snap, *d);
  EXPECT_EQ(d->n_past(), 40);
  b.forward(*d, p.subspan(40, 3), LogitsMode::All, got.data());
  EXPECT_EQ(got, want);

  EXPECT_THROW(b.truncate(*d, 44), Error);
  EXPECT_THROW(b.truncate(*d, -1), Error);
}

TEST(PrefixCache, HybridCachesOnlyReset) {
  const auto ref = test::load_reference("qwen3_5_moe", "long");
  Backend& b = backend_for("qwen3_5_moe");
  ASSERT_FALSE(b.can_truncate());
  const int V = ref.vocab;
  std::span<const int> p(ref.prompt);
  std::vector<float> want(V), got(V);
  auto fresh = b.new_cache(64);
  b.forward(*fresh, p.subspan(0, 6), LogitsMode::LastOnly, want.data());

  auto c = b.new_cache(64);
  b.forward(*c, p.subspan(20, 9), LogitsMode::LastOnly, got.data());
  EXPECT_THROW(b.truncate(*c, 4), Error) << "a DeltaNet state cannot be cut back";
  EXPECT_EQ(c->n_past(), 9);
  b.truncate(*c, 0);
  EXPECT_EQ(c->n_past(), 0);
  b.forward(*c, p.subspan(0, 6), LogitsMode::LastOnly, got.data());
  EXPECT_EQ(got, want) << "truncate(0) clears the recurrent state";

  // A copy carries the DeltaNet state: both continue alike.
  auto snap = c->clone();
  EXPECT_LT(snap->bytes(), c->bytes() + 1);
  auto d = b.new_cache(64);
  b.copy_cache(*snap, *d);
  std::vector<float> x(V), y(V);
  b.forward(*c, p.subspan(6, 1), LogitsMode::LastOnly, x.data());
  b.forward(*d, p.subspan(6, 1), LogitsMode::LastOnly, y.data());
  EXPECT_EQ(x, y);
}

// --- the generator --------------------------------------------------------

const text::Tokenizer& tokenizer() { return test::fixture_tokenizer(); }

struct Out {
  std::vector<int> ids;
  engine::GenerationResult result;
};

Out gen(engine::Generator& g, const std::vector<int>& prompt, int n) {
  engine::GenerationParams p;
  p.prompt = prompt;
  p.sampling.temperature = 0;
  p.max_tokens = n;
  Out o;
  o.result = g.generate(p, [&](engine::GenerationEvent&& e) {
    if (e.token) o.ids.push_back(e.token->id);
    return true;
  });
  return o;
}

std::vector<int> random_tokens(int n, int vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(0, vocab - 1);
  std::vector<int> v(n);
  for (int& t : v) t = d(rng);
  return v;
}

std::vector<int> cat(std::vector<int> a, const std::vector<int>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(PrefixCache, HybridGeneratorKeepsBranchPointsAndParkedConversations) {
  Backend& b = backend_for("qwen3_5_moe");
  const int V = b.config().vocab_size;
  engine::Generator g(b, tokenizer(), 256);
  g.keep_min_tokens = 16;
  g.prefill_chunk = 7;  // several chunks per prompt
  engine::Generator plain(b, tokenizer(), 256);
  plain.set_prefix_cache(0, 0);

  const std::vector<int> pre = random_tokens(24, V, 1);
  const std::vector<int> a = cat(pre, random_tokens(5, V, 2)),
                         bb = cat(pre, random_tokens(6, V, 3)),
                         c = cat(pre, random_tokens(4, V, 4));
  ASSERT_EQ(engine::common_prefix(a, bb), 24u);
  ASSERT_EQ(engine::common_prefix(bb, c), 24u);
  Out oa = gen(g, a, 20);
  EXPECT_EQ(oa.result.cached_tokens, 0);
  Out ob = gen(g, bb, 3);
  EXPECT_EQ(ob.result.cached_tokens, 0) << "the second prompt sharing the preamble keeps it";
  Out oc = gen(g, c, 3);
  EXPECT_EQ(oc.result.cached_tokens, 24) << "the third reuses it";
  const size_t kept = g.prefix_cache().size();
  // B's live sequence (prompt + 2 fed) was not parked when C came: its
  // prompt is kept, and 2 tokens are not worth a copy.
  EXPECT_EQ(kept, 5u) << "A's prompt, A parked, the preamble, B's and C's prompts";
  EXPECT_EQ(oc.ids, gen(plain, c, 3).ids);
  EXPECT_EQ(ob.ids, gen(plain, bb, 3).ids);
  EXPECT_EQ(plain.prefix_cache().size(), 0u);

  // Conversation A continues after B and C ran: its live sequence (prompt +
  // the 19 generated tokens fed, at least keep_min_tokens past its kept
  // prompt) was parked when B came, and is extended.
  const std::vector<int> a2 =
      cat(cat(a, std::vector<int>(oa.ids.begin(), oa.ids.begin() + 19)), {5, 6, 7});
  Out oa2 = gen(g, a2, 3);
  EXPECT_EQ(oa2.result.cached_tokens, static_cast<int>(a.size()) + 19);
  EXPECT_EQ(oa2.ids, gen(plain, a2, 3).ids);

  // A regenerate of B: its prompt's state with logits, nothing to run.
  Out ob2 = gen(g, bb, 3);
  EXPECT_EQ(ob2.result.cached_tokens, static_cast<int>(bb.size()));
  EXPECT_EQ(ob2.ids, ob.ids);

  // Below branch_min_tokens no branch point is kept.
  const std::vector<int> short1 = cat(random_tokens(5, V, 9), {1, 2}),
                         short2 = cat(random_tokens(5, V, 9), {3, 4}),
                         short3 = cat(random_tokens(5, V, 9), {5, 6});
  gen(g, short1, 1);
  gen(g, short2, 1);
  EXPECT_EQ(gen(g, short3, 1).result.cached_tokens, 0);

  // Within the limits: at most 3 entries.
  g.set_prefix_cache(size_t{1} << 30, 3);
  EXPECT_LE(g.prefix_cache().size(), 3u);
  gen(g, c, 1);
  gen(g, a, 1);
  EXPECT_LE(g.prefix_cache().size(), 3u);
  // Off: only the live sequence is reused.
  g.set_prefix_cache(0, 0);
  EXPECT_EQ(g.prefix_cache().size(), 0u);
  EXPECT_EQ(gen(g, bb, 1).result.cached_tokens, 0);
  const std::vector<int> bb2 = cat(bb, {8});
  EXPECT_EQ(gen(g, bb2, 1).result.cached_tokens, static_cast<int>(bb.size()));
}

// A budget with room for one preamble state: the second request's own
// prompt state must not push out the branch point it just kept.
TEST(PrefixCache, HybridBranchPointSurvivesATightBudget) {
  Backend& b = backend_for("qwen3_5_moe");
  const int V = b.config().vocab_size;
  engine::Generator g(b, tokenizer(), 256);
  g.keep_min_tokens = 16;
  const std::vector<int> pre = random_tokens(24, V, 21);
  const std::vector<int> a = cat(pre, random_tokens(5, V, 22)), bb = cat(pre, random_tokens(6, V, 23)),
                         c = cat(pre, random_tokens(4, V, 24));
  // Measure one kept state, then allow a little more than one.
  gen(g, a, 1);
  ASSERT_EQ(g.prefix_cache().size(), 1u);
  const size_t one = g.prefix_cache().bytes();
  g.reset();
  g.set_prefix_cache(one + one / 2, 32);
  gen(g, a, 1);
  gen(g, bb, 1);
  EXPECT_EQ(gen(g, c, 1).result.cached_tokens, 24);
  EXPECT_EQ(gen(g, bb, 1).result.cached_tokens, 24);
}

TEST(PrefixCache, AttentionGeneratorReusesAnyCommonPrefix) {
  Backend& b = backend_for("qwen3");
  const int V = b.config().vocab_size;
  engine::Generator g(b, tokenizer(), 256);
  g.keep_min_tokens = 4;
  engine::Generator plain(b, tokenizer(), 256);
  plain.set_prefix_cache(0, 0);
  const std::vector<int> pre = random_tokens(20, V, 11);
  const std::vector<int> a = cat(pre, random_tokens(5, V, 12)),
                         bb = cat(pre, random_tokens(6, V, 13));
  Out oa = gen(g, a, 4);
  Out ob = gen(g, bb, 4);
  EXPECT_EQ(ob.result.cached_tokens, 20) << "the live sequence cut back to the shared preamble";
  EXPECT_EQ(ob.ids, gen(plain, bb, 4).ids);
  EXPECT_EQ(g.prefix_cache().size(), 1u) << "A was parked before the cut";
  // A again: from its parked state (prompt + 3 fed tokens), cut back.
  Out oa2 = gen(g, a, 4);
  EXPECT_EQ(oa2.result.cached_tokens, static_cast<int>(a.size()) - 1);
  EXPECT_EQ(oa2.ids, oa.ids);
  EXPECT_EQ(g.prefix_cache().size(), 2u) << "B parked too";

  // With the default keep_min_tokens, a live sequence whose unshared tail
  // is short is cut back without a copy.
  engine::Generator h(b, tokenizer(), 256);
  gen(h, a, 4);
  EXPECT_EQ(gen(h, bb, 4).result.cached_tokens, 20);
  EXPECT_EQ(h.prefix_cache().size(), 0u);
}

}  // namespace
}  // namespace lily
