#include "cli/model_paths.h"

#include <unistd.h>

#include <cstdio>

#include "core/error.h"
#include "core/mapped_file.h"

namespace lily::cli {

namespace {

// The source tree: this file's path minus "src/cli/model_paths.cpp" (CMake
// compiles sources by absolute path).
std::string source_root() {
  std::string f = __FILE__;
  const std::string tail = "src/cli/model_paths.cpp";
  if (f.size() >= tail.size() && f.compare(f.size() - tail.size(), tail.size(), tail) == 0)
    return f.substr(0, f.size() - tail.size());
  return "";
}

// The directory of the running executable, with a trailing '/'.
std::string exe_dir() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "";
  std::string p(buf, static_cast<size_t>(n));
  auto slash = p.rfind('/');
  return slash == std::string::npos ? "" : p.substr(0, slash + 1);
}

}  // namespace

std::string bundled_fixture(const std::string& name) {
  const std::string exe = exe_dir();
  for (const std::string& root : {source_root(), exe.empty() ? "" : exe + "../",
                                  exe.empty() ? "" : exe + "../../"}) {
    if (root.empty()) continue;
    const std::string dir = root + "tests/fixtures/" + name;
    if (file_exists(dir + "/config.json") || file_exists(dir + "/tokenizer.json")) return dir;
  }
  return "";
}

server::ModelLoadOptions model_load_options(const Args& a) {
  server::ModelLoadOptions lo;
  lo.model_dir = a.str("--model");
  lo.tokenizer_dir = a.str("--tokenizer");
  if (lo.model_dir.empty()) {
    lo.model_dir = bundled_fixture("qwen3-chat-tiny");
    if (lo.model_dir.empty())
      fail("no --model given and the bundled tiny model (tests/fixtures/qwen3-chat-tiny) was not found");
    std::fprintf(stderr, "lily: no --model given: using the bundled tiny test model %s\n",
                 lo.model_dir.c_str());
  }
  if (lo.tokenizer_dir.empty()) lo.tokenizer_dir = bundled_fixture("tokenizer");
  lo.backend.kind = a.str("--backend", "auto");
  lo.backend.threads = static_cast<int>(a.integer("--threads", 0, 0, 1024));
  lo.backend.kv_cache = a.str("--kv-cache");
  lo.backend.cpu_act = a.str("--cpu-act", "auto");
  lo.quantize = a.str("--quantize");
  return lo;
}

}  // namespace lily::cli
