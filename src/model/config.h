// ModelConfig: the architecture read from a checkpoint's config.json, with
// the defaults transformers applies when a field is absent, validated field by
// field against what lily supports.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace lily {

enum class Arch { Qwen3, Qwen3Moe, Qwen35, Qwen35Moe };
enum class LayerKind { FullAttention, DeltaNet };
enum class NormStyle { Plain, ZeroCentred };  // x/rms*w  vs  x/rms*(1+w)

const char* arch_name(Arch a);

struct QuantConfig {
  bool quantized = false;  // MLX affine quantization present
  int group_size = 64;
  int bits = 4;
  // Per-module overrides keyed by the MLX module path (e.g.
  // "language_model.model.layers.0.mlp.gate").
  std::map<std::string, std::pair<int, int>> overrides;  // path -> {group, bits}
};

struct ModelConfig {
  Arch arch = Arch::Qwen3;
  std::string model_type;  // as written in the file
  bool multimodal_wrapper = false;

  int vocab_size = 0;
  int hidden_size = 0;
  int num_layers = 0;
  int intermediate_size = 0;  // dense MLP
  float rms_norm_eps = 1e-6f;
  bool tie_word_embeddings = false;
  int max_position_embeddings = 0;
  std::vector<int> eos_token_ids;
  std::vector<LayerKind> layer_kinds;

  // Full attention.
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  float rope_theta = 10000.f;
  float partial_rotary_factor = 1.f;
  int rotary_dim = 0;  // head_dim * partial_rotary_factor, even
  bool attn_output_gate = false;
  bool attention_bias = false;

  // Gated DeltaNet.
  int linear_num_key_heads = 0;
  int linear_num_value_heads = 0;
  int linear_key_head_dim = 0;
  int linear_value_head_dim = 0;
  int linear_conv_kernel = 0;

  // MoE.
  int num_experts = 0;
  int num_experts_per_tok = 0;
  int moe_intermediate_size = 0;
  int shared_expert_intermediate_size = 0;  // 0: no shared expert
  bool norm_topk_prob = true;
  std::vector<bool> layer_is_moe;  // per layer: MoE block (true) or dense MLP

  QuantConfig quant;

  NormStyle norm_style() const {
    return (arch == Arch::Qwen35 || arch == Arch::Qwen35Moe) ? NormStyle::ZeroCentred
                                                             : NormStyle::Plain;
  }
  bool is_hybrid() const { return arch == Arch::Qwen35 || arch == Arch::Qwen35Moe; }
  int deltanet_qkv_dim() const {
    return 2 * linear_num_key_heads * linear_key_head_dim +
           linear_num_value_heads * linear_value_head_dim;
  }
  int deltanet_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
};

// Parses config.json text; `path` is used in error messages.
ModelConfig parse_model_config(const std::string& json_text, const std::string& path);
ModelConfig load_model_config(const std::string& model_dir);

}  // namespace lily
