// Tile GEMV kernels written once over an ISA traits struct V; included by x86/avx2/gemv_avx2.cpp
// and x86/avx512/gemv_avx512.cpp *inside* their ISA namespace (cflow::avx2, cflow::avx512, in an
// anonymous namespace) right after they define V, so each ISA gets its own copy compiled with its
// own flags.
//
// V (derived from the ISA's float-vector traits Vec, x86/<isa>/vec.h) provides, for the fp32
// side: reg (W floats), zero, set1, load, load_n (first n < W lanes, rest 0), add,
// fmadd(a,b,c) = a*b+c, hsum, hsum8 (of a __m256), add_n(y, a, n) (y[0..n) += a[0..n)), load_e<E> /
// load_e_n<E> (W or n < W weights of element kind E: 0 f32, 1 f16, 2 bf16, as floats) and
// fma32(q, d0, o0, d1, o1, x, a0, a1): the 32 signed bytes q as weights d*q + o (d0, o0 for
// bytes 0..15, d1, o1 for 16..31) times x[0..32) added into a0 / a1.
// For the int8 side: the ISA's IVec (vec.h): dot, dot_sc, dot_s8, bits32 over 256-bit vectors.
// The including file also defines quantize_block(x, o): 32 activations -> o.qs, returning d.
// The including file has already included <immintrin.h>, <cstring>, isa_kernels.h, tile_walk.h.

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline int hsum_i32(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1));
  return _mm_cvtsi128_si32(v);
}

