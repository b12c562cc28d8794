// lily: one binary, one subcommand per job.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "cli/commands.h"
#include "core/error.h"

namespace {

const char kUsage[] =
    "usage: lily <command> [options]\n"
    "\n"
    "commands:\n"
    "  logits    --model DIR --tokens 1,2,3 [--prefill N]   logits at every position (JSON)\n"
    "  generate  --model DIR --tokens 1,2,3 --max-tokens K  greedy continuation (JSON)\n"
    "  info      --model DIR                                 architecture, parameters, storage\n"
    "  tokenize    [--model DIR] --text STR [--no-special]    {\"tokens\": [...]}\n"
    "  detokenize  [--model DIR] --tokens 1,2 [--skip-special] {\"text\": \"...\"}\n"
    "  template    [--model DIR] --request FILE   chat request -> {\"prompt\", \"tokens\"}\n"
    "  run         [--model DIR] [--no-think] [--max-tokens N] [--temperature T] \"prompt\"\n"
    "              [--json-schema FILE | --json] [--speculative N]   stream one reply (JSON of the schema)\n"
    "  chat        [--model DIR] [--system TEXT] [--no-think]   interactive conversation\n"
    "  bench     --synthetic NAME | --model DIR [--ctx 256,4096] [--prefill 4096,...] [--reuse 512,...] [--draft 2,5] [--json F]\n"
    "            [--generate N [--temperature T] [--top-k K] [--top-p P] [--min-p M] [--seed S]\n"
    "             [--json-object [--tokenizer DIR]] [--logprobs K]]\n"
    "            decode tok/s, GB/s; prefill tok/s, time to first token; draft run cost;\n"
    "            --generate: tok/s of N tokens through the generator (host sampling) against the backend's loop\n"
    "  serve     [--model DIR] [--host H] [--port P] [--api-key KEY] [--ctx N]\n"
    "            [--max-body BYTES] [--max-tokens-limit N] [--tokenizer DIR] [--prefix-cache MIB]\n"
    "            [--speculative N]  (draft up to N tokens by prompt lookup; docs/speculative.md)\n"
    "                                 OpenAI-compatible HTTP server (docs/server.md)\n"
    "\n"
    "common options: --backend cpu|cuda|auto, --threads N, --cpu-act auto|f32|q16|q8 (cpu inputs to 4/8-bit weights)\n";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") ||
      !std::strcmp(argv[1], "help")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  try {
    using namespace lily::cli;
    if (cmd == "logits") return cmd_logits(argc - 2, argv + 2);
    if (cmd == "generate") return cmd_generate(argc - 2, argv + 2);
    if (cmd == "info") return cmd_info(argc - 2, argv + 2);
    if (cmd == "tokenize") return cmd_tokenize(argc - 2, argv + 2);
    if (cmd == "detokenize") return cmd_detokenize(argc - 2, argv + 2);
    if (cmd == "template") return cmd_template(argc - 2, argv + 2);
    if (cmd == "run") return cmd_run(argc - 2, argv + 2);
    if (cmd == "chat") return cmd_chat(argc - 2, argv + 2);
    if (cmd == "bench") return cmd_bench(argc - 2, argv + 2);
    if (cmd == "serve") return cmd_serve(argc - 2, argv + 2);
    std::fprintf(stderr, "lily: unknown command '%s' (try lily --help)\n", cmd.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    for (char& c : msg)
      if (c == '\n') c = ' ';
    std::fprintf(stderr, "lily %s: error: %s\n", cmd.c_str(), msg.c_str());
    return 1;
  }
}
