// Tile GEMMs written once over an ISA's traits (prefill: n tokens against one weight matrix);
// included by x86/avx2/gemm_avx2.cpp and x86/avx512/gemm_avx512.cpp *inside* their ISA
// namespace, in an anonymous namespace, after they define
//   struct V : Vec, IVec { static constexpr int kNT, kPlanesNT; }   (x86/<isa>/vec.h)
//   planes_tokens<TYPE, NT, TWO>(bpr, chunk, x, k0, y, ldy, g): the planes kernel below
// kNT, kPlanesNT: tokens per call of the whole-block and the planes kernel (register budget).
// The including file has already included <immintrin.h>, <cmath>, <cstring>, <vector>, tile_walk.h.
//
// q8 path over whole blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0): a weight block is expanded to 32 bytes
// once and dotted (V::dot) with kNT tokens' int8 activation blocks, for NR rows at a time; per
// (row, token) the int32 dot is scaled by d_w * d_x in fp32, and the weight offset (Q4_0 -8 d,
// Q5_0 -16 d, Q4_1 and Q5_1 m) meets s_x = d_x * sum(q_x) in a scalar accumulator. LEVELS: the
// activation levels (QActs::levels) dotted with each expanded block, summed.

inline float h2f(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return _cvtsh_ss(v);
}

// Weight block -> 32 bytes (unsigned for Q4/Q5, signed for Q8_0), scale, offset.
template <BlockType TYPE>
inline __m256i expand(const uint8_t* b, float* d, float* off) {
  const __m128i m4 = _mm_set1_epi8(15);
  *d = h2f(b);
  if constexpr (TYPE == BlockType::Q4_0 || TYPE == BlockType::Q4_1) {
    *off = TYPE == BlockType::Q4_0 ? -8.f * *d : h2f(b + 2);
    const __m128i q = _mm_loadu_si128((const __m128i*)(b + (TYPE == BlockType::Q4_0 ? 2 : 4)));
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
  } else if constexpr (TYPE == BlockType::Q5_0 || TYPE == BlockType::Q5_1) {
    constexpr int qh_at = TYPE == BlockType::Q5_0 ? 2 : 4;  // Q5_1: after m
    *off = TYPE == BlockType::Q5_0 ? -16.f * *d : h2f(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + qh_at, 4);
    const __m128i q = _mm_loadu_si128((const __m128i*)(b + qh_at + 4));
    const __m256i lo = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    return _mm256_or_si256(lo, _mm256_and_si256(V::bits32(qh), _mm256_set1_epi8(16)));
  } else {  // Q8_0
    *off = 0.f;
    return _mm256_loadu_si256((const __m256i*)(b + 2));
  }
}

// NR rows (i0.. of group G) x NT tokens (k0..): y = W x over all column tiles.
template <BlockType TYPE, int LEVELS, int NR, int NT>
void micro(const Group& G, int i0, const QActs& x, int k0, float* y, int ldy, int r0) {
  __m256 acc[NR][NT];
  float macc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) { acc[r][t] = _mm256_setzero_ps(); macc[r][t] = 0.f; }
  const size_t step = (size_t)G.g * G.bb;
  const block_q8a* xr[NT][LEVELS];  // the tokens' activation rows
  for (int t = 0; t < NT; ++t)
    for (int l = 0; l < LEVELS; ++l) xr[t][l] = x.row(k0 + t, l);
  for (int tl = 0; tl < G.ntiles; ++tl) {
    const uint8_t* p = G.tile(tl) + (size_t)i0 * G.bb;
    const int nb = G.nb_of(tl);
    const int cb0 = tl * G.bpt;
    for (int b = 0; b < nb; ++b, p += step) {
      const int cb = cb0 + b;
      __m256i wq[NR];
      float dw[NR], ow[NR];
      for (int r = 0; r < NR; ++r) wq[r] = expand<TYPE>(p + (size_t)r * G.bb, &dw[r], &ow[r]);
      if (b + 4 < nb && prefetch_on()) _mm_prefetch((const char*)(p + 4 * step), _MM_HINT_T0);
      for (int t = 0; t < NT; ++t)
        for (int l = 0; l < LEVELS; ++l) {
          const block_q8a& a = xr[t][l][cb];
          const __m256i xq = _mm256_loadu_si256((const __m256i*)a.qs);
          for (int r = 0; r < NR; ++r) {
            const __m256i zero = _mm256_setzero_si256();
            const __m256i dot = TYPE == BlockType::Q8_0
                                    ? V::dot(zero, _mm256_abs_epi8(wq[r]), _mm256_sign_epi8(xq, wq[r]))
                                    : V::dot(zero, wq[r], xq);
            acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw[r] * a.d), acc[r][t]);
            // one fused multiply-add, spelled out: left to contraction, the compiler fuses it in
            // some token counts' instantiations and not others, and a token's sum would depend
            // on how many tokens share its call
            if constexpr (TYPE != BlockType::Q8_0) macc[r][t] = std::fma(ow[r], a.s, macc[r][t]);
          }
        }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t)
      y[(size_t)(k0 + t) * ldy + (G.row + i0 + r - r0)] = V::hsum8(acc[r][t]) + macc[r][t];
}

