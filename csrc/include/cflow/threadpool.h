// The persistent thread pool of the kernels and the engine: n-1 workers plus the calling
// thread, one function per run, barriers inside it where data dependence needs them (a whole
// decode step is one run). Every wait (for a run, for the workers' end, at a barrier) spins with
// pause for a budget, then sleeps on the very word it waits for (a futex on Linux, a yield loop
// elsewhere), and whoever changes the word wakes its sleepers: a waiter early by more than the
// budget gives its core away. The barrier budget adapts (threadpool.cpp): 2 ms, unless the
// caller thread keeps waiting for a core (a quarter of a run), then 50 us for a while. With more
// runnable threads than cores a step still waits for partners' time slices at its ~100 barriers
// (docs/KERNELS.md, "Thread pool"): give the engine no more threads than idle cores.
#pragma once
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace cflow {

// Names the calling thread (at most 15 characters on Linux; longer names are cut) for top -H, ps,
// perf and /proc/<pid>/task/<tid>/comm, where `cflow bench load` reads which thread took the
// server's CPU: the pool's workers are "cflow-pool", the expert tier's readers "cflow-io". A no-op
// where the platform has no such call.
void set_thread_name(const char* name);

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
  // Returns once w no longer holds `old`: spins for spin_us, then sleeps on w.
  void wait_change(std::atomic<uint32_t>& w, uint32_t old, int spin_us);
  // After changing w (seq_cst): wakes its sleepers, if any thread sleeps.
  void notify(std::atomic<uint32_t>& w);
  // After a run: the next barrier budget, short for a while when the caller waited for its core.
  void adapt_spin(bool contended);

  int n_;
  const int fixed_spin_us_;              // CFLOW_SPIN_US, or -1: adapt
  std::atomic<int> spin_us_{0};          // the barrier budget now
  int short_left_ = 0, short_runs_ = 0;  // runs left at the short budget; its next length
  int calm_runs_ = 0;                    // runs at the long budget since the last relapse
  int contended_row_ = 0;                // runs in a row in which the caller waited for its core
  int64_t last_run_us_ = INT64_MAX;      // the last run's wall time (the first run is measured)
  std::vector<std::thread> threads_;
  void (*fn_)(void*, int, int) = nullptr;
  void* ctx_ = nullptr;
  alignas(64) std::atomic<uint32_t> gen_{0};   // bumped per run
  alignas(64) std::atomic<uint32_t> done_{0};  // workers finished with this run
  alignas(64) std::atomic<uint32_t> bar_count_{0};
  std::atomic<uint32_t> bar_gen_{0};  // bumped per completed barrier
  std::atomic<bool> stop_{false};
  std::atomic<int> sleepers_{0};
};

// The process-wide pool used by the drivers when none is given (created on first use with
// CFLOW_THREADS or the hardware concurrency threads).
ThreadPool& global_pool();
// Replaces the global pool by one of n threads (not while a job runs).
void set_num_threads(int n);
int num_threads();

}  // namespace cflow
