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
// state.
//
// Two schedules (docs/ENGINE.md, "Schedules"):
//   sequential: every thread runs every op and takes its share of the work; threads meet only
//               at the plan's Barrier ops;
//   pipeline  : the ops are grouped by weight stream into lanes (attention with the residual
//               adds; dense FFN; router and experts; the embedding and the head run on every
//               thread, between meetings of the whole pool), the lanes shared out to
//               teams of threads; a team runs its ops in plan order and waits only for the ops of
//               other teams that write what it reads (or read what it overwrites), so independent
//               weight streams (the dense FFN of layer l beside the attention of layer l + 1 when
//               the dense FFN is delayed) stream at the same time. Both give the same logits: every
//               op computes each row the same way whatever the number of threads that share it.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cflow/expert_tier.h"
#include "cflow/gemm.h"
#include "cflow/kernels.h"  // GemvFn: the decode path
#include "cflow/plan.h"

namespace cflow {

// How a state's KV cache stores keys (values), per position and KV head: hd floats (the fp32
// path: exact against PyTorch), hd IEEE halves (the int8 paths' default, as llama.cpp's f16
// cache: half the memory and the bytes attention reads), or hd / 32 q8_0 blocks of an IEEE half
// scale and 32 int8 (llama.cpp's `--cache-type-k q8_0`: 17/32 of the halves' bytes; keys with
// each rotary pair side by side, run_op(Attention)), quantized as they are written (to_q8_0,
// ops.h) and widened to floats a piece at a time as attention reads them (from_q8), so attention
// over them is the float path's over those values.
enum class KvType : int { F32 = 0, F16 = 1, Q8_0 = 2 };
// Bytes of one position of one KV head (hd values); hd % 32 == 0 for Q8_0.
size_t kv_row_bytes(KvType t, int hd);
const char* kv_type_name(KvType t);

// One sequence: its tokens so far and, per KV slot of the plan, its keys and values (KvType).
// The cache rows are left uninitialized: only positions below pos() are read, and pages are
// committed as they fill (anonymous mappings, map_kv).
class State {
 public:
  // Layout, per KV slot (attention layer): head-major, (n_kv_head, n_ctx, row) with a row
  // kv_row_bytes(type, head_dim), so that the positions of one KV head, which one attention unit
  // reads, are one contiguous stream. kv_widths[s] = n_kv_head * head_dim, kv_head_dims[s] =
  // head_dim; keys of key_type, values of value_type.
  State(int n_ctx, const std::vector<int>& kv_widths, const std::vector<int>& kv_head_dims, KvType key_type,
        KvType value_type);
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  int pos() const { return (int)tokens_.size(); }
  int n_ctx() const { return n_ctx_; }
  KvType key_type() const { return kt_; }
  KvType value_type() const { return vt_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  // Keeps the first n tokens (prompt reuse); 0 <= n <= pos().
  void truncate(int n);
  // Becomes the first n tokens of src and their KV cache (a shared prefix, such as a system
  // prompt, taken from another sequence instead of computed again); 0 <= n <= src.pos(), src of
  // the same model, neither in a forward.
  void copy_prefix(const State& src, int n);
  // Bytes of the KV cache resident in memory (mincore over its mappings): what the state commits.
  size_t kv_resident_bytes() const;

 private:
  friend class Engine;
  friend class Claim;
  int n_ctx_;
  std::vector<int> kv_width_, kv_hd_;
  KvType kt_, vt_;
  // An anonymous private mapping of n bytes: its pages are committed as they are first written
  // and go back to the system with the state, whatever the C library does with large blocks.
  struct Unmap {
    size_t n = 0;
    void operator()(uint8_t* p) const;
  };
  using KvBuffer = std::unique_ptr<uint8_t, Unmap>;
  static KvBuffer map_kv(size_t n);
  // per slot: (n_kv_head, n_ctx, row) keys and values
  std::vector<KvBuffer> k_, v_;
  // per slot: bytes of one position of one head, keys' and values'
  size_t k_row(size_t slot) const { return kv_row_bytes(kt_, kv_hd_[slot]); }
  size_t v_row(size_t slot) const { return kv_row_bytes(vt_, kv_hd_[slot]); }
  std::vector<int32_t> tokens_;
  std::atomic<bool> busy_{false};  // in a forward now
  // Positions whose KV pages may be committed: the most any history of this state has reached
  // since its pages beyond were last released. A forward raises it; truncate and copy_prefix
  // give the whole pages of each KV head's positions [n, high_) back (MADV_DONTNEED) once they
  // are at least kReleasePages a head, so a state that once held a long conversation and goes
  // on with a short one does not keep the long one's memory (the prompt cache's budget counts
  // a history's own pages, engine.kv_bytes_held). Fewer pages than that stay committed: an
  // answer's worth of positions comes and goes with every request, and giving them back each
  // time would cost a system call per head region and a page fault per page.
  static constexpr int kReleasePages = 8;
  int high_ = 0;
  void release_beyond(int n);
};

// A state and the tokens a forward appends to it.
struct Seq {
  State* state = nullptr;
  const int32_t* tokens = nullptr;
  int n = 0;
};

enum class Schedule : int { Sequential = 0, Pipeline = 1 };

// Where experts come from (docs/ENGINE.md, "Experts on disk"): the mapping (the page cache
// decides what stays in RAM), or an ExpertTier of slots read from the file when a layer needs
// them (sync) or as soon as its router has chosen, with the next layer's experts predicted from
// the current hidden state and read ahead (staged).
enum class ExpertPolicy : int { Mmap = 0, Sync = 1, Staged = 2 };

struct EngineOptions {
  Schedule schedule = Schedule::Sequential;
  // The states' KV cache, keys and values: unless given, F16 on the int8 paths and F32 on the
  // fp32 path (exact against PyTorch).
  std::optional<KvType> key_type, value_type;
  bool all_experts = false;  // read (and multiply) every expert of an Experts op, keep the chosen
  ExpertPolicy experts = ExpertPolicy::Mmap;
  TierOptions tier;       // sync and staged: the file, the cache size, the I/O threads
  bool predict = true;    // staged: read ahead the next layer's predicted experts
};

// The expert tier's counters (ExpertTier's), with the staged policy's predictions: of the
// experts a decode row's next layer chose, how many the prediction had named.
struct TierReport {
  TierStats io;
  uint64_t predicted = 0, predicted_right = 0;
};

// Weight bytes read since the engine was made, per Stream (plan.h), and the steps and rows that
// read them.
struct ByteCounts {
  uint64_t bytes[kNumStreams] = {};
  uint64_t steps = 0, rows = 0;
};

class Engine {
 public:
  // base/size: the mapped file. Throws std::runtime_error naming the problem when a tensor's
  // byte range or shape, an expert table entry, or an op's fields, do not check out.
  Engine(const uint8_t* base, size_t size, Plan plan, int n_ctx, int threads, bool fast, EngineOptions opt = {});
  ~Engine();
  // Appends each seq's tokens to its state. logits: per seq, (vocab,) for its last token, or
  // (n_i, vocab) for every token when all_logits; seqs one after another. Returns whether every
  // logit it wrote is finite (checked as they are copied out, where a second pass over them in
  // Python cost a step of 8 Qwen2.5-0.5B rows, 1.2 M logits, 0.27 ms).
  bool forward(const std::vector<Seq>& seqs, bool all_logits, float* logits);
  std::unique_ptr<State> new_state() const;
  int vocab() const { return vocab_; }
  int n_ctx() const { return n_ctx_; }
  KvType key_type() const { return kt_; }  // the states' KV cache (State)
  KvType value_type() const { return vt_; }
  // Whether a prompt row computes bit for bit what a decode row computes: every matrix takes its
  // prompt rows through its batched decode kernel (AVX-512, fast paths, no experts). Then a
  // cached prefix may stop one token short of a prompt, where it otherwise stops two short so
  // that the computed rows take the prefill path of a fresh prompt.
  bool prompt_rows_as_decode() const;
  int threads() const { return threads_; }
  // Wall time per op kind (the index in Op) summed over forwards, seconds (CFLOW_PROFILE=1).
  std::vector<double> profile() const;
  ByteCounts byte_counts() const;
  // nullptr-equivalent (slots 0) without a tier.
  TierReport tier_report() const;
  ExpertPolicy expert_policy() const { return opt_.experts; }
  // Weight bytes one token reads on the longest chain of true dependencies (an op reads what an
  // earlier one wrote) through the attention, dense and expert streams (top_k experts per
  // Experts op), and in all of them: the figures of `cflow analyze` for the same model.
  double critical_path_bytes() const { return crit_bytes_; }
  double stream_bytes() const { return stream_bytes_; }
  Schedule schedule() const { return opt_.schedule; }
  // The pipeline schedule's teams: per team, its lanes (bit i: lane i) and threads.
  std::vector<std::pair<int, int>> teams() const;

