// Typed weights, per layer kind. Matrices point into the memory-mapped
// checkpoint and keep their stored format (bf16 stays bf16, MLX 4-bit stays
// 4-bit); a backend repacks them at load if its kernels want another layout.
// Small vectors (norms, gates' constants, conv taps) are converted to f32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/safetensors.h"

namespace lily {

enum class WeightFormat { F32, F16, BF16, Affine4, Affine8 };

const char* weight_format_name(WeightFormat f);

// A [rows x cols] matrix (rows = outputs, cols = inputs), row-major.
// Affine formats (MLX): w = scale * q + bias per group of `group_size`
// consecutive inputs; codes packed low-bits-first into little-endian u32.
struct Matrix {
  std::string name;
  WeightFormat format = WeightFormat::F32;
  int rows = 0, cols = 0;
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;  // [rows, cols / group_size]
  const uint8_t* biases = nullptr;
  DType scale_dtype = DType::BF16;
  int group_size = 0;

  bool empty() const { return data == nullptr; }
  bool quantized() const {
    return format == WeightFormat::Affine4 || format == WeightFormat::Affine8;
  }
  int bits() const { return format == WeightFormat::Affine4 ? 4 : format == WeightFormat::Affine8 ? 8 : 0; }
  size_t row_bytes() const;                 // bytes of one row of `data`
  size_t groups_per_row() const { return quantized() ? cols / group_size : 0; }
  size_t storage_bytes() const;             // data + scales + biases
  // Rows [first, first + count) as a matrix of its own (expert slices).
  Matrix row_slice(int first, int count) const;
};

struct AttentionWeights {
  Matrix q, k, v, o;  // q has 2 x heads x head_dim rows when the output gate is on
  std::vector<float> q_norm, k_norm;  // effective multipliers
};

struct DeltaNetWeights {
  Matrix in_qkv, in_z, in_b, in_a, out;
  std::vector<float> conv;  // [channels][kernel]
  std::vector<float> a_log, dt_bias;  // [value heads]
  std::vector<float> norm;            // [value head dim], plain RMSNorm weight
};

struct MlpWeights {
  Matrix gate, up, down;
};

struct MoeWeights {
  Matrix router;  // [experts, hidden]
  std::vector<MlpWeights> experts;
  bool has_shared = false;
  MlpWeights shared;
  Matrix shared_gate;  // [1, hidden]
};

struct LayerWeights {
  LayerKind kind = LayerKind::FullAttention;
  std::vector<float> input_norm, post_norm;  // effective multipliers
  AttentionWeights attn;
  DeltaNetWeights deltanet;
  bool is_moe = false;
  MlpWeights mlp;
  MoeWeights moe;
};

struct ModelWeights {
  ModelConfig config;
  std::string dir;
  std::string layout;  // "hf", "hf-multimodal", "mlx"
  std::unique_ptr<Checkpoint> checkpoint;  // owns the mappings (null for synthetic models)
  // Memory that matrices point into when they do not come from a checkpoint
  // (synthetic benchmark models, converted layouts).
  std::vector<std::vector<uint8_t>> owned_buffers;
  Matrix embed, lm_head;
  std::vector<float> final_norm;
  std::vector<LayerWeights> layers;
  std::vector<std::string> skipped;  // tensors present but deliberately unused
};

// Loads config.json + safetensors from a directory. Strict: every shape and
// dtype is checked against the config, and any tensor neither used nor on the
// skip list (vision tower, MTP block) fails the load, naming it.
std::unique_ptr<ModelWeights> load_model(const std::string& dir);

}  // namespace lily
