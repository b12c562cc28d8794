// Jinja values: construction, Python str()/repr(), json.dumps, comparison and
// the UTF-8 string helpers that give Python's str semantics.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>

#include <utf8proc.h>

#include "text/jinja_internal.h"

namespace lily::text::jinja {

// ---------------------------------------------------------------- Value

Value Value::undefined(std::string hint) {
  Value v;
  if (!hint.empty()) v.ptr_ = std::make_shared<std::string>(std::move(hint));
  return v;
}

Value Value::none() {
  Value v;
  v.kind_ = Kind::None;
  return v;
}

Value Value::boolean(bool b) {
  Value v;
  v.kind_ = Kind::Bool;
  v.b_ = b;
  return v;
}

Value Value::integer(int64_t i) {
  Value v;
  v.kind_ = Kind::Int;
  v.i_ = i;
  return v;
}

Value Value::number(double d) {
  Value v;
  v.kind_ = Kind::Float;
  v.f_ = d;
  return v;
}

Value Value::string(std::string s) {
  Value v;
  v.kind_ = Kind::String;
  v.ptr_ = std::make_shared<std::string>(std::move(s));
  return v;
}

Value Value::list(std::vector<Value> items, bool tuple) {
  int depth = 0;
  for (const Value& item : items) depth = std::max(depth, item.depth());
  if (depth + 1 > kMaxValueDepth)
    eval_fail(str_cat("value nested more than ", kMaxValueDepth, " levels deep"));
  auto data = std::make_shared<ListData>();
  data->items = std::move(items);
  data->tuple = tuple;
  data->depth = depth + 1;
  Value v;
  v.kind_ = Kind::List;
  v.ptr_ = std::move(data);
  return v;
}

Value Value::dict(std::shared_ptr<DictData> d) {
  int depth = 0;
  for (const auto& [k, val] : d->entries) depth = std::max({depth, k.depth(), val.depth()});
  if (depth + 1 > kMaxValueDepth)
    eval_fail(str_cat("value nested more than ", kMaxValueDepth, " levels deep"));
  d->depth = depth + 1;
  Value v;
  v.kind_ = Kind::Dict;
  v.ptr_ = std::move(d);
  return v;
}

Value Value::object(std::shared_ptr<Object> o) {
  Value v;
  v.kind_ = Kind::Object;
  v.ptr_ = std::move(o);
  return v;
}

Value Value::function(std::shared_ptr<const Function> f) {
  Value v;
  v.kind_ = Kind::Function;
  v.ptr_ = std::const_pointer_cast<Function>(std::move(f));
  return v;
}

double Value::as_double() const {
  switch (kind_) {
    case Kind::Bool: return b_ ? 1.0 : 0.0;
    case Kind::Int: return static_cast<double>(i_);
    case Kind::Float: return f_;
    default: return 0.0;
  }
}

std::string Value::undefined_hint() const {
  if (kind_ == Kind::Undefined && ptr_) return *static_cast<const std::string*>(ptr_.get());
  return "value is undefined";
}

int Value::depth() const {
  if (kind_ == Kind::List) return as_list().depth;
  if (kind_ == Kind::Dict) return as_dict().depth;
  return 0;
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::Undefined:
    case Kind::None: return false;
    case Kind::Bool: return b_;
    case Kind::Int: return i_ != 0;
    case Kind::Float: return f_ != 0.0;
    case Kind::String: return !as_string().empty();
    case Kind::List: return !as_list().items.empty();
    case Kind::Dict: return as_dict().size() != 0;
    case Kind::Object:
    case Kind::Function: return true;
  }
  return false;
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::Undefined: return "Undefined";
    case Kind::None: return "NoneType";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::List: return as_list().tuple ? "tuple" : "list";
    case Kind::Dict: return "dict";
    case Kind::Object: return as_object().type_name();
    case Kind::Function: return "function";
  }
  return "?";
}

