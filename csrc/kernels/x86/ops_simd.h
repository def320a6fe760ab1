// SIMD ops written once over a vector-traits struct V; included by x86/avx2/ops.cpp and
// x86/avx512/ops.cpp *inside* their ISA namespace (cflow::avx2, cflow::avx512) right after they
// define V, so each ISA gets its own copy compiled with its own flags (no shared inline symbol
// can leak AVX-512 code into the AVX2 path).
//
// V provides: reg, W (lanes), zero, set1, load, store, load_n / store_n (first n < W lanes, the
// rest filled with `fill`), load_h / store_h (W fp16 values), add sub mul div fmadd(a,b,c)=a*b+c
// fnmadd(a,b,c)=c-a*b max min, hsum hmax, round (to nearest even), ldexp(y, n) = y * 2^n for
// integral n in [-150, 128], gt_mask (bit i: a[i] > b[i], false on NaN), dup_pairs (W/2 floats,
// each twice), swap_pairs, fmaddsub (even lanes a*b-c, odd lanes a*b+c).
// The including file has already included <algorithm> <cmath> <cstring> <utility> <vector>.

using reg = V::reg;
constexpr int W = V::W;

// ---- math on vectors -----------------------------------------------------------------------

// exp(x), about 1 ulp (Cephes polynomial on [-ln2/2, ln2/2]); -inf -> 0, large -> inf, NaN -> NaN.
static inline reg vexp(reg x) {
  // max(lo, x) and min(hi, .) return the NaN operand (the second) unchanged.
  x = V::min(V::set1(89.0f), V::max(V::set1(-104.0f), x));
  const reg n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
  reg r = V::fnmadd(n, V::set1(0.693359375f), x);  // n * C1 is exact (C1 has 9 bits)
  r = V::fnmadd(n, V::set1(-2.12194440e-4f), r);
  reg p = V::set1(1.9875691500e-4f);
  p = V::fmadd(p, r, V::set1(1.3981999507e-3f));
  p = V::fmadd(p, r, V::set1(8.3334519073e-3f));
  p = V::fmadd(p, r, V::set1(4.1665795894e-2f));
  p = V::fmadd(p, r, V::set1(1.6666665459e-1f));
  p = V::fmadd(p, r, V::set1(5.0000001201e-1f));
  p = V::fmadd(p, V::mul(r, r), V::add(r, V::set1(1.0f)));
  return V::ldexp(p, n);
}

// x * sigmoid(z) = x / (1 + exp(-z)): relative accuracy everywhere (no 1 + tanh cancellation).
static inline reg vmul_sigmoid(reg x, reg z) {
  return V::div(x, V::add(V::set1(1.0f), vexp(V::sub(V::zero(), z))));
}

static inline reg vsilu(reg x) { return vmul_sigmoid(x, x); }

// gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).
static inline reg vgelu(reg x) {
  const reg x2 = V::mul(x, x);
  const reg u2 = V::mul(V::mul(x, V::set1(2.0f * 0.7978845608028654f)),
                        V::fmadd(x2, V::set1(0.044715f), V::set1(1.0f)));
  return vmul_sigmoid(x, u2);
}

// tanh(x): rational 13/6 approximation on [-7.9053, 7.9053] (saturates to +-1 beyond), a few ulp.
static inline reg vtanh(reg x) {
  x = V::min(V::set1(7.90531110763549805f), V::max(V::set1(-7.90531110763549805f), x));
  const reg x2 = V::mul(x, x);
  reg p = V::set1(-2.76076847742355e-16f);
  p = V::fmadd(x2, p, V::set1(2.00018790482477e-13f));
  p = V::fmadd(x2, p, V::set1(-8.60467152213735e-11f));
  p = V::fmadd(x2, p, V::set1(5.12229709037114e-08f));
  p = V::fmadd(x2, p, V::set1(1.48572235717979e-05f));
  p = V::fmadd(x2, p, V::set1(6.37261928875436e-04f));
  p = V::fmadd(x2, p, V::set1(4.89352455891786e-03f));
  p = V::mul(x, p);
  reg q = V::set1(1.19825839466702e-06f);
  q = V::fmadd(x2, q, V::set1(1.18534705686654e-04f));
  q = V::fmadd(x2, q, V::set1(2.26843463243900e-03f));
  q = V::fmadd(x2, q, V::set1(4.89352518554385e-03f));
  return V::div(p, q);
}

