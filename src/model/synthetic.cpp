#include "model/synthetic.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/half.h"

namespace lily {

namespace {

const char kQwen36[] = R"({
  "model_type": "qwen3_5_moe", "vocab_size": 248320, "hidden_size": 2048,
  "num_hidden_layers": 40, "full_attention_interval": 4,
  "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
  "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
  "linear_num_key_heads": 16, "linear_num_value_heads": 32,
  "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
  "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
  "shared_expert_intermediate_size": 512, "norm_topk_prob": true,
  "rms_norm_eps": 1e-6, "tie_word_embeddings": false, "max_position_embeddings": 262144,
  "eos_token_id": [248046, 248044]
})";

const char kQwen3_30b[] = R"({
  "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
  "num_hidden_layers": 48, "intermediate_size": 6144,
  "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
  "rope_theta": 1000000.0, "num_experts": 128, "num_experts_per_tok": 8,
  "moe_intermediate_size": 768, "norm_topk_prob": true, "decoder_sparse_step": 1,
  "mlp_only_layers": [], "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
  "max_position_embeddings": 40960, "eos_token_id": [151645, 151643]
})";

class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(next() >> 40) * (1.0f / 16777216.0f);
  }

 private:
  uint64_t s_;
};

class Builder {
 public:
  Builder(ModelWeights& w, uint64_t seed, bool materialize)
      : w_(w), rng_(seed), materialize_(materialize) {}

  // An MLX affine matrix of `experts` x rows stacked (experts == 0: plain).
  std::vector<Matrix> matrices(const std::string& name, int experts, int rows, int cols, int bits) {
    const int group = 64;
    const int n = experts > 0 ? experts : 1;
    Matrix m;
    m.name = name;
    m.format = bits == 4 ? WeightFormat::Affine4 : WeightFormat::Affine8;
    m.rows = rows * n;
    m.cols = cols;
    m.group_size = group;
    m.scale_dtype = DType::BF16;
    if (materialize_) {
      const size_t code_bytes = m.row_bytes() * m.rows;
      const size_t groups = m.groups_per_row() * m.rows;
      auto& buf = w_.owned_buffers.emplace_back(code_bytes + 4 * groups);
      for (size_t i = 0; i + 8 <= code_bytes; i += 8) {
        const uint64_t r = rng_.next();
        std::memcpy(&buf[i], &r, 8);
      }
      m.data = buf.data();
      m.scales = buf.data() + code_bytes;
      m.biases = buf.data() + code_bytes + 2 * groups;
      const float sigma = 1.f / std::sqrt(static_cast<float>(cols));
      const float code_std = bits == 4 ? 4.61f : 73.9f, mid = bits == 4 ? 7.5f : 127.5f;
      for (size_t g = 0; g < groups; ++g) {
        const float s = sigma / code_std * rng_.uniform(0.75f, 1.25f);
        const uint16_t sb = f32_to_bf16(s), bb = f32_to_bf16(-mid * s);
        std::memcpy(&buf[code_bytes + 2 * g], &sb, 2);
        std::memcpy(&buf[code_bytes + 2 * groups + 2 * g], &bb, 2);
      }
    }
    if (experts == 0) return {m};
    std::vector<Matrix> out;
    for (int e = 0; e < experts; ++e) {
      Matrix x = m;
      if (materialize_) x = m.row_slice(e * rows, rows);
      x.rows = rows;
      x.name = str_cat(name, "[", e, "]");
      out.push_back(x);
    }
    return out;
  }
  Matrix matrix(const std::string& name, int rows, int cols, int bits) {
    return matrices(name, 0, rows, cols, bits)[0];
  }
  std::vector<float> vec(size_t n, float lo, float hi) {
    std::vector<float> v(n);
    for (float& x : v) x = rng_.uniform(lo, hi);
    return v;
  }

 private:
  ModelWeights& w_;
  Rng rng_;
  bool materialize_;
};

}  // namespace

std::vector<std::string> synthetic_model_names() { return {"qwen3.6-35b-a3b", "qwen3-30b-a3b"}; }

ModelConfig synthetic_config(const std::string& name) {
  ModelConfig c;
  if (name == "qwen3.6-35b-a3b") c = parse_model_config(kQwen36, "synthetic:" + name);
  else if (name == "qwen3-30b-a3b") c = parse_model_config(kQwen3_30b, "synthetic:" + name);
  else fail("unknown synthetic model '", name, "' (available: qwen3.6-35b-a3b, qwen3-30b-a3b)");
  // MLX affine: 4-bit, group 64, router and shared-expert gate 8-bit.
  c.quant.quantized = true;
  c.quant.group_size = 64;
  c.quant.bits = 4;
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = str_cat("language_model.model.layers.", i, ".mlp.");
    c.quant.overrides[p + "gate"] = {64, 8};
    if (c.shared_expert_intermediate_size > 0) c.quant.overrides[p + "shared_expert_gate"] = {64, 8};
  }
  return c;
}