// ---------------------------------------------------------------- DictData

std::string hash_key(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::String: return "s" + v.as_string();
    case Value::Kind::Bool:
    case Value::Kind::Int: return "i" + std::to_string(v.as_int());
    case Value::Kind::Float: {
      double d = v.as_double();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.2e18)
        return "i" + std::to_string(static_cast<int64_t>(d));
      return "f" + py_float_repr(d);
    }
    case Value::Kind::None: return "n";
    case Value::Kind::Undefined: return "u";
    case Value::Kind::List: {
      if (!v.as_list().tuple) eval_fail("unhashable type: 'list'");
      std::string key = "t";
      for (const Value& item : v.as_list().items) {
        std::string k = hash_key(item);
        key += std::to_string(k.size()) + ":" + k;
      }
      return key;
    }
    case Value::Kind::Dict: eval_fail("unhashable type: 'dict'");
    case Value::Kind::Object:
    case Value::Kind::Function: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "o%p", v.identity());
      return buf;
    }
  }
  return "?";
}

const Value* DictData::find(const Value& key) const {
  if (key.is_list() && !key.as_list().tuple) return nullptr;
  if (key.is_dict()) return nullptr;
  auto it = index.find(hash_key(key));
  return it == index.end() ? nullptr : &entries[it->second].second;
}

void DictData::set(const Value& key, Value value) {
  std::string k = hash_key(key);
  auto it = index.find(k);
  if (it != index.end()) {
    entries[it->second].second = std::move(value);
    return;
  }
  index.emplace(std::move(k), entries.size());
  entries.emplace_back(key, std::move(value));
}

// ---------------------------------------------------------------- Namespace, Scope

Value Namespace::get_attr(const std::string& name) const {
  for (const auto& [k, v] : attrs_)
    if (k == name) return v;
  return Value::undefined("'Namespace' object has no attribute '" + name + "'");
}

void Namespace::set_attr(const std::string& name, Value v) {
  for (auto& [k, old] : attrs_)
    if (k == name) {
      old = std::move(v);
      return;
    }
  attrs_.emplace_back(name, std::move(v));
}

std::string Namespace::repr() const {
  std::string out = "<Namespace {";
  bool first = true;
  for (const auto& [k, v] : attrs_) {
    if (!first) out += ", ";
    first = false;
    out += py_str_repr(k) + ": ";
    // A namespace may hold itself: show only scalars and containers, never recurse into objects.
    out += v.is_object() ? "<" + v.type_name() + ">" : jinja::repr(v);
  }
  return out + "}>";
}

const Value* Scope::lookup(const std::string& name) const {
  for (const Scope* s = this; s; s = s->parent_.get())
    for (const auto& [k, v] : s->vars_)
      if (k == name) return &v;
  return nullptr;
}

void Scope::set(const std::string& name, Value v) {
  for (auto& [k, old] : vars_)
    if (k == name) {
      old = std::move(v);
      return;
    }
  vars_.emplace_back(name, std::move(v));
}

// ---------------------------------------------------------------- JSON in

Value from_json(const nlohmann::ordered_json& j, int depth) {
  if (depth >= kMaxValueDepth) eval_fail(str_cat("input nested more than ", kMaxValueDepth, " levels deep"));
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return Value::integer(static_cast<int64_t>(u));
      return Value::number(static_cast<double>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& item : j) items.push_back(from_json(item, depth + 1));
      return Value::list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      auto d = std::make_shared<DictData>();
      d->entries.reserve(j.size());
      for (const auto& [k, v] : j.items()) d->set(Value::string(k), from_json(v, depth + 1));
      return Value::dict(std::move(d));
    }
    default: eval_fail("unsupported JSON value (binary)");
  }
}

// ---------------------------------------------------------------- UTF-8 helpers

