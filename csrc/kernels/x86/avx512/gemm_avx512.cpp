// AVX-512 (VNNI) GEMMs over the tiled layout. The q8 path is the fast path: a weight block is
// expanded to 32 bytes once and dotted (vpdpbusd) with NT tokens' int8 activation blocks, for
// NR rows at a time; per (row, token) the int32 dot is scaled by d_w * d_x in fp32.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../../gemm_tiles.h"
#include "cflow/gemm.h"

namespace cflow {

static inline float h2f(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return _cvtsh_ss(v);
}

static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Weight block -> 32 bytes (unsigned for Q4/Q5, signed for Q8_0), scale, offset.
template <int TYPE>
static inline __m256i expand(const uint8_t* b, float* d, float* off) {
  const __m128i m4 = _mm_set1_epi8(15);
  if constexpr (TYPE == T_Q4_0) {
    *d = h2f(b);
    *off = -8.f * *d;
    __m128i q = _mm_loadu_si128((const __m128i*)(b + 2));
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
  } else if constexpr (TYPE == T_Q4_1) {
    *d = h2f(b);
    *off = h2f(b + 2);
    __m128i q = _mm_loadu_si128((const __m128i*)(b + 4));
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
  } else if constexpr (TYPE == T_Q5_0) {
    *d = h2f(b);
    *off = -16.f * *d;
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    __m128i q = _mm_loadu_si128((const __m128i*)(b + 6));
    __m256i lo = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    __m256i hb = _mm256_and_si256(_mm256_movm_epi8(qh), _mm256_set1_epi8(16));
    return _mm256_or_si256(lo, hb);
  } else {  // Q8_0
    *d = h2f(b);
    *off = 0.f;
    return _mm256_loadu_si256((const __m256i*)(b + 2));
  }
}

// NR rows (i0.. of group G) x NT tokens (k0..): y = W x over all column tiles.
template <int TYPE, int NR, int NT>
static void micro(const Group& G, int i0, const QActs& x, int k0, float* y, int ldy, int r0) {
  __m256 acc[NR][NT];
  float macc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) { acc[r][t] = _mm256_setzero_ps(); macc[r][t] = 0.f; }
  const int xb = x.cols / 32;
  const size_t step = (size_t)G.g * G.bb;
  for (int tl = 0; tl < G.ntiles; ++tl) {
    const uint8_t* p = G.tile(tl) + (size_t)i0 * G.bb;
    const int nb = G.nb_of(tl);
    const int cb0 = tl * G.bpt;
    for (int b = 0; b < nb; ++b, p += step) {
      const int cb = cb0 + b;
      __m256i wq[NR];
      float dw[NR], ow[NR];
      for (int r = 0; r < NR; ++r) wq[r] = expand<TYPE>(p + (size_t)r * G.bb, &dw[r], &ow[r]);
      if (b + 4 < nb) _mm_prefetch((const char*)(p + 4 * step), _MM_HINT_T0);
      for (int t = 0; t < NT; ++t) {
        const size_t kx = (size_t)(k0 + t);
        const __m256i xq = _mm256_loadu_si256((const __m256i*)(x.q + kx * x.cols + (size_t)cb * 32));
        const float dx = x.d[kx * xb + cb];
        const float sx = x.s[kx * xb + cb];
        for (int r = 0; r < NR; ++r) {
          __m256i dot;
          if constexpr (TYPE == T_Q8_0)
            dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(wq[r]), _mm256_sign_epi8(xq, wq[r]));
          else
            dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq[r], xq);
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw[r] * dx), acc[r][t]);
          if constexpr (TYPE != T_Q8_0) macc[r][t] += ow[r] * sx;
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t)
      y[(size_t)(k0 + t) * ldy + (G.row + i0 + r - r0)] = hsum256(acc[r][t]) + macc[r][t];
}

