// The native engine: runs a step plan (cflow/plan.h) over the weights of one mapped file.
//
// Model, weights and sequences are kept apart (docs/ENGINE.md):
//   Plan      : the typed op list, built once per model by its module (src/cflow/models);
//   weights   : byte ranges of one mapped .cflow file, each checked against its size and shape;
//   State     : one sequence: its token history (its length is the position) and its KV cache;
//   Workspace : what one forward call needs (thread pool, activation buffers, scratch). A call
//               takes a free workspace, or makes one, and gives it back: several threads may run
//               forwards on one Engine at once, each with its own states.
// One forward advances one or several states by their new tokens (n_i >= 1 each): the rows of
// all of them go through every op together, so each weight is read once per step for all the
// rows (decode of many sequences, prefill of one, or both); attention reads each row's own
// state. Every thread runs every op and takes its share of the work; threads meet only at the
// plan's Barrier ops.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cflow/gemm.h"
#include "cflow/kernels.h"  // GemvFn: the decode path
#include "cflow/plan.h"

namespace cflow {

// One sequence: its tokens so far and, per KV slot of the plan, its keys and values
// (n_ctx, n_kv_head * head_dim) fp32. The cache rows are left uninitialized: only positions
// below pos() are read, and pages are committed as they fill.
class State {
 public:
  State(int n_ctx, const std::vector<int>& kv_widths);
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  int pos() const { return (int)tokens_.size(); }
  int n_ctx() const { return n_ctx_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  // Keeps the first n tokens (prompt reuse); 0 <= n <= pos().
  void truncate(int n);
  // Becomes the first n tokens of src and their KV cache (a shared prefix, such as a system
  // prompt, taken from another sequence instead of computed again); 0 <= n <= src.pos(), src of
  // the same model, neither in a forward.
  void copy_prefix(const State& src, int n);

 private:
  friend class Engine;
  friend class Claim;
  int n_ctx_;
  std::vector<int> kv_width_;
  std::vector<std::unique_ptr<float[]>> k_, v_;  // per slot
  std::vector<int32_t> tokens_;
  std::atomic<bool> busy_{false};  // in a forward now
};

// A state and the tokens a forward appends to it.
struct Seq {
  State* state = nullptr;
  const int32_t* tokens = nullptr;
  int n = 0;
};

class Engine {
 public:
  // base/size: the mapped file. Throws std::runtime_error naming the problem when a tensor's
  // byte range or shape, or an op's fields, do not check out.
  Engine(const uint8_t* base, size_t size, Plan plan, int n_ctx, int threads, bool fast);
  ~Engine();
  // Appends each seq's tokens to its state. logits: per seq, (vocab,) for its last token, or
  // (n_i, vocab) for every token when all_logits; seqs one after another.
  void forward(const std::vector<Seq>& seqs, bool all_logits, float* logits);
  std::unique_ptr<State> new_state() const;
  int vocab() const { return vocab_; }
  int n_ctx() const { return n_ctx_; }
  int threads() const { return threads_; }
  // Wall time per op kind (the index in Op) summed over forwards, seconds (CFLOW_PROFILE=1).
  std::vector<double> profile() const;

  struct Workspace;  // executor.cpp

 private:
  struct Weight {
    const uint8_t* data;
    TileLayout L;
  };
  void validate();
  void run(Workspace& ws, int tid);
  void run_op(const Embed& op, Workspace& ws, int tid);
  void run_op(const Matmul& op, Workspace& ws, int tid);
  void run_op(const GateUp& op, Workspace& ws, int tid);
  void run_op(const ActMul& op, Workspace& ws, int tid);
  void run_op(const Attention& op, Workspace& ws, int tid);
  void run_op(const NormAdd& op, Workspace& ws, int tid);
  struct Input;
  Input prepare(Workspace& ws, const float* src, int lds, int n, int cols, int norm, bool q8, bool precise, int tid);
  // The decode (one-token) GEMV kernel of W and the activation type it takes; nullptr when none
  // applies.
  GemvFn decode_kernel(const TileLayout& L, bool precise, AType* at) const;
  GemvBatchFn batch_kernel(const TileLayout& L, AType at) const;
  void matmul_gemm(const Matmul& op, Workspace& ws, const float* src, int lds, int n, float* dst, int ldd, int tid);
  void matmul_single(const Matmul& op, Workspace& ws, const float* src, int lds, int m, float* dst, int ldd, int tid);
  void epilogue(const Matmul& op, float* y, int ldy, int m, int r0, int r1, float* dst, int ldd) const;
  void rmsnorm(const float* x, const float* w, int cols, float* out) const;
  const float* vec(int tensor) const { return vecs_[tensor].data(); }  // norms, biases
  struct RopeTable {
    float theta;
    int head_dim;
    std::vector<float> cos, sin;  // (n_ctx, head_dim / 2)
  };
  const RopeTable* rope_table(float theta, int head_dim) const;  // nullptr: not built
  void rope(float* x, const RopeTable& t, int pos) const;
  std::unique_ptr<Workspace> take_workspace();
  void give_workspace(std::unique_ptr<Workspace> ws);

  const uint8_t* base_;
  size_t size_;
  Plan plan_;
  int n_ctx_, threads_, vocab_ = 0, max_width_ = 0;
  bool fast_;
  bool any_precise_ = false;  // some op runs two-level activations
  Isa isa_;                   // kernel ISA, resolved once (CFLOW_ISA caps it)
  std::vector<Weight> W_;
  std::vector<std::vector<float>> vecs_;  // per tensor: dequantized when used as a norm or bias
  std::vector<int> kv_width_;             // per KV slot
  std::vector<RopeTable> rope_;
  bool profile_on_ = false;
  mutable std::mutex mu_;  // guards free_ and prof_ only
  std::vector<std::unique_ptr<Workspace>> free_;
  std::vector<double> prof_;
};

}  // namespace cflow
