// A planes chunk's weights as bytes at 512 bits, the one decoder of the planes pack for the GEMV
// (gemv_avx512.cpp), the batched GEMV (gemv_amx.cpp) and the GEMM (gemm_avx512.cpp). Included
// inside namespace cflow::avx512 (anonymous), after <immintrin.h> and x86/planes_simd.h.
//
// planes_unpack<WT>(c, u): u[j], j = 0..7, is slice j of the 16 rows of chunk c (cflow/planes.h):
// row i's weights 4j..4j+3 in int32 lane i, as unsigned bytes (the integer weight plus
// PlanesKind<WT>::kZero):
//   Q4_0, Q4_1  slice j < 4: the low nibbles of plane j; j >= 4: the high nibbles of plane j - 4;
//   Q5_0, Q5_1  the same nibbles, and as bit 4 each weight's fifth bit. Lane i of the qh plane is
//               row i's 32 fifth bits, bit w for weight w, so slice j's are bits 4j..4j+3: the
//               lane shifted down by 4j, vpermd (which reads the low 4 bits of each index)
//               looks them up in kSpread, and one bit-select (vpternlogd) puts them above the
//               nibbles: per slice one shift, one permute, one logic op;
//   Q8_0        plane j, ^ 0x80.
//
// kSpread.v[v] (v = 0..15): bit b of v at bit 4 of byte b (b = 0..3): 4 weights' fifth bits.
struct alignas(64) SpreadTable {
  uint32_t v[16];
};
constexpr SpreadTable make_spread() {
  SpreadTable t{};
  for (uint32_t v = 0; v < 16; ++v)
    for (int b = 0; b < 4; ++b) t.v[v] |= ((v >> b) & 1) << (8 * b + 4);
  return t;
}
constexpr SpreadTable kSpread = make_spread();

template <BlockType WT>
inline void planes_unpack(const uint8_t* c, __m512i (&u)[8]) {
  using K = PlanesKind<WT>;
  const __m512i* pl = (const __m512i*)(c + K::kQs);
  if constexpr (!K::kNib) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int j = 0; j < 8; ++j) u[j] = _mm512_xor_si512(_mm512_loadu_si512(pl + j), flip);
  } else {
    const __m512i lo = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; ++k) {
      const __m512i q = _mm512_loadu_si512(pl + k);
      u[k] = q;
      u[4 + k] = _mm512_srli_epi16(q, 4);
    }
    if constexpr (K::kFifth) {
      const __m512i qh = _mm512_loadu_si512(c + K::kQh), spread = _mm512_load_si512(kSpread.v);
      for (int j = 0; j < 8; ++j) {  // (lo & nibbles) | (~lo & fifth bits)
        const __m512i h = _mm512_permutexvar_epi32(_mm512_srli_epi32(qh, 4 * j), spread);
        u[j] = _mm512_ternarylogic_epi32(lo, u[j], h, 0xCA);
      }
    } else {
      for (int j = 0; j < 8; ++j) u[j] = _mm512_and_si512(u[j], lo);
    }
  }
}
