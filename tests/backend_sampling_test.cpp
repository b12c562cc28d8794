// The engine's side of choosing tokens on the backend (backend/sampling.h):
// Sampler::backend_request folds logit_bias and the penalties so that the
// documented pipeline, run on the raw row with the draw backend_draw takes,
// picks what Sampler::sample picks and leaves the random stream where
// sample() leaves it; and the generator, given a backend that samples,
// produces the tokens of the host path. The pipeline is written out here
// once more, from sampling.h's description, as the oracle (the CUDA kernels
// are checked against Sampler itself in tests/cuda_sample_test.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <random>

#include "backend/backend.h"
#include "core/error.h"
#include "engine/generator.h"
#include "engine/sampler.h"
#include "engine_test_util.h"
#include "text/json_constraint.h"

namespace lily {
namespace {

// sampling.h's pipeline on the host.
int reference_pick(const std::vector<float>& row, const TokenSampling& r, bool& drew) {
  const int V = static_cast<int>(row.size());
  std::vector<float> w(row);
  for (float& x : w)
    if (std::isnan(x)) x = -std::numeric_limits<float>::infinity();
  if (!r.allow.empty()) {
    if (r.allow.size() != allow_words(row.size())) throw std::runtime_error("allow mask of the wrong size");
    for (size_t i = 0; i < row.size(); ++i)
      if (!(r.allow[i / 32] >> (i % 32) & 1u)) w[i] = -std::numeric_limits<float>::infinity();
  }
  for (const LogitAdjust& a : r.adjust) {
    float& x = w[static_cast<size_t>(a.id)];
    if (a.ops & LogitAdjust::kBias) x += a.bias;
    if (a.ops & LogitAdjust::kRep) x = x > 0.f ? x / r.rep_penalty : x * r.rep_penalty;
    if (a.ops & LogitAdjust::kSub) x -= a.sub;
  }
  std::vector<int> order(static_cast<size_t>(V));
  for (int i = 0; i < V; ++i) order[static_cast<size_t>(i)] = i;
  auto better = [&](int a, int b) {
    return w[static_cast<size_t>(a)] > w[static_cast<size_t>(b)] || (w[static_cast<size_t>(a)] == w[static_cast<size_t>(b)] && a < b);
  };
  const bool whole = r.temperature != 0.f && r.top_k == 0;
  const int k = r.temperature == 0.f ? 1 : whole ? V : r.top_k;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), better);
  order.resize(static_cast<size_t>(k));
  drew = false;
  const float top = w[static_cast<size_t>(order[0])];
  if (!(top > -std::numeric_limits<float>::infinity())) throw std::runtime_error("no finite logit");
  if (r.temperature == 0.f || std::isinf(top)) return order[0];
  const double inv_t = 1.0 / static_cast<double>(r.temperature);
  auto weight = [&](int id) { return std::exp((static_cast<double>(w[static_cast<size_t>(id)]) - top) * inv_t); };
  if (whole) {  // the walk's order: every id in id order, or top_p's buckets
    double total = 0;
    for (int i = 0; i < V; ++i) total += weight(i);
    std::vector<int> lower, crossing, dropped;
    if (r.top_p < 1.f) {
      const double target = static_cast<double>(r.top_p) * total;
      auto bucket = [&](int id) {
        const double d = (static_cast<double>(top) - w[static_cast<size_t>(id)]) * inv_t * 8.0;
        return d < 511 ? static_cast<int>(d) : 511;
      };
      std::vector<double> mass(512, 0.0);
      for (int i = 0; i < V; ++i) mass[static_cast<size_t>(bucket(i))] += weight(i);
      int cross = 0;
      double before = 0;
      while (cross < 511 && before + mass[static_cast<size_t>(cross)] < target) before += mass[static_cast<size_t>(cross++)];
      for (int i = 0; i < V; ++i)
        (bucket(i) < cross ? lower : bucket(i) == cross ? crossing : dropped).push_back(i);
      std::sort(crossing.begin(), crossing.end(), better);
      size_t kept = 0;
      for (; kept < crossing.size() && before < target; ++kept) before += weight(crossing[kept]);
      crossing.resize(kept);
    } else {
      for (int i = 0; i < V; ++i) lower.push_back(i);
    }
    order = lower;
    order.insert(order.end(), crossing.begin(), crossing.end());
  }
  std::vector<double> p;
  for (int id : order) p.push_back(weight(id));
  size_t n = p.size();
  if (r.top_p < 1.f && !whole) {
    double total = 0;
    for (size_t i = 0; i < n; ++i) total += p[i];
    const double target = static_cast<double>(r.top_p) * total;
    double mass = 0;
    size_t i = 0;
    for (; i < n && mass < target; ++i) mass += p[i];
    n = i;
  }
  if (r.min_p > 0.f) {
    size_t kept = 0;
    for (size_t i = 0; i < n; ++i)
      if (p[i] >= static_cast<double>(r.min_p)) {
        order[kept] = order[i];
        p[kept++] = p[i];
      }
    n = kept;
  }
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += p[i];
  const double u = r.u * total;
  double mass = 0;
  int last = order[0];
  drew = true;
  for (size_t i = 0; i < n; ++i) {
    if (p[i] <= 0) continue;
    mass += p[i];
    last = order[i];
    if (u < mass) break;
  }
  return last;
}

