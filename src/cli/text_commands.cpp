// lily tokenize | detokenize | template | run | chat: text in and out.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/model_paths.h"
#include "core/error.h"
#include "core/mapped_file.h"
#include "engine/generator.h"
#include "server/served_model.h"
#include "text/json_constraint.h"
#include "text/output_parser.h"

namespace lily::cli {

namespace {

using ojson = nlohmann::ordered_json;

const std::set<std::string> kModelFlags = {"--model", "--tokenizer", "--backend", "--threads", "--kv-cache",
                                           "--quantize", "--cpu-act"};

std::set<std::string> with(std::set<std::string> a, std::initializer_list<std::string> b) {
  a.insert(b);
  return a;
}

server::ServedModel open_model(const Args& a, bool load_weights, bool quiet) {
  server::ModelLoadOptions lo = model_load_options(a);
  lo.load_weights = load_weights;
  if (!quiet) lo.progress = [](const std::string& s) { std::fprintf(stderr, "%s\n", s.c_str()); };
  return server::load_served_model(lo);
}

// One streamed reply: reasoning (dimmed on a terminal) then content.
struct ReplyPrinter {
  bool tty = ::isatty(STDOUT_FILENO) != 0;
  bool in_reasoning = false;
  void print(const text::Delta& d) {
    if (!d.reasoning.empty()) {
      if (!in_reasoning && tty) std::fputs("\x1b[2m", stdout);
      in_reasoning = true;
      std::fputs(d.reasoning.c_str(), stdout);
    }
    if (!d.content.empty() || !d.tool_calls.empty()) end_reasoning();
    std::fputs(d.content.c_str(), stdout);
    for (const auto& t : d.tool_calls) {
      if (!t.name.empty()) std::printf("[tool call %s(", t.name.c_str());
      std::fputs(t.arguments_fragment.c_str(), stdout);
    }
    std::fflush(stdout);
  }
  void end_reasoning() {
    if (in_reasoning) {
      if (tty) std::fputs("\x1b[0m", stdout);
      std::fputs("\n\n", stdout);
      in_reasoning = false;
    }
  }
};

struct ChatSession {
  server::ServedModel& model;
  engine::Generator generator;
  engine::SamplingParams sampling;
  int max_tokens;
  ojson messages = ojson::array();
  std::string system;
  bool thinking = true;
  std::shared_ptr<const text::JsonGrammar> json;  // --json-schema FILE / --json: constrained replies

  ChatSession(server::ServedModel& m, int context, const Args& a)
      : model(m), generator(*m.backend, *m.tokenizer, context), sampling(m.default_sampling) {
    if (!m.chat_template) fail(m.dir, ": no chat template (chat_template.jinja or tokenizer_config.json)");
    max_tokens = static_cast<int>(a.integer("--max-tokens", 1024, 1, context));
    sampling.temperature = static_cast<float>(a.number("--temperature", sampling.temperature, 0, 100));
    sampling.top_p = static_cast<float>(a.number("--top-p", sampling.top_p, 0, 1));
    sampling.top_k = static_cast<int>(a.integer("--top-k", sampling.top_k, 0, 1 << 20));
    if (a.has("--seed")) {
      sampling.seed = static_cast<uint64_t>(a.integer("--seed", 0, 0, INT64_MAX));
      sampling.has_seed = true;
    }
    system = a.str("--system");
    generator.speculative_tokens = static_cast<int>(a.integer("--speculative", 0, 0, 16));
    thinking = !a.has("--no-think");
    if (a.has("--json-schema")) {
      const std::string path = a.str("--json-schema");
      const ojson schema = ojson::parse(read_text_file(path), nullptr, false);
      if (schema.is_discarded()) fail("--json-schema ", path, ": not JSON");
      try {
        json = text::JsonGrammar::from_schema(schema);
      } catch (const Error& e) {
        fail("--json-schema ", path, ": ", e.what());
      }
    } else if (a.has("--json")) {
      json = text::JsonGrammar::any_object();
    }
  }

