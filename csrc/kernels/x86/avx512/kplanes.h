// The K-quant planes pack at 512 bits (Q4_K, Q5_K, Q6_K; x86/planes_simd.h KPlanesKind): a 16-row
// chunk's weights, sub-block scales and mins, and the float finish of a super-block, shared by
// the GEMV (gemv_avx512.cpp), the batched GEMV (gemv_amx.cpp) and the GEMM (gemm_avx512.cpp).
// Included inside namespace cflow::avx512 (anonymous), after <immintrin.h> and x86/planes_simd.h.
//
// Per super-block, for row i (int32 lane i) and one activation level a (block_q8_K, scale d_a):
//   D_s = sum over sub-block s of (u - kZero) * a      exact int32 (|D_s| <= 32 * 63 * 128)
//   I   = sum_s sc_s * D_s                             exact int32 (Q4_K < 2^25, Q5_K < 2^26, Q6_K < 2^28)
//   M   = sum_s m_s * (sum of a over s)                Q4_K and Q5_K, exact int32 (< 2^21)
//   y  += d * d_a * I - dmin * d_a * M                 kplanes_finish, the one float part
// Integer sums do not depend on their order, so any kernel that forms I and M (vpdpbusd here,
// tdpbssd on AMX) and then runs kplanes_finish gives a token the same result, bit for bit.

// Group q's 16 slices of the 16 rows (KPlanesKind: u[k] is slice k % kSlices of sub-block
// sub(q, k / kSlices)), unsigned. Q6_K: quarter t's 6-bit weights are nibble t / 2 of a ql
// plane and bits 2t, 2t+1 of the qh plane, moved to bits 4, 5 (16-bit shifts: the 0x30 mask
// drops what crosses a byte) and put beside the nibble by one bit-select. Q5_K: slice j's fifth
// bits are bits 2q (low nibbles) and 2q + 1 (high) of each byte of qh plane 3 + j, moved to bit 4
// (kplanes_bit4) and put beside the nibbles the same way.
// Bit b (0..7) of every byte of h at bit 4 of that byte (16-bit shifts by at most 4: what crosses
// a byte lands in bits the caller masks off).
inline __m512i kplanes_bit4(__m512i h, int b) { return b <= 4 ? _mm512_slli_epi16(h, 4 - b) : _mm512_srli_epi16(h, b - 4); }

template <BlockType WT>
inline void kplanes_unpack(const uint8_t* c, int q, __m512i (&u)[16]) {
  using K = KPlanesKind<WT>;
  const __m512i* pl = (const __m512i*)(c + K::kPlanes);
  const __m512i lo = _mm512_set1_epi8(0x0F);
  if constexpr (K::kQ4) {
    const __m512i b4 = _mm512_set1_epi8(16);
    for (int j = 0; j < 8; ++j) {
      const __m512i p = _mm512_loadu_si512(pl + K::kQsPlane + 8 * q + j);
      if constexpr (K::kFifth) {  // (lo & nibbles) | (~lo & fifth bits)
        const __m512i h = _mm512_loadu_si512(pl + 3 + j);
        u[j] = _mm512_ternarylogic_epi32(lo, p, _mm512_and_si512(kplanes_bit4(h, 2 * q), b4), 0xCA);
        u[8 + j] = _mm512_ternarylogic_epi32(lo, _mm512_srli_epi16(p, 4), _mm512_and_si512(kplanes_bit4(h, 2 * q + 1), b4), 0xCA);
      } else {
        u[j] = _mm512_and_si512(p, lo);
        u[8 + j] = _mm512_and_si512(_mm512_srli_epi16(p, 4), lo);
      }
    }
  } else {
    const __m512i hi2 = _mm512_set1_epi8(0x30);
    auto sel = [&](__m512i nib, __m512i bits) {  // (lo & nib) | (~lo & bits & 0x30)
      return _mm512_ternarylogic_epi32(lo, nib, _mm512_and_si512(bits, hi2), 0xCA);
    };
    for (int m = 0; m < 4; ++m) {
      const __m512i qh = _mm512_loadu_si512(pl + K::q6_qh(q, m));
      const __m512i l0 = _mm512_loadu_si512(pl + K::q6_ql(q, 0, m)), l1 = _mm512_loadu_si512(pl + K::q6_ql(q, 1, m));
      u[m] = sel(l0, _mm512_slli_epi16(qh, 4));
      u[4 + m] = sel(l1, _mm512_slli_epi16(qh, 2));
      u[8 + m] = sel(_mm512_srli_epi16(l0, 4), qh);
      u[12 + m] = sel(_mm512_srli_epi16(l1, 4), _mm512_srli_epi16(qh, 2));
    }
  }
}