engine::SamplingParams random_params(std::mt19937& rng, int V) {
  std::uniform_int_distribution<int> pick(0, 5), tok(0, V - 1);
  engine::SamplingParams p;
  const float temps[] = {0.f, 0.3f, 0.7f, 1.f, 1.5f, 8.f};
  p.temperature = temps[pick(rng)];
  const int ks[] = {1, 5, 20, 40, 100, 128, 0, 0};  // 0: the whole vocabulary
  p.top_k = ks[std::uniform_int_distribution<int>(0, 7)(rng)];
  const float tps[] = {1.f, 1.f, 0.95f, 0.8f, 0.5f, 0.1f};
  p.top_p = tps[pick(rng)];
  const float mps[] = {0.f, 0.f, 0.f, 0.02f, 0.1f, 0.5f};
  p.min_p = mps[pick(rng)];
  const float reps[] = {1.f, 1.f, 1.f, 1.1f, 1.3f, 0.8f};
  p.repetition_penalty = reps[pick(rng)];
  const float pens[] = {0.f, 0.f, 0.5f, -0.5f, 1.5f, -2.f};
  p.frequency_penalty = pens[pick(rng)];
  p.presence_penalty = pens[pick(rng)];
  for (int i = 0, n = pick(rng); i < n; ++i) {
    const int id = tok(rng);
    if (std::none_of(p.logit_bias.begin(), p.logit_bias.end(), [&](auto& b) { return b.first == id; }))
      p.logit_bias.push_back({id, i % 2 ? -2.5f * i : 3.f + i});
  }
  p.has_seed = true;
  p.seed = rng();
  return p;
}

TEST(BackendSampling, TheFoldedRequestPicksWhatSamplePicks) {
  std::mt19937 rng(42);
  int compared = 0, drawn = 0;
  for (int V : {1000, 3001}) {
    std::normal_distribution<float> n(0.f, 2.5f);
    std::uniform_int_distribution<int> tok(0, V - 1);
    for (int trial = 0; trial < 300; ++trial) {
      engine::SamplingParams p = random_params(rng, V);
      std::vector<int> history(40);
      for (int& t : history) t = tok(rng);
      if (!p.logit_bias.empty())  // a biased id that is penalised too
        for (int i = 30; i < 34; ++i) history[static_cast<size_t>(i)] = p.logit_bias[0].first;
      engine::Sampler cpu(p), dev(p);
      for (int step = 0; step < 3; ++step) {
        std::vector<float> row(static_cast<size_t>(V));
        for (float& x : row) x = n(rng);
        if (trial % 3 == 0) {  // NaN, -inf and ties
          row[static_cast<size_t>(tok(rng))] = std::numeric_limits<float>::quiet_NaN();
          row[static_cast<size_t>(tok(rng))] = -std::numeric_limits<float>::infinity();
          const float mx = *std::max_element(row.begin(), row.end());
          row[static_cast<size_t>(tok(rng))] = mx;
          row[static_cast<size_t>(tok(rng))] = mx;
        }
        const int want = cpu.sample(row, history, 25);
        std::optional<TokenSampling> r = dev.backend_request(history, 25, static_cast<size_t>(V));
        ASSERT_TRUE(r.has_value());
        for (size_t i = 1; i < r->adjust.size(); ++i) ASSERT_LT(r->adjust[i - 1].id, r->adjust[i].id);
        dev.backend_draw(*r);
        bool drew = false;
        const int got = reference_pick(row, *r, drew);
        dev.backend_done(drew ? 1 : 0);
        ASSERT_EQ(got, want) << "V " << V << " trial " << trial << " step " << step << " T " << p.temperature
                             << " k " << p.top_k;
        drawn += drew;
        ++compared;
        history.push_back(want);
      }
    }
  }
  EXPECT_GT(drawn, compared / 2);
}

