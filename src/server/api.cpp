#include "server/api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "core/error.h"
#include "text/chat_template.h"

namespace lily::server {

namespace {

const char* json_type_name(const ojson& v) {
  switch (v.type()) {
    case ojson::value_t::null:
      return "null";
    case ojson::value_t::boolean:
      return "a boolean";
    case ojson::value_t::string:
      return "a string";
    case ojson::value_t::array:
      return "an array";
    case ojson::value_t::object:
      return "an object";
    case ojson::value_t::number_integer:
    case ojson::value_t::number_unsigned:
      return "an integer";
    case ojson::value_t::number_float:
      return "a decimal";
    default:
      return "an unsupported value";
  }
}

ApiError invalid_type(const std::string& param, const char* expected, const ojson& got) {
  return bad_request(str_cat("Invalid type for '", param, "': expected ", expected, ", but got ",
                             json_type_name(got), " instead."),
                     param, "invalid_type");
}

ApiError invalid_value(const std::string& param, const std::string& what) {
  return bad_request(str_cat("Invalid value for '", param, "': ", what), param, "invalid_value");
}

// The value of `key`, or nullptr when absent or null (OpenAI treats an
// explicit null as "not given").
const ojson* field(const ojson& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

// lo_open: lo itself is out of range too.
std::optional<double> get_number(const ojson& obj, const char* key, double lo, double hi, bool lo_open = false) {
  const ojson* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) throw invalid_type(key, "a number", *v);
  double d = v->get<double>();
  if (!std::isfinite(d) || d < lo || (lo_open && d == lo) || d > hi)
    throw invalid_value(key, str_cat("expected a value in ", lo_open ? "(" : "[", lo, ", ", hi, "], but got ",
                                     v->dump(), "."));
  return d;
}

bool is_integral(const ojson& v) {
  if (v.is_number_integer() || v.is_number_unsigned()) return true;
  if (v.is_number_float()) {
    double d = v.get<double>();
    return std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15;
  }
  return false;
}

std::optional<long long> get_integer(const ojson& obj, const char* key, long long lo,
                                     long long hi) {
  const ojson* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!is_integral(*v)) throw invalid_type(key, "an integer", *v);
  long long x;
  if (v->is_number_unsigned()) {
    auto u = v->get<unsigned long long>();
    x = u > static_cast<unsigned long long>(std::numeric_limits<long long>::max())
            ? std::numeric_limits<long long>::max()
            : static_cast<long long>(u);
  } else if (v->is_number_float()) {
    x = static_cast<long long>(v->get<double>());
  } else {
    x = v->get<long long>();
  }
  if (x < lo || x > hi)
    throw invalid_value(key,
                        str_cat("expected an integer in [", lo, ", ", hi, "], but got ", x, "."));
  return x;
}

std::optional<bool> get_bool(const ojson& obj, const char* key) {
  const ojson* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) throw invalid_type(key, "a boolean", *v);
  return v->get<bool>();
}

std::optional<std::string> get_string(const ojson& obj, const char* key) {
  const ojson* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) throw invalid_type(key, "a string", *v);
  return v->get<std::string>();
}

