// Maps checkpoint tensor names onto typed weights for the HF layouts (plain
// and multimodal wrapper; experts separate or fused) and the MLX affine
// quantized layout.
#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/half.h"
#include "model/weights.h"

namespace lily {

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::F32: return "f32";
    case WeightFormat::F16: return "f16";
    case WeightFormat::BF16: return "bf16";
    case WeightFormat::Affine4: return "affine4";
    case WeightFormat::Affine8: return "affine8";
  }
  return "?";
}

size_t Matrix::row_bytes() const {
  switch (format) {
    case WeightFormat::F32: return static_cast<size_t>(cols) * 4;
    case WeightFormat::F16:
    case WeightFormat::BF16: return static_cast<size_t>(cols) * 2;
    case WeightFormat::Affine4: return static_cast<size_t>(cols) / 2;
    case WeightFormat::Affine8: return static_cast<size_t>(cols);
  }
  return 0;
}

size_t Matrix::storage_bytes() const {
  size_t n = row_bytes() * rows;
  if (quantized()) n += 2 * groups_per_row() * rows * dtype_size(scale_dtype);
  return n;
}

Matrix Matrix::row_slice(int first, int count) const {
  Matrix m = *this;
  m.rows = count;
  m.data = data + row_bytes() * first;
  if (quantized()) {
    size_t sb = groups_per_row() * dtype_size(scale_dtype);
    m.scales = scales + sb * first;
    m.biases = biases + sb * first;
  }
  return m;
}

namespace {

bool starts_with(const std::string& s, const std::string& p) {
  return s.compare(0, p.size(), p) == 0;
}

class Loader {
 public:
  Loader(ModelWeights& w, Checkpoint& ck) : w_(w), ck_(ck), c_(w.config) {}

  void run() {
    detect_layout();
    const int H = c_.hidden_size;
    w_.embed = matrix(model_ + "embed_tokens", c_.vocab_size, H);
    if (c_.tie_word_embeddings) {
      w_.lm_head = w_.embed;
    } else {
      w_.lm_head = matrix(lm_head_, c_.vocab_size, H);
    }
    w_.final_norm = norm(model_ + "norm.weight", H, true);
    w_.layers.resize(c_.num_layers);
    for (int i = 0; i < c_.num_layers; ++i) load_layer(i);
    check_leftovers();
  }

 private:
  void detect_layout() {
    bool has_mlx_prefix = false, has_wrapper_prefix = false;
    for (const auto& [name, t] : ck_.all()) {
      if (starts_with(name, "language_model.model.")) has_mlx_prefix = true;
      if (starts_with(name, "model.language_model.")) has_wrapper_prefix = true;
    }
    auto meta = ck_.metadata();
    mlx_ = c_.quant.quantized || (meta.count("format") && meta["format"] == "mlx");
    if (has_mlx_prefix) {
      model_ = "language_model.model.";
      lm_head_ = "language_model.lm_head";
      w_.layout = "mlx";
    } else if (has_wrapper_prefix) {
      model_ = "model.language_model.";
      lm_head_ = "lm_head";
      w_.layout = mlx_ ? "mlx" : "hf-multimodal";
    } else {
      model_ = "model.";
      lm_head_ = "lm_head";
      w_.layout = mlx_ ? "mlx" : "hf";
    }
  }

  // The MLX quantization of one module: per-module override or the default.
  std::pair<int, int> quant_for(const std::string& base) const {
    auto it = c_.quant.overrides.find(base);
    if (it != c_.quant.overrides.end()) return it->second;
    return {c_.quant.group_size, c_.quant.bits};
  }

  static void expect_shape(const TensorView& t, const std::vector<int64_t>& shape) {
    if (t.shape != shape) {
      TensorView e;
      e.shape = shape;
      fail(t.file, ": tensor '", t.name, "' has shape ", t.shape_str(), ", expected ",
           e.shape_str());
    }
  }

