// The JSON constraint: schemas compiled into a byte-level grammar, the
// matcher accepting exactly the texts a strict parser + the schema accept,
// and the token mask agreeing with feeding each token's bytes.
#include "text/json_constraint.h"

#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "text/tokenizer.h"

namespace lily::text {
namespace {

using json = nlohmann::ordered_json;

bool accepts(const std::shared_ptr<const JsonGrammar>& g, std::string_view text) {
  JsonMatcher m(g);
  return m.feed(text) && m.accepting();
}
bool prefix_ok(const std::shared_ptr<const JsonGrammar>& g, std::string_view text) {
  JsonMatcher m(g);
  return m.feed(text);
}

TEST(JsonConstraint, AnyObjectIsStrictJson) {
  auto g = JsonGrammar::any_object();
  for (const char* ok :
       {"{}", " {\"a\": 1}", "{\"a\":[1,2.5e-3,-0,true,false,null,\"x\"]}\n",
        "{\"k\\\"\\u00e9\": {\"n\": {}}, \"e\": \"\\u20ac\"}", "{\"\xc3\xa9\": \"\xe2\x82\xac\"}"})
    EXPECT_TRUE(accepts(g, ok)) << ok;
  for (const char* bad :
       {"[]", "1", "{", "{\"a\" 1}", "{\"a\":01}", "{\"a\":1,}", "{\"a\":tru}", "{'a':1}",
        "{\"a\":\"\x01\"}", "{\"a\":\"\xc0\xaf\"}", "{\"a\":\"\xed\xa0\x80\"}", "{\"a\":1.}",
        "{\"a\":-}", "{\"a\":\"\\x\"}", "{}x"})
    EXPECT_FALSE(accepts(g, bad)) << bad;
  // Surrogate escapes are not generated at all (raw UTF-8 is): a lone one
  // would fail a strict parser.
  EXPECT_FALSE(accepts(g, "{\"e\": \"\\ud83d\"}"));
  EXPECT_FALSE(accepts(g, "{\"e\": \"\\uDC00\"}"));
  // can_feed answers without moving the state.
  {
    JsonMatcher m(g);
    EXPECT_TRUE(m.can_feed("{\"a\""));
    EXPECT_FALSE(m.can_feed("}"));
    EXPECT_TRUE(m.feed("{"));
    EXPECT_TRUE(m.can_feed("}"));
    EXPECT_FALSE(m.can_feed("{"));
    EXPECT_TRUE(m.feed("}"));
    EXPECT_TRUE(m.accepting());
  }
  // Prefixes of valid text are fed; a complete value is only accepted at its end.
  EXPECT_TRUE(prefix_ok(g, "{\"a\": [1, {\"b\""));
  EXPECT_FALSE(accepts(g, "{\"a\": [1"));
  // Whitespace as JSON writers put it: one space, or a newline and indentation.
  EXPECT_TRUE(accepts(g, "{ \"a\": 1 }"));
  EXPECT_TRUE(prefix_ok(g, "{\n" + std::string(20, ' ')));
  EXPECT_TRUE(prefix_ok(g, "{\n\t\t"));
  EXPECT_FALSE(prefix_ok(g, "{\n" + std::string(21, ' ')));
  EXPECT_FALSE(prefix_ok(g, "{  "));
  EXPECT_FALSE(prefix_ok(g, "{\n\n"));
  EXPECT_FALSE(prefix_ok(g, "{ \n"));
  EXPECT_FALSE(prefix_ok(g, "{\r\n"));
  EXPECT_FALSE(prefix_ok(g, "{\t"));
  // Numbers are bounded.
  EXPECT_TRUE(accepts(g, "{\"n\": " + std::string(24, '7') + "}"));
  EXPECT_FALSE(prefix_ok(g, "{\"n\": " + std::string(25, '7')));
  EXPECT_TRUE(accepts(g, "{\"n\": 1.5e-99}"));
  EXPECT_FALSE(prefix_ok(g, "{\"n\": 1e400")) << "a finite double";
}

TEST(JsonConstraint, SchemaObjectsFollowTheirProperties) {
  auto g = JsonGrammar::from_schema(json::parse(R"({
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                   "ok": {"type": "boolean"}},
    "required": ["name", "ok"]})"));
  EXPECT_TRUE(accepts(g, R"({"name": "x", "ok": true})"));
  EXPECT_TRUE(accepts(g, R"({"name":"x","age":-3,"tags":["b","a"],"ok":false})"));
  EXPECT_TRUE(accepts(g, "{\n  \"name\": \"x\",\n  \"tags\": [],\n  \"ok\": true\n}"));
  EXPECT_FALSE(accepts(g, R"({"ok": true, "name": "x"})")) << "properties in the schema's order";
  EXPECT_FALSE(accepts(g, R"({"name": "x"})")) << "ok is required";
  EXPECT_FALSE(accepts(g, R"({"name": "x", "age": 1.5, "ok": true})")) << "an integer";
  EXPECT_FALSE(accepts(g, R"({"name": "x", "tags": ["c"], "ok": true})")) << "enum";
  EXPECT_FALSE(accepts(g, R"({"name": "x", "tags": ["a","a","a"], "ok": true})")) << "maxItems";
  EXPECT_FALSE(accepts(g, R"({"name": "x", "other": 1, "ok": true})")) << "no other keys";
  EXPECT_FALSE(accepts(g, R"({"name": 1, "ok": true})"));
  EXPECT_TRUE(prefix_ok(g, R"({"nam)")) << "a prefix of a property name";
  EXPECT_FALSE(prefix_ok(g, R"({"ag)")) << "name is required first";
}

TEST(JsonConstraint, RefsAnyOfTypeListsAndAdditionalProperties) {
  auto g = JsonGrammar::from_schema(json::parse(R"({
    "$defs": {"node": {"type": "object", "properties": {
      "v": {"type": ["number", "null"]},
      "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}},
    "anyOf": [{"$ref": "#/$defs/node"}, {"const": "leaf"}, {"type": "object", "additionalProperties": {"type": "integer"}}]})"));
  EXPECT_TRUE(accepts(g, R"({"v": 1, "kids": [{"v": null}, {"v": 2e3, "kids": []}]})"));
  EXPECT_TRUE(accepts(g, R"("leaf")"));
  EXPECT_TRUE(accepts(g, R"({"x": 1, "y": 2})"));
  EXPECT_TRUE(accepts(g, R"({})"));
  EXPECT_FALSE(accepts(g, R"({"x": "s"})"));
  EXPECT_FALSE(accepts(g, R"("lea")"));
  EXPECT_FALSE(accepts(g, R"({"v": 1, "kids": [{"w": 1}]})"));
  // Numbers and enum values end where the next byte says so.
  auto n = JsonGrammar::from_schema(json::parse(R"({"enum": [1, 10, 100]})"));
  EXPECT_TRUE(accepts(n, "1"));
  EXPECT_TRUE(accepts(n, "10 "));
  EXPECT_FALSE(accepts(n, "1000"));
  auto arr = JsonGrammar::from_schema(
      json::parse(R"({"type": "array", "items": {"type": "integer"}, "minItems": 2})"));
  EXPECT_TRUE(accepts(arr, "[1,22]"));
  EXPECT_FALSE(accepts(arr, "[1]"));
  EXPECT_TRUE(accepts(JsonGrammar::from_schema(json::parse("{}")), "\"any\""));
  EXPECT_TRUE(accepts(
      JsonGrammar::from_schema(
          json::parse(R"({"$ref": "#/definitions/s", "definitions": {"s": {"type": "string"}}})")),
      "\"s\""));
}

TEST(JsonConstraint, UnsupportedSchemasAreRefusedByName) {
  auto msg = [](const char* schema) {
    try {
      JsonGrammar::from_schema(json::parse(schema));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(msg(R"({"type": "object", "properties": {"a": {"type": "strin"}}})"),
            "schema.properties.a.type: 'strin' is not a JSON Schema type");
  EXPECT_EQ(msg(R"({"properties": {"a": {"$ref": "http://x"}}})")
                .rfind("schema.properties.a.$ref: 'http://x' is not supported", 0),
            0u);
  EXPECT_EQ(msg(R"({"type": "object", "properties": {"a": {}}, "required": ["b"]})"),
            "schema.required: 'b' is not one of the properties");
  EXPECT_EQ(msg(R"({"allOf": [{}, {}]})"), "schema.allOf: only a list of one schema is supported");
  EXPECT_EQ(msg("false"), "schema: the schema false allows nothing");
  EXPECT_EQ(msg(R"({"type": "array", "minItems": 3, "maxItems": 1})"),
            "schema: minItems is larger than maxItems");
  EXPECT_EQ(
      msg(R"({"type": "object", "properties": {"a": {"type": "string", "pattern": "x+", "format": "date"}}})"),
      "accepted")
      << "string bounds are not enforced, but not refused";
}

// Property: for the schema {} (any value), texts a strict parser reads are
// accepted when they are within the grammar's limits, and every accepted
// text parses. Random values serialised compactly and indented, then
// random one-byte edits of them.
TEST(JsonConstraint, AgreesWithAStrictParser) {
  auto any = JsonGrammar::from_schema(json::object());
  std::mt19937 rng(5);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint32_t>(n)); };
  std::function<json(int)> value = [&](int depth) -> json {
    switch (depth > 3 ? pick(5) : pick(7)) {
      case 0:
        return nullptr;
      case 1:
        return pick(2) == 1;
      case 2:
        return pick(2000) - 1000;
      case 3:
        return (pick(200000) - 100000) / 64.0;
      case 4: {
        std::string t;
        const char* parts[] = {"a",    "\"",       "\\",           "\n",
                               "\x01", "\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80",
                               " ",    "/"};
        for (int i = pick(6); i > 0; --i) t += parts[pick(10)];
        return t;
      }
      case 5: {
        json a = json::array();
        for (int i = pick(4); i > 0; --i) a.push_back(value(depth + 1));
        return a;
      }
      default: {
        json o = json::object();
        for (int i = pick(4); i > 0; --i) o["k" + std::to_string(pick(5))] = value(depth + 1);
        return o;
      }
    }
  };
  int accepted_edits = 0;
  for (int n = 0; n < 2000; ++n) {
    const json v = value(0);
    for (const std::string& text : {v.dump(), v.dump(2)}) {
      EXPECT_TRUE(accepts(any, text)) << text;
      for (int e = 0; e < 8; ++e) {
        std::string t = text;
        const size_t at = static_cast<size_t>(pick(static_cast<int>(t.size()) + 1));
        const char bytes[] = "{}[],:\"\\ 0-.eE+tfnu\x01\x80\xc3";
        const char b = bytes[pick(static_cast<int>(sizeof bytes) - 1)];
        switch (pick(3)) {
          case 0:
            t.insert(at, 1, b);
            break;
          case 1:
            if (at < t.size()) t.erase(at, 1);
            break;
          default:
            if (at < t.size()) t[at] = b;
            break;
        }
        if (accepts(any, t)) {
          ++accepted_edits;
          EXPECT_FALSE(json::parse(t, nullptr, false).is_discarded())
              << "accepted but not JSON: "
              << json(t).dump(-1, ' ', true, json::error_handler_t::replace);
        }
      }
    }
  }
  EXPECT_GT(accepted_edits, 500) << "the edits should leave many texts valid";
}

// The mask from the trie walk equals feeding every token's bytes one by one.
// The matcher's token mask against feeding every token's bytes one by one.
void expect_mask_is_exact(const TokenTrie& trie, const JsonMatcher& m, const std::string& label) {
  std::vector<uint8_t> mask;
  m.allowed_tokens(trie, mask);
  int allowed = 0, mismatches = 0;
  for (int id = 0; id < trie.vocab_size(); ++id) {
    const std::string_view b = trie.bytes(id);
    const bool want = !b.empty() && m.can_feed(b);
    allowed += mask[static_cast<size_t>(id)];
    if (want != (mask[static_cast<size_t>(id)] != 0) && mismatches++ < 5)
      ADD_FAILURE() << "prefix '" << label << "' token " << id << " '" << b << "' want " << want;
  }
  EXPECT_GT(allowed, 0) << label;
}

TEST(JsonConstraint, TokenMaskEqualsFeedingEachToken) {
  static const Tokenizer tok = Tokenizer::from_dir(LILY_FIXTURES_DIR "/tokenizer");
  const int V = tok.vocab_size();
  auto trie = TokenTrie::build(tok, V);
  auto g = JsonGrammar::from_schema(json::parse(R"({"type": "object", "properties": {
    "title": {"type": "string"}, "n": {"type": "number"}, "kind": {"enum": ["alpha", "beta"]}},
    "required": ["title", "n", "kind"]})"));
  const char* prefixes[] = {"",
                            " ",
                            "{",
                            "{\"",
                            "{\"ti",
                            "{\"title\": \"ab",
                            "{\"title\": \"a\\",
                            "{\"title\": \"\xe2\x82",
                            "{\"title\": \"x\", \"n\": 1",
                            "{\"title\": \"x\", \"n\": 1.5e",
                            "{\"title\": \"x\", \"n\": 0, \"kind\": \"al",
                            "{\"title\": \"x\", \"n\": 0, \"kind\": \"beta\""};
  for (const char* p : prefixes) {
    JsonMatcher m(g);
    ASSERT_TRUE(m.feed(p)) << p;
    expect_mask_is_exact(*trie, m, p);
  }
  std::vector<uint8_t> mask;
  // Added tokens (<|im_end|>, <think>) are never allowed: stop tokens are the caller's.
  JsonMatcher m(g);
  m.feed("{\"title\": \"");
  m.allowed_tokens(*trie, mask);
  for (int id : tok.special_ids()) EXPECT_EQ(mask[static_cast<size_t>(id)], 0) << id;
}

const json kTools = json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["city"]}}},
  {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
    "properties": {}, "additionalProperties": false}}}])");

// Feeds text; true when it was taken and the call ended (released).
bool released_after(const std::shared_ptr<const JsonGrammar>& g, std::string_view text) {
  JsonMatcher m(g);
  return m.feed(text) && m.released();
}

TEST(JsonConstraint, HermesToolCallsFollowTheToolsSchemas) {
  auto g = JsonGrammar::tool_calls(kTools, ToolCallSyntax::Json);
  const std::string call = "\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}";
  EXPECT_TRUE(released_after(g, call));
  EXPECT_FALSE(released_after(g, call.substr(0, call.size() - 1)));  // the object is not closed
  EXPECT_TRUE(released_after(g, call + "\n</tool_call>"));           // free after the call
  EXPECT_TRUE(released_after(g, "\n{\"name\": \"get_time\", \"arguments\": {}}"));
  EXPECT_TRUE(released_after(g, "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\", \"unit\": \"celsius\"}}"));
  EXPECT_FALSE(prefix_ok(g, "\n{\"name\": \"get_wea \""));                         // not a tool's name
  EXPECT_FALSE(prefix_ok(g, "\n{\"arguments\": {}"));                             // the name first
  EXPECT_FALSE(prefix_ok(g, "\n{\"name\": \"get_weather\", \"arguments\": {}"));  // city is required
  EXPECT_FALSE(prefix_ok(g, "\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\", \"days\": 1.5"));
  EXPECT_FALSE(prefix_ok(g, "\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\", \"unit\": \"kelvin\""));
  EXPECT_FALSE(prefix_ok(g, "\n{\"name\": \"get_time\", \"arguments\": {\"city\""));  // get_time takes none
  EXPECT_FALSE(prefix_ok(g, "\n{\"name\": \"get_time\", \"arguments\": {}, \"x\""));  // no other keys
}

TEST(JsonConstraint, XmlToolCallsFollowTheToolsSchemas) {
  auto g = JsonGrammar::tool_calls(kTools, ToolCallSyntax::Xml);
  const std::string call =
      "\n<function=get_weather>\n<parameter=city>\nParis, <b>France</b>\n\xc3\xa9t\xc3\xa9\n</parameter>\n"
      "<parameter=days>\n3\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n"
      "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n</function>";
  EXPECT_FALSE(released_after(g, call.substr(0, call.size() - 1)));
  EXPECT_TRUE(released_after(g, call));
  EXPECT_TRUE(released_after(g, call + "\n</tool_call>\n<tool_call>"));
  EXPECT_TRUE(released_after(g, "<function=get_weather>\n<parameter=city>\n\n</parameter>\n</function>"));
  EXPECT_TRUE(released_after(g, "<function=get_time>\n</function>"));
  EXPECT_FALSE(prefix_ok(g, "<function=get_weathe>"));                          // not a tool
  EXPECT_FALSE(prefix_ok(g, "<function=get_weather>\n</function>"));            // city is required
  EXPECT_FALSE(prefix_ok(g, "<function=get_weather>\n<parameter=country>"));    // not a parameter
  EXPECT_FALSE(prefix_ok(g, "<function=get_weather>\n<parameter=city>\nx\n</parameter>\n<parameter=days>\nthree"));
  EXPECT_FALSE(prefix_ok(g, "<function=get_weather>\n<parameter=city>\nx\n</parameter>\n<parameter=unit>\nkelvin"));
  EXPECT_FALSE(prefix_ok(g, "<function=get_weather>\n<parameter=city>\nx\xff"));  // broken UTF-8
  // Parameters in the schema's order, each at most once.
  EXPECT_FALSE(prefix_ok(g, "<function=get_weather>\n<parameter=city>\nx\n</parameter>\n<parameter=days>\n1\n"
                            "</parameter>\n<parameter=city>"));
  EXPECT_FALSE(prefix_ok(g, "<function=get_time>\n<parameter="));
  // Free-form parameters cannot be written in this syntax.
  EXPECT_THROW(JsonGrammar::tool_calls(json::parse(R"([{"type": "function", "function": {"name": "f",
      "parameters": {"type": "object"}}}])"), ToolCallSyntax::Xml), Error);
  EXPECT_NO_THROW(JsonGrammar::tool_calls(json::parse(R"([{"type": "function", "function": {"name": "f",
      "parameters": {"type": "object"}}}])"), ToolCallSyntax::Json));
  EXPECT_THROW(JsonGrammar::tool_calls(json::parse(R"([{"type": "function", "function": {"name": "f",
      "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}])"), ToolCallSyntax::Json), Error);
}