void parse_common(const ojson& body, const engine::SamplingParams& defaults, const Limits& limits,
                  CommonParams& c) {
  c.model = get_string(body, "model").value_or("");
  c.user = get_string(body, "user").value_or("");

  if (auto n = get_integer(body, "n", 1, limits.max_n)) c.n = static_cast<int>(*n);

  engine::SamplingParams& s = c.sampling;
  s = defaults;
  if (auto v = get_number(body, "temperature", 0, 2)) s.temperature = static_cast<float>(*v);
  if (auto v = get_number(body, "top_p", 0, 1, true)) s.top_p = static_cast<float>(*v);
  if (auto v = get_integer(body, "top_k", -1, std::numeric_limits<int>::max()))
    s.top_k = *v < 0 ? 0 : static_cast<int>(*v);
  if (auto v = get_number(body, "min_p", 0, 1)) s.min_p = static_cast<float>(*v);
  if (auto v = get_number(body, "presence_penalty", -2, 2))
    s.presence_penalty = static_cast<float>(*v);
  if (auto v = get_number(body, "frequency_penalty", -2, 2))
    s.frequency_penalty = static_cast<float>(*v);
  if (auto v = get_number(body, "repetition_penalty", 0, 1e6)) {
    if (*v <= 0) throw invalid_value("repetition_penalty", "expected a value > 0, but got 0.");
    s.repetition_penalty = static_cast<float>(*v);
  }
  if (auto v = get_integer(body, "seed", std::numeric_limits<long long>::min(),
                           std::numeric_limits<long long>::max())) {
    s.seed = static_cast<uint64_t>(*v);
    s.has_seed = true;
  }
  if (const ojson* lb = field(body, "logit_bias")) {
    if (!lb->is_object()) throw invalid_type("logit_bias", "an object", *lb);
    for (const auto& [key, value] : lb->items()) {
      // Keys are token ids in decimal ("50256"), values numbers in [-100, 100].
      long long id = -1;
      const bool digits = !key.empty() && key.size() <= 10 &&
                          std::all_of(key.begin(), key.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
      if (digits) id = std::stoll(key);
      if (!digits || (limits.vocab_size > 0 && id >= limits.vocab_size))
        throw invalid_value("logit_bias",
                            str_cat("keys must be token ids",
                                    limits.vocab_size > 0 ? str_cat(" in [0, ", limits.vocab_size, ")") : "",
                                    ", got '", key, "'."));
      if (!value.is_number() || !(value.get<double>() >= -100 && value.get<double>() <= 100))
        throw invalid_value("logit_bias", str_cat("the bias of token ", key, " must be a number in [-100, 100], got ",
                                                  value.dump(), "."));
      if (value.get<double>() != 0) s.logit_bias.emplace_back(static_cast<int>(id), value.get<float>());
    }
  }
  if (auto err = s.validation_error())
    throw bad_request(*err, err->rfind("logit_bias", 0) == 0 ? "logit_bias" : "", "invalid_value");

  std::optional<long long> mt =
      get_integer(body, "max_completion_tokens", 1, limits.max_tokens_limit);
  if (!mt) mt = get_integer(body, "max_tokens", 1, limits.max_tokens_limit);
  if (mt) c.max_tokens = static_cast<int>(*mt);

  if (const ojson* stop = field(body, "stop")) {
    if (stop->is_string()) {
      c.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (static_cast<int>(stop->size()) > limits.max_stop_strings)
        throw invalid_value("stop",
                            str_cat("at most ", limits.max_stop_strings,
                                    " stop sequences are allowed, got ", stop->size(), "."));
      for (const auto& s2 : *stop) {
        if (!s2.is_string()) throw invalid_type("stop", "a string or an array of strings", s2);
        c.stop.push_back(s2.get<std::string>());
      }
    } else {
      throw invalid_type("stop", "a string or an array of strings", *stop);
    }
    for (const auto& s2 : c.stop)
      if (s2.empty()) throw invalid_value("stop", "stop sequences must not be empty.");
  }

  c.stream = get_bool(body, "stream").value_or(false);
  if (const ojson* so = field(body, "stream_options")) {
    if (!so->is_object()) throw invalid_type("stream_options", "an object", *so);
    if (!c.stream)
      throw bad_request("Invalid value for 'stream_options': only allowed when 'stream' is true.",
                        "stream_options", "invalid_value");
    c.include_usage = get_bool(*so, "include_usage").value_or(false);
  }

}

// Maps a lily::Error from text::from_openai_request ("invalid chat request:
// PATH: what") to a 400 naming PATH.
ApiError chat_input_error(const std::string& what) {
  static const std::string prefix = "invalid chat request: ";
  std::string msg = what, param;
  if (msg.rfind(prefix, 0) == 0) {
    msg = msg.substr(prefix.size());
    if (auto colon = msg.find(": "); colon != std::string::npos) param = msg.substr(0, colon);
  }
  const bool missing = msg.size() >= 9 && msg.compare(msg.size() - 9, 9, ": missing") == 0;
  return bad_request("Invalid chat request: " + msg, param,
                     missing ? "missing_required_parameter" : "invalid_value");
}

}  // namespace

ApiError bad_request(const std::string& message, const std::string& param,
                     const std::string& code) {
  return ApiError(400, "invalid_request_error", message, param, code);
}

