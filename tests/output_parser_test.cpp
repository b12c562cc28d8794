#include "text/output_parser.h"

#include "core/error.h"

#include <gtest/gtest.h>

#include <cctype>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace {

using lily::text::Delta;
using lily::text::OutputParser;
using lily::text::OutputParserOptions;
using lily::text::ParsedOutput;
using lily::text::ToolDialect;

struct Call {
  std::string name, arguments;
  bool operator==(const Call&) const = default;
};

struct Expected {
  std::string reasoning, content;
  std::vector<Call> calls;
};

// What a client sees when it concatenates the deltas.
struct Streamed {
  std::string reasoning, content;
  std::vector<std::string> ids;
  std::vector<Call> calls;
};

void absorb(Streamed& s, const Delta& d) {
  s.reasoning += d.reasoning;
  s.content += d.content;
  for (const auto& t : d.tool_calls) {
    ASSERT_GE(t.index, 0);
    ASSERT_LE(t.index, static_cast<int>(s.calls.size()));
    if (t.index == static_cast<int>(s.calls.size())) {
      // First delta of a call: id and name.
      EXPECT_EQ(t.id.rfind("call_", 0), 0u) << t.id;
      EXPECT_EQ(t.id.size(), 5u + 24u);
      EXPECT_FALSE(t.name.empty());
      s.ids.push_back(t.id);
      s.calls.push_back({t.name, ""});
    } else {
      EXPECT_TRUE(t.id.empty());
      EXPECT_TRUE(t.name.empty());
    }
    s.calls[t.index].arguments += t.arguments_fragment;
  }
}

struct Run {
  Streamed streamed;
  ParsedOutput summary;
};

Run run(const std::vector<std::string>& pieces, const OutputParserOptions& options) {
  OutputParser parser(options);
  Run r;
  for (const auto& p : pieces) absorb(r.streamed, parser.push(p));
  absorb(r.streamed, parser.finish());
  EXPECT_TRUE(parser.finished());
  EXPECT_TRUE(parser.finish().empty());
  r.summary = parser.result();
  return r;
}

void expect_consistent(const Run& r, const Run& whole, const Expected& e, const std::string& how) {
  SCOPED_TRACE(how);
  const Streamed& s = r.streamed;
  EXPECT_EQ(s.reasoning, e.reasoning);
  EXPECT_EQ(s.content, e.content);
  EXPECT_EQ(s.calls, e.calls);
  // The summary equals the deltas.
  EXPECT_EQ(r.summary.reasoning, s.reasoning);
  EXPECT_EQ(r.summary.content, s.content);
  ASSERT_EQ(r.summary.tool_calls.size(), s.calls.size());
  for (size_t i = 0; i < s.calls.size(); ++i) {
    EXPECT_EQ(r.summary.tool_calls[i].id, s.ids[i]);
    EXPECT_EQ(r.summary.tool_calls[i].name, s.calls[i].name);
    EXPECT_EQ(r.summary.tool_calls[i].arguments, s.calls[i].arguments);
    auto args = nlohmann::json::parse(s.calls[i].arguments, nullptr, false);
    EXPECT_TRUE(args.is_object()) << s.calls[i].arguments;
  }
  // And the single-fragment parse, ids included.
  EXPECT_EQ(s.ids, whole.streamed.ids);
}

// Feeds text whole, cut in two at every byte, and one byte at a time.
void check_all_splits(const std::string& text, OutputParserOptions options, const Expected& e) {
  options.id_seed = 1234;
  Run whole = run({text}, options);
  expect_consistent(whole, whole, e, "whole");
  if (testing::Test::HasFailure()) return;
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    Run r = run({text.substr(0, cut), text.substr(cut)}, options);
    expect_consistent(r, whole, e, "cut at " + std::to_string(cut));
    if (testing::Test::HasFailure()) return;
  }
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  expect_consistent(run(bytes, options), whole, e, "one byte at a time");
  // Three pieces at a few places, with empty pieces thrown in.
  for (size_t a = 0; a <= text.size(); a += 7)
    for (size_t b = a; b <= text.size(); b += 5) {
      Run r = run({"", text.substr(0, a), "", text.substr(a, b - a), text.substr(b), ""}, options);
      expect_consistent(r, whole, e, "cuts at " + std::to_string(a) + "," + std::to_string(b));
      if (testing::Test::HasFailure()) return;
    }
}

