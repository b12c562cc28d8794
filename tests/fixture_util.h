// Reads the reference fixtures (tests/fixtures/<case>/reference.safetensors).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "model/safetensors.h"

namespace lily::test {

inline std::string fixture_dir(const std::string& name) {
  return std::string(LILY_FIXTURES_DIR) + "/" + name;
}

// Every model fixture x its two prompts, as parameters of a
// TestWithParam<std::tuple<std::string, std::string>>, and their test names.
inline auto fixture_cases() {
  return ::testing::Combine(::testing::Values("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe",
                                              "qwen3_5_moe-vl", "qwen3_5_moe-mlx4"),
                            ::testing::Values("short", "long"));
}
inline std::string fixture_case_name(
    const ::testing::TestParamInfo<std::tuple<std::string, std::string>>& info) {
  std::string n = std::get<0>(info.param) + "_" + std::get<1>(info.param);
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

struct Reference {
  std::vector<int> prompt, generated;
  std::vector<float> prefill_logits, decode_logits;  // [T][V], [10][V]
  int vocab = 0;
};

inline Reference load_reference(const std::string& fixture, const std::string& which) {
  SafetensorsFile f(fixture_dir(fixture) + "/reference.safetensors");
  auto ints = [&](const std::string& n) {
    const TensorView& t = f.tensors().at(n);
    std::vector<int> v(t.numel());
    std::memcpy(v.data(), t.data, t.nbytes);
    return v;
  };
  auto floats = [&](const std::string& n, int* cols) {
    const TensorView& t = f.tensors().at(n);
    std::vector<float> v(t.numel());
    std::memcpy(v.data(), t.data, t.nbytes);
    *cols = static_cast<int>(t.shape.back());
    return v;
  };
  Reference r;
  r.prompt = ints("prompt_" + which);
  r.generated = ints("generated_" + which);
  r.prefill_logits = floats("prefill_logits_" + which, &r.vocab);
  r.decode_logits = floats("decode_logits_" + which, &r.vocab);
  return r;
}

}  // namespace lily::test
