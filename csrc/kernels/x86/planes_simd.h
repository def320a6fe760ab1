// Planes-pack pieces shared by the AVX2 and AVX-512 kernel files (cflow/planes.h, docs/KERNELS.md):
// included *inside* each ISA's namespace, like gemv_simd.h. PlanesKind describes a type's
// chunk (the GEMVs and GEMMs); fill_planes_table fills the planes table from the including
// file's gemv_planes_q8 and gemv_kplanes_q8 (its own kernels) and gemv_f32 (gemv_simd.h) after unpacking.

template <BlockType WT>
struct PlanesKind {
  static constexpr int kHdr = planes_header(WT);  // header bytes: d (and m)
  static constexpr int kBB = block_bytes(WT);
  static constexpr bool kNib = WT != BlockType::Q8_0;  // packed nibbles (two weights per byte)
  // a plane of fifth bits (qh) before the nibbles
  static constexpr bool kFifth = WT == BlockType::Q5_0 || WT == BlockType::Q5_1;
  static constexpr bool kHasM = WT == BlockType::Q4_1 || WT == BlockType::Q5_1;  // header word 1: the min m
  // Byte offsets in a 16-row chunk: the qh plane (Q5_0, Q5_1), the first plane of quants.
  static constexpr int kQh = kPlanesMaxG * kHdr;
  static constexpr int kQs = kQh + (kFifth ? 64 : 0);
  // The kernels take weights as unsigned bytes u (x86/<isa>/planes_unpack.h); the block's
  // integer weight is u - kZero: Q4_0 q - 8, Q5_0 q - 16, Q8_0 (q ^ 0x80) - 128; the offset of
  // Q4_1 and Q5_1 is their m. kMaxU: the largest u.
  static constexpr int kZero = WT == BlockType::Q4_0 ? 8 : WT == BlockType::Q5_0 ? 16 : WT == BlockType::Q8_0 ? 128 : 0;
  static constexpr int kMaxU = kFifth ? 31 : kNib ? 15 : 255;
};

// Whether WT's planes are a K-quant's (KPlanesKind) rather than a 32-block type's (PlanesKind).
template <BlockType WT>
constexpr bool kKQuant = WT == BlockType::Q4_K || WT == BlockType::Q5_K || WT == BlockType::Q6_K;

// One interleave group of walk_planes: group(r, gg, cb0, nb, chunk) for the group at grp.
template <BlockType WT, class GroupF>
inline void planes_group_at(const uint8_t* grp, int r, int gg, int cb0, int nb, GroupF&& group) {
  using K = PlanesKind<WT>;
  alignas(64) uint8_t wide[kPlanesMaxG * K::kBB];
  const size_t step = (size_t)gg * K::kBB;
  auto chunk = [&](int b) -> const uint8_t* {
    const uint8_t* c = grp + b * step;
    // a full chunk's lines whatever gg (a ragged group's prefetches run a little past its chunk,
    // harmlessly): with the count a constant the hints are unrolled, where the loop over a run-time
    // count cost five instructions a line, a tenth of a one-token Q4_0 GEMV's
    if constexpr (!kKQuant<WT>) planes_prefetch(c, (size_t)kPlanesMaxG * K::kBB);
    if (gg == kPlanesMaxG) return c;
    planes_widen(c, gg, K::kHdr, K::kBB, wide);
    return wide;
  };
  group(r, gg, cb0, nb, chunk);
}

// Walks a planes payload by interleave group (walk_tiles): group(r, gg, cb0, nb, chunk), with
// chunk(b) the 16-row chunk of column block b, prefetched ahead (planes_prefetch; a K-quant GEMV
// prefetches its chunks a quarter at a time itself, planes_prefetch_quarter) and widened to 16
// rows in a stack buffer when the group is ragged (planes_widen).
template <BlockType WT, class GroupF>
inline void walk_planes(float* y, const uint8_t* w, const TileLayout& L, int row_begin, int row_end, GroupF&& group) {
  walk_tiles(y, w, L, row_begin, row_end, [&](const uint8_t* grp, int r, int gg, int cb0, int nb) {
    planes_group_at<WT>(grp, r, gg, cb0, nb, group);
  });
}

// walk_planes two full groups at a time, where a tile has them: pair(r, cb0, nb, chunks) for
// the groups of rows r .. r+15 and r+16 .. r+31, chunks(b, ca, cb) setting their chunks of
// column block b (prefetched ahead), and group(...) as walk_planes for the rest. A kernel that
// meets two groups' weights with each activation broadcast halves its broadcasts.
// The two groups' chunks are two interleaved streams a group apart, which the hardware
// prefetcher does not follow: a one-token Q4_1 GEMV over 84 MB, 1 thread, took 38.5 ns per
// 16-row block without software prefetch against 16.1 for the one-group walk, 30.7 with
// planes_prefetch (prefetcht0, 2 KB ahead), 27.4 with prefetcht0 a pair ahead. So the pairs
// prefetch into L2 (prefetcht2) the same chunks of the pair about kPairAhead bytes on (whole
// pairs, so that each address is one the walk will read): 14.2-15.2 ns, the one-group walk's rate.
constexpr size_t kPairAhead = 16 << 10;

