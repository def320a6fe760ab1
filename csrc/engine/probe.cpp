// STREAM-like read-bandwidth probe on the engine's own thread pool.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "cflow/engine.h"
#include "pool.h"

namespace cflow {

double read_bandwidth(size_t nbytes, int threads, int reps) {
  const size_t n = nbytes / sizeof(float) / 64 * 64;
  std::unique_ptr<float[]> buf(new float[n]);
  Pool pool(threads);
  // Each thread first touches its own slice (pages land near the thread that reads them).
  std::function<void(int)> touch = [&](int t) {
    const size_t a = n * t / threads, b = n * (t + 1) / threads;
    for (size_t i = a; i < b; ++i) buf[i] = 1.f;
  };
  pool.run(touch);
  std::vector<float> sink(threads);
  std::function<void(int)> read = [&](int t) {
    const size_t a = n * t / threads / 64 * 64, b = t == threads - 1 ? n : n * (t + 1) / threads / 64 * 64;
    sink[t] += read_sum(buf.get() + a, b - a);
  };
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    pool.run(read);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, n * sizeof(float) / s / 1e9);
  }
  volatile float keep = sink[0];
  (void)keep;
  return best;
}

}  // namespace cflow
