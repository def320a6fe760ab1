// The small fp32 ops of a transformer step the engine calls: RMSNorm, softmax, the gated
// activations and the inner loops of its attention. Formulas: docs/KERNELS.md, section "Ops".
//
// Every op has a scalar reference (namespace cflow::ref, always compiled; the tests compare the
// SIMD paths against it) and SIMD versions for AVX2+FMA and AVX-512. The plain functions in
// namespace cflow dispatch once, at first use, to ops_table(best_isa()) (CFLOW_ISA caps it).
//
// Conventions: row-major arrays, shapes in comments; sizes are ints; outputs may alias inputs
// where a comment says "in place" or "y may be x". None of these functions allocates or throws;
// argument checks belong to the callers (the bindings check everything).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cflow/cpu.h"

namespace cflow {

// Attention's keys and values are prefetched this many rows ahead: the SIMD dot and mix loops
// prefetch from there as they go, and the engine prefetches a span's first rows before them. A
// (sequence, layer, head)'s rows are a stream of a few KB, too short for the hardware prefetchers
// to ramp up, and the caches of a step of 8 long sequences do not hold them (docs/KERNELS.md, "Ops").
constexpr int kAttnPrefetchRows = 16;

// A q8_0 block of the KV cache, as llama.cpp's block_q8_0: an IEEE half scale, then 32 int8.
constexpr int kQ8Block = 34;
// y (n / 32 blocks; n a multiple of 32) = x quantized per 32 values as llama.cpp quantizes its
// q8_0 KV cache: d = max |x| / 127 (stored as a half), q = x * (1 / d) rounded half away from
// zero, as its roundf. One scalar implementation for every ISA, so that a cache means the same
// numbers on every path. A block holding a value that is not finite gets a NaN scale, which
// attention carries to the logits.
void to_q8_0(const float* x, uint8_t* y, int n);

struct OpsTable {
  Isa isa;
  // x, y: (rows, n); w: (n). y = x / sqrt(mean(x^2) + eps) * (w_offset + w). y may be x.
  // QK-norm is the same call with rows = n_head, n = head_dim.
  void (*rmsnorm)(float* y, const float* x, const float* w, int rows, int n, float eps, float w_offset);
  // x: (rows, n), in place, per row.
  void (*softmax)(float* x, int rows, int n);
  // h, g, u: (n). swiglu: h = silu(g) * u, silu(x) = x * sigmoid(x); geglu: h = gelu_tanh(g) * u,
  // gelu_tanh(x) = 0.5 x (1 + tanh(c (x + 0.044715 x^3))), c = sqrt(2/pi). h may be g or u.
  void (*swiglu)(float* h, const float* g, const float* u, int n);
  void (*geglu)(float* h, const float* g, const float* u, int n);
  // Attention inner loops. dot_rows: out (n,) = K (n rows, stride ldk) @ q (hd,).
  // mix_rows: out (hd,) += p (n,) @ V (n rows, stride ldv).
  void (*dot_rows)(const float* q, const float* K, size_t ldk, int n, int hd, float* out);
  void (*mix_rows)(const float* p, const float* V, size_t ldv, int n, int hd, float* out);
  // The same for nq queries that share K (V): the query heads of one KV head. Query m is
  // q + m * ldq (its probabilities p + m * ldp), its outputs out + m * ldo. Each query's results
  // are bit for bit dot_rows' (mix_rows') of it alone; the SIMD versions load each key (value)
  // chunk once for up to 4 queries (AVX2: 2) instead of once per query.
  void (*dot_rows_n)(const float* q, size_t ldq, int nq, const float* K, size_t ldk, int n, int hd, float* out,
                     size_t ldo);
  void (*mix_rows_n)(const float* p, size_t ldp, int nq, const float* V, size_t ldv, int n, int hd, float* out,
                     size_t ldo);
  // The same over a cache of IEEE halves (uint16_t bits; the KV cache of the fast paths): each
  // key (value) widened to float as it loads, which is exact, so the results are bit for bit
  // dot_rows_n's (mix_rows_n's) over the widened rows.
  void (*dot_rows_n_h)(const float* q, size_t ldq, int nq, const uint16_t* K, size_t ldk, int n, int hd, float* out,
                       size_t ldo);
  void (*mix_rows_n_h)(const float* p, size_t ldp, int nq, const uint16_t* V, size_t ldv, int n, int hd, float* out,
                       size_t ldo);
  // y (n halves) = x (n floats), rounded to nearest even (as F16C's vcvtps2ph).
  void (*to_half)(const float* x, uint16_t* y, int n);
  // y (rows, hd) floats = x: rows of hd / 32 q8_0 blocks (kQ8Block bytes each: an IEEE half scale
  // d, then 32 int8 q), y = d * q. Exact (an int8 times a half fits a float's 24 bits), so every
  // ISA gives the same floats, and attention over a q8_0 cache is attention over them.
  void (*from_q8)(const uint8_t* x, int rows, int hd, float* y);
  // x (n >= 1), in place: x[i] = exp(x[i] - max(x)); *mx = max(x), returns the sum of the new x
  // (an unnormalised softmax: attention over one span of keys, merged with the others later).
  float (*exp_max)(float* x, int n, float* mx);
  // The sampler's top-k (top_k_ids below). block_maxima: the maxima of x's n / run runs of
  // `run` values (its first n / run * run), into out; false where any of its n values is not
  // finite. at_least: the indices i < n with x[i] >= bound, ascending, into ids (room for n);
  // returns how many.
  bool (*block_maxima)(const float* x, int n, int run, float* out);
  int (*at_least)(const float* x, int n, float bound, int32_t* ids);
};

// The table of one ISA; `isa` must be supported by this CPU (isa_supported).
const OpsTable& ops_table(Isa isa);
// The table of best_isa(), chosen at the first call.
const OpsTable& ops();

// Scalar reference implementations (the Scalar table points at these).
namespace ref {
void rmsnorm(float* y, const float* x, const float* w, int rows, int n, float eps, float w_offset);
void softmax(float* x, int rows, int n);
void swiglu(float* h, const float* g, const float* u, int n);
void geglu(float* h, const float* g, const float* u, int n);
void dot_rows(const float* q, const float* K, size_t ldk, int n, int hd, float* out);
void mix_rows(const float* p, const float* V, size_t ldv, int n, int hd, float* out);
void dot_rows_n(const float* q, size_t ldq, int nq, const float* K, size_t ldk, int n, int hd, float* out, size_t ldo);
void mix_rows_n(const float* p, size_t ldp, int nq, const float* V, size_t ldv, int n, int hd, float* out, size_t ldo);
void dot_rows_n_h(const float* q, size_t ldq, int nq, const uint16_t* K, size_t ldk, int n, int hd, float* out,
                  size_t ldo);
void mix_rows_n_h(const float* p, size_t ldp, int nq, const uint16_t* V, size_t ldv, int n, int hd, float* out,
                  size_t ldo);
void to_half(const float* x, uint16_t* y, int n);
void from_q8(const uint8_t* x, int rows, int hd, float* y);
float exp_max(float* x, int n, float* mx);
bool block_maxima(const float* x, int n, int run, float* out);
int at_least(const float* x, int n, float bound, int32_t* ids);
}  // namespace ref

// The indices of the k largest of x (n values, 0 < k <= n) and of every value equal to the k-th
// largest, ascending, into ids; false where x holds a value that is not finite (the caller's
// slower path handles those). x is cut into R >= k runs (of 256 values where n >= 256 k): the k
// runs with the largest maxima each hold a value at least the k-th largest maximum, so the k
// largest of x are among the values that reach it: one pass for the maxima, a selection among
// R, one comparison over x, then a selection among those few. (With exactly k runs the bound
// was their smallest maximum, which a run of unlikely tokens keeps low: on Qwen2.5's 151936
// logits a median of 4899 values reached it, against 67 with runs of 256.)
bool top_k_ids(const OpsTable& t, const float* x, int n, int k, std::vector<int32_t>& ids);

// One draw of cflow.sampling's sampler with top-k on (0 < k < n): softmax(x / temperature) over
// top_k_ids, then top_p (1: off) and min_p (0: off) among them, in float64 as the numpy path
// computes them, and the token whose cumulative probability first exceeds u (in [0, 1)). -1
// where x holds a value that is not finite.
int sample_top_k(const OpsTable& t, const float* x, int n, int k, double temperature, double top_p, double min_p,
                 double u);

// A repetition penalty on the tokens of `history` (len ids, each < n, in any order, repeated or
// not): their values divided by `penalty` where positive, multiplied where not, in float64,
// clipped to +-DBL_MAX / 4 (cflow.sampling.apply_repetition_penalty). penalised_top_k: the k
// largest of the penalised x and every value equal to the k-th, ascending, with their float64
// values; false where x holds a value that is not finite, or where k plus the history's h
// distinct tokens reach n (the caller then penalises the whole vocabulary). Only the h tokens
// move, so the answer lies among the history and the k largest of the other tokens (with ties):
// found as the k + h largest of x for a short history, else as the k largest of a copy of x
// with the history's values lowered; and a history token whose penalised value falls under the
// k-th largest of those others is out. No penalised copy of the vocabulary is made.
bool penalised_top_k(const OpsTable& t, const float* x, int n, int k, const int32_t* history, int len, double penalty,
                     std::vector<int32_t>& ids, std::vector<double>& vals);
// The same for any moves: the k largest of x with the h distinct tokens `moved` at `values`
// instead (penalised_top_k is this with the history's penalised values; the frequency and
// presence penalties move the answer's tokens, cflow.sampling), false likewise.
bool moved_top_k(const OpsTable& t, const float* x, int n, int k, const int32_t* moved, const double* values, int h,
                 std::vector<int32_t>& ids, std::vector<double>& vals);
// sample_top_k's draw over moved_top_k; temperature 0: the largest value (k = 1), the first of
// ties. -1 where moved_top_k is false.
int sample_top_k_moved(const OpsTable& t, const float* x, int n, int k, const int32_t* moved, const double* values,
                       int h, double temperature, double top_p, double min_p, double u);
// sample_top_k's draw over penalised_top_k; temperature 0: the largest penalised value (k = 1),
// the first of ties. -1 where penalised_top_k is false.
int sample_top_k_penalised(const OpsTable& t, const float* x, int n, int k, const int32_t* history, int len,
                           double penalty, double temperature, double top_p, double min_p, double u);

// ---- dispatched entry points (what the engine calls) ---------------------------------------

inline void rmsnorm(float* y, const float* x, const float* w, int rows, int n, float eps, float w_offset) {
  ops().rmsnorm(y, x, w, rows, n, eps, w_offset);
}
inline void softmax(float* x, int rows, int n) { ops().softmax(x, rows, n); }
inline void swiglu(float* h, const float* g, const float* u, int n) { ops().swiglu(h, g, u, n); }
inline void geglu(float* h, const float* g, const float* u, int n) { ops().geglu(h, g, u, n); }
inline void dot_rows(const float* q, const float* K, size_t ldk, int n, int hd, float* out) {
  ops().dot_rows(q, K, ldk, n, hd, out);
}
inline void mix_rows(const float* p, const float* V, size_t ldv, int n, int hd, float* out) {
  ops().mix_rows(p, V, ldv, n, hd, out);
}
inline void dot_rows_n(const float* q, size_t ldq, int nq, const float* K, size_t ldk, int n, int hd, float* out,
                       size_t ldo) {
  ops().dot_rows_n(q, ldq, nq, K, ldk, n, hd, out, ldo);
}
inline void mix_rows_n(const float* p, size_t ldp, int nq, const float* V, size_t ldv, int n, int hd, float* out,
                       size_t ldo) {
  ops().mix_rows_n(p, ldp, nq, V, ldv, n, hd, out, ldo);
}
inline void dot_rows_n_h(const float* q, size_t ldq, int nq, const uint16_t* K, size_t ldk, int n, int hd, float* out,
                         size_t ldo) {
  ops().dot_rows_n_h(q, ldq, nq, K, ldk, n, hd, out, ldo);
}
inline void mix_rows_n_h(const float* p, size_t ldp, int nq, const uint16_t* V, size_t ldv, int n, int hd, float* out,
                         size_t ldo) {
  ops().mix_rows_n_h(p, ldp, nq, V, ldv, n, hd, out, ldo);
}
inline void to_half(const float* x, uint16_t* y, int n) { ops().to_half(x, y, n); }
inline float exp_max(float* x, int n, float* mx) { return ops().exp_max(x, n, mx); }
inline void from_q8(const uint8_t* x, int rows, int hd, float* y) { ops().from_q8(x, rows, hd, y); }

}  // namespace cflow