template <BlockType WT, class PairF, class GroupF>
inline void walk_planes_pairs(float* y, const uint8_t* w, const TileLayout& L, int row_begin, int row_end,
                              PairF&& pair_fn, GroupF&& group) {
  using K = PlanesKind<WT>;
  walk_tiles_whole(y, w, L, row_begin, row_end, [&](const uint8_t* tile, int r, int nr, int cb0, int nb) {
    const size_t gbytes = (size_t)nb * L.bb;  // per row of a group: group g0 at tile + g0 * gbytes
    int g0 = 0;
    if (L.g == kPlanesMaxG)
      for (; g0 + 2 * kPlanesMaxG <= nr; g0 += 2 * kPlanesMaxG) {
        const uint8_t* ga = tile + (size_t)g0 * gbytes;
        const uint8_t* gb = ga + kPlanesMaxG * gbytes;
        const size_t step = (size_t)kPlanesMaxG * K::kBB;
        const size_t pair = 2 * kPlanesMaxG * gbytes;
        const size_t ahead = pair * std::max<size_t>(1, (kPairAhead + pair - 1) / pair);  // whole pairs
        pair_fn(r + g0, cb0, nb, [&](int b, const uint8_t*& ca, const uint8_t*& cb) {
          ca = ga + b * step, cb = gb + b * step;
          if constexpr (!kKQuant<WT>) planes_prefetch_l2(ca + ahead, step), planes_prefetch_l2(cb + ahead, step);
        });
      }
    for (; g0 < nr; g0 += L.g)
      planes_group_at<WT>(tile + (size_t)g0 * gbytes, r + g0, std::min(L.g, nr - g0), cb0, nb, group);
  });
}

// The K-quants' chunk (docs/FORMAT.md 5.1), as their kernels walk it: 4 groups of 16 slices of
// 4 weights (one 64-byte plane of 16 rows each, once unpacked), a group being kSubs sub-blocks
// of kSlices slices: u[k] of group q is slice k % kSlices of sub-block sub(q, k / kSlices).
//   Q4_K  group q = qs planes 8q .. 8q+7: their low nibbles sub-block 2q, high nibbles 2q + 1;
//   Q5_K  the same from qs planes 8 (q + 1) .. +7 (the 8 qh planes come first), each slice j
//         with bits 2q (low nibbles) and 2q + 1 (high) of qh plane j as its bit 4;
//   Q6_K  group q = half q / 2, qh slices 4 (q % 2) .. +3 of it with their ql slices: slice
//         m of quarter t (u[4t + m]) is in sub-block 8 (q / 2) + 2t + q % 2. Its 12 planes lie
//         together, in the order read (q6k_plane, cflow/planes.h).
// Q4_K and Q5_K (kQ4: the Q4_K layout) share the scale planes 0..2, their 6-bit scales and mins.
// Weights are unsigned (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63: the integer weight plus kZero). Activations are
// block_q8_K (one scale per 256: the whole super-block's integer sum is exact, and one float
// finish per super-block takes d and dmin, docs/KERNELS.md); sub-block s meets its bytes
// qs[kSubW * s ..], its sum of qs (for the offsets and mins) from bsums.
template <BlockType WT>
struct KPlanesKind {
  static constexpr bool kQ4 = WT == BlockType::Q4_K || WT == BlockType::Q5_K;  // Q4_K's scales, mins, sub-blocks
  static constexpr bool kFifth = WT == BlockType::Q5_K;  // 8 qh planes (3..10) before the qs planes
  static constexpr int kQsPlane = kFifth ? 11 : 3;       // the first qs plane (kQ4)
  static constexpr int kHdr = planes_header(WT), kBB = block_bytes(WT);
  static constexpr int kSubs = kQ4 ? 2 : 4;       // sub-blocks per group
  static constexpr int kSlices = kQ4 ? 8 : 4;     // slices per sub-block
  static constexpr int kSubW = 4 * kSlices;       // weights per sub-block
  static constexpr int kNumSub = 256 / kSubW;     // sub-blocks per super-block
  static constexpr int kZero = kQ4 ? 0 : 32;
  static constexpr int kMaxU = kFifth ? 31 : kQ4 ? 15 : 63;
  static constexpr int kPlanes = kPlanesMaxG * kHdr;  // byte offset of plane 0 in a 16-row chunk
  static constexpr int sub(int q, int r) { return kQ4 ? 2 * q + r : 8 * (q / 2) + 2 * r + q % 2; }
  // Q6_K's planes of group q: slice m (0..3) of its qh, of its ql of quarters 0 and 2 (hi = 0) or
  // 1 and 3 (hi = 1), and sub-block s's scales (byte s % 4 of the plane).
  static constexpr int q6_qh(int q, int m) { return q6k_plane(32 + 8 * (q / 2) + 4 * (q % 2) + m); }
  static constexpr int q6_ql(int q, int hi, int m) { return q6k_plane(16 * (q / 2) + 8 * hi + 4 * (q % 2) + m); }
  static constexpr int q6_scales(int s) { return q6k_plane(48 + s / 4); }
  // Sub-block s's sum of activations (16-sums in bsums).
  static int asum(const block_q8_K& a, int s) { return kQ4 ? a.bsums[2 * s] + a.bsums[2 * s + 1] : a.bsums[s]; }
};

