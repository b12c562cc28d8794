#include "text/chat_template.h"

#include "core/error.h"
#include "core/mapped_file.h"

namespace lily::text {
namespace {

using json = nlohmann::ordered_json;

const char* kind_name(const json& j) {
  switch (j.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float: return "a number";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return "binary data";
  }
}

[[noreturn]] void bad(const std::string& path, const std::string& msg) {
  fail("invalid chat request: ", path, ": ", msg);
}

const std::string& need_string(const json& j, const std::string& path) {
  if (!j.is_string()) bad(path, std::string("expected a string, got ") + kind_name(j));
  return j.get_ref<const std::string&>();
}

// Content as one string: a string, null (""), or text parts concatenated.
std::string content_text(const json& content, const std::string& path) {
  if (content.is_null()) return "";
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array())
    bad(path, std::string("expected a string or an array of content parts, got ") + kind_name(content));
  std::string out;
  for (size_t j = 0; j < content.size(); ++j) {
    const json& part = content[j];
    std::string ppath = path + "[" + std::to_string(j) + "]";
    if (!part.is_object()) bad(ppath, std::string("expected a content part object, got ") + kind_name(part));
    auto type = part.find("type");
    if (type == part.end()) bad(ppath + ".type", "missing");
    const std::string& t = need_string(*type, ppath + ".type");
    if (t != "text") bad(ppath + ".type", "unsupported content part type '" + t + "' (only 'text' is supported)");
    auto text = part.find("text");
    if (text == part.end()) bad(ppath + ".text", "missing");
    out += need_string(*text, ppath + ".text");
  }
  return out;
}

json map_tool_call(const json& call, const std::string& path) {
  if (!call.is_object()) bad(path, std::string("expected an object, got ") + kind_name(call));
  json out = json::object();
  if (auto id = call.find("id"); id != call.end() && !id->is_null()) out["id"] = need_string(*id, path + ".id");
  if (auto type = call.find("type"); type != call.end() && !type->is_null()) {
    const std::string& t = need_string(*type, path + ".type");
    if (t != "function") bad(path + ".type", "expected \"function\", got \"" + t + "\"");
  }
  out["type"] = "function";
  auto fn = call.find("function");
  if (fn == call.end()) bad(path + ".function", "missing");
  if (!fn->is_object()) bad(path + ".function", std::string("expected an object, got ") + kind_name(*fn));
  json f = json::object();
  auto name = fn->find("name");
  if (name == fn->end()) bad(path + ".function.name", "missing");
  f["name"] = need_string(*name, path + ".function.name");
  std::string apath = path + ".function.arguments";
  auto args = fn->find("arguments");
  json parsed = json::object();
  if (args != fn->end() && !args->is_null()) {
    if (args->is_object()) {
      parsed = *args;
    } else if (args->is_string()) {
      const std::string& text = args->get_ref<const std::string&>();
      if (text.find_first_not_of(" \t\r\n") != std::string::npos) {
        try {
          parsed = json::parse(text);
        } catch (const json::parse_error& e) {
          bad(apath, std::string("not valid JSON: ") + e.what());
        }
        if (!parsed.is_object())
          bad(apath, std::string("must encode a JSON object, got ") + kind_name(parsed));
      }
    } else {
      bad(apath, std::string("expected a JSON string, got ") + kind_name(*args));
    }
  }
  f["arguments"] = std::move(parsed);
  out["function"] = std::move(f);
  return out;
}

json map_message(const json& m, const std::string& path) {
  if (!m.is_object()) bad(path, std::string("expected a message object, got ") + kind_name(m));
  auto role_it = m.find("role");
  if (role_it == m.end()) bad(path + ".role", "missing");
  std::string role = need_string(*role_it, path + ".role");
  if (role == "developer") role = "system";
  if (role != "system" && role != "user" && role != "assistant" && role != "tool")
    bad(path + ".role", "expected one of system, developer, user, assistant, tool; got \"" + role + "\"");
  json out = json::object();
  out["role"] = role;
  auto content = m.find("content");
  if (content == m.end() && role != "assistant") bad(path + ".content", "missing");
  out["content"] = content == m.end() ? std::string() : content_text(*content, path + ".content");
  if (auto name = m.find("name"); name != m.end() && !name->is_null()) out["name"] = need_string(*name, path + ".name");

  auto reasoning = m.find("reasoning_content");
  std::string rpath = path + ".reasoning_content";
  if (reasoning == m.end() || reasoning->is_null()) {
    reasoning = m.find("reasoning");
    rpath = path + ".reasoning";
  }
  auto tool_calls = m.find("tool_calls");
  if (role == "assistant") {
    if (reasoning != m.end() && !reasoning->is_null()) out["reasoning_content"] = need_string(*reasoning, rpath);
    if (tool_calls != m.end() && !tool_calls->is_null()) {
      if (!tool_calls->is_array())
        bad(path + ".tool_calls", std::string("expected an array, got ") + kind_name(*tool_calls));
      if (!tool_calls->empty()) {
        json calls = json::array();
        for (size_t k = 0; k < tool_calls->size(); ++k)
          calls.push_back(map_tool_call((*tool_calls)[k], path + ".tool_calls[" + std::to_string(k) + "]"));
        out["tool_calls"] = std::move(calls);
      }
    }
  } else if (tool_calls != m.end() && !tool_calls->is_null()) {
    bad(path + ".tool_calls", "only assistant messages may have tool_calls");
  }
  if (role == "tool") {
    if (auto id = m.find("tool_call_id"); id != m.end() && !id->is_null())
      out["tool_call_id"] = need_string(*id, path + ".tool_call_id");
  }
  return out;
}

json validate_tools(const json& tools) {
  if (tools.is_null()) return nullptr;
  if (!tools.is_array()) bad("tools", std::string("expected an array, got ") + kind_name(tools));
  for (size_t i = 0; i < tools.size(); ++i) {
    const json& t = tools[i];
    std::string path = "tools[" + std::to_string(i) + "]";
    if (!t.is_object()) bad(path, std::string("expected an object, got ") + kind_name(t));
    auto type = t.find("type");
    if (type == t.end()) bad(path + ".type", "missing");
    const std::string& ty = need_string(*type, path + ".type");
    if (ty != "function") bad(path + ".type", "expected \"function\", got \"" + ty + "\"");
    auto fn = t.find("function");
    if (fn == t.end()) bad(path + ".function", "missing");
    if (!fn->is_object()) bad(path + ".function", std::string("expected an object, got ") + kind_name(*fn));
    auto name = fn->find("name");
    if (name == fn->end()) bad(path + ".function.name", "missing");
    need_string(*name, path + ".function.name");
    if (auto d = fn->find("description"); d != fn->end() && !d->is_null()) need_string(*d, path + ".function.description");
    if (auto p = fn->find("parameters"); p != fn->end() && !p->is_null() && !p->is_object())
      bad(path + ".function.parameters", std::string("expected an object, got ") + kind_name(*p));
  }
  return tools;
}

std::string join_path(const std::string& dir, const std::string& file) {
  if (dir.empty()) return file;
  return dir.back() == '/' ? dir + file : dir + "/" + file;
}

json parse_json_file(const std::string& path) {
  std::string text = read_text_file(path);
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    fail(path, ": invalid JSON: ", e.what());
  }
}

}  // namespace

