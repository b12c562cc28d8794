#include "server/server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <set>
#include <thread>

#include "core/error.h"
#include "engine/generator.h"
#include "server/responses.h"
#include "server/scheduler.h"

namespace lily::server {

namespace {

using Clock = std::chrono::steady_clock;

// What the request log line and the metrics need, filled by the handler (and
// the stream provider, which runs on the same HTTP thread) and read by the
// logger that httplib calls once the response is written.
struct RequestStats {
  Clock::time_point start{};
  bool generation = false;
  int prompt = 0, cached = 0, completion = 0, drafted = 0, accepted = 0;
  double ttft = -1, tok_per_s = -1;
  std::string finish;
};
thread_local RequestStats tl_stats;

// The request's choices (n > 1: one builder each): the first's prompt and
// time to its first token, every choice's tokens; the decode rate over the
// choices' decode time, as they run one after another.
template <class Builders>
void record_stats(const Builders& builders) {
  const auto& first = builders[0]->result();
  tl_stats.generation = true;
  tl_stats.prompt = first.prompt_tokens;
  tl_stats.cached = first.cached_tokens;
  tl_stats.completion = tl_stats.drafted = tl_stats.accepted = 0;
  int decoded = 0;
  double decode_s = 0;
  for (const auto& b : builders) {
    const auto& r = b->result();
    tl_stats.completion += r.completion_tokens;
    tl_stats.drafted += r.draft_tokens;
    tl_stats.accepted += r.accepted_tokens;
    if (r.completion_tokens > 1 && r.decode_seconds > 0) {
      decoded += r.completion_tokens - 1;
      decode_s += r.decode_seconds;
    }
  }
  if (first.completion_tokens > 0) tl_stats.ttft = builders[0]->queue_seconds() + first.prefill_seconds;
  if (decoded > 0) tl_stats.tok_per_s = decoded / decode_s;
  tl_stats.finish = engine::finish_reason_name(first.finish);
}

bool constant_time_equal(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

// The generator with the server's limits, before the engine thread starts.
engine::Generator& configured(engine::Generator& g, const ServerOptions& o) {
  g.set_prefix_cache(o.prefix_cache_bytes, o.prefix_cache_entries);
  g.speculative_tokens = o.speculative_tokens;
  return g;
}

// The options with the model's vocabulary size (for logit_bias ids).
ServerOptions with_vocab(ServerOptions o, const ServedModel& m) {
  o.limits.vocab_size = m.backend->config().vocab_size;
  return o;
}

}  // namespace

struct Server::Impl {
  Impl(ServedModel& m, ServerOptions o)
      : model(m),
        opt(with_vocab(std::move(o), m)),
        generator(*m.backend, *m.tokenizer, opt.limits.context),
        scheduler(configured(generator, opt), metrics, opt.max_queue) {}

  ServedModel& model;
  ServerOptions opt;
  Metrics metrics;
  engine::Generator generator;
  Scheduler scheduler;
  httplib::Server http;
  int listen_fd = -1;
  std::atomic<bool> stopping{false};
  std::atomic<bool> running{false};
  std::mutex stop_mu;

  void setup_routes();
  void check_auth(const httplib::Request& req) const;
  void send_error(httplib::Response& res, const ApiError& e) const;
  void handle_chat(const httplib::Request& req, httplib::Response& res);
  void handle_completion(const httplib::Request& req, httplib::Response& res);
  void handle_models(const httplib::Request& req, httplib::Response& res);
  ojson model_card() const;
  void log_request(const httplib::Request& req, const httplib::Response& res);

