// The OpenAI-compatible server: request validation and error bodies
// (server/api.h), response building with reasoning, tool calls and logprobs
// (server/responses.h), the generation loop (engine/generator.h), the engine
// queue (server/scheduler.h), metrics, and the HTTP server itself on the
// bundled tiny model.
#include "server/server.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "engine/generator.h"
#include "server/api.h"
#include "server/metrics.h"
#include "server/responses.h"
#include "server/scheduler.h"
#include "server/served_model.h"
#include "text/json_constraint.h"

namespace lily::server {
namespace {

using engine::SamplingParams;
using nlohmann::json;

const std::string kFixtures = LILY_FIXTURES_DIR;

ojson J(const char* text) {
  return ojson::parse(text);
}

Limits small_limits() {
  Limits l;
  l.context = 64;
  l.max_tokens_limit = 32;
  l.vocab_size = 1000;
  return l;
}

// Runs fn, which must throw ApiError; returns it.
template <class F>
ApiError expect_api_error(F&& fn) {
  try {
    fn();
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "no ApiError thrown";
  return ApiError(0, "", "");
}

ApiError chat_error(const char* body) {
  return expect_api_error([&] { parse_chat_request(J(body), SamplingParams{}, small_limits()); });
}

ChatRequest chat(const char* body) {
  return parse_chat_request(J(body), SamplingParams{}, small_limits());
}

// ---------------------------------------------------------------- error bodies

TEST(ServerApi, ErrorBodyHasOpenAIShape) {
  ojson b = error_body(400, "bad thing", "temperature", "invalid_type");
  ASSERT_TRUE(b.contains("error"));
  const ojson& e = b["error"];
  EXPECT_EQ(e.size(), 4u);
  EXPECT_EQ(e["message"], "bad thing");
  EXPECT_EQ(e["type"], "invalid_request_error");
  EXPECT_EQ(e["param"], "temperature");
  EXPECT_EQ(e["code"], "invalid_type");

  ojson n = error_body(404, "nope");
  EXPECT_TRUE(n["error"]["param"].is_null());
  EXPECT_TRUE(n["error"]["code"].is_null());
  EXPECT_EQ(n["error"]["type"], "not_found_error");
  EXPECT_EQ(error_type_for_status(401), "authentication_error");
  EXPECT_EQ(error_type_for_status(413), "invalid_request_error");
  EXPECT_EQ(error_type_for_status(500), "server_error");

  ApiError a(401, "invalid_request_error", "Incorrect API key provided.", "", "invalid_api_key");
  ojson ab = error_body(a);
  EXPECT_EQ(ab["error"]["type"], "invalid_request_error");
  EXPECT_EQ(ab["error"]["code"], "invalid_api_key");
}

TEST(ServerApi, MalformedJsonIs400) {
  for (const char* body : {"{bad", "", "[1,2]", "42", "\"text\"", "{\"a\": 1,}"}) {
    ApiError e = expect_api_error([&] { parse_json_body(body); });
    EXPECT_EQ(e.status, 400) << body;
    EXPECT_EQ(e.code, "invalid_json") << body;
  }
  EXPECT_NO_THROW(parse_json_body("{\"messages\": []}"));
}

// ---------------------------------------------------------------- chat requests

TEST(ServerApi, MinimalChatRequestGetsDefaults) {
  SamplingParams defaults;
  defaults.temperature = 0.6f;
  defaults.top_p = 0.95f;
  defaults.top_k = 20;
  ChatRequest r =
      parse_chat_request(J(R"({"model": "m", "messages": [{"role": "user", "content": "hi"}]})"),
                         defaults, small_limits());
  EXPECT_FLOAT_EQ(r.common.sampling.temperature, 0.6f);
  EXPECT_FLOAT_EQ(r.common.sampling.top_p, 0.95f);
  EXPECT_EQ(r.common.sampling.top_k, 20);
  EXPECT_FALSE(r.common.max_tokens.has_value());
  EXPECT_FALSE(r.common.stream);
  EXPECT_EQ(r.tool_choice, ToolChoice::Auto);
  EXPECT_TRUE(r.inputs.tools.is_null());
  EXPECT_FALSE(r.enable_thinking.has_value());
  ASSERT_EQ(r.inputs.messages.size(), 1u);
  EXPECT_EQ(r.inputs.messages[0]["content"], "hi");
}

TEST(ServerApi, ChatSamplingParameters) {
  ChatRequest r = chat(R"({"messages": [{"role": "user", "content": "hi"}],
      "temperature": 0, "top_p": 0.5, "top_k": -1, "min_p": 0.1, "seed": -3,
      "presence_penalty": 1.5, "frequency_penalty": -1, "repetition_penalty": 1.1,
      "max_tokens": 7, "max_completion_tokens": 9, "stop": ["a", "bb"], "n": 1,
      "logprobs": true, "top_logprobs": 3, "stream": true,
      "stream_options": {"include_usage": true}, "user": "u", "prompt_cache_key": "k",
      "logit_bias": {"5": -100, "999": 3.5, "7": 0}})");
  EXPECT_EQ(r.common.n, 1);
  EXPECT_EQ(chat(R"({"messages": [{"role": "user", "content": "x"}], "n": 16})").common.n, 16);
  const auto& s = r.common.sampling;
  EXPECT_EQ(s.logit_bias, (std::vector<std::pair<int, float>>{{5, -100.f}, {999, 3.5f}}));  // 0: dropped
  EXPECT_EQ(s.temperature, 0.f);
  EXPECT_FLOAT_EQ(s.top_p, 0.5f);
  EXPECT_EQ(s.top_k, 0);
  EXPECT_FLOAT_EQ(s.min_p, 0.1f);
  EXPECT_TRUE(s.has_seed);
  EXPECT_EQ(s.seed, static_cast<uint64_t>(-3));
  EXPECT_FLOAT_EQ(s.presence_penalty, 1.5f);
  EXPECT_FLOAT_EQ(s.frequency_penalty, -1.f);
  EXPECT_FLOAT_EQ(s.repetition_penalty, 1.1f);
  EXPECT_EQ(r.common.max_tokens, 9);  // max_completion_tokens wins
  EXPECT_EQ(r.common.stop, (std::vector<std::string>{"a", "bb"}));
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.top_logprobs, 3);
  EXPECT_TRUE(r.common.stream);
  EXPECT_TRUE(r.common.include_usage);
  EXPECT_EQ(r.common.user, "u");
  EXPECT_EQ(r.prompt_cache_key, "k");

  ChatRequest single = chat(
      R"({"messages": [{"role": "user", "content": "hi"}], "stop": "x", "seed": null, "temperature": null})");
  EXPECT_EQ(single.common.stop, (std::vector<std::string>{"x"}));
  EXPECT_FALSE(single.common.sampling.has_seed);
  EXPECT_FLOAT_EQ(single.common.sampling.temperature, 1.0f);
}

TEST(ServerApi, WrongTypesName) {
  struct Case {
    const char* body;
    const char* param;
  } cases[] = {
      {R"({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"})", "temperature"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": "10"})", "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5})", "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stream": "yes"})", "stream"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stop": 5})", "stop"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stop": ["a", 1]})", "stop"},
      {R"({"messages": [{"role": "user", "content": "x"}], "seed": "1"})", "seed"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_k": 1.5})", "top_k"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": 1})", "logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "model": 3})", "model"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": 3})", "tool_choice"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": "json"})",
       "response_format"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stream": true, "stream_options": 1})",
       "stream_options"},
      {R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": "no"}})",
       "chat_template_kwargs.enable_thinking"},
      {R"({"messages": "hello"})", "messages"},
      {R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content"},
      {R"({"messages": [{"role": 1, "content": "x"}]})", "messages[0].role"},
  };
  for (const auto& c : cases) {
    ApiError e = chat_error(c.body);
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.type, "invalid_request_error") << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << " -> " << e.what();
    EXPECT_FALSE(std::string(e.what()).empty());
  }
}

