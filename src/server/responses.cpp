#include "server/responses.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "core/error.h"
#include "text/detokenizer.h"

namespace lily::server {

namespace {

double clean_logprob(float lp) {
  // JSON has no -inf; OpenAI reports -9999 for "impossible".
  if (!std::isfinite(lp)) return -9999.0;
  return std::max(static_cast<double>(lp), -9999.0);
}

bool contains(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

std::string error_event(int status, const std::string& message, const std::string& code) {
  return sse_data(error_body(status, message, "", code).dump(-1, ' ', false, kReplaceInvalidUtf8)) +
         sse_data("[DONE]");
}

ApiError engine_error(const JobEvent& e) {
  return ApiError(e.error_status, error_type_for_status(e.error_status), e.error, "",
                  e.error_status == 400 ? "invalid_value" : "engine_error");
}

ApiError cancelled_error(bool shutdown) {
  if (shutdown)
    return ApiError(503, error_type_for_status(503), "The server is shutting down.", "",
                    "server_shutting_down");
  return ApiError(503, error_type_for_status(503),
                  "The generation was cancelled: the server is shutting down or the client did "
                  "not read its stream in time.",
                  "", "cancelled");
}

}  // namespace

std::string make_response_id(const std::string& prefix) {
  static const char kAlnum[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 rng(
      std::random_device{}() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::string id = prefix;
  for (int i = 0; i < 24; ++i) id += kAlnum[rng() % (sizeof kAlnum - 1)];
  return id;
}

int64_t unix_time_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string sse_data(const std::string& payload) {
  return "data: " + payload + "\n\n";
}

// The fields every response object and chunk starts with.
ojson object_head(const std::string& id, const char* object, int64_t created, const std::string& model) {
  ojson o;
  o["id"] = id;
  o["object"] = object;
  o["created"] = created;
  o["model"] = model;
  return o;
}

ojson usage_json(const engine::GenerationResult& r) {
  ojson u;
  u["prompt_tokens"] = r.prompt_tokens;
  u["completion_tokens"] = r.completion_tokens;
  u["total_tokens"] = r.prompt_tokens + r.completion_tokens;
  u["prompt_tokens_details"] = {{"cached_tokens", r.cached_tokens}};
  return u;
}

ojson usage_json(const std::vector<engine::GenerationResult>& choices) {
  if (choices.empty()) return usage_json(engine::GenerationResult{});
  engine::GenerationResult sum = choices.front();  // the prompt counts once
  for (size_t i = 1; i < choices.size(); ++i) sum.completion_tokens += choices[i].completion_tokens;
  return usage_json(sum);
}

namespace {
std::string stream_end(const std::string& id, const char* object, int64_t created, const std::string& model,
                       bool include_usage, const ojson& usage) {
  std::string out;
  if (include_usage) {
    ojson u = object_head(id, object, created, model);
    u["choices"] = ojson::array();
    u["usage"] = usage;
    out += sse_data(u.dump(-1, ' ', false, kReplaceInvalidUtf8));
  }
  return out + sse_data("[DONE]");
}
}  // namespace

std::string ChatResponseBuilder::end_stream(const ojson& usage) const {
  return stream_end(s_.id, "chat.completion.chunk", s_.created, s_.model, s_.include_usage, usage);
}
std::string CompletionResponseBuilder::end_stream(const ojson& usage) const {
  return stream_end(s_.id, "text_completion", s_.created, s_.model, s_.include_usage, usage);
}

std::string token_text(const text::Tokenizer& tok, int id) {
  std::string out;
  text::append_utf8_lossy(tok.token_bytes(id), true, out);
  return out;
}

ojson token_bytes_json(const text::Tokenizer& tok, int id) {
  ojson b = ojson::array();
  for (unsigned char c : tok.token_bytes(id)) b.push_back(static_cast<int>(c));
  return b;
}

// ---------------------------------------------------------------- chat

std::string plan_chat_reply(const ChatRequest& cr, text::ToolDialect dialect,
                            const std::string& rendered_prompt, ChatSetup& setup) {
  setup.stream = cr.common.stream;
  setup.include_usage = cr.common.include_usage;
  setup.logprobs = cr.logprobs;
  setup.top_logprobs = cr.top_logprobs;
  setup.tool_choice = cr.tool_choice;
  setup.tool_name = cr.tool_name;
  setup.json_object = cr.json_object;
  setup.json_schema = cr.json_schema != nullptr;
  const bool tools_on = !cr.inputs.tools.is_null() && dialect != text::ToolDialect::None;
  const bool thinking = cr.enable_thinking.value_or(true);
  setup.parser.reasoning_enabled = thinking;
  setup.parser.starts_in_reasoning = thinking && text::prompt_opens_reasoning(rendered_prompt);
  setup.parser.tool_dialect = tools_on ? dialect : text::ToolDialect::None;
  if (tools_on) {
    setup.parser.tools =
        nlohmann::json::parse(cr.inputs.tools.dump(-1, ' ', false, kReplaceInvalidUtf8));
    if (!cr.parallel_tool_calls) setup.injected_stop = "</tool_call>";
  }
  if (!tools_on || (cr.tool_choice != ToolChoice::Required && cr.tool_choice != ToolChoice::Named))
    return "";
  // The reply is made to start with a tool call: its opening goes into the
  // prompt (any open reasoning is closed first).
  std::string forced;
  if (setup.parser.starts_in_reasoning) forced = "\n</think>\n\n";
  const bool named = cr.tool_choice == ToolChoice::Named;
  if (dialect == text::ToolDialect::Xml) {
    forced += named ? "<tool_call>\n<function=" + cr.tool_name + ">\n"
                    : std::string("<tool_call>\n<function=");
  } else {
    // No space after "arguments": so that a follow-up that renders the call
    // back into the history tokenizes the same up to here.
    forced += named ? "<tool_call>\n{\"name\": " +
                          ojson(cr.tool_name).dump(-1, ' ', false, kReplaceInvalidUtf8) +
                          ", \"arguments\":"
                    : std::string("<tool_call>\n{\"name\": \"");
  }
  setup.forced_prefix = forced;
  return forced;
}

// ------------------------------------------------------------------- shared

void ResponseBuilderBase::take_final(const JobEvent& e) {
  if (e.kind == JobEvent::Kind::Done) {
    result_ = e.result;
    queue_seconds_ = e.queue_seconds;
    if (result_.finish == engine::FinishReason::Cancelled) error_ = cancelled_error(e.shutdown);
  } else {
    error_ = engine_error(e);
  }
  done_ = true;
}

void ResponseBuilderBase::check_complete() const {
  if (error_) throw *error_;
  if (!done_) throw ApiError(500, "server_error", "internal: response not complete");
}

std::string ResponseBuilderBase::abort_stream(int status, const std::string& message,
                                              const std::string& code) {
  done_ = true;
  error_ = ApiError(status, error_type_for_status(status), message, "", code);
  return error_event(status, message, code);
}

ChatResponseBuilder::ChatResponseBuilder(ChatSetup setup, const text::Tokenizer& tokenizer)
    : s_(std::move(setup)), tok_(tokenizer), parser_(s_.parser) {}

ojson ChatResponseBuilder::chunk(ojson delta, const ojson& finish_reason,
                                 const ojson& logprobs) const {
  ojson c = object_head(s_.id, "chat.completion.chunk", s_.created, s_.model);
  ojson choice;
  choice["index"] = index_;
  choice["delta"] = std::move(delta);
  choice["logprobs"] = logprobs;
  choice["finish_reason"] = finish_reason;
  c["choices"] = ojson::array({std::move(choice)});
  if (s_.include_usage) c["usage"] = nullptr;
  return c;
}

ojson ChatResponseBuilder::logprob_entry(const engine::TokenInfo& t) const {
  ojson e;
  e["token"] = token_text(tok_, t.id);
  e["logprob"] = clean_logprob(t.logprob);
  e["bytes"] = token_bytes_json(tok_, t.id);
  ojson top = ojson::array();
  for (const auto& [id, lp] : t.top)
    top.push_back({{"token", token_text(tok_, id)},
                   {"logprob", clean_logprob(lp)},
                   {"bytes", token_bytes_json(tok_, id)}});
  e["top_logprobs"] = std::move(top);
  return e;
}

void ChatResponseBuilder::add_delta(ojson& delta, const text::Delta& d) {
  if (!d.reasoning.empty()) {
    auto& r = delta["reasoning_content"];
    r = (r.is_string() ? r.get<std::string>() : std::string()) + d.reasoning;
  }
  if (!d.content.empty()) {
    auto& c = delta["content"];
    c = (c.is_string() ? c.get<std::string>() : std::string()) + d.content;
  }
  if (!d.tool_calls.empty()) {
    ojson& calls = delta["tool_calls"];
    if (!calls.is_array()) calls = ojson::array();
    for (const auto& t : d.tool_calls) {
      ojson tc;
      tc["index"] = t.index;
      if (!t.id.empty()) {
        tc["id"] = t.id;
        tc["type"] = "function";
      }
      ojson fn = ojson::object();
      if (!t.name.empty()) fn["name"] = t.name;
      fn["arguments"] = t.arguments_fragment;
      tc["function"] = std::move(fn);
      calls.push_back(std::move(tc));
    }
  }
}

std::string ChatResponseBuilder::finish_reason() const {
  if (result_.finish == engine::FinishReason::Length) return "length";
  if (!parser_.result().tool_calls.empty()) return "tool_calls";
  return "stop";
}

std::optional<ApiError> ChatResponseBuilder::validate() const {
  if (result_.finish != engine::FinishReason::Stop) return std::nullopt;  // truncated: no checks
  const auto& out = parser_.result();
  if (s_.tool_choice == ToolChoice::Required || s_.tool_choice == ToolChoice::Named) {
    bool ok = !out.tool_calls.empty();
    if (s_.tool_choice == ToolChoice::Named)
      for (const auto& c : out.tool_calls) ok = ok && c.name == s_.tool_name;
    if (!ok) {
      ApiError e(400, "invalid_request_error",
                 s_.tool_choice == ToolChoice::Named
                     ? "The model's reply is not a call of the function '" + s_.tool_name +
                           "' that tool_choice requires."
                     : std::string("The model's reply contains no tool call, but tool_choice is "
                                   "'required'."),
                 "tool_choice", "tool_use_failed");
      return e;
    }
  }
  if ((s_.json_object || s_.json_schema) && out.tool_calls.empty()) {
    ojson j = ojson::parse(out.content, nullptr, false);
    if (j.is_discarded() || (s_.json_object && !j.is_object()))
      return ApiError(400, "invalid_request_error",
                      s_.json_object ? "The model's reply is not a JSON object, but response_format is 'json_object'."
                                     : "The model's reply is not JSON, but response_format is 'json_schema'.",
                      "response_format", "json_validate_failed");
  }
  return std::nullopt;
}

void ChatResponseBuilder::finish(std::string& out) {
  text::Delta d;
  if (!s_.injected_stop.empty() && result_.finish == engine::FinishReason::Stop &&
      result_.matched_stop == s_.injected_stop) {
    d = parser_.push(s_.injected_stop);
  }
  text::Delta tail = parser_.finish();
  d.reasoning += tail.reasoning;
  d.content += tail.content;
  d.tool_calls.insert(d.tool_calls.end(), tail.tool_calls.begin(), tail.tool_calls.end());
  if (!error_) error_ = validate();
  if (!s_.stream) return;
  if (!d.empty()) {
    ojson delta = ojson::object();
    add_delta(delta, d);
    out += sse_data(
        chunk(std::move(delta), nullptr, nullptr).dump(-1, ' ', false, kReplaceInvalidUtf8));
  }
  if (error_) {
    out += error_event(error_->status, error_->what(), error_->code);
    return;
  }
  out += sse_data(
      chunk(ojson::object(), finish_reason(), nullptr).dump(-1, ' ', false, kReplaceInvalidUtf8));
  if (stream_end_) out += end_stream(usage_json(result_));
}

std::string ChatResponseBuilder::feed(std::vector<JobEvent>& events) {
  std::string out;
  if (done_) return out;
  if (!started_) {
    started_ = true;
    text::Delta d;
    if (!s_.forced_prefix.empty()) d = parser_.push(s_.forced_prefix);
    if (s_.stream) {
      ojson delta = {{"role", "assistant"}, {"content", ""}};
      add_delta(delta, d);
      out += sse_data(
          chunk(std::move(delta), nullptr, nullptr).dump(-1, ' ', false, kReplaceInvalidUtf8));
    }
  }
  for (auto& e : events) {
    if (done_) break;
    if (e.kind == JobEvent::Kind::Token) {
      text::Delta d = parser_.push(e.gen.text);
      ojson lp_entries = ojson::array();
      if (s_.logprobs && e.gen.token && !contains(s_.stop_token_ids, e.gen.token->id)) {
        ojson entry = logprob_entry(*e.gen.token);
        logprobs_.push_back(entry);
        lp_entries.push_back(std::move(entry));
      }
      if (s_.stream && (!d.empty() || !lp_entries.empty())) {
        ojson delta = ojson::object();
        add_delta(delta, d);
        ojson lp = lp_entries.empty()
                       ? ojson(nullptr)
                       : ojson{{"content", std::move(lp_entries)}, {"refusal", nullptr}};
        out += sse_data(
            chunk(std::move(delta), nullptr, lp).dump(-1, ' ', false, kReplaceInvalidUtf8));
      }
    } else {
      take_final(e);
      finish(out);
    }
  }
  events.clear();
  return out;
}

ojson ChatResponseBuilder::body() const {
  check_complete();
  const auto& out = parser_.result();
  ojson msg;
  msg["role"] = "assistant";
  if (out.content.empty() && !out.tool_calls.empty())
    msg["content"] = nullptr;
  else
    msg["content"] = out.content;
  if (!out.reasoning.empty()) msg["reasoning_content"] = out.reasoning;
  if (!out.tool_calls.empty()) {
    ojson calls = ojson::array();
    for (const auto& c : out.tool_calls)
      calls.push_back({{"id", c.id},
                       {"type", "function"},
                       {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
    msg["tool_calls"] = std::move(calls);
  }
  ojson choice;
  choice["index"] = index_;
  choice["message"] = std::move(msg);
  choice["logprobs"] =
      s_.logprobs ? ojson{{"content", logprobs_}, {"refusal", nullptr}} : ojson(nullptr);
  choice["finish_reason"] = finish_reason();
  ojson b = object_head(s_.id, "chat.completion", s_.created, s_.model);
  b["choices"] = ojson::array({std::move(choice)});
  b["usage"] = usage_json(result_);
  return b;
}

// ---------------------------------------------------------------- completions

CompletionResponseBuilder::CompletionResponseBuilder(CompletionSetup setup,
                                                     const text::Tokenizer& tokenizer)
    : s_(std::move(setup)), tok_(tokenizer) {
  if (s_.logprobs >= 0)
    logprobs_ = {{"tokens", ojson::array()},
                 {"token_logprobs", ojson::array()},
                 {"top_logprobs", ojson::array()},
                 {"text_offset", ojson::array()}};
}

ojson CompletionResponseBuilder::chunk(const std::string& text, const ojson& finish_reason,
                                       const ojson& logprobs) const {
  ojson c = object_head(s_.id, "text_completion", s_.created, s_.model);
  ojson choice;
  choice["text"] = text;
  choice["index"] = index_;
  choice["logprobs"] = logprobs;
  choice["finish_reason"] = finish_reason;
  c["choices"] = ojson::array({std::move(choice)});
  if (s_.include_usage) c["usage"] = nullptr;
  return c;
}

void CompletionResponseBuilder::add_logprobs(ojson& lp, const engine::TokenInfo& t,
                                             size_t text_offset) const {
  lp["tokens"].push_back(token_text(tok_, t.id));
  lp["token_logprobs"].push_back(clean_logprob(t.logprob));
  ojson top = ojson::object();
  for (const auto& [id, v] : t.top) {
    const std::string k = token_text(tok_, id);
    if (!top.contains(k)) top[k] = clean_logprob(v);
  }
  lp["top_logprobs"].push_back(std::move(top));
  lp["text_offset"].push_back(text_offset);
}

std::string CompletionResponseBuilder::feed(std::vector<JobEvent>& events) {
  std::string out;
  if (done_) return out;
  if (!started_) {
    started_ = true;
    text_ = s_.echo_text;
    if (s_.stream && !s_.echo_text.empty())
      out +=
          sse_data(chunk(s_.echo_text, nullptr, nullptr).dump(-1, ' ', false, kReplaceInvalidUtf8));
  }
  for (auto& e : events) {
    if (done_) break;
    if (e.kind == JobEvent::Kind::Token) {
      ojson lp = nullptr;
      if (s_.logprobs >= 0 && e.gen.token && !contains(s_.stop_token_ids, e.gen.token->id)) {
        lp = {{"tokens", ojson::array()},
              {"token_logprobs", ojson::array()},
              {"top_logprobs", ojson::array()},
              {"text_offset", ojson::array()}};
        add_logprobs(lp, *e.gen.token, text_.size());
        add_logprobs(logprobs_, *e.gen.token, text_.size());
      }
      text_ += e.gen.text;
      if (s_.stream && (!e.gen.text.empty() || !lp.is_null()))
        out += sse_data(chunk(e.gen.text, nullptr, lp).dump(-1, ' ', false, kReplaceInvalidUtf8));
    } else {
      take_final(e);
      if (!s_.stream) break;
      if (error_) {
        out += error_event(error_->status, error_->what(), error_->code);
        break;
      }
      out += sse_data(chunk("", engine::finish_reason_name(result_.finish), nullptr)
                          .dump(-1, ' ', false, kReplaceInvalidUtf8));
      if (stream_end_) out += end_stream(usage_json(result_));
    }
  }
  events.clear();
  return out;
}

ojson CompletionResponseBuilder::body() const {
  check_complete();
  ojson choice;
  choice["text"] = text_;
  choice["index"] = index_;
  choice["logprobs"] = s_.logprobs >= 0 ? logprobs_ : ojson(nullptr);
  choice["finish_reason"] = engine::finish_reason_name(result_.finish);
  ojson b = object_head(s_.id, "text_completion", s_.created, s_.model);
  b["choices"] = ojson::array({std::move(choice)});
  b["usage"] = usage_json(result_);
  return b;
}

}  // namespace lily::server
