// Block encodings of weights and activations, bit-identical to GGML's (ggml-common.h), plus
// the int8 activation blocks of cflow's fast paths. Every struct has its size asserted:
// the tiled payload of src/cflow/format/tiles.py is an array of these blocks.
#pragma once
#include <cstdint>
#include <cstring>

namespace cflow {

constexpr int QK = 32;     // weights per block of the 32-block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
constexpr int QK_K = 256;  // weights per super-block of the K-quants (Q4_K, Q5_K, Q6_K)
constexpr int K_SCALE_SIZE = 12;

using fp16_t = uint16_t;  // IEEE half, stored as bits
using bf16_t = uint16_t;  // bfloat16, stored as bits

// ---- weight blocks (GGML) ----

// x[i] = d * (q[i] - 8); q[i] = low nibble of qs[i] (i < 16), high nibble of qs[i-16] (i >= 16).
struct block_q4_0 {
  fp16_t d;
  uint8_t qs[QK / 2];
};
static_assert(sizeof(block_q4_0) == 18, "block_q4_0 must be 18 bytes");

// x[i] = d * q[i] + m; nibble order as block_q4_0.
struct block_q4_1 {
  fp16_t d;
  fp16_t m;
  uint8_t qs[QK / 2];
};
static_assert(sizeof(block_q4_1) == 20, "block_q4_1 must be 20 bytes");

// x[i] = d * (q[i] - 16); q[i] = nibble as Q4_0 | bit i of qh (little-endian uint32) << 4.
struct block_q5_0 {
  fp16_t d;
  uint8_t qh[4];
  uint8_t qs[QK / 2];
};
static_assert(sizeof(block_q5_0) == 22, "block_q5_0 must be 22 bytes");

// x[i] = d * q[i] + m; q[i] as block_q5_0's (0..31): Q5_0 plus a min, as Q4_1 is Q4_0 plus one.
struct block_q5_1 {
  fp16_t d;
  fp16_t m;
  uint8_t qh[4];
  uint8_t qs[QK / 2];
};
static_assert(sizeof(block_q5_1) == 24, "block_q5_1 must be 24 bytes");

// x[i] = d * qs[i].
struct block_q8_0 {
  fp16_t d;
  int8_t qs[QK];
};
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 must be 34 bytes");

// 256 weights in 8 sub-blocks of 32; sub-block j: x = d*sc[j]*q - dmin*m[j], with 6-bit sc, m
// packed in scales (see get_scale_min_k4). qs: 4 chunks of 64 weights, 32 bytes each: low
// nibbles are weights 0..31 of the chunk, high nibbles weights 32..63.
struct block_q4_K {
  fp16_t d;
  fp16_t dmin;
  uint8_t scales[K_SCALE_SIZE];
  uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_q4_K) == 144, "block_q4_K must be 144 bytes");

// Q4_K plus a plane of fifth bits: scales, mins and nibbles as block_q4_K; weight 64i + l
// (sub-block 2i) has bit 2i of qh[l] as its bit 4, weight 64i + 32 + l (sub-block 2i + 1) bit
// 2i + 1 (i < 4, l < 32): x = d*sc[j]*q - dmin*m[j] with q in 0..31.
struct block_q5_K {
  fp16_t d;
  fp16_t dmin;
  uint8_t scales[K_SCALE_SIZE];
  uint8_t qh[QK_K / 8];
  uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_q5_K) == 176, "block_q5_K must be 176 bytes");

// 256 weights, x = d * scales[i/16] * (q - 32) with 6-bit q: low 4 bits in ql, high 2 in qh
// (GGML's order: two halves of 128; see dequant in the reference kernels).
struct block_q6_K {
  uint8_t ql[QK_K / 2];
  uint8_t qh[QK_K / 4];
  int8_t scales[QK_K / 16];
  fp16_t d;
};
static_assert(sizeof(block_q6_K) == 210, "block_q6_K must be 210 bytes");

// Ternary weights in {-1, 0, +1}, 256 per block, x = d * (t - 1) with the code t in {0, 1, 2}.
// TQ2_0: 2 bits per code; weight 128h + 32l + m is bits 2l..2l+1 of qs[32h + m] (h < 2, l < 4,
// m < 32): one 32-byte load holds four runs of 32 consecutive weights, one per bit pair.
struct block_tq2_0 {
  uint8_t qs[QK_K / 4];
  fp16_t d;
};
static_assert(sizeof(block_tq2_0) == 66, "block_tq2_0 must be 66 bytes");