// Same expectation in buffered and streamed tool-call modes.
void check_both_modes(const std::string& text, OutputParserOptions options, const Expected& e) {
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "buffered");
    options.stream_tool_calls = stream;
    check_all_splits(text, options, e);
  }
}

OutputParserOptions hermes() {
  OutputParserOptions o;
  o.tool_dialect = ToolDialect::Hermes;
  return o;
}

OutputParserOptions xml() {
  OutputParserOptions o;
  o.tool_dialect = ToolDialect::Xml;
  return o;
}

const char* kWeatherCall =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n"
    "</tool_call>";

TEST(OutputParser, ReasoningThenContent) {
  check_both_modes("<think>\nLet me think.\nTwo plus two.\n</think>\n\nThe answer is 4.", {},
                   {"Let me think.\nTwo plus two.", "The answer is 4.", {}});
}

TEST(OutputParser, StartsInReasoning) {
  OutputParserOptions o;
  o.starts_in_reasoning = true;
  check_both_modes("The user greets me.\n</think>\n\nHello! <think> is just text here.", o,
                   {"The user greets me.", "Hello! <think> is just text here.", {}});
  // Thinking that never ends is all reasoning.
  check_both_modes("Still thinking\n", o, {"Still thinking\n", "", {}});
  // An empty think block.
  check_both_modes("\n</think>\n\nHi", o, {"", "Hi", {}});
}

TEST(OutputParser, ContentOnly) {
  check_both_modes("Hello <world>, a < b and </thi and <tool and </tool_call>.\n", hermes(),
                   {"", "Hello <world>, a < b and </thi and <tool and </tool_call>.\n", {}});
  check_both_modes("<thin>k", {}, {"", "<thin>k", {}});
  check_both_modes("<thi", {}, {"", "<thi", {}});
  check_both_modes("text\n\n", hermes(), {"", "text\n\n", {}});
  check_both_modes("ends with a partial <tool_c", hermes(),
                   {"", "ends with a partial <tool_c", {}});
  // Reasoning off: the tags are text.
  OutputParserOptions off;
  off.reasoning_enabled = false;
  check_both_modes("<think>\nx\n</think>\n\ny", off, {"", "<think>\nx\n</think>\n\ny", {}});
  // Tools off: tool-call syntax is text.
  check_both_modes(kWeatherCall, {}, {"", kWeatherCall, {}});
}

TEST(OutputParser, OneJsonToolCall) {
  check_both_modes(kWeatherCall, hermes(),
                   {"", "", {{"get_weather", "{\"city\":\"Paris\",\"days\":3}"}}});
  // Keys in another order, no arguments, nested values, non-ASCII.
  check_both_modes(
      "<tool_call>\n{\"arguments\": {\"q\": \"caf\\u00e9 \\\"x\\\" }\", \"n\": [1, {\"a\": null}]}, "
      "\"name\": \"search\"}\n</tool_call>",
      hermes(), {"", "", {{"search", "{\"q\":\"café \\\"x\\\" }\",\"n\":[1,{\"a\":null}]}"}}});
  check_both_modes("<tool_call>\n{\"name\": \"now\"}\n</tool_call>\n", hermes(),
                   {"", "", {{"now", "{}"}}});
}

TEST(OutputParser, OneXmlToolCall) {
  check_both_modes(
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
      "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
      xml(), {"", "", {{"get_weather", "{\"city\": \"Paris\", \"days\": 3}"}}});
  check_both_modes("<tool_call>\n<function=now>\n</function>\n</tool_call>", xml(),
                   {"", "", {{"now", "{}"}}});
}

