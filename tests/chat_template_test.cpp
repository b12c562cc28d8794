// Chat templates: the Qwen3 / Qwen3.5 / Qwen3.6 fixtures rendered byte for
// byte as transformers renders them, loading from a model directory, and the
// OpenAI request mapping.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"
#include "text/chat_template.h"

namespace {

using json = nlohmann::ordered_json;
using lily::text::ChatInputs;
using lily::text::ChatTemplate;
using lily::text::from_openai_request;

const std::string kFixtures = LILY_FIXTURES_DIR;

json load_json(const std::string& path) { return json::parse(lily::read_text_file(path)); }

// Renders every case of a fixture file and compares the text byte for byte.
void check_cases(const ChatTemplate& tmpl, const std::string& cases_file) {
  json cases = load_json(kFixtures + "/tokenizer/" + cases_file);
  ASSERT_TRUE(cases.is_array());
  ASSERT_FALSE(cases.empty());
  for (size_t i = 0; i < cases.size(); ++i) {
    const json& c = cases[i];
    json kwargs = json::object();
    kwargs["enable_thinking"] = c["enable_thinking"];
    std::string got = tmpl.render(c["messages"], c["tools"], c["add_generation_prompt"].get<bool>(), kwargs);
    EXPECT_EQ(got, c["text"].get<std::string>())
        << cases_file << " case " << i << " (" << c["name"].get<std::string>()
        << ", add_generation_prompt=" << c["add_generation_prompt"] << ", enable_thinking=" << c["enable_thinking"]
        << ")";
  }
}

std::string qwen3_template() {
  return load_json(kFixtures + "/tokenizer/tokenizer_config.json")["chat_template"].get<std::string>();
}

TEST(ChatTemplateFixtures, Qwen3FromTokenizerConfig) {
  ChatTemplate tmpl(qwen3_template());
  check_cases(tmpl, "chat.json");
}

TEST(ChatTemplateFixtures, Qwen3_5) {
  ChatTemplate tmpl(lily::read_text_file(kFixtures + "/tokenizer/qwen3_5_chat_template.jinja"));
  check_cases(tmpl, "chat_qwen3_5.json");
}

TEST(ChatTemplateFixtures, Qwen3_6) {
  ChatTemplate tmpl(lily::read_text_file(kFixtures + "/tokenizer/qwen3_6_chat_template.jinja"));
  check_cases(tmpl, "chat_qwen3_6.json");
}

// A fresh temporary model directory, removed afterwards.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("lily_chat_template_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string path() const { return path_.string(); }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name, std::ios::binary) << text;
  }

 private:
  std::filesystem::path path_;
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const lily::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a lily::Error";
  return "";
}

TEST(ChatTemplateLoad, FromModelDirTokenizerConfig) {
  ChatTemplate tmpl = ChatTemplate::from_model_dir(kFixtures + "/qwen3-chat-tiny");
  EXPECT_EQ(tmpl.source(), qwen3_template());
  EXPECT_EQ(tmpl.eos_token(), "<|im_end|>");
  EXPECT_EQ(tmpl.bos_token(), "");  // null in the config
  json msgs = json::parse(R"([{"role": "user", "content": "Hello!"}])");
  EXPECT_EQ(tmpl.render(msgs, nullptr, true), "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplateLoad, JinjaFileWinsAndSpecialTokensAreVariables) {
  TempDir dir;
  dir.write("tokenizer_config.json",
            R"({"chat_template": "from config", "bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": false}})");
  dir.write("chat_template.jinja", "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}\n");
  ChatTemplate tmpl = ChatTemplate::from_model_dir(dir.path());
  EXPECT_EQ(tmpl.bos_token(), "<s>");
  EXPECT_EQ(tmpl.eos_token(), "</s>");
  EXPECT_EQ(tmpl.render(json::parse(R"([{"role": "user", "content": "hi"}])"), nullptr, false), "<s>hi</s>");
}

TEST(ChatTemplateLoad, NamedTemplateList) {
  TempDir dir;
  dir.write("tokenizer_config.json",
            R"({"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages | length }} default"}]})");
  ChatTemplate tmpl = ChatTemplate::from_model_dir(dir.path());
  EXPECT_EQ(tmpl.render(json::array({json::object()}), nullptr, true), "1 default");

  TempDir no_default;
  no_default.write("tokenizer_config.json", R"({"chat_template": [{"name": "tool_use", "template": "x"}]})");
  EXPECT_EQ(error_of([&] { ChatTemplate::from_model_dir(no_default.path()); }),
            no_default.path() + "/tokenizer_config.json: field chat_template: no template named \"default\"");
}

