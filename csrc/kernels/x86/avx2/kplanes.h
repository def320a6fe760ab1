// The K-quant planes pack at 256 bits (Q4_K, Q5_K, Q6_K; x86/planes_simd.h KPlanesKind), the pieces of
// x86/avx512/kplanes.h for half h of a 16-row chunk (rows 8h .. 8h+7: the 32-byte half h of
// every plane and of the header vectors), shared by the GEMV (gemv_avx2.cpp) and the GEMM
// (gemm_avx2.cpp). The integers I, M and the float finish are those of the 512-bit file.
// Included inside namespace cflow::avx2 (anonymous), after <immintrin.h> and x86/planes_simd.h.

// Bit b (0..7) of every byte of h at bit 4 of that byte (as the 512-bit kplanes_bit4).
inline __m256i kplanes_bit4(__m256i h, int b) { return b <= 4 ? _mm256_slli_epi16(h, 4 - b) : _mm256_srli_epi16(h, b - 4); }

// Group q's 16 slices of rows 8h .. 8h+7, unsigned (KPlanesKind).
template <BlockType WT>
inline void kplanes_unpack(const uint8_t* c, int h, int q, __m256i (&u)[16]) {
  using K = KPlanesKind<WT>;
  const uint8_t* pl = c + K::kPlanes + 32 * h;
  auto plane = [&](int p) { return _mm256_loadu_si256((const __m256i*)(pl + 64 * p)); };
  const __m256i lo = _mm256_set1_epi8(0x0F);
  if constexpr (K::kQ4) {
    const __m256i b4 = _mm256_set1_epi8(16);
    for (int j = 0; j < 8; ++j) {
      const __m256i p = plane(K::kQsPlane + 8 * q + j);
      u[j] = _mm256_and_si256(p, lo);
      u[8 + j] = _mm256_and_si256(_mm256_srli_epi16(p, 4), lo);
      if constexpr (K::kFifth) {  // Q5_K: bits 2q and 2q + 1 of qh plane 3 + j as bit 4
        const __m256i qh = plane(3 + j);
        u[j] = _mm256_or_si256(u[j], _mm256_and_si256(kplanes_bit4(qh, 2 * q), b4));
        u[8 + j] = _mm256_or_si256(u[8 + j], _mm256_and_si256(kplanes_bit4(qh, 2 * q + 1), b4));
      }
    }
  } else {
    const __m256i hi2 = _mm256_set1_epi8(0x30);
    auto sel = [&](__m256i nib, __m256i bits) {
      return _mm256_or_si256(_mm256_and_si256(nib, lo), _mm256_and_si256(bits, hi2));
    };
    for (int m = 0; m < 4; ++m) {
      const __m256i qh = plane(K::q6_qh(q, m)), l0 = plane(K::q6_ql(q, 0, m)), l1 = plane(K::q6_ql(q, 1, m));
      u[m] = sel(l0, _mm256_slli_epi16(qh, 4));
      u[4 + m] = sel(l1, _mm256_slli_epi16(qh, 2));
      u[8 + m] = sel(_mm256_srli_epi16(l0, 4), qh);
      u[12 + m] = sel(_mm256_srli_epi16(l1, 4), _mm256_srli_epi16(qh, 2));
    }
  }
}

// Slice k of group q (kplanes_unpack's u[k]) alone: the one-token GEMV unpacks each slice where
// it meets the activations, keeping no 16-slice array (kplanes_unpack's u spills: AVX2 has 16 ymm
// registers), and reads a plane again from L1 for each of its slices.
template <BlockType WT>
inline __m256i kplanes_slice(const uint8_t* c, int h, int q, int k) {
  using K = KPlanesKind<WT>;
  const uint8_t* pl = c + K::kPlanes + 32 * h;
  auto plane = [&](int p) { return _mm256_loadu_si256((const __m256i*)(pl + 64 * p)); };
  const __m256i lo = _mm256_set1_epi8(0x0F);
  if constexpr (K::kQ4) {
    const int j = k % 8, r = k / 8;  // slice j of the low (r = 0) or high nibbles
    const __m256i p = plane(K::kQsPlane + 8 * q + j);
    __m256i u = _mm256_and_si256(r ? _mm256_srli_epi16(p, 4) : p, lo);
    if constexpr (K::kFifth) {
      // Q5_K's qh plane through a pointer the compiler cannot see through: otherwise it keeps
      // the group's 8 qh planes in registers for its 16 slices and spills the sums instead
      // (docs/KERNELS.md).
      const uint8_t* ph = pl;
      __asm__("" : "+r"(ph));
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(ph + 64 * (3 + j)));
      u = _mm256_or_si256(u, _mm256_and_si256(kplanes_bit4(qh, 2 * q + r), _mm256_set1_epi8(16)));
    }
    return u;
  } else {
    const int m = k % 4, t = k / 4;  // slice m of quarter t
    const __m256i qh = plane(K::q6_qh(q, m)), l = plane(K::q6_ql(q, t % 2, m));
    const __m256i nib = t < 2 ? l : _mm256_srli_epi16(l, 4);
    const __m256i bits = t == 0 ? _mm256_slli_epi16(qh, 4) : t == 1 ? _mm256_slli_epi16(qh, 2) : t == 2 ? qh : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(_mm256_and_si256(nib, lo), _mm256_and_si256(bits, _mm256_set1_epi8(0x30)));
  }
}

