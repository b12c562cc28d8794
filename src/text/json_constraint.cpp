#include "text/json_constraint.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>

#include "core/error.h"
#include "text/tokenizer.h"

namespace lily::text {

namespace {

constexpr int kMaxIndent = 20;  // spaces / tabs after a newline
constexpr int kMaxNumber = 24;  // characters of a number
constexpr int kMaxDepth = 64;   // nesting
constexpr int kMaxStacks = 64;  // alternatives followed at once (anyOf)
constexpr int kMaxProps = 64;   // properties of one object schema

bool is_ws(uint8_t c) {
  return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}
bool is_digit(uint8_t c) {
  return c >= '0' && c <= '9';
}
bool is_hex(uint8_t c) {
  return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

// UTF-8 as RFC 3629 has it (what a strict JSON parser accepts). State 0:
// between characters; else (continuation bytes left) | (range of the next
// one) << 2. Returns the next state, or -1.
int utf8_step(int st, uint8_t c) {
  if (st == 0) {
    if (c < 0x80) return 0;
    if (c < 0xC2) return -1;
    if (c < 0xE0) return 1;
    if (c == 0xE0) return 2 | (1 << 2);
    if (c == 0xED) return 2 | (2 << 2);
    if (c < 0xF0) return 2;
    if (c == 0xF0) return 3 | (3 << 2);
    if (c < 0xF4) return 3;
    if (c == 0xF4) return 3 | (4 << 2);
    return -1;
  }
  static constexpr uint8_t lo[5] = {0x80, 0xA0, 0x80, 0x90, 0x80},
                           hi[5] = {0xBF, 0xBF, 0x9F, 0xBF, 0x8F};
  const int r = st >> 2;
  if (c < lo[r] || c > hi[r]) return -1;
  return (st & 3) - 1;
}

// One byte of string content. phase: 0 plain, 1 after '\', 2..5 reading the
// 4 hex digits of \u (2 + digits read); u8: the UTF-8 state in phase 0, in
// the hex phases 1 when the code unit is a surrogate so far (refused: a
// strict parser rejects unpaired ones). Returns 0 (consumed), 1 (the closing
// quote) or -1.
int string_step(uint8_t& phase, uint8_t& u8, uint8_t c) {
  if (phase == 0) {
    if (u8 != 0) {
      const int r = utf8_step(u8, c);
      if (r < 0) return -1;
      u8 = static_cast<uint8_t>(r);
      return 0;
    }
    if (c == '"') return 1;
    if (c == '\\') {
      phase = 1;
      return 0;
    }
    if (c < 0x20) return -1;
    const int r = utf8_step(0, c);
    if (r < 0) return -1;
    u8 = static_cast<uint8_t>(r);
    return 0;
  }
  if (phase == 1) {
    if (std::strchr("\"\\/bfnrt", c) && c != 0) {
      phase = 0;
      return 0;
    }
    if (c == 'u') {
      phase = 2;
      return 0;
    }
    return -1;
  }
  if (!is_hex(c)) return -1;
  if (phase == 2) u8 = (c == 'd' || c == 'D') ? 1 : 0;
  if (phase == 3 && u8 == 1 && (c >= '8' || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')))
    return -1;
  if (phase == 3) u8 = 0;
  phase = phase == 5 ? 0 : static_cast<uint8_t>(phase + 1);
  return 0;
}

}  // namespace

// ------------------------------------------------------------------ grammar

struct SchemaCompiler {
  JsonGrammar& g;
  const nlohmann::ordered_json& root;
  std::map<std::string, int> refs;

  int add(JsonGrammar::Node n) {
    g.nodes_.push_back(std::move(n));
    return static_cast<int>(g.nodes_.size()) - 1;
  }

  static std::string key_text(const std::string& name) {
    std::string q = nlohmann::json(name).dump();
    return q.substr(1, q.size() - 2);
  }

  int literal(std::vector<std::string> texts) {
    std::sort(texts.begin(), texts.end());
    texts.erase(std::unique(texts.begin(), texts.end()), texts.end());
    JsonGrammar::Node n;
    n.kind = JsonGrammar::Node::Literal;
    n.texts = std::move(texts);
    return add(std::move(n));
  }

  int ref(const std::string& r, const std::string& where) {
    if (auto it = refs.find(r); it != refs.end()) return it->second;
    const nlohmann::ordered_json* target = nullptr;
    if (r == "#") {
      target = &root;
    } else {
      for (const char* base : {"#/$defs/", "#/definitions/"}) {
        const std::string b = base;
        if (r.rfind(b, 0) == 0) {
          const std::string name = r.substr(b.size());
          const std::string key = b.substr(2, b.size() - 3);
          if (root.is_object() && root.contains(key) && root[key].is_object() &&
              root[key].contains(name))
            target = &root[key][name];
        }
      }
    }
    if (!target)
      fail(where, ".$ref: '", r,
           "' is not supported (only '#', '#/$defs/NAME' and '#/definitions/NAME' of this schema)");
    // Reserve the node first: a schema may refer to itself.
    const int slot = add({});
    refs[r] = slot;
    const int body = compile(*target, r == "#" ? "schema" : "schema" + r.substr(1));
    JsonGrammar::Node alias;
    alias.kind = JsonGrammar::Node::AnyOf;
    alias.alts = {body};
    g.nodes_[static_cast<size_t>(slot)] = std::move(alias);
    return slot;
  }

  int compile_type(const std::string& type, const nlohmann::ordered_json& s,
                   const std::string& where) {
    using K = JsonGrammar::Node::Kind;
    JsonGrammar::Node n;
    if (type == "string") {
      n.kind = K::String;
    } else if (type == "number") {
      n.kind = K::Number;
    } else if (type == "integer") {
      n.kind = K::Integer;
    } else if (type == "boolean") {
      return literal({"true", "false"});
    } else if (type == "null") {
      return literal({"null"});
    } else if (type == "object") {
      n.kind = K::Object;
      const nlohmann::ordered_json* props = s.contains("properties") ? &s["properties"] : nullptr;
      if (props && !props->is_object()) fail(where, ".properties: expected an object");
      std::vector<std::string> required;
      if (s.contains("required")) {
        if (!s["required"].is_array()) fail(where, ".required: expected an array of names");
        for (const auto& r : s["required"]) {
          if (!r.is_string()) fail(where, ".required: expected an array of names");
          required.push_back(r.get<std::string>());
        }
      }
      if (props) {
        if (props->size() > static_cast<size_t>(kMaxProps))
          fail(where, ".properties: more than ", kMaxProps, " properties");
        for (auto it = props->begin(); it != props->end(); ++it) {
          JsonGrammar::Prop p;
          p.key = key_text(it.key());
          p.required = std::find(required.begin(), required.end(), it.key()) != required.end();
          p.node = -1;
          n.props.push_back(std::move(p));
        }
        for (const auto& r : required) {
          bool found = false;
          for (auto it = props->begin(); it != props->end(); ++it) found = found || it.key() == r;
          if (!found) fail(where, ".required: '", r, "' is not one of the properties");
        }
      } else if (!required.empty()) {
        fail(where, ".required: names properties, but the schema has none");
      }
      // Other keys: allowed when the schema says so, or when it lists no
      // properties and says nothing.
      int additional = -2;  // -2: decide below
      if (s.contains("additionalProperties")) {
        const auto& ap = s["additionalProperties"];
        if (ap.is_boolean()) additional = ap.get<bool>() ? 0 : -1;
      } else {
        additional = props && !props->empty() ? -1 : 0;
      }
      const int self = add(std::move(n));
      // Children after the node exists (add() may move the vector).
      if (props) {
        size_t i = 0;
        for (auto it = props->begin(); it != props->end(); ++it, ++i) {
          const int child = compile(it.value(), where + ".properties." + it.key());
          g.nodes_[static_cast<size_t>(self)].props[i].node = child;
        }
      }
      if (additional == -2)
        additional = compile(s["additionalProperties"], where + ".additionalProperties");
      g.nodes_[static_cast<size_t>(self)].additional = additional;
      return self;
    } else if (type == "array") {
      n.kind = K::Array;
      if (s.contains("prefixItems")) fail(where, ".prefixItems: not supported");
      auto count = [&](const char* k, int dflt) {
        if (!s.contains(k)) return dflt;
        if (!s[k].is_number_integer() || s[k].get<long long>() < 0 ||
            s[k].get<long long>() > (1 << 30))
          fail(where, ".", k, ": expected a non-negative integer");
        return static_cast<int>(s[k].get<long long>());
      };
      n.min_items = count("minItems", 0);
      n.max_items = count("maxItems", 1 << 30);
      if (n.min_items > n.max_items) fail(where, ": minItems is larger than maxItems");
      const int self = add(std::move(n));
      const int items = s.contains("items") ? compile(s["items"], where + ".items") : 0;
      g.nodes_[static_cast<size_t>(self)].items = items;
      return self;
    } else {
      fail(where, ".type: '", type, "' is not a JSON Schema type");
    }
    return add(std::move(n));
  }

  int compile(const nlohmann::ordered_json& s, const std::string& where) {
    if (s.is_boolean()) {
      if (!s.get<bool>()) fail(where, ": the schema false allows nothing");
      return 0;
    }
    if (!s.is_object()) fail(where, ": expected a schema (an object)");
    if (s.contains("$ref")) {
      if (!s["$ref"].is_string()) fail(where, ".$ref: expected a string");
      return ref(s["$ref"].get<std::string>(), where);
    }
    if (s.contains("const")) return literal({s["const"].dump()});
    if (s.contains("enum")) {
      if (!s["enum"].is_array() || s["enum"].empty())
        fail(where, ".enum: expected a non-empty array");
      std::vector<std::string> texts;
      for (const auto& v : s["enum"]) texts.push_back(v.dump());
      return literal(std::move(texts));
    }
    for (const char* k : {"anyOf", "oneOf"}) {
      if (!s.contains(k)) continue;
      if (!s[k].is_array() || s[k].empty()) fail(where, ".", k, ": expected a non-empty array");
      JsonGrammar::Node n;
      n.kind = JsonGrammar::Node::AnyOf;
      const int self = add(std::move(n));
      std::vector<int> alts;
      for (size_t i = 0; i < s[k].size(); ++i)
        alts.push_back(compile(s[k][i], where + "." + k + "[" + std::to_string(i) + "]"));
      g.nodes_[static_cast<size_t>(self)].alts = std::move(alts);
      return self;
    }
    if (s.contains("allOf")) {
      if (!s["allOf"].is_array() || s["allOf"].size() != 1)
        fail(where, ".allOf: only a list of one schema is supported");
      return compile(s["allOf"][0], where + ".allOf[0]");
    }
    if (s.contains("type")) {
      const auto& t = s["type"];
      if (t.is_string()) return compile_type(t.get<std::string>(), s, where);
      if (!t.is_array() || t.empty()) fail(where, ".type: expected a type name or a list of them");
      JsonGrammar::Node n;
      n.kind = JsonGrammar::Node::AnyOf;
      const int self = add(std::move(n));
      std::vector<int> alts;
      for (const auto& one : t) {
        if (!one.is_string()) fail(where, ".type: expected a type name or a list of them");
        alts.push_back(compile_type(one.get<std::string>(), s, where));
      }
      g.nodes_[static_cast<size_t>(self)].alts = std::move(alts);
      return self;
    }
    if (s.contains("properties") || s.contains("required") || s.contains("additionalProperties"))
      return compile_type("object", s, where);
    if (s.contains("items")) return compile_type("array", s, where);
    return 0;  // no constraint: any value
  }
};

namespace {
void add_builtins(std::vector<JsonGrammar::Node>& nodes) {
  using K = JsonGrammar::Node::Kind;
  nodes.resize(4);
  nodes[0].kind = K::Any;
  nodes[1].kind = K::Object;
  nodes[1].additional = 0;
  nodes[2].kind = K::Array;
  nodes[2].items = 0;
  nodes[3].kind = K::Literal;
  nodes[3].texts = {"false", "null", "true"};
}
}  // namespace

std::shared_ptr<const JsonGrammar> JsonGrammar::from_schema(const nlohmann::ordered_json& schema) {
  auto g = std::make_shared<JsonGrammar>();
  add_builtins(g->nodes_);
  SchemaCompiler c{*g, schema, {}};
  g->root_ = c.compile(schema, "schema");
  return g;
}

std::shared_ptr<const JsonGrammar> JsonGrammar::any_object() {
  auto g = std::make_shared<JsonGrammar>();
  add_builtins(g->nodes_);
  g->root_ = 1;
  return g;
}

namespace {

bool typed_string(const nlohmann::ordered_json& s) {
  return s.is_object() && s.contains("type") && schema_type_is_string(s["type"]);
}

}  // namespace

std::shared_ptr<const JsonGrammar> JsonGrammar::tool_calls(const nlohmann::ordered_json& tools,
                                                           ToolCallSyntax syntax) {
  using K = JsonGrammar::Node::Kind;
  auto g = std::make_shared<JsonGrammar>();
  add_builtins(g->nodes_);
  if (!tools.is_array() || tools.empty()) fail("tools: expected a non-empty array");
  // (Alternatives are followed at once, up to kMaxStacks of them.)
  if (tools.size() > 32) fail("tools: more than 32 tools");
  SchemaCompiler base{*g, tools, {}};  // nodes outside any tool's schema
  auto node = [&](K kind, std::vector<int> alts = {}, std::vector<std::string> texts = {}) {
    Node n;
    n.kind = kind;
    n.alts = std::move(alts);
    n.texts = std::move(texts);
    return base.add(std::move(n));
  };
  static const nlohmann::ordered_json kAnyObject = {{"type", "object"}};
  std::vector<int> calls;
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string where = "tools[" + std::to_string(i) + "].function";
    const auto& t = tools[i];
    if (!t.is_object() || !t.contains("function") || !t["function"].is_object() ||
        !t["function"].contains("name") || !t["function"]["name"].is_string())
      fail(where, ".name: missing");
    const auto& fn = t["function"];
    const std::string name = fn["name"].get<std::string>();
    const nlohmann::ordered_json& params =
        fn.contains("parameters") && !fn["parameters"].is_null() ? fn["parameters"] : kAnyObject;
    SchemaCompiler c{*g, params, {}};
    if (syntax == ToolCallSyntax::Json) {
      Node obj;
      obj.kind = K::Object;
      obj.additional = -1;
      obj.props.push_back({"name", c.literal({nlohmann::json(name).dump()}), true});
      obj.props.push_back({"arguments", -1, true});
      const int self = base.add(std::move(obj));
      const int args = c.compile(params, where + ".parameters");
      g->nodes_[static_cast<size_t>(self)].props[1].node = args;
      calls.push_back(self);
      continue;
    }
    std::vector<int> elems = {c.literal({"<function=" + name + ">\n"})};
    const std::string pw = where + ".parameters";
    if (!params.is_object()) fail(pw, ": expected an object schema");
    const nlohmann::ordered_json* props =
        params.contains("properties") && params["properties"].is_object() ? &params["properties"] : nullptr;
    const bool closed = params.contains("additionalProperties") && params["additionalProperties"] == false;
    if ((!props || props->empty()) && !closed)
      fail(pw, ": free-form parameters (no properties) cannot be constrained in the XML syntax");
    std::vector<std::string> required;
    if (params.contains("required") && params["required"].is_array())
      for (const auto& r : params["required"])
        if (r.is_string()) required.push_back(r.get<std::string>());
    if (props) {
      if (props->size() > 32) fail(pw, ".properties: more than 32 parameters");
      for (auto it = props->begin(); it != props->end(); ++it) {
        const auto& ps = it.value();
        const std::string pwhere = pw + ".properties." + it.key();
        int value;
        if (typed_string(ps) && ps.contains("enum") && ps["enum"].is_array() && !ps["enum"].empty()) {
          std::vector<std::string> texts;
          for (const auto& v : ps["enum"]) {
            if (!v.is_string()) fail(pwhere, ".enum: a string parameter's values must be strings");
            texts.push_back(v.get<std::string>() + "\n</parameter>\n");
          }
          value = c.literal(std::move(texts));
        } else if (typed_string(ps)) {
          value = node(K::Seq, {node(K::Text, {}, {"\n</parameter>"}), c.literal({"\n"})});
        } else {
          value = node(K::Seq, {c.compile(ps, pwhere), c.literal({"\n</parameter>\n"})});
        }
        int param = node(K::Seq, {c.literal({"<parameter=" + it.key() + ">\n"}), value});
        if (std::find(required.begin(), required.end(), it.key()) == required.end())
          param = node(K::AnyOf, {param, node(K::Empty)});
        elems.push_back(param);
      }
    }
    elems.push_back(c.literal({"</function>"}));
    elems.push_back(node(K::Release));
    calls.push_back(node(K::Seq, std::move(elems)));
  }
  const int any_call = node(K::AnyOf, calls);
  g->root_ = syntax == ToolCallSyntax::Json ? node(K::Seq, {any_call, node(K::Release)}) : any_call;
  return g;
}

// --------------------------------------------------------------------- trie

TokenTrie::Trie TokenTrie::make(const std::vector<std::string>& bytes,
                                const std::vector<int>& ids) {
  std::vector<int> order = ids;
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return bytes[static_cast<size_t>(a)] < bytes[static_cast<size_t>(b)];
  });
  std::vector<std::vector<Edge>> children(1);
  std::vector<std::vector<int>> ends(1);
  std::vector<int> path = {0};  // node at each depth of the previous token
  const std::string* prev = nullptr;
  for (int id : order) {
    const std::string& b = bytes[static_cast<size_t>(id)];
    size_t common = 0;
    if (prev) {
      const size_t n = std::min(prev->size(), b.size());
      while (common < n && (*prev)[common] == b[common]) ++common;
    }
    path.resize(common + 1);
    for (size_t i = common; i < b.size(); ++i) {
      const int node = static_cast<int>(children.size());
      children.emplace_back();
      ends.emplace_back();
      children[static_cast<size_t>(path.back())].push_back({static_cast<uint8_t>(b[i]), node});
      path.push_back(node);
    }
    ends[static_cast<size_t>(path.back())].push_back(id);
    prev = &b;
  }
  Trie t;
  t.nodes.resize(children.size());
  for (size_t i = 0; i < children.size(); ++i) {
    t.nodes[i].first_edge = static_cast<int>(t.edges.size());
    t.nodes[i].num_edges = static_cast<int>(children[i].size());
    t.edges.insert(t.edges.end(), children[i].begin(), children[i].end());
    t.nodes[i].first_token = static_cast<int>(t.tokens.size());
    t.nodes[i].num_tokens = static_cast<int>(ends[i].size());
    t.tokens.insert(t.tokens.end(), ends[i].begin(), ends[i].end());
  }
  return t;
}

std::shared_ptr<const TokenTrie> TokenTrie::build(const Tokenizer& tokenizer, int vocab_size) {
  auto t = std::make_shared<TokenTrie>();
  t->vocab_ = vocab_size;
  t->bytes_.resize(static_cast<size_t>(vocab_size));
  std::vector<int> all, not_plain, not_text;
  for (int id = 0; id < vocab_size; ++id) {
    if (id >= tokenizer.vocab_size() || tokenizer.is_added(id)) continue;
    const std::string_view b = tokenizer.token_bytes(id);
    if (b.empty()) continue;
    t->bytes_[static_cast<size_t>(id)] = std::string(b);
    all.push_back(id);
    int st = 0;
    bool plain = true;
    for (unsigned char c : b) {
      if (c < 0x20 || c == '"' || c == '\\') plain = false;
      st = plain ? utf8_step(st, c) : st;
      if (st < 0) plain = false;
      if (!plain) break;
    }
    if (plain && st == 0)
      t->plain_.push_back(id);
    else
      not_plain.push_back(id);
    // Text content (tool_calls' raw values): no newline (the terminator's
    // start), whole UTF-8 characters.
    st = 0;
    for (unsigned char c : b)
      if (st >= 0) st = (c == '\n' || c == 0) ? -1 : utf8_step(st, c);
    if (st == 0)
      t->text_.push_back(id);
    else
      not_text.push_back(id);
  }
  t->all_ = make(t->bytes_, all);
  t->not_plain_ = make(t->bytes_, not_plain);
  t->not_text_ = make(t->bytes_, not_text);
  return t;
}

std::string_view TokenTrie::bytes(int id) const {
  if (id < 0 || id >= vocab_) return {};
  return bytes_[static_cast<size_t>(id)];
}

// ------------------------------------------------------------------ matcher

namespace {

enum FrameKind : uint8_t { F_ROOT, F_OBJECT, F_KEY, F_ARRAY, F_STRING, F_NUMBER, F_LITERAL, F_SEQ, F_TEXT, F_RELEASED };
// Seq phases (a: the element matched or next).
enum : uint8_t { S_READY, S_INVALUE };
// Object phases.
enum : uint8_t { O_OPEN, O_KEYNEXT, O_COLON, O_VALUE, O_INVALUE, O_AFTER };
// Array phases.
enum : uint8_t { A_OPEN, A_NEXT, A_INVALUE, A_AFTER };
// Root phases.
enum : uint8_t { R_BEFORE, R_INVALUE, R_AFTER };

struct Frame {
  uint8_t kind = F_ROOT, phase = 0, ws = 0, u8 = 0;
  int32_t node = 0;
  int32_t a = 0, b = 0;  // object: next property, current one; array: count;
                         // number: length, integer?; literal: position, lo; key: position, free?
  uint64_t mask = 0;     // key: candidate properties; literal: hi
};

struct FNode {
  Frame f;
  const FNode* up;
  int depth;
};

class Arena {
 public:
  const FNode* make(const Frame& f, const FNode* up) {
    if (used_ == kBlock) {
      if (++block_ == blocks_.size()) blocks_.push_back(std::make_unique<FNode[]>(kBlock));
      used_ = 0;
    }
    FNode* n = &blocks_[block_][used_++];
    n->f = f;
    n->up = up;
    n->depth = up ? up->depth + 1 : 0;
    return n;
  }
  void reset() {
    block_ = 0;
    used_ = blocks_.empty() ? kBlock : 0;
    if (blocks_.empty()) {
      blocks_.push_back(std::make_unique<FNode[]>(kBlock));
      used_ = 0;
    }
  }
  Arena() { reset(); }