// 16 bytes of packed nibbles -> 32 bytes: low nibbles (weights 0..15) then high (16..31).
inline __m256i nib32(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128((const __m128i*)qs), m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

inline __m256i lo4(__m256i q) { return _mm256_and_si256(q, _mm256_set1_epi8(0x0F)); }
inline __m256i hi4(__m256i q) { return lo4(_mm256_srli_epi16(q, 4)); }
inline __m256i load32(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }

// ---- block kinds ----
// A kind describes one weight block type (kType; kQK weights, kBB bytes from the block table):
// the activation block Act of its int8 path, chunks(p, f) calling f(j, q, d0, o0, d1, o1) for
// each chunk j of 32 weights (fp32 weights d*q + o, as the scalar reference forms them) and
// dot(p, a, ls, acc, accs) (the int8 dot of block p with activation block a, whose lane sums
// are *ls for block_q8a, added into the 8 float lanes acc and the float accs).
// The 32-block kinds give q(p) / d(p) / o(p) (bytes, scale, fp32 offset) and kZero: the int8
// path takes q as unsigned bytes and subtracts kZero * (lane sums of x); kZero 0 (Q4_1) adds
// m * sum(x) instead (Q4_1, Q5_1), kZero -1 (Q8_0) marks signed weights.

// kType's row of the block table gives kQK and kBB.
template <BlockType BT>
struct BlkOf {
  static constexpr BlockType kType = BT;
  static constexpr int kQK = block_elems(BT), kBB = block_bytes(BT);
};

struct BlkQ4_0 : BlkOf<BlockType::Q4_0> {
  static constexpr int kZero = 8;
  static __m256i q(const uint8_t* p) { return nib32(p + 2); }
  static float d(const uint8_t* p) { return h2f(p); }
  static float o(const uint8_t* p) { return -8.0f * h2f(p); }
};
struct BlkQ4_1 : BlkOf<BlockType::Q4_1> {
  static constexpr int kZero = 0;
  static __m256i q(const uint8_t* p) { return nib32(p + 4); }
  static float d(const uint8_t* p) { return h2f(p); }
  static float o(const uint8_t* p) { return h2f(p + 2); }
};
struct BlkQ5_0 : BlkOf<BlockType::Q5_0> {
  static constexpr int kZero = 16;
  static __m256i q(const uint8_t* p) {  // nibble | (bit j of qh) << 4
    uint32_t qh;
    std::memcpy(&qh, p + 2, 4);
    return _mm256_or_si256(nib32(p + 6), _mm256_and_si256(V::bits32(qh), _mm256_set1_epi8(16)));
  }
  static float d(const uint8_t* p) { return h2f(p); }
  static float o(const uint8_t* p) { return -16.0f * h2f(p); }
};
struct BlkQ5_1 : BlkOf<BlockType::Q5_1> {
  static constexpr int kZero = 0;
  static __m256i q(const uint8_t* p) {  // as Q5_0's, qh and qs 2 bytes later (after m)
    uint32_t qh;
    std::memcpy(&qh, p + 4, 4);
    return _mm256_or_si256(nib32(p + 8), _mm256_and_si256(V::bits32(qh), _mm256_set1_epi8(16)));
  }
  static float d(const uint8_t* p) { return h2f(p); }
  static float o(const uint8_t* p) { return h2f(p + 2); }
};
struct BlkQ8_0 : BlkOf<BlockType::Q8_0> {
  static constexpr int kZero = -1;  // signed weights
  static __m256i q(const uint8_t* p) { return load32(p + 2); }
  static float d(const uint8_t* p) { return h2f(p); }
  static float o(const uint8_t*) { return 0.0f; }
};

// Q4_K's 8 scales and 8 mins (6 bits each, packed in 12 bytes) -> sm[0..8) scales, sm[8..16)
// mins, as GGML unpacks them (same values as get_scale_min_k4).
inline void scales_k4(const uint8_t* s12, uint8_t* sm) {
  uint32_t u[4];
  std::memcpy(u, s12, 12);
  const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
  u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
  const uint32_t mins_lo = u[1] & m1;
  u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
  u[2] = mins_lo;
  u[0] &= m1;
  std::memcpy(sm, u, 16);
}

// Q4_K and Q5_K share their scales, mins and float finish; Q::quants(p, c, lo, hi) gives chunk c's
// 64 weights as unsigned bytes: low nibbles (sub-block 2c), high nibbles (2c + 1).
struct QuantsQ4_K {
  // 4 chunks of 64 weights, 32 bytes each
  static void quants(const uint8_t* p, int c, __m256i& lo, __m256i& hi) {
    const __m256i q = load32(p + 16 + 32 * c);
    lo = lo4(q);
    hi = hi4(q);
  }
};

// Q5_K: chunk c's 32 qs bytes with bits 2c and 2c + 1 of the 32 qh bytes (the same 32 bytes for
// every chunk) as bit 4 of the low and high nibbles (weights 0..31).
struct QuantsQ5_K {
  static void quants(const uint8_t* p, int c, __m256i& lo, __m256i& hi) {
    const __m256i q = load32(p + 48 + 32 * c), qh = load32(p + 16), b4 = _mm256_set1_epi8(16);
    const __m256i h = _mm256_srli_epi16(qh, 2 * c);  // bit 2c of each byte at bit 0 (16-bit shift)
    lo = _mm256_or_si256(lo4(q), _mm256_and_si256(_mm256_slli_epi16(h, 4), b4));
    hi = _mm256_or_si256(hi4(q), _mm256_and_si256(_mm256_slli_epi16(h, 3), b4));
  }
};

template <BlockType T, class Q>
struct BlkK4 : BlkOf<T> {
  using Act = block_q8_K;
  static void quants(const uint8_t* p, int c, __m256i& lo, __m256i& hi) { Q::quants(p, c, lo, hi); }
  template <class F>
  static void chunks(const uint8_t* p, F&& f) {
    uint8_t sm[16];
    scales_k4(p + 4, sm);
    const float d = h2f(p), dmin = h2f(p + 2);
    for (int c = 0; c < 4; ++c) {
      __m256i lo, hi;
      quants(p, c, lo, hi);
      const float d0 = d * sm[2 * c], o0 = -(dmin * sm[8 + 2 * c]);
      const float d1 = d * sm[2 * c + 1], o1 = -(dmin * sm[9 + 2 * c]);
      f(2 * c, lo, d0, o0, d0, o0);
      f(2 * c + 1, hi, d1, o1, d1, o1);
    }
  }
  // acc += d*dx * sum_s sc_s (q_s . x_s); accs -= dmin*dx * sum_s m_s * sum(x_s). isum is the
  // integer part (8 int32 lanes summing to sum_s sc_s (q_s . x_s)); sm: scales_k4 of the block.
  // maddubs pair sums stay below 2 * 31 * 128 for 5-bit weights: no saturation.
  static __m256i isum(const uint8_t* p, const block_q8_K& a, const uint8_t* sm) {
    __m256i s = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i lo, hi;
      quants(p, c, lo, hi);
      s = V::dot_sc(s, lo, load32(a.qs + 64 * c), _mm256_set1_epi16(sm[2 * c]));
      s = V::dot_sc(s, hi, load32(a.qs + 64 * c + 32), _mm256_set1_epi16(sm[2 * c + 1]));
    }
    return s;
  }
  static void finish(const uint8_t* p, const block_q8_K& a, const uint8_t* sm, __m256i s, __m256& acc, float& accs) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(h2f(p) * a.d), acc);
    // bsums pairs (16 values each) -> the 8 sub-block sums of x, times the 8 mins
    const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i*)a.bsums),
                                      _mm_loadu_si128((const __m128i*)(a.bsums + 8)));
    const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(sm + 8)));
    accs -= h2f(p + 2) * a.d * (float)hsum_i32(_mm_madd_epi16(bs, mins));
  }
  static void dot(const uint8_t* p, const block_q8_K& a, const void*, __m256& acc, float& accs) {
    uint8_t sm[16];
    scales_k4(p + 4, sm);
    finish(p, a, sm, isum(p, a, sm), acc, accs);
  }
};
using BlkQ4_K = BlkK4<BlockType::Q4_K, QuantsQ4_K>;
using BlkQ5_K = BlkK4<BlockType::Q5_K, QuantsQ5_K>;