// Sub-block s's scale of rows 8h .. 8h+7 (int32 lanes).
template <BlockType WT>
inline __m256i kplanes_scale(const uint8_t* c, int h, int s) {
  using K = KPlanesKind<WT>;
  const uint8_t* pl = c + K::kPlanes + 32 * h;
  if constexpr (K::kQ4) {
    const __m256i A = _mm256_loadu_si256((const __m256i*)pl);
    if (s < 4) return _mm256_and_si256(_mm256_srli_epi32(A, 8 * s), _mm256_set1_epi32(63));
    const int k = 8 * (s - 4);
    const __m256i C = _mm256_loadu_si256((const __m256i*)(pl + 128));
    return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(C, k), _mm256_set1_epi32(15)),
                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(A, k + 6), _mm256_set1_epi32(3)), 4));
  } else {
    const __m256i P = _mm256_loadu_si256((const __m256i*)(pl + 64 * K::q6_scales(s)));
    return _mm256_srai_epi32(_mm256_slli_epi32(P, 24 - 8 * (s % 4)), 24);
  }
}

// Q4_K's (and Q5_K's) mins of rows 8h .. 8h+7 as pairs of int16, for kplanes_mins: lane i of
// m[0] holds row i's mins 0 and 2 (low and high half), m[1] mins 1 and 3, m[2] 4 and 6, m[3] 5
// and 7. Scale plane 1 (B) holds mins 0..3 in bits 0..5 of its bytes 0..3 and the top two bits
// of mins 4..7 in their bits 6..7, plane 2 (C) the low four bits of mins 4..7 in the high
// nibbles (docs/FORMAT.md 5.1): a byte pair's fields are picked at once, one and per pair
// (Q6_K: no mins, left unset).
template <BlockType WT>
inline void kplanes_min_pairs(const uint8_t* c, int h, __m256i (&m)[4]) {
  using K = KPlanesKind<WT>;
  if constexpr (K::kQ4) {
    const uint8_t* pl = c + K::kPlanes + 32 * h;
    const __m256i B = _mm256_loadu_si256((const __m256i*)(pl + 64)), C = _mm256_loadu_si256((const __m256i*)(pl + 128));
    const __m256i six = _mm256_set1_epi32(0x003F003F), four = _mm256_set1_epi32(0x000F000F),
                  top = _mm256_set1_epi32(0x00300030);
    m[0] = _mm256_and_si256(B, six);
    m[1] = _mm256_and_si256(_mm256_srli_epi32(B, 8), six);
    m[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(C, 4), four), _mm256_and_si256(_mm256_srli_epi32(B, 2), top));
    m[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(C, 12), four), _mm256_and_si256(_mm256_srli_epi32(B, 10), top));
  }
}

// M = sum over the sub-blocks j of min_j times the sum of a's sub-block j (at most 32 * 127: an
// int16), for one activation level: madds of kplanes_min_pairs against the sums in the same
// pairs, the same integers as a multiply per sub-block (Q6_K: zero).
template <BlockType WT>
inline __m256i kplanes_mins(const __m256i (&m)[4], const block_q8_K& a) {
  using K = KPlanesKind<WT>;
  if constexpr (!K::kQ4) {
    return _mm256_setzero_si256();
  } else {
    auto sums = [&](int j, int k) {
      return _mm256_set1_epi32((int)((uint32_t)(uint16_t)K::asum(a, j) | (uint32_t)K::asum(a, k) << 16));
    };
    const __m256i lo = _mm256_add_epi32(_mm256_madd_epi16(m[0], sums(0, 2)), _mm256_madd_epi16(m[1], sums(1, 3)));
    const __m256i hi = _mm256_add_epi32(_mm256_madd_epi16(m[2], sums(4, 6)), _mm256_madd_epi16(m[3], sums(5, 7)));
    return _mm256_add_epi32(lo, hi);
  }
}

// Rows 8h .. 8h+7: acc + d (d_a I + d_a2 I2) - dmin (d_a M + d_a2 M2) (TWO), or
// acc + (d d_a) I - (dmin d_a) M: the float operations of the 512-bit kplanes_finish.
template <BlockType WT, bool TWO>
inline __m256 kplanes_finish(const uint8_t* c, int h, __m256i I, __m256i M, __m256i I2, __m256i M2,
                             const block_q8_K& a, const block_q8_K* a2, __m256 acc) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(c + 16 * h))), da = _mm256_set1_ps(a.d);
  auto level2 = [&](__m256i S, __m256i S2) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(S2), _mm256_set1_ps(a2->d), _mm256_mul_ps(_mm256_cvtepi32_ps(S), da));
  };
  if (TWO) acc = _mm256_fmadd_ps(d, level2(I, I2), acc);
  else acc = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(I), acc);
  if constexpr (KPlanesKind<WT>::kQ4) {
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(c + 32 + 16 * h)));
    if (TWO) acc = _mm256_fnmadd_ps(dmin, level2(M, M2), acc);
    else acc = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(M), acc);
  }
  return acc;
}