 private:
  static constexpr size_t kBlock = 1024;
  std::vector<std::unique_ptr<FNode[]>> blocks_;
  size_t block_ = 0, used_ = 0;
};

struct Stacks {
  int n = 0;
  const FNode* s[kMaxStacks];
  void add(const FNode* p) {
    if (n < kMaxStacks) s[n++] = p;
  }
};

bool number_complete(uint8_t phase) {
  return phase == 2 || phase == 3 || phase == 5 || phase == 8;
}

}  // namespace

struct JsonMatcher::Impl {
  std::shared_ptr<const JsonGrammar> g;
  Arena persist, scratch;
  Stacks cur;

  const JsonGrammar::Node& node(int i) const { return g->node(i); }

  // The parent after its child value ended.
  const FNode* done(const FNode* parent, Arena& ar) const {
    Frame f = parent->f;
    f.ws = 0;
    switch (f.kind) {
      case F_ROOT:
        f.phase = R_AFTER;
        break;
      case F_OBJECT:
        f.phase = O_AFTER;
        break;
      case F_ARRAY:
        f.phase = A_AFTER;
        f.a++;
        break;
      case F_SEQ:
        f.phase = S_READY;
        f.a++;
        break;
      default:
        break;
    }
    return ar.make(f, parent->up);
  }

