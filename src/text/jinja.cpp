// The Jinja evaluator (statements, expressions, operators, attribute and item
// lookup, loops, macros) and the public JinjaTemplate API.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "text/jinja.h"
#include "text/jinja_internal.h"

namespace lily::text {
namespace jinja {
namespace {

// The `loop` variable of a for loop.
class LoopObj : public Object, public std::enable_shared_from_this<LoopObj> {
 public:
  explicit LoopObj(std::shared_ptr<const std::vector<Value>> items) : items_(std::move(items)) {}
  std::string type_name() const override { return "LoopContext"; }
  std::string repr() const override {
    return "<LoopContext " + std::to_string(index_ + 1) + "/" + std::to_string(items_->size()) + ">";
  }
  void set_index(size_t i) { index_ = i; }

  Value get_attr(const std::string& name) const override {
    const auto n = static_cast<int64_t>(items_->size());
    const auto i = static_cast<int64_t>(index_);
    if (name == "index") return Value::integer(i + 1);
    if (name == "index0") return Value::integer(i);
    if (name == "revindex") return Value::integer(n - i);
    if (name == "revindex0") return Value::integer(n - i - 1);
    if (name == "first") return Value::boolean(i == 0);
    if (name == "last") return Value::boolean(i == n - 1);
    if (name == "length") return Value::integer(n);
    if (name == "depth") return Value::integer(1);
    if (name == "depth0") return Value::integer(0);
    if (name == "previtem") {
      if (i == 0) return Value::undefined("there is no previous item");
      return (*items_)[index_ - 1];
    }
    if (name == "nextitem") {
      if (i + 1 >= n) return Value::undefined("there is no next item");
      return (*items_)[index_ + 1];
    }
    if (name == "cycle") {
      auto self = std::static_pointer_cast<const LoopObj>(shared_from_this());
      auto fn = std::make_shared<Function>();
      fn->name = "cycle";
      fn->call = [self](Interp& in, CallArgs& args) -> Value {
        if (!args.kw.empty()) in.fail("loop.cycle() takes no keyword arguments");
        if (args.pos.empty()) in.fail("no items for cycling given");
        return args.pos[self->index_ % args.pos.size()];
      };
      return Value::function(std::move(fn));
    }
    if (name == "changed") {
      auto self = std::const_pointer_cast<LoopObj>(std::static_pointer_cast<const LoopObj>(shared_from_this()));
      auto fn = std::make_shared<Function>();
      fn->name = "changed";
      fn->call = [self](Interp&, CallArgs& args) -> Value {
        Value v = Value::list(args.pos, true);
        if (self->has_changed_ && equals(self->last_changed_, v)) return Value::boolean(false);
        self->has_changed_ = true;
        self->last_changed_ = v;
        return Value::boolean(true);
      };
      return Value::function(std::move(fn));
    }
    return Value::undefined("'LoopContext' object has no attribute '" + name + "'");
  }

