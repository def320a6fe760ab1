// Small fp32 ops of a transformer step: RMSNorm, RoPE, softmax, activations, top-k, attention,
// vector helpers. Formulas and layouts: docs/KERNELS.md, section "Ops".
//
// Every op has a scalar reference (namespace cflow::ref, always compiled; the tests compare the
// SIMD paths against it) and SIMD versions for AVX2+FMA and AVX-512. The plain functions in
// namespace cflow dispatch once, at first use, to ops_table(best_isa()) (CFLOW_ISA caps it).
//
// Conventions: row-major arrays, shapes in comments; sizes are ints; outputs may alias inputs
// where a comment says "in place" or "y may be x". None of these functions allocates in its hot
// loop or throws; argument checks belong to the callers (the bindings check everything).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cflow/cpu.h"

namespace cflow {

// ---- RoPE tables ---------------------------------------------------------------------------

enum class RopeStyle : int {
  Neox = 0,         // pairs (i, i + rot_dim/2): HF llama / qwen / gemma / mistral
  Interleaved = 1,  // pairs (2i, 2i + 1): GPT-J, original llama / GGUF llama
};

// cos/sin of pos * inv_freq[i] for every position below max_pos, computed once per model so the
// hot path does no trig. The rotation touches the first rot_dim dims of each head
// (rot_dim == head_dim for full rotary; rot_dim even).
struct RopeTable {
  int rot_dim = 0;
  int max_pos = 0;
  std::vector<float> cos, sin;  // (max_pos, rot_dim / 2)
};

// inv_freq[i] = theta^(-2i / rot_dim) rounded to fp32 (as HF keeps it), i < rot_dim / 2;
// angles and cos/sin are computed in double, then rounded.
RopeTable rope_table(int rot_dim, int max_pos, double theta);
// Same with caller-given frequencies (llama3 / linear / yarn scaling is computed by the caller).
RopeTable rope_table_freqs(int rot_dim, int max_pos, const float* inv_freq /* (rot_dim/2) */);

// ---- attention shapes ----------------------------------------------------------------------

// Shape of one layer's attention. The KV cache of a layer is K, V: (n_kv_head, max_ctx, head_dim),
// query head h reads KV head h / (n_head / n_kv_head) (GQA; n_head % n_kv_head == 0).
struct AttnShape {
  int n_head = 0, n_kv_head = 0, head_dim = 0, max_ctx = 0;
  float scale = 0.f;    // logits = scale * q.k, usually 1/sqrt(head_dim)
  int window = 0;       // > 0: a query at position p attends only positions > p - window
  float softcap = 0.f;  // > 0: logits = softcap * tanh(logits / softcap) (gemma 2)
};

// ---- the dispatch table --------------------------------------------------------------------

struct OpsTable {
  Isa isa;
  // x, y: (rows, n); w: (n). y = x / sqrt(mean(x^2) + eps) * (w_offset + w). y may be x.
  // QK-norm is the same call with rows = n_head, n = head_dim.
  void (*rmsnorm)(float* y, const float* x, const float* w, int rows, int n, float eps,
                  float w_offset);
  // x: (T, n_head, head_dim) rotated in place; token t is at position pos[t] < table.max_pos.
  void (*rope)(float* x, int T, int n_head, int head_dim, const int32_t* pos,
               const RopeTable& table, RopeStyle style);
  // x: (rows, n), in place, per row.
  void (*softmax)(float* x, int rows, int n);
  void (*log_softmax)(float* x, int rows, int n);
  // y, x: (n). silu(x) = x * sigmoid(x); gelu_tanh(x) = 0.5 x (1 + tanh(c (x + 0.044715 x^3))),
  // c = sqrt(2/pi). y may be x.
  void (*silu)(float* y, const float* x, int n);
  void (*gelu_tanh)(float* y, const float* x, int n);
  // h, g, u: (n). swiglu: h = silu(g) * u; geglu: h = gelu_tanh(g) * u. h may be g or u.
  void (*swiglu)(float* h, const float* g, const float* u, int n);
  void (*geglu)(float* h, const float* g, const float* u, int n);
  // x: (n); idx, val: (k), 1 <= k <= n. The k largest values, sorted descending, ties broken by
  // the lower index; NaN ranks below every number.
  void (*topk)(int32_t* idx, float* val, const float* x, int n, int k);
  // One new token per sequence (decode). q, out: (n_head, head_dim); k, v: the layer's cache
  // (n_kv_head, max_ctx, head_dim) already holding this token's k, v at position pos. Computes
  // heads [head_begin, head_end) only (the engine splits heads over its threads).
  void (*attn_decode)(float* out, const float* q, const float* k, const float* v, int pos,
                      const AttnShape& s, int head_begin, int head_end);
  // The same with an fp16 (IEEE binary16) cache.
  void (*attn_decode_f16)(float* out, const float* q, const uint16_t* k, const uint16_t* v,
                          int pos, const AttnShape& s, int head_begin, int head_end);
  // Causal prefill of T tokens at positions p0 .. p0+T-1. q, out: (T, n_head, head_dim); the
  // cache already holds k, v of positions 0 .. p0+T-1. Token t attends positions <= p0 + t.
  void (*attn_prefill)(float* out, const float* q, const float* k, const float* v, int p0, int T,
                       const AttnShape& s, int head_begin, int head_end);
  void (*attn_prefill_f16)(float* out, const float* q, const uint16_t* k, const uint16_t* v,
                           int p0, int T, const AttnShape& s, int head_begin, int head_end);
  // y, a, b: (n). add: y = a + b (residual); scale: y = s * x; y may alias an input.
  void (*add)(float* y, const float* a, const float* b, int n);
  void (*scale)(float* y, const float* x, float s, int n);
  // fp32 <-> IEEE fp16, round to nearest even (as numpy astype / F16C); overflow gives inf.
  void (*f32_to_f16)(uint16_t* y, const float* x, int n);
  void (*f16_to_f32)(float* y, const uint16_t* x, int n);
};

// The table of one ISA; `isa` must be supported by this CPU (isa_supported).
const OpsTable& ops_table(Isa isa);
// The table of best_isa(), chosen at the first call.
const OpsTable& ops();

// Scalar reference implementations (the Scalar table points at these).
namespace ref {
void rmsnorm(float* y, const float* x, const float* w, int rows, int n, float eps, float w_offset);
void rope(float* x, int T, int n_head, int head_dim, const int32_t* pos, const RopeTable& table,
          RopeStyle style);
void softmax(float* x, int rows, int n);
void log_softmax(float* x, int rows, int n);
void silu(float* y, const float* x, int n);
void gelu_tanh(float* y, const float* x, int n);
void swiglu(float* h, const float* g, const float* u, int n);
void geglu(float* h, const float* g, const float* u, int n);
void topk(int32_t* idx, float* val, const float* x, int n, int k);
void attn_decode(float* out, const float* q, const float* k, const float* v, int pos,
                 const AttnShape& s, int head_begin, int head_end);
void attn_decode_f16(float* out, const float* q, const uint16_t* k, const uint16_t* v, int pos,
                     const AttnShape& s, int head_begin, int head_end);
void attn_prefill(float* out, const float* q, const float* k, const float* v, int p0, int T,
                  const AttnShape& s, int head_begin, int head_end);
void attn_prefill_f16(float* out, const float* q, const uint16_t* k, const uint16_t* v, int p0,
                      int T, const AttnShape& s, int head_begin, int head_end);
void add(float* y, const float* a, const float* b, int n);
void scale(float* y, const float* x, float s, int n);
void f32_to_f16(uint16_t* y, const float* x, int n);
void f16_to_f32(float* y, const uint16_t* x, int n);
}  // namespace ref

// ---- dispatched entry points (what the engine calls) ---------------------------------------

inline void rmsnorm(float* y, const float* x, const float* w, int rows, int n, float eps,
                    float w_offset) {
  ops().rmsnorm(y, x, w, rows, n, eps, w_offset);
}
inline void rope(float* x, int T, int n_head, int head_dim, const int32_t* pos,
                 const RopeTable& table, RopeStyle style) {
  ops().rope(x, T, n_head, head_dim, pos, table, style);
}
inline void softmax(float* x, int rows, int n) { ops().softmax(x, rows, n); }
inline void log_softmax(float* x, int rows, int n) { ops().log_softmax(x, rows, n); }
inline void silu(float* y, const float* x, int n) { ops().silu(y, x, n); }
inline void gelu_tanh(float* y, const float* x, int n) { ops().gelu_tanh(y, x, n); }
inline void swiglu(float* h, const float* g, const float* u, int n) { ops().swiglu(h, g, u, n); }
inline void geglu(float* h, const float* g, const float* u, int n) { ops().geglu(h, g, u, n); }
inline void topk(int32_t* idx, float* val, const float* x, int n, int k) {
  ops().topk(idx, val, x, n, k);
}
inline void attn_decode(float* out, const float* q, const float* k, const float* v, int pos,
                        const AttnShape& s, int head_begin, int head_end) {
  ops().attn_decode(out, q, k, v, pos, s, head_begin, head_end);
}
inline void attn_decode_f16(float* out, const float* q, const uint16_t* k, const uint16_t* v,
                            int pos, const AttnShape& s, int head_begin, int head_end) {
  ops().attn_decode_f16(out, q, k, v, pos, s, head_begin, head_end);
}
inline void attn_prefill(float* out, const float* q, const float* k, const float* v, int p0,
                         int T, const AttnShape& s, int head_begin, int head_end) {
  ops().attn_prefill(out, q, k, v, p0, T, s, head_begin, head_end);
}
inline void attn_prefill_f16(float* out, const float* q, const uint16_t* k, const uint16_t* v,
                             int p0, int T, const AttnShape& s, int head_begin, int head_end) {
  ops().attn_prefill_f16(out, q, k, v, p0, T, s, head_begin, head_end);
}
inline void add(float* y, const float* a, const float* b, int n) { ops().add(y, a, b, n); }
inline void scale(float* y, const float* x, float s, int n) { ops().scale(y, x, s, n); }
inline void f32_to_f16(uint16_t* y, const float* x, int n) { ops().f32_to_f16(y, x, n); }
inline void f16_to_f32(float* y, const uint16_t* x, int n) { ops().f16_to_f32(y, x, n); }

}  // namespace cflow
