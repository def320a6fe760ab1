// Tests of the small ops: the scalar reference against closed forms, and every SIMD path this
// CPU supports against the scalar reference on random data with ragged sizes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <cstring>
#include <vector>

#include "cflow/blocks.h"
#include "cflow/ops.h"
#include "test_util.h"

using namespace cflow;

namespace {

std::vector<float> randn(size_t n, uint32_t seed, float sd = 1.f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, sd);
  std::vector<float> v(n);
  for (auto& e : v) e = d(g);
  return v;
}

// max |a - b| / (|b| + atol) over all elements.
double max_rel(const std::vector<float>& a, const std::vector<float>& b, double atol = 1e-6) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::fabs((double)a[i] - b[i]) / (std::fabs((double)b[i]) + atol));
  return m;
}

// max |a - b| / max |b|: the error relative to the scale of the result (a dot product can be
// near zero in single elements).
double norm_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    e = std::max(e, std::fabs((double)a[i] - b[i])), m = std::max(m, std::fabs((double)b[i]));
  return e / m;
}

// The SIMD tables this CPU runs (the scalar one is the reference they meet).
std::vector<const OpsTable*> simd_tables() {
  std::vector<const OpsTable*> t;
  for (Isa isa : {Isa::Avx2, Isa::Avx512})
    if (isa_supported(isa)) t.push_back(&ops_table(isa));
  return t;
}

// Every table, the scalar reference's included.
std::vector<const OpsTable*> all_tables() {
  std::vector<const OpsTable*> t = simd_tables();
  t.push_back(&ops_table(Isa::Scalar));
  return t;
}

const int kSizes[] = {1, 3, 7, 8, 15, 16, 17, 31, 33, 64, 100, 576, 1000};

}  // namespace

TEST(ops_dispatch_table_matches_isa) {
  CHECK(ops_table(Isa::Scalar).isa == Isa::Scalar);
  CHECK(ops().isa == best_isa());
  for (const OpsTable* t : simd_tables()) CHECK(t->isa != Isa::Scalar);
}

TEST(ops_ref_closed_forms) {
  // softmax of (0, ln 3) = (1/4, 3/4).
  float x[2] = {0.f, std::log(3.f)};
  ref::softmax(x, 1, 2);
  CHECK(std::fabs(x[0] - 0.25f) < 1e-7f && std::fabs(x[1] - 0.75f) < 1e-7f);
  // rmsnorm of (3, 4) with eps 0: rms = sqrt(12.5); offset 1 and w = 0 gives x / rms.
  float r[2] = {3.f, 4.f}, w[2] = {0.f, 1.f}, y[2];
  ref::rmsnorm(y, r, w, 1, 2, 0.f, 1.f);
  CHECK(std::fabs(y[0] - 3.f / std::sqrt(12.5f)) < 1e-6f);
  CHECK(std::fabs(y[1] - 8.f / std::sqrt(12.5f)) < 1e-6f);
  // swiglu with u = 1 is silu: silu(0) = 0, silu(large) ~ x; geglu likewise gelu(0) = 0.
  float a[3] = {0.f, 30.f, -30.f}, one[3] = {1.f, 1.f, 1.f}, s[3];
  ref::swiglu(s, a, one, 3);
  CHECK(s[0] == 0.f && std::fabs(s[1] - 30.f) < 1e-5f && std::fabs(s[2]) < 1e-10f);
  ref::geglu(s, a, one, 3);
  CHECK(s[0] == 0.f && std::fabs(s[1] - 30.f) < 1e-5f && std::fabs(s[2]) < 1e-10f);
}