TEST(BackendSampling, RequestsOnlyWhatABackendTakes) {
  engine::SamplingParams p;
  p.temperature = 0.7f;
  p.top_k = 0;  // the whole vocabulary
  ASSERT_TRUE(engine::Sampler(p).backend_request({}, 0, 1000).has_value());
  EXPECT_EQ(engine::Sampler(p).backend_request({}, 0, 1000)->top_k, 0);
  p.top_k = kMaxBackendTopK + 1;  // a list longer than a backend keeps: stays on the host
  EXPECT_FALSE(engine::Sampler(p).backend_request({}, 0, 1000).has_value());
  p.top_k = 1000;  // not below the vocabulary: all of it
  ASSERT_TRUE(engine::Sampler(p).backend_request({}, 0, 1000).has_value());
  EXPECT_EQ(engine::Sampler(p).backend_request({}, 0, 1000)->top_k, 0);
  p.top_k = 20;
  EXPECT_TRUE(engine::Sampler(p).backend_request({}, 0, 1000).has_value());
  p.temperature = 0.f;
  p.top_k = 0;
  ASSERT_TRUE(engine::Sampler(p).backend_request({}, 0, 1000).has_value());
  EXPECT_EQ(engine::Sampler(p).backend_request({}, 0, 1000)->top_k, 1);
  p.logit_bias = {{1000, 1.f}};
  try {
    engine::Sampler(p).backend_request({}, 0, 1000);
    FAIL() << "a bias outside the vocabulary was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside the vocabulary"), std::string::npos) << e.what();
  }
}

TEST(BackendSampling, AnUnusedDrawIsGivenBack) {
  engine::SamplingParams p;
  p.temperature = 1.f;
  p.top_k = 10;
  p.has_seed = true;
  p.seed = 5;
  engine::Sampler a(p), b(p);
  TokenSampling r = *a.backend_request({}, 0, 100);
  a.backend_draw(r);
  a.backend_done(0);  // e.g. an infinite best logit: sample() returns before drawing
  std::vector<float> row(100);
  for (int i = 0; i < 100; ++i) row[static_cast<size_t>(i)] = std::sin(float(i));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(a.sample(row), b.sample(row));
}

