// The plan executor: validates a plan against the mapped file, then runs forwards, each on a
// workspace of its own (one pool.run per forward). Sequential schedule: barriers only where the
// plan places them; pipeline schedule: teams of threads per lane, waiting on each other's ops
// only where the ops' buffers say they must (plan_schedule).
#include <sys/mman.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <thread>
#include <type_traits>

#if defined(CFLOW_X86)
#include <immintrin.h>
#endif

#include "cflow/engine.h"
#include "cflow/expert_tier.h"
#include "cflow/ops.h"
#include "cflow/threadpool.h"

namespace cflow {

// What one thread, or the threads together, use inside an op.
struct Scratch {
  std::vector<float> xn;             // (n, C) normalised input
  std::vector<uint8_t> qa;           // (n, levels) rows of int8 input (QActs; two levels: two_level ops)
  std::vector<float> y;              // (n, rows of a share) GEMM output before an epilogue
  std::vector<float> scores;         // (heads at once, span) attention scores
  std::vector<float> attn_part;      // attention: spans' partial results (per thread, or the team's)
  std::vector<int> span_first;       // attention: each row's first span item
  std::vector<float> kv_rows;    // attention: a piece of a q8_0 span's keys or values widened, (piece, hd)
  std::vector<float> kv_paired;  // attention: the queries that meet q8_0 keys, in rotary pairs (nq, hd)
  std::vector<uint8_t> xa;           // one token's activation prepared for a GEMV kernel
  std::vector<float> gather;         // (seqs, C): the last row of each sequence (the head)
  // Experts: the step's (row, expert) assignments sorted by expert, then row
  std::vector<int32_t> ex_start;     // (n_expert + 1,) first assignment of each expert
  std::vector<int32_t> ex_row;       // per assignment: its row
  std::vector<int32_t> ex_of;        // (n, top_k): the assignment of each (row, slot), slots by expert id
  std::vector<float> ex_gate;        // (n, top_k): its gate
  std::vector<float> ex_in, ex_h, ex_out;  // per assignment: input (C), hidden (F), output (C)
  // experts from a tier: those still to run, the one running and its bytes (the lead's pick)
  std::vector<int> ex_todo;
  int ex_cur = -1;
  const uint8_t* ex_ptr = nullptr;
};

// A barrier of a few threads of the pool (a team of the pipeline schedule): spins, then yields.
class SpinBarrier {
 public:
  void reset(int n) { n_ = n; }
  void wait() {
    const uint32_t g = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == (uint32_t)n_) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int i = 1; gen_.load(std::memory_order_acquire) == g; ++i) relax(i);
  }
  static void relax(int i) {
#if defined(CFLOW_X86)
    _mm_pause();
#endif
    if (!(i & 1023)) std::this_thread::yield();
  }

 private:
  int n_ = 1;
  alignas(64) std::atomic<uint32_t> count_{0};
  alignas(64) std::atomic<uint32_t> gen_{0};
};

// Work handed out while a team runs an op: the units (row groups, stripes, GLU pieces) of a
// decode GEMV of 2 MB or more, and attention's spans or decode pairs from kAttnShareBytes of
// keys and values (run_op(Attention)). Each thread first claims its fixed share less an eighth
// (7/8 of U / nth, in thread order as claimed), then the last eighth goes in guided pieces
// (1/(2 nth) of what is left, at least kShareMinBytes of weights). A thread that the host slows (another
// tenant, an interrupt) then takes fewer of the last rows instead of holding the others at the
// next barrier. Measured on a shared 2-vCPU VM, decode steps alternating with the fixed split
// in one process: qwen2.5-coder-0.5b 5% faster in the median step, gemma3-270m 1-2%, SmolLM2
// even; handing out more than the last eighth (pieces from the start) was 3-7% slower than the
// fixed split, each thread then streaming several short runs. Rows do not depend on one
// another, so which thread computes a row changes nothing in its result.
// One counter per call of a thread in an op (kSharesPerOp), stamped with the forward's epoch so
// that the first claim of a forward restarts it; a team of one thread, a matrix under 2 MB or a
// call past kSharesPerOp takes the thread's fixed share once.
constexpr int kSharesPerOp = 4;
constexpr size_t kShareMinBytes = 64 << 10;     // the smallest piece, in bytes of weights (of keys and values)
constexpr size_t kShareDynamicBytes = 2 << 20;  // smaller matrices keep the fixed split
constexpr size_t kAttnShareBytes = 256 << 10;    // attention: keys and values read by the op
struct OpShares {
  struct alignas(64) Slot {
    std::atomic<uint64_t> v{0};  // the forward's epoch (high 32 bits), units handed out (low)
  };
  Slot slot[kSharesPerOp];
};

class UnitShare {
 public:
  UnitShare(OpShares* shares, int* calls, uint64_t epoch, int tid, int nth, int units, int min_units)
      : units_(units) {
    if (nth > 1 && shares && *calls < kSharesPerOp) {
      slot_ = &shares->slot[(*calls)++].v;
      epoch_ = epoch & 0xffffffffu;
      nth_ = nth;
      min_ = std::max(1, min_units);
    } else {
      fixed0_ = (int)((int64_t)units * tid / nth);
      fixed1_ = (int)((int64_t)units * (tid + 1) / nth);
    }
  }
  // This thread's next units [u0, u1); false when none are left.
  bool next(int* u0, int* u1) {
    if (!slot_) {
      if (taken_) return false;
      taken_ = true;
      *u0 = fixed0_, *u1 = fixed1_;
      return fixed0_ < fixed1_;
    }
    uint64_t v = slot_->load(std::memory_order_relaxed);
    for (;;) {
      if ((v >> 32) != epoch_) {  // the first claim of this forward: the count starts at 0
        const uint64_t fresh = epoch_ << 32;
        if (slot_->compare_exchange_weak(v, fresh, std::memory_order_relaxed)) v = fresh;
        continue;
      }
      const int got = (int)(v & 0xffffffffu);
      if (got >= units_) return false;
      const int want = first_ ? (int)((int64_t)units_ * 7 / (8 * nth_)) : (units_ - got) / (2 * nth_);
      const int take = std::min(units_ - got, std::max(min_, want));
      if (slot_->compare_exchange_weak(v, v + (uint64_t)take, std::memory_order_relaxed)) {
        first_ = false;
        *u0 = got, *u1 = got + take;
        return true;
      }
    }
  }

 private:
  int units_, nth_ = 1, min_ = 1, fixed0_ = 0, fixed1_ = 0;
  bool taken_ = false, first_ = true;
  std::atomic<uint64_t>* slot_ = nullptr;
  uint64_t epoch_ = 0;
};

// One forward's pool, buffers and scratch, and the rows of its step.
struct Engine::Workspace {
  Workspace(int threads, int teams, int ops) : pool(threads), bars(teams), done(ops), shares(ops) {
    for (int t = 0; t < threads; ++t) priv.push_back(std::make_unique<Scratch>());
    for (int t = 0; t < teams; ++t) shared.push_back(std::make_unique<Scratch>());
  }
  ThreadPool pool;
  std::vector<std::vector<float>> bufs;  // per plan buffer: (n, width)
  std::vector<std::unique_ptr<Scratch>> priv;    // per thread
  std::vector<std::unique_ptr<Scratch>> shared;  // per team: written by all its threads, each its rows
  std::vector<SpinBarrier> bars;                 // per team (pipeline schedule)
  std::vector<std::atomic<uint64_t>> done;       // per op: threads that finished it, over all forwards
  std::vector<OpShares> shares;                  // per op: its units handed out (UnitShare)
  uint64_t epoch = 0;                            // forwards run on this workspace
  std::atomic<bool> failed{false};               // a thread met bad data (error below)
  std::string error;
  std::vector<double> prof;              // per op kind, seconds
  // the step: n rows, sequence by sequence
  int n = 0;
  bool all_logits = false;
  std::vector<int32_t> tokens, row_seq, row_pos;  // per row
  int n_pre = 0;                                  // rows [0, n_pre): sequences with several new tokens
  std::vector<int32_t> first_row, last_row;       // per sequence, in the caller's order
  std::vector<State*> states;                     // per sequence, in row order
  // expert tier (staged): per experts_of_ slot, per expert, the tier slot its router pinned (-1:
  // none); per experts_of_ slot, the experts predicted for it (decode rows), checked at its router
  std::vector<std::vector<int>> pinned;
  std::vector<std::vector<int>> predicted;
};

// The threads that run one op together: the whole pool (sequential schedule) or a team of it
// (pipeline schedule). tid: this thread's index in the team; nth: the team's size.
struct Engine::Team {
  int tid = 0, nth = 1;
  ThreadPool* pool = nullptr;  // the whole pool's barrier, else bar's
  SpinBarrier* bar = nullptr;
  Scratch* shared = nullptr;
  Scratch* priv = nullptr;
  int op = 0;  // index of the op running
  OpShares* shares = nullptr;  // the running op's counters (UnitShare), this forward's epoch,
  uint64_t epoch = 0;          // and how many row shares this thread began in the op
  int share_calls = 0;
  // the expert the team runs from a tier slot: its entry and the slot's bytes (Engine::weight)
  const ExpertRef* ex = nullptr;
  const uint8_t* ex_data = nullptr;
  bool lead() const { return tid == 0; }
  void enter(Workspace& ws, int i) {
    op = i;
    shares = &ws.shares[i];
    epoch = ws.epoch;
    share_calls = 0;
  }
  // The op's next units handed out among the team (UnitShare), `bytes` of weights in all.
  UnitShare share(int units, size_t bytes, size_t dynamic_from = kShareDynamicBytes) {
    const size_t unit_bytes = std::max<size_t>(1, bytes / std::max(1, units));
    if (bytes < dynamic_from) return UnitShare(nullptr, &share_calls, epoch, tid, nth, units, 1);
    return UnitShare(shares, &share_calls, epoch, tid, nth, units, (int)std::min<size_t>(units, kShareMinBytes / unit_bytes));
  }
  void barrier() const {
    if (nth <= 1) return;
    if (pool) pool->barrier();
    else bar->wait();
  }
};

struct Engine::Input {
  const float* x = nullptr;
  int ldx = 0;
  QActs qa;  // two_level: two levels
};

static void fail(const std::string& msg) { throw std::runtime_error(msg); }

template <class T>
static void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

size_t kv_row_bytes(KvType t, int hd) {
  switch (t) {
    case KvType::F32: return 4 * (size_t)hd;
    case KvType::F16: return 2 * (size_t)hd;
    case KvType::Q8_0: return (size_t)hd / 32 * kQ8Block;
  }
  return 0;
}

const char* kv_type_name(KvType t) {
  switch (t) {
    case KvType::F32: return "f32";
    case KvType::F16: return "f16";
    case KvType::Q8_0: return "q8_0";
  }
  return "?";
}

State::State(int n_ctx, const std::vector<int>& kv_widths, const std::vector<int>& kv_head_dims, KvType key_type,
             KvType value_type)
    : n_ctx_(n_ctx), kv_width_(kv_widths), kv_hd_(kv_head_dims), kt_(key_type), vt_(value_type) {
  for (size_t slot = 0; slot < kv_width_.size(); ++slot) {
    const size_t heads = kv_hd_[slot] ? kv_width_[slot] / kv_hd_[slot] : 0;
    k_.push_back(map_kv((size_t)n_ctx * heads * k_row(slot)));
    v_.push_back(map_kv((size_t)n_ctx * heads * v_row(slot)));
  }
}

void State::Unmap::operator()(uint8_t* p) const {
  if (p) munmap(p, n);
}

State::KvBuffer State::map_kv(size_t n) {
  if (!n) return KvBuffer(nullptr, Unmap{0});
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  return KvBuffer((uint8_t*)p, Unmap{n});
}

void State::truncate(int n) {
  if (n < 0 || n > pos())
    fail("truncate(" + std::to_string(n) + "): the state holds " + std::to_string(pos()) + " tokens");
  tokens_.resize(n);
  release_beyond(n);
}

static size_t page_bytes() {
  static const size_t p = (size_t)sysconf(_SC_PAGESIZE);
  return p;
}

void State::release_beyond(int n) {
  if (high_ <= n) return;
  const size_t page = page_bytes();
  size_t least = SIZE_MAX;  // the fewest bytes a head's positions [n, high_) take, over the slots
  for (size_t slot = 0; slot < k_.size(); ++slot)
    least = std::min(least, std::min(k_row(slot), v_row(slot)) * (size_t)(high_ - n));
  if (least < (kReleasePages + 1) * page) return;  // whole pages: at least kReleasePages of each head
  for (size_t slot = 0; slot < k_.size(); ++slot)
    for (const auto& [buf, per] : {std::pair(&k_[slot], k_row(slot)), std::pair(&v_[slot], v_row(slot))}) {
      const size_t head = per * n_ctx_;
      for (size_t at = 0; at < head * (kv_width_[slot] / kv_hd_[slot]); at += head) {
        // the pages wholly inside this head's positions from n (its first may hold positions
        // kept) up to high_ and the unwritten ones after it, short of the next head's
        const size_t a = (at + per * n + page - 1) / page * page;
        const size_t b = std::min((at + per * high_ + page - 1) / page * page, (at + head) / page * page);
        if (b > a) madvise(buf->get() + a, b - a, MADV_DONTNEED);
      }
    }
  high_ = n;
}

size_t State::kv_resident_bytes() const {
  const size_t page = page_bytes();
  size_t pages = 0;
  std::vector<unsigned char> in;
  for (size_t slot = 0; slot < k_.size(); ++slot)
    for (const KvBuffer* buf : {&k_[slot], &v_[slot]}) {
      const size_t n = buf->get_deleter().n, np = (n + page - 1) / page;
      if (!n) continue;
      in.resize(np);
      if (mincore(buf->get(), n, in.data()) != 0) fail("mincore failed on a KV buffer");
      for (unsigned char c : in) pages += c & 1;
    }
  return pages * page;
}