  // Whitespace where the frame allows it.
  // Whitespace where the frame allows it, as JSON writers put it: one
  // space, or one newline and up to kMaxIndent spaces / tabs. f.ws: 0 none
  // yet, 1 a space, 2 + n a newline and n indent characters.
  static bool take_ws(const FNode* s, uint8_t c, Stacks& out, Arena& ar) {
    if (!is_ws(c)) return false;
    const uint8_t w = s->f.ws;
    int next = -1;
    if (c == ' ' && w == 0)
      next = 1;
    else if (c == '\n' && w == 0)
      next = 2;
    else if ((c == ' ' || c == '\t') && w >= 2 && w - 2 < kMaxIndent)
      next = w + 1;
    if (next >= 0) {
      Frame f = s->f;
      f.ws = static_cast<uint8_t>(next);
      out.add(ar.make(f, s->up));
    }
    return true;
  }

  uint64_t key_candidates(const JsonGrammar::Node& obj, int next) const {
    uint64_t m = 0;
    for (int k = next; k < static_cast<int>(obj.props.size()); ++k) {
      m |= uint64_t{1} << k;
      if (obj.props[static_cast<size_t>(k)].required) break;
    }
    return m;
  }
  static bool required_left(const JsonGrammar::Node& obj, int next) {
    for (size_t k = static_cast<size_t>(next); k < obj.props.size(); ++k)
      if (obj.props[k].required) return true;
    return false;
  }

