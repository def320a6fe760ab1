// The planes pack of an interleave group (docs/FORMAT.md, 5.1), for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q4_K, Q5_K and Q6_K.
//
// A chunk is the g blocks of one column block of an interleave group (g rows, g <= 16): the
// same g * bb bytes as g whole blocks, regrouped. A block is H header bytes (fp16 words: d, and
// m for Q4_1 / Q5_1, dmin for Q4_K / Q5_K), at byte A of the block (planes_header_at: 0, Q6_K
// 208, its end), and Q = bb - H quant bytes, the block's other bytes in order (Q5_0, Q5_1: qh
// then qs; Q4_K: the 12 scale bytes then qs; Q5_K: scales, qh, qs; Q6_K: ql, qh, scales). In the
// chunk:
//   header word h of row i      at  2 * (h * g + i)                (all d, then all m / dmin)
//   quant bytes 4k .. 4k+3 of i at  H * g + 4 * (p * g + i)        (slice k of every row in plane
//                                                                   p = planes_slice_pos(k): k, but Q6_K)
// So with g = 16, slice k of the 16 rows is one 64-byte plane: for Q4_0/Q4_1 its low nibbles
// are weights 4k..4k+3 and its high nibbles 16+4k..16+4k+3 of each row, for Q8_0 weights
// 4k..4k+3. Q5_0's (and Q5_1's) plane 0 is the rows' qh (row i's 32 fifth bits in dword i, bit j
// for weight j), and its planes 1..4 are nibbles as Q4_0's planes 0..3. Q4_K's planes 0..2 are
// the packed 6-bit scales and mins (row i's scale bytes 4p..4p+3 in dword i of plane p), planes
// 3..34 its qs; Q5_K's planes 0..2 are the same scales, 3..10 its qh, 11..42 its qs; Q6_K's
// slices 0..31 are ql, 32..47 qh, 48..51 the int8 scales, in the planes of q6k_plane (docs/FORMAT.md
// 5.1 has the weights of each). The transform is a permutation of the chunk's bytes: lossless.
#pragma once
#include <atomic>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cflow/kernels.h"

