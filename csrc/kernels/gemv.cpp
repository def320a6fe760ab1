// Block-type metadata, activation quantization, kernel dispatch and the threaded drivers.
#include <cmath>
#include <cstring>
#include <vector>

#include "cflow/kernels.h"
#include "cflow/planes.h"
#include "cflow/threadpool.h"
#include "isa_kernels.h"

namespace cflow {

namespace {
struct TypeInfo {
  WType wt;
  const char* name;
  int qk, bb;
};
constexpr TypeInfo kTypes[kNumWTypes] = {
    {WType::F32, "f32", 1, 4},        {WType::F16, "f16", 1, 2},
    {WType::Q4_0, "q4_0", 32, 18},    {WType::Q4_1, "q4_1", 32, 20},
    {WType::Q5_0, "q5_0", 32, 22},    {WType::Q8_0, "q8_0", 32, 34},
    {WType::Q4_K, "q4_k", 256, 144},  {WType::Q6_K, "q6_k", 256, 210},
    {WType::BF16, "bf16", 1, 2},
};

const GemvTable kRefTable = {
    {ref::gemv_f32_f32, nullptr},          {ref::gemv_f16_f32, nullptr},
    {ref::gemv_q4_0_f32, ref::gemv_q4_0_q8}, {ref::gemv_q4_1_f32, ref::gemv_q4_1_q8},
    {ref::gemv_q5_0_f32, ref::gemv_q5_0_q8}, {ref::gemv_q8_0_f32, ref::gemv_q8_0_q8},
    {ref::gemv_q4_k_f32, ref::gemv_q4_k_q8}, {ref::gemv_q6_k_f32, ref::gemv_q6_k_q8},
    {ref::gemv_bf16_f32, nullptr},
};

const GemvTable& ref_planes() {
  static GemvTable t = {};
  static const bool filled = [] {
    auto set = [&](WType wt, GemvFn f32, GemvFn q8, GemvFn q8x2) {
      t[wtype_index(wt)][0] = f32;
      t[wtype_index(wt)][1] = q8;
      t[wtype_index(wt)][2] = q8x2;
    };
    set(WType::Q4_0, ref::gemv_q4_0_f32_planes, ref::gemv_q4_0_q8_planes, ref::gemv_q4_0_q8x2_planes);
    set(WType::Q4_1, ref::gemv_q4_1_f32_planes, ref::gemv_q4_1_q8_planes, ref::gemv_q4_1_q8x2_planes);
    set(WType::Q8_0, ref::gemv_q8_0_f32_planes, ref::gemv_q8_0_q8_planes, ref::gemv_q8_0_q8x2_planes);
    return true;
  }();
  (void)filled;
  return t;
}
}  // namespace

int wtype_index(WType wt) {
  for (int i = 0; i < kNumWTypes; ++i)
    if (kTypes[i].wt == wt) return i;
  return -1;
}

int block_elems(WType wt) {
  int i = wtype_index(wt);
  return i < 0 ? 0 : kTypes[i].qk;
}
int block_bytes(WType wt) {
  int i = wtype_index(wt);
  return i < 0 ? 0 : kTypes[i].bb;
}
const char* wtype_name(WType wt) {
  int i = wtype_index(wt);
  return i < 0 ? "?" : kTypes[i].name;
}
bool wtype_from_name(const char* name, WType* out) {
  for (const TypeInfo& t : kTypes)
    if (!std::strcmp(name, t.name)) {
      *out = t.wt;
      return true;
    }
  return false;
}
bool has_q8_path(WType wt) { return block_elems(wt) > 1; }

bool pack_from_name(const char* name, Pack* out) {
  for (Pack p : {Pack::Blocks, Pack::Planes})
    if (!std::strcmp(name, pack_name(p))) {
      *out = p;
      return true;
    }
  return false;
}
const char* pack_name(Pack pack) { return pack == Pack::Planes ? "planes" : "blocks"; }

size_t tiled_nbytes(WType wt, int rows, int cols) {
  const int qk = block_elems(wt);
  return qk ? (size_t)rows * (size_t)(cols / qk) * (size_t)block_bytes(wt) : 0;
}

const char* check_tiling(WType wt, int rows, int cols, const TileShape& ts) {
  const int qk = block_elems(wt);
  if (!qk) return "unknown weight type";
  if (rows <= 0 || cols <= 0) return "rows and cols must be positive";
  if (cols % qk) return "cols is not a multiple of the block size";
  if (ts.tr <= 0 || ts.tc <= 0 || ts.tc % qk) return "tile columns must be a positive multiple of the block size";
  if (ts.g <= 0 || ts.tr % ts.g) return "interleave must divide the tile rows";
  if (ts.pack == Pack::Planes) {
    if (!planes_header(wt)) return "the planes pack exists only for q4_0, q4_1 and q8_0";
    if (ts.g > kPlanesMaxG) return "the planes pack needs an interleave of at most 16";
  } else if (ts.pack != Pack::Blocks) {
    return "unknown pack";
  }
  return nullptr;
}

size_t act_bytes(WType wt, AType at, int cols) {
  if (at == AType::F32) return (size_t)cols * sizeof(float);
  if (at == AType::Q8x2) return 2 * act_bytes(wt, AType::Q8, cols);
  if (block_elems(wt) == QK_K) return (size_t)(cols / QK_K) * sizeof(block_q8_K);
  return (size_t)(cols / QK) * sizeof(block_q8a);
}

void quantize_q8a(block_q8a* xq, const float* x, int cols) {
  for (int b = 0; b < cols / QK; ++b, x += QK) {
    block_q8a& o = xq[b];
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
      o.qs[j] = (int8_t)std::nearbyint(x[j] * id);
      sum += o.qs[j];
    }
    for (int k = 0; k < 8; ++k)
      o.lsum8[k] = o.qs[4 * k] + o.qs[4 * k + 1] + o.qs[4 * k + 2] + o.qs[4 * k + 3];
    for (int k = 0; k < 4; ++k) o.lsum4[k] = o.lsum8[k] + o.lsum8[k + 4];
    o.d = d;
    o.s = d * (float)sum;
  }
}