  void start_key(const FNode* obj_stack, const Frame& obj_frame, Stacks& out, Arena& ar) const {
    const JsonGrammar::Node& obj = node(obj_frame.node);
    Frame k;
    k.kind = F_KEY;
    k.node = obj_frame.node;
    k.mask = key_candidates(obj, obj_frame.a);
    k.b = obj.additional >= 0 ? 1 : 0;
    if (k.mask == 0 && k.b == 0) return;
    Frame o = obj_frame;
    o.ws = 0;
    o.phase = O_COLON;  // where the object resumes once the key is read
    out.add(ar.make(k, ar.make(o, obj_stack->up)));
  }

  // hops: anyOf expansions so far (a schema may refer to itself).
  void start_value(const FNode* parent, int n, uint8_t c, Stacks& out, Arena& ar,
                   int hops = 0) const {
    if (parent->depth >= kMaxDepth || hops > 32) return;
    const JsonGrammar::Node& nd = node(n);
    using K = JsonGrammar::Node::Kind;
    Frame f;
    f.node = n;
    switch (nd.kind) {
      case K::AnyOf:
        for (int alt : nd.alts) start_value(parent, alt, c, out, ar, hops + 1);
        return;
      case K::Any:
        if (c == '{')
          start_value(parent, 1, c, out, ar);
        else if (c == '[')
          start_value(parent, 2, c, out, ar);
        else if (c == '"') {
          f.kind = F_STRING;
          out.add(ar.make(f, parent));
        } else if (c == '-' || is_digit(c)) {
          f.kind = F_NUMBER;
          step(ar.make(f, parent), c, out, ar);
        } else if (c == 't' || c == 'f' || c == 'n') {
          start_value(parent, 3, c, out, ar);
        }
        return;
      case K::Object:
      case K::Array:
      case K::String: {
        // Opened by their first byte; O_OPEN, A_OPEN and a string's plain phase are all 0.
        static constexpr struct {
          uint8_t open, kind;
        } kOpen[] = {{'{', F_OBJECT}, {'[', F_ARRAY}, {'"', F_STRING}};
        const auto& o = kOpen[nd.kind == K::Object ? 0 : nd.kind == K::Array ? 1 : 2];
        if (c != o.open) return;
        f.kind = o.kind;
        out.add(ar.make(f, parent));
        return;
      }
      case K::Number:
      case K::Integer:
        f.kind = F_NUMBER;
        f.b = nd.kind == K::Integer;
        step(ar.make(f, parent), c, out, ar);
        return;
      case K::Literal:
        f.kind = F_LITERAL;
        f.a = 0;
        f.b = 0;
        f.mask = nd.texts.size();
        step(ar.make(f, parent), c, out, ar);
        return;
      case K::Seq:
        f.kind = F_SEQ;
        f.phase = S_READY;
        f.a = 0;
        step(ar.make(f, parent), c, out, ar);
        return;
      case K::Text:
        f.kind = F_TEXT;
        step(ar.make(f, parent), c, out, ar);
        return;
      case K::Release:
        f.kind = F_RELEASED;
        out.add(ar.make(f, parent));
        return;
      case K::Empty:
        step(done(parent, ar), c, out, ar);
        return;
    }
  }