// f(std::integral_constant<int, n>) for 1 <= n <= N: a token count as a template argument.
template <int N, class F>
inline void with_count(int n, F&& f) {
  if constexpr (N >= 1) {
    if (n == N) return f(std::integral_constant<int, N>{});
    with_count<N - 1>(n, f);
  }
}

// The batched GEMV (kernels.h GemvBatchFn) of a planes type with int8 activations:
// pick(integral_constant<BlockType>, integral_constant<bool, two levels>) names the kernel;
// nullptr for other types, packs and activations.
template <class Pick>
inline GemvBatchFn planes_batch_fn(BlockType bt, Pack pack, AType at, Pick&& pick) {
  if (pack != Pack::Planes || (at != AType::Q8 && at != AType::Q8x2)) return nullptr;
  auto both = [&](auto wt) {
    return at == AType::Q8x2 ? pick(wt, std::true_type{}) : pick(wt, std::false_type{});
  };
  switch (bt) {
    case BlockType::Q4_0: return both(std::integral_constant<BlockType, BlockType::Q4_0>{});
    case BlockType::Q4_1: return both(std::integral_constant<BlockType, BlockType::Q4_1>{});
    case BlockType::Q5_0: return both(std::integral_constant<BlockType, BlockType::Q5_0>{});
    case BlockType::Q5_1: return both(std::integral_constant<BlockType, BlockType::Q5_1>{});
    case BlockType::Q8_0: return both(std::integral_constant<BlockType, BlockType::Q8_0>{});
    case BlockType::Q4_K: return both(std::integral_constant<BlockType, BlockType::Q4_K>{});
    case BlockType::Q5_K: return both(std::integral_constant<BlockType, BlockType::Q5_K>{});
    case BlockType::Q6_K: return both(std::integral_constant<BlockType, BlockType::Q6_K>{});
    default: return nullptr;
  }
}

template <BlockType WT, bool TWO>
void gemv_planes_q8(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end);
template <BlockType WT, bool TWO>
void gemv_kplanes_q8(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end);

inline void fill_planes_table(KernelTable& t) {
  auto set = [&](BlockType bt, GemvFn q8, GemvFn q8x2) {
    t.gemv[block_index(bt)][(int)Pack::Planes][(int)AType::Q8] = q8;
    t.gemv[block_index(bt)][(int)Pack::Planes][(int)AType::Q8x2] = q8x2;
  };
  set(BlockType::Q4_0, gemv_planes_q8<BlockType::Q4_0, false>, gemv_planes_q8<BlockType::Q4_0, true>);
  set(BlockType::Q4_1, gemv_planes_q8<BlockType::Q4_1, false>, gemv_planes_q8<BlockType::Q4_1, true>);
  set(BlockType::Q5_0, gemv_planes_q8<BlockType::Q5_0, false>, gemv_planes_q8<BlockType::Q5_0, true>);
  set(BlockType::Q5_1, gemv_planes_q8<BlockType::Q5_1, false>, gemv_planes_q8<BlockType::Q5_1, true>);
  set(BlockType::Q8_0, gemv_planes_q8<BlockType::Q8_0, false>, gemv_planes_q8<BlockType::Q8_0, true>);
  set(BlockType::Q4_K, gemv_kplanes_q8<BlockType::Q4_K, false>, gemv_kplanes_q8<BlockType::Q4_K, true>);
  set(BlockType::Q5_K, gemv_kplanes_q8<BlockType::Q5_K, false>, gemv_kplanes_q8<BlockType::Q5_K, true>);
  set(BlockType::Q6_K, gemv_kplanes_q8<BlockType::Q6_K, false>, gemv_kplanes_q8<BlockType::Q6_K, true>);
}