  static WeightFormat float_format(const TensorView& t) {
    switch (t.dtype) {
      case DType::F32: return WeightFormat::F32;
      case DType::F16: return WeightFormat::F16;
      case DType::BF16: return WeightFormat::BF16;
      default:
        fail(t.file, ": tensor '", t.name, "' has dtype ", dtype_name(t.dtype),
             ", expected F32, F16 or BF16");
    }
  }

  // A linear layer `base` ("...q_proj"), dense or MLX affine, optionally with
  // a leading expert dimension (returns one Matrix per expert).
  std::vector<Matrix> matrices(const std::string& base, int experts, int rows, int cols) {
    std::vector<int64_t> lead;
    if (experts > 0) lead.push_back(experts);
    auto with = [&](std::vector<int64_t> s) {
      s.insert(s.begin(), lead.begin(), lead.end());
      return s;
    };
    // Fused expert tensors carry no ".weight" suffix; everything else does.
    const std::string wname =
        (!ck_.has(base + ".weight") && ck_.has(base)) ? base : base + ".weight";
    const TensorView& wt = ck_.get(wname);
    Matrix m;
    m.name = base;
    m.rows = rows;
    m.cols = cols;
    if (ck_.has(base + ".scales")) {
      const TensorView& st = ck_.get(base + ".scales");
      const TensorView& bt = ck_.get(base + ".biases");
      if (wt.dtype != DType::U32)
        fail(wt.file, ": tensor '", wt.name, "' has dtype ", dtype_name(wt.dtype),
             ", expected U32 (MLX packed codes)");
      if (wt.shape.size() != lead.size() + 2 || wt.shape[lead.size()] != rows ||
          (experts > 0 && wt.shape[0] != experts))
        fail(wt.file, ": tensor '", wt.name, "' has shape ", wt.shape_str(), ", expected ",
             experts > 0 ? str_cat("[", experts, ", ", rows, ", packed]") : str_cat("[", rows, ", packed]"));
      int64_t packed = wt.shape.back();
      if (packed * 32 % cols != 0)
        fail(wt.file, ": tensor '", wt.name, "': ", packed, " u32 per row cannot hold ", cols,
             " codes");
      int bits = static_cast<int>(packed * 32 / cols);
      if (bits != 4 && bits != 8)
        fail(wt.file, ": tensor '", wt.name, "' is ", bits,
             "-bit; only 4- and 8-bit affine quantization are supported");
      // The stored widths are authoritative; the config must agree with them.
      if (st.shape.empty() || st.shape.back() <= 0 || cols % st.shape.back() != 0)
        fail(st.file, ": tensor '", st.name, "' has shape ", st.shape_str(),
             ", which does not split ", cols, " inputs into groups");
      const int group = static_cast<int>(cols / st.shape.back());
      if (c_.quant.quantized && quant_for(base).first != group)
        fail(st.file, ": tensor '", st.name, "' implies group size ", group,
             " but config.json says ", quant_for(base).first);
      if (st.dtype != DType::BF16 && st.dtype != DType::F16 && st.dtype != DType::F32)
        fail(st.file, ": tensor '", st.name, "' has dtype ", dtype_name(st.dtype),
             ", expected BF16, F16 or F32");
      if (bt.dtype != st.dtype)
        fail(bt.file, ": tensor '", bt.name, "' has dtype ", dtype_name(bt.dtype),
             ", expected ", dtype_name(st.dtype), " like its scales");
      expect_shape(st, with({rows, cols / group}));
      expect_shape(bt, with({rows, cols / group}));
      m.format = bits == 4 ? WeightFormat::Affine4 : WeightFormat::Affine8;
      m.group_size = group;
      m.scale_dtype = st.dtype;
      m.data = wt.data;
      m.scales = st.data;
      m.biases = bt.data;
    } else {
      m.format = float_format(wt);
      expect_shape(wt, with({rows, cols}));
      m.data = wt.data;
    }
    if (experts == 0) return {m};
    std::vector<Matrix> out;
    // Expert e is rows [e*rows, (e+1)*rows) of the stacked tensor.
    Matrix all = m;
    all.rows = rows * experts;
    for (int e = 0; e < experts; ++e) {
      Matrix x = all.row_slice(e * rows, rows);
      x.name = str_cat(base, "[", e, "]");
      out.push_back(x);
    }
    return out;
  }

