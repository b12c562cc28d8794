// Jinja builtins: filters, tests, methods of str / dict / list values, and the
// global functions (range, namespace, dict, raise_exception, strftime_now,
// joiner). Behaviour follows Jinja 3 and Python; mutating methods are refused
// as in the sandbox transformers renders chat templates in.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <unordered_map>
#include <unordered_set>

#include <utf8proc.h>

#include "text/jinja_internal.h"

namespace lily::text::jinja {

Value py_percent_format(Interp& in, const std::string& fmt, const Value& args);

namespace {

// ------------------------------------------------------------------ helpers

const std::string& str_arg(Interp& in, const Value& v, const std::string& what) {
  if (!v.is_string()) in.fail(what + " must be a string, not '" + v.type_name() + "'");
  return v.as_string();
}

int64_t int_arg(Interp& in, const Value& v, const std::string& what) {
  if (!v.is_int() && !v.is_bool()) in.fail(what + " must be an integer, not '" + v.type_name() + "'");
  return v.as_int();
}

bool given(const Value& v) { return !v.is_undefined(); }
bool given_not_none(const Value& v) { return !v.is_undefined() && !v.is_none(); }

Value str_list(Interp& in, std::vector<std::string> parts) {
  in.check_items(parts.size());
  std::vector<Value> items;
  items.reserve(parts.size());
  for (auto& p : parts) items.push_back(Value::string(std::move(p)));
  return Value::list(std::move(items));
}

Value make_function(std::string name, std::function<Value(Interp&, CallArgs&)> fn) {
  auto f = std::make_shared<Function>();
  f->name = std::move(name);
  f->call = std::move(fn);
  return Value::function(std::move(f));
}

// Python's str.replace.
std::string py_replace(Interp& in, const std::string& s, const std::string& old, const std::string& neu, int64_t count) {
  std::string out;
  if (old.empty()) {
    std::vector<size_t> offs = cp_offsets(s);
    int64_t done = 0;
    for (size_t i = 0; i + 1 < offs.size() + 1; ++i) {
      if (count < 0 || done < count) {
        out += neu;
        ++done;
      }
      if (i + 1 < offs.size()) out.append(s, offs[i], offs[i + 1] - offs[i]);
      in.check_size(out.size(), "string");
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t hit = s.find(old, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += neu;
    in.check_size(out.size(), "string");
    pos = hit + old.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  in.check_size(out.size(), "string");
  return out;
}

// Python's start/end adjustment for str methods, in code points.
void adjust_range(int64_t len, const Value& start_v, const Value& end_v, int64_t* start, int64_t* end) {
  *start = given_not_none(start_v) ? start_v.as_int() : 0;
  *end = given_not_none(end_v) ? end_v.as_int() : len;
  if (*end > len) *end = len;
  if (*end < 0) *end = std::max<int64_t>(0, *end + len);
  if (*start < 0) *start = std::max<int64_t>(0, *start + len);
}

// The code-point window [start, end) of s as bytes, plus the byte offset of each code point.
struct Window {
  std::vector<size_t> offs;
  int64_t start = 0, end = 0;
  bool empty_range = false;
  std::string_view text(const std::string& s) const {
    if (empty_range) return {};
    return std::string_view(s).substr(offs[static_cast<size_t>(start)],
                                      offs[static_cast<size_t>(end)] - offs[static_cast<size_t>(start)]);
  }
  int64_t cp_index(size_t byte) const {  // byte offset -> code point index
    return static_cast<int64_t>(std::lower_bound(offs.begin(), offs.end(), byte) - offs.begin());
  }
};

Window window(Interp& in, const std::string& s, const Value& start_v, const Value& end_v) {
  Window w;
  w.offs = cp_offsets(s);
  if (given_not_none(start_v)) int_arg(in, start_v, "start");
  if (given_not_none(end_v)) int_arg(in, end_v, "end");
  adjust_range(static_cast<int64_t>(w.offs.size() - 1), start_v, end_v, &w.start, &w.end);
  if (w.start > w.end) {
    w.empty_range = true;
    w.end = w.start;
  }
  return w;
}

// The fill character of ljust / rjust / center: exactly one character.
std::string fill_char(Interp& in, const Value& v) {
  if (!given(v)) return " ";
  const std::string& f = str_arg(in, v, "fillchar");
  if (cp_count(f) != 1) in.fail("The fill character must be exactly one character long");
  return f;
}

std::string pad_to(const std::string& s, int64_t width, char align, const std::string& fill) {
  auto len = static_cast<int64_t>(cp_count(s));
  if (width <= len) return s;
  int64_t marg = width - len, left = 0;
  if (align == '<') left = 0;
  else if (align == '>') left = marg;
  else left = marg / 2 + (marg & width & 1);
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fill;
  out += s;
  for (int64_t i = 0; i < marg - left; ++i) out += fill;
  return out;
}

template <typename Pred>
bool all_cps(const std::string& s, Pred pred) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size();) {
    size_t len;
    uint32_t cp = decode_cp(s, i, &len);
    if (!pred(cp)) return false;
    i += len;
  }
  return true;
}

utf8proc_category_t cat(uint32_t cp) { return utf8proc_category(static_cast<utf8proc_int32_t>(cp)); }
bool is_letter(uint32_t cp) {
  auto c = cat(cp);
  return c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO;
}
bool is_decimal(uint32_t cp) { return cat(cp) == UTF8PROC_CATEGORY_ND; }
bool is_numeric(uint32_t cp) {
  auto c = cat(cp);
  return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

// str.isupper / islower: some cased character, and none of the other case.
bool case_test(const std::string& s, bool upper) {
  bool cased = false;
  for (size_t i = 0; i < s.size();) {
    size_t len;
    uint32_t cp = decode_cp(s, i, &len);
    i += len;
    auto c = cat(cp);
    if (c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LT) {
      if (!upper) return false;
      cased = true;
    } else if (c == UTF8PROC_CATEGORY_LL) {
      if (upper) return false;
      cased = true;
    }
  }
  return cased;
}

// Attribute path "a.b.0" as Jinja's make_attrgetter reads it.
Value get_path(Interp& in, const Value& item, const Value& attribute) {
  if (attribute.is_int()) return in.get_item(item, attribute);
  const std::string& path = str_arg(in, attribute, "attribute");
  Value cur = item;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (digits && part.size() < 18)
      cur = in.get_item(cur, Value::integer(std::stoll(part)));
    else
      cur = in.get_item(cur, Value::string(part));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return cur;
}

Value lower_if_string(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::string(py_lower(v.as_string()));
  return v;
}

// Python int(str, base) for the int filter: optional sign, underscores between digits.
bool parse_int(const std::string& raw, int base, int64_t* out) {
  std::string s = py_strip(raw, nullptr, true, true);
  size_t i = 0;
  bool neg = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
  if (base == 16 && i + 1 < s.size() && s[i] == '0' && (s[i + 1] == 'x' || s[i + 1] == 'X')) i += 2;
  else if (base == 8 && i + 1 < s.size() && s[i] == '0' && (s[i + 1] == 'o' || s[i + 1] == 'O')) i += 2;
  else if (base == 2 && i + 1 < s.size() && s[i] == '0' && (s[i + 1] == 'b' || s[i + 1] == 'B')) i += 2;
  if (i >= s.size()) return false;
  unsigned __int128 v = 0;
  bool prev_digit = false;
  for (; i < s.size(); ++i) {
    char c = s[i];
    if (c == '_' && prev_digit && i + 1 < s.size() && s[i + 1] != '_') {
      prev_digit = false;
      continue;
    }
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'z') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'Z') d = c - 'A' + 10;
    else return false;
    if (d >= base) return false;
    v = v * static_cast<unsigned>(base) + static_cast<unsigned>(d);
    if (v > static_cast<unsigned __int128>(INT64_MAX) + 1) return false;
    prev_digit = true;
  }
  if (!prev_digit) return false;
  if (!neg && v > static_cast<unsigned __int128>(INT64_MAX)) return false;
  *out = neg ? static_cast<int64_t>(-static_cast<__int128>(v)) : static_cast<int64_t>(v);
  return true;
}

bool parse_float(const std::string& raw, double* out) {
  std::string s = py_strip(raw, nullptr, true, true);
  std::string t;
  for (char c : s)
    if (c != '_') t += static_cast<char>(tolower(static_cast<unsigned char>(c)));
  std::string body = t;
  bool neg = false;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) {
    neg = body[0] == '-';
    body.erase(0, 1);
  }
  if (body == "inf" || body == "infinity") {
    *out = neg ? -INFINITY : INFINITY;
    return true;
  }
  if (body == "nan") {
    *out = NAN;
    return true;
  }
  if (body.empty() || body.find_first_not_of("0123456789.e+-") != std::string::npos) return false;
  char* end = nullptr;
  double v = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size()) return false;
  *out = v;
  return true;
}