TEST(JsonConstraint, ToolCallTokenMaskEqualsFeedingEachToken) {
  static const Tokenizer tok = Tokenizer::from_dir(LILY_FIXTURES_DIR "/tokenizer");
  const int V = tok.vocab_size();
  auto trie = TokenTrie::build(tok, V);
  struct Case {
    ToolCallSyntax syntax;
    const char* prefix;
  } cases[] = {
      {ToolCallSyntax::Xml, ""},
      {ToolCallSyntax::Xml, "\n<function=get_"},
      {ToolCallSyntax::Xml, "\n<function=get_weather>\n<parameter=city>\n"},
      {ToolCallSyntax::Xml, "\n<function=get_weather>\n<parameter=city>\nPar"},
      {ToolCallSyntax::Xml, "\n<function=get_weather>\n<parameter=city>\nPar\n</para"},
      {ToolCallSyntax::Xml, "\n<function=get_weather>\n<parameter=city>\nP\xc3"},
      {ToolCallSyntax::Xml, "\n<function=get_weather>\n<parameter=city>\nP\n</parameter>\n"},
      {ToolCallSyntax::Xml, "\n<function=get_weather>\n<parameter=city>\nP\n</parameter>\n<parameter=days>\n1"},
      {ToolCallSyntax::Xml, "\n<function=get_time>\n</function"},
      {ToolCallSyntax::Json, "\n{\"name\": \"get_"},
      {ToolCallSyntax::Json, "\n{\"name\": \"get_time\", \"arguments\": {}"},
  };
  for (const auto& c : cases) {
    auto g = JsonGrammar::tool_calls(kTools, c.syntax);
    JsonMatcher m(g);
    ASSERT_TRUE(m.feed(c.prefix)) << c.prefix;
    expect_mask_is_exact(*trie, m, c.prefix);
  }
}

}  // namespace
}  // namespace lily::text
