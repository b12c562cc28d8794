// The OpenAI-compatible request surface: error bodies, and the parsing and
// validation of /v1/chat/completions and /v1/completions bodies into typed
// requests. Pure functions (no model, no I/O), so they are unit-tested
// directly. Every problem with a request is an ApiError carrying the HTTP
// status and OpenAI's error fields.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "engine/sampler.h"
#include "text/chat_template.h"
#include "text/json_constraint.h"

namespace lily::server {

using ojson = nlohmann::ordered_json;

// For dump(): bytes that are not UTF-8 (never expected) become U+FFFD rather
// than an exception.
inline constexpr auto kReplaceInvalidUtf8 = ojson::error_handler_t::replace;

class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string type, const std::string& message, std::string param = "",
           std::string code = "")
      : std::runtime_error(message),
        status(status),
        type(std::move(type)),
        param(std::move(param)),
        code(std::move(code)) {}
  int status;
  std::string type, param, code;
};

// 400 invalid_request_error.
ApiError bad_request(const std::string& message, const std::string& param = "",
                     const std::string& code = "");
// The OpenAI error type for a status: 400/413/422 invalid_request_error, 401
// authentication_error, 403 permission_error, 404 not_found_error, 429/503
// rate_limit_error / server_overloaded, 500 server_error.
std::string error_type_for_status(int status);
// {"error": {"message", "type", "param", "code"}}; empty param / code are null.
ojson error_body(int status, const std::string& message, const std::string& param = "",
                 const std::string& code = "", const std::string& type = "");
ojson error_body(const ApiError& e);

struct Limits {
  int context = 4096;           // sequence capacity: prompt + completion
  int max_tokens_limit = 4096;  // largest max_tokens a request may ask for
  int max_stop_strings = 16;
  int max_top_logprobs = 20;
  int max_n = 16;  // choices per request ("n")
  int vocab_size = 0;  // logit_bias ids must be below it (0: not checked here)
};

// Parameters shared by chat and completions.
struct CommonParams {
  engine::SamplingParams sampling;
  std::optional<int> max_tokens;
  int n = 1;  // choices, generated one after another (the prompt is prefilled once)
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;
  std::string model;
  std::string user;
};

enum class ToolChoice { Auto, None, Required, Named };

struct ChatRequest {
  CommonParams common;
  // Messages, tools and chat_template_kwargs mapped for the chat template
  // (text::from_openai_request). tools is null when absent, empty, or
  // tool_choice is "none"; template_kwargs.enable_thinking is set from
  // reasoning_effort unless chat_template_kwargs sets it.
  text::ChatInputs inputs;
  ToolChoice tool_choice = ToolChoice::Auto;
  std::string tool_name;  // ToolChoice::Named
  bool parallel_tool_calls = true;
  std::optional<bool> enable_thinking;  // from chat_template_kwargs / reasoning_effort
  bool json_object = false;             // response_format {"type": "json_object"}
  // response_format {"type": "json_schema"}: the schema, compiled.
  std::shared_ptr<const text::JsonGrammar> json_schema;
  bool logprobs = false;
  int top_logprobs = 0;
  std::string prompt_cache_key;
};

struct CompletionRequest {
  CommonParams common;
  bool prompt_is_tokens = false;
  std::string prompt_text;
  std::vector<int> prompt_tokens;
  bool echo = false;
  int logprobs = -1;  // legacy: -1 off, else 0..5 alternatives
};

// Parses the body text as a JSON object (400 on anything else).
ojson parse_json_body(std::string_view body);

// `defaults`: the sampling values used for parameters the request leaves out
// (the model's generation_config.json).
ChatRequest parse_chat_request(const ojson& body, const engine::SamplingParams& defaults,
                               const Limits& limits);
CompletionRequest parse_completion_request(const ojson& body,
                                           const engine::SamplingParams& defaults,
                                           const Limits& limits);

// The max_tokens a request gets once its prompt length is known: the one it
// asked for, or what is left of the context (capped by max_tokens_limit).
// 400 context_length_exceeded when the prompt leaves no room or prompt +
// max_tokens exceeds the context.
// `prompt_param` names the prompt in the error ("messages" or "prompt").
int resolve_max_tokens(const std::optional<int>& requested, int prompt_tokens, const Limits& limits,
                       const std::string& prompt_param = "messages");

}  // namespace lily::server