TEST(OutputParser, SeveralToolCalls) {
  std::string two_json = std::string(kWeatherCall) +
                         "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": "
                         "\"CET\"}}\n</tool_call>\n";
  check_both_modes(two_json, hermes(),
                   {"",
                    "",
                    {{"get_weather", "{\"city\":\"Paris\",\"days\":3}"},
                     {"get_time", "{\"tz\":\"CET\"}"}}});
  std::string three_xml;
  for (const char* city : {"Paris", "Oslo", "Lima"})
    three_xml += std::string("<tool_call>\n<function=get_weather>\n<parameter=city>\n") + city +
                 "\n</parameter>\n</function>\n</tool_call>\n";
  check_both_modes(three_xml, xml(),
                   {"",
                    "",
                    {{"get_weather", "{\"city\": \"Paris\"}"},
                     {"get_weather", "{\"city\": \"Oslo\"}"},
                     {"get_weather", "{\"city\": \"Lima\"}"}}});
}

TEST(OutputParser, ContentBeforeToolCall) {
  check_both_modes(std::string("I'll check the weather.\n\n") + kWeatherCall, hermes(),
                   {"", "I'll check the weather.", {{"get_weather", "{\"city\":\"Paris\",\"days\":3}"}}});
  OutputParserOptions o = xml();
  o.starts_in_reasoning = true;
  check_both_modes(
      "Need the weather.\n</think>\n\nLet me look.\n\n<tool_call>\n<function=get_weather>\n"
      "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
      o, {"Need the weather.", "Let me look.", {{"get_weather", "{\"city\": \"Paris\"}"}}});
  // A tool call inside reasoning is reasoning.
  check_both_modes(std::string("<think>\nmaybe ") + kWeatherCall + "\n</think>\n\nNo.", hermes(),
                   {std::string("maybe ") + kWeatherCall, "No.", {}});
}

TEST(OutputParser, MalformedJsonToolCall) {
  // Broken before the name is known: content in both modes, and the text
  // after it is read normally.
  const std::string bad = "<tool_call>\n{name: \"f\", \"arguments\": {}}\n</tool_call>";
  check_both_modes(bad + "\nafter", hermes(), {"", bad + "\nafter", {}});
  check_both_modes("<tool_call>\nnot json\n</tool_call>\n" + std::string(kWeatherCall), hermes(),
                   {"",
                    "<tool_call>\nnot json\n</tool_call>",
                    {{"get_weather", "{\"city\":\"Paris\",\"days\":3}"}}});
  // Broken after the name: buffered mode gives the text back; streamed mode
  // had reported the name, so the call stands with {} and the rest is content.
  for (const std::string& text :
       {std::string("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1,}}\n</tool_call>"),
        std::string("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>")}) {
    OutputParserOptions o = hermes();
    o.stream_tool_calls = false;
    check_all_splits(text, o, {"", text, {}});
    o.stream_tool_calls = true;
    const size_t after_name = text.find("\"f\"") + 3;
    check_all_splits(text, o, {"", text.substr(after_name), {{"f", "{}"}}});
  }
  // XML with an unknown structure or a bad name.
  const std::string junk = "<tool_call>\n<function=f>\nhello\n</function>\n</tool_call>";
  OutputParserOptions o = xml();
  o.stream_tool_calls = false;
  check_all_splits(junk, o, {"", junk, {}});
  o.stream_tool_calls = true;
  check_all_splits(junk, o, {"", "\nhello\n</function>\n</tool_call>", {{"f", "{}"}}});
  check_both_modes("<tool_call>\n<function=a\nb>\n</function>\n</tool_call>", xml(),
                   {"", "<tool_call>\n<function=a\nb>\n</function>\n</tool_call>", {}});
  check_both_modes("<tool_call>\n<tool_call>\n<function=f>\n</function>\n</tool_call>", xml(),
                   {"", "<tool_call>\n", {{"f", "{}"}}});
  // Invalid UTF-8 never throws.
  check_both_modes("<tool_call>\n{\"name\": \"f\xff\"}\n</tool_call>", hermes(),
                   {"", "<tool_call>\n{\"name\": \"f\xff\"}\n</tool_call>", {}});
}