struct BlkQ6_K : BlkOf<BlockType::Q6_K> {
  using Act = block_q8_K;
  // The 32 weights j = 4h + k (half h of 128, quarter k) as 6-bit unsigned bytes (0..63):
  // low 4 bits from ql (bytes 0..31 or 32..63 of the half, low or high nibble), high 2 from qh.
  template <class F>
  static void quarters(const uint8_t* p, F&& f) {
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(p + 64 * h), l1 = load32(p + 64 * h + 32), qh = load32(p + 128 + 32 * h);
      auto hi2 = [&](int sh) { return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, sh), m3), 4); };
      f(4 * h + 0, _mm256_or_si256(lo4(l0), hi2(0)));
      f(4 * h + 1, _mm256_or_si256(lo4(l1), hi2(2)));
      f(4 * h + 2, _mm256_or_si256(hi4(l0), hi2(4)));
      f(4 * h + 3, _mm256_or_si256(hi4(l1), hi2(6)));
    }
  }
  // fp32 weight d * sc * (q - 32), 16 weights per scale.
  template <class F>
  static void chunks(const uint8_t* p, F&& f) {
    const int8_t* sc = (const int8_t*)(p + 192);
    const float d = h2f(p + 208);
    quarters(p, [&](int j, __m256i q) {
      const float d0 = d * sc[2 * j], d1 = d * sc[2 * j + 1];
      f(j, q, d0, -32.0f * d0, d1, -32.0f * d1);
    });
  }
  // acc += d*dx * (sum_c sc_c (q_c . x_c) - 32 sum_c sc_c sum(x_c)), c the 16 sub-blocks of 16.
  // isum: the first sum as 8 int32 lanes.
  static __m256i isum(const uint8_t* p, const block_q8_K& a) {
    const int8_t* sc = (const int8_t*)(p + 192);
    __m256i s = _mm256_setzero_si256();
    quarters(p, [&](int j, __m256i q) {
      const __m256i scj = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
      s = V::dot_sc(s, q, load32(a.qs + 32 * j), scj);
    });
    return s;
  }
  static void finish(const uint8_t* p, const block_q8_K& a, __m256i s, __m256& acc) {
    const __m128i sc = _mm_loadu_si128((const __m128i*)(p + 192));
    const __m256i off = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc), load32(a.bsums));
    s = _mm256_sub_epi32(s, _mm256_slli_epi32(off, 5));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(h2f(p + 208) * a.d), acc);
  }
  static void dot(const uint8_t* p, const block_q8_K& a, const void*, __m256& acc, float&) {
    finish(p, a, isum(p, a), acc);
  }
};

// ---- ternary kinds (TQ2_0, TQ1_0): weight d * (t - 1), code t in {0, 1, 2} (TQ2_0 also 3) ----
// runs(p, f) calls f(k, t) for the 8 runs k of 32 consecutive weights (32k .. 32k+31), t their codes
// as unsigned bytes; d(p) is the block's scale.
struct BlkTQ2_0 : BlkOf<BlockType::TQ2_0> {
  template <class F>
  static void runs(const uint8_t* p, F&& f) {  // bit pair l of qs[32h + m] is weight 128h + 32l + m
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m256i v = load32(p + 32 * h);
      f(4 * h + 0, _mm256_and_si256(v, m3));
      f(4 * h + 1, _mm256_and_si256(_mm256_srli_epi16(v, 2), m3));
      f(4 * h + 2, _mm256_and_si256(_mm256_srli_epi16(v, 4), m3));
      f(4 * h + 3, _mm256_and_si256(_mm256_srli_epi16(v, 6), m3));
    }
  }
  static float d(const uint8_t* p) { return h2f(p + 64); }
};

// TQ1_0's base-3 bytes: byte b times 3^n (mod 256) brings code n to the top trit, (t * 3) >> 8.
// Both steps in byte arithmetic, no multiply: x3 = x + 2x; x9 = 8x + x, the 16-bit shift's carries
// across bytes masked off; the top trit (t * 3) >> 8 = (t + t / 2 + carries) >> 7 >> 1, formed with
// two byte averages (the averages round up, so t - 1 goes in; t = 0 stays 0) and the top two bits.
inline __m256i times3(__m256i x) { return _mm256_add_epi8(x, _mm256_add_epi8(x, x)); }
inline __m256i times9(__m256i x) {
  return _mm256_add_epi8(_mm256_and_si256(_mm256_slli_epi16(x, 3), _mm256_set1_epi8((char)0xF8)), x);
}
inline __m256i top_trit(__m256i t) {
  const __m256i q = _mm256_subs_epu8(t, _mm256_set1_epi8(1));
  const __m256i a = _mm256_avg_epu8(q, _mm256_avg_epu8(q, _mm256_setzero_si256()));  // about 3t / 4
  return _mm256_and_si256(_mm256_srli_epi16(a, 6), _mm256_set1_epi8(3));
}

