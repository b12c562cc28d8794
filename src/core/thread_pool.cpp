#include "core/thread_pool.h"

#include <algorithm>

namespace lily {

ThreadPool::ThreadPool(size_t threads) {
  if (threads == 0) threads = std::max<size_t>(1, std::thread::hardware_concurrency());
  for (size_t i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins until done() or kSpin has passed; returns done().
template <class Done>
bool spin_until(Done done, std::chrono::microseconds limit) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0;; ++i) {
    if (done()) return true;
    cpu_relax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() - t0 > limit) return done();
  }
}

}  // namespace

void ThreadPool::run_ranges() {
  for (;;) {
    size_t begin;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (next_ >= job_n_) return;
      begin = next_;
      next_ = std::min(job_n_, next_ + job_chunk_);
    }
    size_t end = std::min(job_n_, begin + job_chunk_);
    (*job_)(begin, end);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pending_.fetch_sub(1) == 1) done_cv_.notify_all();
    }
  }
}

void ThreadPool::worker_loop() {
  size_t seen = 0;
  for (;;) {
    spin_until([&] { return stop_.load() || generation_.load() != seen; }, kSpin);
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
      if (stop_) return;
      seen = generation_.load();
    }
    run_ranges();
  }
}

void ThreadPool::parallel_for(size_t n, size_t min_grain,
                              const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  min_grain = std::max<size_t>(1, min_grain);
  size_t threads = size();
  if (threads == 1 || n <= min_grain) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mu_);
  // A few ranges per thread balances uneven work without much locking.
  size_t chunk = std::max(min_grain, (n + threads * 4 - 1) / (threads * 4));
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_n_ = n;
    job_chunk_ = chunk;
    next_ = 0;
    pending_ = (n + chunk - 1) / chunk;
    generation_.fetch_add(1);
  }
  start_cv_.notify_all();
  run_ranges();
  // (pending_ reaches 0 after the last range's writes: seq_cst atomics.)
  if (!spin_until([&] { return pending_.load() == 0; }, kSpin)) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return pending_.load() == 0; });
  }
  std::lock_guard<std::mutex> lock(mu_);
  job_ = nullptr;
}

}  // namespace lily