TEST(ops_simd_elementwise_match_ref) {
  for (const OpsTable* t : simd_tables())
    for (int n : kSizes) {
      std::vector<float> x = randn(n, 10 + n, 4.f), u = randn(n, 20 + n), w = randn(n, 30 + n);
      std::vector<float> a(n), b(n);
      ref::swiglu(a.data(), x.data(), u.data(), n), t->swiglu(b.data(), x.data(), u.data(), n);
      CHECK(max_rel(b, a) < 1e-5);
      ref::geglu(a.data(), x.data(), u.data(), n), t->geglu(b.data(), x.data(), u.data(), n);
      CHECK(max_rel(b, a) < 1e-5);
      for (float off : {0.f, 1.f}) {
        ref::rmsnorm(a.data(), x.data(), w.data(), 1, n, 1e-6f, off);
        t->rmsnorm(b.data(), x.data(), w.data(), 1, n, 1e-6f, off);
        CHECK(max_rel(b, a) < 1e-5);
      }
      a = x, b = x;
      ref::softmax(a.data(), 1, n), t->softmax(b.data(), 1, n);
      CHECK(max_rel(b, a, 1e-30) < 1e-5);
    }
}

TEST(ops_simd_exp_edges) {
  // The gated activations and softmax at the ends of the exp range: no NaN, inf or garbage
  // exponents.
  const float e[8] = {-200.f, -104.5f, -87.5f, -20.f, 20.f, 87.5f, 88.8f, 200.f};
  const std::vector<float> one(8, 1.f);
  for (const OpsTable* t : simd_tables()) {
    std::vector<float> x(e, e + 8), a(8), b(8);
    ref::swiglu(a.data(), x.data(), one.data(), 8), t->swiglu(b.data(), x.data(), one.data(), 8);
    CHECK(max_rel(b, a, 1e-30) < 1e-5);
    ref::geglu(a.data(), x.data(), one.data(), 8), t->geglu(b.data(), x.data(), one.data(), 8);
    for (int i = 0; i < 8; ++i) CHECK(std::fabs(b[i] - a[i]) <= 1e-5f * std::fabs(a[i]) + 1e-30f);
    a = x, b = x;
    ref::softmax(a.data(), 1, 8), t->softmax(b.data(), 1, 8);
    for (int i = 0; i < 8; ++i) CHECK(std::fabs(b[i] - a[i]) <= 1e-5f * a[i] + 1e-37f);
  }
}

// Several queries at once give each query exactly what it gets alone, on every table (the
// engine runs a KV head's query heads together in prompts and alone in decode steps).
TEST(ops_attention_loops_of_several_queries_are_each_querys_own) {
  for (const int hd : {64, 80, 256, 36})
    for (const int nq : {1, 2, 3, 4, 5, 7}) {
      const int n = 39, ld = 2 * 256 + 16, ldq = hd + 8, ldo = hd + 4, ldp = n + 3;
      const std::vector<float> q = randn((size_t)nq * ldq, 4), K = randn((size_t)n * ld, 5), P = randn((size_t)nq * ldp, 6);
      const std::vector<float> o0 = randn((size_t)nq * ldo, 7);
      for (const OpsTable* t : all_tables()) {
        std::vector<float> a((size_t)nq * ldp, 0.f), b = a, oa = o0, ob = o0;
        t->dot_rows_n(q.data(), ldq, nq, K.data(), ld, n, hd, a.data(), ldp);
        t->mix_rows_n(P.data(), ldp, nq, K.data() + 256, ld, n, hd, oa.data(), ldo);
        for (int m = 0; m < nq; ++m) {
          t->dot_rows(q.data() + m * ldq, K.data(), ld, n, hd, b.data() + m * ldp);
          t->mix_rows(P.data() + m * ldp, K.data() + 256, ld, n, hd, ob.data() + m * ldo);
        }
        CHECK(std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0);
        CHECK(std::memcmp(oa.data(), ob.data(), sizeof(float) * oa.size()) == 0);
      }
    }
}

