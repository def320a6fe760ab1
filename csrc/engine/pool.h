// A persistent thread pool whose threads run one function per call and meet at barriers.
// Every wait spins with pause for a short budget (work is near: a barrier of a decode step is
// tens of microseconds away), then sleeps on the word it waits for (a futex on Linux, a yield
// loop elsewhere), so that a waiter early by more than the budget gives its core away. With
// more runnable threads than cores a step still waits for partners' time slices at its ~100
// barriers (docs/KERNELS.md, "Thread pool"): give the engine no more threads than idle cores.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
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
  // Returns once w no longer holds `old`: spins for spin_us, then sleeps on w.
  void wait_change(std::atomic<uint32_t>& w, uint32_t old, int spin_us);
  // After changing w (seq_cst): wakes its sleepers, if any thread sleeps.
  void notify(std::atomic<uint32_t>& w);
  int n_;
  std::vector<std::thread> threads_;
  const std::function<void(int)>* fn_ = nullptr;
  std::atomic<uint32_t> gen_{0};      // bumped per run
  std::atomic<uint32_t> done_{0};     // workers finished with this run
  std::atomic<uint32_t> bar_count_{0};
  std::atomic<uint32_t> bar_gen_{0};  // bumped per completed barrier
  std::atomic<bool> stop_{false};
  std::atomic<int> sleepers_{0};
};

}  // namespace cflow