// ------------------------------------------------------------------ filters

using FilterFn = Value (*)(Interp&, Value&, CallArgs&);

std::vector<Value> seq_items(Interp& in, const Value& v) { return in.iterate(v); }

Value f_length(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "length", a, {});
  switch (v.kind()) {
    case Value::Kind::String: return Value::integer(static_cast<int64_t>(cp_count(v.as_string())));
    case Value::Kind::List: return Value::integer(static_cast<int64_t>(v.as_list().items.size()));
    case Value::Kind::Dict: return Value::integer(static_cast<int64_t>(v.as_dict().size()));
    case Value::Kind::Undefined: return Value::integer(0);
    default: in.fail("object of type '" + v.type_name() + "' has no len()");
  }
}

Value f_tojson(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "tojson", a, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonStyle st;
  st.ensure_ascii = given(p[0]) && p[0].truthy();
  if (given_not_none(p[1])) {
    st.has_indent = true;
    if (p[1].is_string())
      st.indent = p[1].as_string();
    else
      st.indent = std::string(static_cast<size_t>(std::clamp<int64_t>(int_arg(in, p[1], "tojson indent"), 0, 1024)), ' ');
    st.item_sep = ",";
  }
  if (given_not_none(p[2])) {
    if (!p[2].is_list() || p[2].as_list().items.size() != 2)
      in.fail("tojson separators must be a pair of strings (item_separator, key_separator)");
    st.item_sep = str_arg(in, p[2].as_list().items[0], "tojson separators[0]");
    st.key_sep = str_arg(in, p[2].as_list().items[1], "tojson separators[1]");
  }
  st.sort_keys = given(p[3]) && p[3].truthy();
  return in.string_value(to_json(v, st));
}

Value f_string(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "string", a, {});
  if (v.is_string()) return v;
  return in.string_value(to_str(v));
}

Value f_trim(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "trim", a, {"chars"});
  std::string s = to_str(v);
  if (given_not_none(p[0])) return Value::string(py_strip(s, &str_arg(in, p[0], "trim chars"), true, true));
  return Value::string(py_strip(s, nullptr, true, true));
}

Value f_upper(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "upper", a, {});
  return Value::string(py_upper(to_str(v)));
}
Value f_lower(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "lower", a, {});
  return Value::string(py_lower(to_str(v)));
}
Value f_capitalize(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "capitalize", a, {});
  return Value::string(py_capitalize(to_str(v)));
}

// Jinja's title filter: words begin after '-', whitespace, and opening brackets.
Value f_title(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "title", a, {});
  std::string s = to_str(v), out;
  bool at_start = true;
  for (size_t i = 0; i < s.size();) {
    size_t len;
    uint32_t cp = decode_cp(s, i, &len);
    bool sep = cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || py_isspace(cp);
    std::string one = s.substr(i, len);
    if (sep) {
      out += one;
      at_start = true;
    } else {
      out += at_start ? py_upper(one) : py_lower(one);
      at_start = false;
    }
    i += len;
  }
  return Value::string(std::move(out));
}

Value f_safe(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "safe", a, {});
  if (v.is_string()) return v;
  return in.string_value(to_str(v));
}

Value f_join(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "join", a, {"d", "attribute"});
  std::string sep = given(p[0]) ? to_str(p[0]) : "";
  std::string out;
  bool first = true;
  for (const Value& item : seq_items(in, v)) {
    if (!first) out += sep;
    first = false;
    Value x = given_not_none(p[1]) ? get_path(in, item, p[1]) : item;
    out += x.is_string() ? x.as_string() : to_str(x);
    in.check_size(out.size(), "string");
  }
  return Value::string(std::move(out));
}

Value f_first(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "first", a, {});
  if (v.is_list()) {
    if (v.as_list().items.empty()) return Value::undefined("No first item, sequence was empty.");
    return v.as_list().items.front();
  }
  auto items = seq_items(in, v);
  if (items.empty()) return Value::undefined("No first item, sequence was empty.");
  return items.front();
}

Value f_last(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "last", a, {});
  auto items = seq_items(in, v);
  if (items.empty()) return Value::undefined("No last item, sequence was empty.");
  return items.back();
}

Value f_default(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "default", a, {"default_value", "boolean"});
  bool boolean = given(p[1]) && p[1].truthy();
  if (v.is_undefined() || (boolean && !v.truthy())) return given(p[0]) ? p[0] : Value::string("");
  return v;
}

Value f_replace(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "replace", a, {"old", "new", "count"}, 2);
  int64_t count = given_not_none(p[2]) ? int_arg(in, p[2], "replace count") : -1;
  return Value::string(py_replace(in, to_str(v), to_str(p[0]), to_str(p[1]), count));
}

Value f_list(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "list", a, {});
  if (v.is_list() && !v.as_list().tuple) return v;
  return Value::list(seq_items(in, v));
}

Value f_items(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "items", a, {});
  if (v.is_undefined()) return Value::list({});
  if (!v.is_dict()) in.fail("Can only get item pairs from a mapping.");
  std::vector<Value> out;
  for (const auto& [k, x] : v.as_dict().entries) out.push_back(Value::list({k, x}, true));
  return Value::list(std::move(out));
}

Value f_map(Interp& in, Value& v, CallArgs& a) {
  std::vector<Value> items = seq_items(in, v);
  std::vector<Value> out;
  out.reserve(items.size());
  if (a.pos.empty()) {
    Value attribute, def;
    for (auto& [k, x] : a.kw) {
      if (k == "attribute") attribute = x;
      else if (k == "default") def = x;
      else in.fail("map() got an unexpected keyword argument '" + k + "'");
    }
    if (!given(attribute)) in.fail("map requires a filter argument");
    for (const Value& item : items) {
      Value x = get_path(in, item, attribute);
      out.push_back(x.is_undefined() && given(def) ? def : x);
    }
    return Value::list(std::move(out));
  }
  std::string name = str_arg(in, a.pos[0], "map filter name");
  CallArgs rest;
  rest.pos.assign(a.pos.begin() + 1, a.pos.end());
  rest.kw = a.kw;
  if (!filter_exists(name)) in.fail("no filter named '" + name + "'");
  for (const Value& item : items) {
    in.tick();
    CallArgs copy = rest;
    out.push_back(call_filter(in, name, item, copy));
  }
  return Value::list(std::move(out));
}

// select / reject / selectattr / rejectattr
Value select_common(Interp& in, Value& v, CallArgs& a, bool with_attr, bool keep_if) {
  size_t first = with_attr ? 1 : 0;
  if (with_attr && a.pos.empty()) in.fail("selectattr/rejectattr need an attribute name");
  if (!a.kw.empty()) in.fail("select filters take no keyword arguments");
  Value attribute = with_attr ? a.pos[0] : Value();
  std::string test;
  CallArgs targs;
  if (a.pos.size() > first) {
    test = str_arg(in, a.pos[first], "test name");
    if (!test_exists(test)) in.fail("no test named '" + test + "'");
    targs.pos.assign(a.pos.begin() + static_cast<long>(first) + 1, a.pos.end());
  }
  std::vector<Value> out;
  for (const Value& item : seq_items(in, v)) {
    in.tick();
    Value x = with_attr ? get_path(in, item, attribute) : item;
    bool ok;
    if (test.empty()) {
      ok = x.truthy();
    } else {
      CallArgs copy = targs;
      ok = call_test(in, test, x, copy);
    }
    if (ok == keep_if) out.push_back(item);
  }
  return Value::list(std::move(out));
}

Value f_select(Interp& in, Value& v, CallArgs& a) { return select_common(in, v, a, false, true); }
Value f_reject(Interp& in, Value& v, CallArgs& a) { return select_common(in, v, a, false, false); }
Value f_selectattr(Interp& in, Value& v, CallArgs& a) { return select_common(in, v, a, true, true); }
Value f_rejectattr(Interp& in, Value& v, CallArgs& a) { return select_common(in, v, a, true, false); }

Value f_int(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "int", a, {"default", "base"});
  Value def = given(p[0]) ? p[0] : Value::integer(0);
  int base = given(p[1]) ? static_cast<int>(int_arg(in, p[1], "int base")) : 10;
  if (base < 2 || base > 36) in.fail("int() base must be >= 2 and <= 36");
  if (v.is_undefined()) in.fail(v.undefined_hint());
  if (v.is_int() || v.is_bool()) return Value::integer(v.as_int());
  auto from_double = [&](double d) -> Value {
    if (std::isnan(d)) in.fail("cannot convert float NaN to integer");
    if (std::isinf(d)) in.fail("cannot convert float infinity to integer");
    double t = std::trunc(d);
    if (std::fabs(t) >= 9.2233720368547758e18) in.fail("integer overflow");
    return Value::integer(static_cast<int64_t>(t));
  };
  if (v.is_float()) return from_double(v.as_double());
  if (v.is_string()) {
    int64_t i;
    if (parse_int(v.as_string(), base, &i)) return Value::integer(i);
    double d;
    if (parse_float(v.as_string(), &d)) return from_double(d);
  }
  return def;
}

