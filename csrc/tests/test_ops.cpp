// Tests of the small ops: the scalar reference against closed forms, and every SIMD path this
// CPU supports against the scalar reference on random data with ragged sizes.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

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

// max |a - b| / max |b|: the error relative to the scale of the result (attention outputs are
// averages of values and can be near zero in single elements).
double norm_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    e = std::max(e, std::fabs((double)a[i] - b[i])), m = std::max(m, std::fabs((double)b[i]));
  return e / m;
}

std::vector<const OpsTable*> simd_tables() {
  std::vector<const OpsTable*> t;
  for (Isa isa : {Isa::Avx2, Isa::Avx512})
    if (isa_supported(isa)) t.push_back(&ops_table(isa));
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
  // softmax of (0, ln 3) = (1/4, 3/4); log_softmax = log of it.
  float x[2] = {0.f, std::log(3.f)};
  ref::softmax(x, 1, 2);
  CHECK(std::fabs(x[0] - 0.25f) < 1e-7f && std::fabs(x[1] - 0.75f) < 1e-7f);
  float l[2] = {0.f, std::log(3.f)};
  ref::log_softmax(l, 1, 2);
  CHECK(std::fabs(l[0] - std::log(0.25f)) < 1e-6f);
  // rmsnorm of (3, 4) with eps 0: rms = sqrt(12.5); offset 1 and w = 0 gives x / rms.
  float r[2] = {3.f, 4.f}, w[2] = {0.f, 1.f}, y[2];
  ref::rmsnorm(y, r, w, 1, 2, 0.f, 1.f);
  CHECK(std::fabs(y[0] - 3.f / std::sqrt(12.5f)) < 1e-6f);
  CHECK(std::fabs(y[1] - 8.f / std::sqrt(12.5f)) < 1e-6f);
  // silu(0) = 0, gelu(0) = 0, silu(large) ~ x.
  float a[3] = {0.f, 30.f, -30.f}, s[3];
  ref::silu(s, a, 3);
  CHECK(s[0] == 0.f && std::fabs(s[1] - 30.f) < 1e-5f && std::fabs(s[2]) < 1e-10f);
  // fp16: exact values, rounding to even, overflow, subnormals.
  const float f[7] = {1.f, -2.f, 65504.f, 65520.f, 1.f + 1.f / 2048.f, 5.96046448e-8f, 0.f};
  uint16_t h[7];
  ref::f32_to_f16(h, f, 7);
  CHECK(h[0] == 0x3c00 && h[1] == 0xc000 && h[2] == 0x7bff && h[3] == 0x7c00);
  CHECK(h[4] == 0x3c00);  // halfway between 1 and 1 + 2^-10: ties to even
  CHECK(h[5] == 0x0001 && h[6] == 0);
  float back[7];
  ref::f16_to_f32(back, h, 7);
  CHECK(back[0] == 1.f && back[2] == 65504.f && std::isinf(back[3]) && back[5] == f[5]);
}

TEST(ops_rope_table_and_ref) {
  const int hd = 8;
  RopeTable t = rope_table(hd, 16, 10000.0);
  CHECK(t.cos.size() == 16 * 4 && t.cos[0] == 1.f && t.sin[0] == 0.f);
  // pos 3, frequency 0 (inv_freq = 1): angle 3.
  CHECK(std::fabs(t.cos[3 * 4] - std::cos(3.f)) < 1e-7f);
  for (RopeStyle st : {RopeStyle::Neox, RopeStyle::Interleaved}) {
    std::vector<float> x = randn(2 * hd, 1), x0 = x;
    const int32_t pos0 = 0, pos5 = 5;
    ref::rope(x.data(), 1, 2, hd, &pos0, t, st);
    CHECK(max_rel(x, x0) == 0);  // position 0 is the identity
    ref::rope(x.data(), 1, 2, hd, &pos5, t, st);
    double n0 = 0, n1 = 0;  // rotations keep the norm
    for (int i = 0; i < 2 * hd; ++i) n0 += x0[i] * x0[i], n1 += x[i] * x[i];
    CHECK(std::fabs(n0 - n1) < 1e-5 * n0);
  }
}

TEST(ops_topk_ref) {
  const float x[8] = {1.f, 5.f, 3.f, 5.f, NAN, -INFINITY, 5.f, 2.f};
  int32_t idx[8];
  float val[8];
  ref::topk(idx, val, x, 8, 8);
  const int32_t want[8] = {1, 3, 6, 2, 7, 0, 5, 4};
  for (int i = 0; i < 8; ++i) CHECK(idx[i] == want[i]);
  CHECK(std::isnan(val[7]) && val[0] == 5.f);
}

