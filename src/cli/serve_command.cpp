// lily serve: the OpenAI-compatible HTTP server (src/server/).
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/model_paths.h"
#include "core/error.h"
#include "core/mapped_file.h"
#include "server/server.h"

namespace lily::cli {

int cmd_serve(int argc, char** argv) {
  Args a(argc, argv,
         {"--model", "--tokenizer", "--host", "--port", "--api-key", "--ctx", "--max-body",
          "--max-tokens-limit", "--backend", "--threads", "--kv-cache", "--cpu-act", "--quantize", "--http-threads", "--max-queue",
          "--stream-buffer", "--prefix-cache", "--prefix-cache-entries", "--speculative"},
         {"--quiet"});
  auto say = [](const std::string& s) {
    std::fprintf(stderr, "lily serve: %s\n", s.c_str());
    std::fflush(stderr);
  };

  server::ModelLoadOptions lo = model_load_options(a);
  lo.progress = say;

  server::ServerOptions so;
  so.host = a.str("--host", "127.0.0.1");
  so.port = static_cast<int>(a.integer("--port", 8080, 0, 65535));
  so.api_key = a.str("--api-key");
  if (so.api_key.empty())
    if (const char* k = std::getenv("LILY_API_KEY")) so.api_key = k;
  so.max_body_bytes = static_cast<size_t>(a.integer("--max-body", 8 << 20, 1024, 1LL << 34));
  so.http_threads = static_cast<int>(a.integer("--http-threads", 64, 4, 4096));
  so.max_queue = static_cast<size_t>(a.integer("--max-queue", 256, 1, 1 << 20));
  so.stream_buffer = static_cast<size_t>(a.integer("--stream-buffer", 1024, 16, 1 << 24));
  so.prefix_cache_bytes = static_cast<size_t>(a.integer("--prefix-cache", 1024, 0, 1 << 24)) << 20;
  so.prefix_cache_entries = static_cast<int>(a.integer("--prefix-cache-entries", 32, 0, 4096));
  so.speculative_tokens = static_cast<int>(a.integer("--speculative", so.speculative_tokens, 0, 16));
  so.log_requests = !a.has("--quiet");

  // Signals go to one watcher thread: block them before any thread starts.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  server::ServedModel model = server::load_served_model(lo);
  const int model_ctx = model.backend->config().max_position_embeddings;
  const long long ctx_default = model_ctx > 0 ? std::min(model_ctx, 4096) : 4096;
  so.limits.context =
      static_cast<int>(a.integer("--ctx", ctx_default, 16, model_ctx > 0 ? model_ctx : 1 << 24));
  so.limits.max_tokens_limit =
      static_cast<int>(a.integer("--max-tokens-limit", so.limits.context, 1, so.limits.context));

  server::Server srv(model, so);
  const int port = srv.bind();
  say(str_cat("model '", model.id, "' ready: context ", so.limits.context,
              " tokens, max_tokens <= ", so.limits.max_tokens_limit,
              so.api_key.empty() ? "" : ", API key required"));
  say(str_cat("listening on http://", so.host, ":", port));

  std::atomic<bool> done{false};
  std::thread watcher([&] {
    timespec ts{0, 200 * 1000 * 1000};
    while (!done) {
      int sig = sigtimedwait(&sigs, nullptr, &ts);
      if (sig == SIGINT || sig == SIGTERM) {
        say(str_cat("received ", sig == SIGINT ? "SIGINT" : "SIGTERM", ", shutting down"));
        srv.stop();
        return;
      }
    }
  });
  srv.run();
  done = true;
  watcher.join();
  say("stopped");
  return 0;
}

}  // namespace lily::cli
