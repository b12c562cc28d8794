// Speculative decoding: the prompt-lookup drafter, the backends' draft runs
// (forward_draft / accept_draft, the CPU backend's own and the default the
// other backends inherit) against single decode steps on every model
// fixture, and the generator with drafts against the generator without.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "engine/draft.h"
#include "engine/generator.h"
#include "engine/sequence.h"
#include "engine_test_util.h"
#include "fixture_util.h"
#include "text/tokenizer.h"

namespace lily {
namespace {

using engine::PromptLookup;
using test::fixture_dir;

// --- the drafter ----------------------------------------------------------

TEST(PromptLookup, ProposesWhatFollowedTheLatestLongestMatch) {
  PromptLookup d(2, 4);
  // "5 6" occurs twice, followed by 7 8 then by 9 1; the latest wins.
  std::vector<int> h = {5, 6, 7, 8, 3, 5, 6, 9, 1, 2, 5, 6};
  EXPECT_EQ(d.propose(h, 3), (std::vector<int>{9, 1, 2}));
  EXPECT_EQ(d.propose(h, 1), (std::vector<int>{9}));
  // A longer match is preferred over a later shorter one: "3 5 6" -> 9.
  PromptLookup e(2, 4);
  std::vector<int> h2 = {3, 5, 6, 9, 4, 5, 6, 7, 0, 3, 5, 6};
  EXPECT_EQ(e.propose(h2, 2), (std::vector<int>{9, 4}));
  // The continuation stops at the end of the history.
  PromptLookup f(2, 4);
  std::vector<int> h3 = {1, 2, 3, 1, 2};
  EXPECT_EQ(f.propose(h3, 8), (std::vector<int>{3, 1, 2}));
}

TEST(PromptLookup, ProposesNothingWithoutAnEarlierOccurrence) {
  PromptLookup d(2, 4);
  EXPECT_TRUE(d.propose({1, 2, 3, 4}, 4).empty());
  EXPECT_TRUE(d.propose({7}, 4).empty());
  EXPECT_TRUE(d.propose({}, 4).empty());
  EXPECT_TRUE(d.propose({1, 2, 1, 2}, 0).empty());
  // A single repeated token is below the 2-gram minimum.
  EXPECT_TRUE(d.propose({4, 9, 1, 9}, 3).empty());
  // The suffix never matches itself: "8 8" ending at the last token only.
  PromptLookup e(2, 4);
  EXPECT_TRUE(e.propose({3, 8, 8}, 2).empty());
  EXPECT_EQ(e.propose({3, 8, 8, 8}, 2), (std::vector<int>{8}));
}

TEST(PromptLookup, FollowsAGrowingHistoryAndRestartsOnAShorterOne) {
  PromptLookup d(2, 3);
  std::vector<int> h = {10, 11, 12, 13};
  EXPECT_TRUE(d.propose(h, 2).empty());
  h.insert(h.end(), {10, 11});
  EXPECT_EQ(d.propose(h, 2), (std::vector<int>{12, 13}));
  h.insert(h.end(), {12, 14, 11, 12});
  EXPECT_EQ(d.propose(h, 2), (std::vector<int>{14, 11}));  // "11 12" latest before the end: at 5..6
  // Another, shorter history.
  EXPECT_EQ(d.propose({1, 2, 3, 1, 2}, 1), (std::vector<int>{3}));
  EXPECT_THROW(PromptLookup(0, 2), Error);
  EXPECT_THROW(PromptLookup(3, 2), Error);
}

// --- draft runs in the backends --------------------------------------------

Backend& backend_for(const std::string& fixture) { return test::fixture_backend(fixture); }

// The largest |a - b| relative to the largest |b|.
float rel_diff(std::span<const float> a, std::span<const float> b) {
  float d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::abs(a[i] - b[i]));
    m = std::max(m, std::abs(b[i]));
  }
  return d / std::max(m, 1e-20f);
}

// Logits after each of `tokens`, fed one decode step at a time after
// `prefix` (prefill).
std::vector<float> stepwise(Backend& b, std::span<const int> prefix, std::span<const int> tokens) {
  const int V = b.config().vocab_size;
  auto c = b.new_cache(256);
  std::vector<float> scratch(V), out(tokens.size() * V);
  b.forward(*c, prefix, LogitsMode::LastOnly, scratch.data());
  for (size_t t = 0; t < tokens.size(); ++t) b.forward(*c, tokens.subspan(t, 1), LogitsMode::LastOnly, &out[t * V]);
  return out;
}

class DraftRun : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

