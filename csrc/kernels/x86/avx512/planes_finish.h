// The float part of a planes-packed block's int8 dot product at 512 bits, shared by the GEMV
// (gemv_avx512.cpp) and the batched GEMV (gemv_amx.cpp), so that both run the same float
// operations in the same order on the same exact integers: a token's result is then the same
// whichever kernel formed its integer dot products. Included inside namespace cflow::avx512
// (anonymous), after <immintrin.h> and cflow/planes.h.

// The chunk's header as floats: d, and (Q4_1, Q5_1) m; a batched kernel forms them once for
// all its tokens.
template <BlockType WT>
inline void planes_header_ps(const uint8_t* c, __m512& d, __m512& m) {
  d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)c));
  m = PlanesKind<WT>::kHasM ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(c + 32))) : d;
}

// One chunk c (cflow/planes.h) of 16 rows: S holds row i's exact integer dot product with the
// activation block a in lane i (the weight offset included: Q4_0 (q - 8), Q8_0 signed); T the
// same with the second level a2 (TWO: AType::Q8x2), whose scale d_a2 is d_a / 256
// (quantize_act). Returns acc + d_w * d_a * S, two levels acc + d_w * d_a2 * (256 S + T)
// (+ m_w * s for Q4_1 and Q5_1, s = s_a (+ s_a2)): the two levels meet as exact integers
// (|256 S| < 2^28 for every type), so a two-level block costs one conversion and one
// multiply-add, as one level does, where scaling each level apart took two of each; in a batched
// step of 8 two-level tokens that float part was a third of the time.
// The activation enters as two scalars, the scale da of the integer sum (d_a, two levels d_a2)
// and s, which the block form below takes from the blocks and the batched kernel precomputes;
// the header floats d and m come from planes_header_ps (the forms below from c take them there).
template <BlockType WT, bool TWO>
inline __m512 planes_finish(__m512 d, __m512 m, __m512i S, __m512i T, float da, float s, __m512 acc) {
  const __m512i I = TWO ? _mm512_add_epi32(_mm512_slli_epi32(S, 8), T) : S;
  acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(da)), _mm512_cvtepi32_ps(I), acc);
  if (PlanesKind<WT>::kHasM) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(s), acc);
  return acc;
}

template <BlockType WT, bool TWO>
inline __m512 planes_finish(const uint8_t* c, __m512i S, __m512i T, float da, float s, __m512 acc) {
  __m512 d, m;
  planes_header_ps<WT>(c, d, m);
  return planes_finish<WT, TWO>(d, m, S, T, da, s, acc);
}

// A token's two scalars of a column block, from its level blocks a (and a2): the one statement
// of how they are formed, for the block form below and the kernels that form them ahead.
struct ActScalars {
  float da, s;
};
template <bool TWO>
inline ActScalars planes_act_scalars(const block_q8a& a, const block_q8a* a2) {
  return {TWO ? a2->d : a.d, TWO ? a.s + a2->s : a.s};
}

template <BlockType WT, bool TWO>
inline __m512 planes_finish(const uint8_t* c, __m512i S, __m512i T, const block_q8a& a, const block_q8a* a2,
                            __m512 acc) {
  const ActScalars x = planes_act_scalars<TWO>(a, a2);
  return planes_finish<WT, TWO>(c, S, T, x.da, x.s, acc);
}

// y[0 .. gg) += acc[0 .. gg): a group's outputs, the rows past gg (a widened group) dropped.
inline void planes_store(float* y, int gg, __m512 acc) {
  const __mmask16 m = (__mmask16)((1u << gg) - 1);
  _mm512_mask_storeu_ps(y, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y), acc));
}