// The fixture's CPU backend, choosing tokens itself with reference_pick.
class SamplingBackend : public Backend {
 public:
  explicit SamplingBackend(Backend& b) : b_(b) {}
  std::string name() const override { return "sampling"; }
  const ModelConfig& config() const override { return b_.config(); }
  std::unique_ptr<SequenceCache> new_cache(int n) override { return b_.new_cache(n); }
  void forward(SequenceCache& c, std::span<const int> t, LogitsMode m, float* l) override { b_.forward(c, t, m, l); }
  void copy_cache(const SequenceCache& s, SequenceCache& d) override { b_.copy_cache(s, d); }
  void truncate(SequenceCache& c, int n) override { b_.truncate(c, n); }
  int max_draft_run() const override { return b_.max_draft_run(); }
  void forward_draft(SequenceCache& c, std::span<const int> t, float* l) override { b_.forward_draft(c, t, l); }
  void accept_draft(SequenceCache& c, int n) override { b_.accept_draft(c, n); }
  bool can_sample(const TokenSampling& s) const override {
    if (s.logprobs >= 0 && (!takes_logprobs || s.logprobs > kMaxBackendLogprobs)) return false;
    return s.temperature == 0.f || s.top_k <= 64;
  }
  bool takes_logprobs = true;
  bool can_sample_draft(const TokenSampling& s) const override { return can_sample(s); }
  void forward_draft_sample(SequenceCache& c, std::span<const int> t, std::span<const TokenSampling> s, int* ids,
                            int* drew) override {
    ++draft_calls;
    const size_t V = static_cast<size_t>(config().vocab_size);
    std::vector<float> rows(t.size() * V);
    b_.forward_draft(c, t, rows.data());
    for (size_t i = 0; i < t.size(); ++i) {
      bool d = false;
      TokenSampling r = s[i];
      if (r.allow_fill && r.allow.empty()) r.allow_fill(r.allow);
      const std::vector<float> row(rows.begin() + i * V, rows.begin() + (i + 1) * V);
      ids[i] = reference_pick(row, r, d);
      drew[i] = d ? 1 : 0;
      give_logprobs(row, r, ids[i]);
    }
  }
  int draft_calls = 0;
  int forward_sample(SequenceCache& c, int token, const TokenSampling& s, bool& drew) override {
    ++calls;
    std::vector<float> row(static_cast<size_t>(config().vocab_size));
    b_.forward(c, std::span<const int>(&token, 1), LogitsMode::LastOnly, row.data());
    TokenSampling r = s;  // the mask filled after the step, as a backend that overlaps them would
    if (r.allow_fill && r.allow.empty()) r.allow_fill(r.allow);
    masked_calls += !r.allow.empty();
    const int id = reference_pick(row, r, drew);
    give_logprobs(row, r, id);
    return id;
  }
  int calls = 0, masked_calls = 0;

 private:
  static void give_logprobs(const std::vector<float>& row, const TokenSampling& r, int id) {
    if (r.logprobs < 0) return;
    if (!r.logprobs_out) throw std::runtime_error("logprobs asked for with nowhere to put them");
    r.logprobs_out->logprob = engine::logprob_of(row, id);
    r.logprobs_out->top = engine::top_logprobs(row, static_cast<size_t>(r.logprobs));
  }
  Backend& b_;
};

std::vector<int> generate(SamplingBackend& b, bool on_backend, const engine::GenerationParams& p,
                          engine::GenerationResult* res = nullptr, int speculative = 0) {
  engine::Generator g(b, nullptr, 256);
  g.backend_sampling = on_backend;
  g.speculative_tokens = speculative;
  g.speculative_adaptive = false;
  std::vector<int> ids;
  const engine::GenerationResult r = g.generate(p, [&](engine::GenerationEvent&& e) {
    if (e.token) ids.push_back(e.token->id);
    return true;
  });
  if (res) *res = r;
  return ids;
}

TEST(BackendSampling, GeneratorGivesTheHostPathsTokens) {
  SamplingBackend b(test::fixture_backend("qwen3_5_moe"));
  engine::GenerationParams p;
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> tok(0, b.config().vocab_size - 1);
  for (int i = 0; i < 24; ++i) p.prompt.push_back(tok(rng));
  p.max_tokens = 20;
  p.sampling.temperature = 0.9f;
  p.sampling.top_k = 30;
  p.sampling.top_p = 0.9f;
  p.sampling.presence_penalty = 0.4f;
  p.sampling.logit_bias = {{5, 3.f}};
  p.sampling.has_seed = true;
  p.sampling.seed = 11;
  const std::vector<int> host = generate(b, false, p);
  EXPECT_EQ(b.calls, 0);
  const std::vector<int> dev = generate(b, true, p);
  EXPECT_EQ(b.calls, 19);  // every token after the prefill's
  EXPECT_EQ(dev, host);
  p.top_logprobs = 2;  // the backend gives them with its choice
  b.calls = 0;
  EXPECT_EQ(generate(b, true, p), host);
  EXPECT_EQ(b.calls, 19);
  b.takes_logprobs = false;  // else the row comes back for them
  b.calls = 0;
  EXPECT_EQ(generate(b, true, p), host);
  EXPECT_EQ(b.calls, 0);
  b.takes_logprobs = true;
  p.top_logprobs = -1;
  p.sampling.top_k = 100;  // more than this backend takes
  const std::vector<int> host100 = generate(b, false, p);
  EXPECT_EQ(generate(b, true, p), host100);
  EXPECT_EQ(b.calls, 0);
  p.sampling.temperature = 0.f;  // greedy
  const std::vector<int> greedy = generate(b, false, p);
  EXPECT_EQ(generate(b, true, p), greedy);
  EXPECT_EQ(b.calls, 19);
}