uint32_t decode_cp(std::string_view s, size_t i, size_t* len) {
  auto b = static_cast<unsigned char>(s[i]);
  auto cont = [&](size_t k) {
    return i + k < s.size() && (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80;
  };
  auto at = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i + k]) & 0x3F); };
  if (b < 0x80) {
    *len = 1;
    return b;
  }
  if (b >= 0xC2 && b <= 0xDF && cont(1)) {
    *len = 2;
    return ((b & 0x1Fu) << 6) | at(1);
  }
  if (b >= 0xE0 && b <= 0xEF && cont(1) && cont(2)) {
    uint32_t cp = ((b & 0x0Fu) << 12) | (at(1) << 6) | at(2);
    if (cp >= 0x800 && (cp < 0xD800 || cp > 0xDFFF)) {
      *len = 3;
      return cp;
    }
  }
  if (b >= 0xF0 && b <= 0xF4 && cont(1) && cont(2) && cont(3)) {
    uint32_t cp = ((b & 0x07u) << 18) | (at(1) << 12) | (at(2) << 6) | at(3);
    if (cp >= 0x10000 && cp <= 0x10FFFF) {
      *len = 4;
      return cp;
    }
  }
  *len = 1;  // invalid byte: one unit of its own
  return b;
}

bool is_ascii(std::string_view s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  return true;
}

std::vector<size_t> cp_offsets(std::string_view s) {
  std::vector<size_t> offs;
  offs.reserve(s.size() + 1);
  for (size_t i = 0; i < s.size();) {
    offs.push_back(i);
    size_t len;
    decode_cp(s, i, &len);
    i += len;
  }
  offs.push_back(s.size());
  return offs;
}

size_t cp_count(std::string_view s) {
  if (is_ascii(s)) return s.size();
  size_t n = 0;
  for (size_t i = 0; i < s.size(); ++n) {
    size_t len;
    decode_cp(s, i, &len);
    i += len;
  }
  return n;
}

bool py_isspace(uint32_t cp) {
  switch (cp) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x1C: case 0x1D: case 0x1E:
    case 0x1F: case 0x20: case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029:
    case 0x202F: case 0x205F: case 0x3000:
      return true;
    default: return cp >= 0x2000 && cp <= 0x200A;
  }
}

namespace {

// Code points of `chars` (for strip).
std::vector<uint32_t> cps_of(std::string_view s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    size_t len;
    out.push_back(decode_cp(s, i, &len));
    i += len;
  }
  return out;
}

template <typename F>
std::string map_cps(std::string_view s, F&& f) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t len;
    uint32_t cp = decode_cp(s, i, &len);
    bool valid = len > 1 || cp < 0x80;
    if (valid)
      append_utf8(out, f(cp));
    else
      out.append(s.substr(i, len));
    i += len;
  }
  return out;
}

uint32_t up(uint32_t cp) { return static_cast<uint32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(cp))); }
uint32_t low(uint32_t cp) { return static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))); }
uint32_t titlecase(uint32_t cp) {
  return static_cast<uint32_t>(utf8proc_totitle(static_cast<utf8proc_int32_t>(cp)));
}
bool is_cased(uint32_t cp) {
  auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LL || c == UTF8PROC_CATEGORY_LT;
}

}  // namespace

std::string py_strip(std::string_view s, const std::string* chars, bool left, bool right) {
  std::vector<uint32_t> set;
  if (chars) set = cps_of(*chars);
  auto strip_it = [&](uint32_t cp) {
    return chars ? std::find(set.begin(), set.end(), cp) != set.end() : py_isspace(cp);
  };
  std::vector<size_t> offs = cp_offsets(s);
  size_t n = offs.size() - 1, b = 0, e = n;
  size_t len;
  if (left)
    while (b < e && strip_it(decode_cp(s, offs[b], &len))) ++b;
  if (right)
    while (e > b && strip_it(decode_cp(s, offs[e - 1], &len))) --e;
  return std::string(s.substr(offs[b], offs[e] - offs[b]));
}

