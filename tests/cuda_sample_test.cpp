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

namespace lily {
namespace {

using cuda::DeviceBuffer;

struct DevicePick {
  int id = -1;
  int flags = 0;
};

DevicePick device_pick(const std::vector<float>& logits, const TokenSampling& r) {
  const int V = static_cast<int>(logits.size());
  DeviceBuffer dl, da, doff, dc(cuda::sample_workspace_bytes(V, r.temperature == 0.f ? 1 : r.top_k)), dout(16);
  cuda::upload(dl, logits.data(), logits.size());
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
  int compared = 0, drew = 0;
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
          const int want = cpu.sample(row, history, 50);
          std::optional<TokenSampling> r = dev.backend_request(history, 50, static_cast<size_t>(V));
          ASSERT_TRUE(r.has_value());
          dev.backend_draw(*r);
          const DevicePick got = device_pick(row, *r);
          dev.backend_done(got.flags & 1);
          ASSERT_EQ(got.flags & 2, 0);
          EXPECT_EQ(got.id, want) << "V " << V << " T " << c.temperature << " k " << c.top_k << " top_p "
                                  << c.top_p << " min_p " << c.min_p << " trial " << trial << " step " << step;
          drew += got.flags & 1;
          ++compared;
          history.push_back(want);
        }
      }
    }
  }
  EXPECT_GT(drew, compared / 2);
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
  cuda::CudaOptions o = cuda::options_from_env();
  o.sample_whole = true;
  auto b = cuda::make_cuda_backend(load_model(test::fixture_dir("qwen3_5_moe")), o);
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

// Draft runs whose rows the GPU samples (CudaOptions::draft_sample): the
// tokens of the same speculative generation with the rows copied to the
// host, drafts taken and refused.
TEST(CudaSample, DraftRunRowsSampledOnTheDeviceGiveTheHostPathsTokens) {
  LILY_SKIP_WITHOUT_GPU();
  cuda::CudaOptions o = cuda::options_from_env();
  o.draft_sample = true;
  o.sample_whole = true;
  auto b = cuda::make_cuda_backend(load_model(test::fixture_dir("qwen3_5_moe")), o);
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

}  // namespace
}  // namespace lily

#endif  // LILY_HAVE_CUDA
