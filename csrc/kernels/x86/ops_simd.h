// SIMD ops written once over a vector-traits struct V; included by x86/avx2/ops.cpp and
// x86/avx512/ops.cpp *inside* their ISA namespace (cflow::avx2, cflow::avx512) right after they
// define V, so each ISA gets its own copy compiled with its own flags (no shared inline symbol
// can leak AVX-512 code into the AVX2 path).
//
// V provides: reg, W (lanes), zero, set1, load, store, load_n / store_n (first n < W lanes, the
// rest filled with `fill`), add sub mul div fmadd(a,b,c)=a*b+c fnmadd(a,b,c)=c-a*b max min,
// hsum hmax, round (to nearest even), ldexp(y, n) = y * 2^n for integral n in [-150, 128].
// The including file has already included <cmath> <cstring>.

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

void softmax(float* x, int rows, int n) {
  for (int r = 0; r < rows; ++r, x += n) {
    const float sum = exp_sum(x, n, max_of(x, n));
    const reg inv = V::set1(1.0f / sum);
    map1(x, x, n, [&](reg v) { return V::mul(v, inv); });
  }
}

float exp_max(float* x, int n, float* mx) {
  const float m = *mx = max_of(x, n);
  return exp_sum(x, n, m);
}

bool block_maxima(const float* x, int n, int run, float* out) {
  const int b = run, k = n / run;
  reg s0 = V::zero(), s1 = V::zero();  // sums of x - x: NaN where any value is not finite
  for (int j = 0; j < k; ++j) {
    const float* p = x + (size_t)j * b;
    reg m0 = V::set1(-INFINITY), m1 = m0;  // two chains: a max waits for the one before
    int i = 0;
    for (; i + 2 * W <= b; i += 2 * W) {
      const reg c0 = V::load(p + i), c1 = V::load(p + i + W);
      m0 = V::max(m0, c0), m1 = V::max(m1, c1);
      s0 = V::add(s0, V::sub(c0, c0)), s1 = V::add(s1, V::sub(c1, c1));
    }
    for (; i < b; i += W) {
      const int r = std::min(W, b - i);
      m0 = V::max(m0, V::load_n(p + i, r, -INFINITY));
      const reg c = V::load_n(p + i, r);
      s0 = V::add(s0, V::sub(c, c));
    }
    out[j] = V::hmax(V::max(m0, m1));
  }
  for (int i = k * b; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return !std::isnan(V::hsum(V::add(s0, s1)));
}

int at_least(const float* x, int n, float bound, int32_t* ids) {
  const reg bv = V::set1(bound);
  int c = 0, i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {  // most runs of 4 W values hold none: one test for them
    const reg m = V::max(V::max(V::load(x + i), V::load(x + i + W)),
                         V::max(V::load(x + i + 2 * W), V::load(x + i + 3 * W)));
    if (!V::ge_mask(m, bv)) continue;
    for (int q = i; q < i + 4 * W; q += W)  // the lanes that reach it, in order
      for (unsigned b = V::ge_mask(V::load(x + q), bv); b; b &= b - 1) ids[c++] = q + __builtin_ctz(b);
  }
  for (; i < n; ++i)
    if (x[i] >= bound) ids[c++] = i;
  return c;
}

void swiglu(float* h, const float* g, const float* u, int n) {
  map2(h, g, u, n, [](reg gv, reg uv) { return V::mul(vsilu(gv), uv); });
}
void geglu(float* h, const float* g, const float* u, int n) {
  map2(h, g, u, n, [](reg gv, reg uv) { return V::mul(vgelu(gv), uv); });
}

// Attention inner loops (ops.h): out (n,) = K @ q; out (hd,) += p @ V. Any hd (masked tail).
// Written once over the cache's element type E: float, or uint16_t for IEEE halves (the fast
// paths' KV cache), widened to floats as they load (exact), so a half cache gives bit for bit
// what a float cache holding the same values gives.
static inline reg ld(const float* p) { return V::load(p); }
static inline reg ld(const uint16_t* p) { return V::load_h(p); }
static inline reg ld_n(const float* p, int n) { return V::load_n(p, n); }
static inline reg ld_n(const uint16_t* p, int n) { return V::load_h_n(p, n); }

// Rows [kAttnPrefetchRows, kAttnPrefetchRows + rows) after `row` (stride ld), `elems` elements of
// each, on their way (cflow/ops.h; past the end of the cache too: a prefetch does not fault).
template <class E>
static inline void prefetch_ahead(const E* row, size_t ld, int rows, int elems) {
  for (int r = 0; r < rows; ++r)
    for (size_t b = 0; b < elems * sizeof(E); b += 64)
      _mm_prefetch((const char*)(row + (size_t)(kAttnPrefetchRows + r) * ld) + b, _MM_HINT_T0);
}

template <class E>
static void dot_rows_e(const float* q, const E* K, size_t ldk, int n, int hd, float* out) {
  const int hw = hd / W * W;
  int j = 0;
  if (hw == hd)  // 8 rows at a time: 8 independent chains (an FMA's latency is 4 cycles, and two
    for (; j + 8 <= n; j += 8) {  // issue a cycle), each four reduced as the loop below does
      const E* k = K + (size_t)j * ldk;
      prefetch_ahead(k, ldk, 8, hd);
      reg a[8] = {V::zero(), V::zero(), V::zero(), V::zero(), V::zero(), V::zero(), V::zero(), V::zero()};
      for (int i = 0; i < hd; i += W) {
        const reg qi = V::load(q + i);
        for (int r = 0; r < 8; ++r) a[r] = V::fmadd(qi, ld(k + r * ldk + i), a[r]);
      }
      _mm_storeu_ps(out + j, V::hsum4(a[0], a[1], a[2], a[3]));
      _mm_storeu_ps(out + j + 4, V::hsum4(a[4], a[5], a[6], a[7]));
    }
  if (hw == hd)  // 4 rows at a time: independent chains, one reduction for the four
    for (; j + 4 <= n; j += 4) {
      const E* k = K + (size_t)j * ldk;
      prefetch_ahead(k, ldk, 4, hd);
      reg a[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
      for (int i = 0; i < hd; i += W) {
        const reg qi = V::load(q + i);
        for (int r = 0; r < 4; ++r) a[r] = V::fmadd(qi, ld(k + r * ldk + i), a[r]);
      }
      _mm_storeu_ps(out + j, V::hsum4(a[0], a[1], a[2], a[3]));
    }
  for (; j < n; ++j) {
    const E* k = K + (size_t)j * ldk;
    reg a = V::zero();
    for (int i = 0; i < hw; i += W) a = V::fmadd(V::load(q + i), ld(k + i), a);
    if (hw < hd) a = V::fmadd(V::load_n(q + hw, hd - hw), ld_n(k + hw, hd - hw), a);
    out[j] = V::hsum(a);
  }
}

template <class E>
static void mix_rows_chunks(const float* p, const E* Vm, size_t ldv, int n, int hd, float* out);

template <class E>
static void mix_rows_e(const float* p, const E* Vm, size_t ldv, int n, int hd, float* out) {
  if (hd % W == 0) {  // chunks of the head in registers, 8 per pass over the rows (8 chains)
    mix_rows_chunks(p, Vm, ldv, n, hd, out);
    return;
  }
  for (int i = 0; i < hd; i += W) {
    const int m = hd - i < W ? hd - i : W;
    reg a = m == W ? V::load(out + i) : V::load_n(out + i, m);
    for (int j = 0; j < n; ++j) {
      const E* v = Vm + (size_t)j * ldv + i;
      a = V::fmadd(V::set1(p[j]), m == W ? ld(v) : ld_n(v, m), a);
    }
    if (m == W) V::store(out + i, a);
    else V::store_n(out + i, a, m);
  }
}

// Several queries against the same keys / values (ops.h): per block of 4 keys (values: of kMixC
// chunks) each chunk is loaded once and met by up to kQ queries, whose accumulators are exactly
// dot_rows' (mix_rows'): the same FMAs in the same order, the keys reduced four at a time by
// hsum4 at the same positions, the rows a lane sums in order.
constexpr int kQ = W == 16 ? 4 : 2;  // queries per pass: AVX-512 4 x 4 accumulators, AVX2 2 x 4
constexpr int kMixC = 4;              // value chunks per pass

template <int NQ, class E>
static void dot_rows_q(const float* q, size_t ldq, const E* K, size_t ldk, int n, int hd, float* out, size_t ldo) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const E* k = K + (size_t)j * ldk;
    prefetch_ahead(k, ldk, 4, hd);
    reg a[NQ][4];
    for (int m = 0; m < NQ; ++m)
      for (int r = 0; r < 4; ++r) a[m][r] = V::zero();
    for (int i = 0; i < hd; i += W) {
      reg kv[4];
      for (int r = 0; r < 4; ++r) kv[r] = ld(k + r * ldk + i);
      for (int m = 0; m < NQ; ++m) {
        const reg qi = V::load(q + m * ldq + i);
        for (int r = 0; r < 4; ++r) a[m][r] = V::fmadd(qi, kv[r], a[m][r]);
      }
    }
    for (int m = 0; m < NQ; ++m) _mm_storeu_ps(out + m * ldo + j, V::hsum4(a[m][0], a[m][1], a[m][2], a[m][3]));
  }
  if (j < n)  // the last n % 4 keys one at a time, as dot_rows takes them
    for (int m = 0; m < NQ; ++m) dot_rows_e(q + m * ldq, K + (size_t)j * ldk, ldk, n - j, hd, out + m * ldo + j);
}