TEST(ServerApi, MissingFieldsAndBadValues) {
  struct Case {
    const char* body;
    const char* param;
    const char* code;
  } cases[] = {
      {R"({"model": "m"})", "messages", "missing_required_parameter"},
      {R"({"messages": []})", "messages", "invalid_value"},
      {R"({"messages": [{"content": "x"}]})", "messages[0].role", "missing_required_parameter"},
      {R"({"messages": [{"role": "wizard", "content": "x"}]})", "messages[0].role",
       "invalid_value"},
      {R"({"messages": [{"role": "user"}]})", "messages[0].content", "missing_required_parameter"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})",
       "messages[0].content[0].type", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "temperature": 2.5})", "temperature",
       "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_p": 0})", "top_p", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3})",
       "presence_penalty", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})", "max_tokens",
       "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 33})", "max_tokens",
       "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 100})",
       "max_completion_tokens", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "n": 0})", "n", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "n": 17})", "n", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs",
       "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21})",
       "top_logprobs", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stop": ""})", "stop", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stop": ["1","2","3","4","5","6","7","8","9","10","11","12","13","14","15","16","17"]})",
       "stop", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}})",
       "stream_options", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})",
       "tool_choice", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"})",
       "tool_choice", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"}})",
       "tool_choice.function.name", "missing_required_parameter"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "a"}}],
          "tool_choice": {"type": "function", "function": {"name": "b"}}})",
       "tool_choice", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]})",
       "tools[0].function.name", "missing_required_parameter"},
      {R"({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"})",
       "reasoning_effort", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}})",
       "response_format.json_schema", "missing_required_parameter"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}})",
       "response_format.json_schema.name", "missing_required_parameter"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
          "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}})",
       "response_format.json_schema.schema", "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "grammar"}})",
       "response_format.type", "unsupported_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logit_bias": [1]})", "logit_bias",
       "invalid_type"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 5}})", "logit_bias",
       "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"-3": 5}})", "logit_bias",
       "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 101}})", "logit_bias",
       "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1000": 1}})", "logit_bias",
       "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": "5"}})", "logit_bias",
       "invalid_value"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 5, "01": 2}})", "logit_bias",
       "invalid_value"},
      {R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]})",
       "messages[0].tool_calls[0].function.arguments", "invalid_value"},
  };
  for (const auto& c : cases) {
    ApiError e = chat_error(c.body);
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << " -> " << e.what();
    EXPECT_EQ(e.code, c.code) << c.body << " -> " << e.what();
  }
}

TEST(ServerApi, ToolsToolChoiceAndReasoningSwitches) {
  const char* tools = R"([{"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])";
  auto with = [&](const std::string& extra) {
    std::string body =
        std::string(R"({"messages": [{"role": "user", "content": "x"}], "tools": )") + tools +
        extra + "}";
    return parse_chat_request(ojson::parse(body), SamplingParams{}, small_limits());
  };
  ChatRequest a = with("");
  EXPECT_EQ(a.tool_choice, ToolChoice::Auto);
  ASSERT_TRUE(a.inputs.tools.is_array());
  EXPECT_EQ(a.inputs.tools.size(), 1u);

  ChatRequest none = with(R"(, "tool_choice": "none")");
  EXPECT_EQ(none.tool_choice, ToolChoice::None);
  EXPECT_TRUE(none.inputs.tools.is_null()) << "tool_choice none keeps tools out of the template";

  ChatRequest req = with(R"(, "tool_choice": "required", "parallel_tool_calls": false)");
  EXPECT_EQ(req.tool_choice, ToolChoice::Required);
  EXPECT_FALSE(req.parallel_tool_calls);

  ChatRequest named =
      with(R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}})");
  EXPECT_EQ(named.tool_choice, ToolChoice::Named);
  EXPECT_EQ(named.tool_name, "get_weather");

  ChatRequest off =
      chat(R"({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none"})");
  EXPECT_EQ(off.enable_thinking, false);
  EXPECT_EQ(off.inputs.template_kwargs["enable_thinking"], false);
  ChatRequest minimal =
      chat(R"({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "minimal"})");
  EXPECT_EQ(minimal.enable_thinking, false);
  ChatRequest high =
      chat(R"({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high"})");
  EXPECT_EQ(high.enable_thinking, true);
  ChatRequest kw =
      chat(R"({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high",
                            "chat_template_kwargs": {"enable_thinking": false}})");
  EXPECT_EQ(kw.enable_thinking, false) << "chat_template_kwargs wins over reasoning_effort";

  ChatRequest jo = chat(
      R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})");
  EXPECT_TRUE(jo.json_object);
  ChatRequest js = parse_chat_request(ojson::parse(R"({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": true,
      "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}})"),
      engine::SamplingParams{}, Limits{});
  ASSERT_NE(js.json_schema, nullptr);
  EXPECT_FALSE(js.json_object);
  {
    text::JsonMatcher m(js.json_schema);
    EXPECT_TRUE(m.feed("{\"a\": 12}") && m.accepting());
  }
  ChatRequest text = chat(
      R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "text"}})");
  EXPECT_FALSE(text.json_object);

  // History with a tool call and its result maps for the template.
  ChatRequest hist = chat(R"({"messages": [
      {"role": "developer", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "weather in "}, {"type": "text", "text": "Paris?"}]},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})");
  const ojson& m = hist.inputs.messages;
  ASSERT_EQ(m.size(), 4u);
  EXPECT_EQ(m[0]["role"], "system");
  EXPECT_EQ(m[1]["content"], "weather in Paris?");
  EXPECT_EQ(m[2]["tool_calls"][0]["function"]["arguments"]["city"], "Paris");
  EXPECT_EQ(m[3]["tool_call_id"], "call_1");
}

// ---------------------------------------------------------------- completions

TEST(ServerApi, CompletionRequests) {
  Limits l = small_limits();
  CompletionRequest s =
      parse_completion_request(J(R"({"prompt": "Once", "echo": true, "logprobs": 2})"), {}, l);
  EXPECT_FALSE(s.prompt_is_tokens);
  EXPECT_EQ(s.prompt_text, "Once");
  EXPECT_TRUE(s.echo);
  EXPECT_EQ(s.logprobs, 2);
  CompletionRequest t = parse_completion_request(J(R"({"prompt": [1, 2, 3]})"), {}, l);
  EXPECT_TRUE(t.prompt_is_tokens);
  EXPECT_EQ(t.prompt_tokens, (std::vector<int>{1, 2, 3}));
  CompletionRequest one = parse_completion_request(J(R"({"prompt": ["x"]})"), {}, l);
  EXPECT_EQ(one.prompt_text, "x");
  CompletionRequest one_ids = parse_completion_request(J(R"({"prompt": [[5, 6]]})"), {}, l);
  EXPECT_EQ(one_ids.prompt_tokens, (std::vector<int>{5, 6}));

  struct Case {
    const char* body;
    const char* param;
  } cases[] = {
      {R"({"model": "m"})", "prompt"},
      {R"({"prompt": ""})", "prompt"},
      {R"({"prompt": []})", "prompt"},
      {R"({"prompt": ["a", "b"]})", "prompt"},
      {R"({"prompt": [1, -2]})", "prompt"},
      {R"({"prompt": [1, "a"]})", "prompt"},
      {R"({"prompt": 5})", "prompt"},
      {R"({"prompt": "x", "logprobs": 6})", "logprobs"},
      {R"({"prompt": "x", "best_of": 2})", "best_of"},
      {R"({"prompt": "x", "suffix": "y"})", "suffix"},
      {R"({"prompt": "x", "n": 300})", "n"},
      {R"({"prompt": "x", "max_tokens": 1000})", "max_tokens"},
  };
  for (const auto& c : cases) {
    ApiError e = expect_api_error([&] { parse_completion_request(J(c.body), {}, l); });
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << " -> " << e.what();
  }
}

TEST(ServerApi, ContextLimits) {
  Limits l = small_limits();  // context 64, max_tokens <= 32
  EXPECT_EQ(resolve_max_tokens(std::nullopt, 10, l), 32);
  EXPECT_EQ(resolve_max_tokens(std::nullopt, 50, l), 14);
  EXPECT_EQ(resolve_max_tokens(20, 44, l), 20);
  ApiError too_long = expect_api_error([&] { resolve_max_tokens(std::nullopt, 64, l); });
  EXPECT_EQ(too_long.status, 400);
  EXPECT_EQ(too_long.code, "context_length_exceeded");
  EXPECT_EQ(too_long.param, "messages");
  ApiError sum = expect_api_error([&] { resolve_max_tokens(21, 44, l, "prompt"); });
  EXPECT_EQ(sum.code, "context_length_exceeded");
  EXPECT_EQ(sum.param, "max_tokens");
  ApiError p = expect_api_error([&] { resolve_max_tokens(std::nullopt, 100, l, "prompt"); });
  EXPECT_EQ(p.param, "prompt");
}

