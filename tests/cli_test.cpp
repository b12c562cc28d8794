// The command-line contract: JSON on stdout, exit code 0; on error one line
// on stderr naming the cause and a non-zero exit code.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <sys/wait.h>

#include "backend/cuda/cuda_backend.h"
#include "checkpoint_util.h"
#include "fixture_util.h"

namespace lily {
namespace {

struct CliRun {
  int code;
  std::string out, err;
};

CliRun run_lily(const std::string& args) {
  test::TempModelDir tmp("qwen3");  // any scratch directory will do
  const std::string out = tmp.file("stdout"), err = tmp.file("stderr");
  std::string cmd = std::string(LILY_BINARY) + " " + args + " >" + out + " 2>" + err;
  int status = std::system(cmd.c_str());
  auto slurp = [](const std::string& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), slurp(out), slurp(err)};
}

std::string join(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

TEST(Cli, LogitsWithPrefillSplitMatchReference) {
  auto ref = test::load_reference("qwen3_5_moe", "short");
  CliRun r = run_lily("logits --model " + test::fixture_dir("qwen3_5_moe") + " --tokens " +
                   join(ref.prompt) + " --prefill 4");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  const auto& rows = j.at("logits");
  ASSERT_EQ(rows.size(), ref.prompt.size());
  for (size_t t = 0; t < rows.size(); ++t) {
    ASSERT_EQ(rows[t].size(), size_t(ref.vocab));
    float mx = 0;
    for (int i = 0; i < ref.vocab; ++i) mx = std::max(mx, std::fabs(ref.prefill_logits[t * ref.vocab + i]));
    for (int i = 0; i < ref.vocab; ++i)
      ASSERT_NEAR(rows[t][i].get<float>(), ref.prefill_logits[t * ref.vocab + i], 1e-4 * mx);
  }
}

TEST(Cli, GenerateIsTheGreedyContinuation) {
  auto ref = test::load_reference("qwen3_5_moe-mlx4", "short");
  CliRun r = run_lily("generate --model " + test::fixture_dir("qwen3_5_moe-mlx4") + " --tokens " +
                   join(ref.prompt) + " --max-tokens 10");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out).at("tokens").get<std::vector<int>>(), ref.generated);
}

TEST(Cli, InfoDescribesTheModel) {
  CliRun r = run_lily("info --model " + test::fixture_dir("qwen3_5_moe-vl"));
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["architecture"], "qwen3_5_moe");
  EXPECT_EQ(j["layer_kinds"], "DDDA");
  EXPECT_GT(j["skipped_tensors"].get<int>(), 0);  // the vision tower
  EXPECT_TRUE(j["storage"].contains("bf16"));
}

void expect_one_line_error(const CliRun& r, const std::string& needle) {
  EXPECT_NE(r.code, 0);
  EXPECT_LT(r.code, 128) << "killed by a signal";
  EXPECT_TRUE(r.out.empty()) << r.out;
  ASSERT_FALSE(r.err.empty());
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

TEST(Cli, ErrorsAreOneLineWithNonZeroExit) {
  const std::string m = " --model " + test::fixture_dir("qwen3");
  expect_one_line_error(run_lily("logits --model /nonexistent --tokens 1"), "/nonexistent/config.json");
  expect_one_line_error(run_lily("logits" + m + " --tokens 1,x"), "--tokens: 'x'");
  expect_one_line_error(run_lily("logits" + m + " --tokens 1,99999"), "token id 99999");
  expect_one_line_error(run_lily("logits" + m + " --tokens 1,2 --prefill 3"), "--prefill");
  expect_one_line_error(run_lily("logits" + m), "--tokens");
  expect_one_line_error(run_lily("generate" + m + " --tokens 1 --max-tokens -1"), "--max-tokens");
  expect_one_line_error(run_lily("logits" + m + " --tokens 1 --bogus 1"), "unknown option --bogus");
  expect_one_line_error(run_lily("frobnicate"), "unknown command");
  expect_one_line_error(run_lily("logits" + m + " --tokens 1 --kv-cache q4"), "KV cache type 'q4'");
  expect_one_line_error(run_lily("logits" + m + " --tokens 1 --backend cpu --kv-cache q8"),
                        "the cpu backend keeps an f32 KV cache");
}

// --backend cuda where lily cannot run on a GPU (none, or a generation the
// build has no kernels for; CI: none) is refused with the reason, in one line.
TEST(Cli, CudaBackendWithoutAUsableGpuIsRefusedWithTheReason) {
  if (cuda_device_available()) GTEST_SKIP() << "a usable GPU is present";
  const std::string why = cuda_unavailable_reason();
  ASSERT_FALSE(why.empty());
  expect_one_line_error(run_lily("logits --model " + test::fixture_dir("qwen3") + " --tokens 1 --backend cuda"), why);
}

// --kv-cache f32 is the cpu backend's own type; q8 under --backend auto
// runs the cuda backend's q8 rows where a GPU is present, else the cpu
// backend's f32 (greedy tokens agree either way on this fixture).
TEST(Cli, KvCacheOptionOnTheCpuBackend) {
  auto ref = test::load_reference("qwen3_5_moe-mlx4", "short");
  const std::string args = "generate --model " + test::fixture_dir("qwen3_5_moe-mlx4") + " --tokens " +
                           join(ref.prompt) + " --max-tokens 4";
  CliRun r = run_lily(args + " --backend cpu --kv-cache f32");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<int> first(ref.generated.begin(), ref.generated.begin() + 4);
  EXPECT_EQ(nlohmann::json::parse(r.out).at("tokens").get<std::vector<int>>(), first);
  r = run_lily(args + " --backend auto --kv-cache q8");  // cuda with q8 rows where a GPU is present
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out).at("tokens").get<std::vector<int>>(), first);
}

