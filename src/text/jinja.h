// A Jinja2 interpreter for chat templates (the subset Hugging Face chat
// templates use), with the environment transformers renders them in:
// trim_blocks and lstrip_blocks on, the loop controls (break / continue), the
// `generation` tag, `raise_exception`, `strftime_now`, and a `tojson` that
// keeps key order and non-ASCII text (Python's json.dumps defaults otherwise).
//
// Values follow Python: truthiness, str() / repr() of numbers, lists and
// dicts, integer vs float arithmetic, code-point based string indexing.
// Rendering is bounded: nesting depth, loop iterations and output size are
// limited and exceeding them throws lily::Error, as does every template error
// (syntax errors carry the line number). A parsed template is immutable and
// render() may be called from several threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace lily::text {

namespace jinja {
struct Program;
}

struct JinjaOptions {
  bool trim_blocks = true;    // drop the first newline after a block / comment tag
  bool lstrip_blocks = true;  // strip spaces and tabs before a block / comment tag on its line
  bool keep_trailing_newline = false;
  // Largest output, and largest string or list built while rendering.
  size_t max_output_bytes = size_t{64} << 20;
  // Loop iterations plus macro calls, per render.
  uint64_t max_iterations = 1'000'000;
  // Parser: nested blocks, brackets and unary operators.
  int max_nesting_depth = 200;
  // Runtime: nested evaluation, macro recursion included.
  int max_render_depth = 500;
};

// Thrown when a template calls raise_exception(msg); template_message() is
// msg as the template wrote it (what() adds the template name and line).
class JinjaRaisedError : public lily::Error {
 public:
  JinjaRaisedError(const std::string& what, std::string message)
      : lily::Error(what), message_(std::move(message)) {}
  const std::string& template_message() const { return message_; }

 private:
  std::string message_;
};

class JinjaTemplate {
 public:
  // Parses `source`; `name` prefixes every error message. Throws lily::Error
  // on a syntax error ("<name>:<line>: syntax error: ...").
  explicit JinjaTemplate(std::string_view source, std::string name = "template",
                         JinjaOptions options = {});
  ~JinjaTemplate();
  JinjaTemplate(const JinjaTemplate&) = default;
  JinjaTemplate& operator=(const JinjaTemplate&) = default;
  JinjaTemplate(JinjaTemplate&&) noexcept = default;
  JinjaTemplate& operator=(JinjaTemplate&&) noexcept = default;

  // Renders with `variables` (a JSON object, or null for none) as the
  // template's context. JSON objects keep their key order.
  std::string render(const nlohmann::ordered_json& variables) const;

  const std::string& name() const;

 private:
  std::shared_ptr<const jinja::Program> program_;
};

}  // namespace lily::text
