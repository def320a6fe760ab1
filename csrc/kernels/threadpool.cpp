#include "cflow/threadpool.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstdio>
#include <memory>
#include <mutex>
#if defined(__linux__)
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define CFLOW_PAUSE() _mm_pause()
#else
#define CFLOW_PAUSE() ((void)0)
#endif

namespace cflow {

namespace {
// Spin budgets: the next run comes after the caller's own work between forwards (sampling:
// ~0.1-1 ms); a barrier partner or the end of a run is close (decode ops take 10-100 us), unless
// the partner's core was taken away. Who took it decides the budget (docs/KERNELS.md, "Thread
// pool"): a hypervisor that runs another tenant on the partner's vCPU gives it back within a
// few ms, and a waiter that slept meanwhile pays its own vCPU's wake-up on top (a halted vCPU
// is rescheduled by the host): spinning kSpinLongUs there made decode steps 15-20% faster in
// the median on a shared 2-vCPU VM and removed its 2-5x outliers. When the guest's own
// scheduler runs more threads than cores, a spinner holds the core its partner waits for: steps
// of 9 ms took 0.3-0.4 s with two busy loops beside the engine. So the pool spins long unless
// its caller thread waited for a core (the scheduler's run delay, which hypervisor contention
// does not add to) for a quarter of a run or more, two runs in a row; then short for a while
// (kShortRuns, doubled at each relapse). A thread that wakes now and then beside the engine (a
// server's event loop handing out tokens, its clients) takes a few percent and is better waited
// out: counting the caller's involuntary context switches instead, as the pool first did, kept a
// server at --parallel 8 on the short budget nearly all the time, its cores idle 12% of it.
constexpr int kSpinIdleUs = 2000;
constexpr int kSpinLongUs = 2000;
constexpr int kSpinShortUs = 50;
constexpr int kShortRuns = 64, kMaxShortRuns = 1 << 14;
constexpr int kDelayShare = 4;    // a run is contended when its delay is >= 1/kDelayShare of it
constexpr int kContendedRow = 2;  // short after this many contended runs in a row
constexpr int kMeasureUs = 200;   // runs after a run this short are not measured

// Where the calling thread stands: its wall clock, its time waiting for a core so far
// (/proc/thread-self/schedstat, -1 where unknown) and its involuntary context switches (the
// fallback signal where the run delay is unknown).
struct Usage {
  int64_t wall_us = 0, delay_us = -1;
  long preempted = 0;
};

int64_t run_delay_us() {
#if defined(__linux__)
  struct Fd {  // per thread, closed when the thread ends; opened again in a forked child's thread
    long tid = -1;
    int fd = -1;
    ~Fd() {
      if (fd >= 0) close(fd);
    }
  };
  thread_local Fd f;
  const long tid = syscall(SYS_gettid);
  if (f.tid != tid) {
    if (f.fd >= 0) close(f.fd);
    f.fd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC), f.tid = tid;
  }
  char buf[128];
  const ssize_t n = f.fd >= 0 ? pread(f.fd, buf, sizeof buf - 1, 0) : -1;
  if (n <= 0) return -1;
  buf[n] = 0;
  unsigned long long on_cpu, delay_ns;
  if (std::sscanf(buf, "%llu %llu", &on_cpu, &delay_ns) != 2) return -1;
  return (int64_t)(delay_ns / 1000);
#else
  return -1;
#endif
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// measured: with the run delay (or the preemptions); else the wall clock alone
Usage usage_now(bool measured) {
  Usage u;
  u.wall_us = now_us();
  if (!measured) return u;
  u.delay_us = run_delay_us();
#if defined(__linux__)
  struct rusage ru;
  if (u.delay_us < 0 && getrusage(RUSAGE_THREAD, &ru) == 0) u.preempted = ru.ru_nivcsw;
#endif
  return u;
}

// CFLOW_SPIN_US fixes the barrier budget (no adaptation); for measurements.
int fixed_spin_us() {
  const char* s = std::getenv("CFLOW_SPIN_US");
  return s && *s ? std::max(0, std::atoi(s)) : -1;
}

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

ThreadPool::ThreadPool(int n_threads)
    : n_(n_threads < 1 ? 1 : n_threads), fixed_spin_us_(fixed_spin_us()), short_runs_(kShortRuns) {
  spin_us_.store(fixed_spin_us_ >= 0 ? fixed_spin_us_ : kSpinLongUs, std::memory_order_relaxed);
  for (int t = 1; t < n_; ++t) threads_.emplace_back([this, t] { worker(t); });
}

void ThreadPool::adapt_spin(bool contended) {
  if (fixed_spin_us_ >= 0) return;
  contended_row_ = contended ? contended_row_ + 1 : 0;
  if (contended_row_ >= kContendedRow) {  // the caller keeps waiting for a core: short spins a while
    if (short_left_ > 0) short_runs_ = std::min(2 * short_runs_, kMaxShortRuns);  // relapse
    short_left_ = short_runs_, calm_runs_ = 0;
    spin_us_.store(kSpinShortUs, std::memory_order_relaxed);
  } else if (short_left_ > 0 && --short_left_ == 0) {
    spin_us_.store(kSpinLongUs, std::memory_order_relaxed);
  } else if (short_left_ == 0 && short_runs_ > kShortRuns && ++calm_runs_ >= kMaxShortRuns) {
    short_runs_ = kShortRuns, calm_runs_ = 0;  // long calm: forget the relapses
  }
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  gen_.fetch_add(1);
  notify(gen_);
  for (auto& t : threads_) t.join();
}

void ThreadPool::wait_change(std::atomic<uint32_t>& w, uint32_t old, int spin_us) {
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

void ThreadPool::notify(std::atomic<uint32_t>& w) {
  if (sleepers_.load() > 0) wake_all(w);
}

void set_thread_name(const char* name) {
#if defined(__linux__)
  char cut[16];
  std::snprintf(cut, sizeof cut, "%s", name);
  pthread_setname_np(pthread_self(), cut);
#else
  (void)name;
#endif
}

void ThreadPool::worker(int tid) {
  set_thread_name("cflow-pool");
  uint32_t seen = 0;
  for (;;) {
    wait_change(gen_, seen, kSpinIdleUs);
    seen = gen_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    fn_(ctx_, tid, n_);
    done_.fetch_add(1);
    notify(done_);
  }
}

void ThreadPool::run(void (*fn)(void*, int, int), void* ctx) {
  if (n_ == 1) {
    fn(ctx, 0, 1);
    return;
  }
  // a run after a short one is not measured: reading the usage twice (about 1 us) would cost a
  // small GEMV a few percent, and a run that short says little about who holds the cores
  const bool measure = fixed_spin_us_ < 0 && last_run_us_ >= kMeasureUs;
  const Usage u0 = usage_now(measure);
  fn_ = fn;
  ctx_ = ctx;
  done_.store(0, std::memory_order_relaxed);
  gen_.fetch_add(1);
  notify(gen_);
  fn(ctx, 0, n_);
  for (uint32_t d; (d = done_.load(std::memory_order_acquire)) != (uint32_t)(n_ - 1);)
    wait_change(done_, d, spin_us_.load(std::memory_order_relaxed));
  const Usage u1 = usage_now(measure);
  const int64_t wall = u1.wall_us - u0.wall_us;
  last_run_us_ = wall;
  if (measure)
    adapt_spin(u0.delay_us >= 0 && u1.delay_us >= 0 ? (u1.delay_us - u0.delay_us) * kDelayShare >= wall
                                                    : u1.preempted - u0.preempted >= 2);
}

void ThreadPool::barrier() {
  if (n_ == 1) return;
  const uint32_t g = bar_gen_.load(std::memory_order_acquire);
  if (bar_count_.fetch_add(1, std::memory_order_acq_rel) == (uint32_t)(n_ - 1)) {
    bar_count_.store(0, std::memory_order_relaxed);
    bar_gen_.fetch_add(1);
    notify(bar_gen_);
    return;
  }
  wait_change(bar_gen_, g, spin_us_.load(std::memory_order_relaxed));
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
