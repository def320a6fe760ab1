// Block-type lookups, tile layouts, activation quantization, the kernel tables' dispatch and the
// threaded GEMV drivers.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cflow/kernels.h"
#include "cflow/ops.h"
#include "cflow/planes.h"
#include "cflow/threadpool.h"
#include "isa_kernels.h"

namespace cflow {

// ---- block types and layouts ----

const char* block_name(BlockType bt) {
  const BlockTraits* t = block_traits(bt);
  return t ? t->name : "?";
}

bool block_from_name(const char* name, BlockType* out) {
  for (const BlockTraits& t : kBlockTypes)
    if (!std::strcmp(name, t.name)) {
      *out = t.type;
      return true;
    }
  return false;
}

const char* pack_name(Pack pack) { return pack == Pack::Planes ? "planes" : "blocks"; }

bool pack_from_name(const char* name, Pack* out) {
  for (Pack p : {Pack::Blocks, Pack::Planes})
    if (!std::strcmp(name, pack_name(p))) {
      *out = p;
      return true;
    }
  return false;
}

bool has_int8_path(BlockType bt, bool gemm) {
  const BlockTraits* t = block_traits(bt);
  return t && t->act != ActBlock::None && (!gemm || t->gemm_int8);
}

bool make_layout(TileLayout& L, const char** err) {
  const BlockTraits* t = block_traits(L.bt());
  *err = nullptr;
  if (!t) *err = "unsupported block type";
  else if (L.rows <= 0 || L.cols <= 0) *err = "rows and cols must be positive";
  else if (L.cols % t->elems) *err = "cols is not a multiple of the block size";
  else if (L.tr <= 0 || L.tc <= 0 || L.tc % t->elems) *err = "tile columns must be a positive multiple of the block size";
  else if (L.g <= 0 || L.tr % L.g) *err = "interleave must divide the tile rows";
  else if (L.pack != (int)Pack::Blocks && L.pack != (int)Pack::Planes) *err = "unknown pack";
  else if (L.planes() && !t->planes_header) *err = "the planes pack exists only for q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k and q6_k";
  else if (L.planes() && L.g > kPlanesMaxG) *err = "the planes pack needs an interleave of at most 16";
  if (*err) return false;
  L.qk = t->elems;
  L.bb = t->bytes;
  return true;
}

TileLayout tile_layout(BlockType bt, int rows, int cols, int tr, int tc, int g, Pack pack, const char** err) {
  TileLayout L;
  L.type = (int)bt;
  L.rows = rows;
  L.cols = cols;
  L.tr = tr;
  L.tc = tc;
  L.g = g;
  L.pack = (int)pack;
  make_layout(L, err);
  return L;
}

size_t layout_nbytes(const TileLayout& L) { return (size_t)L.rows * (size_t)(L.cols / L.qk) * (size_t)L.bb; }

// ---- activation quantization ----

namespace ref {

namespace {
// v -> int8 as the SIMD kernels convert (cvtps_epi32, then the saturating packs): round to nearest
// even, saturate to [-128, 127], and NaN or |v| >= 2^31 (cvtps' 0x80000000) -> -128. A plain cast
// of those is undefined behaviour, and they happen: a NaN or inf activation (hostile weights), or
// a block whose max |x| is so small that 1 / d overflows to inf.
inline int8_t to_q8(float v) {
  const float r = std::nearbyint(v);
  if (r >= -128.0f && r <= 127.0f) return (int8_t)r;  // every finite activation of a sane block
  return r > 127.0f && r < 2147483648.0f ? 127 : -128;
}

// One block of N activations -> q (round to nearest even); returns the scale d = max|x| / 127.
template <int N>
float quantize_block(const float* x, int8_t* q) {
  float amax = 0.0f;
  for (int j = 0; j < N; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < N; ++j) q[j] = to_q8(x[j] * id);
  return d;
}

// o.s and the lane sums l of a block whose d and qs are set.
void finish_q8a(block_q8a& o, q8a_sums& l) {
  int sum = 0;
  for (int k = 0; k < 8; ++k) {
    l.lsum8[k] = o.qs[4 * k] + o.qs[4 * k + 1] + o.qs[4 * k + 2] + o.qs[4 * k + 3];
    sum += l.lsum8[k];
  }
  for (int k = 0; k < 4; ++k) l.lsum4[k] = l.lsum8[k] + l.lsum8[k + 4];
  o.s = o.d * (float)sum;
}
}  // namespace

void quantize_q8a(block_q8a* xq, const float* x, int cols) {
  q8a_sums* ls = q8a_sums_of(xq, cols);
  for (int b = 0; b < cols / QK; ++b, x += QK) {
    xq[b].d = quantize_block<QK>(x, xq[b].qs);
    finish_q8a(xq[b], ls[b]);
  }
}

void quantize_q8a_level2(block_q8a* out, block_q8a* l1, const float* x, int cols) {
  q8a_sums *ls = q8a_sums_of(out, cols), *ls1 = q8a_sums_of(l1, cols);
  for (int b = 0; b < cols / QK; ++b, x += QK) {
    block_q8a& o = out[b];
    // d / 256 is exact while it stays a normal float. A block below that (d < 2^-118: every
    // |x| < 2^-111) is zero in both levels, so that the levels' ratio holds everywhere.
    if (!(l1[b].d >= 0x1p-118f)) {
      std::memset(l1[b].qs, 0, QK);
      l1[b].d = 0.0f;
      finish_q8a(l1[b], ls1[b]);
    }
    o.d = l1[b].d * 0x1p-8f;
    const float id = o.d > 0.0f ? 1.0f / o.d : 0.0f;
    for (int j = 0; j < QK; ++j) {
      const float r = std::fma(-l1[b].d, (float)l1[b].qs[j], x[j]);  // one rounding, as the SIMD fnmadd
      o.qs[j] = (int8_t)std::clamp((int)to_q8(r * id), -127, 127);
    }
    finish_q8a(o, ls[b]);
  }
}

void quantize_q8_K(block_q8_K* xq, const float* x, int cols) {
  for (int b = 0; b < cols / QK_K; ++b, x += QK_K) {
    block_q8_K& o = xq[b];
    o.d = quantize_block<QK_K>(x, o.qs);
    for (int c = 0; c < 16; ++c) {
      int s = 0;
      for (int l = 0; l < 16; ++l) s += o.qs[16 * c + l];
      o.bsums[c] = (int16_t)s;
    }
  }
}

}  // namespace ref

namespace {

const KernelTable& best_table() {
  static const KernelTable& t = kernel_table(best_isa());
  return t;
}

size_t act_row_bytes(ActBlock ab, int cols) {
  if (ab == ActBlock::Q8K) return (size_t)(cols / QK_K) * sizeof(block_q8_K);
  return q8a_row_bytes(cols);
}

// r = x - (the values of the int8 row b): what one level of the K-quants' activations misses
// (block_q8a rows form theirs in quantize_q8a_level2).
void residual(const block_q8_K* b, const float* x, int cols, float* r) {
  constexpr int n = QK_K;
  for (int k = 0; k < cols / n; ++k, x += n, r += n) {  // block by block: a loop the compiler vectorizes
    const float d = b[k].d;
    const int8_t* q = b[k].qs;
    for (int j = 0; j < n; ++j) r[j] = x[j] - d * (float)q[j];
  }
}

}  // namespace

size_t act_bytes(BlockType bt, AType at, int cols) {
  if (at == AType::F32) return (size_t)cols * sizeof(float);
  return (at == AType::Q8x2 ? 2 : 1) * act_row_bytes(act_block(bt), cols);
}

void quantize_act(ActBlock ab, void* xa, const float* x, int cols, int levels) {
  auto level = [&](void* out, const float* v) {
    if (ab == ActBlock::Q8K) best_table().quantize_q8K((block_q8_K*)out, v, cols);
    else best_table().quantize_q8a((block_q8a*)out, v, cols);
  };
  level(xa, x);
  if (levels < 2) return;
  void* xa2 = (uint8_t*)xa + act_row_bytes(ab, cols);
  if (ab == ActBlock::Q8a) {
    best_table().quantize_q8a_level2((block_q8a*)xa2, (block_q8a*)xa, x, cols);
    return;
  }
  thread_local std::vector<float> r;
  r.resize((size_t)cols);
  residual((const block_q8_K*)xa, x, cols, r.data());
  level(xa2, r.data());
}

void prepare_act(BlockType bt, AType at, void* xa, const float* x, int cols) {
  if (at == AType::F32) std::memcpy(xa, x, (size_t)cols * sizeof(float));
  else quantize_act(act_block(bt), xa, x, cols, at == AType::Q8x2 ? 2 : 1);
}

void quantize_acts(const float* x, int ldx, int n, int cols, QActs& out) {
  for (int k = 0; k < n; ++k) quantize_act(ActBlock::Q8a, out.row(k), x + (size_t)k * ldx, cols, out.levels);
}

// ---- dispatch ----

const KernelTable& kernel_table(Isa isa) {
#if defined(CFLOW_X86)
  if (isa == Isa::Avx512) return kernel_table_avx512();
  if (isa == Isa::Avx2) return kernel_table_avx2();
#endif
  return kernel_table_scalar();
}

GemvFn gemv_fn(BlockType bt, Pack pack, AType at, Isa isa, Isa* used) {
  const int i = block_index(bt), p = (int)pack, a = (int)at;
  if (i < 0 || p < 0 || p > 1 || a < 0 || a > 2) return nullptr;
  return lookup(isa, used, [&](const KernelTable& t) { return t.gemv[i][p][a]; });
}

GemvBatchFn gemv_batch_fn(BlockType bt, Pack pack, AType at, Isa isa) {
#if defined(CFLOW_X86)
  Isa used;
  // a batched kernel matches its ISA's GEMV: only where that is the one a token alone gets
  if (!gemv_fn(bt, pack, at, isa, &used)) return nullptr;
  if (used == Isa::Avx2) return avx2::gemv_batch(bt, pack, at);
  if (used != Isa::Avx512) return nullptr;
#if defined(CFLOW_AMX)
  if (amx_usable())  // the AMX kernels, where the type has one (the ternary types: the VNNI one)
    if (GemvBatchFn f = avx512::amx_gemv_batch(bt, pack, at)) return f;
#endif
  return avx512::vnni_gemv_batch(bt, pack, at);
#else
  (void)bt, (void)pack, (void)at, (void)isa;
  return nullptr;
#endif
}

namespace {
thread_local uint64_t t_acts_stamp = 0, t_acts_stamps = 0;
}
uint64_t new_acts_stamp() { return ++t_acts_stamps; }
void set_acts_stamp(uint64_t stamp) { t_acts_stamp = stamp; }
uint64_t acts_stamp() { return t_acts_stamp; }

bool gemv_batch_beats_gemm(Isa isa) {
#if defined(CFLOW_X86)
  return isa == Isa::Avx512;
#else
  (void)isa;
  return false;
#endif
}

void unpack_planes(const TileLayout& L, const uint8_t* src, uint8_t* dst, int nr) {
  const int nbr = L.cols / L.qk, bpt = L.tc / L.qk, bb = L.bb;
  size_t off = 0;  // chunks follow one another in payload order: tile, group, column block
  for (int cb0 = 0; cb0 < nbr; cb0 += bpt) {
    const int nb = std::min(bpt, nbr - cb0);
    for (int g0 = 0; g0 < nr; g0 += L.g) {
      const int gg = std::min(L.g, nr - g0);
      for (int b = 0; b < nb; ++b, off += (size_t)gg * bb)
        for (int i = 0; i < gg; ++i) planes_get(src + off, gg, i, L.bt(), dst + off + (size_t)i * bb);
    }
  }
}

// ---- threaded drivers ----

namespace {
// Runs body(s0, s1) over the stripes of L, split over the pool.
template <class Body>
void over_stripes(const TileLayout& L, ThreadPool* pool, Body&& body) {
  const int n_stripes = (L.rows + L.tr - 1) / L.tr;
  if (!pool || pool->size() == 1) body(0, n_stripes);
  else pool->parallel_for(n_stripes, 1, body);
}
}  // namespace

void gemv(AType at, Isa isa, float* y, const void* x, const uint8_t* w, const TileLayout& L, ThreadPool* pool) {
  GemvFn fn = gemv_fn(L.bt(), L.packing(), at, isa);
  if (!fn) return;
  over_stripes(L, pool, [&](int s0, int s1) {
    const int r0 = s0 * L.tr, r1 = std::min(s1 * L.tr, L.rows);
    fn(y + r0, x, w, L, r0, r1);
  });
}

void gemv_glu(AType at, Isa isa, Glu act, float* out, const void* x, const uint8_t* w, const TileLayout& L,
              ThreadPool* pool) {
  GemvFn fn = gemv_fn(L.bt(), L.packing(), at, isa);
  if (!fn) return;
  const int h = L.tr / 2;
  over_stripes(L, pool, [&](int s0, int s1) {
    std::vector<float> gu((size_t)L.tr);
    for (int s = s0; s < s1; ++s) {
      const int r0 = s * L.tr, nr = std::min(L.rows - r0, L.tr), half = nr / 2;
      fn(gu.data(), x, w, L, r0, r0 + nr);  // gu: gate (half) then up (half)
      float* o = out + (size_t)s * h;
      if (act == Glu::Silu) swiglu(o, gu.data(), gu.data() + half, half);
      else geglu(o, gu.data(), gu.data() + half, half);
    }
  });
}

}  // namespace cflow