Value f_float(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "float", a, {"default"});
  if (v.is_undefined()) in.fail(v.undefined_hint());
  if (v.is_number()) return Value::number(v.as_double());
  double d;
  if (v.is_string() && parse_float(v.as_string(), &d)) return Value::number(d);
  return given(p[0]) ? p[0] : Value::number(0.0);
}

Value f_abs(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "abs", a, {});
  if (v.is_int() || v.is_bool()) {
    int64_t i = v.as_int();
    if (i == INT64_MIN) in.fail("integer overflow");
    return Value::integer(i < 0 ? -i : i);
  }
  if (v.is_float()) return Value::number(std::fabs(v.as_double()));
  in.fail("bad operand type for abs(): '" + v.type_name() + "'");
}

Value f_round(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "round", a, {"precision", "method"});
  int64_t precision = given(p[0]) ? int_arg(in, p[0], "round precision") : 0;
  std::string method = given(p[1]) ? str_arg(in, p[1], "round method") : "common";
  if (method != "common" && method != "ceil" && method != "floor")
    in.fail("method must be 'common', 'ceil' or 'floor'");
  if (!v.is_number()) in.fail("type " + v.type_name() + " doesn't define __round__ method");
  precision = std::clamp<int64_t>(precision, -30, 30);
  if (method == "common" && (v.is_int() || v.is_bool()) && precision >= 0) return Value::integer(v.as_int());
  double x = v.as_double();
  if (!std::isfinite(x)) return Value::number(x);
  double scale = std::pow(10.0, static_cast<double>(precision));
  if (method == "ceil") return Value::number(std::ceil(x * scale) / scale);
  if (method == "floor") return Value::number(std::floor(x * scale) / scale);
  double r;
  if (precision == 0) {
    r = std::nearbyint(x);  // round half to even, as Python
  } else if (precision > 0) {
    char buf[512];
    std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(precision), x);
    r = std::strtod(buf, nullptr);
  } else {
    r = std::nearbyint(x / std::pow(10.0, static_cast<double>(-precision))) * std::pow(10.0, static_cast<double>(-precision));
  }
  if (v.is_int() || v.is_bool()) return Value::integer(static_cast<int64_t>(r));
  return Value::number(r);
}

Value f_indent(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "indent", a, {"width", "first", "blank"});
  std::string indention;
  if (given(p[0]) && p[0].is_string())
    indention = p[0].as_string();
  else
    indention = std::string(static_cast<size_t>(std::clamp<int64_t>(given(p[0]) ? int_arg(in, p[0], "indent width") : 4, 0, 1024)), ' ');
  bool first = given(p[1]) && p[1].truthy();
  bool blank = given(p[2]) && p[2].truthy();
  std::string s = to_str(v) + "\n";
  std::vector<std::string> lines = py_splitlines(s, false);
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i) rv += "\n" + indention;
      rv += lines[i];
      in.check_size(rv.size(), "string");
    }
  } else if (!lines.empty()) {
    rv = lines[0];
    for (size_t i = 1; i < lines.size(); ++i) {
      rv += "\n";
      if (!lines[i].empty()) rv += indention;
      rv += lines[i];
      in.check_size(rv.size(), "string");
    }
  }
  if (first) rv = indention + rv;
  return in.string_value(std::move(rv));
}

Value f_center(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "center", a, {"width"});
  int64_t width = given(p[0]) ? int_arg(in, p[0], "center width") : 80;
  in.check_size(static_cast<size_t>(std::max<int64_t>(0, width)), "string");
  return Value::string(pad_to(to_str(v), width, '^', " "));
}

Value f_wordcount(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "wordcount", a, {});
  std::string s = to_str(v);
  int64_t n = 0;
  bool in_word = false;
  for (size_t i = 0; i < s.size();) {
    size_t len;
    uint32_t cp = decode_cp(s, i, &len);
    i += len;
    bool w = cp == '_' || is_letter(cp) || is_numeric(cp);
    if (w && !in_word) ++n;
    in_word = w;
  }
  return Value::integer(n);
}

Value f_escape(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "escape", a, {});
  std::string s = to_str(v), out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return in.string_value(std::move(out));
}

Value f_format(Interp& in, Value& v, CallArgs& a) {
  std::string fmt = to_str(v);
  if (!a.kw.empty()) {
    if (!a.pos.empty()) in.fail("can't handle positional and keyword arguments at the same time");
    auto d = std::make_shared<DictData>();
    for (auto& [k, x] : a.kw) d->set(Value::string(k), x);
    return py_percent_format(in, fmt, Value::dict(std::move(d)));
  }
  return py_percent_format(in, fmt, Value::list(a.pos, true));
}

Value f_attr(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "attr", a, {"name"}, 1);
  const std::string& name = str_arg(in, p[0], "attr name");
  if (v.is_dict()) {  // attributes only: a dict's keys are not its attributes
    Value m = get_method(in, v, name);
    return m.is_function() ? m : Value::undefined("'dict object' has no attribute '" + name + "'");
  }
  return in.get_attr(v, name);
}

Value f_reverse(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "reverse", a, {});
  if (v.is_string()) {
    const std::string& s = v.as_string();
    std::vector<size_t> offs = cp_offsets(s);
    std::string out;
    out.reserve(s.size());
    for (size_t i = offs.size() - 1; i > 0; --i) out.append(s, offs[i - 1], offs[i] - offs[i - 1]);
    return Value::string(std::move(out));
  }
  std::vector<Value> items = seq_items(in, v);
  std::reverse(items.begin(), items.end());
  return Value::list(std::move(items));
}

Value f_sort(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "sort", a, {"reverse", "case_sensitive", "attribute"});
  bool reverse = given(p[0]) && p[0].truthy();
  bool cs = given(p[1]) && p[1].truthy();
  std::vector<Value> attrs;
  if (given_not_none(p[2])) {
    if (p[2].is_string()) {
      std::string s = p[2].as_string();
      size_t start = 0;
      while (true) {
        size_t comma = s.find(',', start);
        attrs.push_back(Value::string(py_strip(s.substr(start, comma == std::string::npos ? std::string::npos : comma - start), nullptr, true, true)));
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    } else {
      attrs.push_back(p[2]);
    }
  }
  std::vector<Value> items = seq_items(in, v);
  std::vector<std::pair<std::vector<Value>, size_t>> keyed;
  keyed.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    std::vector<Value> key;
    if (attrs.empty()) key.push_back(lower_if_string(items[i], cs));
    for (const Value& at : attrs) key.push_back(lower_if_string(get_path(in, items[i], at), cs));
    keyed.emplace_back(std::move(key), i);
  }
  auto key_less = [](const std::vector<Value>& x, const std::vector<Value>& y) {
    for (size_t k = 0; k < x.size(); ++k) {
      if (less_than(x[k], y[k])) return true;
      if (less_than(y[k], x[k])) return false;
    }
    return false;
  };
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
    return reverse ? key_less(y.first, x.first) : key_less(x.first, y.first);
  });
  std::vector<Value> out;
  out.reserve(items.size());
  for (auto& [k, i] : keyed) out.push_back(items[i]);
  return Value::list(std::move(out));
}

Value f_dictsort(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "dictsort", a, {"case_sensitive", "by", "reverse"});
  bool cs = given(p[0]) && p[0].truthy();
  std::string by = given(p[1]) ? str_arg(in, p[1], "dictsort by") : "key";
  bool reverse = given(p[2]) && p[2].truthy();
  if (by != "key" && by != "value") in.fail("You can only sort by either 'key' or 'value'");
  if (!v.is_dict()) in.fail("dictsort needs a mapping, not '" + v.type_name() + "'");
  std::vector<std::pair<Value, Value>> entries = v.as_dict().entries;
  size_t idx = by == "key" ? 0 : 1;
  std::stable_sort(entries.begin(), entries.end(), [&](const auto& x, const auto& y) {
    const Value& xa = idx == 0 ? x.first : x.second;
    const Value& ya = idx == 0 ? y.first : y.second;
    Value xk = lower_if_string(xa, cs), yk = lower_if_string(ya, cs);
    return reverse ? less_than(yk, xk) : less_than(xk, yk);
  });
  std::vector<Value> out;
  for (auto& [k, x] : entries) out.push_back(Value::list({k, x}, true));
  return Value::list(std::move(out));
}

