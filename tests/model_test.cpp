// End-to-end CPU forward against the transformers reference logits, for
// every architecture and checkpoint layout, through the prefill path, the
// decode path and mixes of the two.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <map>
#include <string>

#include "backend/backend.h"
#include "backend/cpu/kernels.h"
#include "core/error.h"
#include "engine/sequence.h"
#include "fixture_util.h"

namespace lily {
namespace {

using test::fixture_dir;
using test::load_reference;

struct ModelCase {
  std::string fixture;
};

// One backend per fixture (and input precision) for the whole suite:
// loading is cheap but not free. The reference checks run f32 throughout.
Backend& backend_for(const std::string& fixture, const std::string& act = "f32") {
  static std::map<std::string, std::unique_ptr<Backend>> cache;
  auto& b = cache[fixture + "/" + act];
  if (!b) {
    BackendOptions o;
    o.cpu_act = act;
    b = make_backend(load_model(fixture_dir(fixture)), o);
  }
  return *b;
}

float max_abs(const float* p, size_t n) {
  float m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(p[i]));
  return m;
}

// Row-wise check: |got - want| <= 1e-4 * max|want| over the row.
void expect_rows_close(const float* got, const float* want, int rows, int V,
                       const std::string& what) {
  for (int r = 0; r < rows; ++r) {
    const float* g = got + static_cast<size_t>(r) * V;
    const float* w = want + static_cast<size_t>(r) * V;
    const float tol = 1e-4f * max_abs(w, V);
    float worst = 0;
    int at = 0;
    for (int i = 0; i < V; ++i) {
      float d = std::fabs(g[i] - w[i]);
      if (!(d <= worst)) {
        worst = d;
        at = i;
      }
    }
    ASSERT_LE(worst, tol) << what << ": row " << r << " logit " << at << " got " << g[at]
                          << " want " << w[at];
  }
}

class ModelFixture : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(ModelFixture, PrefillLogitsMatchReference) {
  auto [fixture, which] = GetParam();
  auto ref = load_reference(fixture, which);
  Backend& b = backend_for(fixture);
  ASSERT_EQ(b.config().vocab_size, ref.vocab);
  Sequence seq(b, 4096);
  auto logits = seq.append(ref.prompt, LogitsMode::All);
  expect_rows_close(logits.data(), ref.prefill_logits.data(), static_cast<int>(ref.prompt.size()),
                    ref.vocab, fixture + "/" + which + " prefill");
}

TEST_P(ModelFixture, DecodeLogitsMatchReference) {
  auto [fixture, which] = GetParam();
  auto ref = load_reference(fixture, which);
  Backend& b = backend_for(fixture);
  Sequence seq(b, 4096);
  auto logits = seq.append(ref.prompt);
  // Teacher-forced decode over the reference continuation.
  for (size_t i = 0; i < ref.generated.size(); ++i) {
    expect_rows_close(logits.data(), &ref.decode_logits[i * ref.vocab], 1, ref.vocab,
                      fixture + "/" + which + " decode step " + std::to_string(i));
    logits = seq.append(std::span<const int>(&ref.generated[i], 1));
  }
}

TEST_P(ModelFixture, GreedyTokensMatchReference) {
  auto [fixture, which] = GetParam();
  auto ref = load_reference(fixture, which);
  Backend& b = backend_for(fixture);
  Sequence seq(b, 4096);
  auto out = generate_greedy(seq, ref.prompt, static_cast<int>(ref.generated.size()), {});
  EXPECT_EQ(out, ref.generated);
}

// Prefill of the first n tokens, then one token at a time: every position's
// logits equal the one-shot prefill reference. Splits inside the first
// DeltaNet chunk, on and across chunk boundaries.
TEST_P(ModelFixture, PrefillThenDecodeMatchesFullPrefill) {
  auto [fixture, which] = GetParam();
  auto ref = load_reference(fixture, which);
  Backend& b = backend_for(fixture);
  const int T = static_cast<int>(ref.prompt.size());
  for (int n : {1, 5, 63, 64, 65, 100, 128, 129}) {
    if (n >= T) continue;
    Sequence seq(b, 4096);
    auto first = seq.append(std::span<const int>(ref.prompt.data(), n), LogitsMode::All);
    expect_rows_close(first.data(), ref.prefill_logits.data(), n, ref.vocab,
                      fixture + "/" + which + " prefill " + std::to_string(n));
    // Decode at most 12 more steps to keep the test quick.
    for (int i = n; i < std::min(T, n + 12); ++i) {
      auto row = seq.append(std::span<const int>(&ref.prompt[i], 1));
      expect_rows_close(row.data(), &ref.prefill_logits[static_cast<size_t>(i) * ref.vocab], 1,
                        ref.vocab, fixture + "/" + which + " decode at " + std::to_string(i));
    }
  }
}

// Prefill in two runs (the second carries KV, DeltaNet and conv state).
TEST_P(ModelFixture, SplitPrefillMatchesFullPrefill) {
  auto [fixture, which] = GetParam();
  auto ref = load_reference(fixture, which);
  Backend& b = backend_for(fixture);
  const int T = static_cast<int>(ref.prompt.size());
  for (int n : {2, 3, 30, 64, 70, 127}) {
    if (n >= T - 1) continue;
    Sequence seq(b, 4096);
    seq.append(std::span<const int>(ref.prompt.data(), n), LogitsMode::All);
    auto rest = seq.append(std::span<const int>(ref.prompt.data() + n, T - n), LogitsMode::All);
    expect_rows_close(rest.data(), &ref.prefill_logits[static_cast<size_t>(n) * ref.vocab], T - n,
                      ref.vocab, fixture + "/" + which + " split at " + std::to_string(n));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ModelFixture, test::fixture_cases(), test::fixture_case_name);

// The default on CPUs with AVX-512 VNNI: 16-bit integer inputs for the
// quantized matmuls (cpu/kernels.h). Each product is within half a code step
// (2^-15 of a group's largest input) of f32 per input, ~3e-5 of its output;
// the tiny random MoE amplifies that (it flips among near-tied experts) to
// 4.7e-4 .. 4.0e-3 of the logits' range on the mlx4 fixture, its one model
// with quantized weights (measured, 2026-12-05), held to 1e-2 (the GPU's
// 16-bit inputs: 3e-2); greedy tokens stay the reference's. At 8 bits the
// same fixture drifts by 14-109% (docs/benchmarks.md), so q8 is opt-in.
TEST(ModelInputs, Q16StaysNearTheReference) {
  if (!cpu::integer_inputs_supported()) GTEST_SKIP() << "no integer kernel (AVX2, AVX-512 VNNI) on this CPU";
  for (const char* which : {"short", "long"}) {
    auto ref = load_reference("qwen3_5_moe-mlx4", which);
    Backend& b = backend_for("qwen3_5_moe-mlx4", "q16");
    Sequence seq(b, 4096);
    auto logits = seq.append(ref.prompt, LogitsMode::All);
    float worst = 0;
    auto row_err = [&](const float* g, const float* w) {
      float d = 0;
      for (int i = 0; i < ref.vocab; ++i) d = std::max(d, std::fabs(g[i] - w[i]));
      return d / max_abs(w, ref.vocab);
    };
    for (size_t r = 0; r < ref.prompt.size(); ++r)
      worst = std::max(worst, row_err(&logits[r * ref.vocab], &ref.prefill_logits[r * ref.vocab]));
    EXPECT_LE(worst, 1e-2f) << which << " prefill";
    EXPECT_GT(worst, 0.f) << "the integer inputs were not used";
    Sequence dec(b, 4096);
    auto row = dec.append(ref.prompt);
    for (size_t i = 0; i < ref.generated.size(); ++i) {
      EXPECT_LE(row_err(row.data(), &ref.decode_logits[i * ref.vocab]), 1e-2f) << which << " decode step " << i;
      row = dec.append(std::span<const int>(&ref.generated[i], 1));
    }
    Sequence greedy(b, 4096);
    EXPECT_EQ(generate_greedy(greedy, ref.prompt, static_cast<int>(ref.generated.size()), {}), ref.generated) << which;
  }
  EXPECT_THROW(backend_for("qwen3_5_moe-mlx4", "q4"), Error);
}

TEST(Sequence, SnapshotRestoreReproducesLogits) {
  auto ref = load_reference("qwen3_5_moe", "long");
  Backend& b = backend_for("qwen3_5_moe");
  Sequence seq(b, 4096);
  seq.append(std::span<const int>(ref.prompt.data(), 40));
  auto snap = seq.snapshot();
  auto a = seq.append(std::span<const int>(ref.prompt.data() + 40, 3));
  seq.restore(snap);
  EXPECT_EQ(seq.size(), 40);
  auto c = seq.append(std::span<const int>(ref.prompt.data() + 40, 3));
  EXPECT_EQ(a, c);
}

TEST(Sequence, RefusesContextOverflowAndBadTokens) {
  Backend& b = backend_for("qwen3");
  Sequence seq(b, 4);
  std::vector<int> five = {1, 2, 3, 4, 5};
  EXPECT_THROW(seq.append(five), Error);
  EXPECT_EQ(seq.size(), 0);
  std::vector<int> bad = {1, 5000};
  EXPECT_THROW(seq.append(bad), Error);
  EXPECT_EQ(seq.size(), 0);
}

}  // namespace
}  // namespace lily