void State::copy_prefix(const State& src, int n) {
  if (&src == this) return truncate(n);
  if (n < 0 || n > src.pos())
    fail("copy_prefix(" + std::to_string(n) + "): the source holds " + std::to_string(src.pos()) + " tokens");
  if (src.n_ctx_ != n_ctx_ || src.kv_width_ != kv_width_ || src.kv_hd_ != kv_hd_ || src.kt_ != kt_ || src.vt_ != vt_)
    fail("copy_prefix: the states belong to different models or KV cache types");
  if (busy_ || src.busy_) fail("copy_prefix: a state is in a forward");
  for (size_t slot = 0; slot < k_.size(); ++slot)
    for (const auto& [dst, from, per] : {std::tuple(&k_[slot], &src.k_[slot], k_row(slot)),
                                          std::tuple(&v_[slot], &src.v_[slot], v_row(slot))}) {
      const size_t head = per * n_ctx_;
      for (size_t at = 0; at < head * (kv_width_[slot] / kv_hd_[slot]); at += head)  // each head's first n positions
        std::memcpy(dst->get() + at, from->get() + at, per * n);
    }
  tokens_.assign(src.tokens_.begin(), src.tokens_.begin() + n);
  high_ = std::max(high_, n);
  release_beyond(n);  // this state's own positions past the copy are gone
}

Engine::Engine(const uint8_t* base, size_t size, Plan plan, int n_ctx, int threads, bool fast, EngineOptions opt)
    : base_(base), size_(size), plan_(std::move(plan)), opt_(opt), n_ctx_(n_ctx), threads_(threads > 0 ? threads : 1),
      fast_(fast), isa_(best_isa()) {
  validate();
  kt_ = opt.key_type.value_or(fast ? KvType::F16 : KvType::F32);
  vt_ = opt.value_type.value_or(fast ? KvType::F16 : KvType::F32);
  for (int hd : kv_hd_)
    if ((kt_ == KvType::Q8_0 || vt_ == KvType::Q8_0) && hd % 32)
      fail("a q8_0 KV cache takes head dims that are multiples of 32; this model's is " + std::to_string(hd));
  plan_schedule();
  make_tier();
  vecs_.resize(W_.size());
  // Norm and bias vectors are small: dequantize them once.
  auto keep_vec = [&](int id) {
    if (id < 0 || !vecs_[id].empty()) return;
    const TileLayout& L = W_[id].L;
    std::vector<float> v((size_t)L.rows * L.cols);
    for (int r = 0; r < L.rows; ++r) dequant_row(L, W_[id].data, r, v.data() + (size_t)r * L.cols);
    vecs_[id] = std::move(v);
  };
  for (const Op& op : plan_.ops) {
    std::visit([&](const auto& o) {
      using T = std::decay_t<decltype(o)>;
      if constexpr (std::is_same_v<T, Matmul>) { keep_vec(o.norm); keep_vec(o.bias); any_precise_ |= o.two_level; }
      if constexpr (std::is_same_v<T, GateUp>) { keep_vec(o.norm); any_precise_ |= o.two_level; }
      if constexpr (std::is_same_v<T, Add>) { keep_vec(o.norm); keep_vec(o.gain); }
      if constexpr (std::is_same_v<T, Router>) { keep_vec(o.weight); keep_vec(o.norm); }
      if constexpr (std::is_same_v<T, Experts>) { keep_vec(o.norm); any_precise_ |= o.two_level; }
      if constexpr (std::is_same_v<T, Attention>) {
        keep_vec(o.q_norm);
        keep_vec(o.k_norm);
        // RoPE tables per distinct (theta, head_dim): (n_ctx, hd/2) cos and sin, angles in fp32 like HF.
        if (rope_table(o.rope_theta, o.head_dim)) return;
        const int half = o.head_dim / 2;
        RopeTable t{o.rope_theta, o.head_dim, std::vector<float>((size_t)n_ctx_ * half),
                    std::vector<float>((size_t)n_ctx_ * half)};
        for (int i = 0; i < half; ++i) {
          const float inv = (float)(1.0 / std::pow((double)o.rope_theta, (2.0 * i) / o.head_dim));
          for (int p = 0; p < n_ctx_; ++p) {
            const double a = (double)((float)p * inv);
            t.cos[(size_t)p * half + i] = (float)std::cos(a);
            t.sin[(size_t)p * half + i] = (float)std::sin(a);
          }
        }
        rope_.push_back(std::move(t));
      }
    }, op);
  }
  const char* pe = std::getenv("CFLOW_PROFILE");
  profile_on_ = pe && *pe && *pe != '0';
  prof_.assign(std::variant_size_v<Op>, 0.0);
  free_.push_back(new_workspace());  // the first caller's: its threads start now
}

Engine::~Engine() = default;

std::unique_ptr<State> Engine::new_state() const { return std::make_unique<State>(n_ctx_, kv_width_, kv_hd_, kt_, vt_); }

std::vector<double> Engine::profile() const {
  std::lock_guard<std::mutex> lk(mu_);
  return prof_;
}

ByteCounts Engine::byte_counts() const {
  ByteCounts c;
  for (int i = 0; i < kNumStreams; ++i) c.bytes[i] = counts_[i].load(std::memory_order_relaxed);
  c.steps = counts_[kNumStreams].load(std::memory_order_relaxed);
  c.rows = counts_[kNumStreams + 1].load(std::memory_order_relaxed);
  return c;
}

std::vector<std::pair<int, int>> Engine::teams() const {
  std::vector<std::pair<int, int>> out;
  for (size_t t = 0; t < team_size_.size(); ++t) out.emplace_back(team_lanes_[t], team_size_[t]);
  return out;
}

std::unique_ptr<Engine::Workspace> Engine::new_workspace() const {
  auto ws = std::make_unique<Workspace>(threads_, (int)team_size_.size(), (int)plan_.ops.size());
  for (size_t t = 0; t < team_size_.size(); ++t) ws->bars[t].reset(team_size_[t]);
  return ws;
}

std::unique_ptr<Engine::Workspace> Engine::take_workspace() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!free_.empty()) {
      auto ws = std::move(free_.back());
      free_.pop_back();
      return ws;
    }
  }
  return new_workspace();  // another thread's forward is running
}

void Engine::give_workspace(std::unique_ptr<Workspace> ws) {
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t i = 0; i < ws->prof.size(); ++i) prof_[i] += ws->prof[i];
  std::fill(ws->prof.begin(), ws->prof.end(), 0.0);
  free_.push_back(std::move(ws));
}

// ---------------------------------------------------------------- validation
void Engine::validate() {
  if (n_ctx_ <= 0) fail("engine: n_ctx must be positive");
  const int nt = (int)plan_.tensors.size();
  for (int i = 0; i < nt; ++i) {
    const TensorRef& t = plan_.tensors[i];
    const std::string at = "tensor " + t.name + ": ";
    TileLayout L;
    L.type = t.type; L.rows = t.rows; L.cols = t.cols; L.tr = t.tile_rows; L.tc = t.tile_cols; L.g = t.interleave;
    L.pack = t.pack;
    const char* err = nullptr;
    if (!make_layout(L, &err)) fail(at + err);
    if (t.offset < 0) fail(at + "not in a mapped file (the native engine runs .cflow files)");
    if (t.nbytes < 0 || (uint64_t)t.offset > size_ || (uint64_t)t.nbytes > size_ - (uint64_t)t.offset)
      fail(at + "byte range [" + std::to_string(t.offset) + ", +" + std::to_string(t.nbytes) +
           ") lies outside the mapped file of " + std::to_string(size_) + " bytes");
    if ((size_t)t.nbytes != layout_nbytes(L))
      fail(at + std::to_string(t.nbytes) + " bytes, its shape needs " + std::to_string(layout_nbytes(L)));
    W_.push_back({base_ + t.offset, L});
  }
  const int nb = (int)plan_.buffers.size();
  for (const BufferSpec& b : plan_.buffers)
    if (b.width <= 0 || b.width > (1 << 24)) fail("plan: buffer " + b.name + " has a bad width");
  if (plan_.logits < 0 || plan_.logits >= nb) fail("plan: bad logits buffer");
  vocab_ = plan_.buffers[plan_.logits].width;
  // the widest input an op normalises or quantizes (scratch per row): not the logits, which
  // only the head writes (plan_schedule widens it where another op touches them)
  for (int b = 0; b < nb; ++b)
    if (b != plan_.logits) max_width_ = std::max(max_width_, plan_.buffers[b].width);
  if (!(plan_.norm_eps >= 0) || !std::isfinite(plan_.norm_offset)) fail("plan: bad RMSNorm constants");
  auto tensor = [&](int id, const char* what) -> const TileLayout* {
    if (id == -1) return nullptr;
    if (id < -1 || id >= nt) fail(std::string("bad tensor id for ") + what);
    return &W_[id].L;
  };
  auto buffer = [&](int id, const char* what) -> int {
    if (id < 0 || id >= nb) fail(std::string("bad buffer id for ") + what);
    return plan_.buffers[id].width;
  };
  auto numel = [](const TileLayout* L) { return (int64_t)L->rows * L->cols; };
  // The expert table: each entry's range 4096-aligned inside the file, its two tensors inside
  // the range with matching shapes.
  std::map<std::pair<int, int>, const ExpertRef*> expert_at;  // (layer, expert)
  for (const ExpertRef& e : plan_.experts) {
    const std::string at = "expert (layer " + std::to_string(e.layer) + ", expert " + std::to_string(e.expert) + "): ";
    if (e.layer < 0 || e.expert < 0 || e.expert >= (1 << 24)) fail(at + "layer and expert must be in 0..2^24");
    if (e.offset < 0 || e.length <= 0 || (uint64_t)e.offset > size_ || (uint64_t)e.length > size_ - (uint64_t)e.offset)
      fail(at + "byte range [" + std::to_string(e.offset) + ", +" + std::to_string(e.length) +
           ") lies outside the mapped file of " + std::to_string(size_) + " bytes");
    if (e.offset % 4096) fail(at + "offset " + std::to_string(e.offset) + " is not a multiple of 4096");
    for (int id : {e.gate_up, e.down}) {
      if (id < 0 || id >= nt) fail(at + "bad tensor id");
      const TensorRef& t = plan_.tensors[id];
      if (t.offset < e.offset || t.offset + t.nbytes > e.offset + e.length)
        fail(at + "tensor " + t.name + " [" + std::to_string(t.offset) + ", +" + std::to_string(t.nbytes) +
             ") lies outside the expert's range [" + std::to_string(e.offset) + ", +" + std::to_string(e.length) + ")");
    }
    const TileLayout &GU = W_[e.gate_up].L, &D = W_[e.down].L;
    if (GU.rows != 2 * D.cols || GU.cols != D.rows)
      fail(at + "gate_up (" + std::to_string(GU.rows) + ", " + std::to_string(GU.cols) + ") and down (" +
           std::to_string(D.rows) + ", " + std::to_string(D.cols) + ") do not make one gated FFN");
    if (e.chunk <= 0 || e.chunk % GU.g) fail(at + "gate_up chunk must be a positive multiple of the interleave");
    if (!expert_at.emplace(std::make_pair(e.layer, e.expert), &e).second) fail(at + "listed twice in the expert table");
  }
  expert_slot_.assign(plan_.ops.size(), -1);
  auto same_layout = [](const TileLayout& a, const TileLayout& b) {
    return a.type == b.type && a.rows == b.rows && a.cols == b.cols && a.tr == b.tr && a.tc == b.tc && a.g == b.g &&
           a.pack == b.pack;
  };
  for (size_t i = 0; i < plan_.ops.size(); ++i) {
    const std::string at = "plan op #" + std::to_string(i) + ": ";
    auto check = [&](bool ok, const std::string& msg) {
      if (!ok) fail(at + msg);
    };
    auto norm_of = [&](int id, int width, const char* what) {
      if (const TileLayout* N = tensor(id, what)) check(numel(N) == width, std::string(what) + " size");
    };
    const Op& op = plan_.ops[i];
    try {
      std::visit([&](const auto& o) {
        using T = std::decay_t<decltype(o)>;
        if constexpr (!std::is_same_v<T, std::monostate> && !std::is_same_v<T, Barrier>)
          check(o.stream >= 0 && o.stream < kNumStreams, "stream " + std::to_string(o.stream) + " is not one of 0..5");
        if constexpr (std::is_same_v<T, std::monostate>) {
          check(false, "empty op");
        } else if constexpr (std::is_same_v<T, Embed>) {
          const TileLayout* E = tensor(o.table, "embedding");
          check(E && E->rows == vocab_ && E->cols == buffer(o.dst, "embed dst"),
                "embedding table shape does not match (vocab, width of dst)");
        } else if constexpr (std::is_same_v<T, Matmul> || std::is_same_v<T, GateUp>) {
          const TileLayout* M = tensor(o.weight, "weight");
          check(M != nullptr, "no weight");
          const int C = buffer(o.src, "src"), R = buffer(o.dst, "dst");
          check(M->cols == C, "weight columns " + std::to_string(M->cols) + " != input width " + std::to_string(C));
          check(o.src != o.dst, "input and output are one buffer");
          norm_of(o.norm, C, "norm");
          if constexpr (std::is_same_v<T, Matmul>) {
            check(o.dst_col >= 0 && o.dst_col <= R && M->rows <= R - o.dst_col,
                  "weight rows " + std::to_string(M->rows) + " at column " + std::to_string(o.dst_col) +
                      " do not fit the output width " + std::to_string(R));
            norm_of(o.bias, M->rows, "bias");
            check(!(o.last_token && o.accumulate), "a last-token op cannot accumulate");
            check(std::isfinite(o.scale) && o.softcap >= 0, "bad scale or softcap");
          } else {
            check(M->rows == 2 * R, "gate_up rows must be twice the FFN width");
            check(o.chunk > 0 && o.chunk % M->g == 0, "gate_up chunk must be a positive multiple of the interleave");
            check(o.act >= 0 && o.act <= 2, "unknown activation");
          }
        } else if constexpr (std::is_same_v<T, ActMul>) {
          const int F = buffer(o.dst, "act_mul dst");
          check(buffer(o.src, "act_mul src") == 2 * F, "input is not (gate, up) of twice the output width");
          check(o.act >= 0 && o.act <= 2, "unknown activation");
        } else if constexpr (std::is_same_v<T, Attention>) {
          check(o.n_head > 0 && o.n_kv_head > 0 && o.n_head % o.n_kv_head == 0, "heads");
          check(o.head_dim > 0 && o.head_dim % 2 == 0 && o.head_dim <= 1024, "head_dim must be even, at most 1024");
          check(o.kv >= 0 && o.kv < 4096, "bad KV slot");
          const int q = o.n_head * o.head_dim, kv = o.n_kv_head * o.head_dim;
          check(buffer(o.src, "attention src") == q + 2 * kv, "attention input is not (q | k | v)");
          check(buffer(o.dst, "attention dst") == q, "attention output width");
          if (const TileLayout* N = tensor(o.q_norm, "q norm"))
            check(numel(N) == o.head_dim || numel(N) == q, "q norm size: head_dim or n_head head_dim");
          if (const TileLayout* N = tensor(o.k_norm, "k norm"))
            check(numel(N) == o.head_dim || numel(N) == kv, "k norm size: head_dim or n_kv_head head_dim");
          check(o.window >= 0 && o.rope_theta > 0 && o.scale >= 0, "bad window, RoPE base or scale");
          if ((int)kv_width_.size() <= o.kv) kv_width_.resize(o.kv + 1, 0), kv_hd_.resize(o.kv + 1, 0);
          check(kv_width_[o.kv] == 0 || (kv_width_[o.kv] == kv && kv_hd_[o.kv] == o.head_dim),
                "KV slot used with two shapes");
          kv_width_[o.kv] = kv, kv_hd_[o.kv] = o.head_dim;
        } else if constexpr (std::is_same_v<T, Add>) {
          const int w = buffer(o.src, "add src");
          check(buffer(o.dst, "add dst") == w, "add: src and dst widths differ");
          norm_of(o.norm, w, "norm");
          norm_of(o.gain, w, "gain");
          check(std::isfinite(o.scale), "bad scale");
          if (o.gate >= 0) check(buffer(o.gate, "add gate") == 1, "add: the gate buffer must be 1 wide");
        } else if constexpr (std::is_same_v<T, Router>) {
          const TileLayout* R = tensor(o.weight, "router weight");
          check(R != nullptr, "no router weight");
          const int C = buffer(o.src, "router src");
          check(R->cols == C, "router columns " + std::to_string(R->cols) + " != input width " + std::to_string(C));
          norm_of(o.norm, C, "norm");
          check(o.top_k >= 1 && o.top_k <= R->rows,
                "top_k " + std::to_string(o.top_k) + " must be in 1..n_expert (" + std::to_string(R->rows) + ")");
          check(buffer(o.dst, "router dst") == 2 * o.top_k, "router output width must be 2 top_k");
        } else if constexpr (std::is_same_v<T, Experts>) {
          const int C = buffer(o.src, "experts src");
          check(buffer(o.dst, "experts dst") == C, "experts output width != input width");
          const int rw = buffer(o.route, "experts route");
          check(rw % 2 == 0, "route width must be 2 top_k");
          check(o.n_expert >= 1 && o.n_expert <= (1 << 16), "n_expert must be in 1..65536");
          check(rw / 2 <= o.n_expert,
                "top_k " + std::to_string(rw / 2) + " > n_expert " + std::to_string(o.n_expert));
          check(rw / 2 <= 64, "top_k above 64");
          norm_of(o.norm, C, "norm");
          check(o.act >= 0 && o.act <= 2, "unknown activation");
          check(std::isfinite(o.scale), "bad scale");
          std::vector<const ExpertRef*> set(o.n_expert);
          for (int e = 0; e < o.n_expert; ++e) {
            auto it = expert_at.find({o.layer, e});
            check(it != expert_at.end(), "the expert table has no entry for layer " + std::to_string(o.layer) +
                                             ", expert " + std::to_string(e));
            set[e] = it->second;
            const TileLayout &GU = W_[set[e]->gate_up].L, &D = W_[set[e]->down].L;
            check(GU.cols == C, "expert " + std::to_string(e) + ": gate_up columns != input width");
            if (e) {
              check(same_layout(GU, W_[set[0]->gate_up].L) && same_layout(D, W_[set[0]->down].L) &&
                        set[e]->chunk == set[0]->chunk,
                    "expert " + std::to_string(e) + " of layer " + std::to_string(o.layer) +
                        " is stored unlike expert 0 (shape, type or tiles)");
            }
          }
          const int F = W_[set[0]->down].L.cols, S = opt_.all_experts ? o.n_expert : rw / 2;
          ex_in_width_ = std::max(ex_in_width_, (size_t)S * C);
          ex_h_width_ = std::max(ex_h_width_, (size_t)S * F);
          max_width_ = std::max(max_width_, F);
          expert_slot_[i] = (int)experts_of_.size();
          experts_of_.push_back(std::move(set));
        }
      }, op);
    } catch (const std::runtime_error& e) {
      const std::string m = e.what();
      if (m.rfind("plan op #", 0) == 0) throw;
      fail(at + m);
    }
  }
  for (size_t s = 0; s < kv_width_.size(); ++s)
    if (!kv_width_[s]) fail("plan: KV slot " + std::to_string(s) + " is not used by any attention op");
  // Each Router and the Experts op that reads its choice (the latest Router writing its route
  // buffer before it), and each Router's successor (the staged policy's prediction target).
  routes_slot_.assign(plan_.ops.size(), -1);
  next_router_.assign(plan_.ops.size(), -1);
  int last = -1;
  for (size_t i = 0; i < plan_.ops.size(); ++i) {
    if (std::holds_alternative<Router>(plan_.ops[i])) {
      if (last >= 0) next_router_[last] = (int)i;
      last = (int)i;
    }
    if (const Experts* x = std::get_if<Experts>(&plan_.ops[i]))
      for (int j = (int)i - 1; j >= 0; --j)
        if (const Router* r = std::get_if<Router>(&plan_.ops[j]); r && r->dst == x->route) {
          routes_slot_[j] = expert_slot_[i];
          break;
        }
  }
}