TEST(ChatTemplateLoad, ErrorsNameTheFile) {
  TempDir empty;
  EXPECT_EQ(error_of([&] { ChatTemplate::from_model_dir(empty.path()); }),
            empty.path() +
                ": no chat template (looked for chat_template.jinja, the chat_template field of "
                "tokenizer_config.json, and chat_template.json)");
  TempDir broken;
  broken.write("chat_template.jinja", "line 1\n{% if x %}");
  EXPECT_EQ(error_of([&] { ChatTemplate::from_model_dir(broken.path()); }),
            broken.path() + "/chat_template.jinja:2: syntax error: unexpected end of template: 'if' opened on line 2 "
                            "needs 'elif' or 'else' or 'endif'");
  TempDir bad_json;
  bad_json.write("tokenizer_config.json", "{not json");
  EXPECT_NE(error_of([&] { ChatTemplate::from_model_dir(bad_json.path()); }).find("tokenizer_config.json: invalid JSON"),
            std::string::npos);
}

TEST(ChatTemplateRender, KwargsReachTheTemplate) {
  ChatTemplate tmpl(lily::read_text_file(kFixtures + "/tokenizer/qwen3_6_chat_template.jinja"));
  json msgs = json::parse(R"([
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "add them"},
    {"role": "user", "content": "and 3+3?"}])");
  std::string plain = tmpl.render(msgs, nullptr, true, json::object());
  std::string preserved = tmpl.render(msgs, nullptr, true, json{{"preserve_thinking", true}});
  EXPECT_EQ(plain.find("add them"), std::string::npos);
  EXPECT_NE(preserved.find("<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>"), std::string::npos);
  EXPECT_EQ(error_of([&] { tmpl.render(msgs, nullptr, true, json{{"messages", json::array()}}); }),
            "chat_template_kwargs.messages: reserved; pass it as a request parameter instead");
  // The template's own raise_exception reaches the caller.
  EXPECT_EQ(error_of([&] { tmpl.render(json::array(), nullptr, true); }),
            "chat template:43: raise_exception: No messages provided.");
}

// ---------------------------------------------------------------- OpenAI mapping

TEST(ChatTemplateOpenAI, ArgumentsStringBecomesAnObject) {
  json body = json::parse(R"({
    "model": "x",
    "messages": [
      {"role": "developer", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
      {"role": "assistant", "content": null, "reasoning_content": "need a tool",
       "tool_calls": [{"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21}"}
    ],
    "chat_template_kwargs": {"enable_thinking": false}
  })");
  ChatInputs in = from_openai_request(body);
  EXPECT_TRUE(in.add_generation_prompt);
  EXPECT_TRUE(in.tools.is_null());
  EXPECT_EQ(in.template_kwargs, json::parse(R"({"enable_thinking": false})"));
  EXPECT_EQ(in.messages, json::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "need a tool",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
    {"role": "tool", "content": "{\"temp_c\": 21}", "tool_call_id": "call_1"}])"));
  // Arguments keep their order; an empty string means no arguments.
  json args = in.messages[2]["tool_calls"][0]["function"]["arguments"];
  EXPECT_EQ(args.dump(), R"({"city":"Paris","days":2})");
  json empty_args = json::parse(R"({"messages": [{"role": "assistant", "content": "",
      "tool_calls": [{"function": {"name": "now", "arguments": ""}}]}]})");
  EXPECT_EQ(from_openai_request(empty_args).messages[0]["tool_calls"][0]["function"]["arguments"], json::object());
}

// The fixture conversations, sent as OpenAI requests (arguments as JSON
// strings), render exactly as transformers rendered them.
TEST(ChatTemplateOpenAI, RequestsRenderLikeTheFixtures) {
  struct Case {
    const char* cases;
    std::string source;
  };
  std::vector<Case> all = {
      {"chat.json", qwen3_template()},
      {"chat_qwen3_5.json", lily::read_text_file(kFixtures + "/tokenizer/qwen3_5_chat_template.jinja")},
      {"chat_qwen3_6.json", lily::read_text_file(kFixtures + "/tokenizer/qwen3_6_chat_template.jinja")},
  };
  for (const Case& c : all) {
    ChatTemplate tmpl(c.source);
    json cases = load_json(kFixtures + "/tokenizer/" + c.cases);
    for (const json& fx : cases) {
      json body = json::object();
      body["messages"] = fx["messages"];
      for (json& m : body["messages"])
        if (m.contains("tool_calls"))
          for (json& call : m["tool_calls"]) call["function"]["arguments"] = call["function"]["arguments"].dump();
      body["tools"] = fx["tools"];
      body["add_generation_prompt"] = fx["add_generation_prompt"];
      body["chat_template_kwargs"] = json{{"enable_thinking", fx["enable_thinking"]}};
      EXPECT_EQ(tmpl.render(from_openai_request(body)), fx["text"].get<std::string>())
          << c.cases << " " << fx["name"].get<std::string>();
    }
  }
}