  // Runs one user turn; prints the reply as it streams; keeps the history.
  void turn(const std::string& user) {
    ojson msgs = ojson::array();
    if (!system.empty()) msgs.push_back({{"role", "system"}, {"content", system}});
    for (const auto& m : messages) msgs.push_back(m);
    msgs.push_back({{"role", "user"}, {"content", user}});
    const std::string prompt = model.chat_template->render(msgs, nullptr, true, {{"enable_thinking", thinking}});
    engine::GenerationParams p;
    p.prompt = model.tokenizer->encode(prompt);
    p.sampling = sampling;
    p.max_tokens = std::min(max_tokens, generator.context() - static_cast<int>(p.prompt.size()));
    if (p.max_tokens < 1) fail("the conversation (", p.prompt.size(), " tokens) fills the context of ", generator.context(), " tokens: /reset");
    p.stop_token_ids = model.stop_token_ids;
    text::OutputParserOptions po;
    po.reasoning_enabled = true;
    po.starts_in_reasoning = thinking && text::prompt_opens_reasoning(prompt);
    if (json) {
      p.json_grammar = json;
      if (po.starts_in_reasoning) p.grammar_after = "</think>";
    }
    text::OutputParser parser(po);
    ReplyPrinter out;
    auto result = generator.generate(p, [&](engine::GenerationEvent&& e) {
      out.print(parser.push(e.text));
      return true;
    });
    out.print(parser.finish());
    out.end_reasoning();
    std::fputc('\n', stdout);
    const auto& parsed = parser.result();
    ojson reply = {{"role", "assistant"}, {"content", parsed.content}};
    if (!parsed.reasoning.empty()) reply["reasoning_content"] = parsed.reasoning;
    messages.push_back({{"role", "user"}, {"content", user}});
    messages.push_back(reply);
    const double tps = result.decode_seconds > 0 ? (result.completion_tokens - 1) / result.decode_seconds : 0;
    std::fprintf(stderr, "[%d prompt tokens (%d cached), %d generated, %.1f tok/s, first token %.0f ms, %s]\n",
                 result.prompt_tokens, result.cached_tokens, result.completion_tokens, tps,
                 result.prefill_seconds * 1000, engine::finish_reason_name(result.finish));
  }
};

int context_for(const server::ServedModel& m, const Args& a) {
  const int model_ctx = m.backend->config().max_position_embeddings;
  const int def = model_ctx > 0 ? std::min(model_ctx, 8192) : 8192;
  return static_cast<int>(a.integer("--ctx", def, 16, model_ctx > 0 ? model_ctx : 1 << 24));
}

const std::set<std::string> kGenFlags = {"--max-tokens", "--temperature", "--top-p", "--top-k",
                                         "--seed", "--system", "--ctx", "--json-schema",
                                         "--speculative"};

}  // namespace

int cmd_tokenize(int argc, char** argv) {
  Args a(argc, argv, with(kModelFlags, {"--text"}), {"--no-special"});
  auto m = open_model(a, false, true);
  auto ids = m.tokenizer->encode(a.required("--text"), !a.has("--no-special"));
  std::printf("%s\n", nlohmann::json({{"tokens", ids}}).dump().c_str());
  return 0;
}

int cmd_detokenize(int argc, char** argv) {
  Args a(argc, argv, with(kModelFlags, {"--tokens"}), {"--skip-special"});
  auto m = open_model(a, false, true);
  auto ids = parse_int_list(a.required("--tokens"), "--tokens");
  std::string text = m.tokenizer->decode(ids, a.has("--skip-special"));
  std::printf("%s\n", ojson({{"text", text}}).dump(-1, ' ', false, ojson::error_handler_t::replace).c_str());
  return 0;
}

int cmd_template(int argc, char** argv) {
  Args a(argc, argv, with(kModelFlags, {"--request"}));
  auto m = open_model(a, false, true);
  if (!m.chat_template) fail(m.dir, ": no chat template");
  const std::string path = a.required("--request");
  ojson body;
  try {
    body = ojson::parse(read_text_file(path));
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": malformed JSON: ", e.what());
  }
  text::ChatInputs in = text::from_openai_request(body);
  // reasoning_effort "none" / "minimal" turns thinking off, as the server does.
  if (body.contains("reasoning_effort") && body["reasoning_effort"].is_string() &&
      !in.template_kwargs.contains("enable_thinking")) {
    std::string e = body["reasoning_effort"].get<std::string>();
    if (e == "none" || e == "minimal") in.template_kwargs["enable_thinking"] = false;
  }
  if (body.contains("tool_choice") && body["tool_choice"] == "none") in.tools = nullptr;
  const std::string prompt = m.chat_template->render(in);
  ojson out = {{"prompt", prompt}, {"tokens", m.tokenizer->encode(prompt)}};
  std::printf("%s\n", out.dump(-1, ' ', false, ojson::error_handler_t::replace).c_str());
  return 0;
}

int cmd_run(int argc, char** argv) {
  Args a(argc, argv, [] {
    auto f = with(kModelFlags, {});
    f.insert(kGenFlags.begin(), kGenFlags.end());
    return f;
  }(), {"--no-think", "--quiet", "--json"});
  if (a.positional().size() != 1) fail("lily run takes one prompt argument (quote it)");
  auto m = open_model(a, true, a.has("--quiet"));
  ChatSession s(m, context_for(m, a), a);
  s.turn(a.positional()[0]);
  return 0;
}

int cmd_chat(int argc, char** argv) {
  Args a(argc, argv, [] {
    auto f = with(kModelFlags, {});
    f.insert(kGenFlags.begin(), kGenFlags.end());
    return f;
  }(), {"--no-think", "--quiet", "--json"});
  auto m = open_model(a, true, a.has("--quiet"));
  ChatSession s(m, context_for(m, a), a);
  std::fprintf(stderr,
               "lily chat: %s. Commands: /reset, /system TEXT, /think on|off, /quit\n",
               m.id.c_str());
  std::string line;
  for (;;) {
    std::fputs("> ", stderr);
    std::fflush(stderr);
    if (!std::getline(std::cin, line)) break;
    if (line.empty()) continue;
    if (line == "/quit" || line == "/exit") break;
    if (line == "/reset") {
      s.messages = ojson::array();
      s.generator.reset();
      std::fputs("(conversation cleared)\n", stderr);
      continue;
    }
    if (line.rfind("/system", 0) == 0) {
      s.system = line.size() > 8 ? line.substr(8) : "";
      s.messages = ojson::array();
      std::fprintf(stderr, "(system prompt %s; conversation cleared)\n", s.system.empty() ? "removed" : "set");
      continue;
    }
    if (line == "/think on" || line == "/think off") {
      s.thinking = line == "/think on";
      std::fprintf(stderr, "(thinking %s)\n", s.thinking ? "on" : "off");
      continue;
    }
    if (line[0] == '/') {
      std::fprintf(stderr, "unknown command %s\n", line.c_str());
      continue;
    }
    try {
      s.turn(line);
    } catch (const Error& e) {
      std::fprintf(stderr, "error: %s\n", e.what());
    }
  }
  return 0;
}

}  // namespace lily::cli