// lily bench --generate N: per ctx, N tokens through the generator (the
// server's path, host sampling) against the backend's decode loop; the
// prompt prefilled once (later repeats reuse the state after it).
TEST(Cli, BenchGenerateCountsTheTokensAndTimesBothLoops) {
  test::TempModelDir tmp("qwen3");
  const std::string json = tmp.file("bench.json");
  auto bench = [&](const std::string& fixture, const std::string& args) {
    CliRun r = run_lily("bench --backend cpu --threads 1 --model " + test::fixture_dir(fixture) +
                        " --ctx 8,40 --warmup 1 --repeats 2 --json " + json + " " + args);
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_NE(r.out.find("gen tok/s"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("host tok/s"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("loop tok/s"), std::string::npos) << r.out;
    std::ifstream in(json);
    return nlohmann::json::parse(in);
  };
  for (const char* fixture : {"qwen3_5_moe", "qwen3"}) {  // hybrid, attention only
    SCOPED_TRACE(fixture);
    const auto j = bench(fixture, "--generate 4");
    EXPECT_EQ(j.at("backend"), "cpu");
    EXPECT_EQ(j.at("generate_tokens"), 4);
    EXPECT_EQ(j.at("sampling").at("temperature"), 0.0);
    EXPECT_EQ(j.at("backend_picks"), false);  // the cpu backend leaves the choice to the host
    ASSERT_EQ(j.at("results").size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      const auto& row = j["results"][i];
      EXPECT_EQ(row.at("ctx"), i ? 40 : 8);
      EXPECT_EQ(row.at("prompt_tokens"), i ? 40 : 8);
      EXPECT_EQ(row.at("generated_tokens"), 4);
      // Repeats start from the state kept after the prompt (an
      // attention-only model runs its last token again).
      EXPECT_GE(row.at("cached_tokens").get<int>(), row["prompt_tokens"].get<int>() - 1);
      EXPECT_GT(row.at("first_ttft_ms").get<double>(), 0);
      EXPECT_EQ(row.at("ms_per_token_repeats").size(), 2u);
      EXPECT_EQ(row.at("backend_ms_per_token_repeats").size(), 2u);
      EXPECT_EQ(row.at("host_sampling_ms_per_token_repeats").size(), 2u);
      for (const char* k : {"decode_tok_s", "ms_per_token", "host_sampling_decode_tok_s", "backend_decode_tok_s",
                            "backend_ms_per_token"})
        EXPECT_GT(row.at(k).get<double>(), 0) << k;
      EXPECT_NEAR(row["decode_tok_s"].get<double>() * row["ms_per_token"].get<double>(), 1000, 1e-6);
      EXPECT_NEAR(row.at("overhead_ms_per_token").get<double>(),
                  row["ms_per_token"].get<double>() - row["backend_ms_per_token"].get<double>(), 1e-9);
    }
  }
  // Sampled: the parameters reach the report; still exactly N tokens.
  auto j = bench("qwen3_5_moe", "--generate 6 --temperature 0.8 --top-k 5 --top-p 0.9 --min-p 0.05 --seed 3");
  EXPECT_EQ(j.at("sampling").at("top_k"), 5);
  EXPECT_NEAR(j["sampling"].at("top_p").get<double>(), 0.9, 1e-6);
  EXPECT_NEAR(j["sampling"].at("min_p").get<double>(), 0.05, 1e-6);
  EXPECT_EQ(j["sampling"].at("seed"), 3);
  for (const auto& row : j.at("results")) EXPECT_EQ(row.at("generated_tokens"), 6);
  // One token: no decode step to time.
  j = bench("qwen3", "--generate 1");
  for (const auto& row : j.at("results")) {
    EXPECT_EQ(row.at("generated_tokens"), 1);
    EXPECT_TRUE(row.at("decode_tok_s").is_null());
    EXPECT_TRUE(row.at("backend_decode_tok_s").is_null());
  }
}

// --backend auto (the default) settles as the other commands' does: cuda
// where a GPU lily's kernels run on is present, cpu otherwise.
TEST(Cli, BenchBackendAutoSettlesOnTheDefault) {
  test::TempModelDir tmp("qwen3");
  const std::string json = tmp.file("bench.json");
  CliRun r = run_lily("bench --backend auto --threads 1 --model " + test::fixture_dir("qwen3") +
                      " --ctx 8 --tokens 2 --warmup 0 --repeats 1 --json " + json);
  ASSERT_EQ(r.code, 0) << r.err;
  std::ifstream in(json);
  EXPECT_EQ(nlohmann::json::parse(in).at("backend"), default_backend_kind());
  expect_one_line_error(run_lily("bench --backend metal --model " + test::fixture_dir("qwen3")),
                        "unknown backend 'metal' (cpu, cuda, auto)");
}

TEST(Cli, BenchGenerateRefusesBadParameters) {
  const std::string b = "bench --backend cpu --model " + test::fixture_dir("qwen3") + " --ctx 8";
  expect_one_line_error(run_lily(b + " --generate 0"), "--generate");
  expect_one_line_error(run_lily(b + " --generate 100001"), "--generate");
  expect_one_line_error(run_lily(b + " --generate x"), "--generate");
  expect_one_line_error(run_lily(b + " --generate 4 --top-p 0"), "top_p");
  expect_one_line_error(run_lily(b + " --generate 4 --top-p 1.5"), "--top-p");
  expect_one_line_error(run_lily(b + " --generate 4 --min-p -0.1"), "--min-p");
  expect_one_line_error(run_lily(b + " --generate 4 --top-k -1"), "--top-k");
  expect_one_line_error(run_lily(b + " --generate 4 --temperature -1"), "--temperature");
  expect_one_line_error(run_lily(b + " --temperature 0.5"), "--temperature is for --generate");
  expect_one_line_error(run_lily(b + " --generate 4 --reuse 8"), "at most one of");
  // The decode step's profile, trace and probes are the cuda backend's: refused, not ignored.
  for (const char* f : {"--profile", "--trace", "--handover", "--persistent"})
    expect_one_line_error(run_lily(b + " " + f), std::string(f) + ": a probe of the cuda backend");
}

TEST(CliText, TokenizeDetokenizeRoundTrip) {
  const std::string tok = " --model " + test::fixture_dir("qwen3-chat-tiny") + " --tokenizer " +
                          test::fixture_dir("tokenizer");
  CliRun r = run_lily("tokenize" + tok + " --text 'Hello, world! <|im_end|>'");
  ASSERT_EQ(r.code, 0) << r.err;
  auto ids = nlohmann::json::parse(r.out).at("tokens").get<std::vector<int>>();
  EXPECT_EQ(ids, (std::vector<int>{9707, 11, 1879, 0, 220, 151645}));
  r = run_lily("detokenize" + tok + " --tokens " + join(ids));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out).at("text"), "Hello, world! <|im_end|>");
  r = run_lily("detokenize" + tok + " --skip-special --tokens " + join(ids));
  EXPECT_EQ(nlohmann::json::parse(r.out).at("text"), "Hello, world! ");
}

