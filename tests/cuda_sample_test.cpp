// On-device sampling (sample.cu, CudaBackend::forward_sample) against the
// host's engine::Sampler: the same parameters, history and seed must pick
// the same token and leave both random streams in step, on rows with NaN,
// -inf and exact ties, over vocabularies that are not multiples of the
// kernels' 2,048-logit blocks; and the generator with the backend choosing
// gives the tokens the host path gives. Skipped when no GPU is present.
#include <gtest/gtest.h>

#ifdef LILY_HAVE_CUDA

#include <cmath>
#include <limits>
#include <random>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_util.h"
#include "backend/cuda/kernels.h"
#include "cuda_test_util.h"
#include "engine/generator.h"
#include "engine/sampler.h"
#include "engine_test_util.h"
#include "fixture_util.h"
#include "text/json_constraint.h"

namespace lily {
namespace {

using cuda::DeviceBuffer;

struct DevicePick {
  int id = -1;
  int flags = 0;
};

DevicePick device_pick(const std::vector<float>& logits, const TokenSampling& r) {
  const int V = static_cast<int>(logits.size());
  DeviceBuffer dl, da, doff, dmask, dc(cuda::sample_workspace_bytes(V, r.temperature == 0.f ? 1 : r.top_k)),
      dout(16);
  cuda::upload(dl, logits.data(), logits.size());
  if (!r.allow.empty()) cuda::upload(dmask, r.allow.data(), r.allow.size());
  const int off[2] = {0, static_cast<int>(r.adjust.size())};
  if (!r.adjust.empty()) {
    cuda::upload(da, r.adjust.data(), r.adjust.size());
    cuda::upload(doff, off, 2);
  }
  cuda::SampleArgs a;
  a.logits = dl.as<float>();
  a.V = V;
  a.adjust = r.adjust.empty() ? nullptr : da.as<LogitAdjust>();
  a.adjust_off = r.adjust.empty() ? nullptr : doff.as<int>();
  a.allow = r.allow.empty() ? nullptr : dmask.as<uint32_t>();
  a.allow_words = r.allow.size();
  a.rep_penalty = r.rep_penalty;
  a.kc = r.temperature == 0.f ? 1 : r.top_k;
  a.temperature = r.temperature;
  a.top_p = r.top_p;
  a.min_p = r.min_p;
  a.u[0] = r.u;
  a.cand = dc.as<uint64_t>();
  a.out = dout.as<int>();
  cuda::launch_sample(a, nullptr);
  int out[2] = {-1, -1};
  LILY_CUDA(cudaMemcpy(out, dout.get(), sizeof out, cudaMemcpyDeviceToHost));
  return {out[0], out[1]};
}

struct Case {
  float temperature;
  int top_k;
  float top_p, min_p, rep, freq, pres;
  int biases;
};

std::vector<float> random_row(int V, std::mt19937& rng, bool specials) {
  std::normal_distribution<float> n(0.f, 3.f);
  std::vector<float> l(static_cast<size_t>(V));
  for (float& x : l) x = n(rng);
  if (specials) {
    std::uniform_int_distribution<int> at(0, V - 1);
    float mx = -1e30f;
    for (float x : l) mx = std::max(mx, x);
    for (int i = 0; i < 3; ++i) l[at(rng)] = mx + 0.5f;  // exact ties at the top
    for (int i = 0; i < 5; ++i) l[at(rng)] = std::numeric_limits<float>::quiet_NaN();
    for (int i = 0; i < 5; ++i) l[at(rng)] = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < 4; ++i) l[at(rng)] = l[at(rng)];  // ties further down
    l[at(rng)] = 0.f;
    l[at(rng)] = -0.f;
  }
  return l;
}

// A grammar-like allow mask over V ids: kind 1 a few ids (often fewer than
// top_k, some in the last block), kind 2 about half of them.
std::vector<uint32_t> random_allow(int V, int kind, std::mt19937& rng) {
  std::vector<uint32_t> bits(allow_words(static_cast<size_t>(V)), 0u);
  auto set = [&](int id) { bits[static_cast<size_t>(id) / 32] |= 1u << (id % 32); };
  std::uniform_int_distribution<int> at(0, V - 1);
  if (kind == 1) {
    const int n = 1 + static_cast<int>(rng() % 24);
    for (int i = 0; i < n; ++i) set(at(rng));
    set(V - 1 - static_cast<int>(rng() % std::min(V, 40)));
  } else {
    for (int id = 0; id < V; ++id)
      if (rng() & 1) set(id);
  }
  return bits;
}

TEST(CudaSample, PicksWhatTheCpuSamplerPicks) {
  LILY_SKIP_WITHOUT_GPU();
  const Case cases[] = {
      {0.f, 0, 1.f, 0.f, 1.f, 0.f, 0.f, 0},       // greedy
      {0.f, 0, 1.f, 0.f, 1.3f, 0.5f, 0.7f, 4},    // greedy with bias and penalties
      {1.f, 1, 1.f, 0.f, 1.f, 0.f, 0.f, 0},       // top-1
      {0.7f, 20, 0.8f, 0.f, 1.f, 0.f, 0.f, 0},    // Qwen-like defaults
      {1.f, 40, 1.f, 0.05f, 1.f, 0.f, 0.f, 0},    // min_p
      {1.5f, 128, 0.95f, 0.02f, 1.1f, 0.3f, -0.4f, 6},
      {0.3f, 7, 0.5f, 0.f, 0.9f, -1.f, 1.f, 3},
      {20.f, 100, 1.f, 0.f, 1.f, 0.f, 0.f, 0},    // nearly flat: the walk goes deep
      // top_k 0: the whole vocabulary (sample.cu's wv_* kernels)
      {1.f, 0, 1.f, 0.f, 1.f, 0.f, 0.f, 0},       // temperature only: the walk in id order
      {0.7f, 0, 0.8f, 0.f, 1.f, 0.f, 0.f, 0},     // top_p
      {1.f, 0, 1.f, 0.05f, 1.f, 0.f, 0.f, 0},     // min_p only
      {1.5f, 0, 0.95f, 0.02f, 1.1f, 0.3f, -0.4f, 6},
      {0.05f, 0, 0.5f, 0.f, 1.f, 0.f, 0.f, 2},    // peaked: the crossing bucket is the first
      {20.f, 0, 0.9f, 0.f, 1.f, 0.f, 0.f, 0},     // nearly flat: tens of thousands cross
  };
  std::mt19937 rng(1234);
  int compared = 0, drew = 0, masked = 0;
  for (int V : {248320, 151943, 3001, 2085, 2048}) {  // 2085: a last block with fewer ids than top_k
    for (const Case& c : cases) {
      for (int trial = 0; trial < 6; ++trial) {
        engine::SamplingParams p;
        p.temperature = c.temperature;
        p.top_k = c.top_k;
        p.top_p = c.top_p;
        p.min_p = c.min_p;
        p.repetition_penalty = c.rep;
        p.frequency_penalty = c.freq;
        p.presence_penalty = c.pres;
        p.has_seed = true;
        p.seed = rng();
        std::uniform_int_distribution<int> tok(0, V - 1);
        std::vector<int> history(60);
        for (int& t : history) t = tok(rng);
        for (int i = 50; i < 60; ++i) history[i] = history[i - 5];  // repeats among the generated
        for (int i = 0; i < c.biases; ++i) {
          const int id = i < 2 ? history[55 + i] : tok(rng);  // some on penalised ids
          bool dup = false;
          for (auto& b : p.logit_bias) dup = dup || b.first == id;
          if (!dup) p.logit_bias.push_back({id, i == 0 ? 5.f : -3.f + i});
        }
        engine::Sampler cpu(p), dev(p);
        for (int step = 0; step < 2; ++step) {  // two draws: the streams must stay in step
          std::vector<float> row = random_row(V, rng, trial % 2 == 1);
          if (trial % 3 == 2)  // values on a coarse grid: many exact ties across the buckets
            for (float& x : row)
              if (std::isfinite(x)) x = std::round(x * 2.f) / 2.f;
          // A grammar's mask on two rows of three: the host masks the
          // row, the device gets the bits.
          const int mask_kind = (trial + step) % 3;
          std::vector<uint32_t> allow;
          std::vector<float> host_row = row;
          if (mask_kind != 0) {
            allow = random_allow(V, mask_kind, rng);
            for (int id = 0; id < V; ++id)
              if (!(allow[static_cast<size_t>(id) / 32] >> (id % 32) & 1u))
                host_row[static_cast<size_t>(id)] = -std::numeric_limits<float>::infinity();
            bool finite = false;
            for (float x : host_row) finite = finite || std::isfinite(x);
            if (!finite) continue;  // the Sampler's error, tested below
          }
          const int want = cpu.sample(host_row, history, 50);
          std::optional<TokenSampling> r = dev.backend_request(history, 50, static_cast<size_t>(V));
          ASSERT_TRUE(r.has_value());
          r->allow = allow;
          dev.backend_draw(*r);
          const DevicePick got = device_pick(row, *r);
          dev.backend_done(got.flags & 1);
          ASSERT_EQ(got.flags & 2, 0);
          EXPECT_EQ(got.id, want) << "V " << V << " T " << c.temperature << " k " << c.top_k << " top_p "
                                  << c.top_p << " min_p " << c.min_p << " trial " << trial << " step " << step
                                  << " mask " << mask_kind;
          masked += mask_kind != 0;
          drew += got.flags & 1;
          ++compared;
          history.push_back(want);
        }
      }
    }
  }
  EXPECT_GT(drew, compared / 2);
  EXPECT_GT(masked, compared / 2);
}

TEST(CudaSample, RefusesARowWithNoFiniteLogit) {
  LILY_SKIP_WITHOUT_GPU();
  std::vector<float> row(5000, -std::numeric_limits<float>::infinity());
  row[17] = std::numeric_limits<float>::quiet_NaN();
  TokenSampling r;
  r.temperature = 0.8f;
  r.top_k = 10;
  r.u = 0.5;
  EXPECT_EQ(device_pick(row, r).flags, 2);
  r.temperature = 0.f;
  EXPECT_EQ(device_pick(row, r).flags, 2);
  // Finite logits, none of them allowed; then one.
  std::vector<float> flat(5000, 1.f);
  r.allow.assign(allow_words(flat.size()), 0u);
  EXPECT_EQ(device_pick(flat, r).flags, 2);
  r.allow[3] = 1u << 5;
  const DevicePick one = device_pick(flat, r);
  EXPECT_EQ(one.flags, 0);
  EXPECT_EQ(one.id, 3 * 32 + 5);
}

// The qwen3_5_moe fixture on the GPU with every on-device sampling path on
// (the whole vocabulary, draft runs' rows), whatever the environment says.
std::unique_ptr<Backend> sampling_backend() {
  cuda::CudaOptions o = cuda::options_from_env();
  o.draft_sample = true;
  o.sample_whole = true;
  return cuda::make_cuda_backend(load_model(test::fixture_dir("qwen3_5_moe")), o);
}

std::vector<int> generate(Backend& b, bool on_backend, const engine::SamplingParams& s, int n) {
  engine::Generator g(b, nullptr, 512);
  g.backend_sampling = on_backend;
  engine::GenerationParams p;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> tok(0, b.config().vocab_size - 1);
  for (int i = 0; i < 40; ++i) p.prompt.push_back(tok(rng));
  p.sampling = s;
  p.max_tokens = n;
  std::vector<int> ids;
  g.generate(p, [&](engine::GenerationEvent&& e) {
    if (e.token) ids.push_back(e.token->id);
    return true;
  });
  return ids;
}

TEST(CudaSample, GeneratorTokensMatchTheHostPath) {
  LILY_SKIP_WITHOUT_GPU();
  auto b = sampling_backend();
  engine::SamplingParams greedy;
  greedy.temperature = 0.f;
  engine::SamplingParams topk;
  topk.temperature = 0.9f;
  topk.top_k = 20;
  topk.top_p = 0.9f;
  topk.presence_penalty = 0.5f;
  topk.repetition_penalty = 1.05f;
  topk.logit_bias = {{3, 2.f}, {11, -50.f}};
  topk.has_seed = true;
  topk.seed = 99;
  engine::SamplingParams whole = topk;  // no top_k: the whole vocabulary
  whole.top_k = 0;
  whole.min_p = 0.01f;
  ASSERT_TRUE(b->can_sample(*engine::Sampler(topk).backend_request({}, 0, b->config().vocab_size)));
  ASSERT_TRUE(b->can_sample(*engine::Sampler(whole).backend_request({}, 0, b->config().vocab_size)));
  for (const auto& s : {greedy, topk, whole}) {
    const std::vector<int> host = generate(*b, false, s, 48), dev = generate(*b, true, s, 48);
    ASSERT_EQ(host.size(), 48u);
    EXPECT_EQ(dev, host) << "temperature " << s.temperature << " top_k " << s.top_k;
  }
}

// Constrained decoding with the grammar's mask applied on the device: the
// tokens of the host path (which masks the row itself) for a JSON schema,
// greedy, top_k and the whole vocabulary. The model (random weights, a
// vocabulary of the tokenizer's first 1,024 tokens: the bytes and the
// first merges) writes no JSON unless masked; its stop token is the byte
// 0xFF, which no UTF-8 text has.
TEST(CudaSample, GrammarMaskedTokensMatchTheHostPath) {
  LILY_SKIP_WITHOUT_GPU();
  auto b = sampling_backend();
  const text::Tokenizer& tok = test::fixture_tokenizer();
  const std::optional<int> stop = test::byte_ff_token(tok, b->config().vocab_size);
  ASSERT_TRUE(stop.has_value());
  auto schema = text::JsonGrammar::from_schema(nlohmann::ordered_json::parse(R"({"type": "object",
    "properties": {"ok": {"type": "boolean"}, "name": {"type": "string"}, "n": {"type": "number"},
                   "list": {"type": "array", "items": {"enum": [1, 2, 30]}, "maxItems": 3}},
    "required": ["ok", "name", "list"], "additionalProperties": false})"));
  TokenSampling probe;
  probe.allow.assign(allow_words(static_cast<size_t>(b->config().vocab_size)), ~0u);
  ASSERT_TRUE(b->can_sample(probe));
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> d(0, b->config().vocab_size - 1);
  for (int variant = 0; variant < 3; ++variant) {
    engine::GenerationParams p;
    for (int i = 0; i < 12; ++i) p.prompt.push_back(d(rng));
    p.max_tokens = 64;
    p.stop_token_ids = {*stop};
    p.json_grammar = schema;
    p.sampling.temperature = variant == 0 ? 0.f : 1.f;
    p.sampling.top_k = variant == 1 ? 40 : 0;
    p.sampling.top_p = 0.95f;
    p.sampling.presence_penalty = 0.3f;
    p.sampling.seed = static_cast<uint64_t>(variant);
    p.sampling.has_seed = true;
    const test::Generated host = test::generate_with(*b, &tok, p, false), dev = test::generate_with(*b, &tok, p, true);
    EXPECT_EQ(dev.ids, host.ids) << "variant " << variant;
    EXPECT_GT(host.ids.size(), 4u);
  }
}

// Speculative runs under a JSON schema whose rows the GPU samples, each with
// the matcher's mask after the drafts before it: the tokens of the host
// path. The prompt holds a JSON text (byte tokens) three times, made
// likelier, so the output copies it and prompt lookup finds drafts.
TEST(CudaSample, DraftRunsUnderAGrammarGiveTheHostPathsTokens) {
  LILY_SKIP_WITHOUT_GPU();
  auto b = sampling_backend();
  ASSERT_GT(b->max_draft_run(), 1);
  const text::Tokenizer& tok = test::fixture_tokenizer();
  std::vector<int> byte_id(256, -1);
  for (int id = 0; id < b->config().vocab_size; ++id)
    if (tok.token_bytes(id).size() == 1) byte_id[static_cast<unsigned char>(tok.token_bytes(id)[0])] = id;
  std::vector<int> text;
  for (unsigned char c : std::string(R"({"name": "abc", "ok": true, "list": [1, 2, 30]})")) text.push_back(byte_id[c]);
  ASSERT_EQ(byte_id[0xff] >= 0, true);
  int accepted = 0, runs = 0;
  for (int variant = 0; variant < 2; ++variant) {
    engine::GenerationParams p;
    for (int r = 0; r < 3; ++r) {
      p.prompt.insert(p.prompt.end(), text.begin(), text.end());
      p.prompt.push_back(byte_id['\n']);
    }
    for (int id : text) {
      bool seen = false;
      for (const auto& [i, v] : p.sampling.logit_bias) seen = seen || i == id;
      if (!seen) p.sampling.logit_bias.push_back({id, 6.f});
    }
    p.max_tokens = 60;
    p.stop_token_ids = {byte_id[0xff]};
    p.json_grammar = text::JsonGrammar::any_object();
    p.sampling.temperature = variant == 0 ? 0.f : 0.8f;
    p.sampling.top_k = 40;
    p.sampling.seed = 5;
    p.sampling.has_seed = true;
    const test::Generated host = test::generate_with(*b, &tok, p, false, 6);
    const test::Generated dev = test::generate_with(*b, &tok, p, true, 6);
    EXPECT_EQ(dev.ids, host.ids) << "variant " << variant;
    EXPECT_EQ(dev.result.accepted_tokens, host.result.accepted_tokens);
    accepted += dev.result.accepted_tokens;
    runs += dev.result.draft_tokens > 0;
  }
  EXPECT_GT(runs, 0);
  EXPECT_GT(accepted, 0);
}

// Draft runs whose rows the GPU samples (CudaOptions::draft_sample): the
// tokens of the same speculative generation with the rows copied to the
// host, drafts taken and refused.
TEST(CudaSample, DraftRunRowsSampledOnTheDeviceGiveTheHostPathsTokens) {
  LILY_SKIP_WITHOUT_GPU();
  auto b = sampling_backend();
  ASSERT_GT(b->max_draft_run(), 1);
  const int V = b->config().vocab_size;
  int drafted = 0, accepted = 0, runs_on_device = 0;
  for (unsigned seed = 1; seed <= 3; ++seed)
    for (float temperature : {0.f, 0.9f}) {
      engine::GenerationParams p = test::looping_prompt(V, seed);
      p.sampling.temperature = temperature;
      p.sampling.top_k = seed == 3 ? 0 : 40;  // 0: the whole vocabulary
      p.sampling.top_p = 0.95f;
      p.sampling.presence_penalty = 0.3f;
      p.sampling.seed = seed;
      p.sampling.has_seed = true;
      p.max_tokens = 40;
      std::vector<int> ids[2];
      engine::GenerationResult res[2];
      for (int on = 0; on < 2; ++on) {
        engine::Generator g(*b, nullptr, 512);
        g.backend_sampling = on == 1;
        g.speculative_tokens = 6;
        g.speculative_adaptive = false;
        res[on] = g.generate(p, [&](engine::GenerationEvent&& e) {
          if (e.token) ids[on].push_back(e.token->id);
          return true;
        });
      }
      EXPECT_EQ(ids[1], ids[0]) << "seed " << seed << " temperature " << temperature;
      EXPECT_EQ(res[1].accepted_tokens, res[0].accepted_tokens);
      drafted += res[1].draft_tokens;
      accepted += res[1].accepted_tokens;
      runs_on_device += res[1].draft_tokens > 0;
    }
  EXPECT_GT(runs_on_device, 0);
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, drafted);
}