// The expert tier of the sync and staged policies: one entry per expert of the plan's table,
// each with its checksum; enough slots for the experts that can be pinned at once (staged: every
// router between an Experts op and its own, quota_ each, and the op's own quota_; sync: the
// expert running and the next one).
void Engine::make_tier() {
  if (opt_.experts == ExpertPolicy::Mmap) return;
  if (experts_of_.empty()) fail("expert tier: the model has no mixture-of-experts layers");
  std::vector<TierEntry> entries;
  for (const ExpertRef& e : plan_.experts) {
    if (e.crc32c < 0)
      fail("expert tier: expert (layer " + std::to_string(e.layer) + ", expert " + std::to_string(e.expert) +
           ") has no checksum in the expert table (a file written before experts carried one): convert the model "
           "again");
    entries.push_back({e.layer, e.expert, (uint64_t)e.offset, (uint64_t)e.length, (uint32_t)e.crc32c});
  }
  int top_k = 1, in_flight = 1;  // routers pinned while an Experts op waits, its own included
  for (size_t i = 0; i < plan_.ops.size(); ++i) {
    const Experts* x = std::get_if<Experts>(&plan_.ops[i]);
    if (!x) continue;
    top_k = std::max(top_k, plan_.buffers[x->route].width / 2);
    int routers = 0;
    for (int j = (int)i - 1; j >= 0; --j)
      if (const Router* r = std::get_if<Router>(&plan_.ops[j])) {
        ++routers;
        if (r->dst == x->route) break;
      }
    in_flight = std::max(in_flight, routers);
  }
  const bool staged = opt_.experts == ExpertPolicy::Staged;
  tier_ = std::make_unique<ExpertTier>(opt_.tier, std::move(entries), staged ? top_k * (in_flight + 1) : 2);
  quota_ = std::max(top_k, tier_->slots() / (in_flight + 1));
}

TierReport Engine::tier_report() const {
  TierReport r;
  if (tier_) r.io = tier_->stats();
  r.predicted = predicted_.load(std::memory_order_relaxed);
  r.predicted_right = predicted_right_.load(std::memory_order_relaxed);
  return r;
}

// ---------------------------------------------------------------- helpers
void Engine::rmsnorm(const float* x, const float* w, int cols, float* out) const {
  ops().rmsnorm(out, x, w, 1, cols, plan_.norm_eps, plan_.norm_offset);
}

const Engine::RopeTable* Engine::rope_table(float theta, int head_dim) const {
  for (const RopeTable& t : rope_)
    if (t.theta == theta && t.head_dim == head_dim) return &t;
  return nullptr;
}

// The one RoPE of the engine, neox style (rotate halves): x (head_dim,) at position pos.
void Engine::rope(float* x, const RopeTable& t, int pos) const {
  const int half = t.head_dim / 2;
  const float* c = t.cos.data() + (size_t)pos * half;
  const float* s = t.sin.data() + (size_t)pos * half;
  for (int i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * c[i] - b * s[i];
    x[i + half] = b * c[i] + a * s[i];
  }
}

// Input of a GEMM: optionally normalised, optionally quantized. One row: each thread makes its
// own copy (no barrier). Several rows: threads split the rows into shared scratch, barrier.
Engine::Input Engine::prepare(Team& t, const float* src, int lds, int n, int cols, int norm, bool q8, bool precise) {
  Input in;
  in.x = src;
  in.ldx = lds;
  if (norm < 0 && !q8) return in;
  const bool one = n == 1;
  Scratch& s = one ? *t.priv : *t.shared;
  const int nth = one ? 1 : t.nth, tid = one ? 0 : t.tid;
  if (!one) t.barrier();  // the shared scratch may still be read by the previous op
  const int k0 = (int)((int64_t)n * tid / nth), k1 = (int)((int64_t)n * (tid + 1) / nth);
  const float* x = src;
  int ldx = lds;
  if (norm >= 0) {
    for (int k = k0; k < k1; ++k) rmsnorm(src + (size_t)k * lds, vec(norm), cols, s.xn.data() + (size_t)k * cols);
    x = s.xn.data();
    ldx = cols;
    in.x = x;
    in.ldx = ldx;
  }
  if (q8) {
    in.qa.n = n;
    in.qa.cols = cols;
    in.qa.levels = precise ? 2 : 1;
    if (one) grow(s.qa, in.qa.bytes());  // a private scratch; the shared one is sized by forward()
    in.qa.data = s.qa.data();
    QActs part = in.qa;  // this thread's rows
    part.n = k1 - k0;
    part.data = (uint8_t*)in.qa.row(k0);
    if (k1 > k0) quantize_acts(x + (size_t)k0 * ldx, ldx, k1 - k0, cols, part);
  }
  if (!one) t.barrier();
  return in;
}

// Decode reads each weight once for one token: the tile GEMV kernels (kernels.h), which threads
// share by interleave groups or whole stripes (gemv_share), are the bandwidth-bound path. int8 activations (one or two levels,
// AType::Q8 / Q8x2) on the fast path for quantized types, fp32 otherwise.
GemvFn Engine::decode_kernel(const TileLayout& L, bool precise, AType* at) const {
  *at = !fast_ || !has_int8_path(L.bt(), false) ? AType::F32 : precise ? AType::Q8x2 : AType::Q8;
  return gemv_fn(L.bt(), L.packing(), *at, isa_);
}

bool Engine::prompt_rows_as_decode() const {
  if (!fast_) return false;  // fp32 prompt rows take the tile GEMM, decode rows the GEMV
  bool same = true;
  for (const Op& op : plan_.ops)
    std::visit([&](const auto& o) {
      using T = std::decay_t<decltype(o)>;
      if constexpr (std::is_same_v<T, Matmul> || std::is_same_v<T, GateUp>) {
        const TileLayout& L = W_[o.weight].L;
        AType at;
        // matmul_rows / gate_up_rows: prompt rows take the batched kernel where the decode
        // kernel has one and either the type has no int8 GEMM or the batched GEMV beats it
        if (!decode_kernel(L, o.two_level, &at) || !batch_kernel(L, at)) same = false;
        if (has_int8_path(L.bt(), true) && !gemv_batch_beats_gemm(isa_)) same = false;
        if constexpr (std::is_same_v<T, GateUp>) {
          if (2 * o.chunk != L.tr) same = false;  // pieces that are not one stripe: the GEMM
        }
      } else if constexpr (std::is_same_v<T, Experts>) {
        same = false;  // experts gather their rows per expert; not claimed
      }
    }, op);
  return same;
}

// Thread tid's share of whole stripes: rows [r0, r1).
static void stripe_share(const TileLayout& L, int tid, int nth, int* r0, int* r1) {
  const int S = (L.rows + L.tr - 1) / L.tr;
  *r0 = std::min(L.rows, (int)((int64_t)S * tid / nth) * L.tr);
  *r1 = std::min(L.rows, (int)((int64_t)S * (tid + 1) / nth) * L.tr);
}

// Thread tid's share of a matrix's rows, on interleave-group boundaries.
static void row_share(const TileLayout& L, int tid, int nth, int* r0, int* r1) {
  const int U = layout_units(L);
  *r0 = unit_row(L, (int)((int64_t)U * tid / nth));
  *r1 = unit_row(L, (int)((int64_t)U * (tid + 1) / nth));
}

// Thread tid's share of rows for the decode GEMVs: every kernel of the planes pack walks
// interleave groups (walk_planes, or whole-block kernels over unpacked stripes, walk_tiles_whole),
// so it splits on group boundaries; the others (ternary kernels walk rows in fours) by whole
// stripes. A matrix of few stripes then splits evenly: 896 rows are 7 stripes of 128 (4 against
// 3 a thread) but 56 groups of 16.
static void gemv_share(const TileLayout& L, int tid, int nth, int* r0, int* r1) {
  if (L.packing() == Pack::Planes) row_share(L, tid, nth, r0, r1);
  else stripe_share(L, tid, nth, r0, r1);
}

// h[j] = act(g[j]) * u[j]: SwiGLU (act 0), GeGLU with tanh GELU (act 1) or squared ReLU (act 2,
// BitNet b1.58's relu2: a loop the compiler vectorizes).
static void act_mul(int act, const float* g, const float* u, float* h, int n) {
  if (act == 0) ops().swiglu(h, g, u, n);
  else if (act == 1) ops().geglu(h, g, u, n);
  else
    for (int j = 0; j < n; ++j) {
      const float r = g[j] > 0.0f ? g[j] : 0.0f;
      h[j] = r * r * u[j];
    }
}

// ---------------------------------------------------------------- ops
void Engine::run_op(const Embed& op, Workspace& ws, Team& t) {
  const Weight& E = W_[op.table];
  const int d = E.L.cols;
  float* dst = ws.bufs[op.dst].data();
  if (t.lead()) counts_[op.stream].fetch_add((uint64_t)ws.n * (layout_nbytes(E.L) / E.L.rows), std::memory_order_relaxed);
  for (int k = t.tid; k < ws.n; k += t.nth) {
    float* row = dst + (size_t)k * d;
    dequant_row(E.L, E.data, ws.tokens[k], row);
    if (op.scale != 1.f)
      for (int i = 0; i < d; ++i) row[i] *= op.scale;
  }
}

