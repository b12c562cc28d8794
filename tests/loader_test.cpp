// The loader refuses broken checkpoints with a message naming the file,
// tensor or field at fault, and accepts the alternative layouts (sharded
// files, transformers' fused expert tensors).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "backend/backend.h"
#include "checkpoint_util.h"
#include "core/error.h"
#include "engine/sequence.h"
#include "backend/cpu/kernels.h"
#include "core/half.h"
#include "model/quantize.h"
#include "model/weights.h"

namespace lily {
namespace {

using test::RawSafetensors;
using test::TempModelDir;

std::string load_error(const std::string& dir) {
  try {
    load_model(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "<loaded without error>";
}

class BrokenCheckpoint : public ::testing::Test {
 protected:
  BrokenCheckpoint()
      : dir_("qwen3_5_moe"),
        st_(RawSafetensors::read(test::fixture_dir("qwen3_5_moe") + "/model.safetensors")) {}
  std::string write_and_load() {
    st_.write(dir_.file("model.safetensors"));
    return load_error(dir_.path());
  }
  TempModelDir dir_;
  RawSafetensors st_;
};

TEST_F(BrokenCheckpoint, IntactCopyLoads) { EXPECT_EQ(write_and_load(), "<loaded without error>"); }

TEST_F(BrokenCheckpoint, TruncatedFile) {
  st_.data.resize(st_.data.size() / 2);
  std::string e = write_and_load();
  EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("outside the data section"), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, TruncatedHeader) {
  st_.write(dir_.file("model.safetensors"));
  std::filesystem::resize_file(dir_.file("model.safetensors"), 100);
  std::string e = load_error(dir_.path());
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, OffsetsOutOfRange) {
  auto& off = st_.header["model.norm.weight"]["data_offsets"];
  off = {st_.data.size() + 10, st_.data.size() + 10 + 256};
  std::string e = write_and_load();
  EXPECT_NE(e.find("'model.norm.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("outside the data section"), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, OverlappingTensors) {
  auto a = st_.header["model.layers.0.input_layernorm.weight"]["data_offsets"];
  st_.header["model.layers.0.post_attention_layernorm.weight"]["data_offsets"] = a;
  std::string e = write_and_load();
  EXPECT_NE(e.find("overlap"), std::string::npos) << e;
  EXPECT_NE(e.find("input_layernorm"), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, ByteSizeDisagreesWithShape) {
  st_.header["model.norm.weight"]["shape"] = {64};
  std::string e = write_and_load();
  EXPECT_NE(e.find("'model.norm.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("byte size"), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, MissingTensor) {
  st_.header.erase("model.layers.2.linear_attn.in_proj_z.weight");
  std::string e = write_and_load();
  EXPECT_NE(e.find("missing tensor 'model.layers.2.linear_attn.in_proj_z.weight'"),
            std::string::npos)
      << e;
}

TEST_F(BrokenCheckpoint, UnexpectedExtraTensor) {
  st_.add("model.layers.1.mlp.surprise.weight", "BF16", {2, 2}, std::vector<uint8_t>(8, 0));
  std::string e = write_and_load();
  EXPECT_NE(e.find("unexpected tensor"), std::string::npos) << e;
  EXPECT_NE(e.find("model.layers.1.mlp.surprise.weight"), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, SkippedTensorsAreAccepted) {
  st_.add("mtp.fc.weight", "BF16", {2, 2}, std::vector<uint8_t>(8, 0));
  st_.add("model.visual.patch_embed.proj.weight", "BF16", {2}, std::vector<uint8_t>(4, 0));
  EXPECT_EQ(write_and_load(), "<loaded without error>");
}

TEST_F(BrokenCheckpoint, WrongShape) {
  // Same byte count, transposed shape.
  st_.header["model.layers.0.linear_attn.in_proj_z.weight"]["shape"] = {64, 256};
  std::string e = write_and_load();
  EXPECT_NE(e.find("'model.layers.0.linear_attn.in_proj_z.weight' has shape [64, 256], expected "
                   "[128, 128]"),
            std::string::npos)
      << e;
}

TEST_F(BrokenCheckpoint, WrongDtype) {
  st_.header["model.layers.3.self_attn.o_proj.weight"]["dtype"] = "I16";
  std::string e = write_and_load();
  EXPECT_NE(e.find("'model.layers.3.self_attn.o_proj.weight' has dtype I16"), std::string::npos)
      << e;
}

TEST_F(BrokenCheckpoint, UnknownDtype) {
  st_.header["model.norm.weight"]["dtype"] = "F8_E4M3X";
  std::string e = write_and_load();
  EXPECT_NE(e.find("unsupported dtype F8_E4M3X"), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, MalformedHeaderJson) {
  std::string h = st_.header.dump();
  h.pop_back();  // drop the closing brace
  std::ofstream out(dir_.file("model.safetensors"), std::ios::binary);
  uint64_t n = h.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << h;
  out.close();
  std::string e = load_error(dir_.path());
  EXPECT_NE(e.find("malformed safetensors header JSON"), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, UnknownModelType) {
  st_.write(dir_.file("model.safetensors"));
  test::write_text(dir_.file("config.json"), R"({"model_type": "llama", "hidden_size": 8})");
  std::string e = load_error(dir_.path());
  EXPECT_NE(e.find("config.json"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown model_type 'llama'"), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, MalformedConfigJson) {
  st_.write(dir_.file("model.safetensors"));
  test::write_text(dir_.file("config.json"), R"({"model_type": "qwen3",)");
  std::string e = load_error(dir_.path());
  EXPECT_NE(e.find("config.json: malformed JSON"), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, ConfigFieldOfWrongType) {
  st_.write(dir_.file("model.safetensors"));
  auto cfg = nlohmann::json::parse(std::ifstream(test::fixture_dir("qwen3_5_moe") + "/config.json"));
  cfg["num_experts"] = "eight";
  test::write_text(dir_.file("config.json"), cfg.dump());
  std::string e = load_error(dir_.path());
  EXPECT_NE(e.find("field 'num_experts' must be an integer"), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, ConfigShapeDisagreesWithTensors) {
  st_.write(dir_.file("model.safetensors"));
  auto cfg = nlohmann::json::parse(std::ifstream(test::fixture_dir("qwen3_5_moe") + "/config.json"));
  cfg["moe_intermediate_size"] = 32;
  test::write_text(dir_.file("config.json"), cfg.dump());
  std::string e = load_error(dir_.path());
  EXPECT_NE(e.find("experts.0.gate_proj.weight' has shape [64, 128], expected [32, 128]"),
            std::string::npos)
      << e;
}

TEST(Loader, MissingDirectoryNamesThePath) {
  std::string e = load_error("/nonexistent/lily-model");
  EXPECT_NE(e.find("/nonexistent/lily-model/config.json"), std::string::npos) << e;
}

// Reference prefill logits through a converted checkpoint.
void expect_matches_reference(const std::string& dir, const std::string& fixture) {
  auto ref = test::load_reference(fixture, "short");
  BackendOptions o;
  o.cpu_act = "f32";
  auto backend = make_backend(load_model(dir), o);
  Sequence seq(*backend, 64);
  auto logits = seq.append(ref.prompt, LogitsMode::All);
  ASSERT_EQ(logits.size(), ref.prefill_logits.size());
  float mx = 0, worst = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    mx = std::max(mx, std::fabs(ref.prefill_logits[i]));
    worst = std::max(worst, std::fabs(logits[i] - ref.prefill_logits[i]));
  }
  EXPECT_LE(worst, 1e-4f * mx);
}

TEST(Loader, ShardedCheckpointWithIndex) {
  TempModelDir dir("qwen3_5_moe");
  auto st = RawSafetensors::read(test::fixture_dir("qwen3_5_moe") + "/model.safetensors");
  RawSafetensors a, b;
  nlohmann::json index = {{"metadata", {{"total_size", st.data.size()}}}, {"weight_map", nlohmann::json::object()}};
  int i = 0;
  for (auto it = st.header.begin(); it != st.header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    RawSafetensors& dst = (i++ % 2) ? a : b;
    dst.add(it.key(), it.value()["dtype"], it.value()["shape"].get<std::vector<int64_t>>(),
            st.bytes_of(it.key()));
    index["weight_map"][it.key()] = (&dst == &a) ? "model-00001-of-00002.safetensors"
                                                  : "model-00002-of-00002.safetensors";
  }
  a.write(dir.file("model-00001-of-00002.safetensors"));
  b.write(dir.file("model-00002-of-00002.safetensors"));
  test::write_text(dir.file("model.safetensors.index.json"), index.dump());
  expect_matches_reference(dir.path(), "qwen3_5_moe");

  // An index that lists a tensor the shards lack is refused.
  index["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors";
  test::write_text(dir.file("model.safetensors.index.json"), index.dump());
  std::string e = load_error(dir.path());
  EXPECT_NE(e.find("'model.extra.weight' is missing"), std::string::npos) << e;
}

// transformers' fused expert form: experts.gate_up_proj [E, 2I, H] (gate rows
// first) and experts.down_proj [E, H, I].
TEST(Loader, FusedExpertTensors) {
  TempModelDir dir("qwen3_5_moe");
  auto st = RawSafetensors::read(test::fixture_dir("qwen3_5_moe") + "/model.safetensors");
  RawSafetensors out;
  const int E = 8, I = 64, H = 128;
  for (auto it = st.header.begin(); it != st.header.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__" || name.find(".mlp.experts.") != std::string::npos) continue;
    out.add(name, it.value()["dtype"], it.value()["shape"].get<std::vector<int64_t>>(),
            st.bytes_of(name));
  }
  for (int l = 0; l < 4; ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".mlp.experts.";
    std::vector<uint8_t> gate_up, down;
    for (int e = 0; e < E; ++e) {
      std::string pe = p + std::to_string(e) + ".";
      auto g = st.bytes_of(pe + "gate_proj.weight"), u = st.bytes_of(pe + "up_proj.weight"),
           d = st.bytes_of(pe + "down_proj.weight");
      gate_up.insert(gate_up.end(), g.begin(), g.end());
      gate_up.insert(gate_up.end(), u.begin(), u.end());
      down.insert(down.end(), d.begin(), d.end());
    }
    out.add(p + "gate_up_proj", "BF16", {E, 2 * I, H}, gate_up);
    out.add(p + "down_proj", "BF16", {E, H, I}, down);
  }
  out.write(dir.file("model.safetensors"));
  expect_matches_reference(dir.path(), "qwen3_5_moe");
}

}  // namespace
}  // namespace lily

namespace lily {
namespace {

// Load-time q4 quantization of the bf16 checkpoint uses the same affine
// scheme as the MLX fixture (min/max per group of 64, bf16 scale and bias
// rounded before the codes are chosen, routers at 8 bits), so every matrix
// must come out byte-identical to the MLX fixture's.
TEST(Quantize, Q4OfBf16CheckpointIsByteIdenticalToMlx) {
  auto w = load_model(test::fixture_dir("qwen3_5_moe"));
  auto mlx = load_model(test::fixture_dir("qwen3_5_moe-mlx4"));
  quantize_model(*w, parse_quantize_option("q4"));
  auto same = [](const Matrix& a, const Matrix& b) {
    ASSERT_EQ(a.format, b.format) << a.name;
    ASSERT_EQ(a.rows, b.rows);
    const size_t nb = a.row_bytes() * a.rows, ns = a.groups_per_row() * a.rows * 2;
    EXPECT_EQ(std::memcmp(a.data, b.data, nb), 0) << a.name;
    EXPECT_EQ(std::memcmp(a.scales, b.scales, ns), 0) << a.name;
    EXPECT_EQ(std::memcmp(a.biases, b.biases, ns), 0) << a.name;
  };
  same(w->embed, mlx->embed);
  same(w->lm_head, mlx->lm_head);
  for (size_t l = 0; l < w->layers.size(); ++l) {
    const auto &A = w->layers[l], &B = mlx->layers[l];
    if (A.kind == LayerKind::DeltaNet) {
      for (auto [x, y] : {std::pair{&A.deltanet.in_qkv, &B.deltanet.in_qkv},
                          {&A.deltanet.in_z, &B.deltanet.in_z}, {&A.deltanet.in_a, &B.deltanet.in_a},
                          {&A.deltanet.in_b, &B.deltanet.in_b}, {&A.deltanet.out, &B.deltanet.out}})
        same(*x, *y);
    } else {
      for (auto [x, y] : {std::pair{&A.attn.q, &B.attn.q}, {&A.attn.k, &B.attn.k},
                          {&A.attn.v, &B.attn.v}, {&A.attn.o, &B.attn.o}})
        same(*x, *y);
    }
    same(A.moe.router, B.moe.router);
    same(A.moe.shared_gate, B.moe.shared_gate);
    same(A.moe.shared.down, B.moe.shared.down);
    for (size_t e = 0; e < A.moe.experts.size(); ++e) {
      same(A.moe.experts[e].gate, B.moe.experts[e].gate);
      same(A.moe.experts[e].up, B.moe.experts[e].up);
      same(A.moe.experts[e].down, B.moe.experts[e].down);
    }
  }
}

// q8: every weight within one quantization step of the original.
TEST(Quantize, Q8WeightsWithinOneStep) {
  auto w = load_model(test::fixture_dir("qwen3_5"));
  auto orig = load_model(test::fixture_dir("qwen3_5"));
  quantize_model(*w, parse_quantize_option("Q8"));
  for (auto [q, o] : {std::pair{&w->layers[0].deltanet.in_qkv, &orig->layers[0].deltanet.in_qkv},
                      {&w->layers[3].attn.o, &orig->layers[3].attn.o}, {&w->lm_head, &orig->lm_head}}) {
    ASSERT_EQ(q->format, WeightFormat::Affine8);
    std::vector<float> a(o->cols), b(o->cols);
    for (int r = 0; r < o->rows; ++r) {
      cpu::dequantize_row(*o, r, a.data());
      cpu::dequantize_row(*q, r, b.data());
      for (int c = 0; c < o->cols; ++c) {
        uint16_t s;
        std::memcpy(&s, q->scales + 2 * (size_t(r) * q->groups_per_row() + c / q->group_size), 2);
        ASSERT_LE(std::fabs(a[c] - b[c]), bf16_to_f32(s) * 1.01f) << q->name << " " << r << "," << c;
      }
    }
  }
  EXPECT_THROW(parse_quantize_option("q3"), Error);
}

}  // namespace
}  // namespace lily
