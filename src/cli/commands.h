#pragma once

namespace lily::cli {

// Each returns the process exit code; errors are thrown as lily::Error.
int cmd_logits(int argc, char** argv);
int cmd_generate(int argc, char** argv);
int cmd_info(int argc, char** argv);
int cmd_tokenize(int argc, char** argv);
int cmd_detokenize(int argc, char** argv);
int cmd_template(int argc, char** argv);
int cmd_run(int argc, char** argv);
int cmd_chat(int argc, char** argv);
int cmd_bench(int argc, char** argv);
int cmd_serve(int argc, char** argv);  // serve_command.cpp

}  // namespace lily::cli
