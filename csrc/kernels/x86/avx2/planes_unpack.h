// A planes chunk's weights as bytes at 256 bits, the one decoder of the planes pack for the GEMV
// (gemv_avx2.cpp) and the GEMM (gemm_avx2.cpp). Included inside namespace cflow::avx2
// (anonymous), after <immintrin.h> and x86/planes_simd.h.
//
// planes_unpack<WT>(c, h, u): u[j], j = 0..7, is slice j of rows 8h .. 8h+7 of chunk c
// (cflow/planes.h; half h of each 64-byte plane): row 8h + i's weights 4j..4j+3 in int32 lane i.
//   Q4_0, Q4_1  unsigned (the integer weight plus PlanesKind<WT>::kZero): slice j < 4 the low
//               nibbles of plane j, j >= 4 the high nibbles of plane j - 4;
//   Q5_0, Q5_1  the same, and as bit 4 each weight's fifth bit. Lane i of the qh plane is row
//               i's 32 fifth bits, bit w for weight w, so slice j's are bits 4j..4j+3: nibble
//               j % 2 of the lane's byte j / 2. vpshufb copies that byte to the lane's 4 bytes
//               (for even j from qh << 4, so that the nibble is the high one either way); byte b
//               keeps its bit 4 + b (and), and min(., 16) makes it 0 or 16;
//   Q8_0        signed, as stored (its dot products take |w| and sign(x, w): no VNNI here).

// Slice j's fifth bits of a half (Q5_0, Q5_1) as bit 4 of each byte, 0 or 16: from the half's qh
// plane (odd j) or qh << 4 (even j).
inline __m256i planes_fifth(__m256i qh, __m256i qh4, int j) {
  const __m256i lane_byte0 = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808,
                                               0x0C0C0C0C);  // byte 0 of the lane, 4 times
  const __m256i bit = _mm256_set1_epi32((int)0x80402010), sixteen = _mm256_set1_epi8(16);
  const __m256i rep = _mm256_shuffle_epi8(j % 2 ? qh : qh4, _mm256_add_epi8(lane_byte0, _mm256_set1_epi8((char)(j / 2))));
  return _mm256_min_epu8(_mm256_and_si256(rep, bit), sixteen);
}

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
    if constexpr (K::kFifth) {
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(c + K::kQh + 32 * h));
      const __m256i qh4 = _mm256_slli_epi16(qh, 4);
      for (int j = 0; j < 8; ++j) u[j] = _mm256_or_si256(u[j], planes_fifth(qh, qh4, j));
    }
  }
}
