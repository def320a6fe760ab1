// Scalar reference of the small ops (cflow/ops.h), the RoPE tables and the ISA dispatch.
// These are written for clarity and accuracy (double accumulators, libm functions): the SIMD
// versions are tested against them.
#include "cflow/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "cflow/blocks.h"
#include "ops_table.h"

namespace cflow {

// ---- RoPE tables ---------------------------------------------------------------------------

RopeTable rope_table_freqs(int rot_dim, int max_pos, const float* inv_freq) {
  RopeTable t;
  t.rot_dim = rot_dim;
  t.max_pos = max_pos;
  const int half = rot_dim / 2;
  t.cos.resize((size_t)max_pos * half);
  t.sin.resize((size_t)max_pos * half);
  for (int p = 0; p < max_pos; ++p)
    for (int i = 0; i < half; ++i) {
      const double a = (double)p * (double)inv_freq[i];
      t.cos[(size_t)p * half + i] = (float)std::cos(a);
      t.sin[(size_t)p * half + i] = (float)std::sin(a);
    }
  return t;
}

RopeTable rope_table(int rot_dim, int max_pos, double theta) {
  std::vector<float> inv_freq(rot_dim / 2);
  for (int i = 0; i < rot_dim / 2; ++i)
    inv_freq[i] = (float)std::pow(theta, -2.0 * i / rot_dim);
  return rope_table_freqs(rot_dim, max_pos, inv_freq.data());
}

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

void rope(float* x, int T, int n_head, int head_dim, const int32_t* pos, const RopeTable& table,
          RopeStyle style) {
  const int half = table.rot_dim / 2;
  for (int t = 0; t < T; ++t) {
    const float* c = table.cos.data() + (size_t)pos[t] * half;
    const float* s = table.sin.data() + (size_t)pos[t] * half;
    for (int h = 0; h < n_head; ++h) {
      float* v = x + ((size_t)t * n_head + h) * head_dim;
      for (int i = 0; i < half; ++i) {
        // (a, b) is rotated by the angle pos * inv_freq[i].
        const int ia = style == RopeStyle::Neox ? i : 2 * i;
        const int ib = style == RopeStyle::Neox ? i + half : 2 * i + 1;
        const float a = v[ia], b = v[ib];
        v[ia] = a * c[i] - b * s[i];
        v[ib] = b * c[i] + a * s[i];
      }
    }
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

void log_softmax(float* x, int rows, int n) {
  for (int r = 0; r < rows; ++r, x += n) {
    const float m = *std::max_element(x, x + n);
    double sum = 0;
    for (int i = 0; i < n; ++i) sum += std::exp((double)x[i] - m);
    const double lse = m + std::log(sum);
    for (int i = 0; i < n; ++i) x[i] = (float)(x[i] - lse);
  }
}

static inline double silu1(double x) { return x / (1.0 + std::exp(-x)); }
// 0.5 x (1 + tanh(u)) written as x * sigmoid(2u): the same function without the cancellation
// of 1 + tanh(u) for negative x.
static inline double gelu1(double x) {
  const double u = 0.7978845608028654 * (x + 0.044715 * x * x * x);  // sqrt(2/pi) (...)
  return x / (1.0 + std::exp(-2.0 * u));
}

void silu(float* y, const float* x, int n) {
  for (int i = 0; i < n; ++i) y[i] = (float)silu1(x[i]);
}
void gelu_tanh(float* y, const float* x, int n) {
  for (int i = 0; i < n; ++i) y[i] = (float)gelu1(x[i]);
}
void swiglu(float* h, const float* g, const float* u, int n) {
  for (int i = 0; i < n; ++i) h[i] = (float)(silu1(g[i]) * u[i]);
}
void geglu(float* h, const float* g, const float* u, int n) {
  for (int i = 0; i < n; ++i) h[i] = (float)(gelu1(g[i]) * u[i]);
}

void topk(int32_t* idx, float* val, const float* x, int n, int k) {
  // Ranking: larger value first, NaN last, lower index first among equals.
  auto better = [x](int32_t a, int32_t b) {
    const bool na = std::isnan(x[a]), nb = std::isnan(x[b]);
    if (na || nb) return na == nb ? a < b : nb;
    return x[a] != x[b] ? x[a] > x[b] : a < b;
  };
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), better);
  for (int j = 0; j < k; ++j) idx[j] = order[j], val[j] = x[order[j]];
}

// Attention of one query row (head_dim) at position p against keys/values of one KV head.
// kh, vh: (max_ctx, head_dim) of that KV head.
template <class KV>
static void attend_one(float* out, const float* q, const KV* kh, const KV* vh, int p,
                       const AttnShape& s) {
  auto ld = [](KV e) {
    if constexpr (std::is_same<KV, uint16_t>::value) return fp16_to_f32(e);
    else return e;
  };
  const int hd = s.head_dim;
  const int t0 = s.window > 0 ? std::max(0, p + 1 - s.window) : 0;
  std::vector<double> score(p + 1 - t0);
  double m = -INFINITY;
  for (int t = t0; t <= p; ++t) {
    double d = 0;
    for (int i = 0; i < hd; ++i) d += (double)q[i] * ld(kh[(size_t)t * hd + i]);
    d *= s.scale;
    if (s.softcap > 0) d = s.softcap * std::tanh(d / s.softcap);
    score[t - t0] = d;
    m = std::max(m, d);
  }
  double sum = 0;
  for (double& e : score) sum += (e = std::exp(e - m));
  for (int i = 0; i < hd; ++i) {
    double o = 0;
    for (int t = t0; t <= p; ++t) o += score[t - t0] * ld(vh[(size_t)t * hd + i]);
    out[i] = (float)(o / sum);
  }
}

template <class KV>
static void attn_prefill_t(float* out, const float* q, const KV* k, const KV* v, int p0, int T,
                           const AttnShape& s, int head_begin, int head_end) {
  const int group = s.n_head / s.n_kv_head;
  const size_t kv_stride = (size_t)s.max_ctx * s.head_dim;
  for (int t = 0; t < T; ++t)
    for (int h = head_begin; h < head_end; ++h) {
      const size_t row = ((size_t)t * s.n_head + h) * s.head_dim;
      const size_t kv = (size_t)(h / group) * kv_stride;
      attend_one(out + row, q + row, k + kv, v + kv, p0 + t, s);
    }
}

void attn_decode(float* out, const float* q, const float* k, const float* v, int pos,
                 const AttnShape& s, int head_begin, int head_end) {
  attn_prefill_t(out, q, k, v, pos, 1, s, head_begin, head_end);
}
void attn_decode_f16(float* out, const float* q, const uint16_t* k, const uint16_t* v, int pos,
                     const AttnShape& s, int head_begin, int head_end) {
  attn_prefill_t(out, q, k, v, pos, 1, s, head_begin, head_end);
}
void attn_prefill(float* out, const float* q, const float* k, const float* v, int p0, int T,
                  const AttnShape& s, int head_begin, int head_end) {
  attn_prefill_t(out, q, k, v, p0, T, s, head_begin, head_end);
}
void attn_prefill_f16(float* out, const float* q, const uint16_t* k, const uint16_t* v, int p0,
                      int T, const AttnShape& s, int head_begin, int head_end) {
  attn_prefill_t(out, q, k, v, p0, T, s, head_begin, head_end);
}

void add(float* y, const float* a, const float* b, int n) {
  for (int i = 0; i < n; ++i) y[i] = a[i] + b[i];
}
void scale(float* y, const float* x, float s, int n) {
  for (int i = 0; i < n; ++i) y[i] = s * x[i];
}
void f32_to_f16(uint16_t* y, const float* x, int n) {
  for (int i = 0; i < n; ++i) y[i] = f32_to_fp16(x[i]);
}
void f16_to_f32(float* y, const uint16_t* x, int n) {
  for (int i = 0; i < n; ++i) y[i] = fp16_to_f32(x[i]);
}

}  // namespace ref

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