void quantize_q8_K(block_q8_K* xq, const float* x, int cols) {
  for (int b = 0; b < cols / QK_K; ++b, x += QK_K) {
    block_q8_K& o = xq[b];
    float amax = 0.0f;
    for (int j = 0; j < QK_K; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < QK_K; ++j) o.qs[j] = (int8_t)std::nearbyint(x[j] * id);
    for (int c = 0; c < 16; ++c) {
      int s = 0;
      for (int l = 0; l < 16; ++l) s += o.qs[16 * c + l];
      o.bsums[c] = (int16_t)s;
    }
    o.d = d;
  }
}

void act_residual(WType wt, const void* xa, const float* x, int cols, float* r) {
  if (block_elems(wt) == QK_K) {
    const block_q8_K* b = (const block_q8_K*)xa;
    for (int c = 0; c < cols; ++c) r[c] = x[c] - b[c / QK_K].d * b[c / QK_K].qs[c % QK_K];
  } else {
    const block_q8a* b = (const block_q8a*)xa;
    for (int c = 0; c < cols; ++c) r[c] = x[c] - b[c / QK].d * b[c / QK].qs[c % QK];
  }
}

void prepare_act(WType wt, AType at, void* xa, const float* x, int cols) {
  if (at == AType::Q8x2) {  // level 1, then the int8 quantization of what it misses
    prepare_act(wt, AType::Q8, xa, x, cols);
    thread_local std::vector<float> r;
    r.resize((size_t)cols);
    act_residual(wt, xa, x, cols, r.data());
    prepare_act(wt, AType::Q8, (uint8_t*)xa + act_bytes(wt, AType::Q8, cols), r.data(), cols);
    return;
  }
  if (at == AType::F32) std::memcpy(xa, x, (size_t)cols * sizeof(float));
  else if (block_elems(wt) == QK_K) quantize_q8_K((block_q8_K*)xa, x, cols);
  else quantize_q8a((block_q8a*)xa, x, cols);
}

