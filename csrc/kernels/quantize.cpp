// Weight quantizers of the writer (format/quant.py) that gguf-py's lack or do worse: Q4_0 with a
// fitted scale (kernels.h quantize_q4_0_fit). Scalar code; sums in double, so the choice
// between candidates does not depend on the order of the additions.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cflow/blocks.h"
#include "cflow/kernels.h"
#include "cflow/threadpool.h"

namespace cflow {
namespace {

constexpr int kSteps = 11;  // s = 7.0, 7.2 .. 9.0: where the block's extreme lands

// The integer nearest v (ties to even), clipped to -8..7: v is first held inside -9..8, where
// adding and subtracting 1.5 * 2^23 rounds to an integer exactly as rint does (no libm call).
inline float nearest_q4(float v) {
  v = v < -9.f ? -9.f : v > 8.f ? 8.f : v;  // comparisons, not fmin/fmax (libm calls here)
  const float magic = 12582912.f;            // IEEE arithmetic: (v + m) - m is not folded to v
  const float r = (v + magic) - magic;
  return r < -8.f ? -8.f : r > 7.f ? 7.f : r;
}

// One block of 32: b -> 18 bytes (fp16 d, then 16 bytes of nibbles, element j low and j + 16 high).
void q4_0_fit_block(const float* b, uint8_t* out) {
  int im = 0;
  for (int i = 1; i < 32; ++i)
    if (std::fabs(b[i]) > std::fabs(b[im])) im = i;
  const float ext = b[im];
  float cand[1 + kSteps];
  cand[0] = ext / -8.f;  // gguf's
  for (int k = 0; k < kSteps; ++k) {
    const float s = (float)(7.0 + 0.2 * k), f = ext != 0.f ? -s / ext : 0.f;
    double ll = 0, bl4[4] = {0, 0, 0, 0};
    for (int i = 0; i < 32; ++i) {
      const float L = nearest_q4(b[i] * f);
      ll += (double)L * L;  // small integers: exact in any order
      bl4[i % 4] += (double)b[i] * L;
    }
    const double bl = (bl4[0] + bl4[1]) + (bl4[2] + bl4[3]);
    cand[1 + k] = ll > 0 ? (float)(bl / ll) : 0.f;
  }
  double best = INFINITY;
  fp16_t best_h = 0;
  float best_inv = 0.f;
  for (float c : cand) {
    if (!std::isfinite(c)) continue;
    const fp16_t h = f32_to_fp16(c);
    const float d = fp16_to_f32(h);
    if (!std::isfinite(d)) continue;
    const float inv = d != 0.f ? 1.f / d : 0.f;  // a zero d gives every weight 0
    double e4[4] = {0, 0, 0, 0};
    for (int i = 0; i < 32; ++i) {
      const double e = (double)b[i] - (double)d * nearest_q4(b[i] * inv);
      e4[i % 4] += e * e;
    }
    const double err = (e4[0] + e4[1]) + (e4[2] + e4[3]);
    if (err < best) best = err, best_h = h, best_inv = inv;
  }
  std::memcpy(out, &best_h, 2);  // little-endian hosts only (as the format)
  for (int j = 0; j < 16; ++j) {
    const int lo = (int)nearest_q4(b[j] * best_inv) + 8, hi = (int)nearest_q4(b[j + 16] * best_inv) + 8;
    out[2 + j] = (uint8_t)(lo | (hi << 4));
  }
}

}  // namespace

void quantize_q4_0_fit(const float* x, int64_t n_blocks, uint8_t* out, ThreadPool* pool) {
  constexpr int64_t kGrain = 4096;  // blocks per piece of work
  const int64_t pieces = (n_blocks + kGrain - 1) / kGrain;
  auto run = [&](int64_t p0, int64_t p1) {
    for (int64_t b = p0 * kGrain, e = std::min(n_blocks, p1 * kGrain); b < e; ++b)
      q4_0_fit_block(x + b * 32, out + b * 18);
  };
  if (!pool || pieces < 2) return run(0, pieces);
  pool->parallel_for((int)pieces, 1, [&](int p0, int p1) { run(p0, p1); });
}

void quantize_q4_0_fit(const float* x, int64_t n_blocks, uint8_t* out, int threads) {
  // a pool of its own: the call may come from any Python thread, beside engines and other callers
  if (threads > 1 && n_blocks >= 2 * 4096) {
    ThreadPool pool(threads);
    quantize_q4_0_fit(x, n_blocks, out, &pool);
  } else {
    quantize_q4_0_fit(x, n_blocks, out, (ThreadPool*)nullptr);
  }
}

}  // namespace cflow