TEST(ops_simd_elementwise_match_ref) {
  for (const OpsTable* t : simd_tables())
    for (int n : kSizes) {
      std::vector<float> x = randn(n, 10 + n, 4.f), u = randn(n, 20 + n), w = randn(n, 30 + n);
      std::vector<float> a(n), b(n);
      ref::silu(a.data(), x.data(), n), t->silu(b.data(), x.data(), n);
      CHECK(max_rel(b, a) < 1e-5);
      ref::gelu_tanh(a.data(), x.data(), n), t->gelu_tanh(b.data(), x.data(), n);
      CHECK(max_rel(b, a) < 1e-5);
      ref::swiglu(a.data(), x.data(), u.data(), n), t->swiglu(b.data(), x.data(), u.data(), n);
      CHECK(max_rel(b, a) < 1e-5);
      ref::geglu(a.data(), x.data(), u.data(), n), t->geglu(b.data(), x.data(), u.data(), n);
      CHECK(max_rel(b, a) < 1e-5);
      ref::add(a.data(), x.data(), u.data(), n), t->add(b.data(), x.data(), u.data(), n);
      CHECK(max_rel(b, a, 0) == 0);
      ref::scale(a.data(), x.data(), 0.37f, n), t->scale(b.data(), x.data(), 0.37f, n);
      CHECK(max_rel(b, a, 0) == 0);
      for (float off : {0.f, 1.f}) {
        ref::rmsnorm(a.data(), x.data(), w.data(), 1, n, 1e-6f, off);
        t->rmsnorm(b.data(), x.data(), w.data(), 1, n, 1e-6f, off);
        CHECK(max_rel(b, a) < 1e-5);
      }
      a = x, b = x;
      ref::softmax(a.data(), 1, n), t->softmax(b.data(), 1, n);
      CHECK(max_rel(b, a, 1e-30) < 1e-5);
      a = x, b = x;
      ref::log_softmax(a.data(), 1, n), t->log_softmax(b.data(), 1, n);
      CHECK(max_rel(b, a) < 1e-5);
    }
}

TEST(ops_simd_exp_edges) {
  // silu and softmax at the ends of the exp range: no NaN, inf or garbage exponents.
  const float e[8] = {-200.f, -104.5f, -87.5f, -20.f, 20.f, 87.5f, 88.8f, 200.f};
  for (const OpsTable* t : simd_tables()) {
    std::vector<float> x(e, e + 8), a(8), b(8);
    ref::silu(a.data(), x.data(), 8), t->silu(b.data(), x.data(), 8);
    CHECK(max_rel(b, a, 1e-30) < 1e-5);
    ref::gelu_tanh(a.data(), x.data(), 8), t->gelu_tanh(b.data(), x.data(), 8);
    for (int i = 0; i < 8; ++i) CHECK(std::fabs(b[i] - a[i]) <= 1e-5f * std::fabs(a[i]) + 1e-30f);
    a = x, b = x;
    ref::softmax(a.data(), 1, 8), t->softmax(b.data(), 1, 8);
    for (int i = 0; i < 8; ++i) CHECK(std::fabs(b[i] - a[i]) <= 1e-5f * a[i] + 1e-37f);
  }
}

TEST(ops_simd_rope_match_ref) {
  for (const OpsTable* t : simd_tables())
    for (int hd : {2, 6, 8, 16, 24, 64, 80, 128, 256}) {
      RopeTable tab = rope_table(hd, 64, 500000.0);
      const int T = 3, nh = 3;
      const int32_t pos[T] = {0, 17, 63};
      for (RopeStyle st : {RopeStyle::Neox, RopeStyle::Interleaved}) {
        std::vector<float> a = randn(T * nh * hd, hd), b = a;
        ref::rope(a.data(), T, nh, hd, pos, tab, st);
        t->rope(b.data(), T, nh, hd, pos, tab, st);
        double err = 0;
        for (size_t i = 0; i < a.size(); ++i) err = std::max(err, (double)std::fabs(a[i] - b[i]));
        CHECK(err < 1e-5);
      }
    }
}

TEST(ops_simd_topk_match_ref) {
  for (const OpsTable* t : simd_tables())
    for (int n : {1, 5, 16, 17, 100, 1000, 262144})
      for (int k : {1, 2, 8, 64}) {
        if (k > n) continue;
        std::vector<float> x = randn(n, n + k);
        for (int i = 0; i < n; i += 7) x[i] = std::round(x[i] * 4) / 4;  // many ties
        if (n > 3) x[n / 2] = NAN, x[0] = NAN;
        std::vector<int32_t> ia(k), ib(k);
        std::vector<float> va(k), vb(k);
        ref::topk(ia.data(), va.data(), x.data(), n, k);
        t->topk(ib.data(), vb.data(), x.data(), n, k);
        CHECK(ia == ib);
      }
}

TEST(ops_simd_f16_match_ref) {
  for (const OpsTable* t : simd_tables()) {
    std::vector<float> x = randn(1003, 5, 3000.f);
    const float special[] = {65520.f, 65519.f, -1e6f, 6e-8f, 3e-8f, 2.9e-8f, 1e-5f, -0.f, INFINITY};
    for (int i = 0; i < 9; ++i) x[i] = special[i];
    for (int i = 9; i < 200; ++i) x[i] *= 1e-7f;  // subnormal halves
    std::vector<uint16_t> ha(x.size()), hb(x.size());
    ref::f32_to_f16(ha.data(), x.data(), (int)x.size());
    t->f32_to_f16(hb.data(), x.data(), (int)x.size());
    CHECK(ha == hb);
    std::vector<float> fa(x.size()), fb(x.size());
    ref::f16_to_f32(fa.data(), ha.data(), (int)x.size());
    t->f16_to_f32(fb.data(), ha.data(), (int)x.size());
    CHECK(max_rel(fb, fa, 0) == 0);
  }
}