// launch_logprobs against engine::logprob_of / top_logprobs on the same raw
// rows: several rows in one launch (a draft run's), NaN, -inf and exact
// ties, chosen ids at -inf and NaN, rows with no finite logit and with +inf,
// vocabularies that are not multiples of the 2,048-logit blocks and one
// shorter than the alternatives asked for.
TEST(CudaSample, LogprobsMatchTheHostsOnTheRawRows) {
  LILY_SKIP_WITHOUT_GPU();
  std::mt19937 rng(77);
  const float inf = std::numeric_limits<float>::infinity();
  int compared = 0;
  for (int V : {248320, 151943, 3001, 2048, 7}) {
    for (int top : {0, 1, 5, kMaxBackendLogprobs}) {
      for (int R : {1, 3, 16}) {
        std::vector<float> rows;
        std::vector<int> ids(2 * static_cast<size_t>(R));
        std::uniform_int_distribution<int> at(0, V - 1);
        for (int r = 0; r < R; ++r) {
          std::vector<float> row = random_row(V, rng, V > 100 && r % 2 == 1);
          if (r % 3 == 2)
            for (float& x : row)
              if (std::isfinite(x)) x = std::round(x * 2.f) / 2.f;  // ties at the top
          if (r == 4) std::fill(row.begin(), row.end(), -inf);      // no finite logit
          if (r == 5) row[static_cast<size_t>(at(rng))] = inf;      // lse +inf
          rows.insert(rows.end(), row.begin(), row.end());
          ids[2 * static_cast<size_t>(r)] = at(rng);
        }
        if (R > 1) rows[static_cast<size_t>(V) + static_cast<size_t>(ids[2])] = -inf;  // a chosen id at -inf
        if (R > 2) rows[2 * static_cast<size_t>(V) + static_cast<size_t>(ids[4])] = std::nanf("");
        DeviceBuffer dl, di, dw(cuda::logprob_workspace_bytes(V, R)), dout(sizeof(cuda::RowLogprobs) * R);
        cuda::upload(dl, rows.data(), rows.size());
        cuda::upload(di, ids.data(), ids.size());
        cuda::LogprobArgs a;
        a.logits = dl.as<float>();
        a.V = V;
        a.rows = R;
        a.row_stride = static_cast<size_t>(V);
        a.ids = di.as<int>();
        a.top = top;
        a.work = dw.get();
        a.out = dout.as<cuda::RowLogprobs>();
        cuda::launch_logprobs(a, nullptr);
        std::vector<cuda::RowLogprobs> got(static_cast<size_t>(R));
        LILY_CUDA(cudaMemcpy(got.data(), dout.get(), sizeof(cuda::RowLogprobs) * R, cudaMemcpyDeviceToHost));
        auto near = [](float want, float have) {
          if (std::isnan(want)) return std::isnan(have);
          if (std::isinf(want)) return want == have;
          return std::abs(want - have) <= 2e-6f * std::max(1.f, std::abs(want));
        };
        for (int r = 0; r < R; ++r) {
          const std::span<const float> row(rows.data() + static_cast<size_t>(r) * V, static_cast<size_t>(V));
          const std::string where = "V " + std::to_string(V) + " top " + std::to_string(top) + " R " +
                                    std::to_string(R) + " row " + std::to_string(r);
          const float want = engine::logprob_of(row, ids[2 * static_cast<size_t>(r)]);
          EXPECT_TRUE(near(want, got[r].logprob)) << where << ": " << want << " vs " << got[r].logprob;
          const auto alt = engine::top_logprobs(row, static_cast<size_t>(top));
          ASSERT_EQ(static_cast<size_t>(got[r].n), alt.size()) << where;
          for (size_t i = 0; i < alt.size(); ++i) {
            EXPECT_EQ(got[r].ids[i], alt[i].first) << where << " alternative " << i;
            EXPECT_TRUE(near(alt[i].second, got[r].lp[i]))
                << where << " alternative " << i << ": " << alt[i].second << " vs " << got[r].lp[i];
          }
          ++compared;
        }
      }
    }
  }
  EXPECT_GT(compared, 300);
}

