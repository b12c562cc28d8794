// Where the CLI finds its model: --model, else the bundled tiny test model;
// the tokenizer in the model directory, else --tokenizer, else the bundled
// Qwen3 tokenizer (the tiny model ships without one).
#pragma once

#include <string>

#include "cli/args.h"
#include "server/served_model.h"

namespace lily::cli {

// tests/fixtures/<name> of the source tree this binary was built from, or ""
// when that tree is not there.
std::string bundled_fixture(const std::string& name);

// Reads --model, --tokenizer, --backend, --threads (all optional).
server::ModelLoadOptions model_load_options(const Args& a);

}  // namespace lily::cli