std::string py_upper(std::string_view s) { return map_cps(s, up); }
std::string py_lower(std::string_view s) { return map_cps(s, low); }

std::string py_capitalize(std::string_view s) {
  bool first = true;
  return map_cps(s, [&](uint32_t cp) {
    uint32_t r = first ? titlecase(cp) : low(cp);
    first = false;
    return r;
  });
}

std::string py_title(std::string_view s) {
  bool prev_cased = false;
  return map_cps(s, [&](uint32_t cp) {
    uint32_t r = prev_cased ? low(cp) : titlecase(cp);
    prev_cased = is_cased(cp);
    return r;
  });
}

std::vector<std::string> py_split(std::string_view s, const std::string* sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep) {
    if (sep->empty()) eval_fail("empty separator");
    size_t pos = 0;
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
      size_t hit = s.find(*sep, pos);
      if (hit == std::string_view::npos) break;
      out.emplace_back(s.substr(pos, hit - pos));
      pos = hit + sep->size();
    }
    out.emplace_back(s.substr(pos));
    return out;
  }
  std::vector<size_t> offs = cp_offsets(s);
  size_t n = offs.size() - 1, i = 0, len;
  auto space = [&](size_t k) { return py_isspace(decode_cp(s, offs[k], &len)); };
  while (true) {
    while (i < n && space(i)) ++i;
    if (i >= n) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
      out.emplace_back(s.substr(offs[i]));
      break;
    }
    size_t j = i;
    while (j < n && !space(j)) ++j;
    out.emplace_back(s.substr(offs[i], offs[j] - offs[i]));
    i = j;
  }
  return out;
}

std::vector<std::string> py_rsplit(std::string_view s, const std::string* sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep) {
    if (sep->empty()) eval_fail("empty separator");
    size_t end = s.size();
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
      if (end < sep->size()) break;
      size_t hit = s.rfind(*sep, end - sep->size());
      if (hit == std::string_view::npos) break;
      out.emplace_back(s.substr(hit + sep->size(), end - hit - sep->size()));
      end = hit;
    }
    out.emplace_back(s.substr(0, end));
    std::reverse(out.begin(), out.end());
    return out;
  }
  std::vector<size_t> offs = cp_offsets(s);
  size_t len;
  auto space = [&](size_t k) { return py_isspace(decode_cp(s, offs[k], &len)); };
  size_t j = offs.size() - 1;  // exclusive end, in code points
  while (true) {
    while (j > 0 && space(j - 1)) --j;
    if (j == 0) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
      out.emplace_back(s.substr(0, offs[j]));
      break;
    }
    size_t i = j;
    while (i > 0 && !space(i - 1)) --i;
    out.emplace_back(s.substr(offs[i], offs[j] - offs[i]));
    j = i;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> py_splitlines(std::string_view s, bool keepends) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i < s.size();) {
    size_t len;
    uint32_t cp = decode_cp(s, i, &len);
    bool brk = cp == '\n' || cp == '\r' || cp == 0x0B || cp == 0x0C || cp == 0x1C || cp == 0x1D ||
               cp == 0x1E || (len > 1 && (cp == 0x85 || cp == 0x2028 || cp == 0x2029));
    if (!brk) {
      i += len;
      continue;
    }
    size_t end = i + len;
    if (cp == '\r' && end < s.size() && s[end] == '\n') ++end;
    out.emplace_back(s.substr(start, (keepends ? end : i) - start));
    start = i = end;
  }
  if (start < s.size()) out.emplace_back(s.substr(start));
  return out;
}

// ---------------------------------------------------------------- str / repr

std::string py_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // [-]d[.ddd]e(+|-)XX
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  int exp = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  int decpt = exp + 1;  // position of the decimal point relative to digits
  std::string out;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out = "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
    } else if (static_cast<size_t>(decpt) >= digits.size()) {
      out = digits + std::string(static_cast<size_t>(decpt) - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, static_cast<size_t>(decpt)) + "." + digits.substr(static_cast<size_t>(decpt));
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    int x = decpt - 1;
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", x < 0 ? '-' : '+', x < 0 ? -x : x);
    out += eb;
  }
  return sign + out;
}