 private:
  std::shared_ptr<const std::vector<Value>> items_;
  size_t index_ = 0;
  bool has_changed_ = false;
  Value last_changed_;
};

bool checked_add(int64_t a, int64_t b, int64_t* r) { return !__builtin_add_overflow(a, b, r); }
bool checked_sub(int64_t a, int64_t b, int64_t* r) { return !__builtin_sub_overflow(a, b, r); }
bool checked_mul(int64_t a, int64_t b, int64_t* r) { return !__builtin_mul_overflow(a, b, r); }

std::string operand_types(const char* op, const Value& a, const Value& b) {
  return std::string("unsupported operand type(s) for ") + op + ": '" + a.type_name() + "' and '" +
         b.type_name() + "'";
}

// Python slice indices (PySlice_AdjustIndices) -> the selected positions.
std::vector<size_t> slice_positions(Interp& in, int64_t len, const Value& start_v, const Value& stop_v,
                                    const Value& step_v) {
  auto as_index = [&](const Value& v, const char* what) -> int64_t {
    if (v.is_int() || v.is_bool()) return v.as_int();
    in.fail(std::string("slice ") + what + " must be an integer or none, not '" + v.type_name() + "'");
  };
  int64_t step = (step_v.is_none() || step_v.is_undefined()) ? 1 : as_index(step_v, "step");
  if (step == 0) in.fail("slice step cannot be zero");
  int64_t start, stop;
  if (step > 0) {
    start = (start_v.is_none() || start_v.is_undefined()) ? 0 : as_index(start_v, "start");
    stop = (stop_v.is_none() || stop_v.is_undefined()) ? len : as_index(stop_v, "stop");
    if (start < 0) start = std::max<int64_t>(0, start + len);
    if (start > len) start = len;
    if (stop < 0) stop = std::max<int64_t>(0, stop + len);
    if (stop > len) stop = len;
  } else {
    start = (start_v.is_none() || start_v.is_undefined()) ? len - 1 : as_index(start_v, "start");
    stop = (stop_v.is_none() || stop_v.is_undefined()) ? -1 : as_index(stop_v, "stop");
    if (start < 0) start = std::max<int64_t>(-1, start + len);
    if (start >= len) start = len - 1;
    if (!(stop_v.is_none() || stop_v.is_undefined())) {
      if (stop < 0) stop = std::max<int64_t>(-1, stop + len);
      if (stop >= len) stop = len - 1;
    }
  }
  std::vector<size_t> out;
  if (step > 0 && start < stop) {
    uint64_t count = 1 + static_cast<uint64_t>(stop - start - 1) / static_cast<uint64_t>(step);
    out.reserve(count);
    for (uint64_t k = 0; k < count; ++k) out.push_back(static_cast<size_t>(start + static_cast<int64_t>(k) * step));
  } else if (step < 0 && start > stop) {
    // step may be INT64_MIN: work in unsigned magnitudes.
    uint64_t mag = static_cast<uint64_t>(-(step + 1)) + 1;
    uint64_t count = 1 + static_cast<uint64_t>(start - stop - 1) / mag;
    out.reserve(count);
    for (uint64_t k = 0; k < count; ++k) out.push_back(static_cast<size_t>(static_cast<uint64_t>(start) - k * mag));
  }
  return out;
}

// get_method's answer names a method: a callable, or the undefined value that
// stands for a mutating method the sandbox refuses.
bool is_method(const Value& m) {
  return m.is_function() || (m.is_undefined() && m.undefined_hint().find("unsafe") != std::string::npos);
}

int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

int64_t py_mod(int64_t a, int64_t b) {
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

}  // namespace

// ------------------------------------------------------------------ Interp basics

DepthGuard::DepthGuard(Interp& in) : in_(in) {
  if (++in_.depth_ > in_.options().max_render_depth) {
    --in_.depth_;
    in_.fail(str_cat("nesting deeper than ", in_.options().max_render_depth,
                     " levels while rendering (runaway macro recursion?)"));
  }
}

Interp::Interp(const Program& program) : program_(program) {}

Interp::~Interp() {
  // Break reference cycles (a namespace holding itself, a macro held by the
  // scope it closes over).
  for (auto& ns : namespaces_) ns->clear();
  for (auto& s : captured_scopes_) s->clear();
}

void Interp::fail(const std::string& message) const { throw EvalError(message); }

void Interp::tick() {
  if (++iterations_ > options().max_iterations)
    fail(str_cat("more than ", options().max_iterations, " loop iterations and macro calls"));
}

void Interp::check_size(size_t n, const char* what) const {
  if (n > options().max_output_bytes)
    fail(str_cat(what, " larger than the ", options().max_output_bytes, "-byte limit"));
}

void Interp::check_items(size_t n) const {
  if (n > options().max_iterations) fail(str_cat("list longer than the ", options().max_iterations, "-item limit"));
}

void Interp::append_out(std::string& out, std::string_view text) const {
  if (out.size() + text.size() > options().max_output_bytes)
    fail(str_cat("output larger than the ", options().max_output_bytes, "-byte limit"));
  out.append(text);
}

std::shared_ptr<Namespace> Interp::new_namespace() {
  auto ns = std::make_shared<Namespace>();
  namespaces_.push_back(ns);
  return ns;
}

std::string Interp::render(const nlohmann::ordered_json& variables) {
  std::string out;
  try {
    auto globals = std::make_shared<Scope>(nullptr);
    add_global_functions(*this, *globals);
    scope_ = std::make_shared<Scope>(globals);
    if (!variables.is_null()) {
      if (!variables.is_object()) fail("template variables must be a JSON object");
      for (const auto& [k, v] : variables.items()) scope_->set(k, from_json(v));
    }
    exec_body(program_.body, out);
  } catch (const RaisedByTemplate& e) {
    throw JinjaRaisedError(str_cat(program_.name, ":", line_, ": raise_exception: ", e.what()), e.what());
  } catch (const EvalError& e) {
    if (line_ <= 0) lily::fail(program_.name, ": ", e.what());  // before the first line ran: the variables
    lily::fail(program_.name, ":", line_, ": ", e.what());
  }
  return out;
}

// ------------------------------------------------------------------ statements

Flow Interp::exec_body(const Body& body, std::string& out) {
  for (const auto& s : body) {
    Flow f = exec(*s, out);
    if (f != Flow::Normal) return f;
  }
  return Flow::Normal;
}

Flow Interp::exec(const Stmt& s, std::string& out) {
  DepthGuard guard(*this);
  line_ = s.line;
  switch (s.kind) {
    case StmtKind::Text: append_out(out, s.text); break;
    case StmtKind::Output:
      for (const auto& e : s.exprs) {
        Value v = eval(*e);
        if (v.is_string())
          append_out(out, v.as_string());
        else
          append_out(out, to_str(v));
      }
      break;
    case StmtKind::If:
      for (size_t i = 0; i < s.exprs.size(); ++i)
        if (eval(*s.exprs[i]).truthy()) return exec_body(s.bodies[i], out);
      if (s.bodies.size() > s.exprs.size()) return exec_body(s.bodies.back(), out);
      break;
    case StmtKind::For: exec_for(s, out); break;
    case StmtKind::Set: assign(s.target, eval(*s.exprs[0])); break;
    case StmtKind::SetBlock: {
      std::string buf;
      Flow f = exec_body(s.bodies[0], buf);
      Value v = Value::string(std::move(buf));
      if (s.exprs[0]) {
        const Value* saved = hole_;
        hole_ = &v;
        Value filtered = eval(*s.exprs[0]);
        hole_ = saved;
        v = std::move(filtered);
      }
      line_ = s.line;
      assign(s.target, v);
      return f;
    }
    case StmtKind::Macro: scope_->set(s.text, make_macro(s)); break;
    case StmtKind::Break: return Flow::Break;
    case StmtKind::Continue: return Flow::Continue;
    case StmtKind::FilterBlock: {
      std::string buf;
      Flow f = exec_body(s.bodies[0], buf);
      Value v = Value::string(std::move(buf));
      const Value* saved = hole_;
      hole_ = &v;
      Value filtered = eval(*s.exprs[0]);
      hole_ = saved;
      append_out(out, to_str(filtered));
      return f;
    }
    case StmtKind::With: {
      std::vector<Value> values;
      for (const auto& e : s.exprs) values.push_back(eval(*e));
      auto inner = std::make_shared<Scope>(scope_);
      for (size_t i = 0; i < s.names.size(); ++i) inner->set(s.names[i], values[i]);
      std::shared_ptr<Scope> saved = scope_;
      scope_ = inner;
      Flow f;
      try {
        f = exec_body(s.bodies[0], out);
      } catch (...) {
        scope_ = saved;
        throw;
      }
      scope_ = saved;
      return f;
    }
    case StmtKind::Scope: return exec_body(s.bodies[0], out);
  }
  return Flow::Normal;
}

void Interp::exec_for(const Stmt& s, std::string& out) {
  Value iterable = eval(*s.exprs[0]);
  std::vector<Value> items = iterate(iterable);
  std::shared_ptr<Scope> outer = scope_;
  struct Restore {
    Interp& in;
    std::shared_ptr<Scope> saved;
    ~Restore() { in.scope_ = saved; }
  } restore{*this, outer};

  if (s.exprs[1]) {  // for x in xs if cond: filter first (loop.* counts the kept items)
    std::vector<Value> kept;
    for (Value& item : items) {
      tick();
      scope_ = std::make_shared<Scope>(outer);
      assign(s.target, item);
      if (eval(*s.exprs[1]).truthy()) kept.push_back(std::move(item));
    }
    scope_ = outer;
    items = std::move(kept);
  }
  if (items.empty()) {
    scope_ = std::make_shared<Scope>(outer);
    exec_body(s.bodies[1], out);
    return;
  }
  auto shared_items = std::make_shared<const std::vector<Value>>(std::move(items));
  auto loop = std::make_shared<LoopObj>(shared_items);
  Value loop_value = Value::object(loop);
  for (size_t i = 0; i < shared_items->size(); ++i) {
    tick();
    line_ = s.line;
    loop->set_index(i);
    scope_ = std::make_shared<Scope>(outer);
    scope_->set("loop", loop_value);
    assign(s.target, (*shared_items)[i]);
    Flow f = exec_body(s.bodies[0], out);
    if (f == Flow::Break) break;
  }
}

void Interp::assign(const Target& t, const Value& v) {
  auto set_one = [&](const TargetItem& item, const Value& val) {
    if (item.attr.empty()) {
      scope_->set(item.name, val);
      return;
    }
    const Value* ns = scope_->lookup(item.name);
    if (!ns || !ns->is_object() || !ns->as_object().is_namespace())
      fail("cannot assign attribute on non-namespace object '" + item.name + "'");
    static_cast<Namespace&>(ns->as_object()).set_attr(item.attr, val);
  };
  if (!t.tuple) {
    set_one(t.items[0], v);
    return;
  }
  if (v.is_undefined()) fail(v.undefined_hint());
  std::vector<Value> vals = iterate(v);
  if (vals.size() != t.items.size()) {
    if (vals.size() > t.items.size()) fail(str_cat("too many values to unpack (expected ", t.items.size(), ")"));
    fail(str_cat("not enough values to unpack (expected ", t.items.size(), ", got ", vals.size(), ")"));
  }
  for (size_t i = 0; i < vals.size(); ++i) set_one(t.items[i], vals[i]);
}

Value Interp::make_macro(const Stmt& s) {
  std::shared_ptr<Scope> closure = scope_;
  captured_scopes_.push_back(closure);
  const Stmt* def = &s;
  auto fn = std::make_shared<Function>();
  fn->name = s.text;
  fn->call = [def, closure](Interp& in, CallArgs& args) { return in.call_macro(*def, closure, args); };
  return Value::function(std::move(fn));
}

Value Interp::call_macro(const Stmt& def, const std::shared_ptr<Scope>& closure, CallArgs& args) {
  tick();
  DepthGuard guard(*this);
  auto sc = std::make_shared<Scope>(closure);
  std::shared_ptr<Scope> saved = scope_;
  struct Restore {
    Interp& in;
    std::shared_ptr<Scope> saved;
    ~Restore() { in.scope_ = saved; }
  } restore{*this, saved};
  scope_ = sc;
  const size_t n = def.names.size();
  std::vector<bool> given(n, false);
  std::vector<Value> extra_pos;
  for (size_t i = 0; i < args.pos.size(); ++i) {
    if (i < n) {
      sc->set(def.names[i], args.pos[i]);
      given[i] = true;
    } else {
      extra_pos.push_back(args.pos[i]);
    }
  }
  auto extra_kw = std::make_shared<DictData>();
  for (auto& [k, v] : args.kw) {
    auto it = std::find(def.names.begin(), def.names.end(), k);
    if (it == def.names.end()) {
      extra_kw->set(Value::string(k), v);
      continue;
    }
    size_t idx = static_cast<size_t>(it - def.names.begin());
    if (given[idx]) fail("macro '" + def.text + "' got multiple values for argument '" + k + "'");
    sc->set(k, v);
    given[idx] = true;
  }
  for (size_t i = 0; i < n; ++i) {
    if (given[i]) continue;
    if (def.defaults[i])
      sc->set(def.names[i], eval(*def.defaults[i]));
    else
      sc->set(def.names[i], Value::undefined("'" + def.names[i] + "' is undefined"));
  }
  sc->set("varargs", Value::list(std::move(extra_pos), true));
  sc->set("kwargs", Value::dict(std::move(extra_kw)));
  std::string buf;
  exec_body(def.bodies[0], buf);
  return Value::string(std::move(buf));
}

// ------------------------------------------------------------------ expressions

Value Interp::eval(const Expr& e) {
  DepthGuard guard(*this);
  line_ = e.line;
  return eval_inner(e);
}

void Interp::eval_call_args(const Expr& e, size_t first_kid, CallArgs& out) {
  for (size_t i = first_kid; i < e.kids.size(); ++i) out.pos.push_back(eval(*e.kids[i]));
  if (e.dyn_args) {
    Value v = eval(*e.dyn_args);
    for (Value& item : iterate(v)) out.pos.push_back(std::move(item));
  }
  for (const auto& [k, x] : e.kwargs) out.kw.emplace_back(k, eval(*x));
  if (e.dyn_kwargs) {
    Value v = eval(*e.dyn_kwargs);
    if (!v.is_dict()) fail("argument after ** must be a mapping, not " + v.type_name());
    for (const auto& [k, x] : v.as_dict().entries) {
      if (!k.is_string()) fail("keywords must be strings");
      out.kw.emplace_back(k.as_string(), x);
    }
  }
}

Value Interp::eval_inner(const Expr& e) {
  switch (e.kind) {
    case ExprKind::Literal: return e.literal;
    case ExprKind::Name: {
      const Value* v = scope_->lookup(e.name);
      if (v) return *v;
      return Value::undefined("'" + e.name + "' is undefined");
    }
    case ExprKind::List:
    case ExprKind::Tuple: {
      std::vector<Value> items;
      items.reserve(e.kids.size());
      for (const auto& k : e.kids) items.push_back(eval(*k));
      return Value::list(std::move(items), e.kind == ExprKind::Tuple);
    }
    case ExprKind::Dict: {
      auto d = std::make_shared<DictData>();
      for (size_t i = 0; i + 1 < e.kids.size(); i += 2) {
        Value k = eval(*e.kids[i]);
        Value v = eval(*e.kids[i + 1]);
        d->set(k, std::move(v));
      }
      return Value::dict(std::move(d));
    }
    case ExprKind::GetAttr: {
      Value obj = eval(*e.kids[0]);
      line_ = e.line;
      return get_attr(obj, e.name);
    }
    case ExprKind::GetItem: {
      Value obj = eval(*e.kids[0]);
      Value key = eval(*e.kids[1]);
      line_ = e.line;
      return get_item(obj, key);
    }
    case ExprKind::Slice: {
      Value obj = eval(*e.kids[0]);
      return eval_slice(obj, e);
    }
    case ExprKind::Call: {
      Value callee = eval(*e.kids[0]);
      CallArgs args;
      eval_call_args(e, 1, args);
      line_ = e.line;
      return call(callee, args);
    }
    case ExprKind::Filter: {
      Value operand = e.kids[0] ? eval(*e.kids[0]) : (hole_ ? *hole_ : Value());
      CallArgs args;
      eval_call_args(e, 1, args);
      line_ = e.line;
      return call_filter(*this, e.name, std::move(operand), args);
    }
    case ExprKind::Test: {
      Value operand = eval(*e.kids[0]);
      CallArgs args;
      eval_call_args(e, 1, args);
      line_ = e.line;
      return Value::boolean(call_test(*this, e.name, operand, args));
    }
    case ExprKind::Neg:
    case ExprKind::Pos: {
      Value v = eval(*e.kids[0]);
      line_ = e.line;
      bool neg = e.kind == ExprKind::Neg;
      if (v.is_int() || v.is_bool()) {
        int64_t i = v.as_int();
        if (!neg) return Value::integer(i);
        if (i == INT64_MIN) fail("integer overflow");
        return Value::integer(-i);
      }
      if (v.is_float()) return Value::number(neg ? -v.as_double() : v.as_double());
      if (v.is_undefined()) fail(v.undefined_hint());
      fail(std::string("bad operand type for unary ") + (neg ? "-" : "+") + ": '" + v.type_name() + "'");
    }
    case ExprKind::Not: return Value::boolean(!eval(*e.kids[0]).truthy());
    case ExprKind::And: {
      Value l = eval(*e.kids[0]);
      if (!l.truthy()) return l;
      return eval(*e.kids[1]);
    }
    case ExprKind::Or: {
      Value l = eval(*e.kids[0]);
      if (l.truthy()) return l;
      return eval(*e.kids[1]);
    }
    case ExprKind::Binary: {
      Value a = eval(*e.kids[0]);
      Value b = eval(*e.kids[1]);
      line_ = e.line;
      return binary(e.bin_op, a, b);
    }
    case ExprKind::Compare: {
      Value left = eval(*e.kids[0]);
      for (size_t i = 0; i < e.cmp_ops.size(); ++i) {
        Value right = eval(*e.kids[i + 1]);
        line_ = e.line;
        if (!compare(e.cmp_ops[i], left, right)) return Value::boolean(false);
        left = std::move(right);
      }
      return Value::boolean(true);
    }
    case ExprKind::Concat: {
      std::string s;
      for (const auto& k : e.kids) {
        Value v = eval(*k);
        s += v.is_string() ? v.as_string() : to_str(v);
        check_size(s.size(), "string");
      }
      return Value::string(std::move(s));
    }
    case ExprKind::Cond: {
      if (eval(*e.kids[0]).truthy()) return eval(*e.kids[1]);
      if (e.kids[2]) return eval(*e.kids[2]);
      return Value::undefined(str_cat("the inline if-expression on line ", e.line,
                                      " evaluated to false and no else section was defined"));
    }
  }
  fail("internal error: unknown expression");
}

Value Interp::eval_slice(const Value& obj, const Expr& e) {
  Value parts[3];
  for (int i = 0; i < 3; ++i)
    parts[i] = e.kids[static_cast<size_t>(i) + 1] ? eval(*e.kids[static_cast<size_t>(i) + 1]) : Value::none();
  line_ = e.line;
  if (obj.is_list()) {
    const auto& items = obj.as_list().items;
    std::vector<Value> out;
    for (size_t p : slice_positions(*this, static_cast<int64_t>(items.size()), parts[0], parts[1], parts[2]))
      out.push_back(items[p]);
    return Value::list(std::move(out), obj.as_list().tuple);
  }
  if (obj.is_string()) {
    const std::string& s = obj.as_string();
    std::string out;
    if (is_ascii(s)) {
      for (size_t p : slice_positions(*this, static_cast<int64_t>(s.size()), parts[0], parts[1], parts[2]))
        out += s[p];
    } else {
      std::vector<size_t> offs = cp_offsets(s);
      for (size_t p : slice_positions(*this, static_cast<int64_t>(offs.size() - 1), parts[0], parts[1], parts[2]))
        out.append(s, offs[p], offs[p + 1] - offs[p]);
    }
    return Value::string(std::move(out));
  }
  if (obj.is_undefined()) fail(obj.undefined_hint());
  fail("'" + obj.type_name() + "' object is not subscriptable");
}

Value Interp::get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind()) {
    case Value::Kind::Undefined: fail(obj.undefined_hint());
    case Value::Kind::Dict: {
      // Python's getattr first: dict methods win over keys of the same name.
      Value m = get_method(*this, obj, name);
      if (is_method(m)) return m;
      if (const Value* v = obj.as_dict().find(Value::string(name))) return *v;
      return Value::undefined("'dict object' has no attribute '" + name + "'");
    }
    case Value::Kind::Object: return obj.as_object().get_attr(name);
    default: {
      Value m = get_method(*this, obj, name);
      if (is_method(m)) return m;
      return Value::undefined("'" + obj.type_name() + " object' has no attribute '" + name + "'");
    }
  }
}

Value Interp::get_item(const Value& obj, const Value& key) {
  auto no_element = [&]() {
    if (key.is_string()) return Value::undefined("'" + obj.type_name() + " object' has no attribute '" + key.as_string() + "'");
    return Value::undefined("'" + obj.type_name() + " object' has no element " + repr(key));
  };
  switch (obj.kind()) {
    case Value::Kind::Undefined: fail(obj.undefined_hint());
    case Value::Kind::Dict: {
      if (const Value* v = obj.as_dict().find(key)) return *v;
      if (key.is_string()) {
        Value m = get_method(*this, obj, key.as_string());
        if (m.is_function()) return m;
      }
      return no_element();
    }
    case Value::Kind::List:
    case Value::Kind::String: {
      if (key.is_int() || key.is_bool()) {
        int64_t i = key.as_int();
        if (obj.is_list()) {
          const auto& items = obj.as_list().items;
          auto n = static_cast<int64_t>(items.size());
          if (i < 0) i += n;
          if (i < 0 || i >= n) return no_element();
          return items[static_cast<size_t>(i)];
        }
        const std::string& s = obj.as_string();
        if (is_ascii(s)) {
          auto n = static_cast<int64_t>(s.size());
          if (i < 0) i += n;
          if (i < 0 || i >= n) return no_element();
          return Value::string(std::string(1, s[static_cast<size_t>(i)]));
        }
        std::vector<size_t> offs = cp_offsets(s);
        auto n = static_cast<int64_t>(offs.size() - 1);
        if (i < 0) i += n;
        if (i < 0 || i >= n) return no_element();
        auto k = static_cast<size_t>(i);
        return Value::string(s.substr(offs[k], offs[k + 1] - offs[k]));
      }
      if (key.is_string()) {
        Value m = get_method(*this, obj, key.as_string());
        if (m.is_function()) return m;
      }
      return no_element();
    }
    case Value::Kind::Object:
      if (key.is_string()) return obj.as_object().get_attr(key.as_string());
      return no_element();
    default: return no_element();
  }
}

Value Interp::call(const Value& callee, CallArgs& args) {
  if (callee.is_function()) return callee.as_function().call(*this, args);
  if (callee.is_undefined()) fail(callee.undefined_hint());
  fail("'" + callee.type_name() + "' object is not callable");
}

std::vector<Value> Interp::iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::List: return v.as_list().items;
    case Value::Kind::Dict: {
      std::vector<Value> keys;
      keys.reserve(v.as_dict().size());
      for (const auto& [k, val] : v.as_dict().entries) keys.push_back(k);
      return keys;
    }
    case Value::Kind::String: {
      const std::string& s = v.as_string();
      std::vector<Value> chars;
      std::vector<size_t> offs = cp_offsets(s);
      chars.reserve(offs.size() - 1);
      for (size_t i = 0; i + 1 < offs.size(); ++i) chars.push_back(Value::string(s.substr(offs[i], offs[i + 1] - offs[i])));
      return chars;
    }
    case Value::Kind::Undefined: return {};
    default: fail("'" + v.type_name() + "' object is not iterable");
  }
}