// A run's rows equal decode steps; after keeping n of its tokens the cache
// continues as one that only ever held those (the DeltaNet state and conv
// inputs replayed or recomputed, the KV rows cut back); several rounds in a
// row, and a fully kept run too.
TEST_P(DraftRun, RowsAndKeptPrefixesMatchDecodeSteps) {
  const auto& [fixture, own] = GetParam();
  Backend& b = backend_for(fixture);
  const int V = b.config().vocab_size;
  const auto ref = test::load_reference(fixture, "long");
  std::vector<int> toks = ref.prompt;
  toks.insert(toks.end(), ref.generated.begin(), ref.generated.end());
  ASSERT_GE(toks.size(), 40u);
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> any(0, V - 1);

  auto draft = [&](SequenceCache& c, std::span<const int> run, float* out) {
    if (own) b.forward_draft(c, run, out);
    else b.Backend::forward_draft(c, run, out);
  };
  auto accept = [&](SequenceCache& c, int n) {
    if (own) b.accept_draft(c, n);
    else b.Backend::accept_draft(c, n);
  };

  // What the sequence holds, fed step by step in the reference.
  std::vector<int> held(toks.begin(), toks.begin() + 6);
  auto c = b.new_cache(256);
  std::vector<float> scratch(V);
  b.forward(*c, held, LogitsMode::LastOnly, scratch.data());
  const int keeps[] = {2, 5, 1, 3, 4};
  for (int round = 0; round < 5; ++round) {
    // A run of 5: real tokens and a random one (a wrong draft).
    std::vector<int> run(toks.begin() + held.size(), toks.begin() + held.size() + 5);
    run[3] = any(rng);
    std::vector<float> rows(run.size() * V);
    draft(*c, run, rows.data());
    EXPECT_EQ(c->n_past(), static_cast<int>(held.size() + run.size()));
    EXPECT_EQ(c->draft_pending(), 5);
    const std::vector<float> want = stepwise(b, held, run);
    for (size_t t = 0; t < run.size(); ++t)
      EXPECT_LT(rel_diff(std::span<const float>(rows).subspan(t * V, V),
                         std::span<const float>(want).subspan(t * V, V)),
                2e-5f)
          << fixture << " round " << round << " row " << t;
    const int n = keeps[round];
    accept(*c, n);
    EXPECT_EQ(c->draft_pending(), 0);
    held.insert(held.end(), run.begin(), run.begin() + n);
    ASSERT_EQ(c->n_past(), static_cast<int>(held.size()));
    // The next token, then another step: as if only `held` had been fed.
    const int next[] = {any(rng), toks[held.size()]};
    std::vector<float> got(2 * V);
    b.forward(*c, std::span<const int>(next, 1), LogitsMode::LastOnly, got.data());
    b.forward(*c, std::span<const int>(next + 1, 1), LogitsMode::LastOnly, got.data() + V);
    const std::vector<float> expect = stepwise(b, held, next);
    EXPECT_LT(rel_diff(got, expect), 2e-5f) << fixture << " round " << round << " kept " << n;
    held.insert(held.end(), next, next + 2);
  }
}

