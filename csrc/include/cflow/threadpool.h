// Persistent thread pool for decode steps: n-1 worker threads plus the calling thread.
// Workers spin on an epoch counter for a short while after each job (a decode step issues jobs
// back to back), then sleep on a condition variable. Inside a job, barrier() is a
// sense-reversing spin barrier (spin, then yield), so a whole step can run as one job with
// barriers only where data dependence needs them.
#pragma once
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace cflow {

class ThreadPool {
 public:
  // n_threads >= 1 threads in all (the caller counts as thread 0).
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }

  // Runs fn(ctx, tid, nth) on every thread, tid 0 on the caller; returns when all finished.
  // Not reentrant: call from one thread at a time, never from inside a job.
  void run(void (*fn)(void* ctx, int tid, int nth), void* ctx);

  // Any callable f(int tid, int nth).
  template <class F>
  void run(F&& f) {
    run([](void* c, int tid, int nth) { (*static_cast<F*>(c))(tid, nth); }, (void*)&f);
  }

  // Splits [0, n) into contiguous chunks, one per thread (chunk = items rounded to `grain`);
  // f(begin, end) on each non-empty chunk.
  template <class F>
  void parallel_for(int n, int grain, F&& f) {
    if (n <= 0) return;
    const int nth = n_ <= 1 ? 1 : n_;
    if (nth == 1 || n <= grain) {
      f(0, n);
      return;
    }
    run([&](int tid, int nt) {
      int units = (n + grain - 1) / grain;
      int b = (int)((long long)units * tid / nt) * grain, e = (int)((long long)units * (tid + 1) / nt) * grain;
      if (e > n) e = n;
      if (b < e) f(b, e);
    });
  }

  // Inside a job only: waits until every thread of the pool has reached it.
  void barrier();

 private:
  void worker(int tid);

  int n_;
  std::vector<std::thread> threads_;
  void (*fn_)(void*, int, int) = nullptr;
  void* ctx_ = nullptr;
  alignas(64) std::atomic<unsigned> epoch_{0};     // bumped once per job
  alignas(64) std::atomic<int> pending_{0};        // workers still running the job
  alignas(64) std::atomic<int> bar_count_{0};
  alignas(64) std::atomic<unsigned> bar_sense_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<int> sleepers_{0};
};

// The process-wide pool used by the drivers when none is given (created on first use with
// CFLOW_THREADS or the hardware concurrency threads).
ThreadPool& global_pool();
// Replaces the global pool by one of n threads (not while a job runs).
void set_num_threads(int n);
int num_threads();

}  // namespace cflow