// The chat-tiny reference: its prompt renders and tokenizes identically, and
// `lily run` at temperature 0 continues exactly as transformers did.
TEST(CliText, TemplateAndRunReproduceChatTinyReference) {
  auto ref = nlohmann::json::parse(std::ifstream(test::fixture_dir("qwen3-chat-tiny") + "/reference.json"));
  test::TempModelDir tmp("qwen3");
  test::write_text(tmp.file("req.json"),
                   R"({"messages": [{"role": "user", "content": "Write a haiku about the sea."}]})");
  const std::string m = " --model " + test::fixture_dir("qwen3-chat-tiny") + " --tokenizer " +
                        test::fixture_dir("tokenizer");
  CliRun r = run_lily("template" + m + " --request " + tmp.file("req.json"));
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("prompt"), ref.at("prompt_text"));
  EXPECT_EQ(j.at("tokens"), ref.at("prompt_ids"));

  r = run_lily("run" + m + " --quiet --temperature 0 --max-tokens 24 'Write a haiku about the sea.'");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, ref.at("generated_text").get<std::string>() + "\n");
  EXPECT_NE(r.err.find("24 generated"), std::string::npos) << r.err;
}

// run --json-schema: the reply is JSON of the schema even from a model of
// random weights; a bad schema is refused naming the file and the place.
TEST(CliText, RunFollowsAJsonSchema) {
  const std::string m = " --model " + test::fixture_dir("qwen3-chat-tiny") + " --tokenizer " +
                        test::fixture_dir("tokenizer");
  test::TempModelDir tmp("qwen3");
  test::write_text(tmp.file("schema.json"), R"({"type": "object", "properties": {
      "sea": {"enum": ["calm", "rough"]}, "waves": {"type": "integer"}}, "required": ["sea", "waves"]})");
  CliRun r = run_lily("run" + m + " --quiet --temperature 0 --max-tokens 200 --json-schema " + tmp.file("schema.json") +
                      " 'Describe the sea.'");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_TRUE(j["sea"] == "calm" || j["sea"] == "rough") << r.out;
  EXPECT_TRUE(j["waves"].is_number_integer()) << r.out;
  EXPECT_NE(r.err.find(", stop]"), std::string::npos) << r.err;

  test::write_text(tmp.file("bad.json"), R"({"type": "object", "properties": {"a": {"type": "strin"}}})");
  r = run_lily("run" + m + " --quiet --json-schema " + tmp.file("bad.json") + " 'x'");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("bad.json: schema.properties.a.type: 'strin' is not a JSON Schema type"), std::string::npos)
      << r.err;
}