// TQ1_0: 5 codes per byte in base 3 (3^5 = 243 <= 256), stored scaled: byte b holds the codes
// t_0..t_4 as b = ceil(256 * (sum_n t_n 3^(4-n)) / 243), so code n is ((uint8)(b * 3^n) * 3) >> 8.
// Weights 0..159: code n of qs[m] is weight 32n + m (m < 32); 160..239: code n of qs[32 + m] is
// weight 160 + 16n + m (m < 16); 240..255: code n of qh[j] is weight 240 + 4n + j (n, j < 4).
struct block_tq1_0 {
  uint8_t qs[48];
  uint8_t qh[4];
  fp16_t d;
};
static_assert(sizeof(block_tq1_0) == 54, "block_tq1_0 must be 54 bytes");

// ---- int8 activation blocks (the fast path quantizes x once per op) ----

// One block of 32 activations, x[i] ~= d * qs[i], d = max|x| / 127 (float, not fp16, so the
// only activation error is the rounding of x/d); s = d * (sum of the 32 q) folds the weight
// offsets of Q4_0 / Q4_1 / Q5_0 / Q5_1.
struct block_q8a {
  int8_t qs[QK];
  float d;
  float s;  // d * sum(qs)
};
static_assert(sizeof(block_q8a) == 40, "block_q8a must be 40 bytes");

// The lane sums of one block_q8a, which let the GEMV kernels use unsigned x signed dot products
// (vpdpbusd) on offset weights: the sums of the 4-byte lanes as a 256-bit register sees them
// (lsum8[k] = q[4k..4k+3]) and as a 128-bit lo/hi nibble pair sees them (lsum4[k] = lsum8[k] +
// lsum8[k+4]). A row of n activation blocks is the n block_q8a, then their n q8a_sums: the GEMM,
// which reads qs, d and s of many tokens, touches 40 bytes a block.
struct q8a_sums {
  int32_t lsum4[4];
  int32_t lsum8[8];
};
static_assert(sizeof(q8a_sums) == 48, "q8a_sums must be 48 bytes");

// Bytes of one row of cols activations (cols % 32 == 0), and the sums of a row.
constexpr size_t q8a_row_bytes(int cols) { return (size_t)(cols / QK) * (sizeof(block_q8a) + sizeof(q8a_sums)); }
inline q8a_sums* q8a_sums_of(block_q8a* row, int cols) { return (q8a_sums*)(row + cols / QK); }
inline const q8a_sums* q8a_sums_of(const block_q8a* row, int cols) { return (const q8a_sums*)(row + cols / QK); }

// One super-block of 256 activations for the K-quants (GGML's block_q8_K): x ~= d * qs,
// bsums[j] = sum of qs[16j .. 16j+15].
struct block_q8_K {
  float d;
  int8_t qs[QK_K];
  int16_t bsums[QK_K / 16];
};
static_assert(sizeof(block_q8_K) == 292, "block_q8_K must be 292 bytes");

// ---- fp16 / bf16 helpers (portable; SIMD paths use F16C / shifts) ----

inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t bits_from_f32(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// IEEE half -> float, exact for every input (subnormals, inf, nan included).
inline float fp16_to_f32(fp16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (!man) return f32_from_bits(sign);
    const float v = (float)man * (1.0f / 16777216.0f);  // man * 2^-24
    return sign ? -v : v;
  }
  return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

// float -> IEEE half, round to nearest even (as F16C's vcvtps2ph with imm 0).
inline fp16_t f32_to_fp16(float f) {
  const uint32_t x = bits_from_f32(f);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t ax = x & 0x7fffffff;
  if (ax >= 0x7f800000u) return (fp16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
  if (ax >= 0x477ff000u) return (fp16_t)(sign | 0x7c00);  // rounds to inf
  if (ax < 0x38800000u) {                                  // half subnormal or zero
    const float v = f32_from_bits(ax) * 16777216.0f;        // exact scaling by 2^24
    const uint32_t m = (uint32_t)__builtin_nearbyintf(v);   // round-to-nearest-even mode
    return (fp16_t)(sign | m);
  }
  uint32_t r = ax - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfff + ((r >> 13) & 1);   // round to nearest even
  return (fp16_t)(sign | (r >> 13));
}

inline float bf16_to_f32(bf16_t b) { return f32_from_bits((uint32_t)b << 16); }

// float -> bf16, round to nearest even (nan stays nan).
inline bf16_t f32_to_bf16(float f) {
  uint32_t u = bits_from_f32(f);
  if ((u & 0x7fffffff) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return (bf16_t)(u >> 16);
}

// Q4_K's 6-bit scale and min of sub-block j (0..7), as GGML's get_scale_min_k4.
inline void get_scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

}  // namespace cflow
