// Scalar reference of the small ops (cflow/ops.h) and the ISA dispatch.
// These are written for clarity and accuracy (double accumulators, libm functions): the SIMD
// versions are tested against them.
#include "cflow/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <vector>

#include "cflow/blocks.h"
#include "ops_table.h"

namespace cflow {

namespace ref {

void rmsnorm(float* y, const float* x, const float* w, int rows, int n, float eps,
             float w_offset) {
  for (int r = 0; r < rows; ++r, x += n, y += n) {
    double ss = 0;
    for (int i = 0; i < n; ++i) ss += (double)x[i] * x[i];
    const double inv = 1.0 / std::sqrt(ss / n + eps);
    for (int i = 0; i < n; ++i) y[i] = (float)(x[i] * inv * (w_offset + (double)w[i]));
  }
}

void softmax(float* x, int rows, int n) {
  for (int r = 0; r < rows; ++r, x += n) {
    const float m = *std::max_element(x, x + n);
    double sum = 0;
    for (int i = 0; i < n; ++i) sum += std::exp((double)x[i] - m);
    for (int i = 0; i < n; ++i) x[i] = (float)(std::exp((double)x[i] - m) / sum);
  }
}

static inline double silu1(double x) { return x / (1.0 + std::exp(-x)); }
// 0.5 x (1 + tanh(u)) written as x * sigmoid(2u): the same function without the cancellation
// of 1 + tanh(u) for negative x.
static inline double gelu1(double x) {
  const double u = 0.7978845608028654 * (x + 0.044715 * x * x * x);  // sqrt(2/pi) (...)
  return x / (1.0 + std::exp(-2.0 * u));
}

void swiglu(float* h, const float* g, const float* u, int n) {
  for (int i = 0; i < n; ++i) h[i] = (float)(silu1(g[i]) * u[i]);
}
void geglu(float* h, const float* g, const float* u, int n) {
  for (int i = 0; i < n; ++i) h[i] = (float)(gelu1(g[i]) * u[i]);
}

void dot_rows(const float* q, const float* K, size_t ldk, int n, int hd, float* out) {
  for (int j = 0; j < n; ++j) {
    const float* k = K + (size_t)j * ldk;
    float s = 0;
    for (int i = 0; i < hd; ++i) s += q[i] * k[i];
    out[j] = s;
  }
}

void mix_rows(const float* p, const float* V, size_t ldv, int n, int hd, float* out) {
  for (int j = 0; j < n; ++j) {
    const float* v = V + (size_t)j * ldv;
    for (int i = 0; i < hd; ++i) out[i] += p[j] * v[i];
  }
}

void dot_rows_n(const float* q, size_t ldq, int nq, const float* K, size_t ldk, int n, int hd, float* out, size_t ldo) {
  for (int m = 0; m < nq; ++m) dot_rows(q + m * ldq, K, ldk, n, hd, out + m * ldo);
}

void mix_rows_n(const float* p, size_t ldp, int nq, const float* V, size_t ldv, int n, int hd, float* out, size_t ldo) {
  for (int m = 0; m < nq; ++m) mix_rows(p + m * ldp, V, ldv, n, hd, out + m * ldo);
}

// The half-cache forms widen each row to floats first: the float ops' results on the same values.
void dot_rows_n_h(const float* q, size_t ldq, int nq, const uint16_t* K, size_t ldk, int n, int hd, float* out,
                  size_t ldo) {
  std::vector<float> k((size_t)hd);
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < hd; ++i) k[i] = fp16_to_f32(K[(size_t)j * ldk + i]);
    for (int m = 0; m < nq; ++m) dot_rows(q + m * ldq, k.data(), 0, 1, hd, out + m * ldo + j);
  }
}