// Sub-block s's scale of the 16 rows (int32 lanes): Q4_K's (and Q5_K's) 6-bit sc from planes 0 and 2, Q6_K's
// int8 from byte s % 4 of its scale plane (docs/FORMAT.md 5.1).
template <BlockType WT>
inline __m512i kplanes_scale(const uint8_t* c, int s) {
  using K = KPlanesKind<WT>;
  const __m512i* pl = (const __m512i*)(c + K::kPlanes);
  if constexpr (K::kQ4) {
    const __m512i A = _mm512_loadu_si512(pl);
    if (s < 4) return _mm512_and_si512(_mm512_srli_epi32(A, 8 * s), _mm512_set1_epi32(63));
    const int k = 8 * (s - 4);
    const __m512i C = _mm512_loadu_si512(pl + 2);
    return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(C, k), _mm512_set1_epi32(15)),
                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(A, k + 6), _mm512_set1_epi32(3)), 4));
  } else {
    return _mm512_srai_epi32(_mm512_slli_epi32(_mm512_loadu_si512(pl + K::q6_scales(s)), 24 - 8 * (s % 4)), 24);
  }
}

// Q4_K's (and Q5_K's) sub-block j's 6-bit min m_j of the 16 rows (int32 lanes), from planes 1 and 2.
template <BlockType WT>
inline __m512i kplanes_min(const uint8_t* c, int j) {
  const __m512i* pl = (const __m512i*)(c + KPlanesKind<WT>::kPlanes);
  const __m512i B = _mm512_loadu_si512(pl + 1);
  if (j < 4) return _mm512_and_si512(_mm512_srli_epi32(B, 8 * j), _mm512_set1_epi32(63));
  const int k = 8 * (j - 4);
  const __m512i C = _mm512_loadu_si512(pl + 2);
  return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(C, k + 4), _mm512_set1_epi32(15)),
                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(B, k + 6), _mm512_set1_epi32(3)), 4));
}

// Q4_K's (and Q5_K's) M = sum_j m_j * asum_j as vpdpwssd over int16 pairs: kplanes_min_pairs
// forms the chunk's mins once, mp[i] = m_2i | m_2i+1 << 16 per lane, and kplanes_mins_pairs sums
// them against a token's asum pairs (kplanes_asum_pair): 4 vpdpwssd a level where the sum term by
// term takes 8 extractions, 8 vpmulld and 8 adds (each |asum| <= 32 * 128 and m <= 63 fit int16;
// the int32 sums are exact, so M is the same integer).
template <BlockType WT>
inline void kplanes_min_pairs(const uint8_t* c, __m512i (&mp)[4]) {
  for (int i = 0; i < 4; ++i)
    mp[i] = _mm512_or_si512(kplanes_min<WT>(c, 2 * i), _mm512_slli_epi32(kplanes_min<WT>(c, 2 * i + 1), 16));
}

template <BlockType WT>
inline int32_t kplanes_asum_pair(const block_q8_K& a, int i) {
  using K = KPlanesKind<WT>;
  return (int32_t)(((uint32_t)(uint16_t)(int16_t)K::asum(a, 2 * i)) | ((uint32_t)(uint16_t)(int16_t)K::asum(a, 2 * i + 1) << 16));
}

// ap: the token's 4 asum pairs of one level.
inline __m512i kplanes_mins_pairs(const __m512i (&mp)[4], const int32_t* ap) {
  __m512i M = _mm512_setzero_si512();
  for (int i = 0; i < 4; ++i) M = _mm512_dpwssd_epi32(M, mp[i], _mm512_set1_epi32(ap[i]));
  return M;
}

// The chunk's header as floats: d, and (Q4_K, Q5_K) dmin; a batched kernel forms them once for
// all its tokens.
template <BlockType WT>
inline void kplanes_header_ps(const uint8_t* c, __m512& d, __m512& dmin) {
  d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)c));
  dmin = KPlanesKind<WT>::kQ4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(c + 32))) : d;
}

// acc + d (d_a I + d_a2 I2) - dmin (d_a M + d_a2 M2) (TWO), or acc + (d d_a) I - (dmin d_a) M.
template <BlockType WT, bool TWO>
inline __m512 kplanes_finish(__m512 d, __m512 dmin, __m512i I, __m512i M, __m512i I2, __m512i M2, float ad,
                             float a2d, __m512 acc) {
  const __m512 da = _mm512_set1_ps(ad);
  auto level2 = [&](__m512i S, __m512i S2) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(S2), _mm512_set1_ps(a2d), _mm512_mul_ps(_mm512_cvtepi32_ps(S), da));
  };
  if (TWO) acc = _mm512_fmadd_ps(d, level2(I, I2), acc);
  else acc = _mm512_fmadd_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(I), acc);
  if constexpr (KPlanesKind<WT>::kQ4) {
    if (TWO) acc = _mm512_fnmadd_ps(dmin, level2(M, M2), acc);
    else acc = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, da), _mm512_cvtepi32_ps(M), acc);
  }
  return acc;
}

template <BlockType WT, bool TWO>
inline __m512 kplanes_finish(const uint8_t* c, __m512i I, __m512i M, __m512i I2, __m512i M2, const block_q8_K& a,
                             const block_q8_K* a2, __m512 acc) {
  __m512 d, dmin;
  kplanes_header_ps<WT>(c, d, dmin);
  return kplanes_finish<WT, TWO>(d, dmin, I, M, I2, M2, a.d, TWO ? a2->d : 0.f, acc);
}
