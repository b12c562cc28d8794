// Jinja lexer and parser: template source -> syntax tree (jinja_internal.h).
// Whitespace control follows Jinja 3: `-` strips all whitespace on that side
// of a tag, `+` disables lstrip/trim for it, trim_blocks drops the first
// newline after a block or comment tag, lstrip_blocks strips the spaces and
// tabs that begin a line before a block or comment tag.
#include <charconv>
#include <cmath>
#include <cstring>

#include <utf8proc.h>

#include "text/jinja_internal.h"

namespace lily::text::jinja {
namespace {

enum class Tok : uint8_t { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };

struct Token {
  Tok type;
  int line;
  std::string text;  // data, name, decoded string, operator
  int64_t ival = 0;
  double fval = 0;
};

class Lexer {
 public:
  Lexer(std::string_view source, const std::string& name, const JinjaOptions& opt)
      : name_(name), opt_(opt) {
    // Newlines: \r\n and \r become \n; one trailing newline is dropped.
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!opt_.keep_trailing_newline && !src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Token> run() {
    const size_t n = src_.size();
    bool line_starting = true;
    while (pos_ < n) {
      size_t tag = std::string::npos;
      for (size_t p = src_.find('{', pos_); p != std::string::npos; p = src_.find('{', p + 1)) {
        if (p + 1 < n && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) {
          tag = p;
          break;
        }
      }
      if (tag == std::string::npos) {
        emit(Tok::Data, pos_, src_.substr(pos_));
        pos_ = n;
        break;
      }
      std::string text = src_.substr(pos_, tag - pos_);
      size_t text_pos = pos_;
      char kind = src_[tag + 1];
      size_t after = tag + 2;
      char sign = 0;
      if (after < n && (src_[after] == '-' || src_[after] == '+')) sign = src_[after++];
      // {% raw %}?
      size_t raw_after = 0;
      if (kind == '%') {
        size_t q = skip_space(after);
        if (src_.compare(q, 3, "raw") == 0) {
          q = skip_space(q + 3);
          if (src_.compare(q, 3, "-%}") == 0)
            raw_after = skip_space(q + 3);
          else if (src_.compare(q, 2, "%}") == 0)
            raw_after = q + 2;
        }
      }
      text = strip_before(std::move(text), sign, kind != '{', line_starting);
      if (!text.empty()) emit(Tok::Data, text_pos, std::move(text));
      if (raw_after) {
        pos_ = raw_after;
        line_starting = src_[pos_ - 1] == '\n';
        lex_raw(tag, line_starting);
      } else if (kind == '#') {
        pos_ = after;
        lex_comment(tag, line_starting);
      } else {
        pos_ = after;
        lex_tag(kind == '{', tag, line_starting);
      }
    }
    tokens_.push_back(Token{Tok::Eof, line_at(n), "", 0, 0});
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void fail(int line, const std::string& msg) const {
    lily::fail(name_, ":", line, ": syntax error: ", msg);
  }

  int line_at(size_t pos) {
    for (; line_pos_ < pos && line_pos_ < src_.size(); ++line_pos_)
      if (src_[line_pos_] == '\n') ++line_;
    return line_;
  }

  void emit(Tok type, size_t pos, std::string text) {
    tokens_.push_back(Token{type, line_at(pos), std::move(text), 0, 0});
  }

  bool space_at(size_t p, size_t* len) const {
    if (p >= src_.size()) return false;
    return py_isspace(decode_cp(src_, p, len));
  }

  size_t skip_space(size_t p) const {
    size_t len;
    while (space_at(p, &len)) p += len;
    return p;
  }

  // Whitespace control for the text before a tag.
  std::string strip_before(std::string text, char sign, bool lstrip_applies, bool line_starting) const {
    if (sign == '-') return py_strip(text, nullptr, false, true);
    if (sign == '+' || !opt_.lstrip_blocks || !lstrip_applies) return text;
    size_t l_pos = text.rfind('\n');
    l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
    if (l_pos == 0 && !line_starting) return text;
    if (l_pos == text.size()) return text;
    size_t p = l_pos, len;
    while (p < text.size()) {
      uint32_t cp = decode_cp(text, p, &len);
      if (!py_isspace(cp)) return text;
      p += len;
    }
    text.resize(l_pos);
    return text;
  }

  // After `%}` / `#}`: trim_blocks drops one newline; `-` strips all whitespace.
  size_t after_end(size_t p, char sign) const {
    if (sign == '-') return skip_space(p);
    if (sign != '+' && opt_.trim_blocks && p < src_.size() && src_[p] == '\n') return p + 1;
    return p;
  }

  void lex_comment(size_t open, bool& line_starting) {
    size_t body = pos_;
    if (body >= src_.size()) return;  // as Jinja: an empty comment opener at the very end is dropped
    size_t end = src_.find("#}", body);
    if (end == std::string::npos) fail(line_at(open), "missing end of comment tag");
    char sign = 0;
    if (end > body && (src_[end - 1] == '-' || src_[end - 1] == '+')) sign = src_[end - 1];
    pos_ = after_end(end + 2, sign);
    line_starting = src_[pos_ - 1] == '\n';
  }

  void lex_raw(size_t open, bool& line_starting) {
    for (size_t p = src_.find("{%", pos_); p != std::string::npos; p = src_.find("{%", p + 1)) {
      size_t q = p + 2;
      char sign = 0;
      if (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) sign = src_[q++];
      q = skip_space(q);
      if (src_.compare(q, 6, "endraw") != 0) continue;
      q = skip_space(q + 6);
      char end_sign = 0;
      if (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) end_sign = src_[q++];
      if (src_.compare(q, 2, "%}") != 0) continue;
      std::string text = strip_before(src_.substr(pos_, p - pos_), sign, true, line_starting);
      if (!text.empty()) emit(Tok::Data, pos_, std::move(text));
      pos_ = after_end(q + 2, end_sign);
      line_starting = src_[pos_ - 1] == '\n';
      return;
    }
    fail(line_at(open), "missing end of raw directive");
  }

  // A character of an identifier (Python's rules, approximately: letters and
  // '_' start one; digits, marks and connectors may follow).
  bool ident_char(size_t p, bool start, size_t* len) const {
    uint32_t cp = decode_cp(src_, p, len);
    if (cp < 0x80) return cp == '_' || isalpha(static_cast<int>(cp)) || (!start && isdigit(static_cast<int>(cp)));
    if (*len == 1) return false;  // invalid UTF-8
    auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
    if ((c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) || c == UTF8PROC_CATEGORY_NL) return true;
    return !start && (c == UTF8PROC_CATEGORY_MN || c == UTF8PROC_CATEGORY_MC || c == UTF8PROC_CATEGORY_ND ||
                      c == UTF8PROC_CATEGORY_PC);
  }

  size_t digits(size_t p) const {  // (\d+_)*\d+
    const size_t n = src_.size();
    if (p >= n || !isdigit(static_cast<unsigned char>(src_[p]))) return std::string::npos;
    while (true) {
      while (p < n && isdigit(static_cast<unsigned char>(src_[p]))) ++p;
      if (p + 1 < n && src_[p] == '_' && isdigit(static_cast<unsigned char>(src_[p + 1]))) {
        ++p;
        continue;
      }
      return p;
    }
  }

  size_t exponent(size_t p) const {
    if (p >= src_.size() || (src_[p] != 'e' && src_[p] != 'E')) return std::string::npos;
    ++p;
    if (p < src_.size() && (src_[p] == '+' || src_[p] == '-')) ++p;
    return digits(p);
  }

  static std::string no_underscores(std::string_view s) {
    std::string out;
    for (char c : s)
      if (c != '_') out += c;
    return out;
  }

  bool lex_number(size_t start) {
    const size_t n = src_.size();
    size_t p = start;
    // Float: not directly after a '.', so that `foo.0.1` stays a chain of subscripts.
    if (p == 0 || src_[p - 1] != '.') {
      size_t int_end = digits(p);
      if (int_end != std::string::npos) {
        size_t frac_end = std::string::npos;
        if (int_end < n && src_[int_end] == '.') frac_end = digits(int_end + 1);
        size_t end = std::string::npos;
        if (frac_end != std::string::npos) end = exponent(frac_end);
        if (end == std::string::npos) end = exponent(int_end);
        if (end == std::string::npos) end = frac_end;
        if (end != std::string::npos) {
          std::string text = no_underscores(std::string_view(src_).substr(p, end - p));
          double v = 0;
          auto res = std::from_chars(text.data(), text.data() + text.size(), v);
          if (res.ec == std::errc::result_out_of_range) {  // as Python: overflow -> inf, underflow -> 0.0
            size_t e = text.find_first_of("eE");
            bool negative_exp = e != std::string::npos && e + 1 < text.size() && text[e + 1] == '-';
            v = negative_exp ? 0.0 : HUGE_VAL;
          } else if (res.ec != std::errc()) {
            fail(line_at(p), "invalid float literal");
          }
          tokens_.push_back(Token{Tok::Float, line_at(p), text, 0, v});
          pos_ = end;
          return true;
        }
      }
    }
    if (!isdigit(static_cast<unsigned char>(src_[p]))) return false;
    int base = 10;
    size_t q = p;
    auto is_digit_of = [&](char c) {
      c = static_cast<char>(tolower(static_cast<unsigned char>(c)));
      if (base == 2) return c == '0' || c == '1';
      if (base == 8) return c >= '0' && c <= '7';
      if (base == 16) return isxdigit(static_cast<unsigned char>(c)) != 0;
      return isdigit(static_cast<unsigned char>(c)) != 0;
    };
    std::string digits_text;
    if (src_[p] == '0' && p + 1 < n && strchr("bBoOxX", src_[p + 1])) {
      char b = static_cast<char>(tolower(static_cast<unsigned char>(src_[p + 1])));
      base = b == 'b' ? 2 : b == 'o' ? 8 : 16;
      q = p + 2;
      while (q < n) {
        if (src_[q] == '_' && q + 1 < n && is_digit_of(src_[q + 1])) ++q;
        if (q < n && is_digit_of(src_[q]))
          digits_text += src_[q++];
        else
          break;
      }
      if (digits_text.empty()) {
        base = 10;
        q = p + 1;
        digits_text = "0";
      }
    } else if (src_[p] == '0') {
      q = p + 1;
      while (q < n) {  // 0(_?0)*
        if (src_[q] == '0')
          ++q;
        else if (src_[q] == '_' && q + 1 < n && src_[q + 1] == '0')
          q += 2;
        else
          break;
      }
      digits_text = "0";
    } else {
      q = digits(p);
      digits_text = no_underscores(std::string_view(src_).substr(p, q - p));
    }
    int64_t v = 0;
    auto res = std::from_chars(digits_text.data(), digits_text.data() + digits_text.size(), v, base);
    if (res.ec != std::errc()) fail(line_at(p), "integer literal too large");
    tokens_.push_back(Token{Tok::Int, line_at(p), std::string(src_.substr(p, q - p)), v, 0});
    pos_ = q;
    return true;
  }

  void lex_string(size_t start) {
    char quote = src_[start];
    std::string out;
    size_t p = start + 1;
    const size_t n = src_.size();
    auto hex = [&](size_t at, int count) -> uint32_t {
      uint32_t v = 0;
      for (int k = 0; k < count; ++k) {
        if (at + k >= n || !isxdigit(static_cast<unsigned char>(src_[at + k])))
          fail(line_at(start), "truncated escape sequence in string literal");
        char c = src_[at + k];
        v = v * 16 + static_cast<uint32_t>(isdigit(static_cast<unsigned char>(c)) ? c - '0' : (tolower(c) - 'a' + 10));
      }
      return v;
    };
    while (true) {
      if (p >= n) fail(line_at(start), "unterminated string literal");
      char c = src_[p];
      if (c == quote) break;
      if (c != '\\') {
        out += c;
        ++p;
        continue;
      }
      if (p + 1 >= n) fail(line_at(start), "unterminated string literal");
      char e = src_[p + 1];
      p += 2;
      switch (e) {
        case '\n': break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'v': out += '\v'; break;
        case 'x': append_utf8(out, hex(p, 2)); p += 2; break;
        case 'u': {
          uint32_t cp = hex(p, 4);
          p += 4;
          if (cp >= 0xD800 && cp <= 0xDFFF) fail(line_at(start), "surrogate code point in string literal");
          append_utf8(out, cp);
          break;
        }
        case 'U': {
          uint32_t cp = hex(p, 8);
          p += 8;
          if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            fail(line_at(start), "invalid \\U escape in string literal");
          append_utf8(out, cp);
          break;
        }
        case 'N': fail(line_at(start), "\\N{...} escapes are not supported");
        default:
          if (e >= '0' && e <= '7') {
            uint32_t v = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && p < n && src_[p] >= '0' && src_[p] <= '7'; ++k) v = v * 8 + static_cast<uint32_t>(src_[p++] - '0');
            append_utf8(out, v);
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    tokens_.push_back(Token{Tok::String, line_at(start), std::move(out), 0, 0});
    pos_ = p + 1;
  }

  void lex_tag(bool variable, size_t open, bool& line_starting) {
    tokens_.push_back(Token{variable ? Tok::VarBegin : Tok::BlockBegin, line_at(open), "", 0, 0});
    std::string balance;  // expected closers
    const size_t n = src_.size();
    while (true) {
      if (pos_ >= n)
        fail(line_at(open), variable ? "unexpected end of template: '{{' is never closed with '}}'"
                                     : "unexpected end of template: '{%' is never closed with '%}'");
      if (balance.empty()) {
        const char* end = variable ? "}}" : "%}";
        char sign = 0;
        size_t q = pos_;
        if (src_[q] == '-' || (!variable && src_[q] == '+')) sign = src_[q++];
        if (src_.compare(q, 2, end) == 0) {
          size_t end_pos = q + 2;
          if (variable)
            end_pos = sign == '-' ? skip_space(end_pos) : end_pos;
          else
            end_pos = after_end(end_pos, sign);
          tokens_.push_back(Token{variable ? Tok::VarEnd : Tok::BlockEnd, line_at(pos_), "", 0, 0});
          pos_ = end_pos;
          line_starting = src_[pos_ - 1] == '\n';
          return;
        }
      }
      size_t len;
      if (space_at(pos_, &len)) {
        pos_ = skip_space(pos_);
        continue;
      }
      char c = src_[pos_];
      if (isdigit(static_cast<unsigned char>(c)) && lex_number(pos_)) continue;
      if (ident_char(pos_, true, &len)) {
        size_t q = pos_ + len;
        while (q < n && ident_char(q, false, &len)) q += len;
        emit(Tok::Name, pos_, src_.substr(pos_, q - pos_));
        pos_ = q;
        continue;
      }
      if (c == '\'' || c == '"') {
        lex_string(pos_);
        continue;
      }
      static const char* const kTwo[] = {"//", "**", "==", "!=", ">=", "<="};
      std::string op;
      for (const char* t : kTwo)
        if (src_.compare(pos_, 2, t) == 0) op = t;
      if (op.empty() && strchr("+-/*%~[](){}<>=.:|,;", c) && c != '\0') op = std::string(1, c);
      if (op.empty()) {
        std::string shown = src_.substr(pos_, 1);
        if (static_cast<unsigned char>(c) >= 0x80) shown = src_.substr(pos_, len ? len : 1);
        fail(line_at(pos_), "unexpected char '" + shown + "'");
      }
      if (op == "(" || op == "[" || op == "{") {
        balance += op == "(" ? ')' : op == "[" ? ']' : '}';
      } else if (op == ")" || op == "]" || op == "}") {
        if (balance.empty()) fail(line_at(pos_), "unexpected '" + op + "'");
        if (balance.back() != op[0])
          fail(line_at(pos_), "unexpected '" + op + "', expected '" + std::string(1, balance.back()) + "'");
        balance.pop_back();
      }
      emit(Tok::Op, pos_, op);
      pos_ += op.size();
    }
  }

  std::string src_;
  const std::string& name_;
  const JinjaOptions& opt_;
  size_t pos_ = 0;
  size_t line_pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

// ------------------------------------------------------------------ parser

class Parser {
 public:
  Parser(std::vector<Token> tokens, const std::string& name, const JinjaOptions& opt)
      : toks_(std::move(tokens)), name_(name), opt_(opt) {}

  Body parse_all() {
    Body body = subparse({});
    if (cur().type != Tok::Eof) fail(cur().line, "unexpected " + describe(cur()));
    return body;
  }

 private:
  struct Depth {
    explicit Depth(Parser& p) : p_(p) {
      if (++p_.depth_ > p_.opt_.max_nesting_depth)
        p_.fail(p_.cur().line, str_cat("nesting deeper than ", p_.opt_.max_nesting_depth, " levels"));
    }
    ~Depth() { --p_.depth_; }
    Parser& p_;
  };

  [[noreturn]] void fail(int line, const std::string& msg) const {
    lily::fail(name_, ":", line, ": syntax error: ", msg);
  }

  const Token& cur() const { return toks_[pos_]; }
  const Token& look() const { return toks_[pos_ + 1 < toks_.size() ? pos_ + 1 : pos_]; }
  const Token& next() {
    const Token& t = toks_[pos_];
    if (pos_ + 1 < toks_.size()) ++pos_;
    return t;
  }
  bool is_op(const char* op) const { return cur().type == Tok::Op && cur().text == op; }
  bool is_name(const char* n) const { return cur().type == Tok::Name && cur().text == n; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(const char* n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }

  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::Data: return "template data";
      case Tok::VarBegin: return "'{{'";
      case Tok::VarEnd: return "end of print statement '}}'";
      case Tok::BlockBegin: return "'{%'";
      case Tok::BlockEnd: return "end of statement block '%}'";
      case Tok::Name: return "'" + t.text + "'";
      case Tok::String: return "string literal";
      case Tok::Int:
      case Tok::Float: return "number " + t.text;
      case Tok::Op: return "'" + t.text + "'";
      case Tok::Eof: return "end of template";
    }
    return "?";
  }

  void expect_op(const char* op) {
    if (!skip_op(op)) fail(cur().line, std::string("expected '") + op + "', got " + describe(cur()));
  }
  void expect_name(const char* n) {
    if (!skip_name(n)) fail(cur().line, std::string("expected '") + n + "', got " + describe(cur()));
  }
  std::string expect_identifier() {
    if (cur().type != Tok::Name) fail(cur().line, "expected a name, got " + describe(cur()));
    return next().text;
  }
  void expect_block_end() {
    if (cur().type != Tok::BlockEnd) fail(cur().line, "expected end of statement block '%}', got " + describe(cur()));
    next();
  }

  static ExprPtr mk(ExprKind k, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = line;
    return e;
  }

  // ---- statements

  Body subparse(const std::vector<std::string>& end_tokens) {
    Depth guard(*this);
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == Tok::Eof) return body;
      if (t.type == Tok::Data) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::Text;
        s->line = t.line;
        s->text = t.text;
        body.push_back(std::move(s));
        next();
      } else if (t.type == Tok::VarBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::Output;
        s->line = cur().line;
        s->exprs.push_back(parse_tuple(false, true, {}, false));
        if (cur().type != Tok::VarEnd) fail(cur().line, "expected end of print statement '}}', got " + describe(cur()));
        next();
        body.push_back(std::move(s));
      } else if (t.type == Tok::BlockBegin) {
        next();
        if (cur().type == Tok::Name)
          for (const auto& e : end_tokens)
            if (cur().text == e) return body;
        body.push_back(parse_statement(end_tokens));
        expect_block_end();
      } else {
        fail(t.line, "unexpected " + describe(t));
      }
    }
  }

  Body parse_statements(const std::vector<std::string>& end_tokens, bool drop_needle, const std::string& tag,
                        int open_line) {
    skip_op(":");
    expect_block_end();
    Body body = subparse(end_tokens);
    if (cur().type == Tok::Eof) {
      std::string expected;
      for (size_t i = 0; i < end_tokens.size(); ++i) expected += (i ? " or '" : "'") + end_tokens[i] + "'";
      fail(cur().line, "unexpected end of template: '" + tag + "' opened on line " + std::to_string(open_line) +
                           " needs " + expected);
    }
    if (drop_needle) next();
    return body;
  }

  std::unique_ptr<Stmt> parse_statement(const std::vector<std::string>& outer_end) {
    const Token& t = cur();
    if (t.type != Tok::Name) fail(t.line, "tag name expected, got " + describe(t));
    std::string tag = t.text;
    int line = t.line;
    auto s = std::make_unique<Stmt>();
    s->line = line;
    if (tag == "if") return parse_if(std::move(s));
    if (tag == "for") return parse_for(std::move(s));
    if (tag == "set") return parse_set(std::move(s));
    if (tag == "macro") return parse_macro(std::move(s));
    if (tag == "break" || tag == "continue") {
      next();
      if (loop_depth_ == 0) fail(line, "'" + tag + "' outside of a loop");
      s->kind = tag == "break" ? StmtKind::Break : StmtKind::Continue;
      return s;
    }
    if (tag == "print") {
      next();
      s->kind = StmtKind::Output;
      while (cur().type != Tok::BlockEnd) {
        if (!s->exprs.empty()) expect_op(",");
        s->exprs.push_back(parse_expression(true));
      }
      return s;
    }
    if (tag == "filter") {
      next();
      s->kind = StmtKind::FilterBlock;
      s->exprs.push_back(parse_filter(nullptr, true));
      s->bodies.push_back(parse_statements({"endfilter"}, true, tag, line));
      return s;
    }
    if (tag == "with") {
      next();
      s->kind = StmtKind::With;
      while (cur().type != Tok::BlockEnd) {
        if (!s->names.empty()) expect_op(",");
        s->names.push_back(expect_identifier());
        expect_op("=");
        s->exprs.push_back(parse_expression(true));
      }
      s->bodies.push_back(parse_statements({"endwith"}, true, tag, line));
      return s;
    }
    if (tag == "generation" || tag == "autoescape") {
      next();
      if (tag == "autoescape") parse_expression(true);  // no escaping here: the setting is ignored
      s->kind = StmtKind::Scope;
      s->bodies.push_back(parse_statements({"end" + tag}, true, tag, line));
      return s;
    }
    if (tag == "call" || tag == "block" || tag == "extends" || tag == "include" || tag == "import" ||
        tag == "from" || tag == "do")
      fail(line, "the '" + tag + "' tag is not supported");
    std::string msg = "unknown tag '" + tag + "'";
    if (!outer_end.empty()) {
      msg += " (expected ";
      for (size_t i = 0; i < outer_end.size(); ++i) msg += (i ? " or '" : "'") + outer_end[i] + "'";
      msg += ")";
    }
    fail(line, msg);
  }

  std::unique_ptr<Stmt> parse_if(std::unique_ptr<Stmt> s) {
    next();
    s->kind = StmtKind::If;
    while (true) {
      s->exprs.push_back(parse_tuple(false, false, {}, false));
      s->bodies.push_back(parse_statements({"elif", "else", "endif"}, false, "if", s->line));
      std::string t = next().text;
      if (t == "elif") continue;
      if (t == "else") s->bodies.push_back(parse_statements({"endif"}, true, "if", s->line));
      break;
    }
    return s;
  }

  Target parse_target(const std::vector<std::string>& extra_end, bool with_namespace) {
    Target t;
    bool paren = skip_op("(");
    while (true) {
      if (!t.items.empty()) {
        if (!skip_op(",")) break;
        t.tuple = true;
      }
      if (cur().type == Tok::BlockEnd || is_op(")") || is_op("=") || is_op("|")) break;
      bool end = false;
      for (const auto& e : extra_end)
        if (is_name(e.c_str())) end = true;
      if (end) break;
      TargetItem item;
      int line = cur().line;
      item.name = expect_identifier();
      if (item.name == "true" || item.name == "false" || item.name == "none" || item.name == "True" ||
          item.name == "False" || item.name == "None")
        fail(line, "can't assign to '" + item.name + "'");
      if (with_namespace && is_op(".")) {
        next();
        item.attr = expect_identifier();
      }
      t.items.push_back(std::move(item));
    }
    if (paren) {
      expect_op(")");
      if (t.items.size() > 1) t.tuple = true;
    }
    if (t.items.empty()) fail(cur().line, "expected an assignment target, got " + describe(cur()));
    return t;
  }

  std::unique_ptr<Stmt> parse_for(std::unique_ptr<Stmt> s) {
    next();
    s->kind = StmtKind::For;
    s->target = parse_target({"in"}, false);
    expect_name("in");
    s->exprs.push_back(parse_tuple(false, false, {"recursive"}, false));
    s->exprs.push_back(skip_name("if") ? parse_expression(true) : nullptr);
    if (is_name("recursive")) fail(cur().line, "recursive for loops are not supported");
    ++loop_depth_;
    s->bodies.push_back(parse_statements({"endfor", "else"}, false, "for", s->line));
    --loop_depth_;
    if (next().text == "else")
      s->bodies.push_back(parse_statements({"endfor"}, true, "for", s->line));
    else
      s->bodies.emplace_back();
    return s;
  }

  std::unique_ptr<Stmt> parse_set(std::unique_ptr<Stmt> s) {
    next();
    s->target = parse_target({}, true);
    if (skip_op("=")) {
      s->kind = StmtKind::Set;
      s->exprs.push_back(parse_tuple(false, true, {}, false));
      return s;
    }
    if (s->target.tuple) fail(s->line, "a block 'set' needs a single target");
    s->kind = StmtKind::SetBlock;
    s->exprs.push_back(is_op("|") ? parse_filter(nullptr, false) : nullptr);
    s->bodies.push_back(parse_statements({"endset"}, true, "set", s->line));
    return s;
  }

  std::unique_ptr<Stmt> parse_macro(std::unique_ptr<Stmt> s) {
    next();
    s->kind = StmtKind::Macro;
    s->text = expect_identifier();
    expect_op("(");
    while (!is_op(")")) {
      if (!s->names.empty()) expect_op(",");
      if (is_op(")")) break;
      s->names.push_back(expect_identifier());
      if (skip_op("=")) {
        s->defaults.push_back(parse_expression(true));
      } else {
        for (const auto& d : s->defaults)
          if (d) fail(cur().line, "non-default argument follows default argument");
        s->defaults.push_back(nullptr);
      }
    }
    expect_op(")");
    int saved = loop_depth_;
    loop_depth_ = 0;
    s->bodies.push_back(parse_statements({"endmacro"}, true, "macro", s->line));
    loop_depth_ = saved;
    return s;
  }

  // ---- expressions

  bool is_tuple_end(const std::vector<std::string>& extra) const {
    if (cur().type == Tok::VarEnd || cur().type == Tok::BlockEnd || cur().type == Tok::Eof || is_op(")"))
      return true;
    for (const auto& e : extra)
      if (is_name(e.c_str())) return true;
    return false;
  }

  ExprPtr parse_tuple(bool /*simplified*/, bool with_condexpr, const std::vector<std::string>& extra_end,
                      bool explicit_parens) {
    int line = cur().line;
    std::vector<ExprPtr> args;
    bool is_tuple = false;
    while (true) {
      if (!args.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      args.push_back(parse_expression(with_condexpr));
      if (is_op(","))
        is_tuple = true;
      else
        break;
    }
    if (!is_tuple) {
      if (!args.empty()) return std::move(args[0]);
      if (!explicit_parens) fail(cur().line, "expected an expression, got " + describe(cur()));
    }
    auto e = mk(ExprKind::Tuple, line);
    e->kids = std::move(args);
    return e;
  }

  ExprPtr parse_expression(bool with_condexpr) { return with_condexpr ? parse_condexpr() : parse_or(); }

  ExprPtr parse_condexpr() {
    Depth guard(*this);
    ExprPtr expr1 = parse_or();
    while (is_name("if")) {
      int line = next().line;
      ExprPtr cond = parse_or();
      ExprPtr expr3 = skip_name("else") ? parse_condexpr() : nullptr;
      auto e = mk(ExprKind::Cond, line);
      e->kids.push_back(std::move(cond));
      e->kids.push_back(std::move(expr1));
      e->kids.push_back(std::move(expr3));
      expr1 = std::move(e);
    }
    return expr1;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      auto e = mk(ExprKind::Or, next().line);
      e->kids.push_back(std::move(left));
      e->kids.push_back(parse_and());
      left = std::move(e);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      auto e = mk(ExprKind::And, next().line);
      e->kids.push_back(std::move(left));
      e->kids.push_back(parse_not());
      left = std::move(e);
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      Depth guard(*this);
      auto e = mk(ExprKind::Not, next().line);
      e->kids.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    int line = cur().line;
    ExprPtr first = parse_math1();
    ExprPtr cmp;
    while (true) {
      CmpOp op;
      if (is_op("=="))
        op = CmpOp::Eq;
      else if (is_op("!="))
        op = CmpOp::Ne;
      else if (is_op("<"))
        op = CmpOp::Lt;
      else if (is_op("<="))
        op = CmpOp::Le;
      else if (is_op(">"))
        op = CmpOp::Gt;
      else if (is_op(">="))
        op = CmpOp::Ge;
      else if (is_name("in"))
        op = CmpOp::In;
      else if (is_name("not") && look().type == Tok::Name && look().text == "in")
        op = CmpOp::NotIn;
      else
        break;
      next();
      if (op == CmpOp::NotIn) next();
      if (!cmp) {
        cmp = mk(ExprKind::Compare, line);
        cmp->kids.push_back(std::move(first));
      }
      cmp->cmp_ops.push_back(op);
      cmp->kids.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  ExprPtr binary(BinOp op, ExprPtr l, ExprPtr r, int line) {
    auto e = mk(ExprKind::Binary, line);
    e->bin_op = op;
    e->kids.push_back(std::move(l));
    e->kids.push_back(std::move(r));
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& t = next();
      BinOp op = t.text == "+" ? BinOp::Add : BinOp::Sub;
      left = binary(op, std::move(left), parse_concat(), t.line);
    }
    return left;
  }

  ExprPtr parse_concat() {
    int line = cur().line;
    ExprPtr first = parse_math2();
    if (!is_op("~")) return first;
    auto e = mk(ExprKind::Concat, line);
    e->kids.push_back(std::move(first));
    while (skip_op("~")) e->kids.push_back(parse_math2());
    return e;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = next();
      BinOp op = t.text == "*" ? BinOp::Mul : t.text == "/" ? BinOp::Div : t.text == "//" ? BinOp::FloorDiv : BinOp::Mod;
      left = binary(op, std::move(left), parse_pow(), t.line);
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      int line = next().line;
      left = binary(BinOp::Pow, std::move(left), parse_unary(true), line);
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    Depth guard(*this);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      const Token& t = next();
      node = mk(t.text == "-" ? ExprKind::Neg : ExprKind::Pos, t.line);
      node->kids.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    int line = t.line;
    switch (t.type) {
      case Tok::Name: {
        next();
        auto e = mk(ExprKind::Literal, line);
        if (t.text == "true" || t.text == "True") {
          e->literal = Value::boolean(true);
        } else if (t.text == "false" || t.text == "False") {
          e->literal = Value::boolean(false);
        } else if (t.text == "none" || t.text == "None") {
          e->literal = Value::none();
        } else {
          e->kind = ExprKind::Name;
          e->name = t.text;
        }
        return e;
      }
      case Tok::String: {
        std::string s;
        while (cur().type == Tok::String) s += next().text;
        auto e = mk(ExprKind::Literal, line);
        e->literal = Value::string(std::move(s));
        return e;
      }
      case Tok::Int:
      case Tok::Float: {
        next();
        auto e = mk(ExprKind::Literal, line);
        e->literal = t.type == Tok::Int ? Value::integer(t.ival) : Value::number(t.fval);
        return e;
      }
      case Tok::Op:
        if (t.text == "(") {
          next();
          ExprPtr e = parse_tuple(false, true, {}, true);
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          next();
          auto e = mk(ExprKind::List, line);
          while (!is_op("]")) {
            if (!e->kids.empty()) expect_op(",");
            if (is_op("]")) break;
            e->kids.push_back(parse_expression(true));
          }
          expect_op("]");
          return e;
        }
        if (t.text == "{") {
          next();
          auto e = mk(ExprKind::Dict, line);
          while (!is_op("}")) {
            if (!e->kids.empty()) expect_op(",");
            if (is_op("}")) break;
            e->kids.push_back(parse_expression(true));
            expect_op(":");
            e->kids.push_back(parse_expression(true));
          }
          expect_op("}");
          return e;
        }
        break;
      default: break;
    }
    fail(line, "unexpected " + describe(t));
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".")) {
        int line = next().line;
        if (cur().type == Tok::Name) {
          auto e = mk(ExprKind::GetAttr, line);
          e->name = next().text;
          e->kids.push_back(std::move(node));
          node = std::move(e);
        } else if (cur().type == Tok::Int) {
          auto e = mk(ExprKind::GetItem, line);
          auto idx = mk(ExprKind::Literal, line);
          idx->literal = Value::integer(next().ival);
          e->kids.push_back(std::move(node));
          e->kids.push_back(std::move(idx));
          node = std::move(e);
        } else {
          fail(cur().line, "expected a name or number after '.', got " + describe(cur()));
        }
      } else if (is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    int line = next().line;  // '['
    std::vector<ExprPtr> args;
    while (!is_op("]")) {
      if (!args.empty()) expect_op(",");
      args.push_back(parse_subscribed());
    }
    expect_op("]");
    if (args.empty()) fail(line, "expected a subscript expression");
    ExprPtr arg;
    if (args.size() == 1) {
      arg = std::move(args[0]);
    } else {
      arg = mk(ExprKind::Tuple, line);
      arg->kids = std::move(args);
    }
    if (arg->kind == ExprKind::Slice) {  // obj[a:b:c]: Slice(obj, a, b, c)
      arg->kids.insert(arg->kids.begin(), std::move(node));
      return arg;
    }
    auto e = mk(ExprKind::GetItem, line);
    e->kids.push_back(std::move(node));
    e->kids.push_back(std::move(arg));
    return e;
  }

  ExprPtr parse_subscribed() {
    int line = cur().line;
    std::vector<ExprPtr> parts;
    if (skip_op(":")) {
      parts.push_back(nullptr);
    } else {
      ExprPtr e = parse_expression(true);
      if (!skip_op(":")) return e;
      parts.push_back(std::move(e));
    }
    if (is_op(":") || is_op("]") || is_op(","))
      parts.push_back(nullptr);
    else
      parts.push_back(parse_expression(true));
    if (skip_op(":")) {
      if (is_op("]") || is_op(","))
        parts.push_back(nullptr);
      else
        parts.push_back(parse_expression(true));
    } else {
      parts.push_back(nullptr);
    }
    auto e = mk(ExprKind::Slice, line);
    e->kids = std::move(parts);
    return e;
  }

  // Call arguments into e (positional appended to kids).
  void parse_call_args(Expr& e) {
    int line = cur().line;
    expect_op("(");
    bool require_comma = false;
    while (!is_op(")")) {
      if (require_comma) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (is_op("*")) {
        next();
        if (e.dyn_args || e.dyn_kwargs) fail(line, "invalid syntax for function call expression");
        e.dyn_args = parse_expression(true);
      } else if (is_op("**")) {
        next();
        if (e.dyn_kwargs) fail(line, "invalid syntax for function call expression");
        e.dyn_kwargs = parse_expression(true);
      } else if (cur().type == Tok::Name && look().type == Tok::Op && look().text == "=") {
        if (e.dyn_kwargs) fail(line, "invalid syntax for function call expression");
        std::string key = next().text;
        next();
        e.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (e.dyn_args || e.dyn_kwargs || !e.kwargs.empty())
          fail(line, "positional argument follows keyword argument");
        e.kids.push_back(parse_expression(true));
      }
      require_comma = true;
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr node) {
    auto e = mk(ExprKind::Call, cur().line);
    e->kids.push_back(std::move(node));
    parse_call_args(*e);
    return e;
  }

  // node may be null: the chain of a filter block or block set.
  ExprPtr parse_filter(ExprPtr node, bool start_inline) {
    while (is_op("|") || start_inline) {
      if (!start_inline) next();
      start_inline = false;
      int line = cur().line;
      std::string name = expect_identifier();
      while (is_op(".")) {
        next();
        name += '.';
        name += expect_identifier();
      }
      auto e = mk(ExprKind::Filter, line);
      e->name = std::move(name);
      e->kids.push_back(std::move(node));
      if (is_op("(")) parse_call_args(*e);
      node = std::move(e);
    }
    return node;
  }

  ExprPtr parse_test(ExprPtr node) {
    int line = next().line;  // 'is'
    bool negated = skip_name("not");
    std::string name = expect_identifier();
    while (is_op(".")) {
      next();
      name += '.';
      name += expect_identifier();
    }
    auto e = mk(ExprKind::Test, line);
    e->name = std::move(name);
    e->kids.push_back(std::move(node));
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((cur().type == Tok::Name || cur().type == Tok::String || cur().type == Tok::Int ||
                cur().type == Tok::Float || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail(cur().line, "you cannot chain multiple tests with 'is'");
      Depth guard(*this);
      e->kids.push_back(parse_postfix(parse_primary()));
    }
    if (!negated) return e;
    auto n = mk(ExprKind::Not, line);
    n->kids.push_back(std::move(e));
    return n;
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|"))
        node = parse_filter(std::move(node), false);
      else if (is_name("is"))
        node = parse_test(std::move(node));
      else if (is_op("("))
        node = parse_call(std::move(node));
      else
        return node;
    }
  }

  std::vector<Token> toks_;
  size_t pos_ = 0;
  const std::string& name_;
  const JinjaOptions& opt_;
  int depth_ = 0;
  int loop_depth_ = 0;
};

// Unknown filters and tests are syntax errors, except inside `if` tests and
// branches and inline if-expressions, where (as in Jinja) they only fail if
// evaluated.
class Validator {
 public:
  Validator(const std::string& name) : name_(name) {}

  void body(const Body& b, bool soft) {
    for (const auto& s : b) stmt(*s, soft);
  }

 private:
  void stmt(const Stmt& s, bool soft) {
    switch (s.kind) {
      case StmtKind::If:
        for (const auto& e : s.exprs) expr(e.get(), true);
        for (const auto& b : s.bodies) body(b, true);
        return;
      case StmtKind::For:
        expr(s.exprs[0].get(), soft);
        expr(s.exprs[1].get(), false);
        for (const auto& b : s.bodies) body(b, false);
        return;
      case StmtKind::Macro:
        for (const auto& d : s.defaults) expr(d.get(), false);
        body(s.bodies[0], false);
        return;
      case StmtKind::Scope:
        body(s.bodies[0], soft);
        return;
      default:
        for (const auto& e : s.exprs) expr(e.get(), soft);
        for (const auto& b : s.bodies) body(b, false);
        return;
    }
  }

  void expr(const Expr* e, bool soft) {
    if (!e) return;
    if (e->kind == ExprKind::Cond) soft = true;
    if (!soft && e->kind == ExprKind::Filter && !filter_exists(e->name))
      lily::fail(name_, ":", e->line, ": syntax error: no filter named '", e->name, "'");
    if (!soft && e->kind == ExprKind::Test && !test_exists(e->name))
      lily::fail(name_, ":", e->line, ": syntax error: no test named '", e->name, "'");
    for (const auto& k : e->kids) expr(k.get(), soft);
    for (const auto& [k, v] : e->kwargs) expr(v.get(), soft);
    expr(e->dyn_args.get(), soft);
    expr(e->dyn_kwargs.get(), soft);
  }

  const std::string& name_;
};

}  // namespace

std::shared_ptr<Program> parse_template(std::string_view source, std::string name, const JinjaOptions& options) {
  auto prog = std::make_shared<Program>();
  prog->name = std::move(name);
  prog->options = options;
  Lexer lexer(source, prog->name, prog->options);
  Parser parser(lexer.run(), prog->name, prog->options);
  prog->body = parser.parse_all();
  Validator(prog->name).body(prog->body, false);
  return prog;
}

}  // namespace lily::text::jinja