// The rows of a step go through a weight in two groups, so that each row gets exactly what its
// sequence would get alone (the kernels' sums differ in order between the two paths):
//  - rows of sequences with several new tokens (prompts, laid out first: rows [0, n_pre)) take
//    the tile GEMM together, each weight block read once for all of them;
//  - a sequence's single new token (decode; rows [n_pre, n)) takes the decode GEMV, which
//    threads share as gemv_share says. The single rows of a step visit a thread's rows in runs
//    of about kVisitBytes, every row in turn, so the weights come from memory once per step and
//    from cache for the other rows.
constexpr size_t kVisitBytes = 192 << 10;

// Rows of L in a run of about kVisitBytes: a whole number of stripes' rows, at least one stripe's.
static int visit_rows(const TileLayout& L) {
  const size_t stripe_bytes = layout_nbytes(L) / std::max(1, (L.rows + L.tr - 1) / L.tr);
  return L.tr * (int)std::max<size_t>(1, kVisitBytes / std::max<size_t>(1, stripe_bytes));
}

// Where a thread's outputs for rows [r0, r1) of W, m tokens, go: dst itself, or its scratch
// when the op accumulates into dst (the epilogue adds them).
static float* output_rows(bool accumulate, std::vector<float>& scratch, float* dst, int ldd, int m, int r0, int r1,
                          int* ldy) {
  if (!accumulate) {
    *ldy = ldd;
    return dst + r0;
  }
  grow(scratch, (size_t)m * (r1 - r0));
  *ldy = r1 - r0;
  return scratch.data();
}

// While alive, the thread's GEMV kernels may keep the pass activations they laid out for the
// decode rows' prepared activations (acts_stamp, kernels.h): the calls over a thread's runs of
// rows in one op then lay them out once. Made right after the rows are prepared.
struct SameActs {
  SameActs() { set_acts_stamp(new_acts_stamp()); }
  ~SameActs() { set_acts_stamp(0); }
  SameActs(const SameActs&) = delete;
  SameActs& operator=(const SameActs&) = delete;
};

// Rows [r0, r1) of L (r0 on an interleave group) for n tokens through a batched GEMV: y (n, ldy) from row
// r0; x: the tokens' prepared activations, adjacent. The kernel passes over its rows once per
// group of 8 or more tokens (kernels.h): more tokens than that take the rows in runs of about
// kVisitBytes of weights, each run passed over by every group while it is in cache.
static void batched_runs(GemvBatchFn batch, const TileLayout& L, const uint8_t* w, const void* x, int n, int r0,
                         int r1, float* y, int ldy) {
  const int run = n <= kBatchGroupMin ? r1 - r0 : visit_rows(L);
  for (int c0 = r0; c0 < r1; c0 += run) batch(y + (c0 - r0), ldy, x, n, w, L, c0, std::min(r1, c0 + run));
}

// The batched GEMV for L with activation `at` where the engine uses one (int8 activations; the
// kernel exists for the type and this CPU), else nullptr.
GemvBatchFn Engine::batch_kernel(const TileLayout& L, AType at) const {
  return fast_ && at != AType::F32 ? gemv_batch_fn(L.bt(), L.packing(), at, isa_) : nullptr;
}

// y (+ epilogue) for rows [r0, r1) of W of m rows: bias, scale, softcap, then dst (+)= y.
void Engine::epilogue(const Matmul& op, float* y, int ldy, int m, int r0, int r1, float* dst, int ldd) const {
  const float* b = op.bias >= 0 ? vec(op.bias) : nullptr;
  const float cap = op.softcap, scale = op.scale;
  for (int k = 0; k < m; ++k) {
    float* yk = y + (size_t)k * ldy;
    if (b)
      for (int r = r0; r < r1; ++r) yk[r - r0] += b[r];
    if (scale != 1.f)
      for (int r = r0; r < r1; ++r) yk[r - r0] *= scale;
    if (cap > 0)
      for (int r = r0; r < r1; ++r) yk[r - r0] = cap * std::tanh(yk[r - r0] / cap);
    if (op.accumulate) {
      float* dk = dst + (size_t)k * ldd;
      for (int r = r0; r < r1; ++r) dk[r] += yk[r - r0];
    }
  }
}

void Engine::run_op(const Matmul& op, Workspace& ws, Team& t) {
  const int lds = plan_.buffers[op.src].width, ldd = plan_.buffers[op.dst].width;
  const float* src = ws.bufs[op.src].data();
  float* dst = ws.bufs[op.dst].data() + op.dst_col;  // this weight's columns of the output
  if (t.lead()) counts_[op.stream].fetch_add(plan_.tensors[op.weight].nbytes, std::memory_order_relaxed);
  if (op.last_token && !ws.all_logits) {  // one row per sequence, its last: single rows
    const int m = (int)ws.last_row.size(), C = W_[op.weight].L.cols;
    if (m == 1) {
      src += (size_t)ws.last_row[0] * lds;
    } else {
      float* g = t.shared->gather.data();
      for (int i = t.tid; i < m; i += t.nth)
        std::memcpy(g + (size_t)i * lds, src + (size_t)ws.last_row[i] * lds, sizeof(float) * C);
      t.barrier();
      src = g;
    }
    matmul_single(op, t, src, lds, m, dst, ldd);
    return;
  }
  matmul_rows(op, ws, t, src, lds, ws.n_pre, ws.n, dst, ldd);
}

void Engine::matmul_rows(const Matmul& op, Workspace&, Team& t, const float* src, int lds, int n_pre, int n,
                         float* dst, int ldd) {
  if (n_pre) {
    // a type without an int8 GEMM (the K-quants) but with a batched decode kernel: prompt rows
    // as single rows, through that kernel, rather than through the fp32 GEMM
    const TileLayout& L = W_[op.weight].L;
    AType at;
    const bool as_single = fast_ && !has_int8_path(L.bt(), true) && decode_kernel(L, op.two_level, &at) &&
                           batch_kernel(L, at);
    if (as_single) matmul_single(op, t, src, lds, n_pre, dst, ldd);
    else matmul_gemm(op, t, src, lds, n_pre, dst, ldd);
  }
  if (n > n_pre) matmul_single(op, t, src + (size_t)n_pre * lds, lds, n - n_pre, dst + (size_t)n_pre * ldd, ldd);
}

// n >= 2 rows through the tile GEMM (int8 activations where the type has an int8 GEMM).
void Engine::matmul_gemm(const Matmul& op, Team& t, const float* src, int lds, int n, float* dst, int ldd) {
  const Weight W = weight(op.weight, t);
  const TileLayout& L = W.L;
  const bool q8 = fast_ && has_int8_path(L.bt(), true);
  Input in = prepare(t, src, lds, n, L.cols, op.norm, q8, q8 && op.two_level);
  // where decode has a batched kernel that is faster than the GEMM (AMX), prompt rows take it
  // too (shared as gemv_share shares decode rows): each token then gets what it gets as a single row
  const GemvBatchFn batch =
      q8 && gemv_batch_beats_gemm(isa_) ? batch_kernel(L, in.qa.levels == 2 ? AType::Q8x2 : AType::Q8) : nullptr;
  int r0, r1;
  if (batch) gemv_share(L, t.tid, t.nth, &r0, &r1);
  else row_share(L, t.tid, t.nth, &r0, &r1);
  if (r0 >= r1) return;
  int ldy;
  float* y = output_rows(op.accumulate, t.priv->y, dst, ldd, n, r0, r1, &ldy);
  if (batch) batched_runs(batch, L, W.data, in.qa.data, n, r0, r1, y, ldy);
  else if (q8) gemm_q8(L, W.data, r0, r1, in.qa, y, ldy);
  else gemm_f32(L, W.data, r0, r1, in.x, in.ldx, n, y, ldy);
  epilogue(op, y, ldy, n, r0, r1, dst, ldd);
}

// m single rows, each as a one-token step computes it.
void Engine::matmul_single(const Matmul& op, Team& t, const float* src, int lds, int m, float* dst, int ldd) {
  const Weight W = weight(op.weight, t);
  const TileLayout& L = W.L;
  Scratch& s = *t.priv;
  AType at;
  const GemvFn gemv = decode_kernel(L, fast_ && op.two_level, &at);
  // each row's input, normalised and prepared for the kernel (thread-private: no barrier)
  const size_t ab = gemv ? act_bytes(L.bt(), at, L.cols) : (size_t)L.cols * sizeof(float);
  grow(s.xa, (size_t)m * ab);
  for (int k = 0; k < m; ++k) {
    Input in = prepare(t, src + (size_t)k * lds, lds, 1, L.cols, op.norm, false, false);
    if (gemv) prepare_act(L.bt(), at, s.xa.data() + k * ab, in.x, L.cols);
    else std::memcpy(s.xa.data() + k * ab, in.x, ab);
  }
  const SameActs same;
  // rows in units of gemv_share's kind (the fp32 fallback: interleave groups), handed out
  const bool groups = !gemv || L.packing() == Pack::Planes;
  const int stripes = (L.rows + L.tr - 1) / L.tr;
  UnitShare share = t.share(groups ? layout_units(L) : stripes, layout_nbytes(L));
  const GemvBatchFn batch = m > 1 && gemv ? batch_kernel(L, at) : nullptr;
  for (int u0, u1; share.next(&u0, &u1);) {
    const int r0 = groups ? unit_row(L, u0) : std::min(L.rows, u0 * L.tr);
    const int r1 = groups ? unit_row(L, u1) : std::min(L.rows, u1 * L.tr);
    if (r0 >= r1) continue;
    int ldy;
    float* y = output_rows(op.accumulate, s.y, dst, ldd, m, r0, r1, &ldy);
    if (batch) {
      batched_runs(batch, L, W.data, s.xa.data(), m, r0, r1, y, ldy);
    } else if (gemv) {
      const int run = m == 1 ? r1 - r0 : visit_rows(L);
      for (int c0 = r0; c0 < r1; c0 += run) {
        const int c1 = std::min(r1, c0 + run);
        for (int k = 0; k < m; ++k) gemv(y + (size_t)k * ldy + (c0 - r0), s.xa.data() + k * ab, W.data, L, c0, c1);
      }
    } else {  // no decode kernel for this type: the fp32 GEMM, one row at a time
      for (int k = 0; k < m; ++k)
        gemm_f32(L, W.data, r0, r1, (const float*)(s.xa.data() + k * ab), L.cols, 1, y + (size_t)k * ldy, ldy);
    }
    epilogue(op, y, ldy, m, r0, r1, dst, ldd);
  }
}

// gate_up rows come in pairs of pieces: [gate rows p*c .. +cp), [up rows p*c .. +cp), cp <= c.
// Rows as for Matmul: prompt rows through the GEMM; single rows through the decode GEMV when a
// piece pair is one stripe (one row: a GEMV over each run of pieces a thread is handed; several
// without a batched kernel: each piece one GEMV row range, visited by every single row in turn),
// else each through the GEMM alone.
void Engine::run_op(const GateUp& op, Workspace& ws, Team& t) {
  if (t.lead()) counts_[op.stream].fetch_add(plan_.tensors[op.weight].nbytes, std::memory_order_relaxed);
  gate_up_rows(op, t, ws.bufs[op.src].data(), plan_.buffers[op.src].width, ws.n_pre, ws.n, ws.bufs[op.dst].data(),
               plan_.buffers[op.dst].width);
}

void Engine::gate_up_rows(const GateUp& op, Team& t, const float* src, int lds, int n_pre, int n, float* h, int ldh) {
  const Weight W = weight(op.weight, t);
  const TileLayout& L = W.L;
  const int C = L.cols, F = L.rows / 2, c = op.chunk, nth = t.nth, tid = t.tid;
  const int P = (F + c - 1) / c;
  const int p0 = (int)((int64_t)P * tid / nth), p1 = (int)((int64_t)P * (tid + 1) / nth);
  const bool precise = fast_ && op.two_level, q8 = fast_ && has_int8_path(L.bt(), true);
  Scratch& s = *t.priv;
  // rows [k0, k0 + n) prepared as `in`, through the GEMM, piece by piece
  auto gemm_rows = [&](const Input& in, int k0, int nr) {
    grow(s.y, (size_t)nr * 2 * std::min(c, F));
    for (int p = p0; p < p1; ++p) {
      const int cp = std::min(c, F - p * c), r0 = 2 * p * c, r1 = r0 + 2 * cp;
      if (in.qa.data) gemm_q8(L, W.data, r0, r1, in.qa, s.y.data(), 2 * cp);
      else gemm_f32(L, W.data, r0, r1, in.x, in.ldx, nr, s.y.data(), 2 * cp);
      for (int k = 0; k < nr; ++k) {
        const float* g = s.y.data() + (size_t)k * 2 * cp;
        act_mul(op.act, g, g + cp, h + (size_t)(k0 + k) * ldh + (size_t)p * c, cp);
      }
    }
  };
  // rows [k0, k0 + n), prepared for `at` at x, through the batched GEMV when a piece pair is one
  // stripe and the kernel exists: the thread's pieces in one call, or for more rows than one
  // pass takes in runs of about kVisitBytes, all rows over each run (as batched_runs). False
  // where it does not apply.
  auto batched_rows = [&](AType at, const void* x, int k0, int nr, int q0, int q1) {
    const GemvBatchFn batch = 2 * c == L.tr ? batch_kernel(L, at) : nullptr;
    if (!batch) return false;
    const int per_run = nr <= kBatchGroupMin ? std::max(1, q1 - q0) : visit_rows(L) / L.tr;  // pieces are stripes here
    for (int pa = q0; pa < q1; pa += per_run) {
      const int pb = std::min(q1, pa + per_run), ra = 2 * pa * c, rb = std::min(2 * pb * c, L.rows), ly = rb - ra;
      grow(s.y, (size_t)nr * ly);
      batch(s.y.data(), ly, x, nr, W.data, L, ra, rb);
      for (int p = pa; p < pb; ++p) {
        const int cp = std::min(c, F - p * c);
        for (int k = 0; k < nr; ++k) {
          const float* g = s.y.data() + (size_t)k * ly + (2 * p * c - ra);
          act_mul(op.act, g, g + cp, h + (size_t)(k0 + k) * ldh + (size_t)p * c, cp);
        }
      }
    }
    return true;
  };
  AType at;
  const GemvFn gemv = 2 * c == L.tr ? decode_kernel(L, precise, &at) : nullptr;
  // prompt rows of a type without an int8 GEMM (the K-quants) but with a batched decode kernel
  // run as single rows through that kernel (as Matmul's), rather than through the fp32 GEMM
  const bool pre_single = n_pre && fast_ && !q8 && gemv && batch_kernel(L, at);
  if (n_pre && !pre_single) {
    const Input in = prepare(t, src, lds, n_pre, C, op.norm, q8, q8 && precise);
    if (!q8 || !gemv_batch_beats_gemm(isa_) ||
        !batched_rows(in.qa.levels == 2 ? AType::Q8x2 : AType::Q8, in.qa.data, 0, n_pre, p0, p1))
      gemm_rows(in, 0, n_pre);
  }
  const int k0 = pre_single ? 0 : n_pre, m = n - k0;  // the single rows
  if (!m) return;
  if (!gemv) {
    for (int k = k0; k < n; ++k)
      gemm_rows(prepare(t, src + (size_t)k * lds, lds, 1, C, op.norm, q8, q8 && precise), k, 1);
    return;
  }
  const size_t ab = act_bytes(L.bt(), at, C);
  grow(s.xa, (size_t)m * ab);
  for (int k = 0; k < m; ++k) {
    Input in = prepare(t, src + (size_t)(k0 + k) * lds, lds, 1, C, op.norm, false, false);
    prepare_act(L.bt(), at, s.xa.data() + k * ab, in.x, C);
  }
  const SameActs same;
  // the single rows' pieces handed out among the team (UnitShare)
  UnitShare share = t.share(P, layout_nbytes(L));
  grow(s.y, (size_t)2 * std::min(c, F));
  for (int q0, q1; share.next(&q0, &q1);) {
    if (m > 1 && batched_rows(at, s.xa.data(), k0, m, q0, q1)) continue;
    if (m == 1) {  // one row: one GEMV over the run of pieces (it lays out its activations once)
      const int ra = 2 * q0 * c, rb = std::min(2 * q1 * c, L.rows);
      grow(s.y, (size_t)(rb - ra));
      gemv(s.y.data(), s.xa.data(), W.data, L, ra, rb);
      for (int p = q0; p < q1; ++p) {
        const int cp = std::min(c, F - p * c);
        const float* g = s.y.data() + (2 * p * c - ra);
        act_mul(op.act, g, g + cp, h + (size_t)k0 * ldh + (size_t)p * c, cp);
      }
      continue;
    }
    for (int p = q0; p < q1; ++p) {
      const int cp = std::min(c, F - p * c), r0 = 2 * p * c, r1 = r0 + 2 * cp;
      for (int k = 0; k < m; ++k) {
        gemv(s.y.data(), s.xa.data() + k * ab, W.data, L, r0, r1);
        act_mul(op.act, s.y.data(), s.y.data() + cp, h + (size_t)(k0 + k) * ldh + (size_t)p * c, cp);
      }
    }
  }
}