std::string py_str_repr(std::string_view s) {
  bool has_single = s.find('\'') != std::string_view::npos;
  bool has_double = s.find('"') != std::string_view::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (size_t i = 0; i < s.size();) {
    size_t len;
    uint32_t cp = decode_cp(s, i, &len);
    bool valid = len > 1 || cp < 0x80;
    i += len;
    char buf[16];
    if (!valid) {
      std::snprintf(buf, sizeof buf, "\\x%02x", cp);
      out += buf;
      continue;
    }
    if (cp == static_cast<uint32_t>(quote) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else {
      bool printable = cp == ' ';
      if (!printable) {
        auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
        printable = !(c == UTF8PROC_CATEGORY_CC || c == UTF8PROC_CATEGORY_CF || c == UTF8PROC_CATEGORY_CS ||
                      c == UTF8PROC_CATEGORY_CO || c == UTF8PROC_CATEGORY_CN || c == UTF8PROC_CATEGORY_ZL ||
                      c == UTF8PROC_CATEGORY_ZP || c == UTF8PROC_CATEGORY_ZS);
      }
      if (printable) {
        append_utf8(out, cp);
      } else {
        if (cp < 0x100)
          std::snprintf(buf, sizeof buf, "\\x%02x", cp);
        else if (cp < 0x10000)
          std::snprintf(buf, sizeof buf, "\\u%04x", cp);
        else
          std::snprintf(buf, sizeof buf, "\\U%08x", cp);
        out += buf;
      }
    }
  }
  out += quote;
  return out;
}

std::string repr(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::String: return py_str_repr(v.as_string());
    case Value::Kind::Undefined: return "Undefined";
    case Value::Kind::List: {
      const ListData& l = v.as_list();
      std::string out = l.tuple ? "(" : "[";
      for (size_t i = 0; i < l.items.size(); ++i) {
        if (i) out += ", ";
        out += repr(l.items[i]);
      }
      if (l.tuple && l.items.size() == 1) out += ",";
      return out + (l.tuple ? ")" : "]");
    }
    case Value::Kind::Dict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, val] : v.as_dict().entries) {
        if (!first) out += ", ";
        first = false;
        out += repr(k) + ": " + repr(val);
      }
      return out + "}";
    }
    default: return to_str(v);
  }
}

std::string to_str(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined: return "";
    case Value::Kind::None: return "None";
    case Value::Kind::Bool: return v.as_bool() ? "True" : "False";
    case Value::Kind::Int: return std::to_string(v.as_int());
    case Value::Kind::Float: return py_float_repr(v.as_double());
    case Value::Kind::String: return v.as_string();
    case Value::Kind::List:
    case Value::Kind::Dict: return repr(v);
    case Value::Kind::Object: return v.as_object().repr();
    case Value::Kind::Function: return "<function " + v.as_function().name + ">";
  }
  return "";
}

// ---------------------------------------------------------------- json.dumps

namespace {

void json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  out += '"';
  char buf[16];
  for (size_t i = 0; i < s.size();) {
    auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
      ++i;
      switch (b) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        default:
          if (b < 0x20) {
            std::snprintf(buf, sizeof buf, "\\u%04x", b);
            out += buf;
          } else {
            out += static_cast<char>(b);
          }
      }
      continue;
    }
    size_t len;
    uint32_t cp = decode_cp(s, i, &len);
    if (!ensure_ascii) {
      out.append(s.substr(i, len));
    } else if (cp < 0x10000) {
      std::snprintf(buf, sizeof buf, "\\u%04x", cp);
      out += buf;
    } else {
      uint32_t v = cp - 0x10000;
      std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
      out += buf;
    }
    i += len;
  }
  out += '"';
}