// ---- loops with ragged tails ---------------------------------------------------------------

// y[i] = f(x[i]) for i < n, the tail through masked loads/stores.
template <class F>
static inline void map1(float* y, const float* x, int n, F f) {
  int i = 0;
  for (; i + W <= n; i += W) V::store(y + i, f(V::load(x + i)));
  if (i < n) V::store_n(y + i, f(V::load_n(x + i, n - i)), n - i);
}

// h[i] = f(g[i], u[i]).
template <class F>
static inline void map2(float* h, const float* g, const float* u, int n, F f) {
  int i = 0;
  for (; i + W <= n; i += W) V::store(h + i, f(V::load(g + i), V::load(u + i)));
  if (i < n) V::store_n(h + i, f(V::load_n(g + i, n - i), V::load_n(u + i, n - i)), n - i);
}

static inline float max_of(const float* x, int n) {
  const float ninf = -INFINITY;
  reg m = V::set1(ninf);
  int i = 0;
  for (; i + W <= n; i += W) m = V::max(m, V::load(x + i));
  if (i < n) m = V::max(m, V::load_n(x + i, n - i, ninf));
  return V::hmax(m);
}

// x[i] = exp(x[i] - m); returns the sum.
static inline float exp_sum(float* x, int n, float m) {
  const reg vm = V::set1(m);
  reg s = V::zero();
  int i = 0;
  for (; i + W <= n; i += W) {
    const reg e = vexp(V::sub(V::load(x + i), vm));
    V::store(x + i, e);
    s = V::add(s, e);
  }
  if (i < n) {
    const reg e = vexp(V::sub(V::load_n(x + i, n - i, -INFINITY), vm));  // padding -> exp = 0
    V::store_n(x + i, e, n - i);
    s = V::add(s, e);
  }
  return V::hsum(s);
}

// fp32 or fp16 loads of W values (full) or n < W values (zero padded).
static inline reg ld(const float* p) { return V::load(p); }
static inline reg ld(const uint16_t* p) { return V::load_h(p); }
static inline reg ld_n(const float* p, int n) { return V::load_n(p, n); }
static inline reg ld_n(const uint16_t* p, int n) {
  uint16_t tmp[W] = {};
  std::memcpy(tmp, p, sizeof(uint16_t) * n);
  return V::load_h(tmp);
}

// ---- ops -----------------------------------------------------------------------------------

void rmsnorm(float* y, const float* x, const float* w, int rows, int n, float eps,
             float w_offset) {
  for (int r = 0; r < rows; ++r, x += n, y += n) {
    reg a0 = V::zero(), a1 = V::zero();
    int i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {
      const reg v0 = V::load(x + i), v1 = V::load(x + i + W);
      a0 = V::fmadd(v0, v0, a0);
      a1 = V::fmadd(v1, v1, a1);
    }
    for (; i + W <= n; i += W) {
      const reg v = V::load(x + i);
      a0 = V::fmadd(v, v, a0);
    }
    if (i < n) {
      const reg v = V::load_n(x + i, n - i);
      a1 = V::fmadd(v, v, a1);
    }
    const reg inv = V::set1(1.0f / std::sqrt(V::hsum(V::add(a0, a1)) / n + eps));
    const reg off = V::set1(w_offset);
    map2(y, x, w, n, [&](reg xv, reg wv) { return V::mul(V::mul(xv, inv), V::add(off, wv)); });
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
      if (style == RopeStyle::Neox) {
        // a = v[i], b = v[i + half]: a' = a c - b s, b' = b c + a s.
        int i = 0;
        for (; i + W <= half; i += W) {
          const reg cv = V::load(c + i), sv = V::load(s + i);
          const reg a = V::load(v + i), b = V::load(v + half + i);
          V::store(v + i, V::fnmadd(b, sv, V::mul(a, cv)));
          V::store(v + half + i, V::fmadd(a, sv, V::mul(b, cv)));
        }
        if (i < half) {
          const int m = half - i;
          const reg cv = V::load_n(c + i, m), sv = V::load_n(s + i, m);
          const reg a = V::load_n(v + i, m), b = V::load_n(v + half + i, m);
          V::store_n(v + i, V::fnmadd(b, sv, V::mul(a, cv)), m);
          V::store_n(v + half + i, V::fmadd(a, sv, V::mul(b, cv)), m);
        }
      } else {
        // (v[2i], v[2i+1]) = (a, b): even lanes a c - b s, odd lanes b c + a s.
        int i = 0;
        for (; i + W / 2 <= half; i += W / 2) {
          const reg xv = V::load(v + 2 * i);
          const reg r = V::fmaddsub(xv, V::dup_pairs(c + i),
                                    V::mul(V::swap_pairs(xv), V::dup_pairs(s + i)));
          V::store(v + 2 * i, r);
        }
        for (; i < half; ++i) {
          const float a = v[2 * i], b = v[2 * i + 1];
          v[2 * i] = a * c[i] - b * s[i];
          v[2 * i + 1] = b * c[i] + a * s[i];
        }
      }
    }
  }
}