std::string error_type_for_status(int status) {
  switch (status) {
    case 400:
    case 413:
    case 422:
      return "invalid_request_error";
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 429:
      return "rate_limit_error";
    case 503:
      return "server_overloaded";
    default:
      return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

ojson error_body(int status, const std::string& message, const std::string& param,
                 const std::string& code, const std::string& type) {
  ojson e;
  e["message"] = message;
  e["type"] = type.empty() ? error_type_for_status(status) : type;
  e["param"] = param.empty() ? ojson(nullptr) : ojson(param);
  e["code"] = code.empty() ? ojson(nullptr) : ojson(code);
  return {{"error", e}};
}

ojson error_body(const ApiError& e) {
  return error_body(e.status, e.what(), e.param, e.code, e.type);
}

ojson parse_json_body(std::string_view body) {
  ojson j = ojson::parse(body.begin(), body.end(), nullptr, false);
  if (j.is_discarded())
    throw bad_request(
        "We could not parse the JSON body of your request. The body must be valid JSON.", "",
        "invalid_json");
  if (!j.is_object())
    throw bad_request(
        str_cat("The request body must be a JSON object, got ", json_type_name(j), "."), "",
        "invalid_json");
  return j;
}

ChatRequest parse_chat_request(const ojson& body, const engine::SamplingParams& defaults,
                               const Limits& limits) {
  ChatRequest r;
  try {
    r.inputs = text::from_openai_request(body);
  } catch (const lily::Error& e) {
    throw chat_input_error(e.what());
  }
  if (r.inputs.tools.is_array() && r.inputs.tools.empty()) r.inputs.tools = nullptr;
  parse_common(body, defaults, limits, r.common);

  r.logprobs = get_bool(body, "logprobs").value_or(false);
  if (auto tl = get_integer(body, "top_logprobs", 0, limits.max_top_logprobs)) {
    if (!r.logprobs)
      throw bad_request("Invalid value for 'top_logprobs': 'logprobs' must be true to use it.",
                        "top_logprobs", "invalid_value");
    r.top_logprobs = static_cast<int>(*tl);
  }

  if (const ojson* tc = field(body, "tool_choice")) {
    if (tc->is_string()) {
      const std::string s = tc->get<std::string>();
      if (s == "auto")
        r.tool_choice = ToolChoice::Auto;
      else if (s == "none")
        r.tool_choice = ToolChoice::None;
      else if (s == "required")
        r.tool_choice = ToolChoice::Required;
      else
        throw invalid_value("tool_choice",
                            str_cat("'", s,
                                    "'. Supported values are: 'none', 'auto', 'required' "
                                    "or {\"type\": \"function\", \"function\": {\"name\": ...}}."));
    } else if (tc->is_object()) {
      const ojson* fn = field(*tc, "function");
      auto name = fn && fn->is_object() ? get_string(*fn, "name") : std::nullopt;
      if (!name)
        throw bad_request("Missing required parameter: 'tool_choice.function.name'.",
                          "tool_choice.function.name", "missing_required_parameter");
      r.tool_choice = ToolChoice::Named;
      r.tool_name = *name;
    } else {
      throw invalid_type("tool_choice", "a string or an object", *tc);
    }
  }
  if ((r.tool_choice == ToolChoice::Required || r.tool_choice == ToolChoice::Named) &&
      r.inputs.tools.is_null())
    throw bad_request(
        "Invalid value for 'tool_choice': 'tools' must be given (and not empty) "
        "when tool_choice is 'required' or names a function.",
        "tool_choice", "invalid_value");
  if (r.tool_choice == ToolChoice::Named) {
    bool found = false;
    for (const auto& t : r.inputs.tools) found = found || t["function"]["name"] == r.tool_name;
    if (!found)
      throw bad_request(
          str_cat("Invalid value for 'tool_choice': no tool named '", r.tool_name, "' in 'tools'."),
          "tool_choice", "invalid_value");
  }
  r.parallel_tool_calls = get_bool(body, "parallel_tool_calls").value_or(true);

  if (auto effort = get_string(body, "reasoning_effort")) {
    static const std::set<std::string> efforts = {"none", "minimal", "low", "medium", "high"};
    if (!efforts.count(*effort))
      throw invalid_value("reasoning_effort", str_cat("'", *effort,
                                                      "'. Supported values are: 'none', 'minimal', "
                                                      "'low', 'medium' and 'high'."));
    r.enable_thinking = !(*effort == "none" || *effort == "minimal");
  }
  ojson& kw = r.inputs.template_kwargs;
  if (auto it = kw.find("enable_thinking"); it != kw.end() && !it->is_null()) {
    if (!it->is_boolean())
      throw invalid_type("chat_template_kwargs.enable_thinking", "a boolean", *it);
    r.enable_thinking = it->get<bool>();
  } else if (r.enable_thinking) {
    kw["enable_thinking"] = *r.enable_thinking;
  }
  if (r.tool_choice == ToolChoice::None) r.inputs.tools = nullptr;

  if (const ojson* rf = field(body, "response_format")) {
    if (!rf->is_object()) throw invalid_type("response_format", "an object", *rf);
    auto type = get_string(*rf, "type");
    if (!type)
      throw bad_request("Missing required parameter: 'response_format.type'.",
                        "response_format.type", "missing_required_parameter");
    if (*type == "json_object") {
      r.json_object = true;
    } else if (*type == "json_schema") {
      const ojson* js = field(*rf, "json_schema");
      if (!js)
        throw bad_request("Missing required parameter: 'response_format.json_schema'.",
                          "response_format.json_schema", "missing_required_parameter");
      if (!js->is_object()) throw invalid_type("response_format.json_schema", "an object", *js);
      const auto name = get_string(*js, "name");
      if (!name)
        throw bad_request("Missing required parameter: 'response_format.json_schema.name'.",
                          "response_format.json_schema.name", "missing_required_parameter");
      get_bool(*js, "strict");  // accepted; lily always constrains to the schema
      const ojson* schema = field(*js, "schema");
      try {
        r.json_schema = schema ? text::JsonGrammar::from_schema(*schema) : text::JsonGrammar::from_schema(ojson::object());
      } catch (const lily::Error& e) {
        throw invalid_value("response_format.json_schema.schema", e.what());
      }
    } else if (*type != "text") {
      throw bad_request(str_cat("Invalid value for 'response_format.type': '", *type,
                                "' is not supported; lily supports 'text', 'json_object' and 'json_schema'."),
                        "response_format.type", "unsupported_value");
    }
  }
  r.prompt_cache_key = get_string(body, "prompt_cache_key").value_or("");
  return r;
}

CompletionRequest parse_completion_request(const ojson& body,
                                           const engine::SamplingParams& defaults,
                                           const Limits& limits) {
  CompletionRequest r;
  const ojson* p = field(body, "prompt");
  if (!p)
    throw bad_request("Missing required parameter: 'prompt'.", "prompt",
                      "missing_required_parameter");
  auto token_list = [&](const ojson& arr) {
    std::vector<int> ids;
    for (const auto& t : arr) {
      if (!is_integral(t) || t.get<double>() < 0 ||
          t.get<double>() > std::numeric_limits<int>::max())
        throw invalid_type("prompt", "a string, an array of token ids or an array of one string",
                           t);
      ids.push_back(static_cast<int>(t.get<long long>()));
    }
    return ids;
  };
  const ojson* single = p;
  if (p->is_array() && !p->empty() && (p->front().is_string() || p->front().is_array())) {
    if (p->size() != 1)
      throw bad_request(
          "Invalid value for 'prompt': lily completes one prompt per request; "
          "send one string or one list of token ids.",
          "prompt", "unsupported_value");
    single = &p->front();
  }
  if (single->is_string()) {
    r.prompt_text = single->get<std::string>();
    if (r.prompt_text.empty()) throw invalid_value("prompt", "the prompt must not be empty.");
  } else if (single->is_array()) {
    r.prompt_is_tokens = true;
    r.prompt_tokens = token_list(*single);
    if (r.prompt_tokens.empty()) throw invalid_value("prompt", "the prompt must not be empty.");
  } else {
    throw invalid_type("prompt", "a string or an array of token ids", *single);
  }
  parse_common(body, defaults, limits, r.common);
  r.echo = get_bool(body, "echo").value_or(false);
  if (auto lp = get_integer(body, "logprobs", 0, 5)) r.logprobs = static_cast<int>(*lp);
  if (auto bo = get_integer(body, "best_of", 1, std::numeric_limits<int>::max()); bo && *bo != 1)
    throw bad_request("Invalid value for 'best_of': only 1 is supported.", "best_of",
                      "unsupported_value");
  if (auto sfx = get_string(body, "suffix"); sfx && !sfx->empty())
    throw bad_request("'suffix' is not supported by lily.", "suffix", "unsupported_parameter");
  return r;
}

int resolve_max_tokens(const std::optional<int>& requested, int prompt_tokens, const Limits& limits,
                       const std::string& prompt_param) {
  const int room = limits.context - prompt_tokens;
  if (room < 1)
    throw bad_request(str_cat("This model's maximum context length is ", limits.context,
                              " tokens. However, your prompt is ", prompt_tokens,
                              " tokens, which leaves no room for a completion. Please reduce "
                              "the length of the prompt."),
                      prompt_param, "context_length_exceeded");
  if (requested) {
    if (prompt_tokens + *requested > limits.context)
      throw bad_request(str_cat("This model's maximum context length is ", limits.context,
                                " tokens. However, you requested ", prompt_tokens + *requested,
                                " tokens (", prompt_tokens, " in the prompt, ", *requested,
                                " for the completion). Please reduce the length of the prompt "
                                "or max_tokens."),
                        "max_tokens", "context_length_exceeded");
    return *requested;
  }
  return std::min(room, limits.max_tokens_limit);
}

}  // namespace lily::server