// Gate and up computed by two matmuls into one (n, 2F) buffer; threads split the columns.
void Engine::run_op(const ActMul& op, Workspace& ws, Team& t) {
  const int F = plan_.buffers[op.dst].width, nth = t.nth, tid = t.tid;
  const int j0 = (int)((int64_t)F * tid / nth), j1 = (int)((int64_t)F * (tid + 1) / nth);
  const float* src = ws.bufs[op.src].data();
  float* dst = ws.bufs[op.dst].data();
  for (int k = 0; k < ws.n; ++k) {
    const float* g = src + (size_t)k * 2 * F;
    act_mul(op.act, g + j0, g + F + j0, dst + (size_t)k * F + j0, j1 - j0);
  }
}

// q8_0 rows of keys or values widened at a time (run_op(Attention)'s KvSpan): 8 KB of floats at
// hd 64, in L1 for the float loops.
constexpr int kQ8Piece = 32;

// Each row attends within its own sequence: its state's cache, positions up to its own.
void Engine::run_op(const Attention& op, Workspace& ws, Team& t) {
  const int hd = op.head_dim, nh = op.n_head, nkv = op.n_kv_head, n = ws.n;
  const int qdim = nh * hd, kvdim = nkv * hd, ld = qdim + 2 * kvdim, nth = t.nth, tid = t.tid;
  float* qkv = ws.bufs[op.src].data();
  // per-head norms; a norm over the whole q (or k) runs first, row by row (OLMoE)
  const bool q_all = op.q_norm >= 0 && W_[op.q_norm].L.cols * W_[op.q_norm].L.rows != hd;
  const bool k_all = op.k_norm >= 0 && W_[op.k_norm].L.cols * W_[op.k_norm].L.rows != hd;
  const float* qn = op.q_norm >= 0 && !q_all ? vec(op.q_norm) : nullptr;
  const float* kn = op.k_norm >= 0 && !k_all ? vec(op.k_norm) : nullptr;
  const RopeTable& table = *rope_table(op.rope_theta, hd);  // built for every Attention op
  if (q_all || k_all) {
    Scratch& s = *t.priv;
    grow(s.xn, (size_t)std::max(qdim, kvdim));
    for (int k = tid; k < n; k += nth) {
      float* row = qkv + (size_t)k * ld;
      if (q_all) {
        rmsnorm(row, vec(op.q_norm), qdim, s.xn.data());
        std::memcpy(row, s.xn.data(), sizeof(float) * qdim);
      }
      if (k_all) {
        rmsnorm(row + qdim, vec(op.k_norm), kvdim, s.xn.data());
        std::memcpy(row + qdim, s.xn.data(), sizeof(float) * kvdim);
      }
    }
    t.barrier();
  }
  float tmp[1024];
  // one head's keys or values (hd floats) into its cache row, as the state stores them; q8_0
  // keys in rotary pairs (KvSpan)
  auto store_kv = [&](KvType type, const float* x, uint8_t* row, bool keys) {
    switch (type) {
      case KvType::F32: std::memcpy(row, x, sizeof(float) * hd); break;
      case KvType::F16: to_half(x, (uint16_t*)row, hd); break;
      case KvType::Q8_0: {
        float paired[1024];  // hd <= 1024, as tmp
        if (keys) {
          for (int i = 0; i < hd / 2; ++i) paired[2 * i] = x[i], paired[2 * i + 1] = x[i + hd / 2];
          x = paired;
        }
        to_q8_0(x, row, hd);
        break;
      }
    }
  };
  auto norm_rope = [&](float* x, const float* nw, int p) {
    if (nw) {
      rmsnorm(x, nw, hd, tmp);
      std::memcpy(x, tmp, sizeof(float) * hd);
    }
    rope(x, table, p);
  };
  // Phase A: norms + rope of q and k heads, k and v into the row's cache.
  const int items = n * (nh + nkv);
  for (int it = (int)((int64_t)items * tid / nth), e = (int)((int64_t)items * (tid + 1) / nth); it < e; ++it) {
    const int k = it / (nh + nkv), h = it % (nh + nkv), p = ws.row_pos[k];
    float* row = qkv + (size_t)k * ld;
    if (h < nh) {
      norm_rope(row + h * hd, qn, p);
    } else {
      const int j = h - nh;
      State& st = *ws.states[ws.row_seq[k]];
      float* kh = row + qdim + j * hd;
      norm_rope(kh, kn, p);
      const float* vh = row + qdim + kvdim + j * hd;
      const size_t at = (size_t)j * st.n_ctx_ + p;  // head-major (State)
      store_kv(st.kt_, kh, st.k_[op.kv].get() + at * st.k_row(op.kv), true);
      store_kv(st.vt_, vh, st.v_[op.kv].get() + at * st.v_row(op.kv), false);
    }
  }
  // Phase B: softmax(q K^T * scale) V per (row, query head), over spans of kSpan keys from the
  // window's first: per span and query head its largest score m_c, l_c = sum of exp(s - m_c) and
  // o_c = sum of exp(s - m_c) V; then out = sum_c w_c o_c / sum_c w_c l_c, w_c = exp(m_c - max m),
  // spans in order. A span is met by the `group` query heads of its KV head together,
  // kHeadsAtOnce at a time (dot_rows_n / mix_rows_n: each head gets what it gets alone), so its
  // keys and values come from memory once.
  // Work: with many (row, KV head) pairs (batches) a thread takes whole pairs, their spans in
  // turn, and merges at once; a step with prompt rows goes in blocks of rows per KV head
  // (prompt_block, below); with few pairs (a decode step of a sequence or two) the threads take
  // spans, their partial results in the team's scratch, merged after a barrier. The arithmetic is
  // the same every way: a row's result does not depend on its step, its block or its thread.
  // Spans, and the pairs of a step of decode rows, go out in runs of consecutive items
  // (UnitShare, once the op reads kAttnShareBytes of keys and values): a thread's spans of a KV
  // head are then one stream through its cache rather than every other 16 KB of it, and a thread
  // the host slows takes fewer of the last. Against spans dealt round the threads (2 threads,
  // steps alternated in one process, 2026-12-06, Zen 3 VM): SmolLM2 one sequence at ~1500
  // positions 3.8% faster a step, two at ~1000 3.9%, Qwen2.5-0.5B one at ~1500 1.7%; pairs of 8
  // sequences at ~1000: SmolLM2 3.4%, Qwen and Gemma 3 even; short contexts even.
  const float scale = op.scale > 0 ? op.scale : 1.f / std::sqrt((float)hd);
  const int group = nh / nkv, part = group * (hd + 2);  // a span's partials: per head m, l, o
  constexpr int kHeadsAtOnce = 8, kSpan = 128, kPromptRows = 8;
  constexpr size_t kPromptPartBytes = 2 << 20;
  // row k's first key (its window's) and its keys, first .. its position
  auto first_key = [&](int k) { return op.window > 0 ? std::max(0, ws.row_pos[k] - op.window + 1) : 0; };
  auto keys_of = [&](int k) { return ws.row_pos[k] + 1 - first_key(k); };
  auto spans_of = [&](int k) { return (keys_of(k) + kSpan - 1) / kSpan; };
  Scratch& s = *t.priv;
  grow(s.scores, (size_t)kHeadsAtOnce * kSpan);
  float* out = ws.bufs[op.dst].data();
  // one query head's span: its scores sr (len) scaled and exponentiated, m and l into pr, the
  // head's o (pr + 2, hd floats) zeroed for the mix to add into
  auto open_partial = [&](float* sr, int len, float* pr) {
    for (int i = 0; i < len; ++i) sr[i] *= scale;
    pr[1] = exp_max(sr, len, &pr[0]);
    std::memset(pr + 2, 0, sizeof(float) * hd);
  };
  // The keys (values) of positions [i0, i0 + len) of KV head j of a state: their cache rows, and
  // the span's dot (mix) over them as the state stores them. A q8_0 span is widened to floats
  // a piece of rows at a time (into the thread's scratch, where the float loops find them in L1;
  // each key's score is its own and the values add in order, so the pieces change no number);
  // halves widen as the kernels load them. q8_0 keys are stored with each rotary
  // pair (i, i + hd/2) side by side, so that a block of 32 holds 16 neighbouring frequencies:
  // the few large channels of a head sit at its low frequencies, in both halves, and in the
  // halves' own order they set the scale of every block (Qwen2.5-Coder-0.5B, 256 positions of
  // text, keys alone in q8_0: top-1 90.2% of the fp32 reference in the halves' order, 98.0% in
  // pairs, llama.cpp's q8_0 cache 95.7%). The keys stay in pairs as they widen, and the queries
  // meet them in pairs too (a copy of their hd floats each).
  struct KvSpan {
    KvType type;
    const uint8_t* at;  // the first position's row
    size_t row;         // bytes a row
    int len, hd;
    // heads groups of nq queries: group h's query i at q + h * qh + i * ldq, its scores at
    // out + h * oh + i * ldo (a span's query heads, or a block's rows of each query head); a
    // q8_0 piece is widened once for all of them
    void dot(const float* q, size_t ldq, int nq, int heads, size_t qh, Scratch& s, float* out, size_t ldo,
             size_t oh) const {
      if (type != KvType::Q8_0) {
        for (int h = 0; h < heads; ++h) {
          const float* qq = q + h * qh;
          if (type == KvType::F16) dot_rows_n_h(qq, ldq, nq, (const uint16_t*)at, hd, len, hd, out + h * oh, ldo);
          else dot_rows_n(qq, ldq, nq, (const float*)at, hd, len, hd, out + h * oh, ldo);
        }
        return;
      }
      const int nqh = nq * heads;
      grow(s.kv_paired, (size_t)nqh * hd);
      float* qp = s.kv_paired.data();  // (heads x nq, hd), each query in rotary pairs
      for (int h = 0; h < heads; ++h)
        for (int m = 0; m < nq; ++m) {
          const float* x = q + h * qh + m * ldq;
          float* y = qp + ((size_t)h * nq + m) * hd;
          for (int i = 0; i < hd / 2; ++i) y[2 * i] = x[i], y[2 * i + 1] = x[i + hd / 2];
        }
      grow(s.kv_rows, (size_t)kQ8Piece * hd);
      for (int r = 0; r < len; r += kQ8Piece) {  // each key's score is its own: pieces change nothing
        const int n = std::min(kQ8Piece, len - r);
        from_q8(at + r * row, n, hd, s.kv_rows.data());
        for (int h = 0; h < heads; ++h)
          dot_rows_n(qp + (size_t)h * nq * hd, hd, nq, s.kv_rows.data(), hd, n, hd, out + h * oh + r, ldo);
      }
    }
    // the same for the probabilities: group h's p at p + h * ph + i * ldp, its sums at
    // out + h * oh + i * ldo
    void mix(const float* p, size_t ldp, int nq, int heads, size_t ph, Scratch& s, float* out, size_t ldo,
             size_t oh) const {
      if (type != KvType::Q8_0) {
        for (int h = 0; h < heads; ++h) {
          const float* pp = p + h * ph;
          if (type == KvType::F16) mix_rows_n_h(pp, ldp, nq, (const uint16_t*)at, hd, len, hd, out + h * oh, ldo);
          else mix_rows_n(pp, ldp, nq, (const float*)at, hd, len, hd, out + h * oh, ldo);
        }
        return;
      }
      grow(s.kv_rows, (size_t)kQ8Piece * hd);
      for (int r = 0; r < len; r += kQ8Piece) {  // the rows added in order, as in one pass
        const int n = std::min(kQ8Piece, len - r);
        from_q8(at + r * row, n, hd, s.kv_rows.data());
        for (int h = 0; h < heads; ++h) mix_rows_n(p + h * ph + r, ldp, nq, s.kv_rows.data(), hd, n, hd, out + h * oh, ldo);
      }
    }
  };
  auto kv_span = [&](const State& st, int j, int i0, int len, bool keys) {
    const size_t row = keys ? st.k_row(op.kv) : st.v_row(op.kv);
    const uint8_t* base = (keys ? st.k_ : st.v_)[op.kv].get();
    return KvSpan{keys ? st.kt_ : st.vt_, base + ((size_t)j * st.n_ctx_ + i0) * row, row, len, hd};  // head-major
  };
  // span c of row k's KV head j -> P (part floats)
  auto span = [&](int k, int j, int c, float* P) {
    const int p = ws.row_pos[k], i0 = first_key(k) + c * kSpan;
    const int len = std::min(kSpan, p + 1 - i0);
    const State& st = *ws.states[ws.row_seq[k]];
    const KvSpan K = kv_span(st, j, i0, len, true), V = kv_span(st, j, i0, len, false);
    float* sc = s.scores.data();
    {  // the span's first rows of keys and values on their way; the kernels prefetch ahead from there
      const int rows = std::min(len, kAttnPrefetchRows);
      for (size_t b = 0; b < K.row * rows; b += 64) __builtin_prefetch(K.at + b);
      for (size_t b = 0; b < V.row * rows; b += 64) __builtin_prefetch(V.at + b);
    }
    for (int m0 = 0; m0 < group; m0 += kHeadsAtOnce) {
      const int nq = std::min(kHeadsAtOnce, group - m0);
      const float* q = qkv + (size_t)k * ld + (size_t)(j * group + m0) * hd;
      K.dot(q, hd, nq, 1, 0, s, sc, kSpan, 0);
      float* Pm = P + (size_t)m0 * (hd + 2);
      for (int m = 0; m < nq; ++m) open_partial(sc + (size_t)m * kSpan, len, Pm + (size_t)m * (hd + 2));
      V.mix(sc, kSpan, nq, 1, 0, s, Pm + 2, hd + 2, 0);
    }
  };
  // query head h of row k from its KV head's ns spans' partials P
  auto merge = [&](int k, int h, const float* P, int ns) {
    const int m = h % group;
    float M = -INFINITY, L = 0.f;
    for (int c = 0; c < ns; ++c) M = std::max(M, P[(size_t)c * part + (size_t)m * (hd + 2)]);
    float* o = out + (size_t)k * qdim + (size_t)h * hd;
    for (int c = 0; c < ns; ++c) {
      const float* pc = P + (size_t)c * part + (size_t)m * (hd + 2);
      const float w = std::exp(pc[0] - M);
      L += w * pc[1];
      for (int i = 0; i < hd; ++i) o[i] = (c ? o[i] : 0.f) + w * pc[2 + i];
    }
    const float inv = 1.f / L;
    for (int i = 0; i < hd; ++i) o[i] *= inv;
  };
  // the keys and values the op reads: from kAttnShareBytes on, its work is handed out (UnitShare)
  auto kv_bytes = [&] {
    size_t b = 0;
    for (int k = 0; k < n; ++k) {
      const State& st = *ws.states[ws.row_seq[k]];
      b += (size_t)nkv * keys_of(k) * (st.k_row(op.kv) + st.v_row(op.kv));
    }
    return b;
  };
  // A step with prompt rows: blocks of consecutive rows, per KV head, span by span, so that a
  // span's keys and values serve the block's rows from cache rather than each row reading the
  // whole stream of its KV head again. Consecutive rows of one sequence that read the same keys in
  // span c (a prompt's rows without a window, in all but their last span) meet it together: per
  // query head one dot_rows_n / mix_rows_n across the rows, which gives each query what it gets
  // alone (ops.h), so every row's partials, and its result, are span()'s bit for bit. Against a
  // row at a time (2 threads, 2048-token prompts, alternated in one process, 2026-12-06, Zen 3 VM):
  // SmolLM2's attention 12% less time (its prefill 4%; 4096 tokens: 13%, 6%), Qwen2.5-0.5B's 4.5%
  // and Gemma 3's 6% (their prefills 0.5-1%).
  auto prompt_block = [&](int k0, int rows, int j) {
    const int k1 = std::min(n, k0 + rows);
    int ns_max = 0;
    for (int k = k0; k < k1; ++k) ns_max = std::max(ns_max, spans_of(k));
    const size_t row_part = (size_t)ns_max * part;  // row k's partials of span c: P + (k - k0) * row_part + c * part
    grow(s.attn_part, (size_t)(k1 - k0) * row_part);
    grow(s.scores, (size_t)group * kPromptRows * kSpan);
    float *P = s.attn_part.data(), *sc = s.scores.data();
    // span c of row k: its first key and length
    auto span_keys = [&](int k, int c) {
      const int i0 = first_key(k) + c * kSpan;
      return std::pair<int, int>(i0, std::min(kSpan, ws.row_pos[k] + 1 - i0));
    };
    for (int c = 0; c < ns_max; ++c)
      for (int a = k0, b; a < k1; a = b) {
        b = a + 1;
        if (c >= spans_of(a)) continue;
        const auto [i0, len] = span_keys(a, c);
        while (b < k1 && ws.row_seq[b] == ws.row_seq[a] && c < spans_of(b) && span_keys(b, c) == span_keys(a, c)) ++b;
        float* Pa = P + (size_t)(a - k0) * row_part + (size_t)c * part;
        if (b - a == 1) {
          span(a, j, c, Pa);
          continue;
        }
        const int nr = b - a;  // rows [a, b): span c of one state
        const State& st = *ws.states[ws.row_seq[a]];
        const KvSpan K = kv_span(st, j, i0, len, true), V = kv_span(st, j, i0, len, false);
        // query head m of rows a.. at q + m * hd; their scores at sc + m * nr * kSpan, a row each;
        // head m's partials of row a at Pa + m * (hd + 2), row a + r's at r * row_part
        const float* q = qkv + (size_t)a * ld + (size_t)j * group * hd;
        const size_t per_head = (size_t)nr * kSpan;
        K.dot(q, ld, nr, group, hd, s, sc, kSpan, per_head);
        for (int m = 0; m < group; ++m)
          for (int r = 0; r < nr; ++r)
            open_partial(sc + m * per_head + (size_t)r * kSpan, len, Pa + (size_t)m * (hd + 2) + (size_t)r * row_part);
        V.mix(sc, kSpan, nr, group, per_head, s, Pa + 2, row_part, hd + 2);
      }
    for (int k = k0; k < k1; ++k)
      for (int m = 0; m < group; ++m) merge(k, j * group + m, P + (size_t)(k - k0) * row_part, spans_of(k));
  };
  if (n * nkv >= 4 * nth) {  // whole (row, KV head) pairs
    t.barrier();
    auto pair = [&](int u) {
      const int k = u / nkv, j = u % nkv, ns = spans_of(k);
      grow(s.attn_part, (size_t)ns * part);
      for (int c = 0; c < ns; ++c) span(k, j, c, s.attn_part.data() + (size_t)c * part);
      for (int m = 0; m < group; ++m) merge(k, j * group + m, s.attn_part.data(), ns);
    };
    if (ws.n_pre > 0) {  // a prompt's rows grow in length: round the threads, so each gets long and short
      // blocks of up to kPromptRows rows, while that leaves 4 (block, KV head) units a thread and
      // a block's partials take at most kPromptPartBytes (long contexts: fewer rows a block)
      int spans = 1;
      for (int k = 0; k < n; ++k) spans = std::max(spans, spans_of(k));
      const int by_bytes = (int)(kPromptPartBytes / (sizeof(float) * spans * part));
      const int rows = std::clamp(std::min(n * nkv / (4 * nth), by_bytes), 1, kPromptRows);
      const int blocks = (n + rows - 1) / rows;
      for (int u = tid; u < blocks * nkv; u += nth) prompt_block(u / nkv * rows, rows, u % nkv);
      return;
    }
    UnitShare share = t.share(n * nkv, kv_bytes(), kAttnShareBytes);
    for (int u0, u1; share.next(&u0, &u1);)
      for (int u = u0; u < u1; ++u) pair(u);
    return;
  }
  // spans among the threads: row k's items start at first[k], KV head by KV head
  grow(s.span_first, (size_t)n + 1);
  int* first = s.span_first.data();
  first[0] = 0;
  for (int k = 0; k < n; ++k) first[k + 1] = first[k] + nkv * spans_of(k);
  if (t.lead()) grow(t.shared->attn_part, (size_t)first[n] * part);
  t.barrier();
  float* P = t.shared->attn_part.data();
  UnitShare share = t.share(first[n], kv_bytes(), kAttnShareBytes);
  for (int u0, u1; share.next(&u0, &u1);)
    for (int it = u0, k = 0; it < u1; ++it) {
      while (it >= first[k + 1]) ++k;
      const int ns = spans_of(k), j = (it - first[k]) / ns, c = (it - first[k]) % ns;
      span(k, j, c, P + (size_t)it * part);
    }
  t.barrier();
  for (int u = tid; u < n * nh; u += nth) {
    const int k = u / nh, h = u % nh, j = h / group, ns = spans_of(k);
    merge(k, h, P + (size_t)(first[k] + j * ns) * part, ns);
  }
}