struct BlkTQ1_0 : BlkOf<BlockType::TQ1_0> {
  template <class F>
  static void runs(const uint8_t* p, F&& f) {
    const __m256i v = load32(p);  // qs[0..31]: code n of qs[m] is weight 32n + m
    const __m256i v3 = times3(v), v9 = times9(v), v27 = times9(v3), v81 = times9(v9);
    f(0, top_trit(v));
    f(1, top_trit(v3));
    f(2, top_trit(v9));
    f(3, top_trit(v27));
    f(4, top_trit(v81));
    // qs[32..47]: code n of qs[32 + m] is weight 160 + 16n + m; runs 5 and 6 take codes 0, 1 and 2, 3
    const __m128i u = _mm_loadu_si128((const __m128i*)(p + 32));
    const __m256i uu = _mm256_set_m128i(u, u);
    const __m256i u3 = times3(uu), u9 = times9(uu), u27 = times9(u3), u81 = times9(u9);
    f(5, top_trit(_mm256_blend_epi32(uu, u3, 0xF0)));
    f(6, top_trit(_mm256_blend_epi32(u9, u27, 0xF0)));
    // run 7: code 4 of qs[32..47], then qh: code n of qh[j] is weight 240 + 4n + j (dword 4 + n)
    uint32_t qh;
    std::memcpy(&qh, p + 48, 4);
    const __m256i w = _mm256_set1_epi32((int)qh), w3 = times3(w), w9 = times9(w), w27 = times9(w3);
    const __m256i hi = _mm256_blend_epi32(_mm256_blend_epi32(w, w3, 0x20), _mm256_blend_epi32(w9, w27, 0x80), 0xC0);
    f(7, top_trit(_mm256_blend_epi32(u81, hi, 0xF0)));
  }
  static float d(const uint8_t* p) { return h2f(p + 52); }
};

// The int8 dot of ternary blocks: sum_j (t_j - 1) a_j = sum_j t_j a_j - sum_j a_j, the activation
// sum from bsums (their 16 lanes: only the total matters). With VNNI one vpdpbusd per run;
// without, the pair sums of maddubs stay in int16 (|sum| <= 8 runs * 2 * 3 * 128 + 2048 < 2^15)
// and one madd per block widens them. codes(p, c) decodes a block's 8 runs once; isum(c, a) is
// their integer dot with one activation block, as 8 int32 lanes; finish adds it, scaled, into the
// row's 8 float lanes. The GEMV (one token) and the batched GEMV (one decode, several tokens) run
// the same three, so a token's result does not depend on its batch.
template <class B>
struct Tern : B {
  using Act = block_q8_K;
  static void codes(const uint8_t* p, __m256i (&c)[8]) {
    B::runs(p, [&](int r, __m256i t) { c[r] = t; });
  }
  static __m256i isum(const __m256i (&c)[8], const block_q8_K& a) {
    const __m256i bs = load32(a.bsums);
#if defined(__AVX512VNNI__)
    __m256i s = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(bs, _mm256_set1_epi16(1)));
    for (int r = 0; r < 8; ++r) s = _mm256_dpbusd_epi32(s, c[r], load32(a.qs + 32 * r));
    return s;
#else
    __m256i s16 = _mm256_sub_epi16(_mm256_setzero_si256(), bs);
    for (int r = 0; r < 8; ++r) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(c[r], load32(a.qs + 32 * r)));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
  }
  static __m256 finish(const uint8_t* p, const block_q8_K& a, __m256i s, __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(B::d(p) * a.d), acc);
  }
  template <int N>
  static void dotn(const uint8_t* const (&p)[N], const block_q8_K& a, __m256 (&acc)[N]) {
    for (int k = 0; k < N; ++k) {
      __m256i c[8];
      codes(p[k], c);
      acc[k] = finish(p[k], a, isum(c, a), acc[k]);
    }
  }
  static void dot(const uint8_t* p, const block_q8_K& a, const void*, __m256& acc, float&) {
    __m256i c[8];
    codes(p, c);
    acc = finish(p, a, isum(c, a), acc);
  }
};
using KTQ1_0 = Tern<BlkTQ1_0>;
using KTQ2_0 = Tern<BlkTQ2_0>;

// The 32-block kinds share their chunk and int8 dot forms.
template <class B>
struct Blk32 : B {
  using Act = block_q8a;
  template <class F>
  static void chunks(const uint8_t* p, F&& f) {
    const float d = B::d(p), o = B::o(p);
    f(0, B::q(p), d, o, d, o);
  }
  static void dot(const uint8_t* p, const block_q8a& a, const q8a_sums* ls, __m256& acc, float& accs) {
    const __m256i x = load32(a.qs);
    __m256i s;
    if (B::kZero < 0) {
      s = V::dot_s8(B::q(p), x, load32(ls->lsum8));
    } else {
      s = _mm256_setzero_si256();
      if (B::kZero > 0) s = _mm256_sub_epi32(s, _mm256_slli_epi32(load32(ls->lsum8), B::kZero == 8 ? 3 : 4));
      s = V::dot(s, B::q(p), x);
      if (B::kZero == 0) accs = std::fma(B::o(p), a.s, accs);  // fused in every instantiation
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(B::d(p) * a.d), acc);
  }
};
using KQ4_0 = Blk32<BlkQ4_0>;
using KQ4_1 = Blk32<BlkQ4_1>;
using KQ5_0 = Blk32<BlkQ5_0>;
using KQ5_1 = Blk32<BlkQ5_1>;
using KQ8_0 = Blk32<BlkQ8_0>;
using KQ4_K = BlkQ4_K;
using KQ5_K = BlkQ5_K;
using KQ6_K = BlkQ6_K;

