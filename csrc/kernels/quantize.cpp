// Weight quantizers of the writer (format/quant.py) that do better than gguf-py's: Q4_0 and Q4_1
// with fitted scales (kernels.h quantize_q4_0_fit, quantize_q4_1_fit). Scalar code; sums in
// double, so the choice between candidates does not depend on the order of the additions.
// Errors and least-squares fits are weighted by an importance per column when one is given (a
// block's 32 weights w); without one every w is 1, and the products by 1 change no sum.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "cflow/blocks.h"
#include "cflow/kernels.h"
#include "cflow/threadpool.h"

namespace cflow {
namespace {

constexpr int kSteps = 11;  // s = 7.0, 7.2 .. 9.0: where the block's extreme lands

// The integer nearest v (ties to even), clipped to lo..hi: v is first held inside lo - 1 ..
// hi + 1, where adding and subtracting 1.5 * 2^23 rounds to an integer exactly as rint does.
// Comparisons, not fmin/fmax (libm calls here, without -ffast-math).
inline float nearest(float v, float lo, float hi) {
  v = v < lo - 1.f ? lo - 1.f : v > hi + 1.f ? hi + 1.f : v;
  const float magic = 12582912.f;  // IEEE arithmetic: (v + m) - m is not folded to v
  const float r = (v + magic) - magic;
  return r < lo ? lo : r > hi ? hi : r;
}

// Squared error (weighted by w) of block b as d * q + m with each q the integer in lo..hi nearest (x - m) / d
// (a zero d gives every q 0 clipped to lo..hi); the q written to L when given. Sums in double.
double fit_error(const float* b, const float* w, float d, float m, float lo, float hi, float* L) {
  const float inv = d != 0.f ? 1.f / d : 0.f;
  double e4[4] = {0, 0, 0, 0};
  for (int i = 0; i < 32; ++i) {
    const float q = nearest((b[i] - m) * inv, lo, hi);
    if (L) L[i] = q;
    const double e = (double)b[i] - ((double)d * q + (double)m);
    e4[i % 4] += (double)w[i] * e * e;
  }
  return (e4[0] + e4[1]) + (e4[2] + e4[3]);
}

// Block b as nibbles: element j low, j + 16 high, each q + bias.
void put_nibbles(const float* L, int bias, uint8_t* out) {
  for (int j = 0; j < 16; ++j) out[j] = (uint8_t)(((int)L[j] + bias) | (((int)L[j + 16] + bias) << 4));
}

// One block of 32: b -> 18 bytes (fp16 d, then 16 bytes of nibbles).
// False when no candidate scale is a finite fp16 (values beyond 8 * 65504): the block is zeros.
bool q4_0_fit_block(const float* b, const float* w, uint8_t* out) {
  int im = 0;
  for (int i = 1; i < 32; ++i)
    if (std::fabs(b[i]) > std::fabs(b[im])) im = i;
  const float ext = b[im];
  float cand[1 + kSteps];
  cand[0] = ext / -8.f;  // gguf's
  for (int k = 0; k < kSteps; ++k) {
    const float s = (float)(7.0 + 0.2 * k), f = ext != 0.f ? -s / ext : 0.f;
    double ll4[4] = {0, 0, 0, 0}, bl4[4] = {0, 0, 0, 0};
    for (int i = 0; i < 32; ++i) {
      const float L = nearest(b[i] * f, -8.f, 7.f);
      ll4[i % 4] += (double)w[i] * L * L;
      bl4[i % 4] += (double)w[i] * b[i] * L;
    }
    const double ll = (ll4[0] + ll4[1]) + (ll4[2] + ll4[3]);
    const double bl = (bl4[0] + bl4[1]) + (bl4[2] + bl4[3]);
    cand[1 + k] = ll > 0 ? (float)(bl / ll) : 0.f;
  }
  double best = INFINITY;
  fp16_t best_h = 0;
  for (float c : cand) {
    if (!std::isfinite(c)) continue;
    const fp16_t h = f32_to_fp16(c);
    const float d = fp16_to_f32(h);
    if (!std::isfinite(d)) continue;
    const double err = fit_error(b, w, d, 0.f, -8.f, 7.f, nullptr);
    if (err < best) best = err, best_h = h;
  }
  float L[32];
  fit_error(b, w, fp16_to_f32(best_h), 0.f, -8.f, 7.f, L);
  std::memcpy(out, &best_h, 2);  // little-endian hosts only (as the format)
  put_nibbles(L, 8, out + 2);
  return best < INFINITY;
}

// One Q4_1 block: b -> 20 bytes (fp16 d, fp16 m, 16 bytes of nibbles). Candidates: gguf's (d =
// (max - min) / 15, m = min), and for the grids that spread the block's range over 14.0, 14.1
// .. 16.0 steps, the least-squares (d, m) of that grid's integers (the regression of x on q);
// each rounded to fp16 and its integers refitted, the least squared error kept. False when no
// candidate is a finite fp16 pair (a range or a minimum beyond 65504 and 15 * 65504).
bool q4_1_fit_block(const float* b, const float* w, uint8_t* out) {
  float lo = b[0], hi = b[0];
  for (int i = 1; i < 32; ++i) lo = b[i] < lo ? b[i] : lo, hi = b[i] > hi ? b[i] : hi;
  float cd[22], cm[22];
  int nc = 0;
  cd[nc] = (hi - lo) / 15.f, cm[nc++] = lo;  // gguf's
  if (hi > lo)
    for (int k = 0; k <= 20; ++k) {
      const float is = (14.f + 0.1f * k) / (hi - lo);
      double sw = 0, sl = 0, sll = 0, sx = 0, slx = 0;
      for (int i = 0; i < 32; ++i) {
        const float q = nearest((b[i] - lo) * is, 0.f, 15.f);
        sw += w[i], sl += (double)w[i] * q, sll += (double)w[i] * q * q, sx += (double)w[i] * b[i],
            slx += (double)w[i] * q * b[i];
      }
      const double den = sw * sll - sl * sl;
      if (den <= 0) continue;
      const double d = (sw * slx - sl * sx) / den;
      cd[nc] = (float)d, cm[nc++] = (float)((sx - d * sl) / sw);
    }
  double best = INFINITY;
  fp16_t bd = 0, bm = 0;
  for (int c = 0; c < nc; ++c) {
    if (!std::isfinite(cd[c]) || !std::isfinite(cm[c]) || cd[c] < 0) continue;
    const fp16_t hd = f32_to_fp16(cd[c]), hm = f32_to_fp16(cm[c]);
    const float d = fp16_to_f32(hd), m = fp16_to_f32(hm);
    if (!std::isfinite(d) || !std::isfinite(m)) continue;
    const double err = fit_error(b, w, d, m, 0.f, 15.f, nullptr);
    if (err < best) best = err, bd = hd, bm = hm;
  }
  float L[32];
  fit_error(b, w, fp16_to_f32(bd), fp16_to_f32(bm), 0.f, 15.f, L);
  std::memcpy(out, &bd, 2);  // little-endian hosts only (as the format)
  std::memcpy(out + 2, &bm, 2);
  put_nibbles(L, 0, out + 4);
  return best < INFINITY;
}

// Blocks [0, n) of x through fit (32 floats -> bb bytes each), pieces of kGrain over the pool;
// block b weighted by importance[(b % row_blocks) * 32 ..] (a row's columns), or by ones.
// Returns how many blocks fit refused.
template <class Fit>
int64_t fit_blocks(Fit fit, int bb, const float* x, int64_t n_blocks, uint8_t* out, int threads,
                   const float* importance, int64_t row_blocks) {
  constexpr int64_t kGrain = 4096;  // blocks per piece of work
  static const float kOnes[32] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                  1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  const int64_t pieces = (n_blocks + kGrain - 1) / kGrain;
  std::atomic<int64_t> refused{0};
  auto run = [&](int64_t p0, int64_t p1) {
    int64_t r = 0;
    for (int64_t b = p0 * kGrain, e = std::min(n_blocks, p1 * kGrain); b < e; ++b) {
      const float* w = importance ? importance + (b % row_blocks) * 32 : kOnes;
      r += !fit(x + b * 32, w, out + b * bb);
    }
    refused += r;
  };
  if (threads < 2 || pieces < 2) {
    run(0, pieces);
  } else {
    ThreadPool pool(threads);  // a pool of its own: the call may come from any Python thread
    pool.parallel_for((int)pieces, 1, [&](int p0, int p1) { run(p0, p1); });
  }
  return refused.load();
}

}  // namespace

int64_t quantize_q4_1_fit(const float* x, int64_t n_blocks, uint8_t* out, int threads, const float* importance,
                          int64_t row_blocks) {
  return fit_blocks(q4_1_fit_block, 20, x, n_blocks, out, threads, importance, row_blocks);
}

int64_t quantize_q4_0_fit(const float* x, int64_t n_blocks, uint8_t* out, int threads, const float* importance,
                          int64_t row_blocks) {
  return fit_blocks(q4_0_fit_block, 18, x, n_blocks, out, threads, importance, row_blocks);
}

}  // namespace cflow