template <int TYPE, int NR>
static void rows_x_tokens(const Group& G, int i0, const QActs& x, float* y, int ldy, int r0) {
  int k = 0;
  for (; k + 4 <= x.n; k += 4) micro<TYPE, NR, 4>(G, i0, x, k, y, ldy, r0);
  for (; k < x.n; ++k) micro<TYPE, NR, 1>(G, i0, x, k, y, ldy, r0);
}

template <int TYPE>
static void gemm_q8_t(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy) {
  for_groups(L, w, r0, r1, [&](const Group& G) {
    int i = 0;
    for (; i + 4 <= G.g; i += 4) rows_x_tokens<TYPE, 4>(G, i, x, y, ldy, r0);
    for (; i + 2 <= G.g; i += 2) rows_x_tokens<TYPE, 2>(G, i, x, y, ldy, r0);
    for (; i < G.g; ++i) rows_x_tokens<TYPE, 1>(G, i, x, y, ldy, r0);
  });
}

// ---- planes-packed Q4_0 / Q4_1 / Q8_0 (cflow/planes.h): the prefill form of the planes GEMV ----
// An interleave group of 16 rows is one zmm (lane i = row i). Per column block, the chunk's
// planes are unpacked once into 8 registers of unsigned weights, u[j] holding slice j (weights
// 4j..4j+3 of every row; for Q4 the high nibbles are slices 4..7); then each of NT tokens meets
// them with its own 8 activation slices, broadcast: 8 vpdpbusd give the 16 rows' int32 dots.
// Per (block, token): acc += d_w * (d_x * dot + off * s_x), off = -8 (Q4_0) or -128 (Q8_0, made
// unsigned by ^ 0x80), or acc += d_w * d_x * dot + m_w * s_x (Q4_1); s_x = d_x * sum(q_x).
// No shuffles, no horizontal sums; a weight chunk is read once per NT tokens.
template <int TYPE>
struct PlanesGeom {
  static constexpr int kHdr = TYPE == T_Q4_1 ? 4 : 2;
  static constexpr int kBB = TYPE == T_Q4_1 ? 20 : TYPE == T_Q4_0 ? 18 : 34;
  static constexpr size_t kChunk = (size_t)kPlanesMaxG * kBB;  // one column block of 16 rows
};