TEST(OutputParser, UnterminatedToolCall) {
  struct Case {
    std::string text;
    OutputParserOptions options;
    Expected streamed;
  };
  const std::vector<Case> cases = {
      {"Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}",
       hermes(),
       {"", "Sure.", {{"f", "{\"a\":1}"}}}},
      {"<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"unterminated",
       hermes(),
       {"", ", \"arguments\": {\"a\": \"unterminated", {{"f", "{}"}}}},
      {"<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nxx",
       xml(),
       {"", "\n<parameter=b>\nxx", {{"f", "{\"a\": 1}"}}}},
      {"<tool_call>\n<function=f>\n</function>\n", xml(), {"", "", {{"f", "{}"}}}},
      {"<tool_call>\n<function=f>\n</function>\n</tool_c", xml(),
       {"", "\n</tool_c", {{"f", "{}"}}}},
      {"Hi\n<tool_call>\n<function=get_wea", xml(), {"", "Hi\n<tool_call>\n<function=get_wea", {}}},
      {"<tool_call>\n{\"na", hermes(), {"", "<tool_call>\n{\"na", {}}},
      {"<tool_call>", hermes(), {"", "<tool_call>", {}}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    OutputParserOptions o = c.options;
    o.stream_tool_calls = false;
    check_all_splits(c.text, o, {"", c.text, {}});
    o.stream_tool_calls = true;
    check_all_splits(c.text, o, c.streamed);
  }
}

TEST(OutputParser, XmlTypedParameters) {
  OutputParserOptions o = xml();
  o.tools = nlohmann::json::parse(R"([
    {"type": "function", "function": {"name": "configure", "parameters": {
      "type": "object", "properties": {
        "label": {"type": "string"},
        "count": {"type": "integer"},
        "ratio": {"type": "number"},
        "enabled": {"type": "boolean"},
        "options": {"type": "object"},
        "items": {"type": "array"},
        "maybe": {"type": ["string", "null"]},
        "bad_int": {"type": "integer"},
        "text": {"type": "string"}}}}},
    {"name": "other", "parameters": {"properties": {"x": {"type": "string"}}}},
    "junk", 3, {"function": 7}
  ])");
  const std::string text =
      "<tool_call>\n<function=configure>\n"
      "<parameter=label>\n42\n</parameter>\n"
      "<parameter=count>\n7\n</parameter>\n"
      "<parameter=ratio>\n2.5\n</parameter>\n"
      "<parameter=enabled>\ntrue\n</parameter>\n"
      "<parameter=options>\n{\"z\": [1, 2],\n \"a\": {\"b\": null}}\n</parameter>\n"
      "<parameter=items>\n[\"x\", 3]\n</parameter>\n"
      "<parameter=maybe>\nnull\n</parameter>\n"
      "<parameter=bad_int>\nseven\n</parameter>\n"
      "<parameter=text>\n\nline one\n  <b>line</b> \"two\"\n\n</parameter>\n"
      "<parameter=unknown_json>\n{\"k\": false}\n</parameter>\n"
      "<parameter=unknown_text>\nhello world\n</parameter>\n"
      "<parameter=empty>\n</parameter>\n"
      "</function>\n</tool_call>";
  const std::string args =
      "{\"label\": \"42\", \"count\": 7, \"ratio\": 2.5, \"enabled\": true, "
      "\"options\": {\"z\":[1,2],\"a\":{\"b\":null}}, \"items\": [\"x\",3], \"maybe\": \"null\", "
      "\"bad_int\": \"seven\", \"text\": \"\\nline one\\n  <b>line</b> \\\"two\\\"\\n\", "
      "\"unknown_json\": {\"k\":false}, \"unknown_text\": \"hello world\", \"empty\": \"\"}";
  check_both_modes(text, o, {"", "", {{"configure", args}}});
  // Without a schema every value that parses as JSON is JSON.
  check_both_modes(
      "<tool_call>\n<function=configure>\n<parameter=label>\n42\n</parameter>\n</function>\n"
      "</tool_call>",
      xml(), {"", "", {{"configure", "{\"label\": 42}"}}});
}