void mix_rows_n_h(const float* p, size_t ldp, int nq, const uint16_t* V, size_t ldv, int n, int hd, float* out,
                  size_t ldo) {
  std::vector<float> v((size_t)hd);
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < hd; ++i) v[i] = fp16_to_f32(V[(size_t)j * ldv + i]);
    for (int m = 0; m < nq; ++m) mix_rows(p + m * ldp + j, v.data(), 0, 1, hd, out + m * ldo);
  }
}

void to_half(const float* x, uint16_t* y, int n) {
  for (int i = 0; i < n; ++i) y[i] = f32_to_fp16(x[i]);
}

void from_q8(const uint8_t* x, int rows, int hd, float* y) {
  for (int b = 0; b < rows * (hd / 32); ++b, x += kQ8Block, y += 32) {
    fp16_t h;
    std::memcpy(&h, x, 2);
    const float d = fp16_to_f32(h);
    for (int i = 0; i < 32; ++i) y[i] = d * (float)(int8_t)x[2 + i];
  }
}

float exp_max(float* x, int n, float* mx) {
  const float m = *mx = *std::max_element(x, x + n);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += x[i] = (float)std::exp((double)x[i] - m);
  return (float)sum;
}

bool block_maxima(const float* x, int n, int run, float* out) {
  for (int j = 0; j < n / run; ++j) out[j] = *std::max_element(x + (size_t)j * run, x + (size_t)(j + 1) * run);
  for (int i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

int at_least(const float* x, int n, float bound, int32_t* ids) {
  int c = 0;
  for (int i = 0; i < n; ++i)
    if (x[i] >= bound) ids[c++] = i;
  return c;
}

}  // namespace ref

void to_q8_0(const float* x, uint8_t* y, int n) {
  for (int b = 0; b < n / 32; ++b, x += 32, y += kQ8Block) {
    float amax = 0.f;
    bool finite = true;
    for (int i = 0; i < 32; ++i) {
      amax = std::max(amax, std::fabs(x[i]));
      finite = finite && std::isfinite(x[i]);
    }
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    const fp16_t h = finite ? f32_to_fp16(d) : (fp16_t)0x7e00;  // a NaN scale: the block's values are NaN
    std::memcpy(y, &h, 2);
    for (int i = 0; i < 32; ++i)
      y[2 + i] = (uint8_t)(int8_t)(finite ? std::clamp(std::round(x[i] * id), -127.f, 127.f) : 0.f);
  }
}

constexpr int kTopKRun = 256;  // values per run of top_k_ids' bound

bool top_k_ids(const OpsTable& t, const float* x, int n, int k, std::vector<int32_t>& ids) {
  const int run = std::max(1, std::min(kTopKRun, n / k)), R = n / run;  // R >= k runs
  thread_local std::vector<float> mx;
  mx.resize(R);
  if (!t.block_maxima(x, n, run, mx.data())) return false;
  std::nth_element(mx.begin(), mx.begin() + (R - k), mx.end());
  const float bound = mx[R - k];  // the k-th largest run maximum
  thread_local std::vector<int32_t> near;  // room for every index, kept (zeroing n costs more than the search)
  thread_local std::vector<float> v;
  if (near.size() < (size_t)n) near.resize(n);
  const int c = t.at_least(x, n, bound, near.data());  // >= k: the k runs' maxima reach bound
  v.resize(c);
  for (int i = 0; i < c; ++i) v[i] = x[near[i]];
  std::nth_element(v.begin(), v.begin() + (c - k), v.end());
  const float kth = v[c - k];  // the k-th largest
  ids.clear();
  for (int i = 0; i < c; ++i)
    if (x[near[i]] >= kth) ids.push_back(near[i]);
  return true;
}

// The draw of sample_top_k over candidates ids (ascending) with float64 logits p (overwritten).
static int draw(const std::vector<int32_t>& ids, std::vector<double>& p, double temperature, double top_p,
                double min_p, double u) {
  thread_local std::vector<int> order;
  const int c = (int)ids.size();
  double mx = -INFINITY, sum = 0;
  for (int i = 0; i < c; ++i) mx = std::max(mx, p[i]);
  for (int i = 0; i < c; ++i) sum += p[i] = std::exp((p[i] - mx) / temperature);  // shifted first: no overflow
  for (int i = 0; i < c; ++i) p[i] /= sum;
  if (top_p < 1.0) {  // the fewest most likely whose mass reaches top_p; ties in id order
    order.resize(c);
    for (int i = 0; i < c; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
    double total = 0;
    for (int i = 0; i < c; ++i) total += p[order[i]];
    const double reach = top_p * total;
    double cum = 0;
    int keep = c;
    for (int i = 0; i < c; ++i)
      if ((cum += p[order[i]]) >= reach) {
        keep = i + 1;
        break;
      }
    for (int i = keep; i < c; ++i) p[order[i]] = 0;
  }
  double top = 0;
  for (int i = 0; i < c; ++i) top = std::max(top, p[i]);
  double cdf = 0;
  for (int i = 0; i < c; ++i) cdf += p[i] = p[i] >= min_p * top ? p[i] : 0;  // min_p
  double run = 0;
  for (int i = 0; i < c; ++i)
    if (p[i] > 0 && (run += p[i]) / cdf > u) return ids[i];
  for (int i = c - 1; i >= 0; --i)  // u past every rounded sum: the last token kept
    if (p[i] > 0) return ids[i];
  return ids[0];
}

int sample_top_k(const OpsTable& t, const float* x, int n, int k, double temperature, double top_p, double min_p,
                 double u) {
  thread_local std::vector<int32_t> ids;
  thread_local std::vector<double> p;
  if (!top_k_ids(t, x, n, k, ids)) return -1;
  p.resize(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) p[i] = x[ids[i]];
  return draw(ids, p, temperature, top_p, min_p, u);
}

// Distinct history tokens up to which penalised_top_k selects the k + h largest of x itself;
// beyond, the k largest of a copy with the history's values lowered (a copy of the vocabulary
// costs less than a selection of thousands).
constexpr int kPenaltyDirect = 256;

bool moved_top_k(const OpsTable& t, const float* x, int n, int k, const int32_t* moved, const double* values,
                 int h, std::vector<int32_t>& ids, std::vector<double>& vals) {
  thread_local std::vector<uint8_t> mark;  // per token: 1 if moved; all zero between calls
  thread_local std::vector<int32_t> top;
  thread_local std::vector<float> rest;
  thread_local std::vector<std::pair<int32_t, double>> cand;
  thread_local std::vector<double> v;
  if (mark.size() < (size_t)n) mark.resize(n, 0);
  for (int i = 0; i < h; ++i) mark[moved[i]] = 1;
  auto unmark = [&] {
    for (int i = 0; i < h; ++i) mark[moved[i]] = 0;
  };
  if (k + h >= n) {  // the caller moves the whole vocabulary
    unmark();
    return false;
  }
  bool finite = true;
  if (h <= kPenaltyDirect) {
    finite = top_k_ids(t, x, n, k + h, top);
  } else {  // many moved: the k largest of the tokens outside them, from a copy without them
    rest.assign(x, x + n);
    for (int i = 0; i < h; ++i) {
      finite &= std::isfinite(x[moved[i]]);  // what the copy hides: not finite fails as top_k_ids does
      rest[moved[i]] = -std::numeric_limits<float>::max();
    }
    finite = finite && top_k_ids(t, rest.data(), n, k, top);
  }
  if (!finite) {
    unmark();
    return false;
  }
  // The unmoved tokens among `top`: at least k; the k-th largest of them bounds the answer's
  // k-th value from below, so a moved token under it is out.
  cand.clear();
  for (int32_t i : top)
    if (!mark[i]) cand.emplace_back(i, x[i]);
  unmark();
  if (cand.size() < (size_t)k) return false;  // logits at -FLT_MAX tied with the hidden ones: the whole vocabulary
  v.clear();
  for (auto& c : cand) v.push_back(c.second);
  std::nth_element(v.begin(), v.begin() + (v.size() - k), v.end());
  const double floor = v[v.size() - k];
  for (int i = 0; i < h; ++i)
    if (values[i] >= floor) cand.emplace_back(moved[i], values[i]);
  v.clear();
  for (auto& c : cand) v.push_back(c.second);
  std::nth_element(v.begin(), v.begin() + (v.size() - k), v.end());
  const double kth = v[v.size() - k];  // the k-th largest value after the moves
  std::sort(cand.begin(), cand.end());  // id order
  ids.clear();
  vals.clear();
  for (auto& [i, a] : cand)
    if (a >= kth) {
      ids.push_back(i);
      vals.push_back(a);
    }
  return true;
}

// The history's distinct tokens (first seen first) and their values after a repetition penalty.
static void penalised_moves(const float* x, int n, const int32_t* history, int len, double penalty,
                            std::vector<int32_t>& seen, std::vector<double>& moved) {
  thread_local std::vector<uint8_t> mark;  // per token: 1 in the history; all zero between calls
  if (mark.size() < (size_t)n) mark.resize(n, 0);
  seen.clear();
  for (int i = 0; i < len; ++i)
    if (!mark[history[i]]) {
      mark[history[i]] = 1;
      seen.push_back(history[i]);
    }
  for (int32_t s : seen) mark[s] = 0;
  const double big = std::numeric_limits<double>::max() / 4;
  moved.clear();
  for (int32_t s : seen) {
    const double a = x[s];
    moved.push_back(std::clamp(a > 0 ? a / penalty : a * penalty, -big, big));
  }
}

bool penalised_top_k(const OpsTable& t, const float* x, int n, int k, const int32_t* history, int len,
                     double penalty, std::vector<int32_t>& ids, std::vector<double>& vals) {
  thread_local std::vector<int32_t> seen;
  thread_local std::vector<double> moved;
  penalised_moves(x, n, history, len, penalty, seen, moved);
  return moved_top_k(t, x, n, k, seen.data(), moved.data(), (int)seen.size(), ids, vals);
}

int sample_top_k_moved(const OpsTable& t, const float* x, int n, int k, const int32_t* moved, const double* values,
                       int h, double temperature, double top_p, double min_p, double u) {
  thread_local std::vector<int32_t> ids;
  thread_local std::vector<double> p;
  if (!moved_top_k(t, x, n, temperature == 0 ? 1 : k, moved, values, h, ids, p)) return -1;
  if (temperature == 0) return ids[std::max_element(p.begin(), p.end()) - p.begin()];  // the first of ties
  return draw(ids, p, temperature, top_p, min_p, u);
}

int sample_top_k_penalised(const OpsTable& t, const float* x, int n, int k, const int32_t* history, int len,
                           double penalty, double temperature, double top_p, double min_p, double u) {
  thread_local std::vector<int32_t> seen;
  thread_local std::vector<double> moved;
  penalised_moves(x, n, history, len, penalty, seen, moved);
  return sample_top_k_moved(t, x, n, k, seen.data(), moved.data(), (int)seen.size(), temperature, top_p, min_p, u);
}

// ---- dispatch ------------------------------------------------------------------------------

static const OpsTable kScalar = CFLOW_OPS_TABLE(ref, Isa::Scalar);

#if defined(CFLOW_X86)
const OpsTable& ops_table_avx2();    // kernels/x86/avx2/ops.cpp
const OpsTable& ops_table_avx512();  // kernels/x86/avx512/ops.cpp
#endif

const OpsTable& ops_table(Isa isa) {
#if defined(CFLOW_X86)
  if (isa == Isa::Avx512 && isa_supported(Isa::Avx512)) return ops_table_avx512();
  if (isa == Isa::Avx2 && isa_supported(Isa::Avx2)) return ops_table_avx2();
#endif
  return kScalar;
}

const OpsTable& ops() {
  static const OpsTable& t = ops_table(best_isa());
  return t;
}

}  // namespace cflow