void softmax(float* x, int rows, int n) {
  for (int r = 0; r < rows; ++r, x += n) {
    const float sum = exp_sum(x, n, max_of(x, n));
    const reg inv = V::set1(1.0f / sum);
    map1(x, x, n, [&](reg v) { return V::mul(v, inv); });
  }
}

void log_softmax(float* x, int rows, int n) {
  for (int r = 0; r < rows; ++r, x += n) {
    const float m = max_of(x, n);
    const reg vm = V::set1(m);
    reg s = V::zero();
    int i = 0;
    for (; i + W <= n; i += W) s = V::add(s, vexp(V::sub(V::load(x + i), vm)));
    if (i < n) s = V::add(s, vexp(V::sub(V::load_n(x + i, n - i, -INFINITY), vm)));
    const reg lse = V::set1(m + std::log(V::hsum(s)));
    map1(x, x, n, [&](reg v) { return V::sub(v, lse); });
  }
}

void silu(float* y, const float* x, int n) { map1(y, x, n, vsilu); }
void gelu_tanh(float* y, const float* x, int n) { map1(y, x, n, vgelu); }
void swiglu(float* h, const float* g, const float* u, int n) {
  map2(h, g, u, n, [](reg gv, reg uv) { return V::mul(vsilu(gv), uv); });
}
void geglu(float* h, const float* g, const float* u, int n) {
  map2(h, g, u, n, [](reg gv, reg uv) { return V::mul(vgelu(gv), uv); });
}

void topk(int32_t* idx, float* val, const float* x, int n, int k) {
  // Heap of the k best so far with the worst at the front, scanning in index order: a later
  // element enters only if strictly better than the worst kept (equal values keep the lower
  // index), so the SIMD scan only looks at lanes above the current threshold.
  using Item = std::pair<float, int32_t>;
  auto better = [](const Item& a, const Item& b) {
    const bool na = std::isnan(a.first), nb = std::isnan(b.first);
    if (na || nb) return na == nb ? a.second < b.second : nb;
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  std::vector<Item> heap(k);
  for (int i = 0; i < k; ++i) heap[i] = Item(x[i], i);
  std::make_heap(heap.begin(), heap.end(), better);
  auto offer = [&](int i) {
    const Item it(x[i], i);
    if (!better(it, heap.front())) return;
    std::pop_heap(heap.begin(), heap.end(), better);
    heap.back() = it;
    std::push_heap(heap.begin(), heap.end(), better);
  };
  int i = k;
  while (i < n) {
    const float thr = heap.front().first;
    if (std::isnan(thr) || i + W > n) {  // NaN kept (any number beats it) or the ragged tail
      offer(i++);
      continue;
    }
    unsigned mask = V::gt_mask(V::load(x + i), V::set1(thr));
    while (mask) {
      offer(i + __builtin_ctz(mask));
      mask &= mask - 1;
    }
    i += W;
  }
  std::sort_heap(heap.begin(), heap.end(), better);  // best first
  for (int j = 0; j < k; ++j) idx[j] = heap[j].second, val[j] = heap[j].first;
}

// q . k over n values.
template <class KV>
static inline float dot(const float* q, const KV* k, int n) {
  reg a0 = V::zero(), a1 = V::zero();
  int i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    a0 = V::fmadd(V::load(q + i), ld(k + i), a0);
    a1 = V::fmadd(V::load(q + i + W), ld(k + i + W), a1);
  }
  for (; i + W <= n; i += W) a0 = V::fmadd(V::load(q + i), ld(k + i), a0);
  if (i < n) a1 = V::fmadd(V::load_n(q + i, n - i), ld_n(k + i, n - i), a1);
  return V::hsum(V::add(a0, a1));
}

