#include "model/config.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"

namespace lily {

using nlohmann::json;

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::Qwen3: return "qwen3";
    case Arch::Qwen3Moe: return "qwen3_moe";
    case Arch::Qwen35: return "qwen3_5";
    case Arch::Qwen35Moe: return "qwen3_5_moe";
  }
  return "?";
}

namespace {

// Typed field access that names the file and field on error.
class Fields {
 public:
  Fields(const json& j, std::string where) : j_(j), where_(std::move(where)) {}

  bool has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }

  int get_int(const char* key, int def, bool required = false) const {
    if (!has(key)) {
      if (required) fail(where_, ": missing field '", key, "'");
      return def;
    }
    const json& v = j_[key];
    if (!v.is_number_integer()) fail(where_, ": field '", key, "' must be an integer");
    long long x = v.get<long long>();
    if (x < 0 || x > (1ll << 30)) fail(where_, ": field '", key, "' = ", x, " is out of range");
    return static_cast<int>(x);
  }
  double get_num(const char* key, double def) const {
    if (!has(key)) return def;
    const json& v = j_[key];
    if (!v.is_number()) fail(where_, ": field '", key, "' must be a number");
    return v.get<double>();
  }
  bool get_bool(const char* key, bool def) const {
    if (!has(key)) return def;
    const json& v = j_[key];
    if (!v.is_boolean()) fail(where_, ": field '", key, "' must be a boolean");
    return v.get<bool>();
  }
  std::string get_str(const char* key, const std::string& def) const {
    if (!has(key)) return def;
    const json& v = j_[key];
    if (!v.is_string()) fail(where_, ": field '", key, "' must be a string");
    return v.get<std::string>();
  }
  const json& raw() const { return j_; }
  const std::string& where() const { return where_; }

 private:
  const json& j_;
  std::string where_;
};

void require_positive(const std::string& where, const char* name, int v) {
  if (v <= 0) fail(where, ": field '", name, "' must be positive (got ", v, ")");
}

QuantConfig parse_quant(const json& root, const std::string& path) {
  QuantConfig q;
  const json* qj = nullptr;
  if (root.contains("quantization")) qj = &root["quantization"];
  else if (root.contains("quantization_config")) qj = &root["quantization_config"];
  if (qj == nullptr || qj->is_null()) return q;
  if (!qj->is_object()) fail(path, ": field 'quantization' must be an object");
  Fields f(*qj, path + ": quantization");
  std::string mode = f.get_str("mode", "affine");
  if (mode != "affine")
    fail(path, ": quantization mode '", mode, "' is not supported (only MLX affine)");
  if (qj->contains("quant_method"))
    fail(path, ": quantization_config.quant_method '", (*qj)["quant_method"].dump(),
         "' is not supported (only MLX affine quantization)");
  q.quantized = true;
  q.group_size = f.get_int("group_size", 64, true);
  q.bits = f.get_int("bits", 4, true);
  for (auto it = qj->begin(); it != qj->end(); ++it) {
    if (!it.value().is_object()) continue;
    Fields o(it.value(), path + ": quantization['" + it.key() + "']");
    q.overrides[it.key()] = {o.get_int("group_size", q.group_size), o.get_int("bits", q.bits)};
  }
  return q;
}

std::vector<int> parse_eos(const json& j) {
  std::vector<int> out;
  if (!j.contains("eos_token_id")) return out;
  const json& e = j["eos_token_id"];
  if (e.is_number_integer()) out.push_back(e.get<int>());
  if (e.is_array())
    for (const auto& x : e)
      if (x.is_number_integer()) out.push_back(x.get<int>());
  return out;
}

}  // namespace

