// Constrained decoding for JSON output (response_format json_object /
// json_schema): a JSON Schema compiled into a byte-level grammar, a matcher
// that follows the output byte by byte, and the set of vocabulary tokens
// that may come next, found by walking a trie of the tokens' bytes with the
// matcher's state.
//
// The grammar is JSON (RFC 8259, UTF-8 checked strictly, as a strict parser
// reads it) narrowed by the schema:
//   type (one or a list), properties (written in the schema's order, optional
//   ones may be left out, required ones may not), required,
//   additionalProperties (false, true or a schema; when properties are given
//   and additionalProperties is not, no other key is allowed), items,
//   minItems, maxItems, enum, const, anyOf / oneOf (as anyOf), allOf of one
//   schema, $ref to "#", "#/$defs/..." or "#/definitions/...", boolean
//   schemas (true: any value).
// Not enforced (accepted and ignored): string and number bounds (minLength,
// maxLength, pattern, format, minimum, maximum, multipleOf), uniqueItems,
// annotations. Refused with a message naming the place: false schemas,
// allOf of several schemas, prefixItems, unknown types, remote or JSON
// pointer refs other than the above, objects with more than 64 properties.
//
// Limits that keep every output finite and every state small: whitespace
// between tokens as JSON writers put it (none, one space, or one newline and
// up to 20 spaces or tabs of indentation), numbers of at most 24 characters
// with at most 2 exponent digits (so every number is a finite double),
// nesting at most 64 deep.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace lily::text {

class Tokenizer;

// How a model writes a tool call after its "<tool_call>" (text/output_parser.h):
// Json (Hermes, Qwen3): {"name": "f", "arguments": {...}}; Xml (Qwen3.5+):
// <function=f>\n<parameter=p>\nVALUE\n</parameter>\n...</function>.
enum class ToolCallSyntax { Json, Xml };

// Whether a schema's "type" (a name or a list of them) includes "string":
// such a parameter is raw text in the XML syntax (the parser keeps it a
// string, text/output_parser.h; the grammar lets it be any text).
template <class Json>
bool schema_type_is_string(const Json& type) {
  if (type.is_string()) return type.template get<std::string>() == "string";
  if (type.is_array())
    for (const auto& t : type)
      if (t.is_string() && t.template get<std::string>() == "string") return true;
  return false;
}

class JsonGrammar {
 public:
  // Throws lily::Error naming the unsupported or malformed part
  // ("schema.properties.age.type: ..."). Properties keep the order they
  // have in `schema` (hence an ordered_json).
  static std::shared_ptr<const JsonGrammar> from_schema(const nlohmann::ordered_json& schema);
  // Any JSON object (response_format json_object).
  static std::shared_ptr<const JsonGrammar> any_object();
  // One tool call's body, from the "\n" after "<tool_call>" to the end of
  // the call's value (Json: the object's "}"; Xml: "</function>"), where the
  // matcher is released(): what follows ("\n</tool_call>", more calls, the
  // end) is free again. The name is one of the tools' (OpenAI "tools":
  // [{"type": "function", "function": {"name", "parameters"}}]) and the
  // arguments follow that tool's parameter schema, with its properties in
  // the schema's order (optional ones may be left out). Xml: a parameter
  // typed "string" (or a list with "string") is raw text up to
  // "\n</parameter>" (or one of its enum values, unquoted); any other is
  // JSON of its schema. Throws lily::Error naming the unsupported part
  // ("tools[1].function.parameters...": as from_schema, plus, for Xml, free-
  // form parameters: no properties and additionalProperties not false).
  static std::shared_ptr<const JsonGrammar> tool_calls(const nlohmann::ordered_json& tools,
                                                       ToolCallSyntax syntax);

  struct Prop {
    std::string key;  // the key as written between the quotes (JSON-escaped)
    int node = 0;
    bool required = false;
  };
  struct Node {
    // Booleans and null are Literal nodes. Beyond JSON (tool calls): Seq
    // (alts matched one after another), Text (raw UTF-8 text ending with
    // texts[0], which is part of it), Release (anything from here on), Empty.
    enum Kind : uint8_t { Any, Object, Array, String, Number, Integer, Literal, AnyOf, Seq, Text, Release, Empty };
    Kind kind = Any;
    std::vector<Prop> props;  // Object
    int additional = -1;      // Object: node of other keys' values; -1: none
    int items = 0;            // Array: node of the elements (0: any)
    int min_items = 0, max_items = 1 << 30;
    std::vector<std::string> texts;  // Literal: the allowed values' JSON, sorted
    std::vector<int> alts;           // AnyOf, Seq
  };
  const Node& node(int i) const { return nodes_[static_cast<size_t>(i)]; }
  int root() const { return root_; }

 private:
  friend struct SchemaCompiler;
  // 0: any value, 1: any object, 2: any array, 3: the literals true / false / null
  std::vector<Node> nodes_;
  int root_ = 0;
};

// The vocabulary as a trie of token bytes, built once per tokenizer. Added
// tokens (special or not: <|im_end|>, <think>, ...) are left out: stop
// tokens are handled by the caller.
class TokenTrie {
 public:
  static std::shared_ptr<const TokenTrie> build(const Tokenizer& tokenizer, int vocab_size);

  struct Edge {
    uint8_t byte;
    int child;
  };
  struct Node {
    int first_edge = 0, num_edges = 0;    // into edges_
    int first_token = 0, num_tokens = 0;  // into tokens_: ids ending here
  };
  int vocab_size() const { return vocab_; }
  std::string_view bytes(int id) const;

 private:
  friend class JsonMatcher;
  struct Trie {
    std::vector<Node> nodes;
    std::vector<Edge> edges;
    std::vector<int> tokens;
  };
  static Trie make(const std::vector<std::string>& bytes, const std::vector<int>& ids);
  int vocab_ = 0;
  std::vector<std::string> bytes_;  // per id ("" for left-out ids)
  Trie all_;                        // every token
  Trie not_plain_;                  // tokens that are not plain string content
  std::vector<int> plain_;  // tokens that are: printable, no '"' or '\', whole UTF-8 characters
  Trie not_text_;           // tokens that are not plain Text content
  std::vector<int> text_;   // tokens that are: no '\n', whole UTF-8 characters
};

// Follows an output byte by byte.
class JsonMatcher {
 public:
  explicit JsonMatcher(std::shared_ptr<const JsonGrammar> grammar);
  ~JsonMatcher();
  JsonMatcher(const JsonMatcher&) = delete;
  JsonMatcher& operator=(const JsonMatcher&) = delete;

  // Consumes bytes; false (and no change) if the grammar does not allow them.
  bool feed(std::string_view bytes);
  // Whether feed(bytes) would succeed (the state does not change).
  bool can_feed(std::string_view bytes) const;
  // Whether the output so far is a complete value of the grammar.
  bool accepting() const;
  // Whether the output has reached a Release (tool_calls: the call ended).
  bool released() const;
  // mask[id] = 1 for every token whose bytes may come next (others 0);
  // mask has trie.vocab_size() entries.
  void allowed_tokens(const TokenTrie& trie, std::vector<uint8_t>& mask) const;

  // The state as it is now, to come back to after feeding bytes ahead (a
  // speculative run's drafts); valid for the matcher's lifetime.
  struct Checkpoint;
  std::shared_ptr<const Checkpoint> checkpoint() const;
  void restore(const Checkpoint& c);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace lily::text
