// Incremental parsing of generated text into the typed pieces an
// OpenAI-compatible server reports: reasoning ("reasoning_content"), content,
// and tool calls.
//
// The text arrives in fragments (one detokenized piece per token) that may
// split anywhere, including inside <think> or <tool_call> tags. push() returns
// what can be reported now; finish() flushes what was held back. Whatever the
// split, the concatenation of all deltas is the same, and it equals result().
//
// Reasoning (reasoning_enabled):
//   * If the output starts with "<think>", or the prompt already opened it
//     (starts_in_reasoning, as the Qwen3.5/3.6 templates do when thinking is
//     on), everything up to "</think>" is reasoning. Later "<think>" tags are
//     plain text, and so is anything inside reasoning that looks like a tool
//     call.
//   * One "\n" right after "<think>" and one right before "</think>" are
//     dropped, and up to two "\n" right after "</think>": the templates write
//     "<think>\nREASONING\n</think>\n\nCONTENT".
//   * If "</think>" never comes, everything after "<think>" is reasoning.
//   With reasoning disabled, everything is content and the tags are text.
//
// Tool calls (tool_dialect != None), in content only:
//   * Hermes / Qwen3:   <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
//   * XML / Qwen3.5+:   <tool_call>\n<function=f>\n<parameter=p>\nVALUE\n</parameter>\n
//                       </function>\n</tool_call>
//   The body of a call is recognised by its first character ('{' or
//   "<function="), so either dialect parses whichever one is set; the dialect
//   only says that tool calls are on. Several calls per reply get increasing
//   indices. Whitespace between the content and a call, between calls and
//   after the last one is dropped.
//   * Arguments are a JSON object string. Hermes: the "arguments" object
//     re-serialised compactly with its key order kept (a missing or null
//     "arguments" is {}; a string holding a JSON object is accepted). XML:
//     {"p": value, ...} in the model's order; one leading and one trailing
//     "\n" of each value are stripped, and the text becomes a JSON value by the
//     tool's schema (options.tools): a parameter whose type includes "string"
//     stays a string; integer/number/boolean/object/array/null is parsed as
//     JSON if it parses, else kept as a string; a parameter without a known
//     type is parsed as JSON if it parses, else kept as a string.
//
// Malformed tool calls never throw; their text becomes content, unmodified.
// When a call is reported depends on stream_tool_calls:
//   * false (buffered): a call is reported only once its "</tool_call>" has
//     been read and everything in it parsed. Anything malformed (bad JSON,
//     unknown structure, closing tags missing at finish) turns the original
//     text into content, whatever the fragmentation.
//   * true (streamed, the default): the call is reported as it forms. The
//     first delta (id + name) goes out as soon as the name is known (Hermes:
//     when `{"name": "..."` has been read with "name" as the first key; XML:
//     at the end of "<function=NAME>"); arguments follow per completed XML
//     parameter (`{"p": v`, `, "q": w`, then `}` at "</function>"), or, for
//     Hermes, in one piece once the JSON object is complete and valid. A call
//     whose name has been reported is committed: if it later turns out
//     malformed or unterminated, its arguments are closed over what was
//     complete ({} if nothing was) and the text after the last complete part
//     goes on as content. Before the name is known, malformed text becomes
//     content as in buffered mode.
//   Within one Delta, the tool_calls entries for one index are merged.
//
// Held back: only a possible tag prefix at the end of the text ("<too",
// "</thi"), the newline that may precede "</think>", whitespace that may
// precede a "<tool_call>", and (buffered mode) the text of an unfinished
// tool call.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace lily::text {

enum class ToolDialect {
  None,    // tool-call syntax is plain content
  Hermes,  // Qwen3: JSON object inside <tool_call>
  Xml,     // Qwen3.5 / 3.6: <function=...><parameter=...> inside <tool_call>
};