  // Answers with n choices (jobs[i] feeding builders[i]): one body, or one
  // stream whose chunks carry each choice's index.
  template <class Builder>
  void respond(httplib::Response& res, const std::vector<std::shared_ptr<Job>>& jobs,
               const std::vector<std::shared_ptr<Builder>>& builders, bool stream);
  std::shared_ptr<Job> submit(engine::GenerationParams params);
  // n jobs of one request (choice i: seed + i when seeded); all or none.
  std::vector<std::shared_ptr<Job>> submit_n(engine::GenerationParams params, int n);
};

void Server::Impl::send_error(httplib::Response& res, const ApiError& e) const {
  res.status = e.status;
  res.set_content(error_body(e).dump(-1, ' ', false, kReplaceInvalidUtf8), "application/json");
}

void Server::Impl::check_auth(const httplib::Request& req) const {
  if (opt.api_key.empty()) return;
  const std::string h = req.get_header_value("Authorization");
  static const std::string bearer = "Bearer ";
  if (h.empty())
    throw ApiError(401, "invalid_request_error",
                   "You didn't provide an API key. Provide it in the Authorization header "
                   "(Authorization: Bearer YOUR_KEY).",
                   "", "missing_api_key");
  if (h.size() < bearer.size() ||
      !std::equal(bearer.begin(), bearer.end(), h.begin(),
                  [](char a, char b) {
                    return std::tolower(static_cast<unsigned char>(a)) ==
                           std::tolower(static_cast<unsigned char>(b));
                  }) ||
      !constant_time_equal(h.substr(bearer.size()), opt.api_key))
    throw ApiError(401, "invalid_request_error", "Incorrect API key provided.", "",
                   "invalid_api_key");
}

ojson Server::Impl::model_card() const {
  ojson m;
  m["id"] = model.id;
  m["object"] = "model";
  m["created"] = model.created;
  m["owned_by"] = "lily";
  m["max_model_len"] = opt.limits.context;
  return m;
}

void Server::Impl::handle_models(const httplib::Request& req, httplib::Response& res) {
  check_auth(req);
  if (req.matches.size() > 1) {
    const std::string id = req.matches[1];
    if (id != model.id)
      throw ApiError(
          404, "invalid_request_error",
          "The model '" + id + "' does not exist; this server serves '" + model.id + "'.", "model",
          "model_not_found");
    res.set_content(model_card().dump(-1, ' ', false, kReplaceInvalidUtf8), "application/json");
    return;
  }
  ojson list;
  list["object"] = "list";
  list["data"] = ojson::array({model_card()});
  res.set_content(list.dump(-1, ' ', false, kReplaceInvalidUtf8), "application/json");
}

std::shared_ptr<Job> Server::Impl::submit(engine::GenerationParams params) {
  auto job = std::make_shared<Job>(std::move(params), opt.stream_buffer);
  if (stopping || !scheduler.submit(job)) {
    if (stopping)
      throw ApiError(503, error_type_for_status(503), "The server is shutting down.", "",
                     "server_shutting_down");
    throw ApiError(503, error_type_for_status(503),
                   str_cat("The server is busy: ", opt.max_queue,
                           " requests are already waiting. Retry later."),
                   "", "queue_full");
  }
  return job;
}

std::vector<std::shared_ptr<Job>> Server::Impl::submit_n(engine::GenerationParams params, int n) {
  std::vector<std::shared_ptr<Job>> jobs;
  try {
    for (int i = 0; i < n; ++i) {
      engine::GenerationParams p = params;
      if (p.sampling.has_seed) p.sampling.seed += static_cast<uint64_t>(i);
      jobs.push_back(submit(std::move(p)));
    }
  } catch (...) {
    for (const auto& j : jobs) {
      j->cancel = true;
      j->events.close();
    }
    throw;
  }
  return jobs;
}

template <class Builder>
void Server::Impl::respond(httplib::Response& res, const std::vector<std::shared_ptr<Job>>& jobs,
                           const std::vector<std::shared_ptr<Builder>>& builders, bool stream) {
  // The choices' jobs run one after another; each pass waits on the first
  // unfinished one and takes whatever the others have.
  auto pump = [jobs, builders](std::chrono::milliseconds wait) {
    std::string out;
    std::vector<JobEvent> events;
    bool waited = false;
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (builders[i]->done()) continue;
      const auto w = waited ? std::chrono::milliseconds(0) : wait;
      waited = true;
      if (jobs[i]->events.pop_all(events, w)) out += builders[i]->feed(events);
      if (builders[i]->failed()) break;  // (streamed: its error event ends the stream)
    }
    return out;
  };
  auto all_done = [builders] {
    return std::all_of(builders.begin(), builders.end(), [](const auto& b) { return b->done(); });
  };
  auto any_failed = [builders] {
    return std::any_of(builders.begin(), builders.end(), [](const auto& b) { return b->failed(); });
  };
  auto cancel_all = [jobs] {
    for (const auto& j : jobs) {
      j->cancel = true;
      j->events.close();
    }
  };
  auto usage = [builders] {
    std::vector<engine::GenerationResult> r;
    for (const auto& b : builders) r.push_back(b->result());
    return usage_json(r);
  };
  if (!stream) {
    while (!all_done() && !any_failed()) pump(std::chrono::milliseconds(500));
    if (any_failed()) {
      cancel_all();
      for (const auto& b : builders)
        if (b->failed()) b->body();  // throws its error
    }
    record_stats(builders);
    ojson body = builders[0]->body();  // may throw ApiError
    for (size_t i = 1; i < builders.size(); ++i) body["choices"].push_back(builders[i]->body()["choices"][0]);
    if (builders.size() > 1) body["usage"] = usage();
    res.set_content(body.dump(-1, ' ', false, kReplaceInvalidUtf8), "application/json");
    return;
  }