  struct Workspace;  // executor.cpp
  struct Team;

 private:
  struct Weight {
    const uint8_t* data;
    TileLayout L;
  };
  // Tensor id's weight for team t: its bytes in the expert slot the team is running, when the
  // tensor is that expert's, else in the mapping.
  Weight weight(int id, const Team& t) const;
  template <class GU, class DN>
  void experts_from_tier(const Experts& op, Workspace& ws, Team& t, GU&& gate_up, DN&& down);
  void stage_reads(const Router& op, Workspace& ws, Team& t);
  void release_pins(Workspace& ws);
  int tier_key(const ExpertRef* e) const;  // the entry's index in plan_.experts (the tier's key)
  void make_tier();
  void validate();
  void plan_schedule();
  void run(Workspace& ws, int tid);
  void run_sequential(Workspace& ws, int tid);
  void run_pipeline(Workspace& ws, int tid);
  void run_one(const Op& op, Workspace& ws, Team& t);
  void run_op(const Embed& op, Workspace& ws, Team& t);
  void run_op(const Matmul& op, Workspace& ws, Team& t);
  void run_op(const GateUp& op, Workspace& ws, Team& t);
  void run_op(const ActMul& op, Workspace& ws, Team& t);
  void run_op(const Attention& op, Workspace& ws, Team& t);
  void run_op(const Add& op, Workspace& ws, Team& t);
  void run_op(const Router& op, Workspace& ws, Team& t);
  void run_op(const Experts& op, Workspace& ws, Team& t);
  struct Input;
  Input prepare(Team& t, const float* src, int lds, int n, int cols, int norm, bool q8, bool precise);
  // The decode (one-token) GEMV kernel of W and the activation type it takes; nullptr when none
  // applies.
  GemvFn decode_kernel(const TileLayout& L, bool precise, AType* at) const;
  GemvBatchFn batch_kernel(const TileLayout& L, AType at) const;
  // Rows [0, n) of src through op's weight, the first n_pre of them prompt rows (docs/ENGINE.md,
  // "Buffers and rows"); dst row k at dst + k * ldd.
  void matmul_rows(const Matmul& op, Workspace& ws, Team& t, const float* src, int lds, int n_pre, int n, float* dst,
                   int ldd);
  void matmul_gemm(const Matmul& op, Team& t, const float* src, int lds, int n, float* dst, int ldd);
  void matmul_single(const Matmul& op, Team& t, const float* src, int lds, int m, float* dst, int ldd);
  // The same for a gate/up weight: h row k (F wide) at h + k * ldh.
  void gate_up_rows(const GateUp& op, Team& t, const float* src, int lds, int n_pre, int n, float* h, int ldh);
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
  std::unique_ptr<Workspace> new_workspace() const;
  std::unique_ptr<Workspace> take_workspace();
  void give_workspace(std::unique_ptr<Workspace> ws);