// ---------------------------------------------------------------- responses

const text::Tokenizer& tokenizer() {
  static const text::Tokenizer t = text::Tokenizer::from_dir(kFixtures + "/tokenizer");
  return t;
}

JobEvent token_event(int id, std::string text, float lp = -0.5f) {
  JobEvent e;
  e.kind = JobEvent::Kind::Token;
  engine::TokenInfo t;
  t.id = id;
  t.logprob = lp;
  t.top = {{id, lp}, {id + 1, lp - 1}};
  e.gen.token = t;
  e.gen.text = std::move(text);
  return e;
}

JobEvent done_event(engine::FinishReason f, int prompt, int completion, int cached = 0) {
  JobEvent e;
  e.kind = JobEvent::Kind::Done;
  e.result.finish = f;
  e.result.prompt_tokens = prompt;
  e.result.completion_tokens = completion;
  e.result.cached_tokens = cached;
  return e;
}

// The data payloads of an SSE text.
std::vector<std::string> sse_payloads(const std::string& sse) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < sse.size()) {
    size_t end = sse.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos) << "unterminated event";
    if (end == std::string::npos) break;
    std::string ev = sse.substr(pos, end - pos);
    EXPECT_EQ(ev.rfind("data: ", 0), 0u) << ev;
    out.push_back(ev.substr(6));
    pos = end + 2;
  }
  return out;
}

struct StreamedChat {
  std::string content, reasoning, finish;
  std::vector<ojson> calls;  // merged per index
  ojson usage;
  ojson error;
  int logprob_entries = 0;
  bool done = false;
  bool role_first = false;
};

StreamedChat collect_chat(const std::string& sse) {
  StreamedChat s;
  auto payloads = sse_payloads(sse);
  for (size_t i = 0; i < payloads.size(); ++i) {
    if (payloads[i] == "[DONE]") {
      EXPECT_EQ(i + 1, payloads.size()) << "[DONE] must be last";
      s.done = true;
      continue;
    }
    ojson c = ojson::parse(payloads[i]);
    if (c.contains("error")) {
      s.error = c["error"];
      continue;
    }
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    if (c["choices"].empty()) {
      s.usage = c["usage"];
      continue;
    }
    const ojson& ch = c["choices"][0];
    const ojson& d = ch["delta"];
    if (i == 0) s.role_first = d.value("role", "") == "assistant";
    if (d.contains("content") && d["content"].is_string())
      s.content += d["content"].get<std::string>();
    if (d.contains("reasoning_content")) s.reasoning += d["reasoning_content"].get<std::string>();
    if (d.contains("tool_calls"))
      for (const auto& tc : d["tool_calls"]) {
        size_t idx = tc["index"].get<size_t>();
        if (idx >= s.calls.size()) {
          EXPECT_EQ(idx, s.calls.size());
          EXPECT_TRUE(tc.contains("id"));
          EXPECT_EQ(tc["type"], "function");
          s.calls.push_back(
              {{"id", tc["id"]}, {"name", tc["function"]["name"]}, {"arguments", ""}});
        }
        s.calls[idx]["arguments"] = s.calls[idx]["arguments"].get<std::string>() +
                                    tc["function"]["arguments"].get<std::string>();
      }
    if (ch["logprobs"].is_object())
      s.logprob_entries += static_cast<int>(ch["logprobs"]["content"].size());
    if (!ch["finish_reason"].is_null()) s.finish = ch["finish_reason"];
  }
  return s;
}

ChatSetup base_setup(bool stream) {
  ChatSetup s;
  s.id = "chatcmpl-test";
  s.model = "tiny";
  s.created = 1;
  s.stream = stream;
  s.stop_token_ids = {151645};
  return s;
}

// Feeds the same events to a streaming and a non-streaming builder, one by one.
std::pair<std::string, ojson> run_both(ChatSetup setup, const std::vector<JobEvent>& events) {
  ChatSetup ss = setup;
  ss.stream = true;
  ChatSetup ns = setup;
  ns.stream = false;
  ChatResponseBuilder sb(ss, tokenizer()), nb(ns, tokenizer());
  std::string sse;
  for (const auto& e : events) {
    std::vector<JobEvent> one{e}, two{e};
    sse += sb.feed(one);
    nb.feed(two);
  }
  EXPECT_TRUE(sb.done());
  EXPECT_TRUE(nb.done());
  return {sse, nb.body()};
}