Value f_unique(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "unique", a, {"case_sensitive", "attribute"});
  bool cs = given(p[0]) && p[0].truthy();
  std::unordered_set<std::string> seen;
  std::vector<Value> out;
  for (const Value& item : seq_items(in, v)) {
    Value key = given_not_none(p[1]) ? get_path(in, item, p[1]) : item;
    if (seen.insert(hash_key(lower_if_string(key, cs))).second) out.push_back(item);
  }
  return Value::list(std::move(out));
}

Value min_max(Interp& in, Value& v, CallArgs& a, bool want_max) {
  auto p = bind_args(in, want_max ? "max" : "min", a, {"case_sensitive", "attribute"});
  bool cs = given(p[0]) && p[0].truthy();
  std::vector<Value> items = seq_items(in, v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  auto key = [&](size_t i) {
    return lower_if_string(given_not_none(p[1]) ? get_path(in, items[i], p[1]) : items[i], cs);
  };
  Value best_key = key(0);
  for (size_t i = 1; i < items.size(); ++i) {
    Value k = key(i);
    if (want_max ? less_than(best_key, k) : less_than(k, best_key)) {
      best = i;
      best_key = k;
    }
  }
  return items[best];
}
Value f_min(Interp& in, Value& v, CallArgs& a) { return min_max(in, v, a, false); }
Value f_max(Interp& in, Value& v, CallArgs& a) { return min_max(in, v, a, true); }

Value f_sum(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "sum", a, {"attribute", "start"});
  Value total = given(p[1]) ? p[1] : Value::integer(0);
  for (const Value& item : seq_items(in, v)) {
    Value x = given_not_none(p[0]) ? get_path(in, item, p[0]) : item;
    total = in.binary(BinOp::Add, total, x);
  }
  return total;
}

Value f_batch(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "batch", a, {"linecount", "fill_with"}, 1);
  int64_t n = int_arg(in, p[0], "batch linecount");
  if (n <= 0) in.fail("batch linecount must be positive");
  if (given_not_none(p[1])) in.check_items(static_cast<uint64_t>(n));
  std::vector<Value> out, tmp;
  for (const Value& item : seq_items(in, v)) {
    if (static_cast<int64_t>(tmp.size()) == n) {
      out.push_back(Value::list(std::move(tmp)));
      tmp.clear();
    }
    tmp.push_back(item);
  }
  if (!tmp.empty()) {
    if (given_not_none(p[1]))
      while (static_cast<int64_t>(tmp.size()) < n) tmp.push_back(p[1]);
    out.push_back(Value::list(std::move(tmp)));
  }
  return Value::list(std::move(out));
}

Value f_truncate(Interp& in, Value& v, CallArgs& a) {
  auto p = bind_args(in, "truncate", a, {"length", "killwords", "end", "leeway"});
  std::string s = to_str(v);
  int64_t length = given(p[0]) ? int_arg(in, p[0], "truncate length") : 255;
  bool killwords = given(p[1]) && p[1].truthy();
  std::string end = given(p[2]) ? str_arg(in, p[2], "truncate end") : "...";
  int64_t leeway = given_not_none(p[3]) ? int_arg(in, p[3], "truncate leeway") : 5;
  auto end_len = static_cast<int64_t>(cp_count(end));
  if (length < end_len) in.fail(str_cat("expected length >= ", end_len, ", got ", length));
  if (leeway < 0) in.fail(str_cat("expected leeway >= 0, got ", leeway));
  std::vector<size_t> offs = cp_offsets(s);
  auto n = static_cast<int64_t>(offs.size() - 1);
  if (n - length <= leeway) return Value::string(s);
  std::string head = s.substr(0, offs[static_cast<size_t>(length - end_len)]);
  if (killwords) return Value::string(head + end);
  size_t sp = head.rfind(' ');
  if (sp != std::string::npos) head.resize(sp);
  return Value::string(head + end);
}

Value f_pprint(Interp& in, Value& v, CallArgs& a) {
  bind_args(in, "pprint", a, {});
  return in.string_value(repr(v));
}

const std::unordered_map<std::string, FilterFn>& filters() {
  static const std::unordered_map<std::string, FilterFn> table = {
      {"abs", f_abs},
      {"attr", f_attr},
      {"batch", f_batch},
      {"capitalize", f_capitalize},
      {"center", f_center},
      {"count", f_length},
      {"d", f_default},
      {"default", f_default},
      {"dictsort", f_dictsort},
      {"e", f_escape},
      {"escape", f_escape},
      {"first", f_first},
      {"float", f_float},
      {"forceescape", f_escape},
      {"format", f_format},
      {"indent", f_indent},
      {"int", f_int},
      {"items", f_items},
      {"join", f_join},
      {"last", f_last},
      {"length", f_length},
      {"list", f_list},
      {"lower", f_lower},
      {"map", f_map},
      {"max", f_max},
      {"min", f_min},
      {"pprint", f_pprint},
      {"reject", f_reject},
      {"rejectattr", f_rejectattr},
      {"replace", f_replace},
      {"reverse", f_reverse},
      {"round", f_round},
      {"safe", f_safe},
      {"select", f_select},
      {"selectattr", f_selectattr},
      {"sort", f_sort},
      {"string", f_string},
      {"sum", f_sum},
      {"title", f_title},
      {"tojson", f_tojson},
      {"trim", f_trim},
      {"truncate", f_truncate},
      {"unique", f_unique},
      {"upper", f_upper},
      {"wordcount", f_wordcount},
  };
  return table;
}

// ------------------------------------------------------------------ tests

using TestFn = bool (*)(Interp&, const Value&, const std::vector<Value>&);

const Value& test_arg(Interp& in, const std::vector<Value>& args, const char* name) {
  if (args.size() != 1) in.fail(std::string("test '") + name + "' takes one argument");
  return args[0];
}

bool same_as(const Value& a, const Value& b) {
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::Undefined:
    case Value::Kind::None: return true;
    case Value::Kind::Bool:
    case Value::Kind::Int:
    case Value::Kind::Float: return equals(a, b);
    default: return a.identity() == b.identity();
  }
}

int64_t int_operand(Interp& in, const Value& v, const char* test) {
  if (v.is_undefined()) in.fail(v.undefined_hint());
  if (!v.is_int() && !v.is_bool()) in.fail(std::string("test '") + test + "' needs an integer, not '" + v.type_name() + "'");
  return v.as_int();
}

