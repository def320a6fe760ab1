// A planes chunk's weights as bytes at 256 bits, the one decoder of the planes pack for the GEMV
// (gemv_avx2.cpp) and the GEMM (gemm_avx2.cpp). Included inside namespace cflow::avx2
// (anonymous), after <immintrin.h> and x86/planes_simd.h.
//
// planes_unpack<WT>(c, h, u): u[j], j = 0..7, is slice j of rows 8h .. 8h+7 of chunk c
// (cflow/planes.h; half h of each 64-byte plane): row 8h + i's weights 4j..4j+3 in int32 lane i.
//   Q4_0, Q4_1  unsigned (the integer weight plus PlanesKind<WT>::kZero): slice j < 4 the low
//               nibbles of plane j, j >= 4 the high nibbles of plane j - 4;
//   Q8_0        signed, as stored (its dot products take |w| and sign(x, w): no VNNI here).
template <BlockType WT>
inline void planes_unpack(const uint8_t* c, int h, __m256i (&u)[8]) {
  using K = PlanesKind<WT>;
  const uint8_t* pl = c + K::kQs + 32 * h;
  if constexpr (!K::kNib) {
    for (int j = 0; j < 8; ++j) u[j] = _mm256_loadu_si256((const __m256i*)(pl + 64 * j));
  } else {
    const __m256i lo = _mm256_set1_epi8(0x0F);
    for (int k = 0; k < 4; ++k) {
      const __m256i q = _mm256_loadu_si256((const __m256i*)(pl + 64 * k));
      u[k] = _mm256_and_si256(q, lo);
      u[4 + k] = _mm256_and_si256(_mm256_srli_epi16(q, 4), lo);
    }
  }
}
