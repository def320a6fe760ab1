// Tile GEMMs written once over an ISA's traits (prefill: n tokens against one weight matrix);
// included by x86/avx2/gemm_avx2.cpp and x86/avx512/gemm_avx512.cpp *inside* their ISA
// namespace, in an anonymous namespace, after they define
//   struct V : Vec, IVec { static constexpr int kNT, kPlanesNT; }   (x86/<isa>/vec.h)
//   planes_tokens<TYPE, NT, TWO>(bpr, chunk, x, x2, k0, y, ldy, g): the planes kernel below
//   quantize_acts_v(x, ldx, n, cols, out): gemm.h quantize_acts
// kNT, kPlanesNT: tokens per call of the whole-block and the planes kernel (register budget).
// The including file has already included <immintrin.h>, <cstring>, <vector>, gemm_tiles.h.
//
// q8 path over whole blocks (Q4_0/Q4_1/Q5_0/Q8_0): a weight block is expanded to 32 bytes once
// and dotted (V::dot) with kNT tokens' int8 activation blocks, for NR rows at a time; per
// (row, token) the int32 dot is scaled by d_w * d_x in fp32, and the weight offset (Q4_0 -8 d,
// Q5_0 -16 d, Q4_1 m) meets s_x = d_x * sum(q_x) in a scalar accumulator.

inline float h2f(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return _cvtsh_ss(v);
}

// Weight block -> 32 bytes (unsigned for Q4/Q5, signed for Q8_0), scale, offset.
template <int TYPE>
inline __m256i expand(const uint8_t* b, float* d, float* off) {
  const __m128i m4 = _mm_set1_epi8(15);
  *d = h2f(b);
  if constexpr (TYPE == T_Q4_0 || TYPE == T_Q4_1) {
    *off = TYPE == T_Q4_0 ? -8.f * *d : h2f(b + 2);
    const __m128i q = _mm_loadu_si128((const __m128i*)(b + (TYPE == T_Q4_0 ? 2 : 4)));
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
  } else if constexpr (TYPE == T_Q5_0) {
    *off = -16.f * *d;
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m128i q = _mm_loadu_si128((const __m128i*)(b + 6));
    const __m256i lo = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    return _mm256_or_si256(lo, _mm256_and_si256(V::bits32(qh), _mm256_set1_epi8(16)));
  } else {  // Q8_0
    *off = 0.f;
    return _mm256_loadu_si256((const __m256i*)(b + 2));
  }
}

// NR rows (i0.. of group G) x NT tokens (k0..): y = W x over all column tiles.
template <int TYPE, int NR, int NT>
void micro(const Group& G, int i0, const QActs& x, int k0, float* y, int ldy, int r0) {
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
          const __m256i zero = _mm256_setzero_si256();
          const __m256i dot = TYPE == T_Q8_0
                                  ? V::dot(zero, _mm256_abs_epi8(wq[r]), _mm256_sign_epi8(xq, wq[r]))
                                  : V::dot(zero, wq[r], xq);
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw[r] * dx), acc[r][t]);
          if constexpr (TYPE != T_Q8_0) macc[r][t] += ow[r] * sx;
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t)
      y[(size_t)(k0 + t) * ldy + (G.row + i0 + r - r0)] = V::hsum8(acc[r][t]) + macc[r][t];
}

template <int TYPE, int NR>
void rows_x_tokens(const Group& G, int i0, const QActs& x, float* y, int ldy, int r0) {
  int k = 0;
  for (; k + V::kNT <= x.n; k += V::kNT) micro<TYPE, NR, V::kNT>(G, i0, x, k, y, ldy, r0);
  for (; k < x.n; ++k) micro<TYPE, NR, 1>(G, i0, x, k, y, ldy, r0);
}

template <int TYPE>
void gemm_blocks_t(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy) {
  for_groups(L, w, r0, r1, [&](const Group& G) {
    int i = 0;
    for (; i + 4 <= G.g; i += 4) rows_x_tokens<TYPE, 4>(G, i, x, y, ldy, r0);
    for (; i + 2 <= G.g; i += 2) rows_x_tokens<TYPE, 2>(G, i, x, y, ldy, r0);
    for (; i < G.g; ++i) rows_x_tokens<TYPE, 1>(G, i, x, y, ldy, r0);
  });
}