// A cache of halves gives bit for bit what a float cache of the same (widened) values gives, on
// every table, and every table narrows floats to halves as f32_to_fp16 does (the fast paths' KV
// cache: the engine writes it with to_half and reads it with the _h loops).
TEST(ops_attention_loops_over_halves_are_the_float_loops_over_their_values) {
  for (const int hd : {64, 80, 256, 36})
    for (const int nq : {1, 3, 4, 5}) {
      const int n = 41, ld = 2 * 256 + 16, ldq = hd + 8, ldo = hd + 4, ldp = n + 3;
      const std::vector<float> q = randn((size_t)nq * ldq, 8), P = randn((size_t)nq * ldp, 9);
      const std::vector<float> o0 = randn((size_t)nq * ldo, 10);
      std::vector<float> K = randn((size_t)n * ld, 11);
      std::vector<uint16_t> Kh(K.size());
      for (size_t i = 0; i < K.size(); ++i) Kh[i] = f32_to_fp16(K[i]), K[i] = fp16_to_f32(Kh[i]);
      for (const OpsTable* t : all_tables()) {
        std::vector<float> a((size_t)nq * ldp, 0.f), b = a, oa = o0, ob = o0;
        t->dot_rows_n_h(q.data(), ldq, nq, Kh.data(), ld, n, hd, a.data(), ldp);
        t->mix_rows_n_h(P.data(), ldp, nq, Kh.data() + 256, ld, n, hd, oa.data(), ldo);
        t->dot_rows_n(q.data(), ldq, nq, K.data(), ld, n, hd, b.data(), ldp);
        t->mix_rows_n(P.data(), ldp, nq, K.data() + 256, ld, n, hd, ob.data(), ldo);
        CHECK(std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0);
        CHECK(std::memcmp(oa.data(), ob.data(), sizeof(float) * oa.size()) == 0);
      }
    }
  std::vector<float> x = randn(37, 12);
  const float edges[] = {65504.f, 65520.f, 1e9f, -1e9f, 6.1e-5f, 3e-6f, 1e-9f, -0.f, 2049.f, 2051.f, 0.33333334f};
  x.insert(x.end(), std::begin(edges), std::end(edges));
  for (const OpsTable* t : all_tables())
    for (const int n : {(int)x.size(), 5, 16, 1}) {
      std::vector<uint16_t> h((size_t)n + 1, 0xABCD);
      t->to_half(x.data(), h.data(), n);
      for (int i = 0; i < n; ++i) CHECK(h[i] == f32_to_fp16(x[i]));
      CHECK(h[n] == 0xABCD);  // nothing past the end
    }
}

// exp_max: the unnormalised softmax of a span of scores, its max and its sum, as the
// reference gives them (any length: whole vectors and masked tails; -inf scores give 0).
TEST(ops_exp_max_matches_ref) {
  for (const int n : {1, 7, 16, 37, 128}) {
    std::vector<float> x = randn(n, 20 + n);
    for (float& v : x) v *= 8.f;
    if (n > 1) x[n / 2] = -INFINITY;
    for (const OpsTable* t : simd_tables()) {
      std::vector<float> a = x, b = x;
      float ma = 0, mb = 0;
      const float sa = ref::exp_max(a.data(), n, &ma), sb = t->exp_max(b.data(), n, &mb);
      CHECK(ma == mb && ma == *std::max_element(x.begin(), x.end()));
      CHECK(std::fabs(sa - sb) <= 1e-5f * sa);
      CHECK(max_rel(b, a, 1e-30) < 1e-5);
      if (n > 1) CHECK(b[n / 2] == 0.f);
    }
  }
}

TEST(ops_attention_loops_match_ref) {
  for (const int hd : {64, 80, 36}) {  // whole vectors and masked tails
    const int n = 37, ld = 192;
    const std::vector<float> q = randn(hd, 1), K = randn((size_t)n * ld, 2), p = randn(n, 3);
    std::vector<float> a(n), b(n), oa(hd), ob(hd, 0.f);
    ref::dot_rows(q.data(), K.data(), ld, n, hd, b.data());
    ref::mix_rows(p.data(), K.data(), ld, n, hd, ob.data());
    for (const OpsTable* t : simd_tables()) {
      t->dot_rows(q.data(), K.data(), ld, n, hd, a.data());
      CHECK(norm_rel(a, b) < 1e-5);
      std::fill(oa.begin(), oa.end(), 0.f);
      t->mix_rows(p.data(), K.data(), ld, n, hd, oa.data());
      CHECK(norm_rel(oa, ob) < 1e-5);
    }
  }
}