bool Interp::contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::String:
      if (!item.is_string())
        fail("'in <string>' requires string as left operand, not " + item.type_name());
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Kind::List:
      for (const Value& x : container.as_list().items)
        if (equals(x, item)) return true;
      return false;
    case Value::Kind::Dict:
      if (item.is_dict() || (item.is_list() && !item.as_list().tuple)) fail("unhashable type: '" + item.type_name() + "'");
      return container.as_dict().find(item) != nullptr;
    case Value::Kind::Undefined: return false;
    default: fail("argument of type '" + container.type_name() + "' is not iterable");
  }
}

bool Interp::compare(CmpOp op, const Value& a, const Value& b) {
  switch (op) {
    case CmpOp::Eq: return equals(a, b);
    case CmpOp::Ne: return !equals(a, b);
    case CmpOp::In: return contains(b, a);
    case CmpOp::NotIn: return !contains(b, a);
    default: break;
  }
  if (a.is_undefined()) fail(a.undefined_hint());
  if (b.is_undefined()) fail(b.undefined_hint());
  switch (op) {
    case CmpOp::Lt: return less_than(a, b);
    case CmpOp::Le: return less_than(a, b) || equals(a, b);
    case CmpOp::Gt: return less_than(b, a);
    case CmpOp::Ge: return less_than(b, a) || equals(a, b);
    default: return false;
  }
}

