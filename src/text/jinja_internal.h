// Internals of the Jinja interpreter (jinja.h): values, the syntax tree, the
// parser and the evaluator. Not part of the public API.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/jinja.h"
#include "text/utf8.h"

namespace lily::text::jinja {

class Value;
class Interp;

// A runtime error without a location: the interpreter adds the template name
// and line when it reaches render().
struct EvalError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// raise_exception(message) from the template.
struct RaisedByTemplate : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] inline void eval_fail(const std::string& message) { throw EvalError(message); }

// Largest nesting of lists / dicts a value may have (inputs included).
constexpr int kMaxValueDepth = 256;

struct ListData {
  std::vector<Value> items;
  bool tuple = false;
  int depth = 1;
};

struct DictData;
class Object;
struct Function;

class Value {
 public:
  enum class Kind : uint8_t { Undefined, None, Bool, Int, Float, String, List, Dict, Object, Function };

  Value() = default;  // undefined, no hint
  static Value undefined(std::string hint);
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value number(double d);
  static Value string(std::string s);
  static Value list(std::vector<Value> items, bool tuple = false);
  static Value dict(std::shared_ptr<DictData> d);
  static Value object(std::shared_ptr<Object> o);
  static Value function(std::shared_ptr<const Function> f);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::Undefined; }
  bool is_none() const { return kind_ == Kind::None; }
  bool is_bool() const { return kind_ == Kind::Bool; }
  bool is_int() const { return kind_ == Kind::Int; }
  bool is_float() const { return kind_ == Kind::Float; }
  bool is_number() const { return kind_ == Kind::Int || kind_ == Kind::Float || kind_ == Kind::Bool; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_list() const { return kind_ == Kind::List; }
  bool is_dict() const { return kind_ == Kind::Dict; }
  bool is_object() const { return kind_ == Kind::Object; }
  bool is_function() const { return kind_ == Kind::Function; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return kind_ == Kind::Bool ? (b_ ? 1 : 0) : i_; }  // Int or Bool
  double as_double() const;                                                 // any number
  const std::string& as_string() const { return *static_cast<const std::string*>(ptr_.get()); }
  const ListData& as_list() const { return *static_cast<const ListData*>(ptr_.get()); }
  const DictData& as_dict() const { return *static_cast<const DictData*>(ptr_.get()); }
  Object& as_object() const { return *static_cast<Object*>(ptr_.get()); }
  const Function& as_function() const { return *static_cast<const Function*>(ptr_.get()); }
  std::shared_ptr<Object> object_ptr() const { return std::static_pointer_cast<Object>(ptr_); }
  const void* identity() const { return ptr_.get(); }
  // For Undefined: what was looked up ("'x' is undefined").
  std::string undefined_hint() const;

  int depth() const;  // container nesting: 0 for scalars
  bool truthy() const;
  // Python's type name: "str", "int", "list", "dict", "NoneType", ...
  std::string type_name() const;

 private:
  Kind kind_ = Kind::Undefined;
  union {
    bool b_;
    int64_t i_ = 0;
    double f_;
  };
  std::shared_ptr<void> ptr_;
};

// An insertion-ordered dict with hashed lookup. Keys: str, int, float, bool,
// None, tuples of those.
struct DictData {
  std::vector<std::pair<Value, Value>> entries;
  std::unordered_map<std::string, size_t> index;
  int depth = 1;

  const Value* find(const Value& key) const;
  // Inserts or replaces (keeping the first position); fails on an unhashable key.
  void set(const Value& key, Value value);
  size_t size() const { return entries.size(); }
};

class Object {
 public:
  virtual ~Object() = default;
  virtual std::string type_name() const = 0;
  // Undefined (with a hint) when there is no such attribute.
  virtual Value get_attr(const std::string& name) const = 0;
  virtual bool is_namespace() const { return false; }
  virtual std::string repr() const = 0;
};

class Namespace : public Object {
 public:
  std::string type_name() const override { return "Namespace"; }
  Value get_attr(const std::string& name) const override;
  bool is_namespace() const override { return true; }
  std::string repr() const override;
  void set_attr(const std::string& name, Value v);
  void clear() { attrs_.clear(); }