TEST(OutputParser, StreamsPromptly) {
  OutputParserOptions o = xml();
  o.starts_in_reasoning = true;
  OutputParser p(o);
  EXPECT_EQ(p.push("Think").reasoning, "Think");
  EXPECT_EQ(p.push("ing\n").reasoning, "ing");  // the newline may precede </think>
  EXPECT_EQ(p.push("more\n</th").reasoning, "\nmore");
  Delta d = p.push("ink>\n\nHello");
  EXPECT_EQ(d.reasoning, "");
  EXPECT_EQ(d.content, "Hello");
  EXPECT_EQ(p.push(" world <to").content, " world");
  EXPECT_EQ(p.push("ol").content, "");
  EXPECT_EQ(p.push("box>").content, " <toolbox>");
  EXPECT_EQ(p.push("\n\n<tool_call>\n<function=get_").content, "");
  d = p.push("weather>\n<parameter=city>\nPar");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0].index, 0);
  EXPECT_EQ(d.tool_calls[0].name, "get_weather");
  EXPECT_FALSE(d.tool_calls[0].id.empty());
  EXPECT_EQ(d.tool_calls[0].arguments_fragment, "");
  d = p.push("is\n</parameter>\n<parameter=days>\n2\n</parameter>");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_TRUE(d.tool_calls[0].name.empty());
  EXPECT_EQ(d.tool_calls[0].arguments_fragment, "{\"city\": \"Paris\", \"days\": 2");
  d = p.push("\n</function>");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0].arguments_fragment, "}");
  EXPECT_TRUE(p.push("\n</tool_call>").empty());
  EXPECT_TRUE(p.finish().empty());
  ASSERT_EQ(p.result().tool_calls.size(), 1u);
  EXPECT_EQ(p.result().content, "Hello world <toolbox>");
  EXPECT_EQ(p.result().reasoning, "Thinking\nmore");

  // Hermes: the name goes out before the arguments are complete.
  OutputParser h(hermes());
  d = h.push("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0].name, "get_weather");
  d = h.push("ty\": \"Paris\"}}");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0].arguments_fragment, "{\"city\":\"Paris\"}");

  // Buffered mode holds the whole call.
  OutputParserOptions b = hermes();
  b.stream_tool_calls = false;
  OutputParser q(b);
  EXPECT_TRUE(q.push("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n").empty());
  d = q.push("</tool_call>");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0].name, "f");
  EXPECT_EQ(d.tool_calls[0].arguments_fragment, "{}");
}

TEST(OutputParser, IdsAreSeeded) {
  OutputParserOptions o = hermes();
  o.id_seed = 7;
  std::string two = std::string(kWeatherCall) + kWeatherCall;
  ParsedOutput a = OutputParser::parse(two, o), b = OutputParser::parse(two, o);
  ASSERT_EQ(a.tool_calls.size(), 2u);
  EXPECT_EQ(a.tool_calls[0].id, b.tool_calls[0].id);
  EXPECT_NE(a.tool_calls[0].id, a.tool_calls[1].id);
  o.id_seed = 8;
  EXPECT_NE(OutputParser::parse(two, o).tool_calls[0].id, a.tool_calls[0].id);
  for (char c : a.tool_calls[0].id.substr(5)) EXPECT_TRUE(std::isalnum(static_cast<unsigned char>(c)));
}

TEST(OutputParser, PushAfterFinishFails) {
  OutputParser p;
  p.finish();
  EXPECT_THROW(p.push("x"), lily::Error);
}

}  // namespace
