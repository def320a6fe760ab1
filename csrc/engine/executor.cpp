// The plan executor: validates a plan against the mapped file, then runs whole forwards on the
// persistent pool (one pool.run per forward; barriers only where the plan places them).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#if defined(CFLOW_X86)
#include <immintrin.h>
#endif

#include "cflow/engine.h"
#include "cflow/ops.h"
#include "cflow/threadpool.h"

namespace cflow {

struct Engine::Scratch {
  std::vector<float> xn;             // (n, C) normalised input
  std::vector<uint8_t> qa;           // (n, levels) rows of int8 input (QActs; F_PRECISE: two levels)
  std::vector<float> y;              // (n, rows of a share) GEMM output before an epilogue
  std::vector<float> scores;         // (n_ctx,) attention scores
  std::vector<uint8_t> xa;           // one token's activation prepared for a GEMV kernel
};

struct Engine::Input {
  const float* x = nullptr;
  int ldx = 0;
  QActs qa;  // F_PRECISE: two levels
};

State::State(int n_layer, int n_ctx_, int kv_dim_) : n_ctx(n_ctx_), kv_dim(kv_dim_), k(n_layer), v(n_layer) {
  for (int l = 0; l < n_layer; ++l) {
    k[l].reset(new float[(size_t)n_ctx * kv_dim]);
    v[l].reset(new float[(size_t)n_ctx * kv_dim]);
  }
}

static void fail(const std::string& msg) { throw std::runtime_error(msg); }

template <class T>
static void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

Engine::Engine(const uint8_t* base, size_t size, const ModelDims& dims, std::vector<TensorRef> tensors, Plan plan,
               int threads, bool fast)
    : base_(base), size_(size), dims_(dims), T_(std::move(tensors)), plan_(std::move(plan)), fast_(fast), isa_(best_isa()) {
  validate();
  int nt = threads > 0 ? threads : 1;
  pool_ = std::make_unique<ThreadPool>(nt);
  for (int t = 0; t < nt; ++t) priv_.push_back(std::make_unique<Scratch>());
  shared_ = std::make_unique<Scratch>();
  for (const Op& op : plan_.ops) any_precise_ |= (op.flags & F_PRECISE) != 0;
  bufs_.resize(plan_.buf_width.size());
  vecs_.resize(T_.size());
  // Norm and bias vectors are small: dequantize them once.
  for (const Op& op : plan_.ops) {
    for (int id : {op.bias, op.norm, op.kind == OP_ATTN ? op.w : -1}) {
      if (id < 0 || !vecs_[id].empty()) continue;
      const TileLayout& L = T_[id].L;
      std::vector<float> v((size_t)L.rows * L.cols);
      for (int r = 0; r < L.rows; ++r) dequant_row(L, base_ + T_[id].off, r, v.data() + (size_t)r * L.cols);
      vecs_[id] = std::move(v);
    }
  }
  // RoPE tables per distinct theta: (n_ctx, hd/2) cos and sin.
  const int half = dims_.head_dim / 2;
  for (const Op& op : plan_.ops) {
    if (op.kind != OP_ATTN || std::find(rope_theta_.begin(), rope_theta_.end(), op.f0) != rope_theta_.end()) continue;
    rope_theta_.push_back(op.f0);
    std::vector<float> c((size_t)dims_.n_ctx * half), s((size_t)dims_.n_ctx * half);
    for (int i = 0; i < half; ++i) {
      const float inv = (float)(1.0 / std::pow((double)op.f0, (2.0 * i) / dims_.head_dim));  // fp32 like HF
      for (int p = 0; p < dims_.n_ctx; ++p) {
        const double a = (double)((float)p * inv);
        c[(size_t)p * half + i] = (float)std::cos(a);
        s[(size_t)p * half + i] = (float)std::sin(a);
      }
    }
    rope_cos_.push_back(std::move(c));
    rope_sin_.push_back(std::move(s));
  }
  const char* pe = std::getenv("CFLOW_PROFILE");
  profile_on_ = pe && *pe && *pe != '0';
  prof_.assign(8, 0.0);
}

Engine::~Engine() = default;

int Engine::threads() const { return pool_->size(); }

std::unique_ptr<State> Engine::new_state() const {
  return std::make_unique<State>(dims_.n_layer, dims_.n_ctx, dims_.n_kv_head * dims_.head_dim);
}

const float* Engine::vec(int tensor) const { return vecs_[tensor].data(); }

// ---------------------------------------------------------------- validation
void Engine::validate() {
  const ModelDims& D = dims_;
  if (D.n_layer <= 0 || D.d_model <= 0 || D.n_head <= 0 || D.n_kv_head <= 0 || D.head_dim <= 0 || D.vocab <= 0 ||
      D.n_ctx <= 0 || D.n_head % D.n_kv_head || D.head_dim % 2 || D.head_dim > 1024)
    fail("engine: bad model dimensions");
  for (size_t i = 0; i < T_.size(); ++i) {
    TensorRef& t = T_[i];
    const char* err = nullptr;
    if (!make_layout(t.L, &err)) fail("tensor #" + std::to_string(i) + ": " + err);
    if (t.off < 0 || t.nbytes < 0 || (uint64_t)t.off > size_ || (uint64_t)t.nbytes > size_ - (uint64_t)t.off)
      fail("tensor #" + std::to_string(i) + ": byte range [" + std::to_string(t.off) + ", +" + std::to_string(t.nbytes) +
           ") lies outside the mapped file of " + std::to_string(size_) + " bytes");
    if ((size_t)t.nbytes != layout_nbytes(t.L))
      fail("tensor #" + std::to_string(i) + ": " + std::to_string(t.nbytes) + " bytes, its shape needs " +
           std::to_string(layout_nbytes(t.L)));
  }
  const int nb = (int)plan_.buf_width.size();
  for (int w : plan_.buf_width)
    if (w <= 0 || w > (1 << 24)) fail("plan: bad buffer width");
  if (plan_.logits_buf < 0 || plan_.logits_buf >= nb || plan_.buf_width[plan_.logits_buf] != D.vocab)
    fail("plan: the logits buffer must have the vocabulary's width");
  auto tensor = [&](int id, const char* what) -> const TileLayout* {
    if (id == -1) return nullptr;
    if (id < -1 || id >= (int)T_.size()) fail(std::string("plan: bad tensor id for ") + what);
    return &T_[id].L;
  };
  auto buffer = [&](int id, const char* what) -> int {
    if (id < 0 || id >= nb) fail(std::string("plan: bad buffer id for ") + what);
    return plan_.buf_width[id];
  };
  auto numel = [](const TileLayout* L) { return (int64_t)L->rows * L->cols; };
  const int qdim = D.n_head * D.head_dim, kvdim = D.n_kv_head * D.head_dim;
  for (size_t i = 0; i < plan_.ops.size(); ++i) {
    const Op& op = plan_.ops[i];
    const std::string at = "plan op #" + std::to_string(i) + ": ";
    switch (op.kind) {
      case OP_BARRIER: break;
      case OP_EMBED: {
        const TileLayout* W = tensor(op.w, "embedding");
        if (!W || W->rows != D.vocab || W->cols != buffer(op.dst, "embed") || W->cols != D.d_model)
          fail(at + "embedding shape does not match (vocab, d_model)");
        break;
      }
      case OP_MATVEC:
      case OP_GLU: {
        const TileLayout* W = tensor(op.w, "matvec");
        if (!W) fail(at + "matvec without a weight");
        const int C = buffer(op.src, "matvec src"), R = buffer(op.dst, "matvec dst");
        if (W->cols != C) fail(at + "weight columns " + std::to_string(W->cols) + " != input width " + std::to_string(C));
        if (op.kind == OP_MATVEC && (op.aux1 < 0 || op.aux1 > R || W->rows > R - op.aux1))
          fail(at + "weight rows " + std::to_string(W->rows) + " at column " + std::to_string(op.aux1) +
               " do not fit the output width " + std::to_string(R));
        if (op.kind == OP_GLU) {
          if (W->rows != 2 * R) fail(at + "gate_up rows must be twice the FFN width");
          if (op.aux0 <= 0 || op.aux0 % W->g) fail(at + "gate_up chunk must be a positive multiple of the interleave");
        }
        if (const TileLayout* B = tensor(op.bias, "bias"); B && numel(B) != W->rows) fail(at + "bias size");
        if (const TileLayout* N = tensor(op.norm, "norm"); N && numel(N) != C) fail(at + "norm size");
        if (op.src == op.dst) fail(at + "matvec in place");
        if (op.flags & F_LAST && op.flags & F_ACCUM) fail(at + "last-token op cannot accumulate");
        break;
      }
      case OP_ATTN: {
        if (op.layer < 0 || op.layer >= D.n_layer) fail(at + "bad layer");
        if (buffer(op.src, "attn src") != qdim + 2 * kvdim) fail(at + "attention input is not (q, k, v)");
        if (buffer(op.dst, "attn dst") != qdim) fail(at + "attention output width");
        if (const TileLayout* N = tensor(op.w, "q norm"); N && numel(N) != D.head_dim) fail(at + "q norm size");
        if (const TileLayout* N = tensor(op.bias, "k norm"); N && numel(N) != D.head_dim) fail(at + "k norm size");
        if (op.aux0 < 0 || !(op.f0 > 0)) fail(at + "bad window or rope theta");
        break;
      }
      case OP_NORM_ADD: {
        const TileLayout* N = tensor(op.norm, "norm");
        const int w = buffer(op.src, "norm src");
        if (!N || numel(N) != w || buffer(op.dst, "norm dst") != w) fail(at + "norm_add shapes");
        break;
      }
      case OP_ACT_MUL: {
        const int F = buffer(op.dst, "act_mul dst");
        if (buffer(op.src, "act_mul src") != 2 * F) fail(at + "act_mul input is not (gate, up) of twice the output width");
        break;
      }
      default: fail(at + "unknown op kind " + std::to_string(op.kind));
    }
  }
}

// ---------------------------------------------------------------- helpers
void Engine::rmsnorm(const float* x, const float* w, int cols, float* out) const {
  ops().rmsnorm(out, x, w, 1, cols, dims_.eps, dims_.norm_offset);
}

// Input of a GEMM: optionally normalised, optionally quantized. One token: each thread makes its
// own copy (no barrier). Several tokens: threads split the tokens into shared scratch, barrier.
Engine::Input Engine::prepare(const float* src, int lds, int n, int cols, int norm, bool q8, bool precise, int tid) {
  Input in;
  in.x = src;
  in.ldx = lds;
  if (!norm && !q8) return in;
  const bool one = n == 1;
  Scratch& s = one ? *priv_[tid] : *shared_;
  const int nth = one ? 1 : pool_->size();
  if (!one) pool_->barrier();  // the shared scratch may still be read by the previous op
  const int k0 = one ? 0 : (int)((int64_t)n * tid / nth), k1 = one ? 1 : (int)((int64_t)n * (tid + 1) / nth);
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
    QActs part = in.qa;
    part.n = k1 - k0;
    part.data = (uint8_t*)in.qa.row(k0);
    if (k1 > k0) quantize_acts(x + (size_t)k0 * ldx, ldx, k1 - k0, cols, part);
  }
  if (!one) pool_->barrier();
  return in;
}