  struct StreamState {
    Clock::time_point last_write = Clock::now();
    bool finished = false;
  };
  auto st = std::make_shared<StreamState>();
  metrics.open_streams++;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, st, jobs, builders, pump, all_done, any_failed, cancel_all, usage](size_t, httplib::DataSink& sink) {
        if (st->finished) {
          sink.done();
          return true;
        }
        std::string out = pump(std::chrono::milliseconds(250));
        if (out.empty() && !any_failed() && !all_done()) {
          if (stopping && jobs.back()->cancel) {
            // The engine is gone (shutdown) and a job's final event may never come.
            for (const auto& b : builders)
              if (!b->done()) {
                out = b->abort_stream(503, "The server is shutting down.", "server_shutting_down");
                break;
              }
          } else if (Clock::now() - st->last_write > std::chrono::seconds(2)) {
            out = ": keep-alive\n\n";  // an SSE comment: finds clients that went away
          }
        }
        const bool failed = any_failed(), end = failed || all_done();
        if (end && !failed && builders.size() > 1) out += builders[0]->end_stream(usage());
        if (!out.empty()) {
          if (!sink.write(out.data(), out.size())) {
            cancel_all();
            return false;
          }
          st->last_write = Clock::now();
        }
        if (end) {
          if (failed) cancel_all();
          st->finished = true;
          record_stats(builders);
          sink.done();
        }
        return true;
      },
      [this, st, cancel_all](bool) {
        if (!st->finished) cancel_all();
        metrics.open_streams--;
      });
}