template <BlockType TYPE, int LEVELS, int NR>
void rows_x_tokens(const Group& G, int i0, const QActs& x, float* y, int ldy, int r0) {
  int k = 0;
  for (; k + V::kNT <= x.n; k += V::kNT) micro<TYPE, LEVELS, NR, V::kNT>(G, i0, x, k, y, ldy, r0);
  for (; k < x.n; ++k) micro<TYPE, LEVELS, NR, 1>(G, i0, x, k, y, ldy, r0);
}

template <BlockType TYPE, int LEVELS>
void gemm_blocks_l(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy) {
  for_groups(L, w, r0, r1, [&](const Group& G) {
    int i = 0;
    for (; i + 4 <= G.g; i += 4) rows_x_tokens<TYPE, LEVELS, 4>(G, i, x, y, ldy, r0);
    for (; i + 2 <= G.g; i += 2) rows_x_tokens<TYPE, LEVELS, 2>(G, i, x, y, ldy, r0);
    for (; i < G.g; ++i) rows_x_tokens<TYPE, LEVELS, 1>(G, i, x, y, ldy, r0);
  });
}

// The int8 GEMM of whole blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0), one or two levels.
template <BlockType TYPE>
void gemm_blocks_t(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy) {
  if (x.levels == 2) gemm_blocks_l<TYPE, 2>(L, w, r0, r1, x, y, ldy);
  else gemm_blocks_l<TYPE, 1>(L, w, r0, r1, x, y, ldy);
}

// ---- planes-packed Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 (cflow/planes.h): the prefill form of the planes GEMV ----
// For each interleave group of rows (a ragged one widened to 16 rows, planes_widen) and each
// run of kPlanesNT tokens, the ISA's planes_tokens<TYPE, NT, TWO> walks the group's chunks
// chunk(cb), cb = 0 .. bpr, and stores rows [0, g) of y for tokens [k0, k0 + NT): per chunk the
// weights are unpacked once and met by every token. TWO: the second activation level
// (QActs::levels 2) is dotted with the same unpacked weights.
template <BlockType TYPE, bool TWO>
void gemm_planes_l(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy) {
  constexpr int hdr = planes_header(TYPE);
  const int bb = L.bb;
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
    for (; k + NT <= x.n; k += NT) planes_tokens<TYPE, NT, TWO>(G.bpr, chunk, x, k, yg, ldy, G.g);
    if constexpr (NT > 8)
      for (; k + 8 <= x.n; k += 8) planes_tokens<TYPE, 8, TWO>(G.bpr, chunk, x, k, yg, ldy, G.g);
    for (; k + 2 <= x.n; k += 2) planes_tokens<TYPE, 2, TWO>(G.bpr, chunk, x, k, yg, ldy, G.g);
    for (; k < x.n; ++k) planes_tokens<TYPE, 1, TWO>(G.bpr, chunk, x, k, yg, ldy, G.g);
  });
}

// The planes GEMM of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0, one or two levels.
template <BlockType TYPE>
void gemm_planes_t(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy) {
  if (x.levels == 2) gemm_planes_l<TYPE, true>(L, w, r0, r1, x, y, ldy);
  else gemm_planes_l<TYPE, false>(L, w, r0, r1, x, y, ldy);
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

// The ISA's GEMM entries of the kernel table (kernels.h).
inline void fill_gemm_table(KernelTable& t) {
  auto set = [&](BlockType bt, GemmQ8Fn blocks, GemmQ8Fn planes) {
    t.gemm_q8[block_index(bt)][(int)Pack::Blocks] = blocks;
    t.gemm_q8[block_index(bt)][(int)Pack::Planes] = planes;
  };
  set(BlockType::Q4_0, gemm_blocks_t<BlockType::Q4_0>, gemm_planes_t<BlockType::Q4_0>);
  set(BlockType::Q4_1, gemm_blocks_t<BlockType::Q4_1>, gemm_planes_t<BlockType::Q4_1>);
  set(BlockType::Q5_0, gemm_blocks_t<BlockType::Q5_0>, gemm_planes_t<BlockType::Q5_0>);
  set(BlockType::Q5_1, gemm_blocks_t<BlockType::Q5_1>, gemm_planes_t<BlockType::Q5_1>);
  set(BlockType::Q8_0, gemm_blocks_t<BlockType::Q8_0>, gemm_planes_t<BlockType::Q8_0>);
  t.gemm_f32 = gemm_f32_rows;
}