// o = o * alpha + sum_j p[j] * v[j], v rows of n values.
template <class KV>
static inline void scale_axpy(float* o, float alpha, const float* p, const KV* v, int rows, int n) {
  int i = 0;
  for (; i + W <= n; i += W) {
    reg acc = V::mul(V::load(o + i), V::set1(alpha));
    for (int j = 0; j < rows; ++j) acc = V::fmadd(V::set1(p[j]), ld(v + (size_t)j * n + i), acc);
    V::store(o + i, acc);
  }
  if (i < n) {
    reg acc = V::mul(V::load_n(o + i, n - i), V::set1(alpha));
    for (int j = 0; j < rows; ++j)
      acc = V::fmadd(V::set1(p[j]), ld_n(v + (size_t)j * n + i, n - i), acc);
    V::store_n(o + i, acc, n - i);
  }
}

// One query row at position p against one KV head (kh, vh: (max_ctx, head_dim)), in chunks of
// positions with a running max (online softmax): no scratch beyond a small stack buffer.
template <class KV>
static void attend_one(float* out, const float* q, const KV* kh, const KV* vh, int p,
                       const AttnShape& s) {
  constexpr int CH = 128;
  const int hd = s.head_dim;
  const int t0 = s.window > 0 ? std::max(0, p + 1 - s.window) : 0;
  float sc[CH];
  float m = -INFINITY, l = 0.f;
  std::memset(out, 0, sizeof(float) * hd);
  for (int c0 = t0; c0 <= p; c0 += CH) {
    const int cn = std::min(CH, p + 1 - c0);
    for (int j = 0; j < cn; ++j) sc[j] = dot(q, kh + (size_t)(c0 + j) * hd, hd) * s.scale;
    if (s.softcap > 0) {
      const reg cap = V::set1(s.softcap), inv = V::set1(1.0f / s.softcap);
      map1(sc, sc, cn, [&](reg v) { return V::mul(cap, vtanh(V::mul(v, inv))); });
    }
    const float mn = std::max(m, max_of(sc, cn));
    const float alpha = std::exp(m - mn);  // 0 on the first chunk
    l = l * alpha + exp_sum(sc, cn, mn);
    scale_axpy(out, alpha, sc, vh + (size_t)c0 * hd, cn, hd);
    m = mn;
  }
  const reg inv = V::set1(1.0f / l);
  map1(out, out, hd, [&](reg v) { return V::mul(v, inv); });
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
  map2(y, a, b, n, [](reg av, reg bv) { return V::add(av, bv); });
}
void scale(float* y, const float* x, float s, int n) {
  const reg sv = V::set1(s);
  map1(y, x, n, [&](reg v) { return V::mul(v, sv); });
}

void f32_to_f16(uint16_t* y, const float* x, int n) {
  int i = 0;
  for (; i + W <= n; i += W) V::store_h(y + i, V::load(x + i));
  if (i < n) {
    uint16_t tmp[W];
    V::store_h(tmp, V::load_n(x + i, n - i));
    std::memcpy(y + i, tmp, sizeof(uint16_t) * (n - i));
  }
}
void f16_to_f32(float* y, const uint16_t* x, int n) {
  int i = 0;
  for (; i + W <= n; i += W) V::store(y + i, V::load_h(x + i));
  if (i < n) V::store_n(y + i, ld_n(x + i, n - i), n - i);
}
