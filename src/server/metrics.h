// Server counters, exported in the Prometheus text format (GET /metrics).
// Every method is thread-safe; counters only grow.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace lily::server {

// A cumulative histogram with fixed upper bounds (seconds or tokens/s).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  // Appends the _bucket / _sum / _count lines of `name`.
  void render(std::string& out, const std::string& name) const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative); last = +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  Metrics();

  // One finished HTTP request (any route, any status).
  void count_request(const std::string& route, int status);
  // One finished generation.
  void count_generation(int prompt_tokens, int cached_tokens, int completion_tokens,
                        double ttft_seconds, double decode_seconds, bool cancelled);
  // Speculative decoding: tokens drafted and run, and those the output took.
  void count_drafts(int drafted, int accepted) {
    drafted_ += static_cast<uint64_t>(drafted);
    accepted_ += static_cast<uint64_t>(accepted);
  }

  std::atomic<int> queue_depth{0};   // jobs waiting for the engine
  std::atomic<int> running{0};       // jobs the engine is running (0 or 1)
  std::atomic<int> open_streams{0};  // SSE responses in progress
  // The engine's prefix cache after the last generation.
  std::atomic<uint64_t> prefix_cache_bytes{0}, prefix_cache_entries{0}, prefix_cache_evictions{0};

  std::string render() const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;  // (route, status)
  std::atomic<uint64_t> prompt_tokens_{0}, cached_tokens_{0}, generated_tokens_{0};
  std::atomic<uint64_t> generations_{0}, cancelled_{0}, prefix_hits_{0}, prefix_lookups_{0};
  std::atomic<uint64_t> drafted_{0}, accepted_{0};
  // Decode time and tokens, for an overall rate.
  std::atomic<uint64_t> decode_micros_{0}, decode_tokens_{0};
  Histogram ttft_;
  Histogram decode_rate_;
};

}  // namespace lily::server