 private:
  std::vector<std::pair<std::string, Value>> attrs_;
};

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

struct Function {
  std::string name;
  std::function<Value(Interp&, CallArgs&)> call;
};

// ---- value helpers (jinja_value.cpp) ----

Value from_json(const nlohmann::ordered_json& j, int depth = 0);
// Python str() / repr().
std::string to_str(const Value& v);
std::string repr(const Value& v);
std::string py_float_repr(double d);
std::string py_str_repr(std::string_view s);
// json.dumps(v, ensure_ascii, indent, separators, sort_keys). indent: empty =
// none; `indent_set` true with an empty string means indent=0 / "".
struct JsonStyle {
  bool ensure_ascii = false;
  bool has_indent = false;
  std::string indent;
  std::string item_sep = ", ";
  std::string key_sep = ": ";
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonStyle& style);
// Python ==.
bool equals(const Value& a, const Value& b);
// Python <; fails for unorderable types.
bool less_than(const Value& a, const Value& b);
// Key for DictData::index; fails on unhashable values.
std::string hash_key(const Value& v);

// ---- UTF-8 / Python string helpers (jinja_value.cpp) ----

// Byte offsets of each code point start, plus s.size() at the end. Invalid
// bytes count as one code point each.
std::vector<size_t> cp_offsets(std::string_view s);
size_t cp_count(std::string_view s);
bool is_ascii(std::string_view s);
// Decodes the code point at s[i] (invalid byte: returns the byte, len 1).
uint32_t decode_cp(std::string_view s, size_t i, size_t* len);
using text::append_utf8;
bool py_isspace(uint32_t cp);
std::string py_strip(std::string_view s, const std::string* chars, bool left, bool right);
std::string py_upper(std::string_view s);
std::string py_lower(std::string_view s);
std::string py_capitalize(std::string_view s);
std::string py_title(std::string_view s);
std::vector<std::string> py_split(std::string_view s, const std::string* sep, int64_t maxsplit);
std::vector<std::string> py_rsplit(std::string_view s, const std::string* sep, int64_t maxsplit);
std::vector<std::string> py_splitlines(std::string_view s, bool keepends);

// ---- syntax tree ----

enum class ExprKind : uint8_t {
  Literal, Name, List, Tuple, Dict, GetAttr, GetItem, Slice, Call, Filter, Test,
  Neg, Pos, Not, And, Or, Binary, Compare, Concat, Cond,
};
enum class BinOp : uint8_t { Add, Sub, Mul, Div, FloorDiv, Mod, Pow };
enum class CmpOp : uint8_t { Eq, Ne, Lt, Le, Gt, Ge, In, NotIn };

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  ExprKind kind;
  int line = 0;
  Value literal;                 // Literal
  std::string name;              // Name, GetAttr, Filter, Test
  std::vector<ExprPtr> kids;     // operands; entries may be null (slice bounds, filter hole, cond else)
  std::vector<std::pair<std::string, ExprPtr>> kwargs;  // Call / Filter / Test
  ExprPtr dyn_args, dyn_kwargs;  // *args, **kwargs
  std::vector<CmpOp> cmp_ops;    // Compare: kids[0] op0 kids[1] op1 kids[2] ...
  BinOp bin_op = BinOp::Add;
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

// An assignment target: a name, or ns.attr.
struct TargetItem {
  std::string name;
  std::string attr;  // non-empty: namespace attribute
};
struct Target {
  std::vector<TargetItem> items;
  bool tuple = false;  // unpack
};

enum class StmtKind : uint8_t {
  Text, Output, If, For, Set, SetBlock, Macro, Break, Continue, FilterBlock, With, Scope,
};

struct Stmt {
  StmtKind kind;
  int line = 0;
  std::string text;                // Text data; Macro name
  std::vector<ExprPtr> exprs;      // Output: values. If: conditions. For: iter, filter (may be null).
                                   // Set: value. SetBlock/FilterBlock: filter chain (may be null). With: values.
  std::vector<Body> bodies;        // If: one per condition, then else. For: body, else. Others: body.
  Target target;                   // Set, SetBlock, For
  std::vector<std::string> names;  // Macro params / With targets
  std::vector<ExprPtr> defaults;   // Macro param defaults (null: none), parallel to names
};

