// Shared by the engine tests (prefix cache, speculative decoding): the
// fixtures' tokenizer and one CPU backend per model fixture (2 threads, f32
// inputs: the reference precision).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "engine/generator.h"
#include "fixture_util.h"
#include "text/tokenizer.h"

namespace lily::test {

inline const text::Tokenizer& fixture_tokenizer() {
  static const text::Tokenizer t = text::Tokenizer::from_dir(fixture_dir("tokenizer"));
  return t;
}

inline Backend& fixture_backend(const std::string& fixture) {
  static std::map<std::string, std::unique_ptr<Backend>> cache;
  auto& b = cache[fixture];
  if (!b) {
    BackendOptions o;
    o.threads = 2;
    o.cpu_act = "f32";
    b = make_backend(load_model(fixture_dir(fixture)), o);
  }
  return *b;
}

// The id below `vocab` whose token is the single byte 0xFF (in no UTF-8
// text): the stop token of the tests that run the tokenizer's first 1,024
// tokens as a model's vocabulary.
inline std::optional<int> byte_ff_token(const text::Tokenizer& tok, int vocab) {
  for (int id = 0; id < vocab; ++id)
    if (tok.token_bytes(id) == "\xff") return id;
  return std::nullopt;
}

// A prompt that repeats a random 12-token part three times, the part's
// first 4 tokens made likelier (logit_bias): its output loops, so prompt
// lookup finds drafts, some taken and some refused.
inline engine::GenerationParams looping_prompt(int V, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(0, V - 1);
  std::vector<int> part(12);
  for (int& t : part) t = d(rng);
  engine::GenerationParams p;
  for (int r = 0; r < 3; ++r) p.prompt.insert(p.prompt.end(), part.begin(), part.end());
  for (int i = 0; i < 4; ++i) p.sampling.logit_bias.push_back({part[i], 3.f});
  return p;
}

// One generation through a fresh generator on b: its tokens and result,
// the next token chosen by the backend where it takes it (on_backend) or
// always on the host, with up to `speculative` drafts a run (0: none).
struct Generated {
  std::vector<int> ids;
  std::vector<engine::TokenInfo> tokens;  // with their logprobs, when asked for
  engine::GenerationResult result;
};
inline Generated generate_with(Backend& b, const text::Tokenizer* tok, const engine::GenerationParams& p,
                               bool on_backend, int speculative = 0) {
  engine::Generator g(b, tok, 512);
  g.backend_sampling = on_backend;
  g.speculative_tokens = speculative;
  g.speculative_adaptive = false;
  Generated out;
  out.result = g.generate(p, [&](engine::GenerationEvent&& e) {
    if (e.token) {
      out.ids.push_back(e.token->id);
      out.tokens.push_back(*e.token);
    }
    return true;
  });
  return out;
}

}  // namespace lily::test