// Decode reads each weight once for one token: the tile GEMV kernels (kernels.h), which split
// work by whole stripes, are the bandwidth-bound path. int8 activations (block_q8a / block_q8_K)
// on the fast path for quantized types, fp32 otherwise.
GemvFn Engine::decode_gemv(const TileLayout& L, const float* x, int tid, const void** xa, bool precise,
                           const void** xa2) {
  const AType at = !fast_ || !has_int8_path(L.bt(), false) ? AType::F32 : precise ? AType::Q8x2 : AType::Q8;
  GemvFn fn = gemv_fn(L.bt(), L.packing(), at, isa_);
  if (xa2) *xa2 = nullptr;  // both levels are in *xa (AType::Q8x2)
  if (!fn) return nullptr;
  Scratch& s = *priv_[tid];
  grow(s.xa, act_bytes(L.bt(), at, L.cols));
  prepare_act(L.bt(), at, s.xa.data(), x, L.cols);
  *xa = s.xa.data();
  return fn;
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

// ---------------------------------------------------------------- ops
void Engine::op_embed(const Op& op, int tid) {
  const TensorRef& W = T_[op.w];
  const int d = W.L.cols, nth = pool_->size();
  float* dst = bufs_[op.dst].data();
  for (int k = tid; k < n_; k += nth) {
    float* row = dst + (size_t)k * d;
    dequant_row(W.L, base_ + W.off, tokens_[k], row);
    if (dims_.embed_scale != 1.f)
      for (int i = 0; i < d; ++i) row[i] *= dims_.embed_scale;
  }
}

void Engine::op_matvec(const Op& op, int tid) {
  const TensorRef& W = T_[op.w];
  const TileLayout& L = W.L;
  const int C = L.cols, lds = plan_.buf_width[op.src], ldd = plan_.buf_width[op.dst];
  const float* src = bufs_[op.src].data();
  int n = n_;
  if ((op.flags & F_LAST) && !all_logits_) {
    src += (size_t)(n - 1) * lds;
    n = 1;
  }
  const bool one = n == 1;
  const bool q8 = !one && fast_ && has_int8_path(L.bt(), true);
  const bool precise = fast_ && (op.flags & F_PRECISE);
  Input in = prepare(src, lds, n, C, op.norm, q8, q8 && precise, tid);
  const void* xa = nullptr;
  GemvFn gemv = one ? decode_gemv(L, in.x, tid, &xa, precise) : nullptr;
  int r0, r1;
  if (gemv) stripe_share(L, tid, pool_->size(), &r0, &r1);
  else row_share(L, tid, pool_->size(), &r0, &r1);
  if (r0 >= r1) return;
  float* dst = bufs_[op.dst].data() + op.aux1;  // this weight's columns of the output
  const bool accum = op.flags & F_ACCUM;
  Scratch& s = *priv_[tid];
  float* y = dst + r0;
  int ldy = ldd;
  if (accum) {
    grow(s.y, (size_t)n * (r1 - r0));
    y = s.y.data();
    ldy = r1 - r0;
  }
  const uint8_t* w = base_ + W.off;
  if (gemv) {
    gemv(y, xa, w, L, r0, r1);
  } else if (q8) {
    gemm_q8(L, w, r0, r1, in.qa, y, ldy);
  } else {
    gemm_f32(L, w, r0, r1, in.x, in.ldx, n, y, ldy);
  }
  const float* b = op.bias >= 0 ? vec(op.bias) : nullptr;
  const float cap = op.f1;
  for (int k = 0; k < n; ++k) {
    float* yk = y + (size_t)k * ldy;
    if (b)
      for (int r = r0; r < r1; ++r) yk[r - r0] += b[r];
    if (cap > 0)
      for (int r = r0; r < r1; ++r) yk[r - r0] = cap * std::tanh(yk[r - r0] / cap);
    if (accum) {
      float* dk = dst + (size_t)k * ldd;
      for (int r = r0; r < r1; ++r) dk[r] += yk[r - r0];
    }
  }
}

// gate_up rows come in pairs of chunks: [gate rows p*c .. +cp), [up rows p*c .. +cp), cp <= c.
void Engine::op_glu(const Op& op, int tid) {
  const TensorRef& W = T_[op.w];
  const TileLayout& L = W.L;
  const int C = L.cols, F = L.rows / 2, c = op.aux0, lds = plan_.buf_width[op.src];
  const int nth = pool_->size();
  // One token with chunks of half a stripe: each chunk pair is one stripe, a GEMV row range.
  const bool one = n_ == 1 && 2 * c == L.tr;
  const bool q8 = !one && fast_ && has_int8_path(L.bt(), true);
  const bool precise = fast_ && (op.flags & F_PRECISE);
  Input in = prepare(bufs_[op.src].data(), lds, n_, C, op.norm, q8, q8 && precise, tid);
  const void* xa = nullptr;
  GemvFn gemv = one ? decode_gemv(L, in.x, tid, &xa, precise) : nullptr;
  const int P = (F + c - 1) / c;
  const int p0 = (int)((int64_t)P * tid / nth), p1 = (int)((int64_t)P * (tid + 1) / nth);
  Scratch& s = *priv_[tid];
  grow(s.y, (size_t)n_ * 2 * c);
  float* h = bufs_[op.dst].data();
  const uint8_t* w = base_ + W.off;
  for (int p = p0; p < p1; ++p) {
    const int cp = std::min(c, F - p * c), r0 = 2 * p * c, r1 = r0 + 2 * cp;
    if (gemv) gemv(s.y.data(), xa, w, L, r0, r1);
    else if (q8) gemm_q8(L, w, r0, r1, in.qa, s.y.data(), 2 * cp);
    else gemm_f32(L, w, r0, r1, in.x, in.ldx, n_, s.y.data(), 2 * cp);
    for (int k = 0; k < n_; ++k) {
      const float* g = s.y.data() + (size_t)k * 2 * cp;
      const float* u = g + cp;
      act_mul(g, u, h + (size_t)k * F + (size_t)p * c, cp);
    }
  }
}

// h[j] = act(g[j]) * u[j]: SwiGLU (act 0) or GeGLU with tanh GELU (act 1).
void Engine::act_mul(const float* g, const float* u, float* h, int n) const {
  if (dims_.act == 0) ops().swiglu(h, g, u, n);
  else ops().geglu(h, g, u, n);
}

// Gate and up computed by two matvecs into one (n, 2F) buffer; threads split the columns.
void Engine::op_act_mul(const Op& op, int tid) {
  const int F = plan_.buf_width[op.dst], nth = pool_->size();
  const int j0 = (int)((int64_t)F * tid / nth), j1 = (int)((int64_t)F * (tid + 1) / nth);
  const float* src = bufs_[op.src].data();
  float* dst = bufs_[op.dst].data();
  for (int k = 0; k < n_; ++k) {
    const float* g = src + (size_t)k * 2 * F;
    act_mul(g + j0, g + F + j0, dst + (size_t)k * F + j0, j1 - j0);
  }
}

void Engine::op_attn(const Op& op, int tid) {
  const ModelDims& D = dims_;
  const int hd = D.head_dim, half = hd / 2, nh = D.n_head, nkv = D.n_kv_head;
  const int qdim = nh * hd, kvdim = nkv * hd, ld = qdim + 2 * kvdim, nth = pool_->size();
  const int ti = (int)(std::find(rope_theta_.begin(), rope_theta_.end(), op.f0) - rope_theta_.begin());
  const float* cs = rope_cos_[ti].data();
  const float* sn = rope_sin_[ti].data();
  float* qkv = bufs_[op.src].data();
  float* K = st_->k[op.layer].get();
  float* V = st_->v[op.layer].get();
  const int pos0 = st_->pos;
  const float* qn = op.w >= 0 ? vec(op.w) : nullptr;
  const float* kn = op.bias >= 0 ? vec(op.bias) : nullptr;
  float tmp[1024];
  auto head_norm_rope = [&](float* x, const float* nw, int p) {
    if (nw) {
      rmsnorm(x, nw, hd, tmp);
      std::memcpy(x, tmp, sizeof(float) * hd);
    }
    const float* c = cs + (size_t)p * half;
    const float* s = sn + (size_t)p * half;
    if (D.rope_style == 0) {
      for (int i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i] + a * s[i];
      }
    } else {
      for (int i = 0; i < half; ++i) {
        const float a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = a * c[i] - b * s[i];
        x[2 * i + 1] = b * c[i] + a * s[i];
      }
    }
  };
  // Phase A: norms + rope of q and k heads, k and v into the cache.
  const int items = n_ * (nh + nkv);
  for (int it = (int)((int64_t)items * tid / nth), e = (int)((int64_t)items * (tid + 1) / nth); it < e; ++it) {
    const int k = it / (nh + nkv), h = it % (nh + nkv), p = pos0 + k;
    float* row = qkv + (size_t)k * ld;
    if (h < nh) {
      head_norm_rope(row + h * hd, qn, p);
    } else {
      const int j = h - nh;
      float* kh = row + qdim + j * hd;
      head_norm_rope(kh, kn, p);
      std::memcpy(K + (size_t)p * kvdim + j * hd, kh, sizeof(float) * hd);
      std::memcpy(V + (size_t)p * kvdim + j * hd, row + qdim + kvdim + j * hd, sizeof(float) * hd);
    }
  }
  pool_->barrier();
  // Phase B: softmax(q K^T * scale) V per (token, head); interleaved so causal work balances.
  const float scale = D.attn_scale > 0 ? D.attn_scale : 1.f / std::sqrt((float)hd);
  const int group = nh / nkv;
  Scratch& s = *priv_[tid];
  grow(s.scores, (size_t)D.n_ctx);
  float* out = bufs_[op.dst].data();
  for (int it = tid; it < n_ * nh; it += nth) {
    const int k = it / nh, h = it % nh, p = pos0 + k, j = h / group;
    const int lo = op.aux0 > 0 ? std::max(0, p - op.aux0 + 1) : 0, len = p - lo + 1;
    const float* q = qkv + (size_t)k * ld + h * hd;
    float* sc = s.scores.data();
    dot_rows(q, K + (size_t)lo * kvdim + j * hd, kvdim, len, hd, sc);
    for (int i = 0; i < len; ++i) sc[i] *= scale;
    softmax(sc, 1, len);
    float* o = out + (size_t)k * qdim + h * hd;
    std::memset(o, 0, sizeof(float) * hd);
    mix_rows(sc, V + (size_t)lo * kvdim + j * hd, kvdim, len, hd, o);
  }
}