  void step(const FNode* s, uint8_t c, Stacks& out, Arena& ar) const {
    const Frame& f = s->f;
    switch (f.kind) {
      case F_ROOT:
        if (f.phase == R_BEFORE) {
          if (take_ws(s, c, out, ar)) return;
          Frame r = f;
          r.ws = 0;
          r.phase = R_INVALUE;
          start_value(ar.make(r, s->up), g->root(), c, out, ar);
        } else if (f.phase == R_AFTER) {
          take_ws(s, c, out, ar);
        }
        return;
      case F_OBJECT: {
        const JsonGrammar::Node& obj = node(f.node);
        switch (f.phase) {
          case O_OPEN:
            if (take_ws(s, c, out, ar)) return;
            if (c == '"')
              start_key(s, f, out, ar);
            else if (c == '}' && !required_left(obj, f.a))
              out.add(done(s->up, ar));
            return;
          case O_KEYNEXT:
            if (take_ws(s, c, out, ar)) return;
            if (c == '"') start_key(s, f, out, ar);
            return;
          case O_COLON:
            if (take_ws(s, c, out, ar)) return;
            if (c == ':') {
              Frame o = f;
              o.ws = 0;
              o.phase = O_VALUE;
              out.add(ar.make(o, s->up));
            }
            return;
          case O_VALUE: {
            if (take_ws(s, c, out, ar)) return;
            Frame o = f;
            o.ws = 0;
            o.phase = O_INVALUE;
            const int vn = f.b >= 0 ? obj.props[static_cast<size_t>(f.b)].node : obj.additional;
            start_value(ar.make(o, s->up), vn, c, out, ar);
            return;
          }
          case O_AFTER:
            if (take_ws(s, c, out, ar)) return;
            if (c == ',') {
              if (obj.additional >= 0 || f.a < static_cast<int>(obj.props.size())) {
                Frame o = f;
                o.ws = 0;
                o.phase = O_KEYNEXT;
                out.add(ar.make(o, s->up));
              }
            } else if (c == '}' && !required_left(obj, f.a)) {
              out.add(done(s->up, ar));
            }
            return;
          default:
            return;
        }
      }
      case F_KEY: {
        const JsonGrammar::Node& obj = node(f.node);
        const size_t pos = static_cast<size_t>(f.a);
        if (c == '"' && f.phase == 0 && f.u8 == 0) {
          // The key ends: a declared property typed in full, else another key.
          for (int k = 0; k < static_cast<int>(obj.props.size()); ++k) {
            if (!(f.mask >> k & 1) || obj.props[static_cast<size_t>(k)].key.size() != pos) continue;
            Frame o = s->up->f;  // the object, at O_COLON
            o.a = k + 1;
            o.b = k;
            out.add(ar.make(o, s->up->up));
            return;
          }
          if (f.b) {
            Frame o = s->up->f;
            o.b = -1;
            out.add(ar.make(o, s->up->up));
          }
          return;
        }
        Frame k = f;
        k.a++;
        k.mask = 0;
        for (int i = 0; i < static_cast<int>(obj.props.size()); ++i) {
          if (!(f.mask >> i & 1)) continue;
          const std::string& key = obj.props[static_cast<size_t>(i)].key;
          if (key.size() > pos && static_cast<uint8_t>(key[pos]) == c) k.mask |= uint64_t{1} << i;
        }
        if (k.b) {
          uint8_t ph = f.phase, u = f.u8;
          if (string_step(ph, u, c) != 0) {
            k.b = 0;
          } else {
            k.phase = ph;
            k.u8 = u;
          }
        }
        // Declared keys are matched byte for byte; the string state only
        // matters for other keys, so it may go stale once those are out.
        if (k.mask != 0 || k.b) out.add(ar.make(k, s->up));
        return;
      }
      case F_ARRAY: {
        const JsonGrammar::Node& arr = node(f.node);
        auto value = [&]() {
          Frame a = f;
          a.ws = 0;
          a.phase = A_INVALUE;
          start_value(ar.make(a, s->up), arr.items, c, out, ar);
        };
        switch (f.phase) {
          case A_OPEN:
            if (take_ws(s, c, out, ar)) return;
            if (c == ']') {
              if (arr.min_items == 0) out.add(done(s->up, ar));
            } else if (arr.max_items > 0) {
              value();
            }
            return;
          case A_NEXT:
            if (take_ws(s, c, out, ar)) return;
            value();
            return;
          case A_AFTER:
            if (take_ws(s, c, out, ar)) return;
            if (c == ',' && f.a < arr.max_items) {
              Frame a = f;
              a.ws = 0;
              a.phase = A_NEXT;
              out.add(ar.make(a, s->up));
            } else if (c == ']' && f.a >= arr.min_items) {
              out.add(done(s->up, ar));
            }
            return;
          default:
            return;
        }
      }
      case F_STRING: {
        Frame t = f;
        const int r = string_step(t.phase, t.u8, c);
        if (r == 0)
          out.add(ar.make(t, s->up));
        else if (r == 1)
          out.add(done(s->up, ar));
        return;
      }
      case F_NUMBER: {
        const bool integer = f.b != 0;
        int np = -1;
        switch (f.phase) {
          case 0:
            np = c == '-' ? 1 : c == '0' ? 2 : is_digit(c) ? 3 : -1;
            break;
          case 1:
            np = c == '0' ? 2 : is_digit(c) ? 3 : -1;
            break;
          case 2:
          case 3:
            if (f.phase == 3 && is_digit(c))
              np = 3;
            else if (c == '.' && !integer)
              np = 4;
            else if ((c == 'e' || c == 'E') && !integer)
              np = 6;
            break;
          case 4:
            np = is_digit(c) ? 5 : -1;
            break;
          case 5:
            np = is_digit(c) ? 5 : (c == 'e' || c == 'E') ? 6 : -1;
            break;
          case 6:
            np = (c == '+' || c == '-') ? 7 : is_digit(c) ? 8 : -1;
            break;
          case 7:
            np = is_digit(c) ? 8 : -1;
            break;
          case 8:
            np = is_digit(c) && f.u8 < 2 ? 8 : -1;  // e+-99 at most: always a finite double
            break;
          default:
            break;
        }
        if (np >= 0) {
          if (f.a + 1 > kMaxNumber) return;
          Frame t = f;
          t.phase = static_cast<uint8_t>(np);
          t.a++;
          t.u8 =
              np == 8 ? static_cast<uint8_t>(f.phase == 8 ? f.u8 + 1 : 1) : 0;  // exponent digits
          out.add(ar.make(t, s->up));
        } else if (number_complete(f.phase)) {
          step(done(s->up, ar), c, out, ar);
        }
        return;
      }
      case F_SEQ: {
        const auto& elems = node(f.node).alts;
        if (f.phase != S_READY) return;
        if (f.a < static_cast<int>(elems.size())) {
          Frame o = f;
          o.phase = S_INVALUE;
          start_value(ar.make(o, s->up), elems[static_cast<size_t>(f.a)], c, out, ar);
        } else {
          step(done(s->up, ar), c, out, ar);
        }
        return;
      }
      case F_TEXT: {
        // Raw text up to and including the terminator (ASCII, its first
        // byte not repeated in it: a mismatch restarts at 0 or 1).
        const std::string& term = node(f.node).texts[0];
        const size_t pos = static_cast<size_t>(f.a);
        Frame t = f;
        if (f.u8 != 0) {
          const int r = utf8_step(f.u8, c);
          if (r < 0) return;
          t.u8 = static_cast<uint8_t>(r);
        } else if (c == static_cast<uint8_t>(term[pos])) {
          if (pos + 1 == term.size()) {
            out.add(done(s->up, ar));
            return;
          }
          t.a = static_cast<int32_t>(pos + 1);
        } else if (c == static_cast<uint8_t>(term[0])) {
          t.a = 1;
        } else {
          const int r = c == 0 ? -1 : utf8_step(0, c);
          if (r < 0) return;
          t.a = 0;
          t.u8 = static_cast<uint8_t>(r);
        }
        out.add(ar.make(t, s->up));
        return;
      }
      case F_RELEASED:
        out.add(s);
        return;
      case F_LITERAL: {
        const auto& texts = node(f.node).texts;
        const size_t pos = static_cast<size_t>(f.a);
        size_t lo = static_cast<size_t>(f.b), hi = static_cast<size_t>(f.mask);
        size_t nlo = lo;
        while (nlo < hi && !(texts[nlo].size() > pos && static_cast<uint8_t>(texts[nlo][pos]) == c))
          ++nlo;
        if (nlo < hi) {
          size_t nhi = nlo;
          while (nhi < hi && texts[nhi].size() > pos && static_cast<uint8_t>(texts[nhi][pos]) == c)
            ++nhi;
          Frame t = f;
          t.a++;
          t.b = static_cast<int32_t>(nlo);
          t.mask = nhi;
          out.add(ar.make(t, s->up));
        } else if (lo < hi && texts[lo].size() == pos) {
          step(done(s->up, ar), c, out, ar);
        }
        return;
      }
      default:
        return;
    }
  }