// Calls f(integral_constant<int, B>, m) for the queries [m, m + B) of nq, B <= kQ at a time.
template <class F>
static void query_batches(int nq, F&& f) {
  for (int m = 0; m < nq; m += kQ) {
    const int b = std::min(kQ, nq - m);
    if (b == kQ) f(std::integral_constant<int, kQ>{}, m);
    else if (b == 3) f(std::integral_constant<int, 3>{}, m);
    else if (b == 2) f(std::integral_constant<int, 2>{}, m);
    else f(std::integral_constant<int, 1>{}, m);
  }
}

template <class E>
static void dot_rows_n_e(const float* q, size_t ldq, int nq, const E* K, size_t ldk, int n, int hd, float* out,
                         size_t ldo) {
  if (hd % W) {
    for (int m = 0; m < nq; ++m) dot_rows_e(q + m * ldq, K, ldk, n, hd, out + m * ldo);
    return;
  }
  query_batches(nq, [&](auto B, int m) {
    if constexpr (B == 1) dot_rows_e(q + m * ldq, K, ldk, n, hd, out + m * ldo);
    else dot_rows_q<B>(q + m * ldq, ldq, K, ldk, n, hd, out + m * ldo, ldo);
  });
}

// NC (<= 8) value chunks from c0 for NQ queries: the accumulators stay in registers.
template <int NQ, int NC, class E>
static inline void mix_rows_qc(const float* p, size_t ldp, const E* Vm, size_t ldv, int n, int c0, float* out,
                               size_t ldo) {
  reg a[NQ][NC];
  for (int m = 0; m < NQ; ++m)
    for (int c = 0; c < NC; ++c) a[m][c] = V::load(out + m * ldo + c0 + c * W);
  for (int j = 0; j < n; ++j) {
    const E* v = Vm + (size_t)j * ldv + c0;
    prefetch_ahead(v, ldv, 1, NC * W);
    reg vc[NC];
    for (int c = 0; c < NC; ++c) vc[c] = ld(v + c * W);
    for (int m = 0; m < NQ; ++m) {
      const reg pj = V::set1(p[m * ldp + j]);
      for (int c = 0; c < NC; ++c) a[m][c] = V::fmadd(pj, vc[c], a[m][c]);
    }
  }
  for (int m = 0; m < NQ; ++m)
    for (int c = 0; c < NC; ++c) V::store(out + m * ldo + c0 + c * W, a[m][c]);
}

