#pragma once

namespace lily::cli {

// Each returns the process exit code; errors are thrown as lily::Error.
int cmd_logits(int argc, char** argv);
int cmd_generate(int argc, char** argv);
int cmd_info(int argc, char** argv);

}  // namespace lily::cli