void Server::Impl::handle_chat(const httplib::Request& req, httplib::Response& res) {
  check_auth(req);
  if (!model.chat_template)
    throw ApiError(400, "invalid_request_error",
                   "This model has no chat template; use /v1/completions.", "", "no_chat_template");
  const ojson body = parse_json_body(req.body);
  ChatRequest cr = parse_chat_request(body, model.default_sampling, opt.limits);

  std::string prompt;
  try {
    prompt = model.chat_template->render(cr.inputs);
  } catch (const lily::Error& e) {
    throw ApiError(400, "invalid_request_error", str_cat("The chat template failed: ", e.what()),
                   "messages", "template_error");
  }

  ChatSetup setup;
  setup.id = make_response_id("chatcmpl-");
  setup.model = model.id;
  setup.created = unix_time_now();
  setup.stop_token_ids = model.stop_token_ids;
  prompt += plan_chat_reply(cr, model.tool_dialect, prompt, setup);
  engine::GenerationParams gp;
  gp.stop_strings = cr.common.stop;
  if (!setup.injected_stop.empty()) gp.stop_strings.push_back(setup.injected_stop);
  gp.prompt = model.tokenizer->encode(prompt, true);
  gp.max_tokens = resolve_max_tokens(cr.common.max_tokens, static_cast<int>(gp.prompt.size()),
                                     opt.limits, "messages");
  gp.sampling = cr.common.sampling;
  gp.stop_token_ids = model.stop_token_ids;
  gp.top_logprobs = cr.logprobs ? cr.top_logprobs : -1;
  // JSON output is constrained token by token, after any reasoning; with
  // tools offered the reply may be a call instead, so it is only checked.
  if (setup.parser.tool_dialect == text::ToolDialect::None && (cr.json_schema || cr.json_object)) {
    gp.json_grammar = cr.json_schema ? cr.json_schema : text::JsonGrammar::any_object();
    if (setup.parser.starts_in_reasoning) gp.grammar_after = "</think>";
  }
  // Tool calls are constrained to the tools' names and parameter schemas
  // from each "<tool_call>" the reply writes outside its reasoning (or from
  // the forced opening) to the end of the call. Schemas the grammar cannot
  // express leave the calls unconstrained (they are still checked).
  if (setup.parser.tool_dialect != text::ToolDialect::None) {
    const ojson& all = cr.inputs.tools;
    ojson tools = ojson::array();
    for (const auto& t : all)
      if (cr.tool_choice != ToolChoice::Named ||
          (t.contains("function") && t["function"].is_object() && t["function"].value("name", "") == cr.tool_name))
        tools.push_back(t);
    try {
      gp.tool_grammar = text::JsonGrammar::tool_calls(
          tools, model.tool_dialect == text::ToolDialect::Xml ? text::ToolCallSyntax::Xml : text::ToolCallSyntax::Json);
    } catch (const lily::Error&) {
      gp.tool_grammar = nullptr;
    }
    const std::string& forced = setup.forced_prefix;
    if (const size_t at = forced.find(gp.tool_trigger); gp.tool_grammar && at != std::string::npos) {
      gp.tool_forced = true;
      gp.tool_prefix = forced.substr(at + gp.tool_trigger.size());
    } else if (gp.tool_grammar) {
      if (setup.parser.starts_in_reasoning) gp.grammar_after = "</think>";
      if (setup.parser.reasoning_enabled) gp.think_open = "<think>";
    }
  }

  std::vector<std::shared_ptr<ChatResponseBuilder>> builders;
  for (int i = 0; i < cr.common.n; ++i) {
    builders.push_back(std::make_shared<ChatResponseBuilder>(setup, *model.tokenizer));
    builders.back()->set_choice(i, cr.common.n == 1);
  }
  respond(res, submit_n(std::move(gp), cr.common.n), builders, cr.common.stream);
}

void Server::Impl::handle_completion(const httplib::Request& req, httplib::Response& res) {
  check_auth(req);
  const ojson body = parse_json_body(req.body);
  CompletionRequest cr = parse_completion_request(body, model.default_sampling, opt.limits);
  engine::GenerationParams gp;
  if (cr.prompt_is_tokens) {
    const int V = model.backend->config().vocab_size;
    for (int t : cr.prompt_tokens)
      if (t >= V)
        throw bad_request(str_cat("Invalid value for 'prompt': token id ", t,
                                  " is outside the vocabulary [0, ", V, ")."),
                          "prompt", "invalid_value");
    gp.prompt = cr.prompt_tokens;
  } else {
    gp.prompt = model.tokenizer->encode(cr.prompt_text, true);
    if (gp.prompt.empty())
      throw bad_request("The prompt has no tokens.", "prompt", "invalid_value");
  }
  if (cr.echo && cr.logprobs >= 0)
    throw bad_request("'echo' together with 'logprobs' is not supported by lily.", "echo",
                      "unsupported_parameter");
  gp.max_tokens = resolve_max_tokens(cr.common.max_tokens, static_cast<int>(gp.prompt.size()),
                                     opt.limits, "prompt");
  gp.sampling = cr.common.sampling;
  gp.stop_token_ids = model.stop_token_ids;
  gp.stop_strings = cr.common.stop;
  gp.top_logprobs = cr.logprobs;

  CompletionSetup setup;
  setup.id = make_response_id("cmpl-");
  setup.model = model.id;
  setup.created = unix_time_now();
  setup.stream = cr.common.stream;
  setup.include_usage = cr.common.include_usage;
  setup.logprobs = cr.logprobs;
  setup.stop_token_ids = model.stop_token_ids;
  if (cr.echo)
    setup.echo_text =
        cr.prompt_is_tokens ? model.tokenizer->decode(cr.prompt_tokens) : cr.prompt_text;
  std::vector<std::shared_ptr<CompletionResponseBuilder>> builders;
  for (int i = 0; i < cr.common.n; ++i) {
    builders.push_back(std::make_shared<CompletionResponseBuilder>(setup, *model.tokenizer));
    builders.back()->set_choice(i, cr.common.n == 1);
  }
  respond(res, submit_n(std::move(gp), cr.common.n), builders, cr.common.stream);
}