// The tokens of a generation on the host path ([0]) and with the backend
// choosing ([1]).
std::array<std::vector<int>, 2> both_ways(SamplingBackend& b, const text::Tokenizer& tok,
                                          const engine::GenerationParams& p) {
  return {test::generate_with(b, &tok, p, false).ids, test::generate_with(b, &tok, p, true).ids};
}

// Constrained decoding with the grammar's mask applied by the backend (an
// allow mask filled after the step is queued): the tokens of the host path,
// which masks the row itself, for a JSON schema, tool calls in both
// syntaxes and json_object, greedy and sampled. A model of random weights
// writes no JSON unless masked, so a mask lost on the way shows as
// different tokens.
TEST(BackendSampling, GrammarMasksAppliedByTheBackendGiveTheHostPathsTokens) {
  SamplingBackend b(test::fixture_backend("qwen3-chat-tiny"));
  const text::Tokenizer& tok = test::fixture_tokenizer();
  const std::optional<int> im_end = tok.token_to_id("<|im_end|>"), eot = tok.token_to_id("<|endoftext|>"),
                           call = tok.token_to_id("<tool_call>");
  ASSERT_TRUE(im_end && eot && call);
  auto schema = text::JsonGrammar::from_schema(nlohmann::ordered_json::parse(R"({"type": "object",
    "properties": {"ok": {"type": "boolean"}, "name": {"type": "string"}, "n": {"type": "number"},
                   "list": {"type": "array", "items": {"enum": [1, 2, 30]}, "maxItems": 3}},
    "required": ["ok", "name", "list"], "additionalProperties": false})"));
  const auto tool_list = nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "set_mode", "parameters": {"type": "object",
      "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]}, "level": {"type": "integer"}},
      "required": ["mode"], "additionalProperties": false}}}])");
  auto tools = text::JsonGrammar::tool_calls(tool_list, text::ToolCallSyntax::Json);
  auto tools_xml = text::JsonGrammar::tool_calls(tool_list, text::ToolCallSyntax::Xml);
  auto object = text::JsonGrammar::any_object();
  struct Variant {
    std::shared_ptr<const text::JsonGrammar> json, tools;
    float temperature;
    int top_k;  // 0: the whole vocabulary
  };
  const Variant variants[] = {
      {schema, nullptr, 0.f, 0},    {schema, nullptr, 1.f, 40},    {schema, nullptr, 1.f, 0},
      {nullptr, tools, 0.f, 0},     {nullptr, tools, 1.f, 40},     {nullptr, tools, 1.f, 0},
      {nullptr, tools_xml, 1.f, 40}, {object, nullptr, 0.f, 0},    {object, nullptr, 0.7f, 20},
  };
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> d(0, 150000);
  int masked = 0;
  for (size_t i = 0; i < std::size(variants); ++i) {
    const Variant& v = variants[i];
    engine::GenerationParams p;
    for (int k = 0; k < 12; ++k) p.prompt.push_back(d(rng));
    p.max_tokens = 48;
    p.stop_token_ids = {*im_end, *eot};
    p.json_grammar = v.json;
    p.tool_grammar = v.tools;
    if (v.tools) p.sampling.logit_bias = {{*call, 30.f}};  // it opens calls wherever it writes freely
    p.sampling.temperature = v.temperature;
    p.sampling.top_k = v.top_k;
    p.sampling.top_p = 0.95f;
    p.sampling.presence_penalty = 0.3f;
    p.sampling.seed = i;
    p.sampling.has_seed = true;
    b.masked_calls = 0;
    const auto ids = both_ways(b, tok, p);
    EXPECT_EQ(ids[1], ids[0]) << "variant " << i;
    EXPECT_GE(ids[0].size(), 2u) << "variant " << i;  // an object may close at once
    EXPECT_GT(b.masked_calls, 0) << "variant " << i;
    masked += b.masked_calls;
  }
  EXPECT_GT(masked, 30);
  // A model whose vocabulary is the tokenizer's first 1,024 tokens (bytes
  // and the first merges; tests/cuda_sample_test.cpp runs the same on the
  // GPU), the byte 0xFF (in no UTF-8 text) as its stop token.
  SamplingBackend small(test::fixture_backend("qwen3_5_moe"));
  const std::optional<int> stop = test::byte_ff_token(tok, small.config().vocab_size);
  ASSERT_TRUE(stop.has_value());
  for (float temperature : {0.f, 1.f}) {
    engine::GenerationParams p;
    for (int k = 0; k < 12; ++k) p.prompt.push_back(static_cast<int>(rng() % 1024));
    p.max_tokens = 64;
    p.stop_token_ids = {*stop};
    p.json_grammar = schema;
    p.sampling.temperature = temperature;
    p.sampling.top_k = 40;
    p.sampling.seed = 3;
    p.sampling.has_seed = true;
    small.masked_calls = 0;
    const auto ids = both_ways(small, tok, p);
    EXPECT_EQ(ids[1], ids[0]) << "temperature " << temperature;
    EXPECT_GT(ids[0].size(), 8u);
    EXPECT_GT(small.masked_calls, 0);
  }
}

