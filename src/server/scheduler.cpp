#include "server/scheduler.h"

#include <exception>

#include "core/error.h"

namespace lily::server {

bool EventQueue::push(JobEvent&& e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return false;
    if (q_.size() >= capacity_) {
      overflowed_ = true;
      return false;
    }
    q_.push_back(std::move(e));
  }
  cv_.notify_one();
  return true;
}

void EventQueue::push_final(JobEvent&& e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    q_.push_back(std::move(e));
  }
  cv_.notify_one();
}

bool EventQueue::pop_all(std::vector<JobEvent>& out, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !q_.empty(); })) return false;
  while (!q_.empty()) {
    out.push_back(std::move(q_.front()));
    q_.pop_front();
  }
  return true;
}

void EventQueue::close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  q_.clear();
}

bool EventQueue::overflowed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return overflowed_;
}

Scheduler::Scheduler(engine::Generator& generator, Metrics& metrics, size_t max_queue)
    : generator_(generator), metrics_(metrics), max_queue_(max_queue) {
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() {
  shutdown();
}

bool Scheduler::submit(const std::shared_ptr<Job>& job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || queue_.size() >= max_queue_) return false;
    job->enqueued = std::chrono::steady_clock::now();
    queue_.push_back(job);
    metrics_.queue_depth = static_cast<int>(queue_.size());
  }
  cv_.notify_one();
  return true;
}

bool Scheduler::stopping() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stopping_;
}

size_t Scheduler::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

void Scheduler::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (auto& j : queue_) j->cancel = true;
    if (current_) current_->cancel = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Scheduler::loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      job = queue_.front();
      queue_.pop_front();
      metrics_.queue_depth = static_cast<int>(queue_.size());
      if (stopping_) job->cancel = true;
      current_ = job;
    }
    run_job(*job);
    std::lock_guard<std::mutex> lock(mu_);
    current_.reset();
  }
}

void Scheduler::run_job(Job& job) {
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - job.enqueued).count();
  JobEvent done;
  done.queue_seconds = waited;
  if (job.cancel) {
    done.kind = JobEvent::Kind::Done;
    done.result.finish = engine::FinishReason::Cancelled;
    done.result.prompt_tokens = static_cast<int>(job.params.prompt.size());
    done.shutdown = stopping();
    metrics_.count_generation(0, 0, 0, -1, 0, true);
    job.events.push_final(std::move(done));
    return;
  }
  metrics_.running = 1;
  try {
    auto on_event = [&](engine::GenerationEvent&& ev) {
      JobEvent e;
      e.kind = JobEvent::Kind::Token;
      e.gen = std::move(ev);
      if (!job.events.push(std::move(e))) {
        job.cancel = true;  // the client is gone or not reading
        return false;
      }
      return true;
    };
    done.result = generator_.generate(job.params, on_event, &job.cancel);
    done.kind = JobEvent::Kind::Done;
    if (done.result.finish == engine::FinishReason::Cancelled) done.shutdown = stopping();
    const auto& r = done.result;
    metrics_.count_generation(r.prompt_tokens, r.cached_tokens, r.completion_tokens,
                              waited + r.prefill_seconds, r.decode_seconds,
                              r.finish == engine::FinishReason::Cancelled);
    metrics_.count_drafts(r.draft_tokens, r.accepted_tokens);
  } catch (const lily::Error& e) {
    done.kind = JobEvent::Kind::Error;
    done.error_status = 400;
    done.error = e.what();
  } catch (const std::exception& e) {
    done.kind = JobEvent::Kind::Error;
    done.error_status = 500;
    done.error = e.what();
  }
  metrics_.running = 0;
  const engine::PrefixCache& pc = generator_.prefix_cache();
  metrics_.prefix_cache_bytes = pc.bytes();
  metrics_.prefix_cache_entries = pc.size();
  metrics_.prefix_cache_evictions = pc.evictions();
  job.events.push_final(std::move(done));
}

}  // namespace lily::server