void Server::Impl::log_request(const httplib::Request& req, const httplib::Response& res) {
  static const std::set<std::string> routes = {"/v1/chat/completions", "/v1/completions",
                                               "/v1/models", "/health", "/metrics"};
  std::string route = routes.count(req.path) ? req.path : "other";
  if (route == "other" && req.path.rfind("/v1/models/", 0) == 0) route = "/v1/models/{id}";
  metrics.count_request(route, res.status);
  if (opt.log_requests) {
    const RequestStats& s = tl_stats;
    const double total = s.start == Clock::time_point{}
                             ? -1
                             : std::chrono::duration<double>(Clock::now() - s.start).count();
    char line[512];
    if (s.generation) {
      char ttft[32] = "-", tps[32] = "-";
      if (s.ttft >= 0) std::snprintf(ttft, sizeof ttft, "%.1fms", s.ttft * 1e3);
      if (s.tok_per_s >= 0) std::snprintf(tps, sizeof tps, "%.1f", s.tok_per_s);
      char draft[48] = "";
      if (s.drafted > 0) std::snprintf(draft, sizeof draft, " drafts=%d/%d", s.accepted, s.drafted);
      std::snprintf(line, sizeof line,
                    "%s %s %d prompt=%d cached=%d completion=%d ttft=%s tok/s=%s%s finish=%s "
                    "time=%.1fms",
                    req.method.c_str(), req.path.c_str(), res.status, s.prompt, s.cached,
                    s.completion, ttft, tps, draft, s.finish.c_str(), total * 1e3);
    } else {
      std::snprintf(line, sizeof line,
                    "%s %s %d prompt=- cached=- completion=- ttft=- tok/s=- time=%.1fms",
                    req.method.c_str(), req.path.c_str(), res.status, total * 1e3);
    }
    std::fprintf(stderr, "lily serve: %s\n", line);
  }
  tl_stats = RequestStats{};
}