  Matrix matrix(const std::string& base, int rows, int cols) {
    return matrices(base, 0, rows, cols)[0];
  }

  std::vector<float> vec(const std::string& name, std::vector<int64_t> shape) {
    const TensorView& t = ck_.get(name);
    float_format(t);
    expect_shape(t, shape);
    std::vector<float> out(t.numel());
    for (size_t i = 0; i < out.size(); ++i) {
      switch (t.dtype) {
        case DType::F32: std::memcpy(&out[i], t.data + 4 * i, 4); break;
        case DType::BF16: {
          uint16_t h;
          std::memcpy(&h, t.data + 2 * i, 2);
          out[i] = bf16_to_f32(h);
          break;
        }
        default: {
          uint16_t h;
          std::memcpy(&h, t.data + 2 * i, 2);
          out[i] = f16_to_f32(h);
        }
      }
    }
    return out;
  }

  // An RMSNorm weight as the multiplier the forward applies: zero-centred
  // norms store w and apply (1 + w), except in MLX files, which bake the +1 in.
  std::vector<float> norm(const std::string& name, int n, bool model_norm_style) {
    std::vector<float> w = vec(name, {n});
    if (model_norm_style && c_.norm_style() == NormStyle::ZeroCentred && !mlx_)
      for (float& x : w) x += 1.f;
    return w;
  }

  MlpWeights mlp(const std::string& base, int inter) {
    const int H = c_.hidden_size;
    MlpWeights m;
    m.gate = matrix(base + "gate_proj", inter, H);
    m.up = matrix(base + "up_proj", inter, H);
    m.down = matrix(base + "down_proj", H, inter);
    return m;
  }

  void load_experts(const std::string& p, MoeWeights& moe) {
    const int E = c_.num_experts, I = c_.moe_intermediate_size, H = c_.hidden_size;
    moe.experts.resize(E);
    if (ck_.has(p + "switch_mlp.gate_proj.weight")) {  // MLX stacked
      auto g = matrices(p + "switch_mlp.gate_proj", E, I, H);
      auto u = matrices(p + "switch_mlp.up_proj", E, I, H);
      auto d = matrices(p + "switch_mlp.down_proj", E, H, I);
      for (int e = 0; e < E; ++e) moe.experts[e] = {g[e], u[e], d[e]};
    } else if (ck_.has(p + "experts.gate_up_proj") || ck_.has(p + "experts.gate_up_proj.weight")) {
      // transformers' fused form: gate_up [E, 2I, H] (gate rows first), down [E, H, I].
      auto gu = matrices(p + "experts.gate_up_proj", E, 2 * I, H);
      auto d = matrices(p + "experts.down_proj", E, H, I);
      for (int e = 0; e < E; ++e) {
        moe.experts[e].gate = gu[e].row_slice(0, I);
        moe.experts[e].up = gu[e].row_slice(I, I);
        moe.experts[e].down = d[e];
      }
    } else {
      for (int e = 0; e < E; ++e) moe.experts[e] = mlp(str_cat(p, "experts.", e, "."), I);
    }
  }

