// The prefill GEMM of every ISA this CPU runs, on one matrix, one thread (the kernel called
// directly, no thread pool): GMAC/s, best and median of --repeats runs, int8 activations.
//   build/dev/cflow_bench_gemm [--type q4_1] [--pack planes|blocks] [--rows 3072] [--cols 576]
//                              [--tokens 512] [--levels 1|2] [--repeats 7] [--batched 1]
//                              [--tile-cols 256] [--pass 8] [--isa scalar|avx2|avx512]
// --isa: the GEMM on that ISA only (default: every ISA the CPU has; e.g. to profile one kernel)
// --batched 1: the batched decode GEMV (gemv_batch_fn, any planes type, the K-quants included)
// over the tokens in calls of --pass tokens (8: as a decode step of 8 sequences runs it), against
// the one-token GEMV run token by token; also ns per (token, 16 x 32 weights).
// --quantize 1: the activation quantizers instead (block_q8a rows of --cols, --levels levels, the
// rows a step prepares: --tokens of them), per ISA: microseconds a row.
// Defaults: SmolLM2-135M's gate+up (3072 x 576, Q4_1, planes at interleave 16, as `cflow
// convert` writes it) against a 512-token prompt. Weights are random bytes with sane fp16
// scales: a GEMM's speed does not depend on the values.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cflow/cpu.h"
#include "cflow/gemm.h"
#include "cflow/kernels.h"
#include "cflow/planes.h"

using namespace cflow;

// Seconds of f(), best and median of `repeats` runs.
template <class F>
static std::pair<double, double> timed(int repeats, F&& f) {
  std::vector<double> sec;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    sec.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(sec.begin(), sec.end());
  return {sec[0], sec[sec.size() / 2]};
}

static int bench_batched(BlockType bt, const TileLayout& L, const std::vector<uint8_t>& w,
                         const std::vector<float>& x, int tokens, int levels, int repeats, int pass) {
  const AType at = levels == 2 ? AType::Q8x2 : AType::Q8;
  const Isa isa = best_isa();
  const GemvFn one = gemv_fn(bt, Pack::Planes, at, isa);
  const GemvBatchFn batch = gemv_batch_fn(bt, Pack::Planes, at, isa);
  if (!one || !batch) {
    std::fprintf(stderr, "no batched GEMV for this type on %s\n", isa_name(isa));
    return 2;
  }
  const size_t ab = act_bytes(bt, at, L.cols);
  std::vector<uint8_t> xa((size_t)tokens * ab);
  for (int k = 0; k < tokens; ++k) prepare_act(bt, at, xa.data() + k * ab, x.data() + (size_t)k * L.cols, L.cols);
  std::vector<float> y((size_t)tokens * L.rows);
  const double units = (double)tokens * L.rows * L.cols / (16.0 * 32.0), macs = (double)tokens * L.rows * L.cols;
  std::printf("%s planes, %d x %d, %d tokens, %d level(s), 1 thread, %s, best / median of %d\n", block_name(bt), L.rows,
              L.cols, tokens, levels, isa_name(isa), repeats);
  const auto b = timed(repeats, [&] {
    for (int k0 = 0; k0 < tokens; k0 += pass)
      batch(y.data() + (size_t)k0 * L.rows, L.rows, xa.data() + k0 * ab, std::min(pass, tokens - k0), w.data(), L, 0,
            L.rows);
  });
  const auto o = timed(repeats, [&] {
    for (int k = 0; k < tokens; ++k) one(y.data() + (size_t)k * L.rows, xa.data() + k * ab, w.data(), L, 0, L.rows);
  });
  std::printf("  batched (%d a call) %7.1f / %7.1f GMAC/s, %.2f ns per (token, 16x32)\n", pass, macs / b.first * 1e-9,
              macs / b.second * 1e-9, b.first / units * 1e9);
  std::printf("  gemv (1 a pass)    %7.1f / %7.1f GMAC/s, %.2f ns per (token, 16x32)\n", macs / o.first * 1e-9,
              macs / o.second * 1e-9, o.first / units * 1e9);
  return 0;
}

// Every ISA's block_q8a quantizer (two levels: then level 2) over `tokens` rows of x.
static int bench_quantize(const std::vector<float>& x, int cols, int tokens, int levels, int repeats, const std::string& only) {
  if (cols % QK) {
    std::fprintf(stderr, "--cols: a multiple of %d\n", QK);
    return 2;
  }
  std::printf("block_q8a activations, %d columns, %d level(s), %d rows a pass, 1 thread, best / median of %d\n", cols,
              levels, tokens, repeats);
  const size_t rb = q8a_row_bytes(cols);
  std::vector<uint8_t> a((size_t)tokens * rb * levels);
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512}) {
    if (!isa_supported(isa) || (!only.empty() && only != isa_name(isa))) continue;
    const KernelTable& T = kernel_table(isa);
    std::vector<double> sec;
    for (int r = 0; r < repeats; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < tokens; ++k) {
        block_q8a* l1 = (block_q8a*)(a.data() + (size_t)k * rb * levels);
        T.quantize_q8a(l1, x.data() + (size_t)k * cols, cols);
        if (levels == 2) T.quantize_q8a_level2((block_q8a*)((uint8_t*)l1 + rb), l1, x.data() + (size_t)k * cols, cols);
      }
      sec.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(sec.begin(), sec.end());
    std::printf("  %-7s %7.3f / %7.3f us a row\n", isa_name(isa), sec[0] / tokens * 1e6, sec[sec.size() / 2] / tokens * 1e6);
  }
  return 0;
}