const std::unordered_map<std::string, TestFn>& tests() {
  static const std::unordered_map<std::string, TestFn> table = {
      {"defined", [](Interp&, const Value& v, const std::vector<Value>&) { return !v.is_undefined(); }},
      {"undefined", [](Interp&, const Value& v, const std::vector<Value>&) { return v.is_undefined(); }},
      {"none", [](Interp&, const Value& v, const std::vector<Value>&) { return v.is_none(); }},
      {"boolean", [](Interp&, const Value& v, const std::vector<Value>&) { return v.is_bool(); }},
      {"true", [](Interp&, const Value& v, const std::vector<Value>&) { return v.is_bool() && v.as_bool(); }},
      {"false", [](Interp&, const Value& v, const std::vector<Value>&) { return v.is_bool() && !v.as_bool(); }},
      {"integer", [](Interp&, const Value& v, const std::vector<Value>&) { return v.is_int(); }},
      {"float", [](Interp&, const Value& v, const std::vector<Value>&) { return v.is_float(); }},
      {"number", [](Interp&, const Value& v, const std::vector<Value>&) { return v.is_number(); }},
      {"string", [](Interp&, const Value& v, const std::vector<Value>&) { return v.is_string(); }},
      {"mapping", [](Interp&, const Value& v, const std::vector<Value>&) { return v.is_dict(); }},
      {"iterable",
       [](Interp&, const Value& v, const std::vector<Value>&) {
         return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined();
       }},
      {"sequence",
       [](Interp&, const Value& v, const std::vector<Value>&) {
         return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined();
       }},
      {"callable", [](Interp&, const Value& v, const std::vector<Value>&) { return v.is_function(); }},
      {"escaped", [](Interp&, const Value&, const std::vector<Value>&) { return false; }},
      {"sameas",
       [](Interp& in, const Value& v, const std::vector<Value>& a) { return same_as(v, test_arg(in, a, "sameas")); }},
      {"odd", [](Interp& in, const Value& v, const std::vector<Value>&) { return int_operand(in, v, "odd") % 2 != 0; }},
      {"even", [](Interp& in, const Value& v, const std::vector<Value>&) { return int_operand(in, v, "even") % 2 == 0; }},
      {"divisibleby",
       [](Interp& in, const Value& v, const std::vector<Value>& a) {
         Value m = in.binary(BinOp::Mod, v, test_arg(in, a, "divisibleby"));
         return equals(m, Value::integer(0));
       }},
      {"eq", [](Interp& in, const Value& v, const std::vector<Value>& a) { return equals(v, test_arg(in, a, "eq")); }},
      {"equalto", [](Interp& in, const Value& v, const std::vector<Value>& a) { return equals(v, test_arg(in, a, "equalto")); }},
      {"==", [](Interp& in, const Value& v, const std::vector<Value>& a) { return equals(v, test_arg(in, a, "==")); }},
      {"ne", [](Interp& in, const Value& v, const std::vector<Value>& a) { return !equals(v, test_arg(in, a, "ne")); }},
      {"!=", [](Interp& in, const Value& v, const std::vector<Value>& a) { return !equals(v, test_arg(in, a, "!=")); }},
      {"lt", [](Interp& in, const Value& v, const std::vector<Value>& a) { return less_than(v, test_arg(in, a, "lt")); }},
      {"lessthan", [](Interp& in, const Value& v, const std::vector<Value>& a) { return less_than(v, test_arg(in, a, "lessthan")); }},
      {"<", [](Interp& in, const Value& v, const std::vector<Value>& a) { return less_than(v, test_arg(in, a, "<")); }},
      {"le",
       [](Interp& in, const Value& v, const std::vector<Value>& a) {
         const Value& o = test_arg(in, a, "le");
         return less_than(v, o) || equals(v, o);
       }},
      {"<=",
       [](Interp& in, const Value& v, const std::vector<Value>& a) {
         const Value& o = test_arg(in, a, "<=");
         return less_than(v, o) || equals(v, o);
       }},
      {"gt", [](Interp& in, const Value& v, const std::vector<Value>& a) { return less_than(test_arg(in, a, "gt"), v); }},
      {"greaterthan", [](Interp& in, const Value& v, const std::vector<Value>& a) { return less_than(test_arg(in, a, "greaterthan"), v); }},
      {">", [](Interp& in, const Value& v, const std::vector<Value>& a) { return less_than(test_arg(in, a, ">"), v); }},
      {"ge",
       [](Interp& in, const Value& v, const std::vector<Value>& a) {
         const Value& o = test_arg(in, a, "ge");
         return less_than(o, v) || equals(v, o);
       }},
      {">=",
       [](Interp& in, const Value& v, const std::vector<Value>& a) {
         const Value& o = test_arg(in, a, ">=");
         return less_than(o, v) || equals(v, o);
       }},
      {"in", [](Interp& in, const Value& v, const std::vector<Value>& a) { return in.contains(test_arg(in, a, "in"), v); }},
      {"lower", [](Interp&, const Value& v, const std::vector<Value>&) { return case_test(to_str(v), false); }},
      {"upper", [](Interp&, const Value& v, const std::vector<Value>&) { return case_test(to_str(v), true); }},
      {"filter", [](Interp&, const Value& v, const std::vector<Value>&) { return v.is_string() && filter_exists(v.as_string()); }},
      {"test", [](Interp&, const Value& v, const std::vector<Value>&) { return v.is_string() && test_exists(v.as_string()); }},
  };
  return table;
}

// ------------------------------------------------------------------ methods

using MethodFn = Value (*)(Interp&, const Value& self, CallArgs&);

Value bind_method(const Value& self, const std::string& name, MethodFn fn) {
  return make_function(name, [self, fn](Interp& in, CallArgs& a) { return fn(in, self, a); });
}

bool prefix_match(Interp& in, const Value& self, CallArgs& a, const char* what, bool at_end) {
  auto p = bind_args(in, what, a, {"prefix", "start", "end"}, 1);
  const std::string& s = self.as_string();
  Window w = window(in, s, p[1], p[2]);
  if (w.empty_range) return false;
  std::string_view text = w.text(s);
  std::vector<Value> options;
  if (p[0].is_list() && p[0].as_list().tuple)
    options = p[0].as_list().items;
  else
    options.push_back(p[0]);
  for (const Value& o : options) {
    const std::string& x = str_arg(in, o, std::string(what) + " argument");
    if (at_end ? text.ends_with(x) : text.starts_with(x)) return true;
  }
  return false;
}

Value find_common(Interp& in, const Value& self, CallArgs& a, const char* what, bool from_right, bool raise) {
  auto p = bind_args(in, what, a, {"sub", "start", "end"}, 1);
  const std::string& s = self.as_string();
  const std::string& sub = str_arg(in, p[0], std::string(what) + " argument");
  Window w = window(in, s, p[1], p[2]);
  int64_t result = -1;
  if (!w.empty_range) {
    std::string_view text = w.text(s);
    size_t hit = from_right ? text.rfind(sub) : text.find(sub);
    if (hit != std::string_view::npos) result = w.cp_index(w.offs[static_cast<size_t>(w.start)] + hit);
  }
  if (result < 0 && raise) in.fail("substring not found");
  return Value::integer(result);
}

Value strip_method(Interp& in, const Value& self, CallArgs& a, const char* what, bool left, bool right) {
  auto p = bind_args(in, what, a, {"chars"});
  if (given_not_none(p[0]))
    return Value::string(py_strip(self.as_string(), &str_arg(in, p[0], std::string(what) + " chars"), left, right));
  return Value::string(py_strip(self.as_string(), nullptr, left, right));
}

Value split_method(Interp& in, const Value& self, CallArgs& a, const char* what, bool right) {
  auto p = bind_args(in, what, a, {"sep", "maxsplit"});
  int64_t maxsplit = given_not_none(p[1]) ? int_arg(in, p[1], "maxsplit") : -1;
  const std::string* sep = given_not_none(p[0]) ? &str_arg(in, p[0], "separator") : nullptr;
  return str_list(in, right ? py_rsplit(self.as_string(), sep, maxsplit) : py_split(self.as_string(), sep, maxsplit));
}

// str.format with auto / numbered / named fields and !r / !s; format specs
// limited to fill, alignment and width.
Value str_format(Interp& in, const Value& self, CallArgs& a) {
  const std::string& fmt = self.as_string();
  std::string out;
  size_t auto_idx = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    char c = fmt[i];
    if (c == '}') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '}') ++i;
      else in.fail("Single '}' encountered in format string");
      out += '}';
      continue;
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    size_t close = fmt.find('}', i);
    if (close == std::string::npos) in.fail("Single '{' encountered in format string");
    std::string field = fmt.substr(i + 1, close - i - 1);
    i = close;
    std::string spec, conv;
    size_t colon = field.find(':');
    if (colon != std::string::npos) {
      spec = field.substr(colon + 1);
      field.resize(colon);
    }
    size_t bang = field.find('!');
    if (bang != std::string::npos) {
      conv = field.substr(bang + 1);
      field.resize(bang);
    }
    Value v;
    if (field.empty()) {
      if (auto_idx >= a.pos.size()) in.fail("Replacement index out of range for positional args tuple");
      v = a.pos[auto_idx++];
    } else if (std::all_of(field.begin(), field.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
      size_t idx = std::stoul(field);
      if (idx >= a.pos.size()) in.fail("Replacement index out of range for positional args tuple");
      v = a.pos[idx];
    } else {
      bool found = false;
      for (auto& [k, x] : a.kw)
        if (k == field) {
          v = x;
          found = true;
        }
      if (!found) in.fail("format: no argument named '" + field + "'");
    }
    std::string text = conv == "r" ? repr(v) : to_str(v);
    if (!conv.empty() && conv != "r" && conv != "s") in.fail("Unknown conversion specifier " + conv);
    if (!spec.empty()) {
      std::string fill = " ";
      char align = v.is_number() ? '>' : '<';
      size_t k = 0;
      if (spec.size() >= 2 && strchr("<>^", spec[1])) {
        fill = spec.substr(0, 1);
        align = spec[1];
        k = 2;
      } else if (strchr("<>^", spec[0])) {
        align = spec[0];
        k = 1;
      }
      std::string width = spec.substr(k);
      if (width.empty() || !std::all_of(width.begin(), width.end(), [](char ch) { return ch >= '0' && ch <= '9'; }) ||
          width.size() > 6)
        in.fail("format spec '" + spec + "' is not supported");
      text = pad_to(text, std::stoll(width), align, fill);
    }
    out += text;
    in.check_size(out.size(), "string");
  }
  return Value::string(std::move(out));
}