TEST(ChatTemplateOpenAI, ErrorsNameTheParameter) {
  auto err = [](const std::string& body) { return error_of([&] { from_openai_request(json::parse(body)); }); };
  EXPECT_EQ(err(R"([])"), "invalid chat request: body: expected a JSON object, got an array");
  EXPECT_EQ(err(R"({})"), "invalid chat request: messages: missing");
  EXPECT_EQ(err(R"({"messages": []})"), "invalid chat request: messages: must not be empty");
  EXPECT_EQ(err(R"({"messages": "hi"})"), "invalid chat request: messages: expected an array, got a string");
  EXPECT_EQ(err(R"({"messages": [{"role": "user", "content": "a"}, 3]})"),
            "invalid chat request: messages[1]: expected a message object, got a number");
  EXPECT_EQ(err(R"({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                 {"role": "robot", "content": "c"}]})"),
            "invalid chat request: messages[2].role: expected one of system, developer, user, assistant, tool; "
            "got \"robot\"");
  EXPECT_EQ(err(R"({"messages": [{"role": 5, "content": "a"}]})"),
            "invalid chat request: messages[0].role: expected a string, got a number");
  EXPECT_EQ(err(R"({"messages": [{"content": "a"}]})"), "invalid chat request: messages[0].role: missing");
  EXPECT_EQ(err(R"({"messages": [{"role": "user"}]})"), "invalid chat request: messages[0].content: missing");
  EXPECT_EQ(err(R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                 {"type": "image_url", "image_url": {"url": "x"}}]}]})"),
            "invalid chat request: messages[0].content[1].type: unsupported content part type 'image_url' (only "
            "'text' is supported)");
  EXPECT_EQ(err(R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})"),
            "invalid chat request: messages[0].content[0].text: missing");
  EXPECT_EQ(err(R"({"messages": [{"role": "user", "content": {"text": "a"}}]})"),
            "invalid chat request: messages[0].content: expected a string or an array of content parts, got an object");
  EXPECT_EQ(err(R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
      "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{\"city\": "}}]}]})")
                .rfind("invalid chat request: messages[1].tool_calls[0].function.arguments: not valid JSON: ", 0),
            0u);
  EXPECT_EQ(err(R"({"messages": [{"role": "assistant", "content": "",
      "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}]})"),
            "invalid chat request: messages[0].tool_calls[0].function.arguments: must encode a JSON object, got an "
            "array");
  EXPECT_EQ(err(R"({"messages": [{"role": "assistant", "content": "",
      "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]})"),
            "invalid chat request: messages[0].tool_calls[0].function.arguments: expected a JSON string, got a number");
  EXPECT_EQ(err(R"({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"type": "code"}]}]})"),
            "invalid chat request: messages[0].tool_calls[0].type: expected \"function\", got \"code\"");
  EXPECT_EQ(err(R"({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]})"),
            "invalid chat request: messages[0].tool_calls[0].function.name: missing");
  EXPECT_EQ(err(R"({"messages": [{"role": "user", "content": "", "tool_calls": []}]})"),
            "invalid chat request: messages[0].tool_calls: only assistant messages may have tool_calls");
  EXPECT_EQ(err(R"({"messages": [{"role": "tool", "content": "", "tool_call_id": 7}]})"),
            "invalid chat request: messages[0].tool_call_id: expected a string, got a number");
  EXPECT_EQ(err(R"({"messages": [{"role": "assistant", "content": "", "reasoning_content": 1}]})"),
            "invalid chat request: messages[0].reasoning_content: expected a string, got a number");
  EXPECT_EQ(err(R"({"messages": [{"role": "user", "content": "a"}], "tools": {}})"),
            "invalid chat request: tools: expected an array, got an object");
  EXPECT_EQ(err(R"({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {}}]})"),
            "invalid chat request: tools[0].function.name: missing");
  EXPECT_EQ(err(R"({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "retrieval"}]})"),
            "invalid chat request: tools[0].type: expected \"function\", got \"retrieval\"");
  EXPECT_EQ(err(R"({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": [1]})"),
            "invalid chat request: chat_template_kwargs: expected an object, got an array");
  EXPECT_EQ(err(R"({"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": "yes"})"),
            "invalid chat request: add_generation_prompt: expected a boolean, got a string");
}

}  // namespace