// ---- int8-activation GEMV: four rows at a time (independent chains), x blocks shared ----
template <class T>
void gemv_q8(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  using A = typename T::Act;
  const A* x = (const A*)xv;
  // the lane sums of a block_q8a row (the K-quants' kinds take none)
  const q8a_sums* xs = T::kQK == QK ? q8a_sums_of((const block_q8a*)xv, L.cols) : nullptr;
  walk_tiles_whole(y, w, L, row_begin, row_end,
                   [&](const uint8_t* tile, int r, int nr, int cb0, int nb) {
                     for (int i = 0; i < nr; i += 4) {
                       const int n = nr - i < 4 ? nr - i : 4;
                       // rows i .. i+3 (a missing row repeats the last one; its result is dropped)
                       auto row = [&](int k) { return TileRow(tile, nr, nb, L.g, T::kBB, i + (k < n ? k : n - 1)); };
                       const TileRow tr[4] = {row(0), row(1), row(2), row(3)};
                       __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                       float accs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                       for (int b = 0; b < nb; ++b) {
                         const q8a_sums* sb = nullptr;
                         if constexpr (T::kQK == QK) sb = xs + cb0 + b;
                         for (int k = 0; k < n; ++k) T::dot(tr[k].base + b * tr[k].stride, x[cb0 + b], sb, acc[k], accs[k]);
                       }
                       for (int k = 0; k < n; ++k) y[r + i + k] += V::hsum8(acc[k]) + accs[k];
                     }
                   });
}

// ---- fp32-activation GEMV: weights formed as the scalar reference forms them (d * q + o is
// one rounding of the exact value for Q4_0/Q5_0/Q8_0/Q6_K), FMA with x; two rows at a time ----
template <class T>
void gemv_f32(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  const float* x = (const float*)xv;
  using reg = typename V::reg;
  walk_tiles_whole(y, w, L, row_begin, row_end,
                   [&](const uint8_t* tile, int r, int nr, int cb0, int nb) {
                     const float* xt = x + (size_t)cb0 * T::kQK;
                     for (int i = 0; i < nr; i += 2) {
                       const int n = nr - i < 2 ? nr - i : 2;
                       const TileRow r0(tile, nr, nb, L.g, T::kBB, i), r1(tile, nr, nb, L.g, T::kBB, i + n - 1);
                       reg a0 = V::zero(), a1 = V::zero(), c0 = V::zero(), c1 = V::zero();
                       for (int b = 0; b < nb; ++b) {
                         const float* xb = xt + (size_t)b * T::kQK;
                         T::chunks(r0.base + b * r0.stride, [&](int j, __m256i q, float d0, float o0, float d1, float o1) {
                           V::fma32(q, d0, o0, d1, o1, xb + 32 * j, a0, a1);
                         });
                         if (n == 2)
                           T::chunks(r1.base + b * r1.stride, [&](int j, __m256i q, float d0, float o0, float d1, float o1) {
                             V::fma32(q, d0, o0, d1, o1, xb + 32 * j, c0, c1);
                           });
                       }
                       y[r + i] += V::hsum(V::add(a0, a1));
                       if (n == 2) y[r + i + 1] += V::hsum(V::add(c0, c1));
                     }
                   });
}