TEST_P(DraftRun, MisuseIsRefused) {
  const auto& [fixture, own] = GetParam();
  if (!own) GTEST_SKIP() << "the checks are shared";
  Backend& b = backend_for(fixture);
  const int V = b.config().vocab_size;
  Sequence seq(b, 64);
  seq.append(std::vector<int>{1, 2, 3});
  EXPECT_THROW(seq.accept_draft(1), Error) << "no run";
  const std::vector<float> rows = seq.append_draft(std::vector<int>{4, 5, 6});
  EXPECT_EQ(rows.size(), 3u * V);
  EXPECT_EQ(seq.size(), 6);
  EXPECT_THROW(seq.append(std::vector<int>{7}), Error) << "a run pending";
  EXPECT_THROW(seq.append_draft(std::vector<int>{7}), Error);
  EXPECT_THROW(seq.snapshot(), Error);
  EXPECT_THROW(seq.truncate(2), Error);
  EXPECT_THROW(seq.accept_draft(0), Error);
  EXPECT_THROW(seq.accept_draft(4), Error);
  seq.accept_draft(2);
  EXPECT_EQ(seq.tokens(), (std::vector<int>{1, 2, 3, 4, 5}));
  seq.append_draft(std::vector<int>{6, 7});
  seq.reset();  // drops a pending run
  EXPECT_EQ(seq.size(), 0);
  seq.append(std::vector<int>{1});
  EXPECT_THROW(Sequence(b, 4).append_draft(std::vector<int>{1, 2, 3, 4, 5}), Error) << "past the context";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DraftRun,
                         ::testing::Combine(::testing::Values("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe",
                                                              "qwen3_5_moe-mlx4"),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           std::string n = std::get<0>(info.param) + (std::get<1>(info.param) ? "_own" : "_default");
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

// --- the generator --------------------------------------------------------

const text::Tokenizer& tokenizer() { return test::fixture_tokenizer(); }

struct Out {
  std::vector<int> ids;
  std::string text;
  engine::GenerationResult result;
};

Out gen(engine::Generator& g, engine::GenerationParams p) {
  Out o;
  o.result = g.generate(p, [&](engine::GenerationEvent&& e) {
    if (e.token) o.ids.push_back(e.token->id);
    o.text += e.text;
    return true;
  });
  return o;
}

// A prompt that repeats itself and a bias towards four of its tokens, so
// that the tiny random models' output falls into loops (part of which the
// drafts from the prompt and the output foresee, part not).
class SpeculativeGenerator : public ::testing::TestWithParam<std::string> {};

// Greedy and seeded sampling give the same tokens with drafts as without;
// drafts were run and some were taken; the live sequence afterwards holds
// exactly the prompt and the fed output (the last token never fed), so a
// follow-up reusing it continues as the plain generator does.
TEST_P(SpeculativeGenerator, SameTokensAsWithoutDrafts) {
  Backend& b = backend_for(GetParam());
  const int V = b.config().vocab_size;
  engine::Generator plain(b, tokenizer(), 512), spec(b, tokenizer(), 512);
  spec.speculative_tokens = 6;
  spec.speculative_adaptive = false;
  int drafted = 0, accepted = 0;
  for (unsigned seed = 1; seed <= 3; ++seed) {
    for (float temperature : {0.f, 0.9f}) {
      engine::GenerationParams p = test::looping_prompt(V, seed);
      p.sampling.temperature = temperature;
      p.sampling.seed = seed;
      p.sampling.has_seed = true;
      p.max_tokens = 40;
      const Out a = gen(plain, p), s = gen(spec, p);
      EXPECT_EQ(s.ids, a.ids) << "seed " << seed << " temperature " << temperature;
      EXPECT_EQ(s.text, a.text);
      EXPECT_EQ(s.result.finish, a.result.finish);
      EXPECT_EQ(plain.slot_tokens(), spec.slot_tokens());
      std::vector<int> fed = p.prompt;
      fed.insert(fed.end(), s.ids.begin(), s.ids.end() - 1);
      EXPECT_EQ(spec.slot_tokens(), fed) << "the last token is never fed";
      EXPECT_LE(s.result.accepted_tokens, s.result.draft_tokens);
      drafted += s.result.draft_tokens;
      accepted += s.result.accepted_tokens;
      EXPECT_EQ(a.result.draft_tokens, 0);

      // A follow-up on the live sequence.
      engine::GenerationParams q = p;
      q.prompt.insert(q.prompt.end(), a.ids.begin(), a.ids.end());
      q.prompt.insert(q.prompt.end(), p.prompt.begin(), p.prompt.begin() + 5);
      q.max_tokens = 12;
      const Out a2 = gen(plain, q), s2 = gen(spec, q);
      EXPECT_EQ(s2.ids, a2.ids) << "follow-up, seed " << seed;
      EXPECT_EQ(s2.result.cached_tokens, a2.result.cached_tokens);
    }
  }
  EXPECT_GT(drafted, 0);
  EXPECT_GT(accepted, 0) << "no draft was ever taken: the test exercises nothing";
  EXPECT_LT(accepted, drafted) << "no draft was ever refused: the test exercises less";
}

// Ends inside a run: max_tokens, a stop token and a stop string each cut
// the output where the plain generator does; drafts are never run past the
// last token wanted or past the context.
TEST_P(SpeculativeGenerator, EndsInsideARunAsWithoutDrafts) {
  Backend& b = backend_for(GetParam());
  const int V = b.config().vocab_size;
  engine::GenerationParams p = test::looping_prompt(V, 2);
  p.sampling.temperature = 0;
  p.max_tokens = 30;
  engine::Generator plain(b, tokenizer(), 512);
  const Out full = gen(plain, p);
  ASSERT_EQ(full.ids.size(), 30u);
  for (int cut : {1, 2, 7, 13, 29}) {
    engine::Generator spec(b, tokenizer(), 512);
    spec.speculative_tokens = 8;
    spec.speculative_adaptive = false;
    engine::GenerationParams q = p;
    q.max_tokens = cut;
    Out s = gen(spec, q);
    EXPECT_EQ(s.ids, std::vector<int>(full.ids.begin(), full.ids.begin() + cut)) << "max_tokens " << cut;
    EXPECT_EQ(spec.slot_tokens().size(), p.prompt.size() + cut - 1);
    // The same cut by a stop token (its first occurrence).
    q.max_tokens = 30;
    q.stop_token_ids = {full.ids[cut - 1]};
    s = gen(spec, q);
    const size_t first = std::find(full.ids.begin(), full.ids.end(), full.ids[cut - 1]) - full.ids.begin();
    EXPECT_EQ(s.ids, std::vector<int>(full.ids.begin(), full.ids.begin() + first + 1)) << "stop token at " << cut;
    EXPECT_EQ(spec.slot_tokens().size(), p.prompt.size() + first);
  }
  // The context: a generation that runs into it.
  engine::Generator tight(b, tokenizer(), static_cast<int>(p.prompt.size()) + 9);
  tight.speculative_tokens = 8;
  tight.speculative_adaptive = false;
  engine::Generator tight_plain(b, tokenizer(), static_cast<int>(p.prompt.size()) + 9);
  EXPECT_EQ(gen(tight, p).ids, gen(tight_plain, p).ids);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SpeculativeGenerator, ::testing::Values("qwen3", "qwen3_5", "qwen3_5_moe"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace lily
