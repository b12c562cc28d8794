// Turning the engine's events for one request into OpenAI response bodies:
// chat.completion / chat.completion.chunk and text_completion objects, the
// SSE framing, usage, logprobs, reasoning and tool calls, and the checks of
// tool_choice and response_format on the final output.
//
// One builder per request, used by the HTTP thread that answers it. The same
// builder serves streaming (feed() returns the SSE text to send) and
// non-streaming (feed() everything, then body()).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "server/api.h"
#include "server/scheduler.h"
#include "text/output_parser.h"
#include "text/tokenizer.h"

namespace lily::server {

// "chatcmpl-" / "cmpl-" + 24 random alphanumerics.
std::string make_response_id(const std::string& prefix);
int64_t unix_time_now();

// One "data: ...\n\n" SSE event.
std::string sse_data(const std::string& payload);

ojson usage_json(const engine::GenerationResult& r);
// Of n choices of one prompt: the prompt counted once, completions summed.
ojson usage_json(const std::vector<engine::GenerationResult>& choices);

struct ChatSetup {
  std::string id, model;
  int64_t created = 0;
  bool stream = false, include_usage = false;
  bool logprobs = false;
  int top_logprobs = 0;
  text::OutputParserOptions parser;
  // Text the server put at the start of the reply (in the prompt) to force a
  // tool call; it is parsed as model output.
  std::string forced_prefix;
  // A stop string the server added ("</tool_call>" for
  // parallel_tool_calls=false); when it ends the reply it is parsed as output.
  std::string injected_stop;
  ToolChoice tool_choice = ToolChoice::Auto;
  std::string tool_name;
  bool json_object = false;
  bool json_schema = false;  // the reply must parse as JSON (the schema was constrained)
  std::vector<int> stop_token_ids;  // left out of logprobs
};

// Fills the request-dependent part of `setup` (stream, logprobs, checks, and
// the output parser: reasoning on unless thinking is off, starting inside
// reasoning when `rendered_prompt` ends with an open "<think>", tool calls
// when tools are on) and returns the text to append to the prompt: for
// tool_choice "required" / named, the opening of a tool call in `dialect`
// (after closing an open <think>), which the parser then reads as output.
// With parallel_tool_calls false, sets setup.injected_stop.
std::string plan_chat_reply(const ChatRequest& request, text::ToolDialect dialect,
                            const std::string& rendered_prompt, ChatSetup& setup);

// What the chat and completion builders share: the job's outcome, taken from
// its final event, and the early end of a stream.
class ResponseBuilderBase {
 public:
  bool done() const { return done_; }
  // Streaming: an error event + [DONE] for a stream that must end early
  // (server shutting down).
  std::string abort_stream(int status, const std::string& message, const std::string& code);
  const engine::GenerationResult& result() const { return result_; }
  double queue_seconds() const { return queue_seconds_; }
  bool failed() const { return error_.has_value(); }
  // One of n choices (request "n"): its index, and whether its stream ends
  // with the usage chunk and [DONE] (false: the server writes them once all
  // choices are done; an error still ends the stream).
  void set_choice(int index, bool stream_end) {
    index_ = index;
    stream_end_ = stream_end;
  }

 protected:
  // Records a Done or Error event (a cancelled job is an error) and marks the
  // response done.
  void take_final(const JobEvent& e);
  // Throws the job's error, or a 500 while the response is not complete.
  void check_complete() const;

  bool done_ = false;
  int index_ = 0;
  bool stream_end_ = true;
  std::optional<ApiError> error_;
  engine::GenerationResult result_;
  double queue_seconds_ = 0;
};

class ChatResponseBuilder : public ResponseBuilderBase {
 public:
  ChatResponseBuilder(ChatSetup setup, const text::Tokenizer& tokenizer);

  // Consumes events. In streaming mode returns the SSE text to send (the
  // first call starts with the role chunk; the call that sees the final
  // event ends with "data: [DONE]"); otherwise returns "".
  std::string feed(std::vector<JobEvent>& events);

  // Non-streaming: the chat.completion body once done(); throws ApiError
  // when the generation failed or its output broke tool_choice /
  // response_format.
  ojson body() const;
  // The usage chunk (when asked for) and [DONE].
  std::string end_stream(const ojson& usage) const;

 private:
  ojson chunk(ojson delta, const ojson& finish_reason, const ojson& logprobs) const;
  ojson logprob_entry(const engine::TokenInfo& t) const;
  void add_delta(ojson& delta, const text::Delta& d);
  std::optional<ApiError> validate() const;
  std::string finish_reason() const;
  void finish(std::string& out);

  ChatSetup s_;
  const text::Tokenizer& tok_;
  text::OutputParser parser_;
  bool started_ = false;
  ojson logprobs_ = ojson::array();
};

struct CompletionSetup {
  std::string id, model;
  int64_t created = 0;
  bool stream = false, include_usage = false;
  int logprobs = -1;      // legacy: -1 off, else the number of alternatives
  std::string echo_text;  // the prompt text when echo is on
  std::vector<int> stop_token_ids;
};

class CompletionResponseBuilder : public ResponseBuilderBase {
 public:
  CompletionResponseBuilder(CompletionSetup setup, const text::Tokenizer& tokenizer);
  std::string feed(std::vector<JobEvent>& events);
  ojson body() const;
  std::string end_stream(const ojson& usage) const;

 private:
  ojson chunk(const std::string& text, const ojson& finish_reason, const ojson& logprobs) const;
  void add_logprobs(ojson& lp, const engine::TokenInfo& t, size_t text_offset) const;

  CompletionSetup s_;
  const text::Tokenizer& tok_;
  bool started_ = false;
  std::string text_;
  ojson logprobs_;
};

// The text a token stands for in logprobs: its bytes as valid UTF-8 (broken
// sequences as U+FFFD), and the raw bytes.
std::string token_text(const text::Tokenizer& tok, int id);
ojson token_bytes_json(const text::Tokenizer& tok, int id);

}  // namespace lily::server
