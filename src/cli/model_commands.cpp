// lily logits | generate | info: the model-level contract the tests and later
// tooling rely on.
#include <cinttypes>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "backend/backend.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "engine/sequence.h"
#include "model/quantize.h"

namespace lily::cli {

namespace {

std::unique_ptr<Backend> open_backend(const Args& a) {
  BackendOptions opt;
  opt.kind = a.str("--backend", "cpu");
  opt.threads = static_cast<int>(a.integer("--threads", 0, 0, 1024));
  opt.kv_cache = a.str("--kv-cache");
  // The reference tools: f32 inputs unless asked otherwise.
  opt.cpu_act = a.str("--cpu-act", "f32");
  auto weights = load_model(a.required("--model"));
  if (a.has("--quantize")) quantize_model(*weights, parse_quantize_option(a.str("--quantize")));
  return make_backend(std::move(weights), opt);
}

// Prints one row of logits as a JSON array; %.9g round-trips an f32.
void print_row(std::FILE* f, const float* row, int n) {
  std::fputc('[', f);
  char buf[32];
  for (int i = 0; i < n; ++i) {
    int len = std::snprintf(buf, sizeof buf, i ? ",%.9g" : "%.9g", static_cast<double>(row[i]));
    std::fwrite(buf, 1, len, f);
  }
  std::fputc(']', f);
}

}  // namespace

int cmd_logits(int argc, char** argv) {
  Args a(argc, argv, {"--model", "--tokens", "--prefill", "--backend", "--threads", "--quantize", "--kv-cache", "--cpu-act"});
  auto backend = open_backend(a);
  std::vector<int> tokens = parse_int_list(a.required("--tokens"), "--tokens");
  const long long n = static_cast<long long>(tokens.size());
  const int prefill = static_cast<int>(a.integer("--prefill", n, 1, n));
  Sequence seq(*backend, static_cast<int>(tokens.size()));
  const int V = backend->config().vocab_size;
  std::vector<float> all = seq.append(std::span<const int>(tokens.data(), prefill), LogitsMode::All);
  all.reserve(tokens.size() * V);
  for (size_t i = prefill; i < tokens.size(); ++i) {
    std::vector<float> row = seq.append(std::span<const int>(&tokens[i], 1));
    all.insert(all.end(), row.begin(), row.end());
  }
  std::fputs("{\"logits\": [", stdout);
  for (size_t t = 0; t < tokens.size(); ++t) {
    if (t) std::fputs(", ", stdout);
    print_row(stdout, &all[t * V], V);
  }
  std::fputs("]}\n", stdout);
  return 0;
}

int cmd_generate(int argc, char** argv) {
  Args a(argc, argv, {"--model", "--tokens", "--max-tokens", "--backend", "--threads", "--quantize", "--kv-cache", "--cpu-act"});
  auto backend = open_backend(a);
  std::vector<int> prompt = parse_int_list(a.required("--tokens"), "--tokens");
  const int max_new = static_cast<int>(a.integer("--max-tokens", 16, 0, 1 << 20));
  Sequence seq(*backend, static_cast<int>(prompt.size()) + max_new);
  std::vector<int> out = generate_greedy(seq, prompt, max_new, backend->config().eos_token_ids);
  nlohmann::json j = {{"tokens", out}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

int cmd_info(int argc, char** argv) {
  Args a(argc, argv, {"--model"});
  auto w = load_model(a.required("--model"));
  const ModelConfig& c = w->config;
  nlohmann::ordered_json j;
  j["architecture"] = arch_name(c.arch);
  j["model_type"] = c.model_type;
  j["layout"] = w->layout;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["num_layers"] = c.num_layers;
  std::string kinds;
  int n_attn = 0, n_delta = 0;
  for (auto k : c.layer_kinds) {
    kinds += k == LayerKind::FullAttention ? 'A' : 'D';
    (k == LayerKind::FullAttention ? n_attn : n_delta)++;
  }
  j["layer_kinds"] = kinds;
  j["full_attention_layers"] = n_attn;
  j["deltanet_layers"] = n_delta;
  j["attention"] = {{"heads", c.num_heads}, {"kv_heads", c.num_kv_heads}, {"head_dim", c.head_dim},
                    {"rotary_dim", c.rotary_dim}, {"rope_theta", c.rope_theta},
                    {"output_gate", c.attn_output_gate}};
  if (c.num_experts > 0)
    j["moe"] = {{"experts", c.num_experts}, {"top_k", c.num_experts_per_tok},
                {"expert_intermediate", c.moe_intermediate_size},
                {"shared_expert_intermediate", c.shared_expert_intermediate_size}};

  // Parameters and bytes by storage format, counting every matrix once.
  std::map<std::string, std::pair<int64_t, int64_t>> by_format;  // params, bytes
  int64_t total = 0, active = 0;
  auto add = [&](const Matrix& m, bool is_active) {
    if (m.empty()) return;
    int64_t p = static_cast<int64_t>(m.rows) * m.cols;
    auto& e = by_format[weight_format_name(m.format)];
    e.first += p;
    e.second += static_cast<int64_t>(m.storage_bytes());
    total += p;
    if (is_active) active += p;
  };
  auto add_mlp = [&](const MlpWeights& m, bool is_active) {
    add(m.gate, is_active);
    add(m.up, is_active);
    add(m.down, is_active);
  };
  add(w->embed, false);
  if (!c.tie_word_embeddings) add(w->lm_head, true);
  for (const auto& L : w->layers) {
    for (const Matrix* m : {&L.attn.q, &L.attn.k, &L.attn.v, &L.attn.o, &L.deltanet.in_qkv,
                            &L.deltanet.in_z, &L.deltanet.in_b, &L.deltanet.in_a, &L.deltanet.out})
      add(*m, true);
    if (L.is_moe) {
      add(L.moe.router, true);
      for (size_t e = 0; e < L.moe.experts.size(); ++e) add_mlp(L.moe.experts[e], false);
      if (L.moe.has_shared) {
        add_mlp(L.moe.shared, true);
        add(L.moe.shared_gate, true);
      }
    } else {
      add_mlp(L.mlp, true);
    }
  }
  if (c.num_experts > 0 && !w->layers.empty()) {
    const MlpWeights& e0 = w->layers[0].moe.experts.empty() ? w->layers[0].mlp : w->layers[0].moe.experts[0];
    int64_t per_expert = static_cast<int64_t>(e0.gate.rows) * e0.gate.cols * 3;
    int moe_layers = 0;
    for (const auto& L : w->layers) moe_layers += L.is_moe;
    active += per_expert * c.num_experts_per_tok * moe_layers;
  }
  if (c.tie_word_embeddings) active += static_cast<int64_t>(c.vocab_size) * c.hidden_size;
  j["parameters"] = total;
  j["active_parameters_per_token"] = active;
  nlohmann::ordered_json fmt = nlohmann::ordered_json::object();
  for (const auto& [name, pb] : by_format) fmt[name] = {{"parameters", pb.first}, {"bytes", pb.second}};
  j["storage"] = fmt;
  j["skipped_tensors"] = w->skipped.size();
  std::map<std::string, int> skipped_groups;
  for (const auto& s : w->skipped) {
    auto dot = s.find('.');
    auto dot2 = dot == std::string::npos ? dot : s.find('.', dot + 1);
    skipped_groups[s.substr(0, dot2)]++;
  }
  j["skipped"] = skipped_groups;
  std::printf("%s\n", j.dump(2).c_str());
  return 0;
}

}  // namespace lily::cli
