#include "text/output_parser.h"

#include <algorithm>

#include "core/error.h"
#include "text/json_constraint.h"

namespace lily::text {

namespace {

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kCallOpen = "<tool_call>";
constexpr std::string_view kCallClose = "</tool_call>";
constexpr std::string_view kFunctionOpen = "<function=";
constexpr std::string_view kFunctionClose = "</function>";
constexpr std::string_view kParamOpen = "<parameter=";
constexpr std::string_view kParamClose = "</parameter>";
constexpr size_t kMaxNameLength = 256;

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// s is shorter than tag and could still grow into it.
bool is_proper_prefix(std::string_view s, std::string_view tag) {
  return s.size() < tag.size() && tag.substr(0, s.size()) == s;
}

// Length of the longest suffix of s that is a proper prefix of tag.
size_t partial_tag_suffix(std::string_view s, std::string_view tag) {
  for (size_t k = std::min(s.size(), tag.size() - 1); k > 0; --k)
    if (s.substr(s.size() - k) == tag.substr(0, k)) return k;
  return 0;
}

size_t skip_space(std::string_view s, size_t pos) {
  while (pos < s.size() && is_space(s[pos])) ++pos;
  return pos;
}

// Serialises without throwing on invalid UTF-8 (replaced by U+FFFD).
template <typename Json>
std::string dump(const Json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string json_string(std::string_view s) { return dump(nlohmann::json(std::string(s))); }

enum class Scan { Found, Partial, Bad };

// A name inside "<function=NAME>" / "<parameter=NAME>", starting at pos:
// Found sets name and end (just past '>').
Scan scan_tag_name(std::string_view s, size_t pos, std::string& name, size_t& end) {
  for (size_t i = pos; i < s.size(); ++i) {
    char c = s[i];
    if (c == '>') {
      if (i == pos) return Scan::Bad;
      name.assign(s.substr(pos, i - pos));
      end = i + 1;
      return Scan::Found;
    }
    if (c == '<' || c == '\n' || c == '\r' || i - pos >= kMaxNameLength) return Scan::Bad;
  }
  return Scan::Partial;
}

}  // namespace

OutputParser::OutputParser(OutputParserOptions options) : options_(std::move(options)) {
  if (options_.id_seed) {
    id_rng_.seed(*options_.id_seed);
  } else {
    std::random_device rd;
    id_rng_.seed((static_cast<uint64_t>(rd()) << 32) ^ rd());
  }
  if (options_.tools.is_array()) {
    for (const auto& tool : options_.tools) {
      if (!tool.is_object()) continue;
      const nlohmann::json& fn =
          tool.contains("function") && tool["function"].is_object() ? tool["function"] : tool;
      if (!fn.contains("name") || !fn["name"].is_string()) continue;
      auto& strings = string_params_[fn["name"].get<std::string>()];
      if (!fn.contains("parameters") || !fn["parameters"].is_object()) continue;
      const auto& params = fn["parameters"];
      if (!params.contains("properties") || !params["properties"].is_object()) continue;
      for (const auto& [pname, pschema] : params["properties"].items())
        if (pschema.is_object() && pschema.contains("type") &&
            schema_type_is_string(pschema["type"]))
          strings.insert(pname);
    }
  }
  if (!options_.reasoning_enabled)
    state_ = State::Content;
  else if (options_.starts_in_reasoning)
    state_ = State::ReasoningStart;
  else
    state_ = State::Start;
}

ParsedOutput OutputParser::parse(std::string_view text, OutputParserOptions options) {
  OutputParser parser(std::move(options));
  parser.push(text);
  parser.finish();
  return parser.result();
}

Delta OutputParser::push(std::string_view fragment) {
  if (finished_) fail("OutputParser::push called after finish()");
  Delta out;
  buf_.append(fragment);
  while (step(out, false)) {
  }
  return out;
}

Delta OutputParser::finish() {
  Delta out;
  if (finished_) return out;
  while (step(out, true)) {
  }
  finished_ = true;
  return out;
}

// One unit of progress; false when more input is needed (or, at the end,
// when everything has been reported).
bool OutputParser::step(Delta& out, bool at_end) {
  const std::string_view b = buf_;
  switch (state_) {
    case State::Start:
      if (b.empty()) return false;
      if (starts_with(b, kThinkOpen)) {
        buf_.erase(0, kThinkOpen.size());
        state_ = State::ReasoningStart;
        return true;
      }
      if (!at_end && is_proper_prefix(b, kThinkOpen)) return false;
      state_ = State::Content;
      return true;

    case State::ReasoningStart:
      if (b.empty()) return false;
      if (b[0] == '\n') buf_.erase(0, 1);
      state_ = State::Reasoning;
      return true;

    case State::Reasoning: {
      size_t close = b.find(kThinkClose);
      if (close != std::string_view::npos) {
        std::string_view r = b.substr(0, close);
        if (!r.empty() && r.back() == '\n') r.remove_suffix(1);
        emit_reasoning(out, r);
        buf_.erase(0, close + kThinkClose.size());
        state_ = State::AfterThink;
        return true;
      }
      if (at_end) {
        emit_reasoning(out, b);
        buf_.clear();
        return false;
      }
      size_t hold = partial_tag_suffix(b, kThinkClose);
      if (hold < b.size() && b[b.size() - hold - 1] == '\n') ++hold;
      emit_reasoning(out, b.substr(0, b.size() - hold));
      buf_.erase(0, b.size() - hold);
      return false;
    }

    case State::AfterThink:
      if (b.empty()) return false;
      if (b[0] != '\n') {
        state_ = State::Content;
        return true;
      }
      if (b.size() == 1) {
        if (at_end) buf_.clear();
        return false;
      }
      buf_.erase(0, b[1] == '\n' ? 2 : 1);
      state_ = State::Content;
      return true;

    case State::Content: {
      if (b.empty()) return false;
      size_t tag = tools_on() ? b.find(kCallOpen) : std::string_view::npos;
      if (tag != std::string_view::npos) {
        size_t ws = tag;
        while (ws > 0 && is_space(b[ws - 1])) --ws;
        emit_content(out, b.substr(0, ws));
        buf_.erase(0, ws);
        begin_call(tag - ws);
        return true;
      }
      if (!tools_on() || at_end) {
        emit_content(out, b);
        buf_.clear();
        return false;
      }
      size_t keep = b.size() - partial_tag_suffix(b, kCallOpen);
      while (keep > 0 && is_space(b[keep - 1])) --keep;
      emit_content(out, b.substr(0, keep));
      buf_.erase(0, keep);
      return false;
    }

    case State::AfterTool: {
      size_t i = skip_space(b, 0);
      if (i == b.size()) {
        if (at_end) buf_.clear();
        return false;
      }
      std::string_view rest = b.substr(i);
      if (starts_with(rest, kCallOpen)) {
        begin_call(i);
        return true;
      }
      if (!at_end && is_proper_prefix(rest, kCallOpen)) return false;
      state_ = State::Content;
      return true;
    }

    case State::ToolCall:
      if (step_call(out)) return true;
      if (at_end) {
        abandon_call(out);
        return true;
      }
      return false;
  }
  return false;
}

void OutputParser::begin_call(size_t tag_pos) {
  call_ = Call{};
  call_.tag_start = tag_pos;
  call_.pos = tag_pos + kCallOpen.size();
  state_ = State::ToolCall;
}

bool OutputParser::step_call(Delta& out) {
  Call& c = call_;
  const std::string_view b = buf_;
  const bool stream = options_.stream_tool_calls;
  switch (c.phase) {
    case Phase::Open: {
      c.pos = skip_space(b, c.pos);
      if (c.pos == b.size()) return false;
      std::string_view rest = b.substr(c.pos);
      if (rest[0] == '{') {
        c.obj_start = c.scan = c.pos;
        c.phase = Phase::HermesObject;
        return true;
      }
      if (starts_with(rest, kFunctionOpen)) {
        c.construct = c.pos;
        c.pos += kFunctionOpen.size();
        c.phase = Phase::XmlName;
        return true;
      }
      if (is_proper_prefix(rest, kFunctionOpen)) return false;
      fail_call(out, c.pos);
      return true;
    }

    case Phase::HermesObject:
      return step_hermes(out);

    case Phase::XmlName: {
      size_t end = 0;
      switch (scan_tag_name(b, c.pos, c.name, end)) {
        case Scan::Partial: return false;
        case Scan::Bad: fail_call(out, c.construct); return true;
        case Scan::Found: break;
      }
      c.name_known = true;
      c.pos = c.committed = end;
      c.phase = Phase::XmlParams;
      if (stream) report_call(out);
      return true;
    }

    case Phase::XmlParams: {
      c.pos = skip_space(b, c.pos);
      if (c.pos == b.size()) return false;
      std::string_view rest = b.substr(c.pos);
      if (starts_with(rest, kParamOpen)) {
        c.construct = c.pos;
        c.pos += kParamOpen.size();
        c.phase = Phase::XmlParamName;
        return true;
      }
      if (starts_with(rest, kFunctionClose)) {
        c.args = c.params > 0 ? c.args + "}" : "{}";
        c.args_done = true;
        c.pos = c.committed = c.pos + kFunctionClose.size();
        c.phase = Phase::CloseTag;
        if (stream) report_call(out);
        return true;
      }
      if (is_proper_prefix(rest, kParamOpen) || is_proper_prefix(rest, kFunctionClose))
        return false;
      fail_call(out, c.pos);
      return true;
    }

    case Phase::XmlParamName: {
      size_t end = 0;
      switch (scan_tag_name(b, c.pos, c.param, end)) {
        case Scan::Partial: return false;
        case Scan::Bad: fail_call(out, c.construct); return true;
        case Scan::Found: break;
      }
      c.pos = c.value_start = c.search = end;
      c.phase = Phase::XmlParamValue;
      return true;
    }

    case Phase::XmlParamValue: {
      size_t close = b.find(kParamClose, c.search);
      if (close == std::string_view::npos) {
        // Resume where a closing tag could still start.
        c.search = std::max(c.value_start, b.size() - std::min(b.size(), kParamClose.size() - 1));
        return false;
      }
      std::string_view value = b.substr(c.value_start, close - c.value_start);
      if (!value.empty() && value.front() == '\n') value.remove_prefix(1);
      if (!value.empty() && value.back() == '\n') value.remove_suffix(1);
      c.args += c.params == 0 ? "{" : ", ";
      c.args += json_string(c.param);
      c.args += ": ";
      c.args += typed_value(c.name, c.param, value);
      ++c.params;
      c.pos = c.committed = close + kParamClose.size();
      c.phase = Phase::XmlParams;
      if (stream) report_call(out);
      return true;
    }

    case Phase::CloseTag: {
      c.pos = skip_space(b, c.pos);
      if (c.pos == b.size()) return false;
      std::string_view rest = b.substr(c.pos);
      if (starts_with(rest, kCallClose)) {
        complete_call(out, c.pos + kCallClose.size());
        return true;
      }
      if (is_proper_prefix(rest, kCallClose)) return false;
      fail_call(out, c.pos);
      return true;
    }
  }
  return false;
}

// Hermes: {"name": ..., "arguments": {...}}. The object's extent is found by
// a scan that tracks strings and nesting; nlohmann validates it. '<' outside a
// string (such as "</tool_call>") or a raw control character inside one ends
// it as malformed at once, so a broken object cannot swallow the rest.
bool OutputParser::step_hermes(Delta& out) {
  Call& c = call_;
  const std::string_view b = buf_;
  if (options_.stream_tool_calls && !c.early_name_tried) {
    try_early_name();
    if (c.name_known) report_call(out);
  }
  size_t end = std::string_view::npos;
  size_t i = c.scan;
  for (; i < b.size(); ++i) {
    const char ch = b[i];
    if (c.in_string) {
      if (c.escape) {
        c.escape = false;
      } else if (ch == '\\') {
        c.escape = true;
      } else if (ch == '"') {
        c.in_string = false;
      } else if (static_cast<unsigned char>(ch) < 0x20) {
        fail_call(out, i);
        return true;
      }
    } else if (ch == '"') {
      c.in_string = true;
    } else if (ch == '{' || ch == '[') {
      ++c.depth;
    } else if (ch == '}' || ch == ']') {
      if (--c.depth == 0) {
        end = i + 1;
        break;
      }
    } else if (ch == '<') {
      fail_call(out, i);
      return true;
    }
  }
  c.scan = i;
  if (end == std::string_view::npos) return false;

  auto obj = nlohmann::ordered_json::parse(b.substr(c.obj_start, end - c.obj_start), nullptr,
                                           false);
  bool ok = obj.is_object() && obj.contains("name") && obj["name"].is_string() &&
            !obj["name"].get<std::string>().empty();
  std::string args;
  if (ok) {
    if (c.name_known && obj["name"].get<std::string>() != c.name) ok = false;
    const char* key = obj.contains("arguments") ? "arguments"
                      : obj.contains("parameters") ? "parameters"
                                                   : nullptr;
    if (!key || obj[key].is_null()) {
      args = "{}";
    } else if (obj[key].is_object()) {
      args = dump(obj[key]);
    } else if (obj[key].is_string()) {
      auto inner = nlohmann::ordered_json::parse(obj[key].get<std::string>(), nullptr, false);
      if (inner.is_object())
        args = dump(inner);
      else
        ok = false;
    } else {
      ok = false;
    }
  }
  if (!ok) {
    fail_call(out, end);
    return true;
  }
  c.name = obj["name"].get<std::string>();
  c.name_known = true;
  c.args = std::move(args);
  c.args_done = true;
  c.pos = c.committed = end;
  c.phase = Phase::CloseTag;
  if (options_.stream_tool_calls) report_call(out);
  return true;
}

// Streamed mode: reads the name early from a prefix `{"name": "..."`. Gives
// up (for good) on any other shape; the full parse then decides.
void OutputParser::try_early_name() {
  Call& c = call_;
  const std::string_view b = buf_;
  size_t p = c.obj_start + 1;
  auto expect = [&](std::string_view lit) -> Scan {
    p = skip_space(b, p);
    std::string_view rest = b.substr(p);
    if (starts_with(rest, lit)) {
      p += lit.size();
      return Scan::Found;
    }
    return is_proper_prefix(rest, lit) ? Scan::Partial : Scan::Bad;
  };
  for (std::string_view lit : {std::string_view("\"name\""), std::string_view(":"),
                               std::string_view("\"")}) {
    Scan s = expect(lit);
    if (s == Scan::Partial) return;
    if (s == Scan::Bad) {
      c.early_name_tried = true;
      return;
    }
  }
  const size_t quote = p - 1;
  bool escape = false;
  for (; p < b.size(); ++p) {
    const char ch = b[p];
    if (p - quote > kMaxNameLength || static_cast<unsigned char>(ch) < 0x20) {
      c.early_name_tried = true;
      return;
    }
    if (escape) {
      escape = false;
    } else if (ch == '\\') {
      escape = true;
    } else if (ch == '"') {
      break;
    }
  }
  if (p == b.size()) return;  // the string goes on
  c.early_name_tried = true;
  auto name = nlohmann::json::parse(b.substr(quote, p + 1 - quote), nullptr, false);
  if (!name.is_string() || name.get<std::string>().empty()) return;
  c.name = name.get<std::string>();
  c.name_known = true;
  c.committed = p + 1;
}

void OutputParser::report_call(Delta& out) {
  Call& c = call_;
  if (!c.name_known) return;
  if (!c.announced) {
    c.announced = true;
    c.index = next_index_++;
    c.id = new_id();
    emit_call_delta(out, ToolCallDelta{c.index, c.id, c.name, ""});
  }
  if (c.args.size() > c.emitted) {
    emit_call_delta(out, ToolCallDelta{c.index, "", "", c.args.substr(c.emitted)});
    c.emitted = c.args.size();
  }
}

void OutputParser::complete_call(Delta& out, size_t end) {
  report_call(out);
  result_.tool_calls.push_back(ToolCall{call_.id, call_.name, call_.args});
  buf_.erase(0, end);
  call_ = Call{};
  state_ = State::AfterTool;
}

// Closes a committed (streamed) call over what was complete.
void OutputParser::close_committed(Delta& out) {
  Call& c = call_;
  if (!c.args_done) {
    c.args = c.args.empty() ? "{}" : c.args + "}";
    c.args_done = true;
  }
  report_call(out);
  result_.tool_calls.push_back(ToolCall{c.id, c.name, c.args});
}

void OutputParser::fail_call(Delta& out, size_t at) {
  if (call_.announced) {
    close_committed(out);
    buf_.erase(0, call_.committed);
    call_ = Call{};
    state_ = State::AfterTool;
    return;
  }
  // Not a tool call after all: its text up to the fault is content, and the
  // rest is read again as content (it may hold a real tool call).
  emit_content(out, std::string_view(buf_).substr(0, at));
  buf_.erase(0, at);
  call_ = Call{};
  state_ = State::Content;
}

void OutputParser::abandon_call(Delta& out) {
  if (call_.announced) {
    close_committed(out);
    std::string_view rest = std::string_view(buf_).substr(call_.committed);
    if (skip_space(rest, 0) < rest.size()) emit_content(out, rest);
  } else {
    emit_content(out, buf_);
  }
  buf_.clear();
  call_ = Call{};
  state_ = State::AfterTool;
}

std::string OutputParser::typed_value(const std::string& function, const std::string& param,
                                      std::string_view value) const {
  auto fn = string_params_.find(function);
  if (fn != string_params_.end() && fn->second.count(param)) return json_string(value);
  auto parsed = nlohmann::ordered_json::parse(value, nullptr, false);
  if (parsed.is_discarded()) return json_string(value);
  return dump(parsed);
}

void OutputParser::emit_reasoning(Delta& out, std::string_view s) {
  out.reasoning.append(s);
  result_.reasoning.append(s);
}

void OutputParser::emit_content(Delta& out, std::string_view s) {
  out.content.append(s);
  result_.content.append(s);
}

void OutputParser::emit_call_delta(Delta& out, ToolCallDelta d) {
  if (!out.tool_calls.empty() && out.tool_calls.back().index == d.index) {
    out.tool_calls.back().arguments_fragment += d.arguments_fragment;
    return;
  }
  out.tool_calls.push_back(std::move(d));
}

std::string OutputParser::new_id() {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kAlphabet[id_rng_() % 62];
  return id;
}

bool prompt_opens_reasoning(std::string_view prompt) {
  const size_t end = prompt.find_last_not_of(" \t\r\n");
  constexpr std::string_view tag = "<think>";
  return end != std::string_view::npos && end + 1 >= tag.size() &&
         prompt.substr(end + 1 - tag.size(), tag.size()) == tag;
}

}  // namespace lily::text
