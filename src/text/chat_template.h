// Chat templates: a model's Jinja template rendered the way transformers'
// apply_chat_template renders it (variables `messages`, `tools`,
// `add_generation_prompt`, the special tokens, and any chat_template_kwargs
// such as `enable_thinking`), plus the mapping from an OpenAI
// chat-completions request body to those inputs.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "text/jinja.h"

namespace lily::text {

// What the chat template gets from a request.
struct ChatInputs {
  // Normalised messages: {role, content: string, [name], [reasoning_content],
  // [tool_calls: [{[id], type: "function", function: {name, arguments: object}}]],
  // [tool_call_id]}.
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  nlohmann::ordered_json tools;  // null, or the request's tool definitions as given
  bool add_generation_prompt = true;
  nlohmann::ordered_json template_kwargs = nlohmann::ordered_json::object();  // chat_template_kwargs
};

// Validates and maps an OpenAI chat-completions request body:
// - messages: non-empty array; role system | developer (-> system) | user |
//   assistant | tool; content a string, null (-> ""), or a list of
//   {type: "text", text} parts, concatenated without separator (any other
//   part type is refused); optional name;
// - assistant: reasoning_content (or `reasoning`), tool_calls whose
//   function.arguments JSON string is parsed into an object ("" -> {});
// - tool: tool_call_id;
// - tools (array of {type: "function", function: {name, ...}}),
//   chat_template_kwargs (object), add_generation_prompt (bool, default true).
// Throws lily::Error naming the offending parameter path, e.g.
// "messages[2].role".
ChatInputs from_openai_request(const nlohmann::ordered_json& body);

class ChatTemplate {
 public:
  // `special_tokens`: {bos_token: "...", eos_token: "...", ...}, passed to the
  // template as variables. `name` prefixes error messages.
  explicit ChatTemplate(std::string source, nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object(),
                        std::string name = "chat template");

  // Loads `dir`/chat_template.jinja if present, else the `chat_template` of
  // `dir`/tokenizer_config.json (a string, or a list of {name, template}:
  // the one named "default"), else `dir`/chat_template.json. Special tokens
  // (bos_token, eos_token, ...) come from tokenizer_config.json.
  static ChatTemplate from_model_dir(const std::string& dir);

  // messages: array of message objects; tools: null or array; extra_kwargs:
  // null or an object of further template variables (chat_template_kwargs).
  std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                     bool add_generation_prompt,
                     const nlohmann::ordered_json& extra_kwargs = nlohmann::ordered_json::object()) const;
  std::string render(const ChatInputs& inputs) const;

  const std::string& source() const { return source_; }
  // "" when the tokenizer config has none.
  std::string bos_token() const;
  std::string eos_token() const;

 private:
  std::string source_;
  nlohmann::ordered_json special_tokens_;
  JinjaTemplate template_;
};

}  // namespace lily::text
