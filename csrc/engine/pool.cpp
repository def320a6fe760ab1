#include "pool.h"

#include <chrono>
#if defined(__x86_64__)
#include <immintrin.h>
#define CFLOW_PAUSE() _mm_pause()
#else
#define CFLOW_PAUSE() ((void)0)
#endif

namespace cflow {

// Spin briefly, then yield so a descheduled partner thread can run on a busy machine.
static inline void backoff(int& spins) {
  if (++spins < 2000) CFLOW_PAUSE();
  else std::this_thread::yield();
}

Pool::Pool(int n) : n_(n < 1 ? 1 : n) {
  for (int t = 1; t < n_; ++t) threads_.emplace_back([this, t] { worker(t); });
}

Pool::~Pool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    gen_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void Pool::worker(int tid) {
  uint64_t seen = 0;
  for (;;) {
    int spins = 0;
    auto t0 = std::chrono::steady_clock::now();
    while (gen_.load(std::memory_order_acquire) == seen) {
      backoff(spins);
      if ((spins & 1023) == 0 && std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(5)) {
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1);
        cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
        sleepers_.fetch_sub(1);
      }
    }
    seen = gen_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    (*fn_)(tid);
    done_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void Pool::run(const std::function<void(int)>& fn) {
  if (n_ == 1) { fn(0); return; }
  fn_ = &fn;
  done_.store(0, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lk(mu_);
    gen_.fetch_add(1, std::memory_order_release);
  }
  if (sleepers_.load()) cv_.notify_all();
  fn(0);
  int spins = 0;
  while (done_.load(std::memory_order_acquire) != n_ - 1) backoff(spins);
}

void Pool::barrier() {
  if (n_ == 1) return;
  const uint64_t g = bar_gen_.load(std::memory_order_acquire);
  if (bar_count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
    bar_count_.store(0, std::memory_order_relaxed);
    bar_gen_.fetch_add(1, std::memory_order_release);
    return;
  }
  int spins = 0;
  while (bar_gen_.load(std::memory_order_acquire) == g) backoff(spins);
}

}  // namespace cflow
