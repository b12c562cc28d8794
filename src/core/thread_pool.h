// A fixed pool of worker threads for data-parallel loops. parallel_for splits
// [0, n) into contiguous ranges; the calling thread takes part, and the call
// returns when every range is done.
#pragma once

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
  size_t job_n_ = 0, job_chunk_ = 0, next_ = 0, pending_ = 0;
  size_t generation_ = 0;
  bool stop_ = false;
  std::mutex call_mu_;  // one parallel_for at a time
};

}  // namespace lily
