// Everything the server needs about the one model it serves: the backend,
// the tokenizer, the chat template, the stop tokens and the default sampling
// parameters, loaded from a model directory.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "engine/sampler.h"
#include "text/chat_template.h"
#include "text/output_parser.h"
#include "text/tokenizer.h"

namespace lily::server {

struct ServedModel {
  std::string id;  // the name /v1/models reports (the directory's base name)
  std::string dir;
  std::string tokenizer_path;  // the tokenizer.json used
  std::unique_ptr<Backend> backend;
  std::unique_ptr<text::Tokenizer> tokenizer;
  std::unique_ptr<text::ChatTemplate> chat_template;  // null: no chat endpoint
  std::vector<int> stop_token_ids;          // EOS ids (config, generation config, template)
  engine::SamplingParams default_sampling;  // generation_config.json
  text::ToolDialect tool_dialect = text::ToolDialect::None;  // from the template's syntax
  int64_t created = 0;                                       // unix time of loading
};

struct ModelLoadOptions {
  std::string model_dir;
  // Where to look for tokenizer.json (and the chat template) when the model
  // directory has none. Empty: nowhere else.
  std::string tokenizer_dir;
  BackendOptions backend;
  // Non-empty: quantize a bf16 checkpoint at load ("q4" / "q8", see
  // model/quantize.h).
  std::string quantize;
  // false: tokenizer, template and generation config only (no backend), for
  // the text tools (lily tokenize / detokenize / template).
  bool load_weights = true;
  // Called with a line of progress ("loading weights from ...").
  std::function<void(const std::string&)> progress;
};

// Throws lily::Error naming what is missing or malformed.
ServedModel load_served_model(const ModelLoadOptions& options);

// The tool-call syntax a chat template writes: Xml ("<function="), Hermes
// ("<tool_call>" with JSON), or None.
text::ToolDialect detect_tool_dialect(const std::string& template_source);

}  // namespace lily::server