int main(int argc, char** argv) {
  std::string type = "q4_1", pack = "planes", only;
  int rows = 3072, cols = 576, tokens = 512, repeats = 7, levels = 1, batched = 0, tile_cols = 256, pass = 8,
      quantize = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--type") type = v;
    else if (k == "--pack") pack = v;
    else if (k == "--rows") rows = std::atoi(v.c_str());
    else if (k == "--cols") cols = std::atoi(v.c_str());
    else if (k == "--tokens") tokens = std::atoi(v.c_str());
    else if (k == "--repeats") repeats = std::atoi(v.c_str());
    else if (k == "--levels") levels = std::atoi(v.c_str());
    else if (k == "--batched") batched = std::atoi(v.c_str());
    else if (k == "--tile-cols") tile_cols = std::atoi(v.c_str());
    else if (k == "--pass") pass = std::atoi(v.c_str());
    else if (k == "--isa") only = v;
    else if (k == "--quantize") quantize = std::atoi(v.c_str());
    else { std::fprintf(stderr, "unknown option %s\n", k.c_str()); return 2; }
  }
  BlockType bt;
  if (!block_from_name(type.c_str(), &bt) || !(batched ? planes_header(bt) > 0 : has_int8_path(bt, true))) {
    std::fprintf(stderr, batched ? "--type: a type with a planes pack\n" : "--type: one of q4_0, q4_1, q5_0, q5_1, q8_0\n");
    return 2;
  }
  const char* err = nullptr;
  const Pack p = pack == "planes" ? Pack::Planes : Pack::Blocks;
  const TileLayout L = tile_layout(bt, rows, cols, 128, tile_cols, p == Pack::Planes ? kPlanesMaxG : 1, p, &err);
  if (repeats < 1 || tokens < 1 || levels < 1 || levels > 2 || err) {
    std::fprintf(stderr, "bad shape: %s\n", err ? err : "tokens and repeats must be positive");
    return 2;
  }
  std::mt19937 rng(1);
  std::vector<uint8_t> w(layout_nbytes(L));
  for (auto& b : w) b = (uint8_t)rng();
  // fp16 0.01 in every word that can be a scale (whole blocks: the header; planes: the chunk's
  // 16 (or 32) header words lead each chunk), so no value is a NaN or a denormal
  const uint16_t h = 0x211f;
  const size_t hdr = L.planes() ? (size_t)kPlanesMaxG * planes_header(bt) : (size_t)(planes_header(bt) ? planes_header(bt) : 2);
  const size_t unit = L.planes() ? (size_t)kPlanesMaxG * L.bb : (size_t)L.bb;
  for (size_t o = 0; o + unit <= w.size(); o += unit)
    for (size_t j = 0; j < hdr; j += 2) std::memcpy(&w[o + j], &h, 2);
  std::vector<float> x((size_t)tokens * cols), y((size_t)tokens * rows);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& v : x) v = u(rng);
  if (quantize) return bench_quantize(x, cols, tokens, levels, repeats, only);
  if (batched) return bench_batched(bt, L, w, x, tokens, levels, repeats, std::max(1, pass));
  QActs qa{tokens, cols, levels, nullptr};
  std::vector<uint8_t> b(qa.bytes());
  qa.data = b.data();
  quantize_acts(x.data(), cols, tokens, cols, qa);
  std::printf("%s %s, %d x %d, %d tokens, %d level(s), 1 thread, best / median of %d\n", type.c_str(), pack.c_str(),
              rows, cols, tokens, levels, repeats);
  const double macs = (double)tokens * rows * cols;
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512}) {
    if (!isa_supported(isa) || (!only.empty() && only != isa_name(isa))) continue;
    const GemmQ8Fn q8 = kernel_table(isa).gemm_q8[block_index(bt)][L.pack];
    std::vector<double> sec;
    for (int r = 0; r < repeats; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      q8(L, w.data(), 0, rows, qa, y.data(), rows);
      sec.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(sec.begin(), sec.end());
    std::printf("  %-7s %7.1f / %7.1f GMAC/s\n", isa_name(isa), macs / sec[0] * 1e-9, macs / sec[sec.size() / 2] * 1e-9);
  }
  return 0;
}