template <int NQ, class E>
static void mix_rows_q(const float* p, size_t ldp, const E* Vm, size_t ldv, int n, int hd, float* out, size_t ldo) {
  int c0 = 0;
  for (; c0 + kMixC * W <= hd; c0 += kMixC * W) mix_rows_qc<NQ, kMixC>(p, ldp, Vm, ldv, n, c0, out, ldo);
  switch ((hd - c0) / W) {
    case 3: mix_rows_qc<NQ, 3>(p, ldp, Vm, ldv, n, c0, out, ldo); break;
    case 2: mix_rows_qc<NQ, 2>(p, ldp, Vm, ldv, n, c0, out, ldo); break;
    case 1: mix_rows_qc<NQ, 1>(p, ldp, Vm, ldv, n, c0, out, ldo); break;
    default: break;
  }
}

// mix_rows of a head of whole chunks: 8 chunks per pass (each lane sums its rows in order).
template <class E>
static void mix_rows_chunks(const float* p, const E* Vm, size_t ldv, int n, int hd, float* out) {
  int c0 = 0;
  for (; c0 + 8 * W <= hd; c0 += 8 * W) mix_rows_qc<1, 8>(p, 0, Vm, ldv, n, c0, out, 0);
  switch ((hd - c0) / W) {
    case 7: mix_rows_qc<1, 7>(p, 0, Vm, ldv, n, c0, out, 0); break;
    case 6: mix_rows_qc<1, 6>(p, 0, Vm, ldv, n, c0, out, 0); break;
    case 5: mix_rows_qc<1, 5>(p, 0, Vm, ldv, n, c0, out, 0); break;
    case 4: mix_rows_qc<1, 4>(p, 0, Vm, ldv, n, c0, out, 0); break;
    case 3: mix_rows_qc<1, 3>(p, 0, Vm, ldv, n, c0, out, 0); break;
    case 2: mix_rows_qc<1, 2>(p, 0, Vm, ldv, n, c0, out, 0); break;
    case 1: mix_rows_qc<1, 1>(p, 0, Vm, ldv, n, c0, out, 0); break;
    default: break;
  }
}