  const uint8_t* base_;
  size_t size_;
  Plan plan_;
  EngineOptions opt_;
  // per Experts op layer: the expert table's entries of experts 0 .. n_expert - 1
  std::vector<std::vector<const ExpertRef*>> experts_of_;  // indexed by an Experts op's `layer` slot
  std::vector<int> expert_slot_;                           // per op: its slot in experts_of_, or -1
  // per op: for a Router, the experts_of_ slot of the Experts op it routes, and of the next
  // Router's (the prediction's target); -1 where none
  std::vector<int> routes_slot_, next_slot_;
  std::vector<int> next_router_;  // per op: for a Router, the next Router op, or -1
  std::unique_ptr<ExpertTier> tier_;
  int quota_ = 0;  // staged: pins one router (or one Experts op) may hold
  std::mutex tier_mu_;  // forwards on a tier run one at a time (pins are per forward)
  mutable std::atomic<uint64_t> predicted_{0}, predicted_right_{0};
  // the pipeline schedule (plan_schedule): per op its team, the ops of other teams it waits for,
  // whether its team meets before it, whether others wait for it; per team its threads
  struct OpSched {
    int team = 0;
    std::vector<int> waits;
    bool barrier_before = false, signals = false;
  };
  std::vector<OpSched> sched_;
  std::vector<int> team_first_, team_size_, team_lanes_, thread_team_;
  std::vector<std::vector<int>> team_ops_;
  double crit_bytes_ = 0, stream_bytes_ = 0;
  size_t ex_in_width_ = 0, ex_h_width_ = 0;  // floats per row of the experts' scratch
  mutable std::atomic<uint64_t> counts_[kNumStreams + 2] = {};  // bytes per stream, steps, rows
  int n_ctx_, threads_, vocab_ = 0, max_width_ = 0;
  bool logits_by_seq_ = true;  // only last-token ops touch the logits buffer (plan_schedule)
  bool fast_;
  KvType kt_, vt_;  // the states' keys and values (EngineOptions)
  bool any_precise_ = false;  // some op runs two-level activations
  Isa isa_;                   // kernel ISA, resolved once (CFLOW_ISA caps it)
  std::vector<Weight> W_;
  std::vector<std::vector<float>> vecs_;  // per tensor: dequantized when used as a norm or bias
  std::vector<int> kv_width_, kv_hd_;     // per KV slot: n_kv_head * head_dim, head_dim
  std::vector<RopeTable> rope_;
  bool profile_on_ = false;
  mutable std::mutex mu_;  // guards free_ and prof_ only
  std::vector<std::unique_ptr<Workspace>> free_;
  std::vector<double> prof_;
};

}  // namespace cflow