TEST(ServerResponses, ChatContentStreamMatchesBody) {
  ChatSetup s = base_setup(true);
  s.include_usage = true;
  std::vector<JobEvent> ev = {token_event(10, "Hello"), token_event(11, ""),
                              token_event(12, ", world"), token_event(151645, ""),
                              done_event(engine::FinishReason::Stop, 16, 4, 3)};
  auto [sse, body] = run_both(s, ev);
  StreamedChat st = collect_chat(sse);
  EXPECT_TRUE(st.role_first);
  EXPECT_TRUE(st.done);
  EXPECT_EQ(st.content, "Hello, world");
  EXPECT_EQ(st.finish, "stop");
  EXPECT_EQ(st.usage["prompt_tokens"], 16);
  EXPECT_EQ(st.usage["completion_tokens"], 4);
  EXPECT_EQ(st.usage["total_tokens"], 20);
  EXPECT_EQ(st.usage["prompt_tokens_details"]["cached_tokens"], 3);

  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["id"], "chatcmpl-test");
  EXPECT_EQ(body["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(body["choices"][0]["message"]["content"], st.content);
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(body["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(body["usage"], st.usage);
  EXPECT_FALSE(body["choices"][0]["message"].contains("tool_calls"));
}

TEST(ServerResponses, ChatLengthAndLogprobs) {
  ChatSetup s = base_setup(true);
  s.logprobs = true;
  s.top_logprobs = 2;
  const int hello = tokenizer().encode("Hello")[0];
  std::vector<JobEvent> ev = {token_event(hello, "Hello", -0.25f),
                              token_event(hello, "Hello", -1e30f),
                              done_event(engine::FinishReason::Length, 5, 2)};
  auto [sse, body] = run_both(s, ev);
  StreamedChat st = collect_chat(sse);
  EXPECT_EQ(st.finish, "length");
  EXPECT_EQ(st.logprob_entries, 2);
  const ojson& lp = body["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(lp.size(), 2u);
  EXPECT_EQ(lp[0]["token"], "Hello");
  EXPECT_DOUBLE_EQ(lp[0]["logprob"].get<double>(), -0.25);
  EXPECT_EQ(lp[0]["bytes"], ojson::array({72, 101, 108, 108, 111}));
  EXPECT_EQ(lp[0]["top_logprobs"].size(), 2u);
  EXPECT_DOUBLE_EQ(lp[1]["logprob"].get<double>(), -9999.0) << "no -inf in JSON";
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
}

TEST(ServerResponses, ChatReasoningIsSeparated) {
  ChatSetup s = base_setup(true);
  s.parser.reasoning_enabled = true;
  std::vector<JobEvent> ev = {
      token_event(1, "<thi"),          token_event(2, "nk>\nLet me"),
      token_event(3, " think.\n</th"), token_event(4, "ink>\n\nThe answer"),
      token_event(5, " is 4."),        done_event(engine::FinishReason::Stop, 3, 5)};
  auto [sse, body] = run_both(s, ev);
  StreamedChat st = collect_chat(sse);
  EXPECT_EQ(st.reasoning, "Let me think.");
  EXPECT_EQ(st.content, "The answer is 4.");
  EXPECT_EQ(body["choices"][0]["message"]["reasoning_content"], "Let me think.");
  EXPECT_EQ(body["choices"][0]["message"]["content"], "The answer is 4.");

  // Prompt already opened <think> (Qwen3.5-style templates).
  ChatSetup open = base_setup(true);
  open.parser.starts_in_reasoning = true;
  auto [sse2, body2] = run_both(
      open, {token_event(1, "hmm\n</think>\n\nok"), done_event(engine::FinishReason::Stop, 3, 1)});
  EXPECT_EQ(body2["choices"][0]["message"]["reasoning_content"], "hmm");
  EXPECT_EQ(body2["choices"][0]["message"]["content"], "ok");
  EXPECT_EQ(collect_chat(sse2).reasoning, "hmm");
}

TEST(ServerResponses, ChatToolCallsHermes) {
  ChatSetup s = base_setup(true);
  s.parser.tool_dialect = text::ToolDialect::Hermes;
  s.parser.tools = json::parse(R"([{"type": "function", "function": {"name": "get_weather"}}])");
  std::vector<JobEvent> ev = {token_event(1, "Let me check.\n<tool_"),
                              token_event(2, "call>\n{\"name\": \"get_wea"),
                              token_event(3, "ther\", \"arguments\": {\"city\": "),
                              token_event(4, "\"Paris\"}}\n</tool_call>"),
                              token_event(5,
                                          "\n<tool_call>\n{\"name\": \"get_weather\", "
                                          "\"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"),
                              token_event(151645, ""),
                              done_event(engine::FinishReason::Stop, 10, 6)};
  auto [sse, body] = run_both(s, ev);
  StreamedChat st = collect_chat(sse);
  EXPECT_EQ(st.finish, "tool_calls");
  EXPECT_EQ(st.content, "Let me check.");
  ASSERT_EQ(st.calls.size(), 2u);
  EXPECT_EQ(st.calls[0]["name"], "get_weather");
  EXPECT_EQ(json::parse(st.calls[0]["arguments"].get<std::string>()),
            json::parse(R"({"city": "Paris"})"));
  EXPECT_EQ(json::parse(st.calls[1]["arguments"].get<std::string>()),
            json::parse(R"({"city": "Oslo"})"));
  EXPECT_EQ(st.calls[0]["id"].get<std::string>().rfind("call_", 0), 0u);

  const ojson& msg = body["choices"][0]["message"];
  EXPECT_EQ(body["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_EQ(msg["content"], "Let me check.");
  ASSERT_EQ(msg["tool_calls"].size(), 2u);
  EXPECT_EQ(msg["tool_calls"][0]["type"], "function");
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(msg["tool_calls"][1]["function"]["arguments"].get<std::string>())["city"],
            "Oslo");

  // Only a call: content is null.
  auto [sse2, body2] = run_both(
      s,
      {token_event(1, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>"),
       done_event(engine::FinishReason::Stop, 10, 1)});
  EXPECT_TRUE(body2["choices"][0]["message"]["content"].is_null());
  EXPECT_EQ(body2["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"], "{}");
}

TEST(ServerResponses, ChatToolCallsXml) {
  ChatSetup s = base_setup(true);
  s.parser.tool_dialect = text::ToolDialect::Xml;
  s.parser.tools = json::parse(R"([{"type": "function", "function": {"name": "add",
      "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}}}])");
  auto [sse, body] = run_both(
      s,
      {token_event(1, "<tool_call>\n<function=add>\n<parameter=a>\n4"),
       token_event(2, "2\n</parameter>\n<parameter=b>\nx\n</parameter>\n</function>\n</tool_call>"),
       done_event(engine::FinishReason::Stop, 10, 2)});
  StreamedChat st = collect_chat(sse);
  ASSERT_EQ(st.calls.size(), 1u);
  EXPECT_EQ(json::parse(st.calls[0]["arguments"].get<std::string>()),
            json::parse(R"({"a": 42, "b": "x"})"));
  EXPECT_EQ(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            st.calls[0]["arguments"]);
}

TEST(ServerResponses, ForcedToolCallPrefixAndValidation) {
  // tool_choice named: the prompt already holds the call's opening.
  ChatSetup s = base_setup(true);
  s.parser.tool_dialect = text::ToolDialect::Hermes;
  s.tool_choice = ToolChoice::Named;
  s.tool_name = "get_weather";
  s.forced_prefix = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ";
  auto [sse, body] = run_both(s, {token_event(1, "{\"city\": \"Rome\"}}\n</tool_call>"),
                                  done_event(engine::FinishReason::Stop, 10, 1)});
  StreamedChat st = collect_chat(sse);
  ASSERT_EQ(st.calls.size(), 1u);
  EXPECT_EQ(st.calls[0]["name"], "get_weather");
  EXPECT_EQ(st.finish, "tool_calls");
  EXPECT_EQ(json::parse(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
                            .get<std::string>())["city"],
            "Rome");

  // tool_choice required, but the model wrote text: an error, in both modes.
  ChatSetup r = base_setup(true);
  r.parser.tool_dialect = text::ToolDialect::Hermes;
  r.tool_choice = ToolChoice::Required;
  ChatSetup rn = r;
  rn.stream = false;
  ChatResponseBuilder nb(rn, tokenizer());
  std::vector<JobEvent> ev = {token_event(1, "no call"),
                              done_event(engine::FinishReason::Stop, 10, 1)};
  nb.feed(ev);
  ApiError e = expect_api_error([&] { nb.body(); });
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.code, "tool_use_failed");
  ChatResponseBuilder sb(r, tokenizer());
  std::vector<JobEvent> ev2 = {token_event(1, "no call"),
                               done_event(engine::FinishReason::Stop, 10, 1)};
  StreamedChat st2 = collect_chat(sb.feed(ev2));
  EXPECT_EQ(st2.error["code"], "tool_use_failed");
  EXPECT_TRUE(st2.done);

  // parallel_tool_calls=false: the injected stop string closes the call.
  ChatSetup p = base_setup(false);
  p.parser.tool_dialect = text::ToolDialect::Hermes;
  p.injected_stop = "</tool_call>";
  ChatResponseBuilder pb(p, tokenizer());
  JobEvent d = done_event(engine::FinishReason::Stop, 10, 2);
  d.result.matched_stop = "</tool_call>";
  std::vector<JobEvent> ev3 = {
      token_event(1, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n"), d};
  pb.feed(ev3);
  ojson pbody = pb.body();
  ASSERT_EQ(pbody["choices"][0]["message"]["tool_calls"].size(), 1u);
  EXPECT_EQ(pbody["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"], "{\"x\":1}");
  EXPECT_EQ(pbody["choices"][0]["finish_reason"], "tool_calls");
}

TEST(ServerResponses, JsonObjectIsChecked) {
  ChatSetup s = base_setup(false);
  s.json_object = true;
  {
    ChatResponseBuilder b(s, tokenizer());
    std::vector<JobEvent> ev = {token_event(1, " {\"a\": [1, 2]}\n"),
                                done_event(engine::FinishReason::Stop, 3, 1)};
    b.feed(ev);
    EXPECT_EQ(b.body()["choices"][0]["message"]["content"], " {\"a\": [1, 2]}\n");
  }
  {
    ChatResponseBuilder b(s, tokenizer());
    std::vector<JobEvent> ev = {token_event(1, "not json"),
                                done_event(engine::FinishReason::Stop, 3, 1)};
    b.feed(ev);
    ApiError e = expect_api_error([&] { b.body(); });
    EXPECT_EQ(e.code, "json_validate_failed");
    EXPECT_EQ(e.param, "response_format");
  }
  {
    // Cut by max_tokens: reported as it is (finish_reason "length").
    ChatResponseBuilder b(s, tokenizer());
    std::vector<JobEvent> ev = {token_event(1, "{\"a\": "),
                                done_event(engine::FinishReason::Length, 3, 1)};
    b.feed(ev);
    EXPECT_EQ(b.body()["choices"][0]["finish_reason"], "length");
  }
}

TEST(ServerResponses, EngineErrorsAndCancellation) {
  JobEvent err;
  err.kind = JobEvent::Kind::Error;
  err.error_status = 400;
  err.error = "token id 999999 is outside the vocabulary";
  {
    ChatResponseBuilder b(base_setup(false), tokenizer());
    std::vector<JobEvent> ev = {err};
    b.feed(ev);
    ApiError e = expect_api_error([&] { b.body(); });
    EXPECT_EQ(e.status, 400);
  }
  {
    ChatResponseBuilder b(base_setup(true), tokenizer());
    std::vector<JobEvent> ev = {token_event(1, "partial"), err};
    StreamedChat st = collect_chat(b.feed(ev));
    EXPECT_EQ(st.content, "partial");
    EXPECT_TRUE(st.error.is_object());
    EXPECT_EQ(st.error["message"], err.error);
    EXPECT_TRUE(st.done);
  }
  {
    ChatResponseBuilder b(base_setup(false), tokenizer());
    std::vector<JobEvent> ev = {done_event(engine::FinishReason::Cancelled, 3, 0)};
    b.feed(ev);
    EXPECT_EQ(expect_api_error([&] { b.body(); }).status, 503);
  }
}

TEST(ServerResponses, Completions) {
  CompletionSetup s;
  s.id = "cmpl-x";
  s.model = "tiny";
  s.logprobs = 1;
  s.echo_text = "Once";
  s.stop_token_ids = {151645};
  auto events = [] {
    return std::vector<JobEvent>{token_event(10, " upon"), token_event(11, " a"),
                                 token_event(151645, ""),
                                 done_event(engine::FinishReason::Stop, 1, 3)};
  };
  CompletionResponseBuilder nb(s, tokenizer());
  auto ev = events();
  nb.feed(ev);
  ojson b = nb.body();
  EXPECT_EQ(b["object"], "text_completion");
  EXPECT_EQ(b["choices"][0]["text"], "Once upon a");
  EXPECT_EQ(b["choices"][0]["finish_reason"], "stop");
  const ojson& lp = b["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"].size(), 2u) << "the stop token is not listed";
  EXPECT_EQ(lp["text_offset"], ojson::array({4, 9}));
  EXPECT_EQ(b["usage"]["completion_tokens"], 3);

  s.stream = true;
  s.include_usage = true;
  CompletionResponseBuilder sb(s, tokenizer());
  auto ev2 = events();
  auto payloads = sse_payloads(sb.feed(ev2));
  std::string text, finish;
  bool usage = false;
  for (const auto& p : payloads) {
    if (p == "[DONE]") continue;
    ojson c = ojson::parse(p);
    if (c["choices"].empty()) {
      usage = c["usage"]["total_tokens"] == 4;
      continue;
    }
    text += c["choices"][0]["text"].get<std::string>();
    if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(text, "Once upon a");
  EXPECT_EQ(finish, "stop");
  EXPECT_TRUE(usage);
  EXPECT_EQ(payloads.back(), "[DONE]");
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// What the chat endpoint does to the prompt and the parser, with the real
// Qwen3 (Hermes) and Qwen3.5 (XML, prompt opens <think>) templates.
TEST(ServerResponses, PlanChatReplyForcesToolCalls) {
  const char* body = R"({"messages": [{"role": "user", "content": "Weather in Paris?"}],
      "tools": [{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})";
  ChatRequest named = chat(body);

  text::ChatTemplate qwen3 = text::ChatTemplate::from_model_dir(kFixtures + "/qwen3-chat-tiny");
  ASSERT_EQ(detect_tool_dialect(qwen3.source()), text::ToolDialect::Hermes);
  std::string p3 = qwen3.render(named.inputs);
  ChatSetup s3;
  std::string f3 = plan_chat_reply(named, text::ToolDialect::Hermes, p3, s3);
  EXPECT_EQ(f3, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\":");
  EXPECT_FALSE(s3.parser.starts_in_reasoning);
  EXPECT_EQ(s3.parser.tool_dialect, text::ToolDialect::Hermes);
  EXPECT_EQ(s3.tool_choice, ToolChoice::Named);
  EXPECT_TRUE(s3.injected_stop.empty());
  // The forced text parses as the start of the call.
  ChatResponseBuilder b3(s3, tokenizer());
  std::vector<JobEvent> ev3 = {token_event(1, " {\"city\": \"Paris\"}}\n</tool_call>"),
                               done_event(engine::FinishReason::Stop, 10, 1)};
  b3.feed(ev3);
  EXPECT_EQ(b3.body()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"city\":\"Paris\"}");

  text::ChatTemplate qwen35(read_file(kFixtures + "/tokenizer/qwen3_5_chat_template.jinja"));
  ASSERT_EQ(detect_tool_dialect(qwen35.source()), text::ToolDialect::Xml);
  std::string p35 = qwen35.render(named.inputs);
  ASSERT_EQ(p35.substr(p35.size() - 8), "<think>\n");
  ChatSetup s35;
  std::string f35 = plan_chat_reply(named, text::ToolDialect::Xml, p35, s35);
  EXPECT_TRUE(s35.parser.starts_in_reasoning);
  EXPECT_EQ(f35, "\n</think>\n\n<tool_call>\n<function=get_weather>\n");
  ChatResponseBuilder b35(s35, tokenizer());
  std::vector<JobEvent> ev35 = {
      token_event(1, "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
      done_event(engine::FinishReason::Stop, 10, 1)};
  b35.feed(ev35);
  ojson m35 = b35.body()["choices"][0]["message"];
  EXPECT_FALSE(m35.contains("reasoning_content"));
  EXPECT_EQ(m35["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(m35["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            json::parse(R"({"city": "Paris"})"));

  // required: the name is left to the model.
  ChatRequest req = chat(R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "parallel_tool_calls": false})");
  ChatSetup sr;
  EXPECT_EQ(plan_chat_reply(req, text::ToolDialect::Hermes, "...assistant\n", sr),
            "<tool_call>\n{\"name\": \"");
  EXPECT_EQ(sr.injected_stop, "</tool_call>");
  ChatSetup sx;
  EXPECT_EQ(plan_chat_reply(req, text::ToolDialect::Xml, "...assistant\n", sx),
            "<tool_call>\n<function=");

  // auto / none / thinking off: nothing forced.
  ChatRequest none = chat(R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none",
      "chat_template_kwargs": {"enable_thinking": false}})");
  ChatSetup sn;
  EXPECT_EQ(plan_chat_reply(none, text::ToolDialect::Xml, "<think>\n\n</think>\n\n", sn), "");
  EXPECT_EQ(sn.parser.tool_dialect, text::ToolDialect::None);
  EXPECT_FALSE(sn.parser.reasoning_enabled);
  EXPECT_FALSE(sn.parser.starts_in_reasoning);
  // A model whose template has no tool syntax: tools are not parsed.
  ChatSetup sd;
  EXPECT_EQ(plan_chat_reply(named, text::ToolDialect::None, "x", sd), "");
  EXPECT_EQ(sd.parser.tool_dialect, text::ToolDialect::None);
}

TEST(ServerMisc, DetectToolDialect) {
  EXPECT_EQ(detect_tool_dialect("{{ '<tool_call>\\n{\"name\": ' }}"), text::ToolDialect::Hermes);
  EXPECT_EQ(detect_tool_dialect("<tool_call>\n<function=' + name"), text::ToolDialect::Xml);
  EXPECT_EQ(detect_tool_dialect("{{ messages }}"), text::ToolDialect::None);
}

TEST(ServerMisc, MetricsRender) {
  Metrics m;
  m.count_request("/v1/chat/completions", 200);
  m.count_request("/v1/chat/completions", 400);
  m.count_request("/v1/chat/completions", 200);
  m.count_generation(16, 8, 24, 0.02, 0.1, false);
  m.count_generation(16, 0, 0, -1, 0, true);
  std::string out = m.render();
  EXPECT_NE(out.find("lily_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 2"),
            std::string::npos);
  EXPECT_NE(out.find("lily_requests_total{route=\"/v1/chat/completions\",status=\"400\"} 1"),
            std::string::npos);
  EXPECT_NE(out.find("lily_prompt_tokens_total 32"), std::string::npos);
  EXPECT_NE(out.find("lily_generated_tokens_total 24"), std::string::npos);
  EXPECT_NE(out.find("lily_prefix_cache_hits_total 1"), std::string::npos);
  EXPECT_NE(out.find("lily_prefix_cache_hit_tokens_total 8"), std::string::npos);
  EXPECT_NE(out.find("lily_generations_cancelled_total 1"), std::string::npos);
  EXPECT_NE(out.find("lily_time_to_first_token_seconds_count 1"), std::string::npos);
  EXPECT_NE(out.find("lily_time_to_first_token_seconds_bucket{le=\"0.025\"} 1"), std::string::npos);
  EXPECT_NE(out.find("lily_decode_tokens_per_second_count 1"), std::string::npos);
  EXPECT_NE(out.find("lily_queue_depth 0"), std::string::npos);
}

// ---------------------------------------------------------------- engine on the tiny model

struct Tiny {
  ServedModel model;
  std::vector<int> prompt, reference;
  std::string reference_text;
};

Tiny& tiny() {
  static Tiny* t = [] {
    auto* x = new Tiny;
    ModelLoadOptions o;
    o.model_dir = kFixtures + "/qwen3-chat-tiny";
    o.tokenizer_dir = kFixtures + "/tokenizer";
    o.backend.threads = 1;
    x->model = load_served_model(o);
    std::ifstream f(kFixtures + "/qwen3-chat-tiny/reference.json");
    json ref = json::parse(f);
    x->prompt = ref["prompt_ids"].get<std::vector<int>>();
    x->reference = ref["generated_ids"].get<std::vector<int>>();
    x->reference_text = ref["generated_text"];
    return x;
  }();
  return *t;
}

engine::GenerationParams greedy(const std::vector<int>& prompt, int max_tokens) {
  engine::GenerationParams p;
  p.prompt = prompt;
  p.sampling.temperature = 0;
  p.max_tokens = max_tokens;
  p.stop_token_ids = tiny().model.stop_token_ids;
  return p;
}

struct Collected {
  std::vector<int> ids;
  std::string text;
  engine::GenerationResult result;
};

Collected run(engine::Generator& g, const engine::GenerationParams& p,
              const std::atomic<bool>* cancel = nullptr, int stop_after = -1) {
  Collected c;
  c.result = g.generate(
      p,
      [&](engine::GenerationEvent&& e) {
        if (e.token) c.ids.push_back(e.token->id);
        c.text += e.text;
        return stop_after < 0 || static_cast<int>(c.ids.size()) < stop_after;
      },
      cancel);
  return c;
}

TEST(ServerEngine, GeneratorReproducesReferenceAndReusesPrefix) {
  Tiny& t = tiny();
  ASSERT_EQ(t.model.id, "qwen3-chat-tiny");
  ASSERT_EQ(t.model.tool_dialect, text::ToolDialect::Hermes);
  EXPECT_NE(std::find(t.model.stop_token_ids.begin(), t.model.stop_token_ids.end(), 151645),
            t.model.stop_token_ids.end());
  engine::Generator g(*t.model.backend, *t.model.tokenizer, 256);
  g.keep_min_tokens = 1;  // this test's conversations are short
  const int n = static_cast<int>(t.reference.size());

  Collected a = run(g, greedy(t.prompt, n));
  EXPECT_EQ(a.ids, t.reference);
  EXPECT_EQ(a.text, t.reference_text);
  EXPECT_EQ(a.result.finish, engine::FinishReason::Length);
  EXPECT_EQ(a.result.prompt_tokens, 16);
  EXPECT_EQ(a.result.completion_tokens, n);
  EXPECT_EQ(a.result.cached_tokens, 0);

  // The same prompt again: the live sequence (prompt + reply), cut back to
  // the prompt's first 15 tokens (the 16th runs again for its logits).
  ASSERT_TRUE(t.model.backend->can_truncate()) << "a Qwen3 model has no DeltaNet state";
  Collected b = run(g, greedy(t.prompt, n));
  EXPECT_EQ(b.ids, t.reference);
  EXPECT_EQ(b.result.cached_tokens, 15);

  // A follow-up that extends prompt + reply reuses the live sequence.
  std::vector<int> follow = t.prompt;
  follow.insert(follow.end(), t.reference.begin(), t.reference.end());
  follow.push_back(151645);
  follow.push_back(198);
  Collected c = run(g, greedy(follow, 4));
  EXPECT_EQ(c.result.cached_tokens, 16 + n - 1) << "everything the slot fed";
  engine::Generator fresh(*t.model.backend, *t.model.tokenizer, 256);
  Collected c2 = run(fresh, greedy(follow, 4));
  EXPECT_EQ(c2.result.cached_tokens, 0);
  EXPECT_EQ(c.ids, c2.ids);

  // Back to the first prompt: the follow-up's sequence starts with it.
  Collected d = run(g, greedy(t.prompt, 2));
  EXPECT_EQ(d.result.cached_tokens, 15);
  EXPECT_EQ(d.ids, std::vector<int>(t.reference.begin(), t.reference.begin() + 2));
  // Diverging from the reply (as when the reasoning is stripped from the
  // history): the prompt is reused whole.
  std::vector<int> diverge = t.prompt;
  diverge.push_back(9707);
  ASSERT_NE(t.reference[0], 9707);
  Collected d2 = run(g, greedy(diverge, 2));
  EXPECT_EQ(d2.result.cached_tokens, 16);
  // Another conversation sharing only the chat template's first tokens.
  std::vector<int> other = {151644, 872, 198, 9707};
  ASSERT_EQ(engine::common_prefix(other, t.prompt), 3u);
  Collected e = run(g, greedy(other, 2));
  EXPECT_EQ(e.result.cached_tokens, 3);
  Collected e2 = run(fresh, greedy(other, 2));
  EXPECT_EQ(e.ids, e2.ids);
  // The follow-up conversation was parked when `other` cut the live
  // sequence back: continuing it reuses all it had fed.
  Collected c3 = run(g, greedy(follow, 4));
  EXPECT_EQ(c3.result.cached_tokens, static_cast<int>(follow.size()) - 1);
  EXPECT_EQ(c3.ids, c2.ids);
}

// Constrained decoding on a model of random weights: whatever it prefers,
// the output is a JSON value of the schema, greedy or sampled, and it ends
// with a stop token once the value is complete.
TEST(ServerEngine, GeneratorFollowsAJsonSchema) {
  Tiny& t = tiny();
  engine::Generator g(*t.model.backend, *t.model.tokenizer, 512);
  auto grammar = text::JsonGrammar::from_schema(ojson::parse(R"({"type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 30]}, "v": {"type": "null"},
                   "list": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["ok", "n", "list"], "additionalProperties": false})"));
  for (int seed = 0; seed < 4; ++seed) {
    engine::GenerationParams p = greedy(t.prompt, 200);
    if (seed > 0) {
      p.sampling.temperature = 1.0f;
      p.sampling.seed = static_cast<uint64_t>(seed);
      p.sampling.has_seed = true;
    }
    p.json_grammar = grammar;
    Collected c = run(g, p);
    SCOPED_TRACE(c.text);
    EXPECT_EQ(c.result.finish, engine::FinishReason::Stop);
    const ojson j = ojson::parse(c.text, nullptr, false);
    ASSERT_FALSE(j.is_discarded());
    ASSERT_TRUE(j.is_object());
    EXPECT_TRUE(j["ok"].is_boolean());
    EXPECT_TRUE(j["n"] == 1 || j["n"] == 2 || j["n"] == 30);
    EXPECT_TRUE(j["list"].is_array() && j["list"].size() <= 3);
    for (auto it = j.begin(); it != j.end(); ++it)
      EXPECT_TRUE(it.key() == "ok" || it.key() == "n" || it.key() == "v" || it.key() == "list") << it.key();
  }
  // Unconstrained, the same model writes no JSON.
  Collected free = run(g, greedy(t.prompt, 16));
  EXPECT_TRUE(ojson::parse(free.text, nullptr, false).is_discarded());

  // The constraint can wait for the end of the reasoning: before "</think>"
  // the model writes freely.
  engine::GenerationParams p = greedy(t.prompt, 100);
  p.json_grammar = grammar;
  p.grammar_after = std::string(t.model.tokenizer->token_bytes(t.reference[0]));  // its first token anyway
  const size_t n = p.grammar_after.size();
  Collected late = run(g, p);
  EXPECT_EQ(late.result.finish, engine::FinishReason::Stop);
  ASSERT_GE(late.text.size(), n);
  EXPECT_EQ(late.text.substr(0, n), p.grammar_after);
  EXPECT_TRUE(ojson::parse(late.text.substr(n), nullptr, false).is_object()) << late.text;
}

// Constrained tool calls on a model of random weights. A bias on
// "<tool_call>" makes it open a call wherever it writes freely, so the
// output is call after call: each must be a complete call of the tools'
// schemas, in either syntax; a forced start (tool_choice required) too.
TEST(ServerEngine, GeneratorConstrainsToolCalls) {
  Tiny& t = tiny();
  engine::Generator g(*t.model.backend, *t.model.tokenizer, 512);
  const ojson tools = ojson::parse(R"([
    {"type": "function", "function": {"name": "set_mode", "parameters": {"type": "object",
      "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]}, "level": {"type": "integer"},
                     "on": {"type": "boolean"}, "ids": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}},
      "required": ["mode"], "additionalProperties": false}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
      "additionalProperties": false}}}])");
  const std::optional<int> open = t.model.tokenizer->token_to_id("<tool_call>");
  ASSERT_TRUE(open.has_value());
  for (auto syntax : {text::ToolCallSyntax::Json, text::ToolCallSyntax::Xml}) {
    auto grammar = text::JsonGrammar::tool_calls(tools, syntax);
    for (int seed = 0; seed < 3; ++seed) {
      engine::GenerationParams p = greedy(t.prompt, 160);
      if (seed > 0) {
        p.sampling.temperature = 1.0f;
        p.sampling.seed = static_cast<uint64_t>(seed);
        p.sampling.has_seed = true;
      }
      p.sampling.logit_bias = {{*open, 100.0f}};
      p.tool_grammar = grammar;
      Collected c = run(g, p);
      SCOPED_TRACE(c.text);
      // Split at the openings: every piece but the last (cut by max_tokens)
      // is one complete call.
      std::vector<std::string> calls;
      for (size_t at = c.text.find("<tool_call>"); at != std::string::npos;) {
        const size_t next = c.text.find("<tool_call>", at + 1);
        calls.push_back(c.text.substr(at + 11, next == std::string::npos ? std::string::npos : next - at - 11));
        at = next;
      }
      ASSERT_GE(calls.size(), 3u);
      EXPECT_EQ(c.text.substr(0, 11), "<tool_call>");
      for (size_t i = 0; i < calls.size(); ++i) {
        text::JsonMatcher m(grammar);
        EXPECT_TRUE(m.feed(calls[i])) << calls[i];
        if (i + 1 < calls.size()) EXPECT_TRUE(m.released()) << calls[i];
      }
      // Without the constraint the same model writes no valid call.
      p.tool_grammar = nullptr;
      Collected free = run(g, p);
      bool any_valid = false;
      for (size_t at = free.text.find("<tool_call>"); at != std::string::npos; at = free.text.find("<tool_call>", at + 1)) {
        text::JsonMatcher m(grammar);
        const size_t next = free.text.find("<tool_call>", at + 1);
        any_valid = any_valid || (m.feed(free.text.substr(at + 11, next == std::string::npos ? std::string::npos : next - at - 11)) &&
                                  m.released());
      }
      EXPECT_FALSE(any_valid) << free.text;
    }
    // Forced: the prompt ends inside a call; the reply completes it, then
    // (no bias) is free.
    engine::GenerationParams f = greedy(t.prompt, 120);
    f.tool_grammar = grammar;
    f.tool_forced = true;
    f.tool_prefix = syntax == text::ToolCallSyntax::Json ? "\n{\"name\": \"" : "\n<function=";
    Collected c = run(g, f);
    text::JsonMatcher m(grammar);
    EXPECT_TRUE(m.feed(f.tool_prefix + c.text.substr(0, c.text.find("<tool_call>")))) << c.text;
    EXPECT_TRUE(m.released()) << c.text;
  }
}

TEST(ServerEngine, GeneratorStopsAndCancels) {
  Tiny& t = tiny();
  engine::Generator g(*t.model.backend, *t.model.tokenizer, 64);
  // Stop string in the middle of the reference text.
  engine::GenerationParams p = greedy(t.prompt, 24);
  p.stop_strings = {"DAYS"};
  Collected s = run(g, p);
  EXPECT_EQ(s.result.finish, engine::FinishReason::Stop);
  EXPECT_EQ(s.result.matched_stop, "DAYS");
  EXPECT_EQ(s.text, t.reference_text.substr(0, t.reference_text.find("DAYS")));
  EXPECT_EQ(s.result.completion_tokens, 4);

  // Stop token: the reference's 5th token.
  p = greedy(t.prompt, 24);
  p.stop_token_ids = {t.reference[4]};
  Collected st = run(g, p);
  EXPECT_EQ(st.result.stop_token, t.reference[4]);
  EXPECT_EQ(st.result.completion_tokens, 5);
  EXPECT_EQ(st.ids.size(), 5u);

  // The callback cancels; the flag cancels.
  Collected cb = run(g, greedy(t.prompt, 24), nullptr, 3);
  EXPECT_EQ(cb.result.finish, engine::FinishReason::Cancelled);
  EXPECT_EQ(cb.result.completion_tokens, 3);
  std::atomic<bool> cancel{true};
  Collected fl = run(g, greedy(t.prompt, 24), &cancel);
  EXPECT_EQ(fl.result.finish, engine::FinishReason::Cancelled);
  EXPECT_LE(fl.result.completion_tokens, 1);

  // The context bounds the output: 16 + 49 - 1 = 64.
  Collected len = run(g, greedy(t.prompt, 1000));
  EXPECT_EQ(len.result.finish, engine::FinishReason::Length);
  EXPECT_EQ(len.result.completion_tokens, 49);

  // Logprobs: greedy picks the top alternative.
  p = greedy(t.prompt, 3);
  p.top_logprobs = 2;
  g.generate(p, [&](engine::GenerationEvent&& e) {
    if (e.token) {
      EXPECT_EQ(e.token->top.size(), 2u);
      EXPECT_EQ(e.token->top[0].first, e.token->id);
      EXPECT_LE(e.token->logprob, 0.f);
    }
    return true;
  });

  // Invalid requests throw before emitting anything.
  EXPECT_THROW(g.generate(greedy({}, 4), [](engine::GenerationEvent&&) { return true; }),
               lily::Error);
  EXPECT_THROW(g.generate(greedy(std::vector<int>(65, 1), 4),
                          [](engine::GenerationEvent&&) { return true; }),
               lily::Error);
  EXPECT_THROW(g.generate(greedy({1, 999999}, 4), [](engine::GenerationEvent&&) { return true; }),
               lily::Error);
  // And the generator still works.
  EXPECT_EQ(run(g, greedy(t.prompt, 3)).ids,
            std::vector<int>(t.reference.begin(), t.reference.begin() + 3));
}

TEST(ServerEngine, SchedulerIsFifoAndCancelsSlowReaders) {
  Tiny& t = tiny();
  engine::Generator g(*t.model.backend, *t.model.tokenizer, 256);
  Metrics metrics;
  Scheduler sched(g, metrics, 8);

  // A reader that never reads, with a tiny buffer: cancelled, engine moves on.
  auto slow = std::make_shared<Job>(greedy(t.prompt, 200), 4);
  auto next = std::make_shared<Job>(greedy(t.prompt, 3), 64);
  ASSERT_TRUE(sched.submit(slow));
  ASSERT_TRUE(sched.submit(next));
  std::vector<JobEvent> got;
  auto wait_done = [](Job& j, std::vector<JobEvent>& out) {
    for (int i = 0; i < 400; ++i) {
      j.events.pop_all(out, std::chrono::milliseconds(50));
      if (!out.empty() && out.back().kind != JobEvent::Kind::Token) return true;
    }
    return false;
  };
  ASSERT_TRUE(wait_done(*next, got));
  EXPECT_EQ(got.back().kind, JobEvent::Kind::Done);
  EXPECT_EQ(got.size(), 4u);  // 3 tokens + done
  EXPECT_TRUE(slow->cancel.load());
  EXPECT_TRUE(slow->events.overflowed());
  std::vector<JobEvent> slow_events;
  ASSERT_TRUE(wait_done(*slow, slow_events));
  EXPECT_EQ(slow_events.back().result.finish, engine::FinishReason::Cancelled);
  EXPECT_LE(slow_events.back().result.completion_tokens, 5);

  // A closed queue (client gone) cancels too.
  auto gone = std::make_shared<Job>(greedy(t.prompt, 200), 64);
  gone->events.close();
  ASSERT_TRUE(sched.submit(gone));
  auto after = std::make_shared<Job>(greedy(t.prompt, 2), 64);
  ASSERT_TRUE(sched.submit(after));
  got.clear();
  ASSERT_TRUE(wait_done(*after, got));
  EXPECT_TRUE(gone->cancel.load());

  // Engine errors come back as an Error event.
  auto bad = std::make_shared<Job>(greedy({1, 999999}, 2), 64);
  ASSERT_TRUE(sched.submit(bad));
  got.clear();
  ASSERT_TRUE(wait_done(*bad, got));
  EXPECT_EQ(got.back().kind, JobEvent::Kind::Error);
  EXPECT_EQ(got.back().error_status, 400);

  // Queue bound, then shutdown: queued jobs get their final event.
  std::vector<std::shared_ptr<Job>> jobs;  // the accepted ones
  size_t accepted = 0;
  for (int i = 0; i < 20; ++i) {
    auto j = std::make_shared<Job>(greedy(t.prompt, 50), 1024);
    if (sched.submit(j)) {
      ++accepted;
      jobs.push_back(j);
    }
  }
  EXPECT_LT(accepted, 20u);
  EXPECT_GE(accepted, 8u);
  sched.shutdown();
  EXPECT_FALSE(sched.submit(std::make_shared<Job>(greedy(t.prompt, 1), 4)));
  size_t finals = 0;
  for (const auto& j : jobs) {
    std::vector<JobEvent> out;
    j->events.pop_all(out, std::chrono::milliseconds(1));
    finals += !out.empty() && out.back().kind == JobEvent::Kind::Done;
  }
  EXPECT_EQ(finals, accepted);
  EXPECT_EQ(metrics.queue_depth.load(), 0);
}

// ---------------------------------------------------------------- HTTP

TEST(ServerHttp, ServesErrorsAndCompletions) {
  Tiny& t = tiny();
  ServerOptions o;
  o.port = 0;
  o.api_key = "sekret";
  o.max_body_bytes = 4096;
  o.limits.context = 64;
  o.limits.max_tokens_limit = 32;
  o.log_requests = false;
  o.http_threads = 8;
  Server srv(t.model, o);
  const int port = srv.bind();
  std::thread th([&] { srv.run(); });

  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(30, 0);
  httplib::Headers auth = {{"Authorization", "Bearer sekret"}};
  const std::string good =
      R"({"model": "qwen3-chat-tiny", "messages": [{"role": "user", "content": "Write a haiku about the sea."}],
          "temperature": 0, "max_tokens": 24})";
  auto check_error = [](const httplib::Result& r, int status, const char* code) {
    ASSERT_TRUE(r) << "no response";
    EXPECT_EQ(r->status, status) << r->body;
    ojson b = ojson::parse(r->body, nullptr, false);
    ASSERT_TRUE(b.is_object()) << r->body;
    ASSERT_TRUE(b["error"].is_object()) << r->body;
    EXPECT_TRUE(b["error"]["message"].is_string());
    EXPECT_TRUE(b["error"]["type"].is_string());
    EXPECT_TRUE(b["error"].contains("param"));
    if (code) {
      EXPECT_EQ(b["error"]["code"], code) << r->body;
    }
  };

  check_error(cli.Post("/v1/chat/completions", good, "application/json"), 401, "missing_api_key");
  check_error(cli.Post("/v1/chat/completions", httplib::Headers{{"Authorization", "Bearer nope"}},
                       good, "application/json"),
              401, "invalid_api_key");
  check_error(cli.Get("/v1/models"), 401, "missing_api_key");
  check_error(cli.Get("/v1/nothing", auth), 404, "unknown_url");
  check_error(cli.Get("/v1/models/other", auth), 404, "model_not_found");
  check_error(cli.Post("/v1/chat/completions", auth, std::string(5000, ' '), "application/json"),
              413, "request_too_large");
  check_error(cli.Post("/v1/chat/completions", auth, "{oops", "application/json"), 400,
              "invalid_json");
  std::string many_words;
  for (int i = 0; i < 100; ++i) many_words += " a";
  check_error(cli.Post("/v1/chat/completions", auth,
                       R"({"messages": [{"role": "user", "content": ")" + many_words + R"("}]})",
                       "application/json"),
              400, "context_length_exceeded");
  check_error(cli.Post("/v1/completions", auth, R"({"prompt": [1, 2], "max_tokens": 64})",
                       "application/json"),
              400, "invalid_value");

  auto ok = cli.Post("/v1/chat/completions", auth, good, "application/json");
  ASSERT_TRUE(ok);
  ASSERT_EQ(ok->status, 200) << ok->body;
  ojson body = ojson::parse(ok->body);
  EXPECT_EQ(body["choices"][0]["message"]["content"], t.reference_text);
  EXPECT_EQ(body["usage"]["prompt_tokens"], 16);
  EXPECT_EQ(body["usage"]["completion_tokens"], 24);

  // Streaming through the same server.
  std::string sse;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.headers = auth;
  req.set_header("Content-Type", "application/json");
  ojson sreq = ojson::parse(good);
  sreq["stream"] = true;
  sreq["stream_options"] = {{"include_usage", true}};
  req.body = sreq.dump();
  req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
    sse.append(d, n);
    return true;
  };
  auto sr = cli.send(req);
  ASSERT_TRUE(sr);
  EXPECT_EQ(sr->status, 200);
  EXPECT_EQ(sr->get_header_value("Content-Type"), "text/event-stream");
  StreamedChat st = collect_chat(sse);
  EXPECT_EQ(st.content, t.reference_text);
  EXPECT_EQ(st.finish, "length");
  EXPECT_EQ(st.usage["completion_tokens"], 24);
  EXPECT_TRUE(st.done);

  auto health = cli.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto metrics = cli.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(
      metrics->body.find("lily_requests_total{route=\"/v1/chat/completions\",status=\"401\"} 2"),
      std::string::npos)
      << metrics->body;

  srv.stop();
  th.join();
}