namespace cflow {

// The plane that holds slice k of a Q6_K chunk (format version 3). Its planes lie in the order
// the kernels consume them, so that a chunk is read front to back: the 4 scale planes (slices
// 48..51), then per group q of 16 slices (half h = q / 2, e = q % 2; x86/planes_simd.h) its 4 qh
// planes (slices 32 + 8h + 4e ..), its 4 ql planes of quarters 0 and 2 (slices 16h + 4e ..) and
// its 4 ql planes of quarters 1 and 3 (slices 16h + 8 + 4e ..). In slice order (version 2) the
// kernel took each group from three places 1-2 KB apart, and the hardware prefetcher of an AMD
// Zen 4 core fell behind: 7.5 GB/s from DRAM on 1 thread against 23 in this order (docs/KERNELS.md).
constexpr int q6k_plane(int k) {
  if (k >= 48) return k - 48;                                      // scales
  if (k >= 32) return 4 + 12 * ((k - 32) / 4) + (k - 32) % 4;      // qh: group (k - 32) / 4
  return 4 + 12 * (2 * (k / 16) + k % 8 / 4) + 4 + 4 * (k % 16 / 8) + k % 4;  // ql
}
// The plane of slice k (quant bytes 4k .. 4k+3 of a block) in a chunk of type bt.
constexpr int planes_slice_pos(BlockType bt, int k) { return bt == BlockType::Q6_K ? q6k_plane(k) : k; }

// Calls f(chunk offset, block offset, bytes) for each piece of block i of a chunk of g blocks
// of type bt: its header words, then its quant slices (the one statement of the permutation).
template <class F>
inline void planes_pieces(BlockType bt, int g, int i, F&& f) {
  const int hdr = planes_header(bt), at = planes_header_at(bt), bb = block_bytes(bt);
  for (int h = 0; h < hdr / 2; ++h) f(2 * (h * g + i), at + 2 * h, 2);
  for (int k = 0; k < (bb - hdr) / 4; ++k)
    f(hdr * g + 4 * (planes_slice_pos(bt, k) * g + i), 4 * k < at ? 4 * k : 4 * k + hdr, 4);
}
// Block i of a chunk of g blocks of type bt <-> whole block bytes.
inline void planes_get(const uint8_t* chunk, int g, int i, BlockType bt, uint8_t* block) {
  planes_pieces(bt, g, i, [&](int c, int b, int n) { std::memcpy(block + b, chunk + c, n); });
}
inline void planes_put(uint8_t* chunk, int g, int i, BlockType bt, const uint8_t* block) {
  planes_pieces(bt, g, i, [&](int c, int b, int n) { std::memcpy(chunk + c, block + b, n); });
}

// A chunk of g < 16 rows spread to the 16-row positions of `wide` (16 * bb bytes), the missing
// rows zero: SIMD kernels then treat every group as a full one and drop the extra results.
inline void planes_widen(const uint8_t* chunk, int g, int hdr, int bb, uint8_t* wide) {
  std::memset(wide, 0, (size_t)kPlanesMaxG * bb);
  for (int h = 0; h < hdr / 2; ++h) std::memcpy(wide + 2 * h * kPlanesMaxG, chunk + 2 * h * g, (size_t)2 * g);
  for (int k = 0; k < (bb - hdr) / 4; ++k)
    std::memcpy(wide + hdr * kPlanesMaxG + 4 * k * kPlanesMaxG, chunk + hdr * g + 4 * k * g, (size_t)4 * g);
}

// Software prefetch of the chunk kPrefetchAhead bytes ahead of `chunk` (n bytes, one hint per
// cache line), issued by the SIMD kernels before each chunk. The payload is one linear stream,
// yet without it a GEMV thread read 13 GB/s where the probe read 16.7 (and 26 of 33 with two
// threads); 2048 bytes ahead brought both to the probe's figure, 1024 and 4096 less (docs/KERNELS.md).
// A prefetch past the end of the mapping is harmless: prefetches never fault.
constexpr size_t kPrefetchAhead = 2048;
// Whether the kernels issue their software prefetches (set_prefetch; CFLOW_PREFETCH=0 starts
// with them off): the A/B of explicit prefetch against the hardware prefetcher alone.
extern std::atomic<bool> g_prefetch;
inline void set_prefetch(bool on) { g_prefetch.store(on, std::memory_order_relaxed); }
inline bool prefetch_on() { return g_prefetch.load(std::memory_order_relaxed); }
inline void planes_prefetch(const uint8_t* chunk, size_t n) {
  if (!prefetch_on()) return;
  for (size_t o = 0; o < n; o += 64) __builtin_prefetch(chunk + kPrefetchAhead + o, 0, 3);
}
// The n bytes at p itself into L2 (prefetcht2): the pair walk's two streams, which it prefetches
// whole pairs ahead (x86/planes_simd.h walk_planes_pairs).
inline void planes_prefetch_l2(const uint8_t* p, size_t n) {
  if (!prefetch_on()) return;
  for (size_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 1);
}
// The K-quants' chunks (2304-3360 bytes, 36-53 lines) are prefetched a quarter at a time, by
// their GEMVs before each of the 4 groups of slices they read: the whole chunk at once, as the
// 32-blocks' 5-9 lines are, put bursts of 36-53 prefetches ahead of the loads, and on a Zen 4 core
// that made the K-quant GEMVs 13-37% slower than no software prefetch at all; a quarter at a time
// they are within the measurements' noise of it there (docs/KERNELS.md).
inline void planes_prefetch_quarter(const uint8_t* chunk, size_t n, int q) {
  if (!prefetch_on()) return;
  const size_t a = n * q / 4 / 64 * 64, b = q == 3 ? n : n * (q + 1) / 4 / 64 * 64;
  for (size_t o = a; o < b; o += 64) __builtin_prefetch(chunk + kPrefetchAhead + o, 0, 3);
}

// Calls f(S, ws, lo, hi, ys) for each stripe met by rows [r0, r1) of a planes-packed L, with
// S the stripe as a whole-block matrix of its own (ws: a per-thread buffer), rows [lo, hi) of
// it, and ys = y + (the output offset of its row lo). The GEMV and GEMM of a type's whole blocks
// read planes this way where no kernel reads the pack itself (the fp32 paths, the references).
template <class F>
void for_unpacked_stripes(const TileLayout& L, const uint8_t* w, int r0, int r1, float* y, F&& f) {
  thread_local std::vector<uint8_t> buf;
  const size_t row_bytes = (size_t)(L.cols / L.qk) * L.bb;
  TileLayout S = L;
  S.pack = (int)Pack::Blocks;
  r1 = std::min(r1, L.rows);
  for (int r = r0; r < r1;) {
    const int sr = r / L.tr * L.tr, nr = std::min(L.tr, L.rows - sr), end = std::min(r1, sr + nr);
    buf.resize((size_t)nr * row_bytes);
    unpack_planes(L, w + (size_t)sr * row_bytes, buf.data(), nr);
    S.rows = nr;
    f((const TileLayout&)S, (const uint8_t*)buf.data(), r - sr, end - sr, y + (r - r0));
    r = end;
  }
}

// The planes-packed GEMV made from a whole-block kernel F of the same type and activation.
template <GemvFn F>
void gemv_unpacked(float* y, const void* x, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  for_unpacked_stripes(L, w, row_begin, row_end, y, [&](const TileLayout& S, const uint8_t* ws, int lo, int hi, float* ys) {
    F(ys, x, ws, S, lo, hi);
  });
}

// The two-level GEMV (AType::Q8x2) from a one-level kernel F: F on each level's row, summed.
// The scalar definition the single-pass SIMD kernels match, and the form of the types that have
// no single-pass kernel.
template <GemvFn F>
void gemv_two_levels(float* y, const void* x, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  thread_local std::vector<float> y2;
  const int n = std::min(row_end, L.rows) - row_begin;
  if (n <= 0) return;
  y2.resize((size_t)n);
  F(y, x, w, L, row_begin, row_end);
  F(y2.data(), (const uint8_t*)x + act_bytes(L.bt(), AType::Q8, L.cols), w, L, row_begin, row_end);
  for (int i = 0; i < n; ++i) y[i] += y2[i];
}

}  // namespace cflow