std::unique_ptr<ModelWeights> make_synthetic_model(const std::string& name, uint64_t seed,
                                                   bool materialize) {
  auto w = std::make_unique<ModelWeights>();
  w->config = synthetic_config(name);
  w->dir = "synthetic:" + name;
  w->layout = materialize ? "mlx" : "synthetic";
  const ModelConfig& c = w->config;
  Builder b(*w, seed, materialize);
  const int H = c.hidden_size;
  w->embed = b.matrix("embed_tokens", c.vocab_size, H, 4);
  w->lm_head = c.tie_word_embeddings ? w->embed : b.matrix("lm_head", c.vocab_size, H, 4);
  w->final_norm = b.vec(H, 0.9f, 1.1f);
  w->layers.resize(c.num_layers);
  for (int i = 0; i < c.num_layers; ++i) {
    LayerWeights& L = w->layers[i];
    const std::string p = str_cat("layers.", i, ".");
    L.kind = c.layer_kinds[i];
    L.input_norm = b.vec(H, 0.9f, 1.1f);
    L.post_norm = b.vec(H, 0.9f, 1.1f);
    if (L.kind == LayerKind::FullAttention) {
      const int qrows = c.num_heads * c.head_dim * (c.attn_output_gate ? 2 : 1);
      L.attn.q = b.matrix(p + "q_proj", qrows, H, 4);
      L.attn.k = b.matrix(p + "k_proj", c.num_kv_heads * c.head_dim, H, 4);
      L.attn.v = b.matrix(p + "v_proj", c.num_kv_heads * c.head_dim, H, 4);
      L.attn.o = b.matrix(p + "o_proj", H, c.num_heads * c.head_dim, 4);
      L.attn.q_norm = b.vec(c.head_dim, 0.9f, 1.1f);
      L.attn.k_norm = b.vec(c.head_dim, 0.9f, 1.1f);
    } else {
      DeltaNetWeights& D = L.deltanet;
      const int C = c.deltanet_qkv_dim(), V = c.deltanet_value_dim(), nv = c.linear_num_value_heads;
      D.in_qkv = b.matrix(p + "in_proj_qkv", C, H, 4);
      D.in_z = b.matrix(p + "in_proj_z", V, H, 4);
      D.in_b = b.matrix(p + "in_proj_b", nv, H, 4);
      D.in_a = b.matrix(p + "in_proj_a", nv, H, 4);
      D.out = b.matrix(p + "out_proj", H, V, 4);
      D.conv = b.vec(size_t(C) * c.linear_conv_kernel, -0.5f, 0.5f);
      D.a_log = b.vec(nv, 0.f, 2.7f);
      D.dt_bias = b.vec(nv, -1.f, 1.f);
      D.norm = b.vec(c.linear_value_head_dim, 0.9f, 1.1f);
    }
    L.is_moe = c.layer_is_moe[i];
    if (!L.is_moe) {
      L.mlp.gate = b.matrix(p + "gate_proj", c.intermediate_size, H, 4);
      L.mlp.up = b.matrix(p + "up_proj", c.intermediate_size, H, 4);
      L.mlp.down = b.matrix(p + "down_proj", H, c.intermediate_size, 4);
      continue;
    }
    const int E = c.num_experts, I = c.moe_intermediate_size;
    L.moe.router = b.matrix(p + "gate", E, H, 8);
    auto g = b.matrices(p + "switch_mlp.gate_proj", E, I, H, 4);
    auto u = b.matrices(p + "switch_mlp.up_proj", E, I, H, 4);
    auto d = b.matrices(p + "switch_mlp.down_proj", E, H, I, 4);
    L.moe.experts.resize(E);
    for (int e = 0; e < E; ++e) L.moe.experts[e] = {g[e], u[e], d[e]};
    if (c.shared_expert_intermediate_size > 0) {
      const int S = c.shared_expert_intermediate_size;
      L.moe.has_shared = true;
      L.moe.shared.gate = b.matrix(p + "shared_expert.gate_proj", S, H, 4);
      L.moe.shared.up = b.matrix(p + "shared_expert.up_proj", S, H, 4);
      L.moe.shared.down = b.matrix(p + "shared_expert.down_proj", H, S, 4);
      L.moe.shared_gate = b.matrix(p + "shared_expert_gate", 1, H, 8);
    }
  }
  return w;
}

}  // namespace lily
