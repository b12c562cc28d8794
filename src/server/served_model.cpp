#include "server/served_model.h"

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"
#include "model/quantize.h"
#include "model/weights.h"

namespace lily::server {

namespace {

std::string join(const std::string& dir, const std::string& file) {
  if (dir.empty()) return file;
  return dir.back() == '/' ? dir + file : dir + "/" + file;
}

std::string base_name(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  auto slash = dir.rfind('/');
  return slash == std::string::npos ? dir : dir.substr(slash + 1);
}

void add_ids(const nlohmann::json& v, std::vector<int>& out) {
  if (v.is_number_integer()) out.push_back(v.get<int>());
  if (v.is_array())
    for (const auto& x : v)
      if (x.is_number_integer()) out.push_back(x.get<int>());
}

bool has_template(const std::string& dir) {
  if (dir.empty()) return false;
  if (file_exists(join(dir, "chat_template.jinja")) || file_exists(join(dir, "chat_template.json")))
    return true;
  const std::string cfg = join(dir, "tokenizer_config.json");
  if (!file_exists(cfg)) return false;
  auto j = nlohmann::json::parse(read_text_file(cfg), nullptr, false);
  return j.is_object() && j.contains("chat_template") && !j["chat_template"].is_null();
}

}  // namespace

text::ToolDialect detect_tool_dialect(const std::string& src) {
  if (src.find("<function=") != std::string::npos) return text::ToolDialect::Xml;
  if (src.find("<tool_call>") != std::string::npos) return text::ToolDialect::Hermes;
  return text::ToolDialect::None;
}

ServedModel load_served_model(const ModelLoadOptions& o) {
  auto say = [&](const std::string& s) {
    if (o.progress) o.progress(s);
  };
  using Clock = std::chrono::steady_clock;
  ServedModel m;
  m.dir = o.model_dir;
  m.id = base_name(o.model_dir);

  // Tokenizer: the model directory's, else the fallback directory's.
  std::string tok_dir = o.model_dir;
  if (!file_exists(join(tok_dir, "tokenizer.json"))) {
    if (o.tokenizer_dir.empty() || !file_exists(join(o.tokenizer_dir, "tokenizer.json")))
      fail(o.model_dir, ": no tokenizer.json here",
           o.tokenizer_dir.empty() ? std::string(" (pass --tokenizer DIR)")
                                   : str_cat(" nor in ", o.tokenizer_dir));
    tok_dir = o.tokenizer_dir;
  }
  m.tokenizer_path = join(tok_dir, "tokenizer.json");
  auto t0 = Clock::now();
  say("loading tokenizer " + m.tokenizer_path);
  m.tokenizer = std::make_unique<text::Tokenizer>(text::Tokenizer::from_dir(tok_dir));
  say(str_cat("  ", m.tokenizer->vocab_size(), " tokens (",
              std::chrono::duration<double>(Clock::now() - t0).count(), " s)"));

  // Chat template: the model directory's, else the tokenizer directory's.
  for (const std::string& dir : {o.model_dir, tok_dir, o.tokenizer_dir}) {
    if (!has_template(dir)) continue;
    say("loading chat template from " + dir);
    m.chat_template = std::make_unique<text::ChatTemplate>(text::ChatTemplate::from_model_dir(dir));
    break;
  }
  if (!m.chat_template)
    say("no chat template found: /v1/chat/completions is disabled");
  else
    m.tool_dialect = detect_tool_dialect(m.chat_template->source());

  const ModelConfig cfg = load_model_config(o.model_dir);
  if (o.load_weights) {
    t0 = Clock::now();
    say("loading weights from " + o.model_dir);
    auto weights = load_model(o.model_dir);
    if (!o.quantize.empty()) quantize_model(*weights, parse_quantize_option(o.quantize));
    say(str_cat("  ", arch_name(cfg.arch), ", ", cfg.num_layers, " layers, hidden ",
                cfg.hidden_size, ", vocabulary ", cfg.vocab_size, " (",
                std::chrono::duration<double>(Clock::now() - t0).count(), " s)"));
    t0 = Clock::now();
    say("starting the " + o.backend.kind + " backend");
    m.backend = make_backend(std::move(weights), o.backend);
    say(str_cat("  ready: ", m.backend->name(), " backend (", std::chrono::duration<double>(Clock::now() - t0).count(),
                " s)"));
  }

  if (m.tokenizer->vocab_size() > cfg.vocab_size)
    fail("the tokenizer (", m.tokenizer_path, ") has ", m.tokenizer->vocab_size(),
         " tokens but the model only ", cfg.vocab_size, ": not this model's tokenizer?");

  // Stop tokens and default sampling.
  m.stop_token_ids = cfg.eos_token_ids;
  const std::string gen_path = join(o.model_dir, "generation_config.json");
  if (file_exists(gen_path)) {
    auto gen = nlohmann::json::parse(read_text_file(gen_path), nullptr, false);
    if (gen.is_discarded()) fail(gen_path, ": invalid JSON");
    if (gen.contains("eos_token_id")) add_ids(gen["eos_token_id"], m.stop_token_ids);
    m.default_sampling = engine::SamplingParams::from_generation_config(gen);
  }
  if (m.chat_template) {
    const std::string eos = m.chat_template->eos_token();
    if (!eos.empty())
      if (auto id = m.tokenizer->token_to_id(eos)) m.stop_token_ids.push_back(*id);
  }
  std::sort(m.stop_token_ids.begin(), m.stop_token_ids.end());
  m.stop_token_ids.erase(std::unique(m.stop_token_ids.begin(), m.stop_token_ids.end()),
                         m.stop_token_ids.end());
  m.created = std::chrono::duration_cast<std::chrono::seconds>(
                  std::chrono::system_clock::now().time_since_epoch())
                  .count();
  return m;
}

}  // namespace lily::server