// ---- ternary, int8 activations: payload order (stripe, tile, row pair), each row's 8 float
// lanes kept across the column tiles of its stripe (acc, 32 bytes a row, in L1) and summed once
// at the stripe's end: a 256-weight block fills a 256-column tile, and a horizontal sum per block
// and row would cost as much as the block's dot ----
template <class T>
void gemv_tern_q8(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  const block_q8_K* x = (const block_q8_K*)xv;
  thread_local std::vector<__m256> acc;
  for_stripes(L, w, row_begin, row_end, [&](const Stripe& S, int lo, int hi) {
    acc.assign((size_t)S.nr, _mm256_setzero_ps());
    for (int t = 0; t < S.ntiles(); ++t) {
      const uint8_t* tile = S.tile(t);
      const int nb = S.nb(t), cb0 = t * S.bpt;
      for (int i = lo; i < hi; i += 2) {
        const int i1 = i + 1 < hi ? i + 1 : i;  // an odd last row pairs with itself; its twin is dropped
        const TileRow r0(tile, S.nr, nb, S.g, T::kBB, i), r1(tile, S.nr, nb, S.g, T::kBB, i1);
        __m256 a[2] = {acc[i], acc[i1]};
        for (int b = 0; b < nb; ++b) {
          const uint8_t* const p[2] = {r0.base + b * r0.stride, r1.base + b * r1.stride};
          // the payload order is linear within a row (and, rows of one block, within a tile):
          // a hint for the same block two rows further, from each row of the pair, about one per
          // cache line. (kPrefetchAhead bytes from each row landed, with whole-row tiles, in the
          // other row of the pair, and left every second row to the hardware prefetcher.)
          if (prefetch_on()) {
            const size_t ah = (size_t)2 * nb * T::kBB;
            __builtin_prefetch(p[0] + ah, 0, 3);
            __builtin_prefetch(p[1] + ah, 0, 3);
          }
          T::template dotn<2>(p, x[cb0 + b], a);
        }
        acc[i] = a[0];
        if (i1 != i) acc[i1] = a[1];
      }
    }
    for (int i = lo; i < hi; ++i) y[S.row + i - row_begin] = V::hsum8(acc[i]);
  });
}

// The batched form (kernels.h GemvBatchFn): groups of up to kTernGroup tokens; each block decoded
// once (Tern::codes) and met by every token of the group (isum, finish: the GEMV's operations in
// its order, so each token's result is the GEMV's bit for bit). acc: each (token, row)'s 8 lanes.
constexpr int kTernGroup = 8;
template <class T>
void gemv_tern_batch(float* y, int ldy, const void* xv, int m, const uint8_t* w, const TileLayout& L, int row_begin,
                     int row_end) {
  const size_t ab = act_bytes(T::kType, AType::Q8, L.cols);  // one token's row of block_q8_K
  thread_local std::vector<__m256> acc;
  for (int t0 = 0; t0 < m; t0 += kTernGroup) {
    const int nt = std::min(kTernGroup, m - t0);
    const block_q8_K* x[kTernGroup];
    for (int k = 0; k < nt; ++k) x[k] = (const block_q8_K*)((const uint8_t*)xv + (size_t)(t0 + k) * ab);
    for_stripes(L, w, row_begin, row_end, [&](const Stripe& S, int lo, int hi) {
      acc.assign((size_t)nt * S.nr, _mm256_setzero_ps());
      for (int t = 0; t < S.ntiles(); ++t) {
        const uint8_t* tile = S.tile(t);
        const int nb = S.nb(t), cb0 = t * S.bpt;
        for (int i = lo; i < hi; ++i) {
          const TileRow r(tile, S.nr, nb, S.g, T::kBB, i);
          for (int b = 0; b < nb; ++b) {
            const uint8_t* p = r.base + b * r.stride;
            if (prefetch_on()) __builtin_prefetch(p + kPrefetchAhead, 0, 3);
            __m256i c[8];
            T::codes(p, c);
            for (int k = 0; k < nt; ++k) {
              __m256& a = acc[(size_t)k * S.nr + i];
              a = T::finish(p, x[k][cb0 + b], T::isum(c, x[k][cb0 + b]), a);
            }
          }
        }
      }
      for (int k = 0; k < nt; ++k)
        for (int i = lo; i < hi; ++i)
          y[(size_t)(t0 + k) * ldy + S.row + i - row_begin] = V::hsum8(acc[(size_t)k * S.nr + i]);
    });
  }
}

// The batched ternary kernel of (bt, pack, at), nullptr for other combinations.
inline GemvBatchFn tern_batch_fn(BlockType bt, Pack pack, AType at) {
  if (pack != Pack::Blocks || at != AType::Q8) return nullptr;
  if (bt == BlockType::TQ2_0) return gemv_tern_batch<KTQ2_0>;
  if (bt == BlockType::TQ1_0) return gemv_tern_batch<KTQ1_0>;
  return nullptr;
}

// ---- ternary, fp32 activations, without a multiply per weight: with the code's bits b1, b0,
// t - 1 = 2 b1 + b0 - 1, so a block's dot is 2 A1 + A0 - S, A1 and A0 the masked sums of x where
// b1 / b0 is set (vblendvps on the bit moved to the sign, then vaddps) and S the block's sum of x,
// shared by the rows of a pass; one multiply by d per block and row. Two rows at a time ----
template <class T>
__m256 tern_masked_sum(const uint8_t* p, const float* xb) {
  __m256 a1 = _mm256_setzero_ps(), a0 = _mm256_setzero_ps();
  T::runs(p, [&](int k, __m256i t) {
    const __m128i h[2] = {_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)};
    for (int g = 0; g < 4; ++g) {  // 8 weights: their codes as int32 lanes
      const __m256i c = _mm256_cvtepu8_epi32(g & 1 ? _mm_srli_si128(h[g / 2], 8) : h[g / 2]);
      const __m256 x8 = _mm256_loadu_ps(xb + 32 * k + 8 * g);
      a1 = _mm256_add_ps(a1, _mm256_blendv_ps(_mm256_setzero_ps(), x8, _mm256_castsi256_ps(_mm256_slli_epi32(c, 30))));
      a0 = _mm256_add_ps(a0, _mm256_blendv_ps(_mm256_setzero_ps(), x8, _mm256_castsi256_ps(_mm256_slli_epi32(c, 31))));
    }
  });
  return _mm256_add_ps(_mm256_add_ps(a1, a1), a0);
}

