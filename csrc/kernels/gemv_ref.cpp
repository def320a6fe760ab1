// Scalar reference GEMVs (the parity definition of every kernel, and the fallback path).
// fp32-activation kernels dequantize each block as GGML does and accumulate w*x in float;
// int8-activation kernels take integer dot products per (sub-)block and scale them, as GGML's
// vec_dot_*_q8_* do.
#include <cmath>

#include "cflow/kernels.h"
#include "cflow/planes.h"
#include "tile_walk.h"

namespace cflow {
namespace ref {

namespace {

// ---- dequantization of one block into out[block_elems] ----

inline void deq_q4_0(const uint8_t* p, float* out) {
  const block_q4_0* b = (const block_q4_0*)p;
  const float d = fp16_to_f32(b->d);
  for (int j = 0; j < 16; ++j) {
    out[j] = d * (float)((b->qs[j] & 0xF) - 8);
    out[j + 16] = d * (float)((b->qs[j] >> 4) - 8);
  }
}

inline void deq_q4_1(const uint8_t* p, float* out) {
  const block_q4_1* b = (const block_q4_1*)p;
  const float d = fp16_to_f32(b->d), m = fp16_to_f32(b->m);
  for (int j = 0; j < 16; ++j) {
    out[j] = d * (float)(b->qs[j] & 0xF) + m;
    out[j + 16] = d * (float)(b->qs[j] >> 4) + m;
  }
}

inline int q5_0_value(const block_q5_0* b, int j) {  // 0..31, j in 0..31
  uint32_t qh;
  std::memcpy(&qh, b->qh, 4);
  const int lo = j < 16 ? (b->qs[j] & 0xF) : (b->qs[j - 16] >> 4);
  return lo | (int)(((qh >> j) & 1) << 4);
}

inline void deq_q5_0(const uint8_t* p, float* out) {
  const block_q5_0* b = (const block_q5_0*)p;
  const float d = fp16_to_f32(b->d);
  for (int j = 0; j < 32; ++j) out[j] = d * (float)(q5_0_value(b, j) - 16);
}

inline void deq_q8_0(const uint8_t* p, float* out) {
  const block_q8_0* b = (const block_q8_0*)p;
  const float d = fp16_to_f32(b->d);
  for (int j = 0; j < 32; ++j) out[j] = d * (float)b->qs[j];
}

// Q4_K: q[j] (0..15) and the sub-block index of weight j (0..255).
inline int q4_k_value(const block_q4_K* b, int j) {
  const int chunk = j / 64, l = j % 64;
  const uint8_t byte = b->qs[chunk * 32 + (l % 32)];
  return l < 32 ? (byte & 0xF) : (byte >> 4);
}

inline void deq_q4_k(const uint8_t* p, float* out) {
  const block_q4_K* b = (const block_q4_K*)p;
  const float d = fp16_to_f32(b->d), dmin = fp16_to_f32(b->dmin);
  for (int s = 0; s < 8; ++s) {
    uint8_t sc, m;
    get_scale_min_k4(s, b->scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    for (int l = 0; l < 32; ++l) out[s * 32 + l] = d1 * (float)q4_k_value(b, s * 32 + l) - m1;
  }
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

inline void deq_q6_k(const uint8_t* p, float* out) {
  const block_q6_K* b = (const block_q6_K*)p;
  const float d = fp16_to_f32(b->d);
  for (int j = 0; j < 256; ++j) out[j] = d * (float)b->scales[j / 16] * (float)q6_k_value(b, j);
}

// ---- fp32-activation GEMV: dequantize a block, dot with x ----

template <int QKT, int BB, void (*Deq)(const uint8_t*, float*)>
void gemv_deq(float* y, const void* xv, const uint8_t* w, int rows, int cols, const TileShape& ts,
              int row_begin, int row_end) {
  const float* x = (const float*)xv;
  walk_tiles(y, w, rows, cols, ts, QKT, BB, row_begin, row_end,
             [&](const uint8_t* grp, int r, int gg, int cb0, int nb) {
               float wf[QKT];
               for (int i = 0; i < gg; ++i) {
                 float acc = 0.0f;
                 for (int b = 0; b < nb; ++b) {
                   Deq(grp + ((size_t)b * gg + i) * BB, wf);
                   const float* xb = x + (size_t)(cb0 + b) * QKT;
                   float s = 0.0f;
                   for (int j = 0; j < QKT; ++j) s += wf[j] * xb[j];
                   acc += s;
                 }
                 y[r + i] += acc;
               }
             });
}

inline void deq_f32(const uint8_t* p, float* out) { std::memcpy(out, p, 4); }
inline void deq_f16(const uint8_t* p, float* out) {
  fp16_t h;
  std::memcpy(&h, p, 2);
  out[0] = fp16_to_f32(h);
}
inline void deq_bf16(const uint8_t* p, float* out) {
  bf16_t h;
  std::memcpy(&h, p, 2);
  out[0] = bf16_to_f32(h);
}

// F32/F16/BF16: one element per "block"; the dot runs over the tile's columns.
template <int BB, void (*Deq)(const uint8_t*, float*)>
void gemv_elem(float* y, const void* xv, const uint8_t* w, int rows, int cols, const TileShape& ts,
               int row_begin, int row_end) {
  const float* x = (const float*)xv;
  walk_tiles(y, w, rows, cols, ts, 1, BB, row_begin, row_end,
             [&](const uint8_t* grp, int r, int gg, int cb0, int nb) {
               for (int i = 0; i < gg; ++i) {
                 float acc = 0.0f;
                 for (int b = 0; b < nb; ++b) {
                   float v;
                   Deq(grp + ((size_t)b * gg + i) * BB, &v);
                   acc += v * x[cb0 + b];
                 }
                 y[r + i] += acc;
               }
             });
}

// ---- int8-activation GEMV: integer dot per block, scaled ----

// Dot of one weight block with the matching activation block, as float.
inline float dot_q4_0(const uint8_t* p, const block_q8a& a) {
  const block_q4_0* b = (const block_q4_0*)p;
  int s = 0;
  for (int j = 0; j < 16; ++j)
    s += ((b->qs[j] & 0xF) - 8) * a.qs[j] + ((b->qs[j] >> 4) - 8) * a.qs[j + 16];
  return fp16_to_f32(b->d) * a.d * (float)s;
}

inline float dot_q4_1(const uint8_t* p, const block_q8a& a) {
  const block_q4_1* b = (const block_q4_1*)p;
  int s = 0;
  for (int j = 0; j < 16; ++j) s += (b->qs[j] & 0xF) * a.qs[j] + (b->qs[j] >> 4) * a.qs[j + 16];
  return fp16_to_f32(b->d) * a.d * (float)s + fp16_to_f32(b->m) * a.s;
}

inline float dot_q5_0(const uint8_t* p, const block_q8a& a) {
  const block_q5_0* b = (const block_q5_0*)p;
  int s = 0;
  for (int j = 0; j < 32; ++j) s += (q5_0_value(b, j) - 16) * a.qs[j];
  return fp16_to_f32(b->d) * a.d * (float)s;
}

inline float dot_q8_0(const uint8_t* p, const block_q8a& a) {
  const block_q8_0* b = (const block_q8_0*)p;
  int s = 0;
  for (int j = 0; j < 32; ++j) s += b->qs[j] * a.qs[j];
  return fp16_to_f32(b->d) * a.d * (float)s;
}

inline float dot_q4_k(const uint8_t* p, const block_q8_K& a) {
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

inline float dot_q6_k(const uint8_t* p, const block_q8_K& a) {
  const block_q6_K* b = (const block_q6_K*)p;
  int sum = 0;
  for (int c = 0; c < 16; ++c) {
    int si = 0;
    for (int l = 0; l < 16; ++l) si += q6_k_value(b, c * 16 + l) * a.qs[c * 16 + l];
    sum += b->scales[c] * si;
  }
  return a.d * fp16_to_f32(b->d) * (float)sum;
}

template <int QKT, int BB, class A, float (*Dot)(const uint8_t*, const A&)>
void gemv_int(float* y, const void* xv, const uint8_t* w, int rows, int cols, const TileShape& ts,
              int row_begin, int row_end) {
  const A* xa = (const A*)xv;
  walk_tiles(y, w, rows, cols, ts, QKT, BB, row_begin, row_end,
             [&](const uint8_t* grp, int r, int gg, int cb0, int nb) {
               for (int i = 0; i < gg; ++i) {
                 float acc = 0.0f;
                 for (int b = 0; b < nb; ++b) acc += Dot(grp + ((size_t)b * gg + i) * BB, xa[cb0 + b]);
                 y[r + i] += acc;
               }
             });
}

}  // namespace

#define CFLOW_GEMV_DEF(name, ...)                                                                \
  void name(float* y, const void* x, const uint8_t* w, int rows, int cols, const TileShape& ts, \
            int row_begin, int row_end) {                                                       \
    __VA_ARGS__(y, x, w, rows, cols, ts, row_begin, row_end);                                   \
  }

CFLOW_GEMV_DEF(gemv_f32_f32, gemv_elem<4, deq_f32>)
CFLOW_GEMV_DEF(gemv_f16_f32, gemv_elem<2, deq_f16>)
CFLOW_GEMV_DEF(gemv_bf16_f32, gemv_elem<2, deq_bf16>)
CFLOW_GEMV_DEF(gemv_q4_0_f32, gemv_deq<32, 18, deq_q4_0>)
CFLOW_GEMV_DEF(gemv_q4_1_f32, gemv_deq<32, 20, deq_q4_1>)
CFLOW_GEMV_DEF(gemv_q5_0_f32, gemv_deq<32, 22, deq_q5_0>)
CFLOW_GEMV_DEF(gemv_q8_0_f32, gemv_deq<32, 34, deq_q8_0>)
CFLOW_GEMV_DEF(gemv_q4_k_f32, gemv_deq<256, 144, deq_q4_k>)
CFLOW_GEMV_DEF(gemv_q6_k_f32, gemv_deq<256, 210, deq_q6_k>)
CFLOW_GEMV_DEF(gemv_q4_0_q8, gemv_int<32, 18, block_q8a, dot_q4_0>)
CFLOW_GEMV_DEF(gemv_q4_1_q8, gemv_int<32, 20, block_q8a, dot_q4_1>)
CFLOW_GEMV_DEF(gemv_q5_0_q8, gemv_int<32, 22, block_q8a, dot_q5_0>)
CFLOW_GEMV_DEF(gemv_q8_0_q8, gemv_int<32, 34, block_q8a, dot_q8_0>)
CFLOW_GEMV_DEF(gemv_q4_k_q8, gemv_int<256, 144, block_q8_K, dot_q4_k>)
CFLOW_GEMV_DEF(gemv_q6_k_q8, gemv_int<256, 210, block_q8_K, dot_q6_k>)
CFLOW_GEMV_DEF(gemv_q4_0_f32_planes, gemv_unpacked<WType::Q4_0, gemv_q4_0_f32>)
CFLOW_GEMV_DEF(gemv_q4_1_f32_planes, gemv_unpacked<WType::Q4_1, gemv_q4_1_f32>)
CFLOW_GEMV_DEF(gemv_q8_0_f32_planes, gemv_unpacked<WType::Q8_0, gemv_q8_0_f32>)
CFLOW_GEMV_DEF(gemv_q4_0_q8_planes, gemv_unpacked<WType::Q4_0, gemv_q4_0_q8>)
CFLOW_GEMV_DEF(gemv_q4_1_q8_planes, gemv_unpacked<WType::Q4_1, gemv_q4_1_q8>)
CFLOW_GEMV_DEF(gemv_q8_0_q8_planes, gemv_unpacked<WType::Q8_0, gemv_q8_0_q8>)
CFLOW_GEMV_DEF(gemv_q4_0_q8x2_planes, gemv_two_levels<gemv_q4_0_q8_planes>)
CFLOW_GEMV_DEF(gemv_q4_1_q8x2_planes, gemv_two_levels<gemv_q4_1_q8_planes>)
CFLOW_GEMV_DEF(gemv_q8_0_q8x2_planes, gemv_two_levels<gemv_q8_0_q8_planes>)
#undef CFLOW_GEMV_DEF

void dequantize(WType wt, const uint8_t* p, int n_blocks, float* out) {
  const int bb = block_bytes(wt), qk = block_elems(wt);
  for (int i = 0; i < n_blocks; ++i, p += bb, out += qk) {
    switch (wt) {
      case WType::F32: deq_f32(p, out); break;
      case WType::F16: deq_f16(p, out); break;
      case WType::BF16: deq_bf16(p, out); break;
      case WType::Q4_0: deq_q4_0(p, out); break;
      case WType::Q4_1: deq_q4_1(p, out); break;
      case WType::Q5_0: deq_q5_0(p, out); break;
      case WType::Q8_0: deq_q8_0(p, out); break;
      case WType::Q4_K: deq_q4_k(p, out); break;
      case WType::Q6_K: deq_q6_k(p, out); break;
    }
  }
}

}  // namespace ref
}  // namespace cflow