// dst (+)= scale * gain * rmsnorm?(src), row by row: residual adds, copies, post norms.
void Engine::run_op(const Add& op, Workspace& ws, Team& t) {
  const int w = plan_.buffers[op.src].width;
  const float* src = ws.bufs[op.src].data();
  float* dst = ws.bufs[op.dst].data();
  const float* gain = op.gain >= 0 ? vec(op.gain) : nullptr;
  const float* gate = op.gate >= 0 ? ws.bufs[op.gate].data() : nullptr;
  for (int k = t.tid; k < ws.n; k += t.nth) {
    const float* x = prepare(t, src + (size_t)k * w, w, 1, w, op.norm, false, false).x;
    float* d = dst + (size_t)k * w;
    const float scale = gate ? op.scale / (1.f + std::exp(-gate[k])) : op.scale;
    if (!gain && scale == 1.f) {
      if (op.accumulate)
        for (int i = 0; i < w; ++i) d[i] += x[i];
      else if (d != x)
        std::memmove(d, x, sizeof(float) * w);
      continue;
    }
    for (int i = 0; i < w; ++i) {
      const float y = (gain ? x[i] * gain[i] : x[i]) * scale;
      d[i] = op.accumulate ? d[i] + y : y;
    }
  }
}

// p = softmax(R x) per row (fp32, R dequantized once), the top_k largest by a partial selection
// (ties: the lower id), their gates, renormalised over the top_k when asked.
void Engine::run_op(const Router& op, Workspace& ws, Team& t) {
  const TileLayout& L = W_[op.weight].L;
  const int E = L.rows, C = L.cols, K = op.top_k, lds = plan_.buffers[op.src].width;
  const float* R = vec(op.weight);
  const float* src = ws.bufs[op.src].data();
  float* dst = ws.bufs[op.dst].data();
  if (t.lead()) counts_[op.stream].fetch_add(plan_.tensors[op.weight].nbytes, std::memory_order_relaxed);
  Scratch& s = *t.priv;
  grow(s.scores, (size_t)E);
  for (int k = t.tid; k < ws.n; k += t.nth) {
    const float* x = prepare(t, src + (size_t)k * lds, lds, 1, C, op.norm, false, false).x;
    float* p = s.scores.data();
    dot_rows(x, R, (size_t)C, E, C, p);  // (E,) = R x
    softmax(p, 1, E);
    float* ids = dst + (size_t)k * 2 * K;
    float* gates = ids + K;
    float sum = 0.f;
    for (int j = 0; j < K; ++j) {  // the j-th largest: greater than every later pick
      int best = -1;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int i = 0; i < j; ++i) taken |= (int)ids[i] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      ids[j] = (float)best;
      gates[j] = p[best];
      sum += p[best];
    }
    if (op.renorm)
      for (int j = 0; j < K; ++j) gates[j] /= sum;
  }
  if (tier_ && opt_.experts == ExpertPolicy::Staged) stage_reads(op, ws, t);
}