Value py_percent_format(Interp& in, const std::string& fmt, const Value& args);

Value Interp::binary(BinOp op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail(a.undefined_hint());
  if (b.is_undefined()) fail(b.undefined_hint());
  const bool ints = (a.is_int() || a.is_bool()) && (b.is_int() || b.is_bool());
  const bool nums = a.is_number() && b.is_number();
  int64_t r = 0;
  switch (op) {
    case BinOp::Add:
      if (ints) {
        if (!checked_add(a.as_int(), b.as_int(), &r)) fail("integer overflow");
        return Value::integer(r);
      }
      if (nums) return Value::number(a.as_double() + b.as_double());
      if (a.is_string() && b.is_string()) {
        check_size(a.as_string().size() + b.as_string().size(), "string");
        return Value::string(a.as_string() + b.as_string());
      }
      if (a.is_list() && b.is_list() && a.as_list().tuple == b.as_list().tuple) {
        check_items(a.as_list().items.size() + b.as_list().items.size());
        std::vector<Value> items = a.as_list().items;
        items.insert(items.end(), b.as_list().items.begin(), b.as_list().items.end());
        return Value::list(std::move(items), a.as_list().tuple);
      }
      if (a.is_string()) fail("can only concatenate str (not \"" + b.type_name() + "\") to str");
      if (a.is_list()) fail("can only concatenate " + a.type_name() + " (not \"" + b.type_name() + "\") to " + a.type_name());
      fail(operand_types("+", a, b));
    case BinOp::Sub:
      if (ints) {
        if (!checked_sub(a.as_int(), b.as_int(), &r)) fail("integer overflow");
        return Value::integer(r);
      }
      if (nums) return Value::number(a.as_double() - b.as_double());
      fail(operand_types("-", a, b));
    case BinOp::Mul: {
      if (ints) {
        if (!checked_mul(a.as_int(), b.as_int(), &r)) fail("integer overflow");
        return Value::integer(r);
      }
      if (nums) return Value::number(a.as_double() * b.as_double());
      const Value* seq = nullptr;
      const Value* count = nullptr;
      if ((a.is_string() || a.is_list()) && (b.is_int() || b.is_bool())) {
        seq = &a;
        count = &b;
      } else if ((b.is_string() || b.is_list()) && (a.is_int() || a.is_bool())) {
        seq = &b;
        count = &a;
      }
      if (!seq) fail(operand_types("*", a, b));
      int64_t n = std::max<int64_t>(0, count->as_int());
      if (seq->is_string()) {
        const std::string& s = seq->as_string();
        if (!s.empty()) check_size(static_cast<uint64_t>(n) > options().max_output_bytes ? options().max_output_bytes + 1 : s.size() * static_cast<size_t>(n), "string");
        std::string out;
        out.reserve(s.size() * static_cast<size_t>(s.empty() ? 0 : n));
        for (int64_t i = 0; i < n && !s.empty(); ++i) out += s;
        return Value::string(std::move(out));
      }
      const auto& items = seq->as_list().items;
      if (!items.empty()) check_items(static_cast<uint64_t>(n) > options().max_iterations ? options().max_iterations + 1 : items.size() * static_cast<size_t>(n));
      std::vector<Value> out;
      for (int64_t i = 0; i < n && !items.empty(); ++i) out.insert(out.end(), items.begin(), items.end());
      return Value::list(std::move(out), seq->as_list().tuple);
    }
    case BinOp::Div:
      if (!nums) fail(operand_types("/", a, b));
      if (b.as_double() == 0.0) fail("division by zero");
      return Value::number(a.as_double() / b.as_double());
    case BinOp::FloorDiv:
      if (ints) {
        if (b.as_int() == 0) fail("integer division or modulo by zero");
        if (a.as_int() == INT64_MIN && b.as_int() == -1) fail("integer overflow");
        return Value::integer(floor_div(a.as_int(), b.as_int()));
      }
      if (nums) {
        if (b.as_double() == 0.0) fail("float floor division by zero");
        return Value::number(std::floor(a.as_double() / b.as_double()));
      }
      fail(operand_types("//", a, b));
    case BinOp::Mod:
      if (ints) {
        if (b.as_int() == 0) fail("integer division or modulo by zero");
        if (b.as_int() == -1) return Value::integer(0);
        return Value::integer(py_mod(a.as_int(), b.as_int()));
      }
      if (nums) {
        double x = a.as_double(), y = b.as_double();
        if (y == 0.0) fail("float modulo by zero");
        double m = std::fmod(x, y);
        if (m != 0.0 && ((m < 0) != (y < 0))) m += y;
        return Value::number(m);
      }
      if (a.is_string()) return py_percent_format(*this, a.as_string(), b);
      fail(operand_types("%", a, b));
    case BinOp::Pow:
      if (ints && b.as_int() >= 0) {
        int64_t base = a.as_int(), e = b.as_int(), result = 1;
        while (e > 0) {
          if (e & 1)
            if (!checked_mul(result, base, &result)) fail("integer overflow");
          e >>= 1;
          // Squared only while bits remain, so an overflow here means the result overflows.
          if (e > 0 && !checked_mul(base, base, &base)) fail("integer overflow");
        }
        return Value::integer(result);
      }
      if (nums) {
        double x = a.as_double(), y = b.as_double();
        if (x == 0.0 && y < 0) fail("zero cannot be raised to a negative power");
        double p = std::pow(x, y);
        if (std::isnan(p) && !std::isnan(x) && !std::isnan(y)) fail("negative number cannot be raised to a fractional power");
        return Value::number(p);
      }
      fail(operand_types("** or pow()", a, b));
  }
  fail("internal error: unknown operator");
}

}  // namespace jinja

// ------------------------------------------------------------------ public API

JinjaTemplate::JinjaTemplate(std::string_view source, std::string name, JinjaOptions options)
    : program_(jinja::parse_template(source, std::move(name), options)) {}

JinjaTemplate::~JinjaTemplate() = default;

std::string JinjaTemplate::render(const nlohmann::ordered_json& variables) const {
  jinja::Interp interp(*program_);
  return interp.render(variables);
}

const std::string& JinjaTemplate::name() const { return program_->name; }

}  // namespace lily::text