void Server::Impl::setup_routes() {
  // Every handler answers errors in OpenAI's shape.
  auto guarded = [this](void (Impl::*fn)(const httplib::Request&, httplib::Response&)) {
    return [this, fn](const httplib::Request& req, httplib::Response& res) {
      try {
        (this->*fn)(req, res);
      } catch (const ApiError& e) {
        send_error(res, e);
      } catch (const lily::Error& e) {
        send_error(res, bad_request(e.what()));
      } catch (const std::exception& e) {
        send_error(res, ApiError(500, "server_error", str_cat("Internal error: ", e.what())));
      }
    };
  };
  http.Post("/v1/chat/completions", guarded(&Impl::handle_chat));
  http.Post("/v1/completions", guarded(&Impl::handle_completion));
  http.Get("/v1/models", guarded(&Impl::handle_models));
  http.Get("/v1/models/(.+)", guarded(&Impl::handle_models));
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (stopping) {
      res.status = 503;
      res.set_content(R"({"status":"shutting_down"})", "application/json");
      return;
    }
    ojson h = {{"status", "ok"},
               {"model", model.id},
               {"queue_depth", metrics.queue_depth.load()},
               {"running", metrics.running.load()}};
    res.set_content(h.dump(-1, ' ', false, kReplaceInvalidUtf8), "application/json");
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.render(), "text/plain; version=0.0.4; charset=utf-8");
  });

  http.set_pre_routing_handler([](const httplib::Request&, httplib::Response&) {
    tl_stats = RequestStats{};
    tl_stats.start = Clock::now();
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Statuses httplib produces itself (no route, body too large, bad request
  // line) get an OpenAI error body; handler errors already have one.
  http.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req,
                                                                     httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    std::string msg, code;
    switch (res.status) {
      case 404:
        msg = "Unknown request URL: " + req.method + " " + req.path +
              ". The routes are POST /v1/chat/completions, POST /v1/completions, GET /v1/models, "
              "GET /health and GET /metrics.";
        code = "unknown_url";
        break;
      case 413:
        msg =
            str_cat("The request body is too large: the limit is ", opt.max_body_bytes, " bytes.");
        code = "request_too_large";
        break;
      case 405:
        msg = "Method " + req.method + " is not allowed for " + req.path + ".";
        code = "method_not_allowed";
        break;
      default:
        msg = str_cat("HTTP error ", res.status, ".");
        break;
    }
    res.set_content(error_body(res.status, msg, "", code).dump(-1, ' ', false, kReplaceInvalidUtf8),
                    "application/json");
    return httplib::Server::HandlerResponse::Handled;
  }));
  http.set_exception_handler(
      [this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          if (ep) std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        send_error(res, ApiError(500, "server_error", "Internal error: " + what));
      });
  http.set_logger(
      [this](const httplib::Request& req, const httplib::Response& res) { log_request(req, res); });
}

Server::Server(ServedModel& model, ServerOptions options)
    : impl_(std::make_unique<Impl>(model, std::move(options))) {
  Impl& s = *impl_;
  const int threads = std::max(4, s.opt.http_threads);
  s.http.new_task_queue = [threads] {
    return new httplib::ThreadPool(static_cast<size_t>(threads));
  };
  s.http.set_payload_max_length(s.opt.max_body_bytes);
  s.http.set_tcp_nodelay(true);
  s.http.set_keep_alive_timeout(5);
  s.http.set_keep_alive_max_count(1000);
  s.http.set_read_timeout(30, 0);
  s.http.set_write_timeout(10, 0);
  s.http.set_socket_options([this](int fd) {
    int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    impl_->listen_fd = fd;
  });
  s.setup_routes();
}

Server::~Server() {
  stop();
  impl_->scheduler.shutdown();
}

int Server::bind() {
  Impl& s = *impl_;
  int port = s.opt.port;
  if (port == 0) {
    port = s.http.bind_to_any_port(s.opt.host);
    if (port <= 0) fail("cannot bind to ", s.opt.host, " (any port)");
  } else if (!s.http.bind_to_port(s.opt.host, port)) {
    fail("cannot bind to ", s.opt.host, ":", port, " (in use, or not a local address?)");
  }
  // httplib listens with a backlog of 5; allow bursts of connections.
  if (s.listen_fd >= 0) ::listen(s.listen_fd, 1024);
  return port;
}

void Server::run() {
  Impl& s = *impl_;
  s.running = true;
  if (!s.stopping) s.http.listen_after_bind();
  s.running = false;
  s.scheduler.shutdown();
}

void Server::stop() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.stop_mu);
  if (s.stopping.exchange(true)) return;
  s.scheduler.shutdown();  // cancels; every job gets its final event
  // Give open streams a moment to send their last events.
  for (int i = 0; i < 200 && s.metrics.open_streams > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  for (int i = 0; i < 200 && s.running && !s.http.is_running(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  s.http.stop();
}

Metrics& Server::metrics() {
  return impl_->metrics;
}
const ServerOptions& Server::options() const {
  return impl_->opt;
}

}  // namespace lily::server