// A server drafting by prompt lookup answers as the engine does without
// drafts: the reference reply, and a reply whose logit_bias makes the tiny
// model loop (where drafts are found and taken), streamed and not; /metrics
// counts the drafts.
TEST(ServerHttp, SpeculativeServerAnswersAsWithoutDrafts) {
  Tiny& t = tiny();
  ServerOptions o;
  o.port = 0;
  o.limits.context = 256;
  o.log_requests = false;
  o.speculative_tokens = 6;
  Server srv(t.model, o);
  const int port = srv.bind();
  std::thread th([&] { srv.run(); });
  struct Stop {
    Server& srv;
    std::thread& th;
    ~Stop() {
      srv.stop();
      th.join();
    }
  } stop{srv, th};
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(30, 0);

  const std::string good =
      R"({"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "temperature": 0, "max_tokens": 24})";
  auto ok = cli.Post("/v1/chat/completions", good, "application/json");
  ASSERT_TRUE(ok);
  ASSERT_EQ(ok->status, 200) << ok->body;
  EXPECT_EQ(ojson::parse(ok->body)["choices"][0]["message"]["content"], t.reference_text);

  // Tokens of " the sea." favoured: the reply loops over them.
  std::vector<int> favour = t.model.tokenizer->encode(" the sea.", false);
  std::sort(favour.begin(), favour.end());
  favour.erase(std::unique(favour.begin(), favour.end()), favour.end());
  ojson loop = ojson::parse(R"({"prompt": "the sea, the sea. the sea", "temperature": 0, "max_tokens": 48})");
  for (int id : favour) loop["logit_bias"][std::to_string(id)] = 4;
  engine::Generator plain(*t.model.backend, *t.model.tokenizer, 256);
  engine::GenerationParams p = greedy(t.model.tokenizer->encode("the sea, the sea. the sea", false), 48);
  for (int id : favour) p.sampling.logit_bias.push_back({id, 4.f});
  const Collected want = run(plain, p);
  auto r = cli.Post("/v1/completions", loop.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(ojson::parse(r->body)["choices"][0]["text"], want.text);
  loop["stream"] = true;
  std::string sse;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.set_header("Content-Type", "application/json");
  req.body = loop.dump();
  req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
    sse.append(d, n);
    return true;
  };
  auto sr = cli.send(req);
  ASSERT_TRUE(sr);
  std::string streamed;
  for (const std::string& payload : sse_payloads(sse)) {
    if (payload == "[DONE]") continue;
    ojson c = ojson::parse(payload);
    if (!c["choices"].empty()) streamed += c["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(streamed, want.text);

  auto metrics = cli.Get("/metrics");
  ASSERT_TRUE(metrics);
  const std::string& m = metrics->body;
  auto value = [&](const std::string& name) {
    const size_t at = m.find("\n" + name + " ");
    return at == std::string::npos ? -1.0 : std::stod(m.substr(at + name.size() + 2));
  };
  EXPECT_GT(value("lily_draft_tokens_total"), 0) << m;
  EXPECT_GT(value("lily_draft_accepted_tokens_total"), 0) << m;
  EXPECT_LE(value("lily_draft_accepted_tokens_total"), value("lily_draft_tokens_total"));
}

}  // namespace
}  // namespace lily::server