// Speculative runs under a grammar whose rows the backend samples with each
// row's mask (the matcher's after the drafts before it): the tokens of the
// host path, drafts taken and refused. The prompt holds a JSON text three
// times and its tokens are made likelier, so the output copies it and
// prompt lookup finds drafts.
TEST(BackendSampling, DraftRunsUnderAGrammarGiveTheHostPathsTokens) {
  SamplingBackend b(test::fixture_backend("qwen3-chat-tiny"));
  ASSERT_GT(b.max_draft_run(), 1);
  const text::Tokenizer& tok = test::fixture_tokenizer();
  const std::vector<int> text = tok.encode(R"({"name": "abc", "ok": true, "list": [1, 2, 30], "n": 12.5})");
  const int im_end = *tok.token_to_id("<|im_end|>");
  int drafted = 0, accepted = 0, runs_on_backend = 0;
  for (int variant = 0; variant < 4; ++variant) {
    engine::GenerationParams p;
    for (int r = 0; r < 3; ++r) {
      p.prompt.insert(p.prompt.end(), text.begin(), text.end());
      p.prompt.push_back(198);  // "\n"
    }
    for (int id : text) {
      bool seen = false;
      for (const auto& [i, v] : p.sampling.logit_bias) seen = seen || i == id;
      if (!seen) p.sampling.logit_bias.push_back({id, 12.f});
    }
    p.max_tokens = 60;
    p.stop_token_ids = {im_end};
    p.json_grammar = variant < 2 ? text::JsonGrammar::any_object()
                                 : text::JsonGrammar::from_schema(nlohmann::ordered_json::parse(
                                       R"({"type": "object", "properties": {"name": {"type": "string"},
                                           "ok": {"type": "boolean"}}, "required": ["name"]})"));
    p.sampling.temperature = variant % 2 == 0 ? 0.f : 0.8f;
    p.sampling.top_k = 40;
    p.sampling.seed = static_cast<uint64_t>(variant + 1);
    p.sampling.has_seed = true;
    b.draft_calls = 0;
    const test::Generated host = test::generate_with(b, &tok, p, false, 6);
    const test::Generated dev = test::generate_with(b, &tok, p, true, 6);
    EXPECT_EQ(dev.ids, host.ids) << "variant " << variant;
    EXPECT_EQ(dev.result.accepted_tokens, host.result.accepted_tokens) << "variant " << variant;
    drafted += dev.result.draft_tokens;
    accepted += dev.result.accepted_tokens;
    runs_on_backend += b.draft_calls;
  }
  EXPECT_GT(runs_on_backend, 0);
  EXPECT_GT(accepted, 0) << "no draft was ever taken: the test exercises nothing";
  EXPECT_LT(accepted, drafted) << "no draft was ever refused";
}

