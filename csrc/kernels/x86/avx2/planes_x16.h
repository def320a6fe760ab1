// Q8_0's planes against both activation levels at once, in 16 bits, at 256 bits, the float
// finish of the planes kernels and the blocks' start records (Q4_0, Q5_0: BlockStart): shared by
// the GEMV and its batched pass (gemv_avx2.cpp) and the prefill GEMM (gemm_avx2.cpp: Q8_0 with two
// levels). Included inside namespace cflow::avx2 (anonymous), after <immintrin.h>,
// x86/planes_simd.h and isa_kernels.h.
//
// Without VNNI, Q8_0's signed weights meet int8 activations as |w| times sign(x, w) and a madd
// per slice and level (no int16 runs: two pair sums can exceed 32767). Widened to int16 instead,
// the weights meet both levels at once: the second level's scale is the first's / 256, so
// x16 = 256 q1 + q2 fits int16 (|q1| <= 127 and q2 >= -128: |x16| <= 32640), and a madd of w
// against x16 gives 256 s + s2 directly, exact in int32 (|I| <= 32 * 128 * 32640, a crafted
// weight of -128 included): per slice two vpmovsxbw (16 rows' bytes -> rows 0..3 and 4..7), two
// madds and two adds where the int8 path takes nine operations per level pair. A 32-bit lane of
// the widened slice holds two weights of a row, so each half's lane pairs are added at the end
// (pairs_to_rows). One level stays on the int8 path (planes_dot), which is then the cheaper:
// 19% faster one-token GEMV and 30% faster batched pass with two levels, 15-20% slower with one.
// The nibble types stay on the int8 path with two levels too: their maddubs take unsigned
// weights directly and add up in int16 runs, and widened (zero-extended once per half for all of
// a batched pass's tokens) they ran 25-35% slower (docs/KERNELS.md).

// Rows 8h .. 8h+7: the float part of a block, as planes_finish at 512 bits: acc + d_w d_a I, or
// with two levels (the second's scale is d_a / 256) acc + d_w d_a2 I, I = 256 s + s2 the levels'
// exact integer sums (one conversion and one multiply-add for both); plus m_w s_a (s_a + s_a2)
// for Q4_1 and Q5_1.
template <BlockType WT, bool TWO>
inline __m256 planes_finish(const uint8_t* c, int h, __m256i I, const block_q8a& a, const block_q8a* a2, __m256 acc) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(c + 16 * h)));
  acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(TWO ? a2->d : a.d)), _mm256_cvtepi32_ps(I), acc);
  if (PlanesKind<WT>::kHasM)
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(c + 32 + 16 * h))),
                          _mm256_set1_ps(TWO ? a.s + a2->s : a.s), acc);
  return acc;
}

// What each 16-row chunk of one column block starts from, for one token of Q4_0 or Q5_0
// (kBlockStarts): z, the integer dot's start value -kZero * (256 s1 + s2) with two levels (-kZero
// s1 with one; s the integer sums of a level's bytes), and d, the activation scale of the finish
// (the second level's with two). block_starts makes them once a call: made by every chunk for
// itself, z was 14 scalar instructions of a Q4_0 chunk's 192 in the one-token GEMV, and twice that
// in the batched pass, which met each block once a half and token (docs/KERNELS.md). The types
// without an offset start from 0 and take their scales from the blocks: records for Q4_1's mins
// too ran 2-4% more instructions than the blocks' own fields.
struct BlockStart {
  int32_t z;
  float d;
};
template <BlockType WT>
constexpr bool kBlockStarts = PlanesKind<WT>::kNib && PlanesKind<WT>::kZero != 0;
template <BlockType WT>
inline int32_t start_z(const BlockStart* st) {
  if constexpr (kBlockStarts<WT>) return st->z;
  return 0;
}

// planes_finish with the block's record where the type has one (the same operations on the same
// values: st->d is a2->d, or a.d with one level).
template <BlockType WT, bool TWO>
inline __m256 planes_finish(const uint8_t* c, int h, __m256i I, const block_q8a& a, const block_q8a* a2,
                            const BlockStart* st, __m256 acc) {
  if constexpr (!kBlockStarts<WT>) return planes_finish<WT, TWO>(c, h, I, a, a2, acc);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(c + 16 * h)));
  return _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(st->d)), _mm256_cvtepi32_ps(I), acc);
}

