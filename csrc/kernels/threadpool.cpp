#include "cflow/threadpool.h"

#include <cstdlib>
#include <memory>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define CFLOW_PAUSE() _mm_pause()
#else
#define CFLOW_PAUSE() ((void)0)
#endif

namespace cflow {

namespace {
// Spin iterations before sleeping: ~50-100 us, longer than the gap between the jobs of one
// decode step, far shorter than the gap between user calls.
constexpr int kSpinJob = 1 << 11;
constexpr int kSpinBarrier = 1 << 10;
}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_(n_threads < 1 ? 1 : n_threads) {
  for (int t = 1; t < n_; ++t) threads_.emplace_back([this, t] { worker(t); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
    epoch_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& th : threads_) th.join();
}

void ThreadPool::worker(int tid) {
  unsigned seen = 0;
  for (;;) {
    unsigned e = epoch_.load(std::memory_order_acquire);
    for (int i = 0; e == seen && i < kSpinJob; ++i) {
      CFLOW_PAUSE();
      e = epoch_.load(std::memory_order_acquire);
    }
    if (e == seen) {
      std::unique_lock<std::mutex> lk(mu_);
      sleepers_.fetch_add(1);
      cv_.wait(lk, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
      sleepers_.fetch_sub(1);
      e = epoch_.load(std::memory_order_acquire);
    }
    seen = e;
    if (stop_.load()) return;
    fn_(ctx_, tid, n_);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::run(void (*fn)(void*, int, int), void* ctx) {
  if (n_ == 1) {
    fn(ctx, 0, 1);
    return;
  }
  fn_ = fn;
  ctx_ = ctx;
  pending_.store(n_ - 1, std::memory_order_relaxed);
  {
    // The lock orders the epoch bump against a worker that is about to sleep.
    std::lock_guard<std::mutex> lk(mu_);
    epoch_.fetch_add(1, std::memory_order_release);
  }
  if (sleepers_.load()) cv_.notify_all();
  fn(ctx, 0, n_);
  while (pending_.load(std::memory_order_acquire) != 0) CFLOW_PAUSE();
}

void ThreadPool::barrier() {
  if (n_ == 1) return;
  const unsigned sense = bar_sense_.load(std::memory_order_acquire);
  if (bar_count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
    bar_count_.store(0, std::memory_order_relaxed);
    bar_sense_.store(sense + 1, std::memory_order_release);
    return;
  }
  for (int i = 0; bar_sense_.load(std::memory_order_acquire) == sense; ++i) {
    if (i < kSpinBarrier) CFLOW_PAUSE();
    else std::this_thread::yield();
  }
}

namespace {
std::mutex g_pool_mu;
std::unique_ptr<ThreadPool> g_pool;

int default_threads() {
  if (const char* s = std::getenv("CFLOW_THREADS")) {
    int n = std::atoi(s);
    if (n > 0) return n;
  }
  unsigned hc = std::thread::hardware_concurrency();
  return hc ? (int)hc : 1;
}
}  // namespace

ThreadPool& global_pool() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (!g_pool) g_pool = std::make_unique<ThreadPool>(default_threads());
  return *g_pool;
}

void set_num_threads(int n) {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (g_pool && g_pool->size() == n) return;
  g_pool.reset();
  g_pool = std::make_unique<ThreadPool>(n < 1 ? 1 : n);
}

int num_threads() { return global_pool().size(); }

}  // namespace cflow