void Engine::op_norm_add(const Op& op, int tid) {
  const int w = plan_.buf_width[op.src], nth = pool_->size();
  const float* src = bufs_[op.src].data();
  float* dst = bufs_[op.dst].data();
  float tmp[16384];
  std::vector<float> big;
  float* t = tmp;
  if (w > 16384) { big.resize(w); t = big.data(); }
  for (int k = tid; k < n_; k += nth) {
    rmsnorm(src + (size_t)k * w, vec(op.norm), w, t);
    float* d = dst + (size_t)k * w;
    for (int i = 0; i < w; ++i) d[i] += t[i];
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

void Engine::run_ops(int tid) {
  using clk = std::chrono::steady_clock;
  FlushDenormals ftz;
  for (const Op& op : plan_.ops) {
    clk::time_point t0;
    if (profile_on_ && tid == 0) t0 = clk::now();
    switch (op.kind) {
      case OP_BARRIER: pool_->barrier(); break;
      case OP_EMBED: op_embed(op, tid); break;
      case OP_MATVEC: op_matvec(op, tid); break;
      case OP_GLU: op_glu(op, tid); break;
      case OP_ATTN: op_attn(op, tid); break;
      case OP_NORM_ADD: op_norm_add(op, tid); break;
      case OP_ACT_MUL: op_act_mul(op, tid); break;
    }
    if (profile_on_ && tid == 0) prof_[op.kind] += std::chrono::duration<double>(clk::now() - t0).count();
  }
}

void Engine::forward(State& st, const int32_t* tokens, int n, bool all_logits, float* logits) {
  std::lock_guard<std::mutex> lk(mu_);
  if (n <= 0) fail("forward: no tokens");
  if (st.n_ctx != dims_.n_ctx || (int)st.k.size() != dims_.n_layer) fail("forward: state belongs to another model");
  if (st.pos < 0 || st.pos + n > dims_.n_ctx)
    fail("context full: " + std::to_string(st.pos) + " tokens in the cache + " + std::to_string(n) + " new > n_ctx " +
         std::to_string(dims_.n_ctx));
  for (int i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= dims_.vocab)
      fail("token id " + std::to_string(tokens[i]) + " outside the vocabulary of " + std::to_string(dims_.vocab));
  // Scratch sized for n tokens.
  for (size_t b = 0; b < bufs_.size(); ++b) grow(bufs_[b], (size_t)n * plan_.buf_width[b]);
  int maxc = 0;
  for (int w : plan_.buf_width) maxc = std::max(maxc, w);
  for (Scratch* s : {shared_.get()}) {  // every thread writes its tokens' rows: sized here, once
    grow(s->xn, (size_t)n * maxc);
    grow(s->qa, (size_t)n * (any_precise_ ? 2 : 1) * q8a_row_bytes(maxc));
  }
  for (auto& s : priv_) grow(s->xn, (size_t)maxc);
  st_ = &st;
  tokens_ = tokens;
  n_ = n;
  all_logits_ = all_logits;
  pool_->run([this](int tid, int) { run_ops(tid); });
  st.pos += n;
  const float* lg = bufs_[plan_.logits_buf].data();
  std::memcpy(logits, lg, sizeof(float) * (size_t)dims_.vocab * (all_logits ? n : 1));
}

}  // namespace cflow
