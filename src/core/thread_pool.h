// A fixed pool of worker threads for data-parallel loops. parallel_for splits
// [0, n) into contiguous ranges; the calling thread takes part, and the call
// returns when every range is done. Between loops the workers spin for a
// short while (kSpin) before they sleep, and so does the caller waiting for
// the last range: a decode step runs hundreds of short loops back to back,
// and a sleeping thread takes tens of microseconds to wake.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lily {

class ThreadPool {
 public:
  // threads == 0: one per hardware thread.
  explicit ThreadPool(size_t threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t size() const { return workers_.size() + 1; }

  // fn(begin, end) over ranges of at least min_grain items.
  void parallel_for(size_t n, size_t min_grain,
                    const std::function<void(size_t, size_t)>& fn);

 private:
  void worker_loop();
  void run_ranges();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(size_t, size_t)>* job_ = nullptr;
  size_t job_n_ = 0, job_chunk_ = 0, next_ = 0;  // under mu_
  // Written under mu_; read without it while spinning.
  std::atomic<size_t> pending_{0}, generation_{0};
  std::atomic<bool> stop_{false};
  static constexpr std::chrono::microseconds kSpin{200};
  std::mutex call_mu_;  // one parallel_for at a time
};

}  // namespace lily
