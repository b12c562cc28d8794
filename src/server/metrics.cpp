#include "server/metrics.h"

#include <cstdio>

namespace lily::server {

namespace {

std::string fmt_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

void header(std::string& out, const char* name, const char* type, const char* help) {
  out += "# HELP ";
  out += name;
  out += ' ';
  out += help;
  out += "\n# TYPE ";
  out += name;
  out += ' ';
  out += type;
  out += '\n';
}

void sample(std::string& out, const std::string& name, double v) {
  out += name;
  out += ' ';
  out += fmt_double(v);
  out += '\n';
}

// A metric of one sample: its HELP / TYPE lines and the value.
void metric(std::string& out, const char* name, const char* type, const char* help, double v) {
  header(out, name, type, help);
  sample(out, name, v);
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  counts_[i]++;
  sum_ += v;
  count_++;
}

void Histogram::render(std::string& out, const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t cum = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cum += counts_[i];
    out += name + "_bucket{le=\"" + (i < bounds_.size() ? fmt_double(bounds_[i]) : "+Inf") +
           "\"} " + std::to_string(cum) + "\n";
  }
  sample(out, name + "_sum", sum_);
  out += name + "_count " + std::to_string(count_) + "\n";
}

Metrics::Metrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      decode_rate_({1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000}) {}

void Metrics::count_request(const std::string& route, int status) {
  std::lock_guard<std::mutex> lock(mu_);
  requests_[{route, status}]++;
}

void Metrics::count_generation(int prompt_tokens, int cached_tokens, int completion_tokens,
                               double ttft_seconds, double decode_seconds, bool cancelled) {
  generations_++;
  if (cancelled) cancelled_++;
  prompt_tokens_ += static_cast<uint64_t>(prompt_tokens);
  cached_tokens_ += static_cast<uint64_t>(cached_tokens);
  generated_tokens_ += static_cast<uint64_t>(completion_tokens);
  prefix_lookups_++;
  if (cached_tokens > 0) prefix_hits_++;
  if (ttft_seconds >= 0 && completion_tokens > 0) ttft_.observe(ttft_seconds);
  // The decode rate counts the tokens after the first one (the first comes
  // from the prefill) over the time they took.
  if (completion_tokens > 1 && decode_seconds > 0) {
    decode_micros_ += static_cast<uint64_t>(decode_seconds * 1e6);
    decode_tokens_ += static_cast<uint64_t>(completion_tokens - 1);
    decode_rate_.observe((completion_tokens - 1) / decode_seconds);
  }
}

std::string Metrics::render() const {
  std::string out;
  header(out, "lily_requests_total", "counter", "HTTP requests answered, by route and status.");
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, n] : requests_)
      out += "lily_requests_total{route=\"" + key.first + "\",status=\"" +
             std::to_string(key.second) + "\"} " + std::to_string(n) + "\n";
  }
  metric(out, "lily_generations_total", "counter", "Generations run by the engine.",
         static_cast<double>(generations_.load()));
  metric(out, "lily_generations_cancelled_total", "counter",
         "Generations cancelled (client gone, queue overflow, shutdown).",
         static_cast<double>(cancelled_.load()));
  metric(out, "lily_prompt_tokens_total", "counter", "Prompt tokens processed (cached included).",
         static_cast<double>(prompt_tokens_.load()));
  metric(out, "lily_generated_tokens_total", "counter", "Completion tokens generated.",
         static_cast<double>(generated_tokens_.load()));
  metric(out, "lily_prefix_cache_lookups_total", "counter",
         "Generations that looked for a reusable prefix.",
         static_cast<double>(prefix_lookups_.load()));
  metric(out, "lily_prefix_cache_hits_total", "counter",
         "Generations that reused a cached prefix of their prompt.",
         static_cast<double>(prefix_hits_.load()));
  metric(out, "lily_prefix_cache_hit_tokens_total", "counter",
         "Prompt tokens served from the cached prefix.",
         static_cast<double>(cached_tokens_.load()));
  metric(out, "lily_prefix_cache_bytes", "gauge",
         "Memory held by kept model states (prefix cache).",
         static_cast<double>(prefix_cache_bytes.load()));
  metric(out, "lily_prefix_cache_entries", "gauge", "Model states kept (prefix cache).",
         static_cast<double>(prefix_cache_entries.load()));
  metric(out, "lily_prefix_cache_evictions_total", "counter",
         "Kept model states dropped to stay within the prefix cache's limits.",
         static_cast<double>(prefix_cache_evictions.load()));
  metric(out, "lily_draft_tokens_total", "counter",
         "Tokens drafted by prompt lookup and run through the model (speculative decoding).",
         static_cast<double>(drafted_.load()));
  metric(out, "lily_draft_accepted_tokens_total", "counter",
         "Drafted tokens the output took (each saved a decode step).",
         static_cast<double>(accepted_.load()));
  header(out, "lily_time_to_first_token_seconds", "histogram",
         "From the request reaching the engine queue to its first generated token.");
  ttft_.render(out, "lily_time_to_first_token_seconds");
  header(out, "lily_decode_tokens_per_second", "histogram",
         "Per-request decode rate (tokens after the first / their time).");
  decode_rate_.render(out, "lily_decode_tokens_per_second");
  metric(out, "lily_decode_seconds_total", "counter", "Time spent decoding.",
         static_cast<double>(decode_micros_.load()) / 1e6);
  metric(out, "lily_decode_tokens_total", "counter", "Tokens decoded (after each first token).",
         static_cast<double>(decode_tokens_.load()));
  metric(out, "lily_queue_depth", "gauge", "Requests waiting for the engine.", queue_depth.load());
  metric(out, "lily_running_requests", "gauge", "Requests the engine is running.", running.load());
  metric(out, "lily_open_streams", "gauge", "Streaming responses in progress.",
         open_streams.load());
  return out;
}

}  // namespace lily::server
