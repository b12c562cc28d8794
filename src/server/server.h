// The OpenAI-compatible HTTP server (cpp-httplib underneath):
//
//   POST /v1/chat/completions   POST /v1/completions   GET /v1/models[/ID]
//   GET /health                 GET /metrics (Prometheus text)
//
// HTTP threads parse and validate requests, render and tokenize prompts, and
// write responses; one engine thread runs the generations in FIFO order
// (scheduler.h). See docs/server.md for the API surface.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "server/api.h"
#include "server/metrics.h"
#include "server/served_model.h"

namespace lily::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;      // 0: any free port (see Server::bind)
  std::string api_key;  // non-empty: /v1/* need "Authorization: Bearer KEY"
  size_t max_body_bytes = size_t{8} << 20;
  int http_threads = 64;        // concurrent connections served at once
  size_t max_queue = 256;       // requests waiting for the engine before 503
  size_t stream_buffer = 1024;  // events buffered per request before it is cancelled
  // Model states kept between requests (engine/prefix_cache.h); 0 keeps
  // only the live conversation.
  size_t prefix_cache_bytes = size_t{1} << 30;
  int prefix_cache_entries = 32;
  // Speculative decoding by prompt lookup (engine::Generator): the most
  // tokens drafted per step; 0: off.
  int speculative_tokens = 0;
  Limits limits;
  bool log_requests = true;  // one line per request on stderr
};

class Server {
 public:
  // `model` must outlive the server. Starts the engine thread.
  Server(ServedModel& model, ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the listening socket; returns the port (the chosen one for port 0).
  // Throws lily::Error if the address cannot be bound.
  int bind();
  // Serves until stop(); returns once every connection and the engine thread
  // are finished. bind() first.
  void run();
  // Stops: new requests get 503, running and queued generations are
  // cancelled (streams end with an error event), the listener closes and
  // run() returns. Thread-safe, idempotent; not async-signal-safe (call it
  // from a signal-watching thread).
  void stop();

  Metrics& metrics();
  const ServerOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lily::server