struct Program {
  std::string name;
  JinjaOptions options;
  Body body;
};

std::shared_ptr<Program> parse_template(std::string_view source, std::string name,
                                        const JinjaOptions& options);

// ---- evaluation ----

class Scope {
 public:
  explicit Scope(std::shared_ptr<Scope> parent) : parent_(std::move(parent)) {}
  const Value* lookup(const std::string& name) const;
  void set(const std::string& name, Value v);
  void clear() { vars_.clear(); }

 private:
  std::shared_ptr<Scope> parent_;
  std::vector<std::pair<std::string, Value>> vars_;
};

enum class Flow : uint8_t { Normal, Break, Continue };

class Interp {
 public:
  Interp(const Program& program);
  ~Interp();

  std::string render(const nlohmann::ordered_json& variables);

  // Errors at the current line.
  [[noreturn]] void fail(const std::string& message) const;
  // Counts loop iterations / calls against the limit.
  void tick();
  // Fails if a string or list of this size is over the limit.
  void check_size(size_t n, const char* what) const;
  const JinjaOptions& options() const { return program_.options; }

  // Jinja's getattr (obj.name) and getitem (obj[key]).
  Value get_attr(const Value& obj, const std::string& name);
  Value get_item(const Value& obj, const Value& key);
  Value call(const Value& callee, CallArgs& args);
  // Items of an iterable: list items, dict keys, string characters.
  std::vector<Value> iterate(const Value& v);
  // Python's binary operators (+ - * / // % **) on values.
  Value binary(BinOp op, const Value& a, const Value& b);
  bool contains(const Value& container, const Value& item);
  std::shared_ptr<Namespace> new_namespace();
  // Fails if a list of n items is over the limit.
  void check_items(size_t n) const;

  Value string_value(std::string s) const {
    check_size(s.size(), "string");
    return Value::string(std::move(s));
  }

 private:
  friend struct DepthGuard;
  Value eval(const Expr& e);
  Value eval_inner(const Expr& e);
  Value eval_slice(const Value& obj, const Expr& e);
  bool compare(CmpOp op, const Value& a, const Value& b);
  void eval_call_args(const Expr& e, size_t first_kid, CallArgs& out);
  Flow exec_body(const Body& body, std::string& out);
  Flow exec(const Stmt& s, std::string& out);
  void exec_for(const Stmt& s, std::string& out);
  void assign(const Target& t, const Value& v);
  Value make_macro(const Stmt& s);
  Value call_macro(const Stmt& def, const std::shared_ptr<Scope>& closure, CallArgs& args);
  void append_out(std::string& out, std::string_view text) const;
  void install_globals(Scope& globals);

  const Program& program_;
  std::shared_ptr<Scope> scope_;
  int line_ = 0;
  int depth_ = 0;
  uint64_t iterations_ = 0;
  const Value* hole_ = nullptr;  // operand of a filter block's filter chain
  std::vector<std::shared_ptr<Namespace>> namespaces_;
  std::vector<std::shared_ptr<Scope>> captured_scopes_;
};

struct DepthGuard {
  explicit DepthGuard(Interp& in);
  ~DepthGuard() { --in_.depth_; }
  DepthGuard(const DepthGuard&) = delete;
  DepthGuard& operator=(const DepthGuard&) = delete;
  Interp& in_;
};

// Builtins (jinja_builtins.cpp).
Value call_filter(Interp& in, const std::string& name, Value operand, CallArgs& args);
bool filter_exists(const std::string& name);
bool call_test(Interp& in, const std::string& name, const Value& operand, CallArgs& args);
bool test_exists(const std::string& name);
// Bound method of a str / dict / list value; Undefined if it has none by that name.
Value get_method(Interp& in, const Value& obj, const std::string& name);
void add_global_functions(Interp& in, Scope& globals);

// Binds call arguments to parameter names; returns one Value per name
// (Undefined where not given). Fails naming `what` on unknown keyword or too
// many positional arguments, or when fewer than `required` were given.
std::vector<Value> bind_args(Interp& in, const std::string& what, const CallArgs& args,
                             std::initializer_list<const char*> names, size_t required = 0);

}  // namespace lily::text::jinja
