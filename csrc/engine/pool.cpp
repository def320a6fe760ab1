#include "pool.h"

#include <chrono>
#include <climits>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#define CFLOW_PAUSE() _mm_pause()
#else
#define CFLOW_PAUSE() ((void)0)
#endif

namespace cflow {

namespace {
// Spin budgets: a barrier partner or the end of a run is close (decode ops take 10-100 us); the
// next run comes after the caller's own work between forwards (sampling: ~0.1-1 ms).
constexpr int kSpinBarrierUs = 50;
constexpr int kSpinIdleUs = 2000;

void sleep_while(std::atomic<uint32_t>& w, uint32_t old) {
#if defined(__linux__)
  // The kernel compares *w with old atomically, so a change made after our last look wakes us.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&w), FUTEX_WAIT_PRIVATE, old, nullptr, nullptr, 0);
#else
  (void)w;
  (void)old;
  std::this_thread::yield();
#endif
}

void wake_all(std::atomic<uint32_t>& w) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&w), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#else
  (void)w;
#endif
}
}  // namespace

Pool::Pool(int n) : n_(n < 1 ? 1 : n) {
  for (int t = 1; t < n_; ++t) threads_.emplace_back([this, t] { worker(t); });
}

Pool::~Pool() {
  stop_.store(true);
  gen_.fetch_add(1);
  notify(gen_);
  for (auto& t : threads_) t.join();
}

void Pool::wait_change(std::atomic<uint32_t>& w, uint32_t old, int spin_us) {
  using clk = std::chrono::steady_clock;
  const auto t0 = clk::now();
  for (int spins = 1; w.load(std::memory_order_acquire) == old; ++spins) {
    if ((spins & 63) || clk::now() - t0 < std::chrono::microseconds(spin_us)) {
      CFLOW_PAUSE();
      continue;
    }
    // Dekker with notify(): our sleepers_ increment and the changer's write to w are both
    // seq_cst, so either we see the new value here or the changer sees us and wakes us.
    sleepers_.fetch_add(1);
    if (w.load() == old) sleep_while(w, old);
    sleepers_.fetch_sub(1);
  }
}

void Pool::notify(std::atomic<uint32_t>& w) {
  if (sleepers_.load() > 0) wake_all(w);
}

void Pool::worker(int tid) {
  uint32_t seen = 0;
  for (;;) {
    wait_change(gen_, seen, kSpinIdleUs);
    seen = gen_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    (*fn_)(tid);
    done_.fetch_add(1);
    notify(done_);
  }
}

void Pool::run(const std::function<void(int)>& fn) {
  if (n_ == 1) { fn(0); return; }
  fn_ = &fn;
  done_.store(0, std::memory_order_relaxed);
  gen_.fetch_add(1);
  notify(gen_);
  fn(0);
  for (uint32_t d; (d = done_.load(std::memory_order_acquire)) != (uint32_t)(n_ - 1);)
    wait_change(done_, d, kSpinBarrierUs);
}

void Pool::barrier() {
  if (n_ == 1) return;
  const uint32_t g = bar_gen_.load(std::memory_order_acquire);
  if (bar_count_.fetch_add(1, std::memory_order_acq_rel) == (uint32_t)(n_ - 1)) {
    bar_count_.store(0, std::memory_order_relaxed);
    bar_gen_.fetch_add(1);
    notify(bar_gen_);
    return;
  }
  wait_change(bar_gen_, g, kSpinBarrierUs);
}

}  // namespace cflow