const std::unordered_map<std::string, MethodFn>& str_methods() {
  static const std::unordered_map<std::string, MethodFn> table = {
      {"startswith", [](Interp& in, const Value& s, CallArgs& a) { return Value::boolean(prefix_match(in, s, a, "startswith", false)); }},
      {"endswith", [](Interp& in, const Value& s, CallArgs& a) { return Value::boolean(prefix_match(in, s, a, "endswith", true)); }},
      {"strip", [](Interp& in, const Value& s, CallArgs& a) { return strip_method(in, s, a, "strip", true, true); }},
      {"lstrip", [](Interp& in, const Value& s, CallArgs& a) { return strip_method(in, s, a, "lstrip", true, false); }},
      {"rstrip", [](Interp& in, const Value& s, CallArgs& a) { return strip_method(in, s, a, "rstrip", false, true); }},
      {"split", [](Interp& in, const Value& s, CallArgs& a) { return split_method(in, s, a, "split", false); }},
      {"rsplit", [](Interp& in, const Value& s, CallArgs& a) { return split_method(in, s, a, "rsplit", true); }},
      {"splitlines",
       [](Interp& in, const Value& s, CallArgs& a) {
         auto p = bind_args(in, "splitlines", a, {"keepends"});
         return str_list(in, py_splitlines(s.as_string(), given(p[0]) && p[0].truthy()));
       }},
      {"replace",
       [](Interp& in, const Value& s, CallArgs& a) {
         auto p = bind_args(in, "replace", a, {"old", "new", "count"}, 2);
         int64_t count = given_not_none(p[2]) ? int_arg(in, p[2], "replace count") : -1;
         return Value::string(py_replace(in, s.as_string(), str_arg(in, p[0], "replace old"),
                                         str_arg(in, p[1], "replace new"), count));
       }},
      {"upper", [](Interp& in, const Value& s, CallArgs& a) { bind_args(in, "upper", a, {}); return Value::string(py_upper(s.as_string())); }},
      {"lower", [](Interp& in, const Value& s, CallArgs& a) { bind_args(in, "lower", a, {}); return Value::string(py_lower(s.as_string())); }},
      {"casefold", [](Interp& in, const Value& s, CallArgs& a) { bind_args(in, "casefold", a, {}); return Value::string(py_lower(s.as_string())); }},
      {"title", [](Interp& in, const Value& s, CallArgs& a) { bind_args(in, "title", a, {}); return Value::string(py_title(s.as_string())); }},
      {"capitalize", [](Interp& in, const Value& s, CallArgs& a) { bind_args(in, "capitalize", a, {}); return Value::string(py_capitalize(s.as_string())); }},
      {"swapcase",
       [](Interp& in, const Value& s, CallArgs& a) {
         bind_args(in, "swapcase", a, {});
         std::string out;
         const std::string& x = s.as_string();
         for (size_t i = 0; i < x.size();) {
           size_t len;
           decode_cp(x, i, &len);
           std::string one = x.substr(i, len);
           std::string u = py_upper(one);
           out += u != one ? u : py_lower(one);
           i += len;
         }
         return Value::string(std::move(out));
       }},
      {"find", [](Interp& in, const Value& s, CallArgs& a) { return find_common(in, s, a, "find", false, false); }},
      {"rfind", [](Interp& in, const Value& s, CallArgs& a) { return find_common(in, s, a, "rfind", true, false); }},
      {"index", [](Interp& in, const Value& s, CallArgs& a) { return find_common(in, s, a, "index", false, true); }},
      {"rindex", [](Interp& in, const Value& s, CallArgs& a) { return find_common(in, s, a, "rindex", true, true); }},
      {"count",
       [](Interp& in, const Value& s, CallArgs& a) {
         auto p = bind_args(in, "count", a, {"sub", "start", "end"}, 1);
         const std::string& x = s.as_string();
         const std::string& sub = str_arg(in, p[0], "count argument");
         Window w = window(in, x, p[1], p[2]);
         if (w.empty_range) return Value::integer(0);
         std::string_view text = w.text(x);
         if (sub.empty()) return Value::integer(static_cast<int64_t>(cp_count(text)) + 1);
         int64_t n = 0;
         for (size_t pos = text.find(sub); pos != std::string_view::npos; pos = text.find(sub, pos + sub.size())) ++n;
         return Value::integer(n);
       }},
      {"join",
       [](Interp& in, const Value& s, CallArgs& a) {
         auto p = bind_args(in, "join", a, {"iterable"}, 1);
         std::string out;
         size_t i = 0;
         for (const Value& item : in.iterate(p[0])) {
           if (!item.is_string())
             in.fail(str_cat("sequence item ", i, ": expected str instance, ", item.type_name(), " found"));
           if (i++) out += s.as_string();
           out += item.as_string();
           in.check_size(out.size(), "string");
         }
         return Value::string(std::move(out));
       }},
      {"isdigit", [](Interp& in, const Value& s, CallArgs& a) {
         bind_args(in, "isdigit", a, {});
         return Value::boolean(all_cps(s.as_string(), is_numeric)); }},
      {"isdecimal", [](Interp& in, const Value& s, CallArgs& a) {
         bind_args(in, "isdecimal", a, {});
         return Value::boolean(all_cps(s.as_string(), is_decimal)); }},
      {"isnumeric", [](Interp& in, const Value& s, CallArgs& a) {
         bind_args(in, "isnumeric", a, {});
         return Value::boolean(all_cps(s.as_string(), is_numeric)); }},
      {"isalpha", [](Interp& in, const Value& s, CallArgs& a) {
         bind_args(in, "isalpha", a, {});
         return Value::boolean(all_cps(s.as_string(), is_letter)); }},
      {"isalnum",
       [](Interp& in, const Value& s, CallArgs& a) {
         bind_args(in, "isalnum", a, {});
         return Value::boolean(all_cps(s.as_string(), [](uint32_t cp) { return is_letter(cp) || is_numeric(cp); }));
       }},
      {"isspace", [](Interp& in, const Value& s, CallArgs& a) {
         bind_args(in, "isspace", a, {});
         return Value::boolean(all_cps(s.as_string(), py_isspace)); }},
      {"isupper", [](Interp& in, const Value& s, CallArgs& a) {
         bind_args(in, "isupper", a, {});
         return Value::boolean(case_test(s.as_string(), true)); }},
      {"islower", [](Interp& in, const Value& s, CallArgs& a) {
         bind_args(in, "islower", a, {});
         return Value::boolean(case_test(s.as_string(), false)); }},
      {"removeprefix",
       [](Interp& in, const Value& s, CallArgs& a) {
         auto p = bind_args(in, "removeprefix", a, {"prefix"}, 1);
         const std::string& x = s.as_string();
         const std::string& pre = str_arg(in, p[0], "removeprefix argument");
         return Value::string(x.starts_with(pre) ? x.substr(pre.size()) : x);
       }},
      {"removesuffix",
       [](Interp& in, const Value& s, CallArgs& a) {
         auto p = bind_args(in, "removesuffix", a, {"suffix"}, 1);
         const std::string& x = s.as_string();
         const std::string& suf = str_arg(in, p[0], "removesuffix argument");
         return Value::string(!suf.empty() && x.ends_with(suf) ? x.substr(0, x.size() - suf.size()) : x);
       }},
      {"ljust",
       [](Interp& in, const Value& s, CallArgs& a) {
         auto p = bind_args(in, "ljust", a, {"width", "fillchar"}, 1);
         int64_t w = int_arg(in, p[0], "ljust width");
         in.check_size(static_cast<size_t>(std::max<int64_t>(0, w)) * 4, "string");
         return Value::string(pad_to(s.as_string(), w, '<', fill_char(in, p[1])));
       }},
      {"rjust",
       [](Interp& in, const Value& s, CallArgs& a) {
         auto p = bind_args(in, "rjust", a, {"width", "fillchar"}, 1);
         int64_t w = int_arg(in, p[0], "rjust width");
         in.check_size(static_cast<size_t>(std::max<int64_t>(0, w)) * 4, "string");
         return Value::string(pad_to(s.as_string(), w, '>', fill_char(in, p[1])));
       }},
      {"center",
       [](Interp& in, const Value& s, CallArgs& a) {
         auto p = bind_args(in, "center", a, {"width", "fillchar"}, 1);
         int64_t w = int_arg(in, p[0], "center width");
         in.check_size(static_cast<size_t>(std::max<int64_t>(0, w)) * 4, "string");
         return Value::string(pad_to(s.as_string(), w, '^', fill_char(in, p[1])));
       }},
      {"zfill",
       [](Interp& in, const Value& s, CallArgs& a) {
         auto p = bind_args(in, "zfill", a, {"width"}, 1);
         int64_t w = int_arg(in, p[0], "zfill width");
         in.check_size(static_cast<size_t>(std::max<int64_t>(0, w)), "string");
         std::string x = s.as_string();
         auto len = static_cast<int64_t>(cp_count(x));
         if (w <= len) return Value::string(x);
         std::string zeros(static_cast<size_t>(w - len), '0');
         if (!x.empty() && (x[0] == '+' || x[0] == '-')) return Value::string(x.substr(0, 1) + zeros + x.substr(1));
         return Value::string(zeros + x);
       }},
      {"partition",
       [](Interp& in, const Value& s, CallArgs& a) {
         auto p = bind_args(in, "partition", a, {"sep"}, 1);
         const std::string& x = s.as_string();
         const std::string& sep = str_arg(in, p[0], "partition separator");
         if (sep.empty()) in.fail("empty separator");
         size_t hit = x.find(sep);
         if (hit == std::string::npos) return Value::list({Value::string(x), Value::string(""), Value::string("")}, true);
         return Value::list({Value::string(x.substr(0, hit)), Value::string(sep), Value::string(x.substr(hit + sep.size()))}, true);
       }},
      {"rpartition",
       [](Interp& in, const Value& s, CallArgs& a) {
         auto p = bind_args(in, "rpartition", a, {"sep"}, 1);
         const std::string& x = s.as_string();
         const std::string& sep = str_arg(in, p[0], "rpartition separator");
         if (sep.empty()) in.fail("empty separator");
         size_t hit = x.rfind(sep);
         if (hit == std::string::npos) return Value::list({Value::string(""), Value::string(""), Value::string(x)}, true);
         return Value::list({Value::string(x.substr(0, hit)), Value::string(sep), Value::string(x.substr(hit + sep.size()))}, true);
       }},
      {"format", str_format},
  };
  return table;
}

