// The engine side of the server: a FIFO queue of generation jobs run one at
// a time by a single engine thread, and the bounded per-job event queues the
// HTTP threads read from.
//
// The engine never waits for a client: it pushes events without blocking,
// and a job whose queue is full (the client reads too slowly) or closed (the
// client went away) is cancelled, which frees the engine for the next job.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/generator.h"
#include "server/metrics.h"

namespace lily::server {

struct JobEvent {
  enum class Kind { Token, Done, Error };
  Kind kind = Kind::Token;
  engine::GenerationEvent gen;      // Token
  engine::GenerationResult result;  // Done
  double queue_seconds = 0;         // Done: time spent waiting for the engine
  bool shutdown = false;            // Done: cancelled because the server is stopping
  int error_status = 500;           // Error
  std::string error;                // Error
};

class EventQueue {
 public:
  explicit EventQueue(size_t capacity) : capacity_(capacity) {}

  // Fails when the queue holds `capacity` events or the reader closed it.
  bool push(JobEvent&& e);
  // The last event of a job (Done / Error): accepted beyond the capacity.
  void push_final(JobEvent&& e);
  // Moves every queued event into `out` (appending); waits up to `timeout`
  // for the first. Returns whether anything was moved.
  bool pop_all(std::vector<JobEvent>& out, std::chrono::milliseconds timeout);
  // The reader is gone: later pushes fail.
  void close();
  bool overflowed() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<JobEvent> q_;
  size_t capacity_;
  bool closed_ = false;
  bool overflowed_ = false;
};

struct Job {
  Job(engine::GenerationParams p, size_t queue_capacity)
      : params(std::move(p)), events(queue_capacity) {}
  engine::GenerationParams params;
  std::atomic<bool> cancel{false};
  EventQueue events;
  std::chrono::steady_clock::time_point enqueued{};
};

class Scheduler {
 public:
  // Starts the engine thread. `generator` is used by that thread only.
  Scheduler(engine::Generator& generator, Metrics& metrics, size_t max_queue);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a job (FIFO). Fails when max_queue jobs are waiting or the
  // scheduler is shutting down.
  bool submit(const std::shared_ptr<Job>& job);
  // Cancels the running and queued jobs, refuses new ones, joins the engine
  // thread. Every job still gets its final event. Idempotent.
  void shutdown();

  size_t queued() const;

 private:
  void loop();
  void run_job(Job& job);
  bool stopping() const;

  engine::Generator& generator_;
  Metrics& metrics_;
  size_t max_queue_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::shared_ptr<Job> current_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace lily::server