template <class T>
void gemv_tern_f32(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  const float* x = (const float*)xv;
  walk_tiles_whole(y, w, L, row_begin, row_end,
                   [&](const uint8_t* tile, int r, int nr, int cb0, int nb) {
                     const float* xt = x + (size_t)cb0 * T::kQK;
                     for (int i = 0; i < nr; i += 2) {
                       const int n = nr - i < 2 ? nr - i : 2;
                       const TileRow r0(tile, nr, nb, L.g, T::kBB, i), r1(tile, nr, nb, L.g, T::kBB, i + n - 1);
                       __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                       for (int b = 0; b < nb; ++b) {
                         const float* xb = xt + (size_t)b * T::kQK;
                         __m256 s = _mm256_setzero_ps();
                         for (int j = 0; j < T::kQK; j += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xb + j));
                         const uint8_t* p0 = r0.base + b * r0.stride;
                         a0 = _mm256_fmadd_ps(_mm256_set1_ps(T::d(p0)), _mm256_sub_ps(tern_masked_sum<T>(p0, xb), s), a0);
                         if (n == 2) {
                           const uint8_t* p1 = r1.base + b * r1.stride;
                           a1 = _mm256_fmadd_ps(_mm256_set1_ps(T::d(p1)), _mm256_sub_ps(tern_masked_sum<T>(p1, xb), s), a1);
                         }
                       }
                       y[r + i] += V::hsum8(a0);
                       if (n == 2) y[r + i + 1] += V::hsum8(a1);
                     }
                   });
}

// ---- F32 / F16 / BF16 (element kind E): any interleave ----
// g = 1: a row is contiguous, dot with x (W lanes, masked tail). g > 1: a group's g rows are
// interleaved element by element, so column j of the group is g contiguous weights: W rows at a
// time take one vector of weights per column times the broadcast x_j (masked for the last
// rows of a group).
template <int E>
void gemv_elem(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  constexpr int BB = E == 0 ? 4 : 2, W = V::W;
  const float* x = (const float*)xv;
  using reg = typename V::reg;
  walk_tiles(y, w, L, row_begin, row_end,
             [&](const uint8_t* grp, int r, int gg, int cb0, int nb) {
               const float* xt = x + cb0;
               if (gg == 1) {
                 reg a0 = V::zero(), a1 = V::zero();
                 int j = 0;
                 for (; j + 2 * W <= nb; j += 2 * W) {
                   a0 = V::fmadd(V::template load_e<E>(grp + j * BB), V::load(xt + j), a0);
                   a1 = V::fmadd(V::template load_e<E>(grp + (j + W) * BB), V::load(xt + j + W), a1);
                 }
                 for (; j < nb; j += W) {
                   const int n = nb - j < W ? nb - j : W;
                   a0 = V::fmadd(V::template load_e_n<E>(grp + j * BB, n), V::load_n(xt + j, n), a0);
                 }
                 y[r] += V::hsum(V::add(a0, a1));
                 return;
               }
               for (int i = 0; i < gg; i += W) {
                 const int n = gg - i < W ? gg - i : W;
                 reg acc = V::zero();
                 const uint8_t* p = grp + (size_t)i * BB;
                 if (n == W)
                   for (int j = 0; j < nb; ++j) acc = V::fmadd(V::template load_e<E>(p + (size_t)j * gg * BB), V::set1(xt[j]), acc);
                 else
                   for (int j = 0; j < nb; ++j) acc = V::fmadd(V::template load_e_n<E>(p + (size_t)j * gg * BB, n), V::set1(xt[j]), acc);
                 V::add_n(y + r + i, acc, n);
               }
             });
}

// A block_q8a whose quants q (the bytes of o.qs) are set: its scale d, s = d * sum(q) and the
// lane sums l.
inline void finish_q8a_v(block_q8a& o, q8a_sums& l, __m256i q, float d) {
  const __m256i l8 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
  const __m128i l4 = _mm_add_epi32(_mm256_castsi256_si128(l8), _mm256_extracti128_si256(l8, 1));
  _mm256_storeu_si256((__m256i*)l.lsum8, l8);
  _mm_storeu_si128((__m128i*)l.lsum4, l4);
  o.d = d;
  o.s = d * (float)hsum_i32(l4);
}