TEST(ops_attention_match_ref) {
  struct Case { int nh, nkv, hd, ctx, pos, window; float softcap; };
  const Case cases[] = {{4, 4, 64, 32, 0, 0, 0.f},    {9, 3, 64, 300, 299, 0, 0.f},
                        {4, 1, 256, 600, 550, 512, 0.f}, {8, 2, 80, 200, 150, 0, 50.f},
                        {2, 2, 17, 140, 139, 7, 30.f}, {6, 3, 128, 260, 257, 0, 0.f}};
  std::vector<const OpsTable*> tabs = simd_tables();
  tabs.push_back(&ops_table(Isa::Scalar));
  for (const Case& c : cases) {
    AttnShape s;
    s.n_head = c.nh, s.n_kv_head = c.nkv, s.head_dim = c.hd, s.max_ctx = c.ctx;
    s.scale = 1.f / std::sqrt((float)c.hd), s.window = c.window, s.softcap = c.softcap;
    const size_t kvn = (size_t)c.nkv * c.ctx * c.hd;
    std::vector<float> k = randn(kvn, 1, 2.f), v = randn(kvn, 2);
    std::vector<uint16_t> k16(kvn), v16(kvn);
    ref::f32_to_f16(k16.data(), k.data(), (int)kvn);
    ref::f32_to_f16(v16.data(), v.data(), (int)kvn);
    // Decode at pos, and prefill of the last T tokens ending at pos.
    const int T = std::min(c.pos + 1, 5), p0 = c.pos + 1 - T;
    std::vector<float> q = randn((size_t)T * c.nh * c.hd, 3);
    const float* qlast = q.data() + (size_t)(T - 1) * c.nh * c.hd;
    std::vector<float> want((size_t)c.nh * c.hd), want16(want.size()), wantp(q.size());
    ref::attn_decode(want.data(), qlast, k.data(), v.data(), c.pos, s, 0, c.nh);
    ref::attn_decode_f16(want16.data(), qlast, k16.data(), v16.data(), c.pos, s, 0, c.nh);
    ref::attn_prefill(wantp.data(), q.data(), k.data(), v.data(), p0, T, s, 0, c.nh);
    // Prefill's last token is the decode of that token.
    std::vector<float> lastp(wantp.end() - want.size(), wantp.end());
    CHECK(norm_rel(lastp, want) == 0);
    for (const OpsTable* t : tabs) {
      std::vector<float> got(want.size(), NAN), gotp(q.size(), NAN);
      // Heads in two ranges, as two threads would.
      t->attn_decode(got.data(), qlast, k.data(), v.data(), c.pos, s, 0, c.nh / 2);
      t->attn_decode(got.data(), qlast, k.data(), v.data(), c.pos, s, c.nh / 2, c.nh);
      CHECK(norm_rel(got, want) < 1e-5);
      t->attn_decode_f16(got.data(), qlast, k16.data(), v16.data(), c.pos, s, 0, c.nh);
      CHECK(norm_rel(got, want16) < 1e-5);
      t->attn_prefill(gotp.data(), q.data(), k.data(), v.data(), p0, T, s, 0, c.nh);
      CHECK(norm_rel(gotp, wantp) < 1e-5);
      t->attn_prefill_f16(gotp.data(), q.data(), k16.data(), v16.data(), p0, T, s, 0, c.nh);
      std::vector<float> wantp16(q.size());
      ref::attn_prefill_f16(wantp16.data(), q.data(), k16.data(), v16.data(), p0, T, s, 0, c.nh);
      CHECK(norm_rel(gotp, wantp16) < 1e-5);
    }
  }
}

TEST(ops_attention_window_and_single_position) {
  // One position: the output is that position's value row. Window 1: the same at any pos.
  AttnShape s;
  s.n_head = 2, s.n_kv_head = 1, s.head_dim = 16, s.max_ctx = 8, s.scale = 0.25f, s.window = 1;
  std::vector<float> k = randn(8 * 16, 7), v = randn(8 * 16, 8), q = randn(2 * 16, 9);
  std::vector<const OpsTable*> tabs = simd_tables();
  tabs.push_back(&ops_table(Isa::Scalar));
  for (const OpsTable* t : tabs) {
    std::vector<float> out(2 * 16);
    t->attn_decode(out.data(), q.data(), k.data(), v.data(), 5, s, 0, 2);
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 16; ++i) CHECK(std::fabs(out[h * 16 + i] - v[5 * 16 + i]) < 1e-6f);
  }
}