TEST(CliText, ChatKeepsTheConversation) {
  const std::string m = " --model " + test::fixture_dir("qwen3-chat-tiny") + " --tokenizer " +
                        test::fixture_dir("tokenizer");
  test::TempModelDir tmp("qwen3");
  test::write_text(tmp.file("input"), "hello\n/think off\nand again\n/reset\n/bogus\nbye\n/quit\n");
  CliRun r = run_lily("chat" + m + " --quiet --temperature 0 --max-tokens 4 < " + tmp.file("input"));
  ASSERT_EQ(r.code, 0) << r.err;
  // Three replies; the second turn reuses the first turn's prefix.
  size_t n = 0;
  for (size_t p = r.err.find("generated"); p != std::string::npos; p = r.err.find("generated", p + 1)) ++n;
  EXPECT_EQ(n, 3u) << r.err;
  // Only the first and the post-reset turns start cold.
  size_t cold = 0;
  for (size_t p = r.err.find("(0 cached)"); p != std::string::npos; p = r.err.find("(0 cached)", p + 1)) ++cold;
  EXPECT_EQ(cold, 2u) << r.err;
  EXPECT_NE(r.err.find("unknown command /bogus"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("conversation cleared"), std::string::npos) << r.err;
}

TEST(CliText, TemplateErrorsNameTheParameter) {
  test::TempModelDir tmp("qwen3");
  test::write_text(tmp.file("req.json"), R"({"messages": [{"role": "wizard", "content": "hi"}]})");
  const std::string m = " --model " + test::fixture_dir("qwen3-chat-tiny") + " --tokenizer " +
                        test::fixture_dir("tokenizer");
  expect_one_line_error(run_lily("template" + m + " --request " + tmp.file("req.json")), "messages[0].role");
  expect_one_line_error(run_lily("template" + m + " --request /nonexistent.json"), "/nonexistent.json");
}

}  // namespace
}  // namespace lily