// Activations -> one row of block_q8a, rounding to nearest even as the reference: the ISA's
// quantize_block(x, o) writes o.qs and returns d; the lane sums and s follow from the bytes.
inline void quantize_q8a_v(block_q8a* out, const float* x, int cols) {
  q8a_sums* ls = q8a_sums_of(out, cols);
  for (int b = 0; b < cols / QK; ++b) {
    const float d = quantize_block(x + (size_t)b * QK, out[b]);
    finish_q8a_v(out[b], ls[b], load32(out[b].qs), d);
  }
}

// Level 2 of a two-level row, byte for byte ref::quantize_q8a_level2: per block r = x - d1 q1
// (one fma, std::fma there), q2 = r * (1 / (d1 / 256)) rounded to nearest even (cvtps), packed
// with saturation and clamped to -127.
inline void quantize_q8a_level2_v(block_q8a* out, block_q8a* l1, const float* x, int cols) {
  const __m256i lo = _mm256_set1_epi8(-127);
  q8a_sums *ls = q8a_sums_of(out, cols), *ls1 = q8a_sums_of(l1, cols);
  for (int b = 0; b < cols / QK; ++b, x += QK) {
    block_q8a& a = l1[b];
    if (!(a.d >= 0x1p-118f)) {  // near zero (or NaN): both levels zero, as the reference
      std::memset(a.qs, 0, QK);
      std::memset(&ls1[b], 0, sizeof(q8a_sums));
      a.d = a.s = 0.0f;
    }
    block_q8a& o = out[b];
    const float d2 = a.d * 0x1p-8f, id = d2 > 0.0f ? 1.0f / d2 : 0.0f;
    const __m256 vd = _mm256_set1_ps(a.d), vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(a.qs + 8 * k))));
      const __m256 r = _mm256_fnmadd_ps(vd, q1, _mm256_loadu_ps(x + 8 * k));
      q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(r, vid));
    }
    // packs interleave 128-bit lanes: (q0 q1) -> words 0-3 of q0, 0-3 of q1, 4-7 of q0, 4-7 of q1
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    q8 = _mm256_max_epi8(q8, lo);
    _mm256_storeu_si256((__m256i*)o.qs, q8);
    finish_q8a_v(o, ls[b], q8, d2);
  }
}

// Activations -> one row of block_q8_K (the K-quants' activations), bit for bit the reference's
// (ref::quantize_q8_K: max |x| / 127, round to nearest even) at 256 bits: both ISAs run it.
inline void quantize_q8K_v(block_q8_K* out, const float* x, int cols) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int b = 0; b < cols / QK_K; ++b, x += QK_K) {
    block_q8_K& o = out[b];
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < QK_K; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float d = _mm_cvtss_f32(h) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    for (int c = 0; c < QK_K / 16; ++c) {  // 16 values: 16 bytes of qs and their sum, bsums[c]
      const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * c), vid));
      const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * c + 8), vid));
      const __m128i w0 = _mm_packs_epi32(_mm256_castsi256_si128(q0), _mm256_extracti128_si256(q0, 1));
      const __m128i w1 = _mm_packs_epi32(_mm256_castsi256_si128(q1), _mm256_extracti128_si256(q1, 1));
      _mm_storeu_si128((__m128i*)(o.qs + 16 * c), _mm_packs_epi16(w0, w1));
      const __m256i s = _mm256_add_epi32(q0, q1);
      o.bsums[c] = (int16_t)hsum_i32(_mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
    }
    o.d = d;
  }
}

// Fills the table entries every ISA shares (a file may then replace some with its own kernels).
template <class K>
void set_kind(KernelTable& t) {
  set_gemv_f32<gemv_f32<K>>(t, K::kType);
  set_gemv_q8<gemv_q8<K>>(t, K::kType);
}

inline void fill_table(KernelTable& t) {
  set_gemv_f32<gemv_elem<0>>(t, BlockType::F32);
  set_gemv_f32<gemv_elem<1>>(t, BlockType::F16);
  set_gemv_f32<gemv_elem<2>>(t, BlockType::BF16);
  set_kind<KQ4_0>(t);
  set_kind<KQ4_1>(t);
  set_kind<KQ5_0>(t);
  set_kind<KQ5_1>(t);
  set_kind<KQ8_0>(t);
  set_kind<KQ4_K>(t);
  set_kind<KQ5_K>(t);
  set_kind<KQ6_K>(t);
  set_gemv_f32<gemv_tern_f32<BlkTQ1_0>>(t, BlockType::TQ1_0);
  set_gemv_q8<gemv_tern_q8<KTQ1_0>>(t, BlockType::TQ1_0);
  set_gemv_f32<gemv_tern_f32<BlkTQ2_0>>(t, BlockType::TQ2_0);
  set_gemv_q8<gemv_tern_q8<KTQ2_0>>(t, BlockType::TQ2_0);
  t.quantize_q8a = quantize_q8a_v;
  t.quantize_q8a_level2 = quantize_q8a_level2_v;
  t.quantize_q8K = quantize_q8K_v;
}
