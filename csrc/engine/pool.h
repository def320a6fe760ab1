// A persistent thread pool whose threads run one function per call and meet at barriers.
// Threads spin (with pause, then yield: the machine may be shared) while work is near, and
// sleep on a condition variable after a few milliseconds idle.
#pragma once
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace cflow {

class Pool {
 public:
  explicit Pool(int n);  // n threads in all, the caller included
  ~Pool();
  int size() const { return n_; }
  // fn(tid) on every thread (tid 0 is the caller); returns when all have finished.
  void run(const std::function<void(int)>& fn);
  // Called by all n threads inside fn: returns when all have arrived.
  void barrier();

 private:
  void worker(int tid);
  int n_;
  std::vector<std::thread> threads_;
  const std::function<void(int)>* fn_ = nullptr;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> done_{0};
  std::atomic<int> bar_count_{0};
  std::atomic<uint64_t> bar_gen_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> sleepers_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace cflow