const std::unordered_map<std::string, MethodFn>& dict_methods() {
  static const std::unordered_map<std::string, MethodFn> table = {
      {"items",
       [](Interp& in, const Value& d, CallArgs& a) {
         bind_args(in, "items", a, {});
         std::vector<Value> out;
         for (const auto& [k, v] : d.as_dict().entries) out.push_back(Value::list({k, v}, true));
         return Value::list(std::move(out));
       }},
      {"keys",
       [](Interp& in, const Value& d, CallArgs& a) {
         bind_args(in, "keys", a, {});
         std::vector<Value> out;
         for (const auto& [k, v] : d.as_dict().entries) out.push_back(k);
         return Value::list(std::move(out));
       }},
      {"values",
       [](Interp& in, const Value& d, CallArgs& a) {
         bind_args(in, "values", a, {});
         std::vector<Value> out;
         for (const auto& [k, v] : d.as_dict().entries) out.push_back(v);
         return Value::list(std::move(out));
       }},
      {"get",
       [](Interp& in, const Value& d, CallArgs& a) {
         auto p = bind_args(in, "get", a, {"key", "default"}, 1);
         if (const Value* v = d.as_dict().find(p[0])) return *v;
         return given(p[1]) ? p[1] : Value::none();
       }},
      {"copy",
       [](Interp& in, const Value& d, CallArgs& a) {
         bind_args(in, "copy", a, {});
         return d;
       }},
  };
  return table;
}

const std::unordered_map<std::string, MethodFn>& list_methods() {
  static const std::unordered_map<std::string, MethodFn> table = {
      {"index",
       [](Interp& in, const Value& l, CallArgs& a) {
         auto p = bind_args(in, "index", a, {"value"}, 1);
         const auto& items = l.as_list().items;
         for (size_t i = 0; i < items.size(); ++i)
           if (equals(items[i], p[0])) return Value::integer(static_cast<int64_t>(i));
         in.fail(repr(p[0]) + " is not in list");
       }},
      {"count",
       [](Interp& in, const Value& l, CallArgs& a) {
         auto p = bind_args(in, "count", a, {"value"}, 1);
         int64_t n = 0;
         for (const Value& x : l.as_list().items)
           if (equals(x, p[0])) ++n;
         return Value::integer(n);
       }},
      {"copy",
       [](Interp& in, const Value& l, CallArgs& a) {
         bind_args(in, "copy", a, {});
         return l;
       }},
  };
  return table;
}

bool is_unsafe_method(const Value& obj, const std::string& name) {
  static const std::unordered_set<std::string> dict_unsafe = {"clear", "pop", "popitem", "setdefault", "update"};
  static const std::unordered_set<std::string> list_unsafe = {"append", "clear", "extend", "insert", "pop",
                                                              "remove", "reverse", "sort"};
  if (obj.is_dict()) return dict_unsafe.count(name) != 0;
  if (obj.is_list() && !obj.as_list().tuple) return list_unsafe.count(name) != 0;
  return false;
}

// ------------------------------------------------------------------ globals

Value g_range(Interp& in, CallArgs& a) {
  if (!a.kw.empty()) in.fail("range() takes no keyword arguments");
  if (a.pos.empty() || a.pos.size() > 3) in.fail(str_cat("range expected 1 to 3 arguments, got ", a.pos.size()));
  int64_t start = 0, stop, step = 1;
  if (a.pos.size() == 1) {
    stop = int_arg(in, a.pos[0], "range stop");
  } else {
    start = int_arg(in, a.pos[0], "range start");
    stop = int_arg(in, a.pos[1], "range stop");
    if (a.pos.size() == 3) step = int_arg(in, a.pos[2], "range step");
  }
  if (step == 0) in.fail("range() arg 3 must not be zero");
  constexpr int64_t kMaxRange = 100000;  // as Jinja's sandbox
  std::vector<Value> out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
    if (static_cast<int64_t>(out.size()) >= kMaxRange)
      in.fail(str_cat("range too big: more than ", kMaxRange, " items"));
    out.push_back(Value::integer(i));
    if (__builtin_add_overflow(i, step, &i)) break;
  }
  return Value::list(std::move(out));
}

}  // namespace

// ------------------------------------------------------------------ entry points

std::vector<Value> bind_args(Interp& in, const std::string& what, const CallArgs& args,
                             std::initializer_list<const char*> names, size_t required) {
  std::vector<Value> out(names.size());
  std::vector<bool> set(names.size(), false);
  if (args.pos.size() > names.size())
    in.fail(str_cat(what, "() takes at most ", names.size(), " argument", names.size() == 1 ? "" : "s", " (",
                    args.pos.size(), " given)"));
  for (size_t i = 0; i < args.pos.size(); ++i) {
    out[i] = args.pos[i];
    set[i] = true;
  }
  for (const auto& [k, v] : args.kw) {
    size_t idx = 0;
    for (const char* n : names) {
      if (k == n) break;
      ++idx;
    }
    if (idx == names.size()) in.fail(what + "() got an unexpected keyword argument '" + k + "'");
    if (set[idx]) in.fail(what + "() got multiple values for argument '" + k + "'");
    out[idx] = v;
    set[idx] = true;
  }
  for (size_t i = 0; i < required; ++i)
    if (!set[i]) in.fail(what + "() missing required argument '" + std::string(names.begin()[i]) + "'");
  return out;
}

Value call_filter(Interp& in, const std::string& name, Value operand, CallArgs& args) {
  auto it = filters().find(name);
  if (it == filters().end()) in.fail("no filter named '" + name + "'");
  return it->second(in, operand, args);
}

bool filter_exists(const std::string& name) { return filters().count(name) != 0; }

bool call_test(Interp& in, const std::string& name, const Value& operand, CallArgs& args) {
  auto it = tests().find(name);
  if (it == tests().end()) in.fail("no test named '" + name + "'");
  if (!args.kw.empty()) in.fail("test '" + name + "' takes no keyword arguments");
  static const std::unordered_set<std::string> with_argument = {
      "sameas", "divisibleby", "eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<", "le", "<=",
      "gt", "greaterthan", ">", "ge", ">=", "in"};
  if (!args.pos.empty() && with_argument.count(name) == 0) in.fail("test '" + name + "' takes no arguments");
  return it->second(in, operand, args.pos);
}

bool test_exists(const std::string& name) { return tests().count(name) != 0; }

Value get_method(Interp& /*in*/, const Value& obj, const std::string& name) {
  const std::unordered_map<std::string, MethodFn>* table = nullptr;
  if (obj.is_string()) table = &str_methods();
  else if (obj.is_dict()) table = &dict_methods();
  else if (obj.is_list()) table = &list_methods();
  if (!table) return Value();
  auto it = table->find(name);
  if (it != table->end()) return bind_method(obj, name, it->second);
  if (is_unsafe_method(obj, name))
    return Value::undefined("access to attribute '" + name + "' of '" + obj.type_name() + "' object is unsafe");
  return Value();
}