// Tokens [k0, k0 + NT) against the group whose chunks are chunk(cb), cb = 0 .. bpr. TWO: x2 is
// the second activation level (AType::Q8x2), dotted with the same unpacked weights.
template <int TYPE, int NT, bool TWO, class Chunk>
static void planes_tokens(int bpr, Chunk&& chunk, const QActs& x, const QActs* x2, int k0, float* y, int ldy,
                          __mmask16 mask) {
  using K = PlanesGeom<TYPE>;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const int xb = x.cols / 32;
  const __m512i lo = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
  const __m512 off = _mm512_set1_ps(TYPE == T_Q4_0 ? -8.f : TYPE == T_Q8_0 ? -128.f : 0.f);
  // The int32 dots of one token's activation blocks q with the 16 rows.
  auto dot = [](const __m512i* u, const int8_t* q) {
    const int32_t* xs = (const int32_t*)q;
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
      s0 = _mm512_dpbusd_epi32(s0, u[j], _mm512_set1_epi32(xs[j]));
      s1 = _mm512_dpbusd_epi32(s1, u[j + 1], _mm512_set1_epi32(xs[j + 1]));
    }
    return _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
  };
  for (int cb = 0; cb < bpr; ++cb) {
    const uint8_t* c = chunk(cb);
    const __m512i* pl = (const __m512i*)(c + kPlanesMaxG * K::kHdr);
    __m512i u[8];
    if constexpr (TYPE == T_Q8_0) {
      for (int j = 0; j < 8; ++j) u[j] = _mm512_xor_si512(_mm512_loadu_si512(pl + j), flip);
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i q = _mm512_loadu_si512(pl + j);
        u[j] = _mm512_and_si512(q, lo);
        u[4 + j] = _mm512_and_si512(_mm512_srli_epi16(q, 4), lo);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)c));
    __m512 m = _mm512_setzero_ps();
    if constexpr (TYPE == T_Q4_1) m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(c + 32)));
    for (int t = 0; t < NT; ++t) {
      const size_t kx = (size_t)(k0 + t), o = kx * xb + cb, oq = kx * x.cols + (size_t)cb * 32;
      // f = d_x * dot + off * s_x, summed over the levels; Q4_1's m * s_x goes in separately
      __m512 f = _mm512_mul_ps(dot(u, x.q + oq), _mm512_set1_ps(x.d[o]));
      float sx = x.s[o];
      if constexpr (TWO) {
        f = _mm512_fmadd_ps(dot(u, x2->q + oq), _mm512_set1_ps(x2->d[o]), f);
        sx += x2->s[o];
      }
      if constexpr (TYPE == T_Q4_1) {
        acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx), _mm512_fmadd_ps(d, f, acc[t]));
      } else {
        acc[t] = _mm512_fmadd_ps(d, _mm512_fmadd_ps(off, _mm512_set1_ps(sx), f), acc[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + (size_t)(k0 + t) * ldy, mask, acc[t]);
}

template <int TYPE, bool TWO>
static void gemm_planes_t(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, const QActs* x2,
                          float* y, int ldy) {
  using K = PlanesGeom<TYPE>;
  thread_local std::vector<uint8_t> wide;  // a ragged group widened to 16 rows (planes_widen)
  for_groups(L, w, r0, r1, [&](const Group& G) {
    const size_t step = (size_t)G.g * K::kBB;
    if (G.g != kPlanesMaxG) {
      wide.resize((size_t)G.bpr * K::kChunk);
      for (int cb = 0; cb < G.bpr; ++cb)
        planes_widen(G.tile(cb / G.bpt) + (size_t)(cb % G.bpt) * step, G.g, K::kHdr, K::kBB,
                     wide.data() + cb * K::kChunk);
    }
    const uint8_t* wd = wide.data();
    auto chunk = [&](int cb) -> const uint8_t* {
      if (G.g != kPlanesMaxG) return wd + cb * K::kChunk;
      return G.tile(cb / G.bpt) + (size_t)(cb % G.bpt) * step;
    };
    const __mmask16 mask = (__mmask16)((1u << G.g) - 1);
    float* yg = y + (G.row - r0);
    int k = 0;
    for (; k + 8 <= x.n; k += 8) planes_tokens<TYPE, 8, TWO>(G.bpr, chunk, x, x2, k, yg, ldy, mask);
    for (; k + 2 <= x.n; k += 2) planes_tokens<TYPE, 2, TWO>(G.bpr, chunk, x, x2, k, yg, ldy, mask);
    for (; k < x.n; ++k) planes_tokens<TYPE, 1, TWO>(G.bpr, chunk, x, x2, k, yg, ldy, mask);
  });
}

// The planes GEMM of L's type, one level (x2 null) or two; false when L is not planes-packed.
static bool gemm_planes(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, const QActs* x2,
                        float* y, int ldy) {
  if (L.pack != (int)Pack::Planes) return false;
  switch (L.type * 2 + (x2 != nullptr)) {
    case T_Q4_0 * 2: gemm_planes_t<T_Q4_0, false>(L, w, r0, r1, x, x2, y, ldy); return true;
    case T_Q4_0 * 2 + 1: gemm_planes_t<T_Q4_0, true>(L, w, r0, r1, x, x2, y, ldy); return true;
    case T_Q4_1 * 2: gemm_planes_t<T_Q4_1, false>(L, w, r0, r1, x, x2, y, ldy); return true;
    case T_Q4_1 * 2 + 1: gemm_planes_t<T_Q4_1, true>(L, w, r0, r1, x, x2, y, ldy); return true;
    case T_Q8_0 * 2: gemm_planes_t<T_Q8_0, false>(L, w, r0, r1, x, x2, y, ldy); return true;
    case T_Q8_0 * 2 + 1: gemm_planes_t<T_Q8_0, true>(L, w, r0, r1, x, x2, y, ldy); return true;
  }
  return false;
}

bool gemm_q8x2_avx512(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, const QActs& x2,
                      float* y, int ldy) {
  return gemm_planes(L, w, r0, r1, x, &x2, y, ldy);
}

void gemm_q8_avx512(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy) {
  if (gemm_planes(L, w, r0, r1, x, nullptr, y, ldy)) return;
  if (gemm_on_whole_blocks(L, w, r0, r1, y, [&](const TileLayout& S, const uint8_t* ws, int a, int b, float* ys) {
        gemm_q8_avx512(S, ws, a, b, x, ys, ldy);
      }))
    return;
  switch (L.type) {
    case T_Q4_0: return gemm_q8_t<T_Q4_0>(L, w, r0, r1, x, y, ldy);
    case T_Q4_1: return gemm_q8_t<T_Q4_1>(L, w, r0, r1, x, y, ldy);
    case T_Q5_0: return gemm_q8_t<T_Q5_0>(L, w, r0, r1, x, y, ldy);
    case T_Q8_0: return gemm_q8_t<T_Q8_0>(L, w, r0, r1, x, y, ldy);
  }
  gemm_q8_ref(L, w, r0, r1, x, y, ldy);
}

// fp32 path: each row is dequantized once (dequant_group_row reads either pack) and dotted with
// every token.
void gemm_f32_avx512(const TileLayout& L, const uint8_t* w, int r0, int r1, const float* x, int ldx, int n,
                     float* y, int ldy) {
  std::vector<float> row(L.cols + 16);
  const int c16 = L.cols / 16 * 16;
  for_groups(L, w, r0, r1, [&](const Group& G) {
    for (int i = 0; i < G.g; ++i) {
      dequant_group_row(L, G, i, row.data());
      for (int k = 0; k < n; ++k) {
        const float* xk = x + (size_t)k * ldx;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int c = 0;
        for (; c + 32 <= c16; c += 32) {
          a0 = _mm512_fmadd_ps(_mm512_loadu_ps(row.data() + c), _mm512_loadu_ps(xk + c), a0);
          a1 = _mm512_fmadd_ps(_mm512_loadu_ps(row.data() + c + 16), _mm512_loadu_ps(xk + c + 16), a1);
        }
        for (; c < c16; c += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(row.data() + c), _mm512_loadu_ps(xk + c), a0);
        float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        for (; c < L.cols; ++c) s += row[c] * xk[c];
        y[(size_t)k * ldy + (G.row + i - r0)] = s;
      }
    }
  });
}

void dot_rows_avx512(const float* q, const float* K, size_t ldk, int n, int hd, float* out) {
  for (int j = 0; j < n; ++j) {
    const float* k = K + (size_t)j * ldk;
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
    for (int i = 16; i < hd; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), a);
    out[j] = _mm512_reduce_add_ps(a);
  }
}

void mix_rows_avx512(const float* p, const float* V, size_t ldv, int n, int hd, float* out) {
  for (int i = 0; i < hd; i += 16) {
    __m512 a = _mm512_loadu_ps(out + i);
    for (int j = 0; j < n; ++j) a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(V + (size_t)j * ldv + i), a);
    _mm512_storeu_ps(out + i, a);
  }
}

void quantize_acts_avx512(const float* x, int ldx, int n, int cols, QActs& out) {
  const int nb = cols / 32;
  out.n = n;
  out.cols = cols;
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int k = 0; k < n; ++k) {
    for (int b = 0; b < nb; ++b) {
      const float* xb = x + (size_t)k * ldx + b * 32;
      __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      __m512 m = _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1));
      const float amax = _mm512_reduce_max_ps(m);
      const float d = amax / 127.f, id = d ? 1.f / d : 0.f;
      const __m512 vid = _mm512_set1_ps(id);
      __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));  // round to nearest even
      __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
      int8_t* q = out.q + (size_t)k * cols + b * 32;
      _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(q1));
      const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      out.d[(size_t)k * nb + b] = d;
      out.s[(size_t)k * nb + b] = d * sum;
    }
  }
}

}  // namespace cflow