ChatInputs from_openai_request(const nlohmann::ordered_json& body) {
  if (!body.is_object()) bad("body", std::string("expected a JSON object, got ") + kind_name(body));
  ChatInputs in;
  auto messages = body.find("messages");
  if (messages == body.end()) bad("messages", "missing");
  if (!messages->is_array()) bad("messages", std::string("expected an array, got ") + kind_name(*messages));
  if (messages->empty()) bad("messages", "must not be empty");
  for (size_t i = 0; i < messages->size(); ++i)
    in.messages.push_back(map_message((*messages)[i], "messages[" + std::to_string(i) + "]"));
  if (auto tools = body.find("tools"); tools != body.end()) in.tools = validate_tools(*tools);
  if (auto kw = body.find("chat_template_kwargs"); kw != body.end() && !kw->is_null()) {
    if (!kw->is_object()) bad("chat_template_kwargs", std::string("expected an object, got ") + kind_name(*kw));
    in.template_kwargs = *kw;
  }
  if (auto agp = body.find("add_generation_prompt"); agp != body.end() && !agp->is_null()) {
    if (!agp->is_boolean()) bad("add_generation_prompt", std::string("expected a boolean, got ") + kind_name(*agp));
    in.add_generation_prompt = agp->get<bool>();
  }
  return in;
}