ModelConfig parse_model_config(const std::string& json_text, const std::string& path) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    fail(path, ": malformed JSON: ", e.what());
  }
  if (!root.is_object()) fail(path, ": config is not a JSON object");

  ModelConfig c;
  const json* text = &root;
  if (root.contains("text_config")) {
    if (!root["text_config"].is_object()) fail(path, ": field 'text_config' must be an object");
    text = &root["text_config"];
    c.multimodal_wrapper = true;
  }
  std::string where = c.multimodal_wrapper ? path + ": text_config" : path;
  Fields f(*text, where);
  Fields top(root, path);

  std::string mt = f.get_str("model_type", top.get_str("model_type", ""));
  if (mt.empty()) fail(where, ": missing field 'model_type'");
  c.model_type = mt;
  if (mt == "qwen3") c.arch = Arch::Qwen3;
  else if (mt == "qwen3_moe") c.arch = Arch::Qwen3Moe;
  else if (mt == "qwen3_5" || mt == "qwen3_5_text") c.arch = Arch::Qwen35;
  else if (mt == "qwen3_5_moe" || mt == "qwen3_5_moe_text") c.arch = Arch::Qwen35Moe;
  else
    fail(where, ": unknown model_type '", mt,
         "' (supported: qwen3, qwen3_moe, qwen3_5[_text], qwen3_5_moe[_text])");

  const bool hybrid = c.is_hybrid();
  const bool moe = c.arch == Arch::Qwen3Moe || c.arch == Arch::Qwen35Moe;

  // Defaults are those of the transformers config classes.
  switch (c.arch) {
    case Arch::Qwen3:
      c.vocab_size = f.get_int("vocab_size", 151936);
      c.hidden_size = f.get_int("hidden_size", 4096);
      c.num_layers = f.get_int("num_hidden_layers", 32);
      c.intermediate_size = f.get_int("intermediate_size", 22016);
      c.num_heads = f.get_int("num_attention_heads", 32);
      c.num_kv_heads = f.get_int("num_key_value_heads", c.num_heads);
      c.max_position_embeddings = f.get_int("max_position_embeddings", 32768);
      break;
    case Arch::Qwen3Moe:
      c.vocab_size = f.get_int("vocab_size", 151936);
      c.hidden_size = f.get_int("hidden_size", 2048);
      c.num_layers = f.get_int("num_hidden_layers", 24);
      c.intermediate_size = f.get_int("intermediate_size", 6144);
      c.num_heads = f.get_int("num_attention_heads", 32);
      c.num_kv_heads = f.get_int("num_key_value_heads", 4);
      c.num_experts = f.get_int("num_experts", f.get_int("num_local_experts", 128));
      c.num_experts_per_tok = f.get_int("num_experts_per_tok", 8);
      c.moe_intermediate_size = f.get_int("moe_intermediate_size", 768);
      c.norm_topk_prob = f.get_bool("norm_topk_prob", false);
      c.max_position_embeddings = f.get_int("max_position_embeddings", 32768);
      break;
    case Arch::Qwen35:
      c.vocab_size = f.get_int("vocab_size", 151936);
      c.hidden_size = f.get_int("hidden_size", 2048);
      c.num_layers = f.get_int("num_hidden_layers", 48);
      c.intermediate_size = f.get_int("intermediate_size", 8192);
      c.num_heads = f.get_int("num_attention_heads", 16);
      c.num_kv_heads = f.get_int("num_key_value_heads", 2);
      c.max_position_embeddings = f.get_int("max_position_embeddings", 32768);
      break;
    case Arch::Qwen35Moe:
      c.vocab_size = f.get_int("vocab_size", 248320);
      c.hidden_size = f.get_int("hidden_size", 2048);
      c.num_layers = f.get_int("num_hidden_layers", 40);
      c.num_heads = f.get_int("num_attention_heads", 16);
      c.num_kv_heads = f.get_int("num_key_value_heads", 2);
      c.num_experts = f.get_int("num_experts", 256);
      c.num_experts_per_tok = f.get_int("num_experts_per_tok", 8);
      c.moe_intermediate_size = f.get_int("moe_intermediate_size", 512);
      c.shared_expert_intermediate_size = f.get_int("shared_expert_intermediate_size", 512);
      c.norm_topk_prob = f.get_bool("norm_topk_prob", true);
      c.max_position_embeddings = f.get_int("max_position_embeddings", 32768);
      break;
  }
  require_positive(where, "vocab_size", c.vocab_size);
  require_positive(where, "hidden_size", c.hidden_size);
  require_positive(where, "num_hidden_layers", c.num_layers);
  require_positive(where, "num_attention_heads", c.num_heads);
  require_positive(where, "num_key_value_heads", c.num_kv_heads);
  if (c.num_heads % c.num_kv_heads != 0)
    fail(where, ": num_attention_heads (", c.num_heads, ") is not a multiple of num_key_value_heads (",
         c.num_kv_heads, ")");
  c.head_dim = f.get_int("head_dim", hybrid ? 256 : c.hidden_size / c.num_heads);
  require_positive(where, "head_dim", c.head_dim);
  c.rms_norm_eps = static_cast<float>(f.get_num("rms_norm_eps", 1e-6));
  if (!(c.rms_norm_eps > 0)) fail(where, ": field 'rms_norm_eps' must be positive");
  c.tie_word_embeddings = f.get_bool("tie_word_embeddings", top.get_bool("tie_word_embeddings", false));
  c.attention_bias = f.get_bool("attention_bias", false);
  if (c.attention_bias) fail(where, ": attention_bias = true is not supported by these models");
  std::string act = f.get_str("hidden_act", "silu");
  if (act != "silu") fail(where, ": hidden_act '", act, "' is not supported (expected silu)");

  // RoPE: transformers 5 writes rope_parameters; older files rope_theta /
  // rope_scaling at the top level.
  double theta = hybrid ? 10000.0 : 10000.0;
  double partial = hybrid ? 0.25 : 1.0;
  partial = f.get_num("partial_rotary_factor", partial);
  theta = f.get_num("rope_theta", theta);
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!f.has(key)) continue;
    const json& rp = (*text)[key];
    if (!rp.is_object()) fail(where, ": field '", key, "' must be an object");
    Fields r(rp, where + ": " + key);
    theta = r.get_num("rope_theta", theta);
    partial = r.get_num("partial_rotary_factor", partial);
    std::string type = r.get_str("rope_type", r.get_str("type", "default"));
    if (type != "default" && type != "mrope")
      fail(where, ": ", key, ".rope_type '", type, "' is not supported (only default RoPE)");
  }
  if (!(theta > 0)) fail(where, ": rope_theta must be positive");
  if (!(partial > 0 && partial <= 1)) fail(where, ": partial_rotary_factor must be in (0, 1]");
  c.rope_theta = static_cast<float>(theta);
  c.partial_rotary_factor = static_cast<float>(partial);
  c.rotary_dim = static_cast<int>(c.head_dim * partial);
  if (c.rotary_dim % 2 != 0 || c.rotary_dim == 0)
    fail(where, ": head_dim x partial_rotary_factor = ", c.rotary_dim, " must be even and positive");
  c.attn_output_gate = f.get_bool("attn_output_gate", hybrid);

  // Layer kinds.
  c.layer_kinds.assign(c.num_layers, LayerKind::FullAttention);
  if (hybrid) {
    if (f.has("layer_types")) {
      const json& lt = (*text)["layer_types"];
      if (!lt.is_array() || static_cast<int>(lt.size()) != c.num_layers)
        fail(where, ": layer_types must be a list of num_hidden_layers (", c.num_layers, ") strings");
      for (int i = 0; i < c.num_layers; ++i) {
        std::string s = lt[i].is_string() ? lt[i].get<std::string>() : "";
        if (s == "full_attention") c.layer_kinds[i] = LayerKind::FullAttention;
        else if (s == "linear_attention") c.layer_kinds[i] = LayerKind::DeltaNet;
        else fail(where, ": layer_types[", i, "] = '", lt[i].dump(), "' is not supported");
      }
    } else {
      int interval = f.get_int("full_attention_interval", 4);
      require_positive(where, "full_attention_interval", interval);
      for (int i = 0; i < c.num_layers; ++i)
        c.layer_kinds[i] = ((i + 1) % interval) ? LayerKind::DeltaNet : LayerKind::FullAttention;
    }
    c.linear_num_key_heads = f.get_int("linear_num_key_heads", 16);
    c.linear_num_value_heads = f.get_int("linear_num_value_heads", 32);
    c.linear_key_head_dim = f.get_int("linear_key_head_dim", 128);
    c.linear_value_head_dim = f.get_int("linear_value_head_dim", 128);
    c.linear_conv_kernel = f.get_int("linear_conv_kernel_dim", 4);
    require_positive(where, "linear_num_key_heads", c.linear_num_key_heads);
    require_positive(where, "linear_num_value_heads", c.linear_num_value_heads);
    require_positive(where, "linear_key_head_dim", c.linear_key_head_dim);
    require_positive(where, "linear_value_head_dim", c.linear_value_head_dim);
    require_positive(where, "linear_conv_kernel_dim", c.linear_conv_kernel);
    if (c.linear_num_value_heads % c.linear_num_key_heads != 0)
      fail(where, ": linear_num_value_heads must be a multiple of linear_num_key_heads");
  } else if (f.has("layer_types")) {
    const json& lt = (*text)["layer_types"];
    if (lt.is_array())
      for (size_t i = 0; i < lt.size(); ++i)
        if (!lt[i].is_string() || lt[i].get<std::string>() != "full_attention")
          fail(where, ": layer_types[", i, "] = ", lt[i].dump(),
               " is not supported (sliding window attention is not implemented)");
  }
  if (f.get_bool("use_sliding_window", false))
    fail(where, ": use_sliding_window = true is not supported");

  // MLP / MoE per layer.
  c.layer_is_moe.assign(c.num_layers, moe);
  if (moe) {
    require_positive(where, "num_experts", c.num_experts);
    require_positive(where, "num_experts_per_tok", c.num_experts_per_tok);
    require_positive(where, "moe_intermediate_size", c.moe_intermediate_size);
    if (c.num_experts_per_tok > c.num_experts)
      fail(where, ": num_experts_per_tok (", c.num_experts_per_tok, ") > num_experts (",
           c.num_experts, ")");
    if (c.arch == Arch::Qwen3Moe) {
      int step = f.get_int("decoder_sparse_step", 1);
      require_positive(where, "decoder_sparse_step", step);
      std::vector<int> mlp_only;
      if (f.has("mlp_only_layers")) {
        const json& m = (*text)["mlp_only_layers"];
        if (!m.is_array()) fail(where, ": mlp_only_layers must be a list");
        for (const auto& x : m) {
          if (!x.is_number_integer()) fail(where, ": mlp_only_layers must hold integers");
          mlp_only.push_back(x.get<int>());
        }
      }
      for (int i = 0; i < c.num_layers; ++i) {
        bool dense = (i + 1) % step != 0;
        for (int m : mlp_only) dense = dense || m == i;
        c.layer_is_moe[i] = !dense;
      }
    }
  }
  for (int i = 0; i < c.num_layers; ++i)
    if (!c.layer_is_moe[i]) require_positive(where, "intermediate_size", c.intermediate_size);

  c.eos_token_ids = parse_eos(*text);
  if (c.eos_token_ids.empty()) c.eos_token_ids = parse_eos(root);
  c.quant = parse_quant(root, path);
  return c;
}

ModelConfig load_model_config(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  return parse_model_config(read_text_file(path), path);
}

}  // namespace lily