GemvFn gemv_fn(WType wt, AType at, Isa isa, Isa* used, Pack pack) {
  const bool planes = pack == Pack::Planes;
  const GemvTable& ref = planes ? ref_planes() : kRefTable;
  const int i = wtype_index(wt), a = (int)at;
  if (i < 0 || a < 0 || a > 2 || !ref[i][a]) return nullptr;
#if defined(CFLOW_X86)
  const GemvTable& t512 = planes ? gemv_planes_avx512() : gemv_table_avx512();
  if (isa == Isa::Avx512 && isa_supported(Isa::Avx512) && t512[i][a]) {
    if (used) *used = Isa::Avx512;
    return t512[i][a];
  }
  const GemvTable& t2 = planes ? gemv_planes_avx2() : gemv_table_avx2();
  if (isa >= Isa::Avx2 && isa_supported(Isa::Avx2) && t2[i][a]) {
    if (used) *used = Isa::Avx2;
    return t2[i][a];
  }
#endif
  if (used) *used = Isa::Scalar;
  return ref[i][a];
}

void unpack_planes(WType wt, const uint8_t* src, uint8_t* dst, int nr, int cols, const TileShape& ts) {
  const int qk = block_elems(wt), bb = block_bytes(wt), hdr = planes_header(wt);
  const int nbr = cols / qk, bpt = ts.tc / qk;
  size_t off = 0;  // chunks follow one another in payload order: tile, group, column block
  for (int cb0 = 0; cb0 < nbr; cb0 += bpt) {
    const int nb = nbr - cb0 < bpt ? nbr - cb0 : bpt;
    for (int g0 = 0; g0 < nr; g0 += ts.g) {
      const int gg = nr - g0 < ts.g ? nr - g0 : ts.g;
      for (int b = 0; b < nb; ++b, off += (size_t)gg * bb)
        for (int i = 0; i < gg; ++i) planes_get(src + off, gg, i, hdr, bb, dst + off + (size_t)i * bb);
    }
  }
}

void gemv(WType wt, AType at, Isa isa, float* y, const void* x, const uint8_t* w, int rows,
          int cols, const TileShape& ts, ThreadPool* pool) {
  GemvFn fn = gemv_fn(wt, at, isa, nullptr, ts.pack);
  if (!fn) return;
  const int n_stripes = (rows + ts.tr - 1) / ts.tr;
  auto body = [&](int s0, int s1) {
    const int r0 = s0 * ts.tr, r1 = s1 * ts.tr < rows ? s1 * ts.tr : rows;
    fn(y + r0, x, w, rows, cols, ts, r0, r1);
  };
  if (!pool || pool->size() == 1) body(0, n_stripes);
  else pool->parallel_for(n_stripes, 1, body);
}

namespace {
inline float silu(float g) { return g / (1.0f + std::exp(-g)); }
inline float gelu_tanh(float g) {
  const float c = 0.7978845608028654f;  // sqrt(2/pi)
  return 0.5f * g * (1.0f + std::tanh(c * (g + 0.044715f * g * g * g)));
}
}  // namespace

void gemv_glu(WType wt, AType at, Isa isa, Glu act, float* out, const void* x, const uint8_t* w,
              int ff, int cols, const TileShape& ts, ThreadPool* pool) {
  GemvFn fn = gemv_fn(wt, at, isa, nullptr, ts.pack);
  if (!fn) return;
  const int rows = 2 * ff, h = ts.tr / 2;
  const int n_stripes = (rows + ts.tr - 1) / ts.tr;
  auto body = [&](int s0, int s1) {
    float buf[1024];
    std::vector<float> big;
    float* gu = buf;
    if (ts.tr > 1024) {
      big.resize(ts.tr);
      gu = big.data();
    }
    for (int s = s0; s < s1; ++s) {
      const int r0 = s * ts.tr, nr = rows - r0 < ts.tr ? rows - r0 : ts.tr, half = nr / 2;
      fn(gu, x, w, rows, cols, ts, r0, r0 + nr);  // gu: gate (half) then up (half)
      float* o = out + (size_t)s * h;
      if (act == Glu::Silu)
        for (int i = 0; i < half; ++i) o[i] = silu(gu[i]) * gu[half + i];
      else
        for (int i = 0; i < half; ++i) o[i] = gelu_tanh(gu[i]) * gu[half + i];
    }
  };
  if (!pool || pool->size() == 1) body(0, n_stripes);
  else pool->parallel_for(n_stripes, 1, body);
}

}  // namespace cflow