// Each row's top_k experts (from the Router's dst), grouped by expert: every chosen expert's
// weights are read once for all the rows that chose it, prompt rows through the GEMM and single
// rows through the decode GEMV as for a Matmul (so a row's result does not depend on the others
// in its step). Phases, the team meeting between them: the assignments (row, expert) sorted by
// expert, then row; each assignment's input row (normalised); gate/up of each expert over its
// rows; down of each expert; per row, the gated sum over its experts in ascending id.
// With all_experts every expert takes every row (and is read), and only the chosen ones count.
void Engine::run_op(const Experts& op, Workspace& ws, Team& t) {
  const std::vector<const ExpertRef*>& X = experts_of_[expert_slot_[t.op]];
  const int n = ws.n, E = op.n_expert, K = plan_.buffers[op.route].width / 2, C = plan_.buffers[op.src].width;
  const int F = W_[X[0]->down].L.cols, S = opt_.all_experts ? E : K;  // assignments per row
  Scratch& sh = *t.shared;
  const float* route = ws.bufs[op.route].data();
  const float* src = ws.bufs[op.src].data();
  if (t.lead()) {
    sh.ex_start.assign(E + 2, 0);
    sh.ex_row.resize((size_t)n * S);
    sh.ex_of.resize((size_t)n * K);
    sh.ex_gate.resize((size_t)n * K);
    int32_t* count = sh.ex_start.data() + 2;  // count[e] of expert e, then prefix sums in place
    for (int r = 0; r < n; ++r) {
      const float* ids = route + (size_t)r * 2 * K;
      for (int j = 0; j < K; ++j) {
        const float v = ids[j];
        bool ok = v >= 0.f && v < (float)E && v == (float)(int)v;
        for (int i = 0; ok && i < j; ++i) ok = ids[i] != v;
        if (!ok) {
          std::lock_guard<std::mutex> lk(mu_);
          ws.error = "experts of layer " + std::to_string(op.layer) + ": routed expert id " + std::to_string(v) +
                     " is not a distinct expert of 0.." + std::to_string(E - 1);
          ws.failed = true;
          break;
        }
        if (!opt_.all_experts) ++count[(int)v];
      }
    }
    if (opt_.all_experts)
      for (int e = 0; e < E; ++e) count[e] = n;
    if (!ws.failed) {
      // fill[e] = ex_start[e + 1] walks expert e's assignments; afterwards ex_start[e + 1] is its end
      for (int e = 0; e < E; ++e) sh.ex_start[e + 2] += sh.ex_start[e + 1];
      int32_t* fill = sh.ex_start.data() + 1;
      uint64_t bytes = 0;
      for (int e = 0; e < E; ++e)
        if (sh.ex_start[e + 2] > sh.ex_start[e + 1])
          bytes += plan_.tensors[X[e]->gate_up].nbytes + plan_.tensors[X[e]->down].nbytes;
      counts_[op.stream].fetch_add(bytes, std::memory_order_relaxed);
      for (int r = 0; r < n; ++r) {
        const float* ids = route + (size_t)r * 2 * K;
        int order[64], nk = 0;  // the row's slots by ascending expert id (K <= 64 is checked at load)
        for (int j = 0; j < K; ++j) {
          int q = nk++;
          for (; q > 0 && ids[order[q - 1]] > ids[j]; --q) order[q] = order[q - 1];
          order[q] = j;
        }
        int q = 0;
        for (int e = 0; e < E; ++e) {
          const bool chosen = q < K && (int)ids[order[q]] == e;
          if (!chosen && !opt_.all_experts) continue;
          const int a = fill[e]++;
          sh.ex_row[a] = r;
          if (chosen) {
            sh.ex_of[(size_t)r * K + q] = a;
            sh.ex_gate[(size_t)r * K + q] = ids[K + order[q]];
            ++q;
          }
          if (!opt_.all_experts && q == K) break;
        }
      }
    }
  }
  t.barrier();
  if (ws.failed) return;
  const int32_t* start = sh.ex_start.data();  // expert e: assignments [start[e], start[e + 1])
  const int M = start[E];
  for (int a = t.tid; a < M; a += t.nth) {  // each assignment's input row
    const float* x = src + (size_t)sh.ex_row[a] * C;
    float* in = sh.ex_in.data() + (size_t)a * C;
    if (op.norm >= 0) rmsnorm(x, vec(op.norm), C, in);
    else std::memcpy(in, x, sizeof(float) * C);
  }
  t.barrier();
  // prompt rows (rows < n_pre) come first among an expert's rows
  auto prompt_rows = [&](int e) {
    int k = start[e];
    while (k < start[e + 1] && sh.ex_row[k] < ws.n_pre) ++k;
    return k - start[e];
  };
  auto gate_up = [&](int e) {
    GateUp g;
    g.weight = X[e]->gate_up;
    g.chunk = X[e]->chunk;
    g.act = op.act;
    g.two_level = op.two_level;
    gate_up_rows(g, t, sh.ex_in.data() + (size_t)start[e] * C, C, prompt_rows(e), start[e + 1] - start[e],
                 sh.ex_h.data() + (size_t)start[e] * F, F);
  };
  auto down = [&](int e) {
    Matmul d;
    d.weight = X[e]->down;
    d.two_level = op.two_level;
    matmul_rows(d, ws, t, sh.ex_h.data() + (size_t)start[e] * F, F, prompt_rows(e), start[e + 1] - start[e],
                sh.ex_out.data() + (size_t)start[e] * C, C);
  };
  if (tier_) {
    experts_from_tier(op, ws, t, gate_up, down);
    if (ws.failed) return;
  } else {
    for (int e = 0; e < E; ++e)
      if (start[e + 1] > start[e]) gate_up(e);
    t.barrier();
    for (int e = 0; e < E; ++e)
      if (start[e + 1] > start[e]) down(e);
    t.barrier();
  }
  float* dst = ws.bufs[op.dst].data();
  Scratch& s = *t.priv;
  grow(s.xn, (size_t)C);
  for (int r = t.tid; r < n; r += t.nth) {
    float* acc = s.xn.data();
    std::fill(acc, acc + C, 0.f);
    for (int q = 0; q < K; ++q) {
      const float g = sh.ex_gate[(size_t)r * K + q];
      const float* y = sh.ex_out.data() + (size_t)sh.ex_of[(size_t)r * K + q] * C;
      for (int c = 0; c < C; ++c) acc[c] += g * y[c];
    }
    float* d = dst + (size_t)r * C;
    for (int c = 0; c < C; ++c) d[c] = op.accumulate ? d[c] + op.scale * acc[c] : op.scale * acc[c];
  }
}

// ---------------------------------------------------------------- expert tier
Engine::Weight Engine::weight(int id, const Team& t) const {
  if (t.ex && (id == t.ex->gate_up || id == t.ex->down))
    return {t.ex_data + (plan_.tensors[id].offset - t.ex->offset), W_[id].L};
  return W_[id];
}

int Engine::tier_key(const ExpertRef* e) const { return (int)(e - plan_.experts.data()); }

// The staged policy's reads, at the router (its lead, once every row is routed): the chosen
// experts pinned in the tier (at most quota_ of them; the Experts op requests the rest as it
// goes), first come first; then, for a decode step, the prediction: the next router applied to
// this router's input, its top_k read ahead unpinned. A prediction made here for this layer is
// scored against the choice.
void Engine::stage_reads(const Router& op, Workspace& ws, Team& t) {
  const int slot = routes_slot_[t.op];
  t.barrier();  // every row routed
  if (!t.lead() || slot < 0) return;
  const std::vector<const ExpertRef*>& X = experts_of_[slot];
  const int E = (int)X.size(), K = op.top_k;
  const float* route = ws.bufs[op.dst].data();
  std::vector<int>& pin = ws.pinned[slot];
  if (pin.size() != (size_t)E) pin.assign(E, -1);
  int held = 0;
  for (int r = 0; r < ws.n && held < quota_; ++r)
    for (int j = 0; j < K && held < quota_; ++j) {
      const int e = (int)route[(size_t)r * 2 * K + j];
      if (e < 0 || e >= E || pin[e] >= 0) continue;
      pin[e] = tier_->request(tier_key(X[e]));
      ++held;
    }
  std::vector<int>& guess = ws.predicted[slot];
  if (ws.n == 1 && !guess.empty()) {
    predicted_.fetch_add(K, std::memory_order_relaxed);
    int right = 0;
    for (int j = 0; j < K; ++j)
      right += std::count(guess.begin(), guess.end(), (int)route[j]) > 0;
    predicted_right_.fetch_add(right, std::memory_order_relaxed);
  }
  guess.clear();
  const int nr = next_router_[t.op], ns = nr >= 0 ? routes_slot_[nr] : -1;
  if (!opt_.predict || ws.n != 1 || ns < 0) return;
  const Router& next = std::get<Router>(plan_.ops[nr]);
  const TileLayout& L = W_[next.weight].L;
  const int C = L.cols;
  if (C != plan_.buffers[op.src].width) return;
  Scratch& s = *t.priv;
  grow(s.scores, (size_t)L.rows);
  grow(s.xn, (size_t)C);
  const float* x = ws.bufs[op.src].data();
  if (next.norm >= 0) {
    rmsnorm(x, vec(next.norm), C, s.xn.data());
    x = s.xn.data();
  }
  float* p = s.scores.data();
  dot_rows(x, vec(next.weight), (size_t)C, L.rows, C, p);
  std::vector<int>& g = ws.predicted[ns];
  for (int j = 0; j < next.top_k; ++j) {  // top_k of the scores (softmax keeps their order)
    int best = -1;
    for (int e = 0; e < L.rows; ++e)
      if (std::find(g.begin(), g.end(), e) == g.end() && (best < 0 || p[e] > p[best])) best = e;
    g.push_back(best);
  }
  const std::vector<const ExpertRef*>& Y = experts_of_[ns];
  for (int e : g)
    if (e < (int)Y.size()) tier_->hint(tier_key(Y[e]));
}

// The experts of an Experts op from the tier, one at a time: the lead picks the next (staged: one
// whose read has landed if any, keeping up to quota_ requests ahead; sync: the next in id order,
// read now), the team runs its gate/up and down, and the lead unpins it once the team met again.
// Each expert's rows get exactly what the mapped path gives them (the same kernels on the same
// bytes), whatever the order.
template <class GU, class DN>
void Engine::experts_from_tier(const Experts& op, Workspace& ws, Team& t, GU&& gate_up, DN&& down) {
  const std::vector<const ExpertRef*>& X = experts_of_[expert_slot_[t.op]];
  const int E = op.n_expert;
  Scratch& sh = *t.shared;
  const int32_t* start = sh.ex_start.data();
  const bool staged = opt_.experts == ExpertPolicy::Staged;
  std::vector<int>& pin = ws.pinned[expert_slot_[t.op]];
  auto pick = [&]() {  // lead: the next expert into sh.ex_cur / sh.ex_ptr, -1 when done or failed
    sh.ex_cur = -1;
    if (sh.ex_todo.empty() || ws.failed) return;
    try {
      if (!staged) {
        const int e = sh.ex_todo.front();
        sh.ex_todo.erase(sh.ex_todo.begin());
        sh.ex_ptr = tier_->acquire_sync(tier_key(X[e]), &pin[e]);
        sh.ex_cur = e;
        return;
      }
      int held = 0;
      for (int e : sh.ex_todo) held += pin[e] >= 0;
      for (int e : sh.ex_todo)
        if (pin[e] < 0 && held < quota_) pin[e] = tier_->request(tier_key(X[e])), ++held;
      size_t q = 0;
      while (q < sh.ex_todo.size() && !(pin[sh.ex_todo[q]] >= 0 && tier_->ready(pin[sh.ex_todo[q]]))) ++q;
      if (q == sh.ex_todo.size()) q = 0;
      const int e = sh.ex_todo[q];
      sh.ex_todo.erase(sh.ex_todo.begin() + q);
      if (pin[e] < 0) pin[e] = tier_->request(tier_key(X[e]));
      sh.ex_ptr = tier_->wait(pin[e]);
      sh.ex_cur = e;
    } catch (const std::runtime_error& err) {
      std::lock_guard<std::mutex> lk(mu_);
      ws.error = err.what();
      ws.failed = true;
    }
  };
  if (t.lead()) {
    if (pin.size() != (size_t)E) pin.assign(E, -1);
    sh.ex_todo.clear();
    for (int e = 0; e < E; ++e)
      if (start[e + 1] > start[e]) sh.ex_todo.push_back(e);
    pick();
  }
  t.barrier();
  for (;;) {
    const int e = sh.ex_cur;
    if (e < 0) break;
    t.ex = X[e];
    t.ex_data = sh.ex_ptr;
    gate_up(e);
    t.barrier();
    down(e);
    t.ex = nullptr;
    t.ex_data = nullptr;
    const int done = pin[e];
    if (t.lead()) pick();  // the next one's read may still be landing while the team finishes
    t.barrier();
    if (t.lead()) {
      tier_->unpin(done);
      pin[e] = -1;
    }
  }
}

// Unpins whatever a forward's routers pinned and no Experts op used (a step that failed).
void Engine::release_pins(Workspace& ws) {
  for (std::vector<int>& pin : ws.pinned)
    for (int& p : pin)
      if (p >= 0) {
        tier_->unpin(p);
        p = -1;
      }
}

