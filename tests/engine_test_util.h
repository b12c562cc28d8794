// Shared by the engine tests (prefix cache, speculative decoding): the
// fixtures' tokenizer and one CPU backend per model fixture (2 threads, f32
// inputs: the reference precision).
#pragma once

#include <map>
#include <memory>
#include <string>

#include "backend/backend.h"
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

}  // namespace lily::test
