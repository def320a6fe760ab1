#include "cflow/probe.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>

#include "cflow/threadpool.h"

namespace cflow {

float read_sum(const float* p, size_t n, Isa isa) {
#if defined(CFLOW_X86)
  if (isa == Isa::Avx512 && isa_supported(Isa::Avx512)) return avx512::read_sum(p, n);
  if (isa >= Isa::Avx2 && isa_supported(Isa::Avx2)) return avx2::read_sum(p, n);
#endif
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 independent chains
  for (size_t i = 0; i < n; i += 8)
    for (int k = 0; k < 8; ++k) s[k] += p[i + k];
  return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

std::vector<double> probe_read(size_t bytes, int threads, int repeats, Isa isa) {
  const size_t align = 2u << 20;
  bytes = (bytes + align - 1) / align * align;
  void* mem = nullptr;
  if (posix_memalign(&mem, align, bytes)) return {};
#ifdef MADV_HUGEPAGE
  madvise(mem, bytes, MADV_HUGEPAGE);
#endif
  float* buf = (float*)mem;
  const size_t n = bytes / sizeof(float);
  for (size_t i = 0; i < n; ++i) buf[i] = (float)(i & 1023) * 1e-3f;  // fault in, non-zero
  ThreadPool pool(threads);
  const int nt = pool.size();
  volatile float sink = 0.0f;
  std::vector<float> part(nt * 16);  // one cache line per thread
  auto pass = [&] {
    pool.run([&](int tid, int nth) {
      const size_t chunk = n / nth / 64 * 64;
      const size_t b = chunk * tid, e = tid == nth - 1 ? n / 64 * 64 : b + chunk;
      part[tid * 16] = read_sum(buf + b, e - b, isa);
    });
    for (int t = 0; t < nt; ++t) sink = sink + part[t * 16];
  };
  pass();  // warm-up: page tables, thread wake-up
  std::vector<double> gbps;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pass();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    gbps.push_back((double)(n / 64 * 64 * sizeof(float)) / s * 1e-9);
  }
  std::free(mem);
  return gbps;
}

}  // namespace cflow
