#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "core/mapped_file.h"

namespace {

using lily::engine::SamplingParams;
using lily::engine::Sampler;

std::vector<float> random_logits(size_t n, uint64_t seed, float scale = 4.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

SamplingParams seeded(uint64_t seed = 42) {
  SamplingParams p;
  p.seed = seed;
  p.has_seed = true;
  return p;
}

std::vector<int> draws(Sampler& s, const std::vector<float>& logits, int n) {
  std::vector<int> out;
  for (int i = 0; i < n; ++i) out.push_back(s.sample(logits));
  return out;
}

TEST(Sampler, GreedyPicksArgmax) {
  SamplingParams p;
  p.temperature = 0.0f;
  Sampler s(p);
  EXPECT_EQ(s.sample(std::vector<float>{0.1f, 2.0f, -1.0f, 2.0f}), 1);  // tie: lower id
  EXPECT_EQ(s.sample(std::vector<float>{-5.0f}), 0);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(s.sample(std::vector<float>{nan, -3.0f, nan, -2.0f}), 3);
  auto big = random_logits(248320, 3);
  const int expected = static_cast<int>(std::max_element(big.begin(), big.end()) - big.begin());
  EXPECT_EQ(s.sample(big), expected);
  EXPECT_EQ(lily::engine::argmax(big), expected);
}

TEST(Sampler, TemperatureZeroIsDeterministic) {
  auto logits = random_logits(5000, 11);
  const int best = lily::engine::argmax(logits);
  for (uint64_t seed : {1u, 2u, 3u}) {
    SamplingParams p = seeded(seed);
    p.temperature = 0.0f;
    p.top_k = 50;
    p.top_p = 0.5f;
    Sampler s(p);
    for (int i = 0; i < 20; ++i) EXPECT_EQ(s.sample(logits), best);
  }
}

TEST(Sampler, SeedReproducibility) {
  auto logits = random_logits(1000, 5, 1.0f);
  auto make = [](uint64_t seed, int top_k, float top_p, float min_p) {
    SamplingParams p = seeded(seed);
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    return p;
  };
  for (auto [k, tp, mp] : {std::tuple{0, 1.0f, 0.0f}, std::tuple{40, 1.0f, 0.0f},
                           std::tuple{0, 0.9f, 0.0f}, std::tuple{0, 1.0f, 0.05f},
                           std::tuple{100, 0.95f, 0.01f}}) {
    Sampler a(make(42, k, tp, mp)), b(make(42, k, tp, mp)), c(make(43, k, tp, mp));
    auto sa = draws(a, logits, 200), sb = draws(b, logits, 200), sc = draws(c, logits, 200);
    EXPECT_EQ(sa, sb);
    EXPECT_NE(sa, sc);
    EXPECT_GT(std::set<int>(sa.begin(), sa.end()).size(), 20u);  // it does sample
  }
}

TEST(Sampler, TopKOneEqualsGreedy) {
  for (uint64_t seed = 0; seed < 20; ++seed) {
    auto logits = random_logits(3000, seed);
    SamplingParams p = seeded(seed);
    p.top_k = 1;
    Sampler s(p);
    EXPECT_EQ(s.sample(logits), lily::engine::argmax(logits));
  }
  SamplingParams p = seeded();
  p.top_k = 1;
  Sampler s(p);
  EXPECT_EQ(s.sample(std::vector<float>{1.0f, 3.0f, 3.0f, 0.0f}), 1);  // tie: lower id
}

TEST(Sampler, TinyTopPEqualsGreedy) {
  for (uint64_t seed = 0; seed < 20; ++seed) {
    auto logits = random_logits(3000, seed, 0.5f);
    SamplingParams p = seeded(seed);
    p.top_p = 1e-6f;
    Sampler s(p);
    for (int i = 0; i < 5; ++i) EXPECT_EQ(s.sample(logits), lily::engine::argmax(logits));
  }
}

TEST(Sampler, MinPFilters) {
  // Probabilities 0.4, 0.3, 0.2, 0.1: min_p 0.45 keeps p >= 0.18.
  std::vector<float> logits = {std::log(0.1f), std::log(0.4f), std::log(0.2f), std::log(0.3f)};
  SamplingParams p = seeded(9);
  p.min_p = 0.45f;
  Sampler s(p);
  std::vector<int> seen(4, 0);
  for (int i = 0; i < 5000; ++i) ++seen[s.sample(logits)];
  EXPECT_EQ(seen[0], 0);
  EXPECT_GT(seen[1], 0);
  EXPECT_GT(seen[2], 0);
  EXPECT_GT(seen[3], 0);
  EXPECT_NEAR(seen[1] / 5000.0, 0.4 / 0.9, 0.03);
  p.min_p = 0.8f;  // keeps 0.4 only (0.3 < 0.32)
  Sampler t(p);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(t.sample(logits), 1);
}

// 20k draws from a 4-token distribution match its probabilities.
void expect_distribution(const SamplingParams& params, const std::vector<float>& logits,
                         const std::vector<double>& probs) {
  Sampler s(params);
  constexpr int kDraws = 20000;
  std::vector<int> seen(logits.size(), 0);
  for (int i = 0; i < kDraws; ++i) ++seen[s.sample(logits)];
  for (size_t i = 0; i < logits.size(); ++i) {
    // 0.015 is more than 4 standard deviations for any p at 20k draws.
    EXPECT_NEAR(seen[i] / static_cast<double>(kDraws), probs[i], 0.015) << "token " << i;
    if (probs[i] == 0.0) {
      EXPECT_EQ(seen[i], 0) << "token " << i;
    }
  }
}

TEST(Sampler, MatchesDistribution) {
  const std::vector<double> probs = {0.1, 0.2, 0.3, 0.4};
  std::vector<float> logits;
  for (double p : probs) logits.push_back(static_cast<float>(std::log(p)) + 7.0f);
  expect_distribution(seeded(1), logits, probs);
  // Temperature 2: p^(1/2), renormalised.
  SamplingParams hot = seeded(2);
  hot.temperature = 2.0f;
  std::vector<double> sq;
  double z = 0;
  for (double p : probs) z += std::sqrt(p);
  for (double p : probs) sq.push_back(std::sqrt(p) / z);
  expect_distribution(hot, logits, sq);
  // top_k 2: {0.3, 0.4} renormalised.
  SamplingParams k2 = seeded(3);
  k2.top_k = 2;
  expect_distribution(k2, logits, {0, 0, 3.0 / 7, 4.0 / 7});
  // top_p 0.65: 0.4 (mass before 0), 0.3 (mass before 0.4); 0.2 has 0.7 before it.
  SamplingParams tp = seeded(4);
  tp.top_p = 0.65f;
  expect_distribution(tp, logits, {0, 0, 3.0 / 7, 4.0 / 7});
  tp.top_p = 0.75f;  // now 0.2 is kept too
  expect_distribution(tp, logits, {0, 2.0 / 9, 3.0 / 9, 4.0 / 9});
}

// Every draw lies in the set a plain full sort says is kept.
TEST(Sampler, LargeVocabularyKeepsTheRightSet) {
  const size_t vocab = 248320;
  auto logits = random_logits(vocab, 77, 3.0f);
  std::vector<int> order(vocab);
  for (size_t i = 0; i < vocab; ++i) order[i] = static_cast<int>(i);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  struct Case {
    int top_k;
    float top_p, min_p, temperature;
  };
  for (const Case& c : {Case{20, 0.95f, 0.0f, 0.7f}, Case{0, 0.95f, 0.0f, 1.0f},
                        Case{0, 0.999f, 0.0f, 1.5f}, Case{0, 1.0f, 0.05f, 1.0f},
                        Case{50, 1.0f, 0.1f, 1.0f}, Case{0, 0.8f, 0.02f, 0.6f}}) {
    const double mx = logits[order[0]];
    std::vector<double> w;
    for (int id : order) w.push_back(std::exp((logits[id] - mx) / c.temperature));
    size_t n = c.top_k > 0 ? static_cast<size_t>(c.top_k) : vocab;
    if (c.top_p < 1.0f) {
      double total = 0;
      for (size_t i = 0; i < n; ++i) total += w[i];
      double mass = 0;
      size_t i = 0;
      for (; i < n && mass < c.top_p * total; ++i) mass += w[i];
      n = i;
    }
    size_t i = 1;
    while (i < n && w[i] >= c.min_p) ++i;
    n = i;
    std::set<int> kept(order.begin(), order.begin() + n);
    SamplingParams p = seeded(5);
    p.top_k = c.top_k;
    p.top_p = c.top_p;
    p.min_p = c.min_p;
    p.temperature = c.temperature;
    Sampler s(p);
    std::set<int> seen;
    for (int d = 0; d < 60; ++d) {
      int id = s.sample(logits);
      EXPECT_TRUE(kept.count(id)) << "token " << id << " outside the kept " << n;
      seen.insert(id);
    }
    EXPECT_GT(seen.size(), std::min<size_t>(n, 4) - 1);
  }
}

TEST(Sampler, RepetitionPenaltySeesPromptAndGenerated) {
  SamplingParams p = seeded();
  p.temperature = 0.0f;
  p.repetition_penalty = 1.1f;
  Sampler s(p);
  const std::vector<float> pos = {2.0f, 1.9f};  // 2.0 / 1.1 = 1.82 < 1.9
  const std::vector<float> neg = {-1.0f, -1.05f};  // -1.0 * 1.1 = -1.1 < -1.05
  const std::vector<int> hist = {0, 0};
  EXPECT_EQ(s.sample(pos), 0);
  EXPECT_EQ(s.sample(pos, hist, 2), 1);  // token 0 in the prompt
  EXPECT_EQ(s.sample(pos, hist, 0), 1);  // token 0 generated
  EXPECT_EQ(s.sample(neg), 0);
  EXPECT_EQ(s.sample(neg, hist, 1), 1);
  // Applied once per distinct token, not per occurrence: 2.0 / 1.1 > 1.5.
  EXPECT_EQ(s.sample(std::vector<float>{2.0f, 1.5f}, std::vector<int>{0, 0, 0, 0}, 0), 0);
}

TEST(Sampler, PresencePenaltySeesGeneratedOnly) {
  SamplingParams p = seeded();
  p.temperature = 0.0f;
  p.presence_penalty = 1.0f;
  Sampler s(p);
  const std::vector<float> logits = {2.0f, 1.5f};
  EXPECT_EQ(s.sample(logits, std::vector<int>{0}, 1), 0);     // only in the prompt
  EXPECT_EQ(s.sample(logits, std::vector<int>{0}, 0), 1);     // generated: 2 - 1 < 1.5
  EXPECT_EQ(s.sample(logits, std::vector<int>{1, 0}, 1), 1);  // prompt 1, generated 0
  EXPECT_EQ(s.sample(logits, std::vector<int>{0, 1}, 1), 0);  // prompt 0, generated 1
  p.presence_penalty = -1.0f;  // negative encourages
  Sampler e(p);
  EXPECT_EQ(e.sample(logits, std::vector<int>{1}, 0), 1);
}

TEST(Sampler, FrequencyPenaltyCountsOccurrences) {
  SamplingParams p = seeded();
  p.temperature = 0.0f;
  p.frequency_penalty = 0.2f;
  Sampler s(p);
  const std::vector<float> logits = {2.0f, 1.5f};
  EXPECT_EQ(s.sample(logits, std::vector<int>{0}, 0), 0);           // 1.8 > 1.5
  EXPECT_EQ(s.sample(logits, std::vector<int>{0, 0, 0}, 0), 1);     // 1.4 < 1.5
  EXPECT_EQ(s.sample(logits, std::vector<int>{0, 0, 0, 1}, 2), 0);  // one generated 0
  // Sampling (not greedy) also sees it: token 0 made impossible in practice.
  SamplingParams q = seeded(3);
  q.frequency_penalty = 2.0f;
  Sampler t(q);
  std::vector<int> many(20, 0);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(t.sample(logits, many, 0), 1);
}

TEST(Sampler, LogitBias) {
  const std::vector<float> logits = {2.0f, 1.5f, 0.0f, -1.0f};
  SamplingParams p = seeded();
  p.temperature = 0.0f;
  p.logit_bias = {{2, 2.5f}};  // 0 + 2.5 > 2: greedy follows the bias
  Sampler g(p);
  EXPECT_EQ(g.sample(logits), 2);
  p.logit_bias = {{2, 1.9f}};  // 1.9 < 2
  Sampler g2(p);
  EXPECT_EQ(g2.sample(logits), 0);
  // Applied before the penalties: presence 1 on a generated token 2 undoes
  // a bias of 2.5 (0 + 2.5 - 1 < 2).
  p.logit_bias = {{2, 2.5f}};
  p.presence_penalty = 1.0f;
  Sampler g3(p);
  EXPECT_EQ(g3.sample(logits, std::vector<int>{2}, 0), 0);

  // Sampling: -100 bans the likeliest token, +100 forces the least likely.
  SamplingParams q = seeded(7);
  q.logit_bias = {{0, -100.0f}};
  Sampler ban(q);
  auto d = draws(ban, logits, 200);
  EXPECT_EQ(std::count(d.begin(), d.end(), 0), 0);
  EXPECT_GT(std::count(d.begin(), d.end(), 1), 50);
  q.logit_bias = {{3, 100.0f}, {0, -1.0f}};
  Sampler force(q);
  for (int t : draws(force, logits, 100)) EXPECT_EQ(t, 3);
  // A masked token (-inf) stays masked whatever its bias.
  const float inf = std::numeric_limits<float>::infinity();
  q.logit_bias = {{1, 100.0f}};
  Sampler masked(q);
  for (int t : draws(masked, std::vector<float>{0.0f, -inf, 0.5f}, 50)) EXPECT_NE(t, 1);
  // An id beyond the row fails at sample().
  q.logit_bias = {{4, 1.0f}};
  Sampler beyond(q);
  EXPECT_THROW(beyond.sample(logits), lily::Error);
}

TEST(Sampler, Validation) {
  auto bad = [](auto set, const std::string& field) {
    SamplingParams p;
    set(p);
    auto e = p.validation_error();
    ASSERT_TRUE(e.has_value()) << field;
    EXPECT_NE(e->find(field), std::string::npos) << *e;
    EXPECT_THROW(Sampler{p}, lily::Error);
    try {
      p.validate();
    } catch (const lily::Error& err) {
      EXPECT_NE(std::string(err.what()).find(field), std::string::npos) << err.what();
    }
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  bad([](SamplingParams& p) { p.temperature = -0.1f; }, "temperature");
  bad([&](SamplingParams& p) { p.temperature = nan; }, "temperature");
  bad([](SamplingParams& p) { p.top_p = 0.0f; }, "top_p");
  bad([](SamplingParams& p) { p.top_p = 1.01f; }, "top_p");
  bad([&](SamplingParams& p) { p.top_p = nan; }, "top_p");
  bad([](SamplingParams& p) { p.top_k = -1; }, "top_k");
  bad([](SamplingParams& p) { p.min_p = -0.1f; }, "min_p");
  bad([](SamplingParams& p) { p.min_p = 1.5f; }, "min_p");
  bad([](SamplingParams& p) { p.repetition_penalty = 0.0f; }, "repetition_penalty");
  bad([](SamplingParams& p) { p.presence_penalty = 2.5f; }, "presence_penalty");
  bad([](SamplingParams& p) { p.frequency_penalty = -3.0f; }, "frequency_penalty");
  bad([](SamplingParams& p) { p.logit_bias = {{1, 100.5f}}; }, "logit_bias");
  bad([](SamplingParams& p) { p.logit_bias = {{-1, 1.0f}}; }, "logit_bias");
  bad([](SamplingParams& p) { p.logit_bias = {{3, 1.0f}, {1, 2.0f}, {3, -1.0f}}; }, "logit_bias");
  SamplingParams ok;
  ok.temperature = 0.0f;
  ok.top_p = 1.0f;
  ok.min_p = 1.0f;
  ok.presence_penalty = -2.0f;
  EXPECT_FALSE(ok.validation_error().has_value());
  EXPECT_NO_THROW(Sampler{ok});

  Sampler s(seeded());
  EXPECT_THROW(s.sample(std::vector<float>{}), lily::Error);
  EXPECT_THROW(s.sample(std::vector<float>{1.0f, 2.0f}, std::vector<int>{2}), lily::Error);
  EXPECT_THROW(s.sample(std::vector<float>{1.0f, 2.0f}, std::vector<int>{-1}), lily::Error);
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_THROW(s.sample(std::vector<float>{-inf, nan}), lily::Error);
  EXPECT_EQ(s.sample(std::vector<float>{1.0f, inf, inf}), 1);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(s.sample(std::vector<float>{nan, 0.0f, -inf}), 1);
}

TEST(Sampler, FromGenerationConfig) {
  auto p = SamplingParams::from_generation_config(nlohmann::json::parse(
      R"({"do_sample": true, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
          "repetition_penalty": 1.05, "eos_token_id": [1, 2]})"));
  EXPECT_FLOAT_EQ(p.temperature, 0.6f);
  EXPECT_FLOAT_EQ(p.top_p, 0.95f);
  EXPECT_EQ(p.top_k, 20);
  EXPECT_FLOAT_EQ(p.min_p, 0.0f);
  EXPECT_FLOAT_EQ(p.repetition_penalty, 1.05f);
  EXPECT_FALSE(p.validation_error().has_value());

  auto greedy = SamplingParams::from_generation_config(
      nlohmann::json::parse(R"({"do_sample": false, "temperature": 0.7, "top_k": null})"));
  EXPECT_TRUE(greedy.greedy());
  EXPECT_EQ(greedy.top_k, 0);

  auto defaults = SamplingParams::from_generation_config(nlohmann::json::parse(
      lily::read_text_file(std::string(LILY_FIXTURES_DIR) + "/qwen3/generation_config.json")));
  EXPECT_FLOAT_EQ(defaults.temperature, 1.0f);
  EXPECT_FLOAT_EQ(defaults.top_p, 1.0f);
  EXPECT_EQ(defaults.top_k, 0);

  EXPECT_THROW(SamplingParams::from_generation_config(nlohmann::json::parse(R"({"top_k": 2.5})")),
               lily::Error);
  EXPECT_THROW(
      SamplingParams::from_generation_config(nlohmann::json::parse(R"({"temperature": "hot"})")),
      lily::Error);
  EXPECT_THROW(SamplingParams::from_generation_config(nlohmann::json::parse(R"({"do_sample": 1})")),
               lily::Error);
  EXPECT_THROW(SamplingParams::from_generation_config(nlohmann::json::array()), lily::Error);
  // Out-of-range values are read; validation reports them.
  auto odd = SamplingParams::from_generation_config(nlohmann::json::parse(R"({"top_p": 0})"));
  EXPECT_TRUE(odd.validation_error().has_value());
}

TEST(Sampler, TopLogprobs) {
  for (size_t vocab : {size_t{7}, size_t{248320}}) {
    auto logits = random_logits(vocab, 21, 3.0f);
    logits[3] = logits[5];  // a tie
    for (size_t n : {size_t{1}, size_t{5}, size_t{20}, size_t{50}, size_t{2000}, vocab + 3}) {
      auto top = lily::engine::top_logprobs(logits, n);
      ASSERT_EQ(top.size(), std::min(n, vocab));
      double mass = 0;
      for (size_t i = 0; i < top.size(); ++i) {
        EXPECT_LE(top[i].second, 0.0f);
        mass += std::exp(static_cast<double>(top[i].second));
        if (i < 25) {
          EXPECT_FLOAT_EQ(top[i].second, lily::engine::logprob_of(logits, top[i].first));
        }
        if (i > 0) {
          EXPECT_GE(top[i - 1].second, top[i].second);
        }
      }
      EXPECT_LE(mass, 1.0 + 1e-5);
      if (n >= vocab) {
        EXPECT_NEAR(mass, 1.0, 1e-4);
      }
      EXPECT_EQ(top[0].first, lily::engine::argmax(logits));
      // Against a plain sort.
      std::vector<int> order(vocab);
      for (size_t i = 0; i < vocab; ++i) order[i] = static_cast<int>(i);
      std::sort(order.begin(), order.end(), [&](int a, int b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
      });
      for (size_t i = 0; i < top.size(); ++i) ASSERT_EQ(top[i].first, order[i]);
    }
  }
  // Known values.
  std::vector<float> l = {std::log(0.5f), std::log(0.25f), std::log(0.25f)};
  auto top = lily::engine::top_logprobs(l, 2);
  EXPECT_EQ(top[0].first, 0);
  EXPECT_NEAR(top[0].second, std::log(0.5), 1e-6);
  EXPECT_EQ(top[1].first, 1);
  EXPECT_NEAR(lily::engine::logprob_of(l, 2), std::log(0.25), 1e-6);
  EXPECT_THROW(lily::engine::logprob_of(l, 3), lily::Error);
  EXPECT_TRUE(lily::engine::top_logprobs(l, 0).empty());
}

}  // namespace

// The penalties' counts are kept across calls (TokenCounts): a history that
// grows a token at a time, gains a draft run's tokens and loses the refused
// ones, or changes altogether, must be penalised as a fresh Sampler
// penalises it: the same adjustments for a backend, the same greedy pick.
TEST(Sampler, PenaltiesFollowAHistoryThatGrowsShrinksAndChanges) {
  using lily::LogitAdjust;
  using lily::TokenSampling;
  const int V = 300;
  SamplingParams p;
  p.temperature = 0.f;
  p.repetition_penalty = 1.3f;
  p.frequency_penalty = 0.4f;
  p.presence_penalty = -0.3f;
  p.logit_bias = {{7, 2.f}, {250, -1.f}, {3, 0.5f}};
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> tok(0, V - 1), few(0, 40);
  std::normal_distribution<float> n(0.f, 2.f);
  std::vector<int> history(60);
  for (int& t : history) t = tok(rng);
  const size_t prompt_len = 50;
  Sampler kept(p);
  for (int step = 0; step < 400; ++step) {
    switch (step % 7) {
      case 3:  // a draft run's refused tokens dropped
        history.resize(std::max(prompt_len - 5, history.size() - static_cast<size_t>(few(rng) % 6)));
        break;
      case 5:  // several tokens at once, some repeated
        for (int i = 0, k = few(rng) % 5; i < k; ++i) history.push_back(i % 2 ? history[history.size() / 2] : tok(rng));
        break;
      case 6:
        if (step % 49 == 6) history[static_cast<size_t>(few(rng))] = tok(rng);  // an earlier token changed
        break;
      default:
        history.push_back(tok(rng) % 20);  // often the same few ids
    }
    std::vector<float> row(V);
    for (float& x : row) x = n(rng);
    Sampler fresh(p);
    const std::optional<TokenSampling> a = kept.backend_request(history, prompt_len, V);
    const std::optional<TokenSampling> b = fresh.backend_request(history, prompt_len, V);
    ASSERT_TRUE(a && b);
    ASSERT_EQ(a->adjust.size(), b->adjust.size()) << "step " << step;
    for (size_t i = 0; i < a->adjust.size(); ++i) {
      const LogitAdjust &x = a->adjust[i], &y = b->adjust[i];
      ASSERT_TRUE(x.id == y.id && x.ops == y.ops && x.bias == y.bias && x.sub == y.sub) << "step " << step << " entry " << i;
    }
    EXPECT_EQ(kept.sample(row, history, prompt_len), Sampler(p).sample(row, history, prompt_len)) << "step " << step;
  }
  // Every listed id once, ascending, with the bias, repetition and count
  // penalties of a history written out by hand.
  Sampler s(p);
  const std::vector<int> h = {9, 7, 9, 250, 7, 7, 11};  // prompt {9, 7, 9}, generated {250, 7, 7, 11}
  const TokenSampling r = *s.backend_request(h, 3, V);
  ASSERT_EQ(r.adjust.size(), 5u);
  EXPECT_EQ(r.adjust[0].id, 3);
  EXPECT_EQ(r.adjust[0].ops, LogitAdjust::kBias);
  EXPECT_EQ(r.adjust[1].id, 7);
  EXPECT_EQ(r.adjust[1].ops, LogitAdjust::kBias | LogitAdjust::kRep | LogitAdjust::kSub);
  EXPECT_FLOAT_EQ(r.adjust[1].sub, 0.4f * 2 - 0.3f);
  EXPECT_EQ(r.adjust[2].id, 9);
  EXPECT_EQ(r.adjust[2].ops, LogitAdjust::kRep);
  EXPECT_EQ(r.adjust[3].id, 11);
  EXPECT_EQ(r.adjust[3].ops, LogitAdjust::kRep | LogitAdjust::kSub);
  EXPECT_EQ(r.adjust[4].id, 250);
  EXPECT_EQ(r.adjust[4].ops, LogitAdjust::kBias | LogitAdjust::kRep | LogitAdjust::kSub);
  EXPECT_FLOAT_EQ(r.adjust[4].sub, 0.4f - 0.3f);
}