template <class E>
static void mix_rows_n_e(const float* p, size_t ldp, int nq, const E* Vm, size_t ldv, int n, int hd, float* out,
                         size_t ldo) {
  if (hd % W) {
    for (int m = 0; m < nq; ++m) mix_rows_e(p + m * ldp, Vm, ldv, n, hd, out + m * ldo);
    return;
  }
  query_batches(nq, [&](auto B, int m) {
    if constexpr (B == 1) mix_rows_e(p + m * ldp, Vm, ldv, n, hd, out + m * ldo);
    else mix_rows_q<B>(p + m * ldp, ldp, Vm, ldv, n, hd, out + m * ldo, ldo);
  });
}

void dot_rows(const float* q, const float* K, size_t ldk, int n, int hd, float* out) {
  dot_rows_e(q, K, ldk, n, hd, out);
}
void mix_rows(const float* p, const float* Vm, size_t ldv, int n, int hd, float* out) {
  mix_rows_e(p, Vm, ldv, n, hd, out);
}
void dot_rows_n(const float* q, size_t ldq, int nq, const float* K, size_t ldk, int n, int hd, float* out, size_t ldo) {
  dot_rows_n_e(q, ldq, nq, K, ldk, n, hd, out, ldo);
}
void mix_rows_n(const float* p, size_t ldp, int nq, const float* Vm, size_t ldv, int n, int hd, float* out, size_t ldo) {
  mix_rows_n_e(p, ldp, nq, Vm, ldv, n, hd, out, ldo);
}
void dot_rows_n_h(const float* q, size_t ldq, int nq, const uint16_t* K, size_t ldk, int n, int hd, float* out,
                  size_t ldo) {
  dot_rows_n_e(q, ldq, nq, K, ldk, n, hd, out, ldo);
}
void mix_rows_n_h(const float* p, size_t ldp, int nq, const uint16_t* Vm, size_t ldv, int n, int hd, float* out,
                  size_t ldo) {
  mix_rows_n_e(p, ldp, nq, Vm, ldv, n, hd, out, ldo);
}

// y (n halves) = x (n floats), each rounded to nearest even.
void to_half(const float* x, uint16_t* y, int n) {
  int i = 0;
  for (; i + W <= n; i += W) V::store_h(y + i, V::load(x + i));
  if (i < n) V::store_h_n(y + i, V::load_n(x + i, n - i), n - i);
}

// ops.h: a block's 32 int8 widened 8 at a time (AVX2's 256-bit ops on both ISAs: a block is
// four of them), times its half scale; the products are exact, as the reference's.
void from_q8(const uint8_t* x, int rows, int hd, float* y) {
  for (int b = 0; b < rows * (hd / 32); ++b, x += kQ8Block, y += 32) {
    // the cache's rows kAttnPrefetchRows ahead on their way, as the attention loops prefetch
    // (a span's rows are a stream too short for the hardware prefetchers)
    _mm_prefetch((const char*)x + (size_t)kAttnPrefetchRows * (hd / 32) * kQ8Block, _MM_HINT_T0);
    uint16_t h;
    std::memcpy(&h, x, 2);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
    for (int i = 0; i < 4; ++i) {
      const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(x + 2 + 8 * i)));
      _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
    }
  }
}