struct OutputParserOptions {
  bool reasoning_enabled = true;
  // The prompt ended with an opened "<think>\n": output starts as reasoning.
  bool starts_in_reasoning = false;
  ToolDialect tool_dialect = ToolDialect::None;
  // OpenAI "tools" array ([{"type":"function","function":{"name", "parameters"}}]
  // or bare {"name", "parameters"} objects), used to type XML parameters.
  nlohmann::json tools = nlohmann::json::array();
  bool stream_tool_calls = true;
  // Seed for the tool call ids ("call_" + 24 alphanumerics); random if unset.
  std::optional<uint64_t> id_seed;
};

struct ToolCallDelta {
  int index = 0;
  std::string id;    // set on the first delta of a call only
  std::string name;  // set on the first delta of a call only
  std::string arguments_fragment;
};

struct Delta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text of an object
};

struct ParsedOutput {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;
};

class OutputParser {
 public:
  explicit OutputParser(OutputParserOptions options = {});

  // Feeds the next piece of generated text. Not to be called after finish().
  Delta push(std::string_view fragment);
  // End of generation: reports everything still held back. Idempotent.
  Delta finish();

  // Everything reported so far (complete after finish()). A streamed tool
  // call appears here once its arguments are closed.
  const ParsedOutput& result() const { return result_; }
  bool finished() const { return finished_; }

  // Whole-text convenience: push(text) then finish().
  static ParsedOutput parse(std::string_view text, OutputParserOptions options = {});

 private:
  enum class State { Start, ReasoningStart, Reasoning, AfterThink, Content, AfterTool, ToolCall };
  enum class Phase { Open, HermesObject, CloseTag, XmlName, XmlParams, XmlParamName, XmlParamValue };
  struct Call {
    Phase phase = Phase::Open;
    size_t pos = 0;        // parse cursor into buf_ (buf_ starts at the call)
    size_t tag_start = 0;  // where "<tool_call>" starts (after dropped whitespace)
    size_t committed = 0;  // end of the last part that is final (streamed mode)
    // Hermes object scan.
    size_t obj_start = 0, scan = 0;
    int depth = 0;
    bool in_string = false, escape = false, early_name_tried = false;
    // XML.
    size_t construct = 0;  // where the current <parameter=...> tag starts
    size_t value_start = 0, search = 0;
    std::string param;
    int params = 0;
    // What is known about the call.
    bool name_known = false, args_done = false, announced = false;
    std::string name, args;
    size_t emitted = 0;  // bytes of args reported
    int index = -1;
    std::string id;
  };

  bool step(Delta& out, bool at_end);
  bool step_call(Delta& out);
  bool step_hermes(Delta& out);
  void try_early_name();
  void begin_call(size_t tag_pos);
  void report_call(Delta& out);          // emits what is new of the current call
  void complete_call(Delta& out, size_t end);
  void fail_call(Delta& out, size_t at);  // malformed at buf_[at]
  void abandon_call(Delta& out);          // at finish, unterminated
  void close_committed(Delta& out);
  std::string typed_value(const std::string& function, const std::string& param,
                          std::string_view value) const;

  void emit_reasoning(Delta& out, std::string_view s);
  void emit_content(Delta& out, std::string_view s);
  void emit_call_delta(Delta& out, ToolCallDelta d);
  std::string new_id();
  bool tools_on() const { return options_.tool_dialect != ToolDialect::None; }

  OutputParserOptions options_;
  // function name -> its parameters whose schema type includes "string".
  std::map<std::string, std::set<std::string>> string_params_;
  std::mt19937_64 id_rng_;
  State state_;
  std::string buf_;  // text not yet reported
  Call call_;
  int next_index_ = 0;
  bool finished_ = false;
  ParsedOutput result_;
};

// True when a rendered prompt ends inside an opened <think> block (the
// Qwen3.5/3.6 templates open it when thinking is on): the reply then starts
// as reasoning (OutputParserOptions::starts_in_reasoning).
bool prompt_opens_reasoning(std::string_view prompt);

}  // namespace lily::text