std::string json_float(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d < 0 ? "-Infinity" : "Infinity";
  return py_float_repr(d);
}

void json_value(std::string& out, const Value& v, const JsonStyle& st, int level) {
  auto newline = [&](int lvl) {
    out += '\n';
    for (int i = 0; i < lvl; ++i) out += st.indent;
  };
  switch (v.kind()) {
    case Value::Kind::None: out += "null"; return;
    case Value::Kind::Bool: out += v.as_bool() ? "true" : "false"; return;
    case Value::Kind::Int: out += std::to_string(v.as_int()); return;
    case Value::Kind::Float: out += json_float(v.as_double()); return;
    case Value::Kind::String: json_string(out, v.as_string(), st.ensure_ascii); return;
    case Value::Kind::List: {
      const auto& items = v.as_list().items;
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += st.item_sep;
        if (st.has_indent) newline(level + 1);
        json_value(out, items[i], st, level + 1);
      }
      if (st.has_indent) newline(level);
      out += ']';
      return;
    }
    case Value::Kind::Dict: {
      const auto& entries = v.as_dict().entries;
      if (entries.empty()) {
        out += "{}";
        return;
      }
      std::vector<std::pair<std::string, const Value*>> items;
      items.reserve(entries.size());
      for (const auto& [k, val] : entries) {
        std::string key;
        switch (k.kind()) {
          case Value::Kind::String: key = k.as_string(); break;
          case Value::Kind::Bool: key = k.as_bool() ? "true" : "false"; break;
          case Value::Kind::Int: key = std::to_string(k.as_int()); break;
          case Value::Kind::Float: key = json_float(k.as_double()); break;
          case Value::Kind::None: key = "null"; break;
          default: eval_fail("keys must be str, int, float, bool or None, not " + k.type_name());
        }
        items.emplace_back(std::move(key), &val);
      }
      if (st.sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](const auto& a, const auto& b) { return a.first < b.first; });
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += st.item_sep;
        if (st.has_indent) newline(level + 1);
        json_string(out, items[i].first, st.ensure_ascii);
        out += st.key_sep;
        json_value(out, *items[i].second, st, level + 1);
      }
      if (st.has_indent) newline(level);
      out += '}';
      return;
    }
    default: eval_fail("Object of type " + v.type_name() + " is not JSON serializable");
  }
}

}  // namespace

std::string to_json(const Value& v, const JsonStyle& style) {
  std::string out;
  json_value(out, v, style, 0);
  return out;
}

// ---------------------------------------------------------------- comparison

bool equals(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case K::Undefined:
    case K::None: return true;
    case K::String: return a.as_string() == b.as_string();
    case K::List: {
      const ListData& x = a.as_list();
      const ListData& y = b.as_list();
      if (x.tuple != y.tuple || x.items.size() != y.items.size()) return false;
      for (size_t i = 0; i < x.items.size(); ++i)
        if (!equals(x.items[i], y.items[i])) return false;
      return true;
    }
    case K::Dict: {
      const DictData& x = a.as_dict();
      const DictData& y = b.as_dict();
      if (x.size() != y.size()) return false;
      for (const auto& [k, v] : x.entries) {
        const Value* other = y.find(k);
        if (!other || !equals(v, *other)) return false;
      }
      return true;
    }
    default: return a.identity() == b.identity();
  }
}

bool less_than(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() < b.as_double();
    return a.as_int() < b.as_int();
  }
  if (a.is_string() && b.is_string()) return a.as_string() < b.as_string();
  if (a.is_list() && b.is_list() && a.as_list().tuple == b.as_list().tuple) {
    const auto& x = a.as_list().items;
    const auto& y = b.as_list().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (equals(x[i], y[i])) continue;
      return less_than(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  eval_fail("'<' not supported between instances of '" + a.type_name() + "' and '" + b.type_name() + "'");
}

}  // namespace lily::text::jinja