// ---- planes-packed Q4_0 / Q4_1 / Q8_0 (cflow/planes.h): the prefill form of the planes GEMV ----
// For each interleave group of rows (a ragged one widened to 16 rows, planes_widen) and each
// run of kPlanesNT tokens, the ISA's planes_tokens<TYPE, NT, TWO> walks the group's chunks
// chunk(cb), cb = 0 .. bpr, and stores rows [0, g) of y for tokens [k0, k0 + NT): per chunk the
// weights are unpacked once and met by every token. TWO: x2 is the second activation level
// (AType::Q8x2), dotted with the same unpacked weights.
template <int TYPE, bool TWO>
void gemm_planes_t(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, const QActs* x2, float* y,
                   int ldy) {
  const int hdr = planes_header(static_cast<WType>(TYPE)), bb = L.bb;
  const size_t chunk_bytes = (size_t)kPlanesMaxG * bb;  // one column block of 16 rows
  thread_local std::vector<uint8_t> wide;
  for_groups(L, w, r0, r1, [&](const Group& G) {
    const size_t step = (size_t)G.g * bb;
    if (G.g != kPlanesMaxG) {
      wide.resize((size_t)G.bpr * chunk_bytes);
      for (int cb = 0; cb < G.bpr; ++cb)
        planes_widen(G.tile(cb / G.bpt) + (size_t)(cb % G.bpt) * step, G.g, hdr, bb, wide.data() + cb * chunk_bytes);
    }
    const uint8_t* wd = wide.data();
    auto chunk = [&](int cb) -> const uint8_t* {
      if (G.g != kPlanesMaxG) return wd + cb * chunk_bytes;
      return G.tile(cb / G.bpt) + (size_t)(cb % G.bpt) * step;
    };
    float* yg = y + (G.row - r0);
    constexpr int NT = V::kPlanesNT;
    int k = 0;
    for (; k + NT <= x.n; k += NT) planes_tokens<TYPE, NT, TWO>(G.bpr, chunk, x, x2, k, yg, ldy, G.g);
    for (; k + 2 <= x.n; k += 2) planes_tokens<TYPE, 2, TWO>(G.bpr, chunk, x, x2, k, yg, ldy, G.g);
    for (; k < x.n; ++k) planes_tokens<TYPE, 1, TWO>(G.bpr, chunk, x, x2, k, yg, ldy, G.g);
  });
}

// The planes GEMM of L's type, one level (x2 null) or two; false when L is not planes-packed.
bool gemm_planes(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, const QActs* x2, float* y,
                 int ldy) {
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

// The q8 GEMM of a whole-block layout. Types without a q8 kernel: the reference.
void gemm_q8_blocks(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy) {
  switch (L.type) {
    case T_Q4_0: return gemm_blocks_t<T_Q4_0>(L, w, r0, r1, x, y, ldy);
    case T_Q4_1: return gemm_blocks_t<T_Q4_1>(L, w, r0, r1, x, y, ldy);
    case T_Q5_0: return gemm_blocks_t<T_Q5_0>(L, w, r0, r1, x, y, ldy);
    case T_Q8_0: return gemm_blocks_t<T_Q8_0>(L, w, r0, r1, x, y, ldy);
  }
  gemm_q8_ref(L, w, r0, r1, x, y, ldy);
}

// The q8 GEMMs of the table (gemm.h GemmTable::q8, q8x2).
bool gemm_q8x2_simd(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, const QActs& x2, float* y,
                    int ldy) {
  return gemm_planes(L, w, r0, r1, x, &x2, y, ldy);
}

void gemm_q8_simd(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy) {
  if (!gemm_planes(L, w, r0, r1, x, nullptr, y, ldy)) gemm_q8_blocks(L, w, r0, r1, x, y, ldy);
}

// fp32 path: each row is dequantized once (dequant_group_row reads either pack) and dotted with
// every token, two accumulators per dot.
void gemm_f32_rows(const TileLayout& L, const uint8_t* w, int r0, int r1, const float* x, int ldx, int n, float* y,
                   int ldy) {
  constexpr int W = V::W;
  std::vector<float> row(L.cols + W);
  const int cw = L.cols / W * W;
  for_groups(L, w, r0, r1, [&](const Group& G) {
    for (int i = 0; i < G.g; ++i) {
      dequant_group_row(L, G, i, row.data());
      for (int k = 0; k < n; ++k) {
        const float* xk = x + (size_t)k * ldx;
        typename V::reg a0 = V::zero(), a1 = V::zero();
        int c = 0;
        for (; c + 2 * W <= cw; c += 2 * W) {
          a0 = V::fmadd(V::load(row.data() + c), V::load(xk + c), a0);
          a1 = V::fmadd(V::load(row.data() + c + W), V::load(xk + c + W), a1);
        }
        for (; c < cw; c += W) a0 = V::fmadd(V::load(row.data() + c), V::load(xk + c), a0);
        float s = V::hsum(V::add(a0, a1));
        for (; c < L.cols; ++c) s += row[c] * xk[c];
        y[(size_t)k * ldy + (G.row + i - r0)] = s;
      }
    }
  });
}

// The ISA's table (gemm.h).
GemmTable make_gemm_table(Isa isa) {
  return GemmTable{isa, gemm_f32_rows, gemm_q8_simd, gemm_q8x2_simd, quantize_acts_v};
}