// ---------------------------------------------------------------- forward
// Denormal floats flushed to zero while a forward runs, restored after (the caller is a Python
// thread). x86 cores take a slow microcode assist on denormal operands and results, and the
// engine makes them (silu of a strongly negative gate, ~1e-37, times a small up value is one
// way): a 64-token SmolLM2 prompt ran 7x slower (best of 12) before this. Their contribution is
// below fp32 resolution of the sums they enter anyway.
class FlushDenormals {
 public:
#if defined(CFLOW_X86)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

void Engine::run_one(const Op& op, Workspace& ws, Team& t) {
  std::visit([&](const auto& o) {
    using T = std::decay_t<decltype(o)>;
    if constexpr (std::is_same_v<T, Barrier>) t.barrier();
    else if constexpr (!std::is_same_v<T, std::monostate>) run_op(o, ws, t);
  }, op);
}

void Engine::run(Workspace& ws, int tid) {
  FlushDenormals ftz;
  if (team_size_.size() > 1) run_pipeline(ws, tid);
  else run_sequential(ws, tid);
}

void Engine::run_sequential(Workspace& ws, int tid) {
  using clk = std::chrono::steady_clock;
  const bool prof = profile_on_ && tid == 0;
  Team t;
  t.tid = tid;
  t.nth = ws.pool.size();
  t.pool = &ws.pool;
  t.shared = ws.shared[0].get();
  t.priv = ws.priv[tid].get();
  for (size_t i = 0; i < plan_.ops.size(); ++i) {
    const Op& op = plan_.ops[i];
    clk::time_point t0;
    if (prof) t0 = clk::now();
    t.enter(ws, (int)i);
    run_one(op, ws, t);
    if (prof) ws.prof[op.index()] += std::chrono::duration<double>(clk::now() - t0).count();
  }
}

// A team runs its ops in plan order; before each, it meets where the op reads what the team
// wrote since it last met, and waits for the ops of other teams it depends on (their threads
// count themselves done, per forward: the epoch).
void Engine::run_pipeline(Workspace& ws, int tid) {
  using clk = std::chrono::steady_clock;
  const bool prof = profile_on_ && tid == 0;
  const int team = thread_team_[tid];
  Team t;
  t.tid = tid - team_first_[team];
  t.nth = team_size_[team];
  t.bar = &ws.bars[team];
  t.shared = ws.shared[team].get();
  t.priv = ws.priv[tid].get();
  for (int i : team_ops_[team]) {
    const OpSched& os = sched_[i];
    clk::time_point t0;
    if (prof) t0 = clk::now();
    if (os.team < 0) {  // a joint op: the whole pool, after every team's earlier ops
      Team all;
      all.tid = tid;
      all.nth = ws.pool.size();
      all.pool = &ws.pool;
      all.shared = ws.shared[0].get();
      all.priv = t.priv;
      all.enter(ws, i);
      ws.pool.barrier();
      run_one(plan_.ops[i], ws, all);
      ws.pool.barrier();
      if (prof) ws.prof[plan_.ops[i].index()] += std::chrono::duration<double>(clk::now() - t0).count();
      continue;
    }
    if (os.barrier_before) t.barrier();
    for (int d : os.waits) {
      const uint64_t target = ws.epoch * (uint64_t)team_size_[sched_[d].team];
      for (int k = 1; ws.done[d].load(std::memory_order_acquire) < target; ++k) SpinBarrier::relax(k);
    }
    t.enter(ws, i);
    run_one(plan_.ops[i], ws, t);
    if (os.signals) ws.done[i].fetch_add(1, std::memory_order_acq_rel);
    if (prof) ws.prof[plan_.ops[i].index()] += std::chrono::duration<double>(clk::now() - t0).count();
  }
}

// ---------------------------------------------------------------- schedules
// The lanes of the pipeline schedule, by stream: attention (with the adds the builder gives the
// attention stream), dense FFN, experts (with their router).
static int lane_of(int stream) { return stream == kDense ? 1 : stream == kExperts || stream == kRouter ? 2 : 0; }
constexpr int kLanes = 3;
// The embedding and the head are no lane's: nothing runs beside them (the first and the last op
// of a step), so every thread of the pool runs them together, as in the sequential schedule.
static bool joint(int stream) { return stream == kEmbed || stream == kHead; }

// Dependencies from the buffers (and KV slots) each op reads and writes, in plan order: an op
// depends on the last writer of what it reads or writes, and on the readers since then of what
// it writes. The true ones (reading what an earlier op wrote) give the critical path; all of
// them, between teams, what a team waits for.
void Engine::plan_schedule() {
  const int nops = (int)plan_.ops.size(), nb = (int)plan_.buffers.size();
  const int nres = nb + (int)kv_width_.size();
  std::vector<int> last_writer(nres, -1), stream(nops, -1);
  std::vector<std::vector<int>> readers(nres), deps(nops), raw(nops);
  std::vector<double> cost(nops, 0.0);  // weight bytes per token on the counted streams
  auto counted = [](int st) { return st == kAttention || st == kDense || st == kExperts; };
  for (int i = 0; i < nops; ++i) {
    std::vector<int> R, W;
    std::visit([&](const auto& o) {
      using T = std::decay_t<decltype(o)>;
      if constexpr (std::is_same_v<T, Embed>) {
        W = {o.dst};
      } else if constexpr (std::is_same_v<T, Matmul>) {
        R = {o.src};
        W = {o.dst};
        if (o.accumulate) R.push_back(o.dst);
        if (counted(o.stream)) cost[i] = (double)plan_.tensors[o.weight].nbytes;
      } else if constexpr (std::is_same_v<T, GateUp>) {
        R = {o.src};
        W = {o.dst};
        if (counted(o.stream)) cost[i] = (double)plan_.tensors[o.weight].nbytes;
      } else if constexpr (std::is_same_v<T, ActMul> || std::is_same_v<T, Router>) {
        R = {o.src};
        W = {o.dst};
      } else if constexpr (std::is_same_v<T, Add>) {
        R = {o.src};
        W = {o.dst};
        if (o.accumulate) R.push_back(o.dst);
        if (o.gate >= 0) R.push_back(o.gate);
      } else if constexpr (std::is_same_v<T, Attention>) {
        R = {o.src, nb + o.kv};
        W = {o.src, o.dst, nb + o.kv};
      } else if constexpr (std::is_same_v<T, Experts>) {
        R = {o.src, o.route};
        W = {o.dst};
        if (o.accumulate) R.push_back(o.dst);
        const auto& X = experts_of_[expert_slot_[i]];
        const int K = plan_.buffers[o.route].width / 2;
        if (counted(o.stream))
          cost[i] = (double)K * (plan_.tensors[X[0]->gate_up].nbytes + plan_.tensors[X[0]->down].nbytes);
      }
      if constexpr (!std::is_same_v<T, Barrier> && !std::is_same_v<T, std::monostate>) stream[i] = o.stream;
    }, plan_.ops[i]);
    if (stream[i] < 0) continue;  // a barrier
    const bool head = std::holds_alternative<Matmul>(plan_.ops[i]) && std::get<Matmul>(plan_.ops[i]).last_token;
    if (!head && (std::count(R.begin(), R.end(), plan_.logits) || std::count(W.begin(), W.end(), plan_.logits)))
      logits_by_seq_ = false;
    for (int r : R)
      if (last_writer[r] >= 0) raw[i].push_back(last_writer[r]);
    for (int w : W) {
      if (last_writer[w] >= 0) deps[i].push_back(last_writer[w]);
      deps[i].insert(deps[i].end(), readers[w].begin(), readers[w].end());
    }
    deps[i].insert(deps[i].end(), raw[i].begin(), raw[i].end());
    for (int r : R) readers[r].push_back(i);
    for (int w : W) {
      last_writer[w] = i;
      readers[w].clear();
    }
    std::sort(deps[i].begin(), deps[i].end());
    deps[i].erase(std::unique(deps[i].begin(), deps[i].end()), deps[i].end());
    deps[i].erase(std::remove(deps[i].begin(), deps[i].end(), i), deps[i].end());
  }
  if (!logits_by_seq_) max_width_ = std::max(max_width_, vocab_);
  // the longest chain of true dependencies, in weight bytes
  std::vector<double> finish(nops, 0.0);
  crit_bytes_ = stream_bytes_ = 0;
  for (int i = 0; i < nops; ++i) {
    double start = 0;
    for (int d : raw[i]) start = std::max(start, finish[d]);
    finish[i] = start + cost[i];
    crit_bytes_ = std::max(crit_bytes_, finish[i]);
    stream_bytes_ += cost[i];
  }
  // teams: one of every thread (sequential), or the lanes shared out to teams by load
  team_first_ = {0};
  team_size_ = {threads_};
  team_lanes_ = {(1 << kLanes) - 1};
  thread_team_.assign(threads_, 0);
  team_ops_.assign(1, {});
  sched_.assign(nops, OpSched{});
  double load[kLanes] = {};
  bool used[kLanes] = {};
  for (int i = 0; i < nops; ++i)
    if (stream[i] >= 0) {
      if (joint(stream[i])) continue;  // every thread runs these
      const int l = lane_of(stream[i]);
      used[l] = true;
      std::visit([&](const auto& o) {  // bytes per token the lane reads
        using T = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<T, Matmul> || std::is_same_v<T, GateUp> || std::is_same_v<T, Router>)
          load[l] += (double)plan_.tensors[o.weight].nbytes;
        if constexpr (std::is_same_v<T, Experts>) load[l] += cost[i];
      }, plan_.ops[i]);
    }
  std::vector<int> lanes;
  for (int l = 0; l < kLanes; ++l)
    if (used[l]) lanes.push_back(l);
  const int nteams = std::min<int>(threads_, (int)lanes.size());
  if (opt_.schedule != Schedule::Pipeline || nteams <= 1) return;  // run_sequential walks the plan
  // lanes by falling load, each to the team with the least; threads to the teams by load per thread
  std::sort(lanes.begin(), lanes.end(), [&](int a, int b) { return load[a] > load[b]; });
  std::vector<double> tload(nteams, 0.0);
  int lane_team[kLanes] = {};
  team_lanes_.assign(nteams, 0);
  for (int l : lanes) {
    const int t = (int)(std::min_element(tload.begin(), tload.end()) - tload.begin());
    lane_team[l] = t;
    tload[t] += std::max(load[l], 1.0);
    team_lanes_[t] |= 1 << l;
  }
  team_size_.assign(nteams, 1);
  for (int extra = threads_ - nteams; extra > 0; --extra) {
    int best = 0;
    for (int t = 1; t < nteams; ++t)
      if (tload[t] / team_size_[t] > tload[best] / team_size_[best]) best = t;
    ++team_size_[best];
  }
  team_first_.assign(nteams, 0);
  for (int t = 1; t < nteams; ++t) team_first_[t] = team_first_[t - 1] + team_size_[t - 1];
  for (int t = 0; t < nteams; ++t)
    for (int k = 0; k < team_size_[t]; ++k) thread_team_[team_first_[t] + k] = t;
  team_ops_.assign(nteams, {});
  std::vector<std::vector<int>> since(nteams);  // ops a team ran since it last met
  for (int i = 0; i < nops; ++i) {
    if (stream[i] < 0) continue;
    OpSched& os = sched_[i];
    if (joint(stream[i])) {  // all teams meet, run it together, meet again
      os.team = -1;
      for (int t = 0; t < nteams; ++t) {
        team_ops_[t].push_back(i);
        since[t].clear();
      }
      continue;
    }
    os.team = lane_team[lane_of(stream[i])];
    for (int d : deps[i]) {
      if (sched_[d].team < 0) continue;  // ordered by the meetings around it
      if (sched_[d].team != os.team) {
        os.waits.push_back(d);
        sched_[d].signals = true;
      } else if (std::find(since[os.team].begin(), since[os.team].end(), d) != since[os.team].end()) {
        os.barrier_before = true;
      }
    }
    if (os.barrier_before) since[os.team].clear();
    since[os.team].push_back(i);
    team_ops_[os.team].push_back(i);
  }
}

// Marks the states of one forward busy, and free again when it ends (also on an exception).
class Claim {
 public:
  explicit Claim(const std::vector<Seq>& seqs) {
    for (const Seq& s : seqs) {
      if (s.state->busy_.exchange(true)) fail("forward: a state is already in a forward (or twice in this one)");
      held_.push_back(s.state);
    }
  }
  ~Claim() {
    for (State* s : held_) s->busy_ = false;
  }

 private:
  std::vector<State*> held_;
};

// dst[0 .. n) = src[0 .. n); whether every value is finite. A value is not when its exponent bits
// are all ones: adding one to the exponent field then carries into the sign bit, which the
// accumulator keeps (integer and / add / or: a loop the compiler vectorizes at any ISA level).
static bool copy_finite(float* dst, const float* src, size_t n) {
  uint32_t acc = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, src + i, sizeof b);
    acc |= (b & 0x7f800000u) + 0x00800000u;
    dst[i] = src[i];
  }
  return !(acc & 0x80000000u);
}

bool Engine::forward(const std::vector<Seq>& seqs, bool all_logits, float* logits) {
  if (seqs.empty()) fail("forward: no sequences");
  int n = 0;
  for (const Seq& s : seqs) {
    if (!s.state || s.n <= 0) fail("forward: every sequence needs at least one token");
    const State& st = *s.state;
    if (st.n_ctx_ != n_ctx_ || st.kv_width_ != kv_width_ || st.kv_hd_ != kv_hd_ || st.kt_ != kt_ || st.vt_ != vt_)
      fail("forward: the state belongs to another model or KV cache type");
    if (st.pos() + s.n > n_ctx_)
      fail("context full: " + std::to_string(st.pos()) + " tokens in the cache + " + std::to_string(s.n) +
           " new > n_ctx " + std::to_string(n_ctx_));
    for (int i = 0; i < s.n; ++i)
      if (s.tokens[i] < 0 || s.tokens[i] >= vocab_)
        fail("token id " + std::to_string(s.tokens[i]) + " outside the vocabulary of " + std::to_string(vocab_));
    n += s.n;
  }
  Claim claim(seqs);
  for (const Seq& s : seqs) s.state->high_ = std::max(s.state->high_, s.state->pos() + s.n);  // pages it may write
  std::unique_lock<std::mutex> tier_lock(tier_mu_, std::defer_lock);
  if (tier_) tier_lock.lock();
  std::unique_ptr<Workspace> wsp = take_workspace();
  Workspace& ws = *wsp;
  ws.n = n;
  ws.all_logits = all_logits;
  ws.tokens.clear();
  ws.row_seq.clear();
  ws.row_pos.clear();
  ws.states.clear();
  ws.first_row.assign(seqs.size(), 0);
  ws.last_row.assign(seqs.size(), 0);
  // Rows sequence after sequence, those with several new tokens first (the GEMM rows).
  std::vector<int> order(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) order[i] = (int)i;
  std::stable_partition(order.begin(), order.end(), [&](int i) { return seqs[i].n > 1; });
  ws.n_pre = 0;
  for (int i : order) {
    const Seq& s = seqs[i];
    ws.first_row[i] = (int)ws.tokens.size();
    for (int j = 0; j < s.n; ++j) {
      ws.tokens.push_back(s.tokens[j]);
      ws.row_seq.push_back((int)ws.states.size());
      ws.row_pos.push_back(s.state->pos() + j);
    }
    ws.last_row[i] = (int)ws.tokens.size() - 1;
    ws.states.push_back(s.state);
    if (s.n > 1) ws.n_pre += s.n;
  }
  // Buffers and shared scratch sized for n rows (every thread writes its rows of them); the
  // logits, which only the head writes, for one row per sequence unless every row's are asked
  // for (a 512-token prompt's logits rows of gemma3-270m are 537 MB, zeroed at first touch).
  ws.bufs.resize(plan_.buffers.size());
  for (size_t b = 0; b < ws.bufs.size(); ++b) {
    const bool by_seq = (int)b == plan_.logits && logits_by_seq_ && !all_logits;
    grow(ws.bufs[b], (by_seq ? seqs.size() : (size_t)n) * plan_.buffers[b].width);
  }
  const size_t maxc = (size_t)max_width_;
  grow(ws.prof, prof_.size());
  for (auto& sh : ws.shared) {
    grow(sh->gather, seqs.size() * maxc);
    grow(sh->xn, n * maxc);
    grow(sh->qa, n * (any_precise_ ? 2 : 1) * q8a_row_bytes(max_width_));
    grow(sh->ex_in, (size_t)n * ex_in_width_);
    grow(sh->ex_out, (size_t)n * ex_in_width_);
    grow(sh->ex_h, (size_t)n * ex_h_width_);
  }
  for (auto& s : ws.priv) grow(s->xn, maxc);
  ++ws.epoch;
  ws.failed = false;
  ws.pinned.resize(experts_of_.size());
  ws.predicted.resize(experts_of_.size());
  try {
    ws.pool.run([this, &ws](int tid, int) { run(ws, tid); });
  } catch (...) {
    if (tier_) release_pins(ws);
    give_workspace(std::move(wsp));
    throw;
  }
  if (tier_) release_pins(ws);
  counts_[kNumStreams].fetch_add(1, std::memory_order_relaxed);
  counts_[kNumStreams + 1].fetch_add(n, std::memory_order_relaxed);
  if (ws.failed) {
    const std::string err = ws.error;
    give_workspace(std::move(wsp));
    fail(err);  // the states are left as they were
  }
  for (const Seq& s : seqs) s.state->tokens_.insert(s.state->tokens_.end(), s.tokens, s.tokens + s.n);
  const float* lg = ws.bufs[plan_.logits].data();  // all rows in layout order, or one per sequence
  bool finite = true;
  if (all_logits) {
    for (const Seq& s : seqs) {
      const size_t i = &s - seqs.data();
      finite &= copy_finite(logits, lg + (size_t)ws.first_row[i] * vocab_, (size_t)vocab_ * s.n);
      logits += (size_t)vocab_ * s.n;
    }
  } else {
    finite = copy_finite(logits, lg, (size_t)vocab_ * seqs.size());
  }
  give_workspace(std::move(wsp));
  return finite;
}

}  // namespace cflow