ChatTemplate::ChatTemplate(std::string source, nlohmann::ordered_json special_tokens, std::string name)
    : source_(std::move(source)),
      special_tokens_(special_tokens.is_object() ? std::move(special_tokens) : json::object()),
      template_(source_, std::move(name)) {}

ChatTemplate ChatTemplate::from_model_dir(const std::string& dir) {
  const std::string jinja_path = join_path(dir, "chat_template.jinja");
  const std::string config_path = join_path(dir, "tokenizer_config.json");
  const std::string json_path = join_path(dir, "chat_template.json");
  json config = file_exists(config_path) ? parse_json_file(config_path) : json::object();
  if (!config.is_object()) fail(config_path, ": expected a JSON object");

  json special = json::object();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"}) {
    auto it = config.find(key);
    if (it == config.end() || it->is_null()) continue;
    if (it->is_string()) {
      special[key] = *it;
    } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
      special[key] = (*it)["content"];
    } else {
      fail(config_path, ": field ", key, ": expected a string or {\"content\": string}");
    }
  }

  if (file_exists(jinja_path)) return ChatTemplate(read_text_file(jinja_path), special, jinja_path);

  auto tmpl = config.find("chat_template");
  if (tmpl != config.end() && !tmpl->is_null()) {
    if (tmpl->is_string()) return ChatTemplate(tmpl->get<std::string>(), special, config_path + ": chat_template");
    if (tmpl->is_array()) {
      for (size_t i = 0; i < tmpl->size(); ++i) {
        const json& entry = (*tmpl)[i];
        if (!entry.is_object() || !entry.contains("name") || !entry.contains("template") ||
            !entry["name"].is_string() || !entry["template"].is_string())
          fail(config_path, ": field chat_template[", i, "]: expected {\"name\": string, \"template\": string}");
        if (entry["name"] == "default")
          return ChatTemplate(entry["template"].get<std::string>(), special, config_path + ": chat_template[default]");
      }
      fail(config_path, ": field chat_template: no template named \"default\"");
    }
    fail(config_path, ": field chat_template: expected a string or a list of named templates");
  }
  if (file_exists(json_path)) {
    json j = parse_json_file(json_path);
    if (!j.is_object() || !j.contains("chat_template") || !j["chat_template"].is_string())
      fail(json_path, ": expected {\"chat_template\": string}");
    return ChatTemplate(j["chat_template"].get<std::string>(), special, json_path);
  }
  fail(dir, ": no chat template (looked for chat_template.jinja, the chat_template field of "
            "tokenizer_config.json, and chat_template.json)");
}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                 bool add_generation_prompt, const nlohmann::ordered_json& extra_kwargs) const {
  if (!messages.is_array()) fail("chat template: messages must be an array, got ", kind_name(messages));
  if (!tools.is_null() && !tools.is_array()) fail("chat template: tools must be null or an array, got ", kind_name(tools));
  if (!extra_kwargs.is_null() && !extra_kwargs.is_object())
    fail("chat template: chat_template_kwargs must be an object, got ", kind_name(extra_kwargs));
  json vars = special_tokens_;
  if (extra_kwargs.is_object()) {
    for (const auto& [k, v] : extra_kwargs.items()) {
      if (k == "messages" || k == "tools" || k == "add_generation_prompt")
        fail("chat_template_kwargs.", k, ": reserved; pass it as a request parameter instead");
      vars[k] = v;
    }
  }
  vars["messages"] = messages;
  vars["tools"] = tools;
  vars["add_generation_prompt"] = add_generation_prompt;
  return template_.render(vars);
}

std::string ChatTemplate::render(const ChatInputs& inputs) const {
  return render(inputs.messages, inputs.tools, inputs.add_generation_prompt, inputs.template_kwargs);
}

std::string ChatTemplate::bos_token() const {
  auto it = special_tokens_.find("bos_token");
  return it != special_tokens_.end() && it->is_string() ? it->get<std::string>() : std::string();
}

std::string ChatTemplate::eos_token() const {
  auto it = special_tokens_.find("eos_token");
  return it != special_tokens_.end() && it->is_string() ? it->get<std::string>() : std::string();
}

}  // namespace lily::text