// Speculative runs whose rows the backend samples: the tokens of the host
// path, with drafts taken and refused (the refused rows' draws given back).
TEST(BackendSampling, DraftRunsSampledByTheBackendGiveTheHostPathsTokens) {
  SamplingBackend b(test::fixture_backend("qwen3_5_moe"));
  ASSERT_GT(b.max_draft_run(), 1);
  const int V = b.config().vocab_size;
  int drafted = 0, accepted = 0;
  for (unsigned seed = 1; seed <= 3; ++seed) {
    for (float temperature : {0.f, 0.9f}) {
      engine::GenerationParams p = test::looping_prompt(V, seed);
      p.sampling.temperature = temperature;
      p.sampling.top_k = 40;
      p.sampling.presence_penalty = 0.3f;  // each row's adjustments follow the drafts before it
      p.sampling.seed = seed;
      p.sampling.has_seed = true;
      p.max_tokens = 40;
      engine::GenerationResult host_res, dev_res;
      b.draft_calls = 0;
      const std::vector<int> host = generate(b, false, p, &host_res, 6);
      EXPECT_EQ(b.draft_calls, 0);
      const std::vector<int> dev = generate(b, true, p, &dev_res, 6);
      EXPECT_EQ(dev, host) << "seed " << seed << " temperature " << temperature;
      EXPECT_EQ(dev_res.draft_tokens, host_res.draft_tokens);
      EXPECT_EQ(dev_res.accepted_tokens, host_res.accepted_tokens);
      EXPECT_EQ(b.draft_calls > 0, dev_res.draft_tokens > 0);
      drafted += dev_res.draft_tokens;
      accepted += dev_res.accepted_tokens;
    }
  }
  EXPECT_GT(accepted, 0) << "no draft was ever taken: the test exercises nothing";
  EXPECT_LT(accepted, drafted) << "no draft was ever refused: the draws given back go untested";
}

// Log-probabilities given by the backend with its choice (TokenSampling::
// logprobs): every token's, and its alternatives', those of the host path
// (which computes them from the row), for plain steps, draft runs and a
// grammar's masked tokens. Where the generator ignored them, or took them
// from the wrong row, the values would differ.
TEST(BackendSampling, LogprobsGivenByTheBackendAreTheHostPaths) {
  SamplingBackend b(test::fixture_backend("qwen3_5_moe"));
  const text::Tokenizer& tok = test::fixture_tokenizer();
  const std::optional<int> stop = test::byte_ff_token(tok, b.config().vocab_size);
  ASSERT_TRUE(stop.has_value());
  const int V = b.config().vocab_size;
  int drafted = 0, backend_calls = 0;
  for (int variant = 0; variant < 6; ++variant) {
    engine::GenerationParams p = test::looping_prompt(V, static_cast<unsigned>(variant + 1));
    p.top_logprobs = variant % 3 == 0 ? 0 : variant % 3 == 1 ? 5 : kMaxBackendLogprobs;
    p.sampling.temperature = variant % 2 == 0 ? 0.f : 0.9f;
    p.sampling.top_k = 40;
    p.sampling.seed = static_cast<uint64_t>(variant);
    p.sampling.has_seed = true;
    p.max_tokens = 32;
    if (variant >= 4) {  // masked tokens
      p.json_grammar = text::JsonGrammar::any_object();
      p.stop_token_ids = {*stop};
    }
    b.calls = b.draft_calls = 0;
    const int speculative = variant < 4 ? 6 : 0;
    const test::Generated host = test::generate_with(b, &tok, p, false, speculative);
    ASSERT_EQ(b.calls + b.draft_calls, 0);
    const test::Generated dev = test::generate_with(b, &tok, p, true, speculative);
    backend_calls += b.calls + b.draft_calls;
    drafted += dev.result.draft_tokens;
    ASSERT_EQ(dev.ids, host.ids) << "variant " << variant;
    ASSERT_EQ(dev.tokens.size(), host.tokens.size());
    for (size_t i = 0; i < host.tokens.size(); ++i) {
      EXPECT_EQ(dev.tokens[i].logprob, host.tokens[i].logprob) << "variant " << variant << " token " << i;
      EXPECT_EQ(dev.tokens[i].top, host.tokens[i].top) << "variant " << variant << " token " << i;
      EXPECT_EQ(host.tokens[i].top.size(), static_cast<size_t>(p.top_logprobs));
    }
  }
  EXPECT_GT(backend_calls, 50);
  EXPECT_GT(drafted, 0) << "no draft run: the runs' logprobs go untested";
}

}  // namespace
}  // namespace lily