// The generator with the device choosing and giving the logprobs (plain
// steps, draft runs, a grammar's masked tokens): the tokens and the
// logprobs of the host path, which takes them from the row it copies back.
TEST(CudaSample, LogprobsWithTheDevicesChoiceMatchTheHostPath) {
  LILY_SKIP_WITHOUT_GPU();
  auto b = sampling_backend();
  const text::Tokenizer& tok = test::fixture_tokenizer();
  const std::optional<int> stop = test::byte_ff_token(tok, b->config().vocab_size);
  ASSERT_TRUE(stop.has_value());
  const int V = b->config().vocab_size;
  int drafted = 0, compared = 0;
  for (int variant = 0; variant < 6; ++variant) {
    engine::GenerationParams p = test::looping_prompt(V, static_cast<unsigned>(variant + 1));
    p.top_logprobs = variant % 3 == 0 ? 0 : variant % 3 == 1 ? 5 : kMaxBackendLogprobs;
    p.sampling.temperature = variant % 2 == 0 ? 0.f : 0.9f;
    p.sampling.top_k = variant == 3 ? 0 : 40;
    p.sampling.seed = static_cast<uint64_t>(variant);
    p.sampling.has_seed = true;
    p.max_tokens = 40;
    if (variant >= 4) {
      p.json_grammar = text::JsonGrammar::any_object();
      p.stop_token_ids = {*stop};
    }
    const int speculative = variant < 4 ? 6 : 0;
    const test::Generated host = test::generate_with(*b, &tok, p, false, speculative);
    const test::Generated dev = test::generate_with(*b, &tok, p, true, speculative);
    drafted += dev.result.draft_tokens;
    ASSERT_EQ(dev.ids, host.ids) << "variant " << variant;
    ASSERT_EQ(dev.tokens.size(), host.tokens.size());
    for (size_t i = 0; i < host.tokens.size(); ++i) {
      const engine::TokenInfo &h = host.tokens[i], &d = dev.tokens[i];
      EXPECT_NEAR(d.logprob, h.logprob, 1e-5) << "variant " << variant << " token " << i;
      ASSERT_EQ(d.top.size(), h.top.size()) << "variant " << variant << " token " << i;
      ASSERT_EQ(h.top.size(), static_cast<size_t>(p.top_logprobs));
      for (size_t k = 0; k < h.top.size(); ++k) {
        EXPECT_EQ(d.top[k].first, h.top[k].first) << "variant " << variant << " token " << i << " alternative " << k;
        EXPECT_NEAR(d.top[k].second, h.top[k].second, 1e-5) << "variant " << variant << " token " << i;
      }
      ++compared;
    }
  }
  EXPECT_GT(compared, 150);
  EXPECT_GT(drafted, 0) << "no draft run: the runs' logprobs go untested";
}

}  // namespace
}  // namespace lily

#endif  // LILY_HAVE_CUDA