void add_global_functions(Interp& in, Scope& globals) {
  (void)in;
  globals.set("range", make_function("range", g_range));
  globals.set("namespace", make_function("namespace", [](Interp& in, CallArgs& a) {
    if (a.pos.size() > 1) in.fail("namespace() takes at most one positional argument");
    auto ns = in.new_namespace();
    if (!a.pos.empty()) {
      if (!a.pos[0].is_dict()) in.fail("namespace() positional argument must be a mapping");
      for (const auto& [k, v] : a.pos[0].as_dict().entries) ns->set_attr(to_str(k), v);
    }
    for (auto& [k, v] : a.kw) ns->set_attr(k, v);
    return Value::object(ns);
  }));
  globals.set("dict", make_function("dict", [](Interp& in, CallArgs& a) {
    if (a.pos.size() > 1) in.fail("dict() takes at most one positional argument");
    auto d = std::make_shared<DictData>();
    if (!a.pos.empty()) {
      if (a.pos[0].is_undefined()) in.fail(a.pos[0].undefined_hint());
      if (a.pos[0].is_dict()) {
        for (const auto& [k, v] : a.pos[0].as_dict().entries) d->set(k, v);
      } else {
        for (const Value& pair : in.iterate(a.pos[0])) {
          if (!pair.is_list() || pair.as_list().items.size() != 2)
            in.fail("dictionary update sequence element has the wrong length; 2 is required");
          d->set(pair.as_list().items[0], pair.as_list().items[1]);
        }
      }
    }
    for (auto& [k, v] : a.kw) d->set(Value::string(k), v);
    return Value::dict(std::move(d));
  }));
  globals.set("raise_exception", make_function("raise_exception", [](Interp& in, CallArgs& a) -> Value {
    auto p = bind_args(in, "raise_exception", a, {"message"});
    throw RaisedByTemplate(to_str(p[0]));
  }));
  globals.set("strftime_now", make_function("strftime_now", [](Interp& in, CallArgs& a) {
    auto p = bind_args(in, "strftime_now", a, {"format"}, 1);
    const std::string& fmt = str_arg(in, p[0], "strftime_now format");
    if (fmt.size() > 256) in.fail("strftime_now format longer than 256 characters");
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    std::string buf(1024, '\0');
    size_t n = std::strftime(buf.data(), buf.size(), fmt.c_str(), &tm);
    if (n == 0 && !fmt.empty()) in.fail("strftime_now: formatted date too long or invalid format");
    buf.resize(n);
    return Value::string(std::move(buf));
  }));
  globals.set("joiner", make_function("joiner", [](Interp& in, CallArgs& a) {
    auto p = bind_args(in, "joiner", a, {"sep"});
    std::string sep = given(p[0]) ? to_str(p[0]) : ", ";
    auto used = std::make_shared<bool>(false);
    return make_function("joiner", [sep, used](Interp&, CallArgs&) {
      if (!*used) {
        *used = true;
        return Value::string("");
      }
      return Value::string(sep);
    });
  }));
}

// ------------------------------------------------------------------ printf-style %

Value py_percent_format(Interp& in, const std::string& fmt, const Value& args) {
  std::vector<Value> list;
  const DictData* mapping = nullptr;
  if (args.is_list() && args.as_list().tuple) {
    list = args.as_list().items;
  } else {
    if (args.is_dict()) mapping = &args.as_dict();
    list.push_back(args);
  }
  size_t ai = 0;
  bool used_mapping = false;
  std::string out;
  auto next_arg = [&]() -> Value {
    if (ai >= list.size()) in.fail("not enough arguments for format string");
    return list[ai++];
  };
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    if (++i >= fmt.size()) in.fail("incomplete format");
    if (fmt[i] == '%') {
      out += '%';
      continue;
    }
    Value v;
    bool have = false;
    if (fmt[i] == '(') {
      size_t close = fmt.find(')', i);
      if (close == std::string::npos) in.fail("incomplete format key");
      if (!mapping) in.fail("format requires a mapping");
      const Value* x = mapping->find(Value::string(fmt.substr(i + 1, close - i - 1)));
      if (!x) in.fail("format key " + py_str_repr(fmt.substr(i + 1, close - i - 1)) + " not found");
      v = *x;
      have = used_mapping = true;
      i = close + 1;
    }
    std::string flags;
    while (i < fmt.size() && strchr("-+ 0#", fmt[i]) && fmt[i]) flags += fmt[i++];
    int64_t width = -1, prec = -1;
    auto read_num = [&](int64_t* dst) {
      if (i < fmt.size() && fmt[i] == '*') {
        *dst = int_arg(in, next_arg(), "* width");
        if (*dst > 100000) in.fail("format width too large");
        ++i;
        return;
      }
      int64_t n = 0;
      bool any = false;
      while (i < fmt.size() && isdigit(static_cast<unsigned char>(fmt[i]))) {
        n = n * 10 + (fmt[i++] - '0');
        if (n > 100000) in.fail("format width too large");
        any = true;
      }
      if (any) *dst = n;
    };
    read_num(&width);
    if (i < fmt.size() && fmt[i] == '.') {
      ++i;
      prec = 0;
      read_num(&prec);
    }
    while (i < fmt.size() && strchr("hlL", fmt[i]) && fmt[i]) ++i;
    if (i >= fmt.size()) in.fail("incomplete format");
    char conv = fmt[i];
    if (!have) v = next_arg();
    bool left = flags.find('-') != std::string::npos;
    bool zero = flags.find('0') != std::string::npos && !left;
    std::string body;
    switch (conv) {
      case 's':
      case 'r':
      case 'a': {
        body = conv == 's' ? to_str(v) : repr(v);
        if (prec >= 0) {
          std::vector<size_t> offs = cp_offsets(body);
          if (static_cast<size_t>(prec) + 1 < offs.size()) body.resize(offs[static_cast<size_t>(prec)]);
        }
        zero = false;
        break;
      }
      case 'd':
      case 'i':
      case 'u':
      case 'x':
      case 'X':
      case 'o':
      case 'e':
      case 'E':
      case 'f':
      case 'F':
      case 'g':
      case 'G': {
        if (!v.is_number()) in.fail(std::string("%") + conv + " format: a real number is required, not " + v.type_name());
        std::string spec = "%";
        for (char f : flags)
          if (f != '-' && f != '0') spec += f;
        char buf[512];
        bool integral = strchr("diuxXo", conv) != nullptr;
        if (integral) {
          if (v.is_float() && !(std::fabs(v.as_double()) < 9.2e18))
            in.fail(std::string("%") + conv + " format: number out of range");
          int64_t n = v.is_float() ? static_cast<int64_t>(std::trunc(v.as_double())) : v.as_int();
          char c = conv == 'i' || conv == 'u' ? 'd' : conv;
          bool neg = n < 0 && c != 'd';
          uint64_t mag = n < 0 ? static_cast<uint64_t>(-(n + 1)) + 1 : static_cast<uint64_t>(n);
          if (prec >= 0) spec += "." + std::to_string(std::min<int64_t>(prec, 400));
          spec += std::string("ll") + c;
          if (c == 'd')
            std::snprintf(buf, sizeof buf, spec.c_str(), static_cast<long long>(n));
          else
            std::snprintf(buf, sizeof buf, spec.c_str(), static_cast<unsigned long long>(mag));
          body = neg ? std::string("-") + buf : buf;
        } else {
          spec += "." + std::to_string(prec >= 0 ? std::min<int64_t>(prec, 400) : 6) + conv;
          int len = std::snprintf(nullptr, 0, spec.c_str(), v.as_double());
          body.assign(static_cast<size_t>(std::max(len, 0)) + 1, '\0');
          std::snprintf(body.data(), body.size(), spec.c_str(), v.as_double());
          body.resize(static_cast<size_t>(std::max(len, 0)));
        }
        break;
      }
      case 'c':
        if (v.is_string() && cp_count(v.as_string()) == 1) {
          body = v.as_string();
        } else if (v.is_int() && v.as_int() >= 0 && v.as_int() <= 0x10FFFF) {
          append_utf8(body, static_cast<uint32_t>(v.as_int()));
        } else {
          in.fail("%c requires an int or a unicode character");
        }
        zero = false;
        break;
      default: in.fail(std::string("unsupported format character '") + conv + "'");
    }
    auto len = static_cast<int64_t>(cp_count(body));
    if (width > len) {
      auto pad = static_cast<size_t>(width - len);
      if (left) {
        body += std::string(pad, ' ');
      } else if (zero) {
        size_t sign = (!body.empty() && (body[0] == '-' || body[0] == '+' || body[0] == ' ')) ? 1 : 0;
        body.insert(sign, std::string(pad, '0'));
      } else {
        body.insert(0, std::string(pad, ' '));
      }
    }
    out += body;
    in.check_size(out.size(), "string");
  }
  if (!used_mapping && !mapping && ai < list.size()) in.fail("not all arguments converted during string formatting");
  return Value::string(std::move(out));
}

}  // namespace lily::text::jinja