  // Follows the frames a complete number, literal or sequence ends; stops at
  // the first frame that needs more. release: stop at a Release instead.
  bool accepting(const FNode* s, Arena& ar, bool release = false) const {
    for (;;) {
      const Frame& f = s->f;
      if (f.kind == F_RELEASED) return true;
      if (f.kind == F_SEQ && f.phase == S_READY) {
        const auto& elems = node(f.node).alts;
        if (f.a == static_cast<int>(elems.size())) {
          s = done(s->up, ar);
          continue;
        }
        return release && node(elems[static_cast<size_t>(f.a)]).kind == JsonGrammar::Node::Release;
      }
      if (f.kind == F_ROOT) return !release && f.phase == R_AFTER;
      if (f.kind == F_NUMBER && number_complete(f.phase)) {
        s = done(s->up, ar);
        continue;
      }
      if (f.kind == F_LITERAL) {
        const auto& texts = node(f.node).texts;
        const size_t lo = static_cast<size_t>(f.b);
        if (lo < static_cast<size_t>(f.mask) && texts[lo].size() == static_cast<size_t>(f.a)) {
          s = done(s->up, ar);
          continue;
        }
      }
      return false;
    }
  }

  // Advances st over bytes; false when no stack survives a byte.
  bool run(std::string_view bytes, Stacks& st, Arena& ar) const {
    for (unsigned char c : bytes) {
      Stacks next;
      for (int i = 0; i < st.n; ++i) step(st.s[i], c, next, ar);
      if (next.n == 0) return false;
      st = next;
    }
    return true;
  }

