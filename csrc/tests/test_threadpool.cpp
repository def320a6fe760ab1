// The thread pool's runs and barriers (cflow/threadpool.h): every thread runs every job, and no
// thread passes a barrier before all have reached it, whichever way the waits end: spinning
// (the adaptive budget, as the engine runs) or sleeping on the futex at once (CFLOW_SPIN_US=0,
// every wait through the sleep and wake path). Counts only, no timing.
#include <atomic>
#include <cstdlib>

#include "cflow/threadpool.h"
#include "test_util.h"

using namespace cflow;

static bool runs_and_barriers_hold(int threads) {
  ThreadPool pool(threads);
  constexpr int kRuns = 300, kPhases = 6;
  std::atomic<int> arrived[kPhases];
  bool ok = true;
  for (int run = 0; run < kRuns; ++run) {
    for (auto& a : arrived) a.store(0);
    std::atomic<int> ran{0}, early{0};
    pool.run([&](int, int nth) {
      ran.fetch_add(1);
      for (int p = 0; p < kPhases; ++p) {
        arrived[p].fetch_add(1);
        pool.barrier();
        if (arrived[p].load() != nth) early.fetch_add(1);  // passed before a partner arrived
      }
    });
    ok &= ran.load() == threads && early.load() == 0;
  }
  return ok;
}

TEST(thread_pool_runs_every_job_and_holds_every_barrier) {
  const char* was = std::getenv("CFLOW_SPIN_US");
  for (const char* spin : {"0", ""}) {  // sleep at once; then the adaptive budget
    setenv("CFLOW_SPIN_US", spin, 1);
    for (int threads : {1, 2, 3}) CHECK(runs_and_barriers_hold(threads));
  }
  if (was) setenv("CFLOW_SPIN_US", was, 1);
  else unsetenv("CFLOW_SPIN_US");
}
