// The native decode engine: a step plan built once in Python, run by one call per forward.
//
// Config, weights and state are kept apart (STYLE.md):
//   ModelDims : the shapes and scalars the ops need (from ModelConfig);
//   Weights   : TensorRefs, byte ranges of one mapped .cflow file (checked against its size);
//   State     : the KV cache of one sequence (several may exist per Engine);
//   Plan      : the op list. Every thread runs every op and takes its share of the work;
//               OP_BARRIER is placed by the plan builder only where data dependence needs one.
// A forward of n tokens (n = 1: decode; n > 1: prefill as a batch) runs the same plan: each
// MATVEC becomes a tile GEMM that reads each weight block once for all n tokens.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cflow/gemm.h"
#include "cflow/kernels.h"  // GemvFn: the decode path

namespace cflow {

struct ModelDims {
  int n_layer = 0, d_model = 0, n_head = 0, n_kv_head = 0, head_dim = 0, vocab = 0, n_ctx = 0;
  float eps = 1e-5f, norm_offset = 0.f, attn_scale = 0.f, embed_scale = 1.f;
  int rope_style = 0;  // 0: neox (rotate halves), 1: interleaved pairs
  int act = 0;         // gated FFN activation: 0 silu, 1 gelu_tanh
};

struct TensorRef {
  int64_t off = 0, nbytes = 0;  // byte range in the mapped file
  TileLayout L;
};

enum OpKind : int32_t {
  OP_BARRIER = 0,   // all threads meet
  OP_EMBED = 1,     // dst (n, d) = W[token] * embed_scale                       (w)
  OP_MATVEC = 2,    // dst[:, aux1 : aux1+R] =|+= W @ norm?(src) (+ bias), softcap f1   (w, bias, norm)
  OP_GLU = 3,       // dst (n, F) = act(gate) * up; W = gate/up interleaved by aux0-row chunks
  OP_ATTN = 4,      // src qkv (n, q+2kv) -> dst (n, q): rope theta f0, window aux0, q/k norms w/bias
  OP_NORM_ADD = 5,  // dst (n, d) += rmsnorm(src) * (offset + W)                 (norm)
  OP_ACT_MUL = 6,   // src (n, 2F) = [gate | up] -> dst (n, F) = act(gate) * up (gate, up stored apart)
};
// F_PRECISE (fast path only): the op's int8 activations are two-level, x ~ d1 q1 + d2 q2 with
// q2 the int8 quantization of the residual x - d1 q1: two integer passes over the weights (the
// second mostly from cache), about 14 bits of activation precision instead of 8.
enum OpFlags : int32_t { F_ACCUM = 1, F_LAST = 2, F_PRECISE = 4 };

// One op; tensor ids index Weights, buffer ids index the plan's scratch buffers (-1: none).
struct Op {
  int32_t kind = 0, w = -1, bias = -1, norm = -1, src = -1, dst = -1, flags = 0, layer = 0, aux0 = 0, aux1 = 0;
  float f0 = 0.f, f1 = 0.f;
};
constexpr int kOpInts = 10, kOpFloats = 2;

struct Plan {
  std::vector<Op> ops;
  std::vector<int> buf_width;  // per-token width of each scratch buffer
  int logits_buf = -1;         // buffer holding the logits after the last op
};

// KV cache of one sequence: per layer K and V, (n_ctx, kv_dim) fp32.
struct State {
  int pos = 0, n_ctx = 0, kv_dim = 0;
  // k[l], v[l]: (n_ctx, kv_dim) each. Left uninitialized: only positions < pos are ever read, and
  // the OS hands out pages on first touch, so a new state costs nothing until it is filled.
  std::vector<std::unique_ptr<float[]>> k, v;
  State(int n_layer, int n_ctx, int kv_dim);
  State(const State&) = delete;
  State& operator=(const State&) = delete;
};

class ThreadPool;

class Engine {
 public:
  // base/size: the mapped file. Throws std::runtime_error naming the problem when a tensor range,
  // shape or op does not check out.
  Engine(const uint8_t* base, size_t size, const ModelDims& dims, std::vector<TensorRef> tensors, Plan plan,
         int threads, bool fast);
  ~Engine();
  // Appends tokens (n >= 1) at st.pos; logits: (vocab,) or (n, vocab) when all_logits.
  void forward(State& st, const int32_t* tokens, int n, bool all_logits, float* logits);
  std::unique_ptr<State> new_state() const;
  const ModelDims& dims() const { return dims_; }
  int threads() const;
  // Per-op wall time totals (CFLOW_PROFILE=1), by op kind: seconds.
  std::vector<double> profile() const { return prof_; }

  struct Scratch;  // per-thread and shared scratch (executor.cpp)

 private:
  void run_ops(int tid);
  void op_embed(const Op& op, int tid);
  void op_matvec(const Op& op, int tid);
  void op_glu(const Op& op, int tid);
  void op_attn(const Op& op, int tid);
  void op_norm_add(const Op& op, int tid);
  void op_act_mul(const Op& op, int tid);
  void act_mul(const float* g, const float* u, float* h, int n) const;
  void validate();
  const float* vec(int tensor) const;  // dequantized 1-D tensor (norms, biases)
  struct Input;
  Input prepare(const float* src, int lds, int n, int cols, int norm, bool q8, bool precise, int tid);
  // One token: the tile GEMV kernel for W (kernels.h) and its activation type, or nullptr when
  // none applies (the GEMM path runs). `xa` receives x prepared for it (thread tid's scratch).
  // precise: also the int8 residual of x into *xa2 (else *xa2 = nullptr).
  GemvFn decode_gemv(const TileLayout& L, const float* x, int tid, const void** xa, bool precise = false,
                     const void** xa2 = nullptr);
  void rmsnorm(const float* x, const float* w, int cols, float* out) const;

  const uint8_t* base_;
  size_t size_;
  ModelDims dims_;
  std::vector<TensorRef> T_;
  Plan plan_;
  bool fast_;
  bool any_precise_ = false;  // some op has F_PRECISE
  Isa isa_;  // kernel ISA, resolved once (CFLOW_ISA caps it)
  std::unique_ptr<ThreadPool> pool_;
  std::vector<std::vector<float>> vecs_;  // per tensor: dequantized when used as norm/bias
  std::vector<std::vector<float>> bufs_;
  std::vector<std::unique_ptr<Scratch>> priv_;  // per thread
  std::unique_ptr<Scratch> shared_;
  std::vector<std::vector<float>> rope_cos_, rope_sin_;  // per distinct theta: (n_ctx, hd/2)
  std::vector<float> rope_theta_;
  std::mutex mu_;  // one forward at a time (the pool and scratch are shared)
  // set per forward
  State* st_ = nullptr;
  const int32_t* tokens_ = nullptr;
  int n_ = 0;
  bool all_logits_ = false;
  bool profile_on_ = false;
  std::vector<double> prof_;
};

}  // namespace cflow