  // Plain string content keeps every stack as it is.
  bool in_plain_string() const {
    if (cur.n == 0) return false;
    for (int i = 0; i < cur.n; ++i) {
      const Frame& f = cur.s[i]->f;
      const bool str = f.kind == F_STRING && f.phase == 0 && f.u8 == 0;
      const bool free_key = f.kind == F_KEY && f.mask == 0 && f.b && f.phase == 0 && f.u8 == 0;
      if (!str && !free_key) return false;
    }
    return true;
  }

  // Raw Text content between terminator matches keeps every stack as it is.
  bool in_plain_text() const {
    if (cur.n == 0) return false;
    for (int i = 0; i < cur.n; ++i) {
      const Frame& f = cur.s[i]->f;
      if (!(f.kind == F_TEXT && f.a == 0 && f.u8 == 0)) return false;
    }
    return true;
  }

  void dfs(const TokenTrie::Trie& t, int n, const Stacks& st, std::vector<uint8_t>& mask) {
    const TokenTrie::Node& nd = t.nodes[static_cast<size_t>(n)];
    for (int e = nd.first_edge; e < nd.first_edge + nd.num_edges; ++e) {
      const TokenTrie::Edge& edge = t.edges[static_cast<size_t>(e)];
      Stacks next;
      for (int i = 0; i < st.n; ++i) step(st.s[i], edge.byte, next, scratch);
      if (next.n == 0) continue;
      const TokenTrie::Node& child = t.nodes[static_cast<size_t>(edge.child)];
      for (int k = child.first_token; k < child.first_token + child.num_tokens; ++k)
        mask[static_cast<size_t>(t.tokens[static_cast<size_t>(k)])] = 1;
      dfs(t, edge.child, next, mask);
    }
  }
};

JsonMatcher::JsonMatcher(std::shared_ptr<const JsonGrammar> grammar)
    : impl_(std::make_unique<Impl>()) {
  impl_->g = std::move(grammar);
  impl_->cur.add(impl_->persist.make(Frame{}, nullptr));
}

JsonMatcher::~JsonMatcher() = default;

bool JsonMatcher::feed(std::string_view bytes) {
  Stacks st = impl_->cur;
  if (!impl_->run(bytes, st, impl_->persist)) return false;
  impl_->cur = st;
  return true;
}

// What feed() makes lives in the persist arena, which only grows: a copy
// of the stacks is the whole state.
struct JsonMatcher::Checkpoint {
  const JsonMatcher::Impl* owner;
  Stacks st;
};

std::shared_ptr<const JsonMatcher::Checkpoint> JsonMatcher::checkpoint() const {
  return std::make_shared<const Checkpoint>(Checkpoint{impl_.get(), impl_->cur});
}

void JsonMatcher::restore(const Checkpoint& c) {
  if (c.owner != impl_.get()) fail("JsonMatcher::restore: a checkpoint of another matcher");
  impl_->cur = c.st;
}

bool JsonMatcher::can_feed(std::string_view bytes) const {
  impl_->scratch.reset();
  Stacks st = impl_->cur;
  return impl_->run(bytes, st, impl_->scratch);
}

bool JsonMatcher::accepting() const {
  impl_->scratch.reset();
  for (int i = 0; i < impl_->cur.n; ++i)
    if (impl_->accepting(impl_->cur.s[i], impl_->scratch)) return true;
  return false;
}

bool JsonMatcher::released() const {
  impl_->scratch.reset();
  for (int i = 0; i < impl_->cur.n; ++i)
    if (impl_->accepting(impl_->cur.s[i], impl_->scratch, true)) return true;
  return false;
}

void JsonMatcher::allowed_tokens(const TokenTrie& trie, std::vector<uint8_t>& mask) const {
  mask.assign(static_cast<size_t>(trie.vocab_size()), 0);
  impl_->scratch.reset();
  if (impl_->in_plain_string()) {
    for (int id : trie.plain_) mask[static_cast<size_t>(id)] = 1;
    impl_->dfs(trie.not_plain_, 0, impl_->cur, mask);
  } else if (impl_->in_plain_text()) {
    for (int id : trie.text_) mask[static_cast<size_t>(id)] = 1;
    impl_->dfs(trie.not_text_, 0, impl_->cur, mask);
  } else {
    impl_->dfs(trie.all_, 0, impl_->cur, mask);
  }
}

}  // namespace lily::text