  void load_layer(int i) {
    const ModelConfig& c = c_;
    const int H = c.hidden_size;
    LayerWeights& L = w_.layers[i];
    const std::string p = str_cat(model_, "layers.", i, ".");
    L.kind = c.layer_kinds[i];
    L.input_norm = norm(p + "input_layernorm.weight", H, true);
    L.post_norm = norm(p + "post_attention_layernorm.weight", H, true);
    if (L.kind == LayerKind::FullAttention) {
      const std::string a = p + "self_attn.";
      const int q_rows = c.num_heads * c.head_dim * (c.attn_output_gate ? 2 : 1);
      L.attn.q = matrix(a + "q_proj", q_rows, H);
      L.attn.k = matrix(a + "k_proj", c.num_kv_heads * c.head_dim, H);
      L.attn.v = matrix(a + "v_proj", c.num_kv_heads * c.head_dim, H);
      L.attn.o = matrix(a + "o_proj", H, c.num_heads * c.head_dim);
      L.attn.q_norm = norm(a + "q_norm.weight", c.head_dim, true);
      L.attn.k_norm = norm(a + "k_norm.weight", c.head_dim, true);
    } else {
      const std::string d = p + "linear_attn.";
      DeltaNetWeights& D = L.deltanet;
      const int C = c.deltanet_qkv_dim(), K = c.linear_conv_kernel;
      const int HV = c.linear_num_value_heads;
      D.in_qkv = matrix(d + "in_proj_qkv", C, H);
      D.in_z = matrix(d + "in_proj_z", c.deltanet_value_dim(), H);
      D.in_b = matrix(d + "in_proj_b", HV, H);
      D.in_a = matrix(d + "in_proj_a", HV, H);
      D.out = matrix(d + "out_proj", H, c.deltanet_value_dim());
      const TensorView& cv = ck_.get(d + "conv1d.weight");
      bool mlx_conv = cv.shape.size() == 3 && cv.shape[1] == K && cv.shape[2] == 1 && K != 1;
      D.conv = vec(d + "conv1d.weight", mlx_conv ? std::vector<int64_t>{C, K, 1}
                                                 : std::vector<int64_t>{C, 1, K});
      D.a_log = vec(d + "A_log", {HV});
      D.dt_bias = vec(d + "dt_bias", {HV});
      D.norm = vec(d + "norm.weight", {c.linear_value_head_dim});
    }
    L.is_moe = c.layer_is_moe[i];
    if (!L.is_moe) {
      L.mlp = mlp(p + "mlp.", c.intermediate_size);
    } else {
      const std::string m = p + "mlp.";
      L.moe.router = matrix(m + "gate", c.num_experts, H);
      load_experts(m, L.moe);
      if (c.shared_expert_intermediate_size > 0) {
        L.moe.has_shared = true;
        L.moe.shared = mlp(m + "shared_expert.", c.shared_expert_intermediate_size);
        L.moe.shared_gate = matrix(m + "shared_expert_gate", 1, H);
      }
    }
  }

  void check_leftovers() {
    static const char* kSkip[] = {"model.visual.", "visual.", "vision_tower.", "model.vision_tower.",
                                  "mtp.", "model.mtp."};
    std::vector<std::string> unexpected;
    for (const std::string& name : ck_.unused()) {
      bool skip = false;
      for (const char* s : kSkip) skip = skip || starts_with(name, s);
      // A tied checkpoint may still carry an lm_head copy.
      if (c_.tie_word_embeddings && starts_with(name, lm_head_ + ".")) skip = true;
      if (skip) {
        w_.skipped.push_back(name);
        ck_.mark_used(name);
      } else {
        unexpected.push_back(name);
      }
    }
    if (!unexpected.empty()) {
      std::string list;
      for (size_t i = 0; i < unexpected.size() && i < 8; ++i) list += (i ? ", '" : "'") + unexpected[i] + "'";
      if (unexpected.size() > 8) list += str_cat(" and ", unexpected.size() - 8, " more");
      fail(w_.dir, ": ", unexpected.size(), " unexpected tensor(s) not used by ",
           arch_name(c_.arch), ": ", list);
    }
  }

  ModelWeights& w_;
  Checkpoint& ck_;
  const ModelConfig& c_;
  bool mlx_ = false;
  std::string model_, lm_head_;
};

}  // namespace

std::unique_ptr<ModelWeights> load_model(const std::string& dir) {
  auto w = std::make_unique<ModelWeights>();
  w->dir = dir;
  w->config = load_model_config(dir);
  w->checkpoint = std::make_unique<Checkpoint>(dir);
  Loader(*w, *w->checkpoint).run();
  return w;
}

}  // namespace lily
