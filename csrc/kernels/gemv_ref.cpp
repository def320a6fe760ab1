// The block codecs of the block-type table (blocktypes.h) and the scalar kernel table: the
// reference GEMVs (the parity definition of every kernel, and the fallback path) and GEMMs.
// fp32-activation kernels dequantize each block as GGML does and accumulate w*x in float;
// int8-activation kernels take integer dot products per (sub-)block and scale them, as GGML's
// vec_dot_*_q8_* do.
#include <cmath>

#include "cflow/gemm.h"
#include "cflow/kernels.h"
#include "cflow/planes.h"
#include "isa_kernels.h"
#include "tile_walk.h"

namespace cflow {
namespace ref {

// ---- the block codecs of the table (blocktypes.h) ----

namespace {
inline int q5_0_value(const block_q5_0* b, int j) {  // 0..31, j in 0..31
  uint32_t qh;
  std::memcpy(&qh, b->qh, 4);
  const int lo = j < 16 ? (b->qs[j] & 0xF) : (b->qs[j - 16] >> 4);
  return lo | (int)(((qh >> j) & 1) << 4);
}

// Q5_1: the same fifth bit above the same nibbles.
inline int q5_1_value(const block_q5_1* b, int j) {  // 0..31, j in 0..31
  uint32_t qh;
  std::memcpy(&qh, b->qh, 4);
  const int lo = j < 16 ? (b->qs[j] & 0xF) : (b->qs[j - 16] >> 4);
  return lo | (int)(((qh >> j) & 1) << 4);
}

// Q4_K: q[j] (0..15) and the sub-block index of weight j (0..255).
inline int q4_k_value(const block_q4_K* b, int j) {
  const int chunk = j / 64, l = j % 64;
  const uint8_t byte = b->qs[chunk * 32 + (l % 32)];
  return l < 32 ? (byte & 0xF) : (byte >> 4);
}

// Q5_K: q[j] (0..31) of weight j (0..255): Q4_K's nibble, and bit j / 32 of qh[j % 32] as bit 4.
inline int q5_k_value(const block_q5_K* b, int j) {
  const int chunk = j / 64, l = j % 64;
  const uint8_t byte = b->qs[chunk * 32 + (l % 32)];
  const int lo = l < 32 ? (byte & 0xF) : (byte >> 4);
  return lo | (((b->qh[l % 32] >> (j / 32)) & 1) << 4);
}

// Q6_K: q[j] - 32 (-32..31) of weight j (0..255); its scale is scales[j / 16].
inline int q6_k_value(const block_q6_K* b, int j) {
  const int half = j / 128, l = j % 128, quarter = l / 32, i = l % 32;
  const uint8_t* ql = b->ql + half * 64;
  const uint8_t* qh = b->qh + half * 32;
  const int lo = quarter & 1 ? (quarter & 2 ? ql[i + 32] >> 4 : ql[i + 32] & 0xF)
                             : (quarter & 2 ? ql[i] >> 4 : ql[i] & 0xF);
  const int hi = (qh[i] >> (2 * quarter)) & 3;
  return (lo | (hi << 4)) - 32;
}

// TQ2_0's code (0..3; 3 only in a file no quantizer wrote: weight 2d, as GGML decodes it) and
// TQ1_0's (0..2) of weight j (0..255); the weight is d * (code - 1).
inline int tq2_0_code(const block_tq2_0* b, int j) { return (b->qs[32 * (j / 128) + j % 32] >> (2 * (j % 128 / 32))) & 3; }
inline int tq1_0_code(const block_tq1_0* b, int j) {
  static constexpr uint8_t pow3[5] = {1, 3, 9, 27, 81};
  uint8_t byte;
  int n;
  if (j < 160) byte = b->qs[j % 32], n = j / 32;
  else if (j < 240) byte = b->qs[32 + (j - 160) % 16], n = (j - 160) / 16;
  else byte = b->qh[(j - 240) % 4], n = (j - 240) / 4;
  const uint8_t q = (uint8_t)(byte * pow3[n]);  // code n moved to the top trit, mod 256
  return ((uint16_t)q * 3) >> 8;
}

}  // namespace

void deq_f32(const uint8_t* p, float* out) { std::memcpy(out, p, 4); }
void deq_f16(const uint8_t* p, float* out) {
  fp16_t h;
  std::memcpy(&h, p, 2);
  out[0] = fp16_to_f32(h);
}
void deq_bf16(const uint8_t* p, float* out) {
  bf16_t h;
  std::memcpy(&h, p, 2);
  out[0] = bf16_to_f32(h);
}

void deq_q4_0(const uint8_t* p, float* out) {
  const block_q4_0* b = (const block_q4_0*)p;
  const float d = fp16_to_f32(b->d);
  for (int j = 0; j < 16; ++j) {
    out[j] = d * (float)((b->qs[j] & 0xF) - 8);
    out[j + 16] = d * (float)((b->qs[j] >> 4) - 8);
  }
}

void deq_q4_1(const uint8_t* p, float* out) {
  const block_q4_1* b = (const block_q4_1*)p;
  const float d = fp16_to_f32(b->d), m = fp16_to_f32(b->m);
  for (int j = 0; j < 16; ++j) {
    out[j] = d * (float)(b->qs[j] & 0xF) + m;
    out[j + 16] = d * (float)(b->qs[j] >> 4) + m;
  }
}

void deq_q5_0(const uint8_t* p, float* out) {
  const block_q5_0* b = (const block_q5_0*)p;
  const float d = fp16_to_f32(b->d);
  for (int j = 0; j < 32; ++j) out[j] = d * (float)(q5_0_value(b, j) - 16);
}

void deq_q5_1(const uint8_t* p, float* out) {
  const block_q5_1* b = (const block_q5_1*)p;
  const float d = fp16_to_f32(b->d), m = fp16_to_f32(b->m);
  for (int j = 0; j < 32; ++j) out[j] = d * (float)q5_1_value(b, j) + m;
}

void deq_q8_0(const uint8_t* p, float* out) {
  const block_q8_0* b = (const block_q8_0*)p;
  const float d = fp16_to_f32(b->d);
  for (int j = 0; j < 32; ++j) out[j] = d * (float)b->qs[j];
}

void deq_q4_k(const uint8_t* p, float* out) {
  const block_q4_K* b = (const block_q4_K*)p;
  const float d = fp16_to_f32(b->d), dmin = fp16_to_f32(b->dmin);
  for (int s = 0; s < 8; ++s) {
    uint8_t sc, m;
    get_scale_min_k4(s, b->scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    for (int l = 0; l < 32; ++l) out[s * 32 + l] = d1 * (float)q4_k_value(b, s * 32 + l) - m1;
  }
}

void deq_q5_k(const uint8_t* p, float* out) {
  const block_q5_K* b = (const block_q5_K*)p;
  const float d = fp16_to_f32(b->d), dmin = fp16_to_f32(b->dmin);
  for (int s = 0; s < 8; ++s) {
    uint8_t sc, m;
    get_scale_min_k4(s, b->scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    for (int l = 0; l < 32; ++l) out[s * 32 + l] = d1 * (float)q5_k_value(b, s * 32 + l) - m1;
  }
}

void deq_q6_k(const uint8_t* p, float* out) {
  const block_q6_K* b = (const block_q6_K*)p;
  const float d = fp16_to_f32(b->d);
  for (int j = 0; j < 256; ++j) out[j] = d * (float)b->scales[j / 16] * (float)q6_k_value(b, j);
}

void deq_tq1_0(const uint8_t* p, float* out) {
  const block_tq1_0* b = (const block_tq1_0*)p;
  const float d = fp16_to_f32(b->d);
  for (int j = 0; j < 256; ++j) out[j] = d * (float)(tq1_0_code(b, j) - 1);
}

void deq_tq2_0(const uint8_t* p, float* out) {
  const block_tq2_0* b = (const block_tq2_0*)p;
  const float d = fp16_to_f32(b->d);
  for (int j = 0; j < 256; ++j) out[j] = d * (float)(tq2_0_code(b, j) - 1);
}

// Dot of one weight block with the matching activation block, as float: integer products per
// (sub-)block, scaled, as GGML's vec_dot_*_q8_* form them.
float dot_q4_0(const uint8_t* p, const void* av) {
  const block_q8a& a = *(const block_q8a*)av;
  const block_q4_0* b = (const block_q4_0*)p;
  int s = 0;
  for (int j = 0; j < 16; ++j)
    s += ((b->qs[j] & 0xF) - 8) * a.qs[j] + ((b->qs[j] >> 4) - 8) * a.qs[j + 16];
  return fp16_to_f32(b->d) * a.d * (float)s;
}

float dot_q4_1(const uint8_t* p, const void* av) {
  const block_q8a& a = *(const block_q8a*)av;
  const block_q4_1* b = (const block_q4_1*)p;
  int s = 0;
  for (int j = 0; j < 16; ++j) s += (b->qs[j] & 0xF) * a.qs[j] + (b->qs[j] >> 4) * a.qs[j + 16];
  return fp16_to_f32(b->d) * a.d * (float)s + fp16_to_f32(b->m) * a.s;
}

float dot_q5_0(const uint8_t* p, const void* av) {
  const block_q8a& a = *(const block_q8a*)av;
  const block_q5_0* b = (const block_q5_0*)p;
  int s = 0;
  for (int j = 0; j < 32; ++j) s += (q5_0_value(b, j) - 16) * a.qs[j];
  return fp16_to_f32(b->d) * a.d * (float)s;
}

float dot_q5_1(const uint8_t* p, const void* av) {
  const block_q8a& a = *(const block_q8a*)av;
  const block_q5_1* b = (const block_q5_1*)p;
  int s = 0;
  for (int j = 0; j < 32; ++j) s += q5_1_value(b, j) * a.qs[j];
  return fp16_to_f32(b->d) * a.d * (float)s + fp16_to_f32(b->m) * a.s;
}

float dot_q8_0(const uint8_t* p, const void* av) {
  const block_q8a& a = *(const block_q8a*)av;
  const block_q8_0* b = (const block_q8_0*)p;
  int s = 0;
  for (int j = 0; j < 32; ++j) s += b->qs[j] * a.qs[j];
  return fp16_to_f32(b->d) * a.d * (float)s;
}

float dot_q4_k(const uint8_t* p, const void* av) {
  const block_q8_K& a = *(const block_q8_K*)av;
  const block_q4_K* b = (const block_q4_K*)p;
  int sum_q = 0, sum_m = 0;
  for (int s = 0; s < 8; ++s) {
    uint8_t sc, m;
    get_scale_min_k4(s, b->scales, &sc, &m);
    int si = 0;
    for (int l = 0; l < 32; ++l) si += q4_k_value(b, s * 32 + l) * a.qs[s * 32 + l];
    sum_q += sc * si;
    sum_m += m * (a.bsums[2 * s] + a.bsums[2 * s + 1]);
  }
  return a.d * (fp16_to_f32(b->d) * (float)sum_q - fp16_to_f32(b->dmin) * (float)sum_m);
}

float dot_q5_k(const uint8_t* p, const void* av) {
  const block_q8_K& a = *(const block_q8_K*)av;
  const block_q5_K* b = (const block_q5_K*)p;
  int sum_q = 0, sum_m = 0;
  for (int s = 0; s < 8; ++s) {
    uint8_t sc, m;
    get_scale_min_k4(s, b->scales, &sc, &m);
    int si = 0;
    for (int l = 0; l < 32; ++l) si += q5_k_value(b, s * 32 + l) * a.qs[s * 32 + l];
    sum_q += sc * si;
    sum_m += m * (a.bsums[2 * s] + a.bsums[2 * s + 1]);
  }
  return a.d * (fp16_to_f32(b->d) * (float)sum_q - fp16_to_f32(b->dmin) * (float)sum_m);
}

float dot_q6_k(const uint8_t* p, const void* av) {
  const block_q8_K& a = *(const block_q8_K*)av;
  const block_q6_K* b = (const block_q6_K*)p;
  int sum = 0;
  for (int c = 0; c < 16; ++c) {
    int si = 0;
    for (int l = 0; l < 16; ++l) si += q6_k_value(b, c * 16 + l) * a.qs[c * 16 + l];
    sum += b->scales[c] * si;
  }
  return a.d * fp16_to_f32(b->d) * (float)sum;
}

float dot_tq1_0(const uint8_t* p, const void* av) {
  const block_q8_K& a = *(const block_q8_K*)av;
  const block_tq1_0* b = (const block_tq1_0*)p;
  int s = 0;
  for (int j = 0; j < 256; ++j) s += (tq1_0_code(b, j) - 1) * a.qs[j];
  return a.d * fp16_to_f32(b->d) * (float)s;
}

float dot_tq2_0(const uint8_t* p, const void* av) {
  const block_q8_K& a = *(const block_q8_K*)av;
  const block_tq2_0* b = (const block_tq2_0*)p;
  int s = 0;
  for (int j = 0; j < 256; ++j) s += (tq2_0_code(b, j) - 1) * a.qs[j];
  return a.d * fp16_to_f32(b->d) * (float)s;
}

void dequantize(BlockType bt, const uint8_t* p, int n_blocks, float* out) {
  const BlockTraits& t = *block_traits(bt);
  for (int i = 0; i < n_blocks; ++i, p += t.bytes, out += t.elems) t.dequantize(p, out);
}

namespace {

// ---- fp32-activation GEMV: dequantize a block (the table's codec), dot with x ----
template <BlockType BT>
void gemv_deq(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  constexpr BlockTraits T = kBlockTypes[block_index(BT)];
  const float* x = (const float*)xv;
  walk_tiles(y, w, L, row_begin, row_end, [&](const uint8_t* grp, int r, int gg, int cb0, int nb) {
    float wf[T.elems];
    for (int i = 0; i < gg; ++i) {
      float acc = 0.0f;
      for (int b = 0; b < nb; ++b) {
        T.dequantize(grp + ((size_t)b * gg + i) * T.bytes, wf);
        const float* xb = x + (size_t)(cb0 + b) * T.elems;
        float s = 0.0f;
        for (int j = 0; j < T.elems; ++j) s += wf[j] * xb[j];
        acc += s;
      }
      y[r + i] += acc;
    }
  });
}

// ---- int8-activation GEMV: the table's int8 dot per block ----
template <BlockType BT>
void gemv_int(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  constexpr BlockTraits T = kBlockTypes[block_index(BT)];
  constexpr size_t abytes = T.act == ActBlock::Q8K ? sizeof(block_q8_K) : sizeof(block_q8a);
  const uint8_t* xa = (const uint8_t*)xv;
  walk_tiles(y, w, L, row_begin, row_end, [&](const uint8_t* grp, int r, int gg, int cb0, int nb) {
    for (int i = 0; i < gg; ++i) {
      float acc = 0.0f;
      for (int b = 0; b < nb; ++b) acc += T.dot(grp + ((size_t)b * gg + i) * T.bytes, xa + (cb0 + b) * abytes);
      y[r + i] += acc;
    }
  });
}

template <BlockType BT>
void set_ref(KernelTable& t) {
  set_gemv_f32<gemv_deq<BT>>(t, BT);
  if constexpr (act_block(BT) != ActBlock::None) {
    set_gemv_q8<gemv_int<BT>>(t, BT);
    if constexpr (planes_header(BT) != 0) set_gemv_q8<gemv_unpacked<gemv_int<BT>>>(t, BT, Pack::Planes);
  }
  if constexpr (kBlockTypes[block_index(BT)].gemm_int8) {
    t.gemm_q8[block_index(BT)][(int)Pack::Blocks] = ref::gemm_q8;
    if constexpr (planes_header(BT) != 0) t.gemm_q8[block_index(BT)][(int)Pack::Planes] = ref::gemm_q8;
  }
}

void fill_ref(KernelTable& t) {
  set_ref<BlockType::F32>(t);
  set_ref<BlockType::F16>(t);
  set_ref<BlockType::BF16>(t);
  set_ref<BlockType::Q4_0>(t);
  set_ref<BlockType::Q4_1>(t);
  set_ref<BlockType::Q5_0>(t);
  set_ref<BlockType::Q5_1>(t);
  set_ref<BlockType::Q8_0>(t);
  set_ref<BlockType::Q4_K>(t);
  set_ref<BlockType::Q5_K>(t);
  set_ref<BlockType::Q6_K>(t);
  set_ref<BlockType::TQ1_0>(t);
  set_ref<BlockType::TQ2_0>(t);
  t.gemm_f32 = gemm_f32;
  t.quantize_q8a = quantize_q8a;
  t.quantize_q8a_level2 = quantize_q8a_level2;
  t.quantize_q8K = quantize_q8_K;
}

}  // namespace
}  // namespace ref

const KernelTable& kernel_table_scalar() {
  static const KernelTable t = make_table(Isa::Scalar, {ref::fill_ref});
  return t;
}

}  // namespace cflow