// The records of nt tokens' activation rows (token t's level 1 at x + t * ab, its level 2
// q8a_row_bytes(cols) on), block-major: block b of token t at [b * nt + t], so that a chunk's
// tokens read theirs in turn. A thread_local buffer, valid until the thread's next call.
template <BlockType WT, bool TWO>
inline const BlockStart* block_starts(const uint8_t* x, size_t ab, int nt, int cols) {
  thread_local std::vector<BlockStart> v;
  const int nb = cols / QK;
  v.resize((size_t)nb * nt);
  auto isum = [](const q8a_sums& s) { return s.lsum4[0] + s.lsum4[1] + s.lsum4[2] + s.lsum4[3]; };
  for (int t = 0; t < nt; ++t) {
    const block_q8a* a = (const block_q8a*)(x + t * ab);
    const block_q8a* a2 = TWO ? level2(a, q8a_row_bytes(cols)) : a;
    const q8a_sums *la = q8a_sums_of(a, cols), *la2 = q8a_sums_of(a2, cols);
    for (int b = 0; b < nb; ++b) {
      BlockStart& o = v[(size_t)b * nt + t];
      o.z = -PlanesKind<WT>::kZero * (TWO ? 256 * isum(la[b]) + isum(la2[b]) : isum(la[b]));
      o.d = TWO ? a2[b].d : a[b].d;
    }
  }
  return v.data();
}

// A block's two levels as x16 = 256 q1 + q2, 32 int16.
inline void x16_of(const block_q8a& a, const block_q8a& a2, int16_t (&x16)[32]) {
  for (int i = 0; i < 2; ++i) {
    const __m256i v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(a.qs + 16 * i)));
    const __m256i v2 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(a2.qs + 16 * i)));
    _mm256_storeu_si256((__m256i*)(x16 + 16 * i), _mm256_add_epi16(_mm256_slli_epi16(v1, 8), v2));
  }
}

// Rows 0..7 of a half from its lane-pair sums: lo (rows 0..3, two lanes a row) and hi (rows 4..7).
inline __m256i pairs_to_rows(__m256i lo, __m256i hi) {
  // hadd: [r0 r1 r4 r5 | r2 r3 r6 r7]
  return _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(lo, hi), _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

// I of NH halves (S[i]: half h0 + i) from x16: w16(h, j, lo, hi) gives slice j of half h widened
// (rows 0..3 in lo, 4..7 in hi). PIN (the one-token GEMV): the sums held in registers after every
// slice. Unpinned, GCC reassociated them into a tree of 32 madd results and spilled half of
// them: the pinned GEMV runs 11% fewer instructions and 10-15% faster (docs/KERNELS.md); the
// batched pass and the GEMM, whose widened slices are already kept for their tokens, ran 5% more
// instructions pinned.
template <int NH, bool PIN = false, class W16>
inline void dot16(W16&& w16, int h0, const int16_t (&x16)[32], __m256i (&S)[NH]) {
  __m256i lo[NH], hi[NH];
  for (int i = 0; i < NH; ++i) lo[i] = hi[i] = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    int64_t v;
    std::memcpy(&v, x16 + 4 * j, 8);
    const __m256i xb = _mm256_set1_epi64x(v);  // activations 4j .. 4j+3, every row
    for (int i = 0; i < NH; ++i) {
      __m256i wl, wh;
      w16(h0 + i, j, wl, wh);
      lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(wl, xb));
      hi[i] = _mm256_add_epi32(hi[i], _mm256_madd_epi16(wh, xb));
      if constexpr (PIN) {
        keep_in_register(lo[i]);
        keep_in_register(hi[i]);
      }
    }
  }
  for (int i = 0; i < NH; ++i) S[i] = pairs_to_rows(lo[i], hi[i]);
}

// Slice j of half h of Q8_0 chunk c, widened (signed): rows 0..3 in wl, 4..7 in wh.
inline void q8_widen(const uint8_t* c, int h, int j, __m256i& wl, __m256i& wh) {
  const uint8_t* s = c + PlanesKind<BlockType::Q8_0>::kQs + 64 * j + 32 * h;
  wl = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)s));
  wh = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(s + 16)));
}

// Q8_0 chunk c against nt <= 16 tokens' two levels, for the kernels that visit a chunk for many
// tokens (the batched pass, the GEMM): each half widened once, each token's x16 made once, then
// acc[t][h] (token t's rows 8h .. 8h+7) through the GEMV's integers and finish. level1(t) and
// level2(t): token t's block of this column (a reference) and its second level (a pointer).
template <class Level1, class Level2>
inline void q8_chunk_two_levels(const uint8_t* c, int nt, Level1&& level1, Level2&& level2, __m256 (*acc)[2]) {
  alignas(32) int16_t x16[16][32];
  for (int t = 0; t < nt; ++t) x16_of(level1(t), *level2(t), x16[t]);
  for (int h = 0; h < 2; ++h) {
    __m256i w16[8][2];
    for (int j = 0; j < 8; ++j) q8_widen(c, h, j, w16[j][0], w16[j][1]);
    for (int t = 0; t < nt; ++t) {
      __m256i S[1];
      dot16<1>([&](int, int j, __m256i& wl, __m256i& wh) { wl = w16[j][0], wh = w16[j][1]; }, 0, x16[t], S);
      acc[t][h] = planes_finish<BlockType::Q8_0, true>(c, h, S[0], level1(t), level2(t), acc[t][h]);
    }
  }
}
