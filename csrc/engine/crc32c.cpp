// CRC-32C: reflected polynomial 0x82F63B78, initial and final XOR 0xFFFFFFFF.
//
// The hardware path runs three streams of a block at once (the crc32 instruction has a latency
// of three cycles and a throughput of one), then folds them into one value. Folding multiplies
// a stream's CRC by x^(8 * bytes after it) modulo the polynomial: shift_table() precomputes that
// multiplication for one block length as four 256-entry tables (one per byte of the CRC), so a
// fold is four lookups. A tail shorter than a block goes through the plain loop.
#include "cflow/crc32c.h"

#include <cstring>

#if defined(CFLOW_X86)
#include <immintrin.h>
#endif

namespace cflow {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;

struct Table {
  uint32_t t[8][256];  // slicing-by-8
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};
const Table& table() {
  static const Table tab;
  return tab;
}

// The raw CRC state (no XORs) advanced over n bytes, by table.
uint32_t sw(const uint8_t* p, size_t n, uint32_t c) {
  const Table& T = table();
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;
    c = T.t[7][w & 0xFF] ^ T.t[6][(w >> 8) & 0xFF] ^ T.t[5][(w >> 16) & 0xFF] ^ T.t[4][(w >> 24) & 0xFF] ^
        T.t[3][(w >> 32) & 0xFF] ^ T.t[2][(w >> 40) & 0xFF] ^ T.t[1][(w >> 48) & 0xFF] ^ T.t[0][w >> 56];
  }
  for (; n; --n, ++p) c = (c >> 8) ^ T.t[0][(c ^ *p) & 0xFF];
  return c;
}

#if defined(CFLOW_X86)
constexpr size_t kBlock = 8192;  // bytes per stream in one round of three

// Multiplication of a raw CRC state by x^(8 kBlock): the state after kBlock zero bytes, linear in
// the state, so a table per state byte.
struct Shift {
  uint32_t t[4][256];
  Shift() {
    for (int b = 0; b < 4; ++b)
      for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i << (8 * b);
        for (size_t k = 0; k < kBlock; ++k) c = (c >> 8) ^ table().t[0][c & 0xFF];
        t[b][i] = c;
      }
  }
  uint32_t operator()(uint32_t c) const { return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24]; }
};
const Shift& shift() {
  static const Shift s;
  return s;
}

__attribute__((target("sse4.2"))) uint32_t hw(const uint8_t* p, size_t n, uint32_t c) {
  uint64_t c0 = c;
  while (n >= 3 * kBlock) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t *p1 = p + kBlock, *p2 = p + 2 * kBlock;
    for (size_t i = 0; i < kBlock; i += 8) {
      uint64_t a, b, d;
      std::memcpy(&a, p + i, 8);
      std::memcpy(&b, p1 + i, 8);
      std::memcpy(&d, p2 + i, 8);
      c0 = _mm_crc32_u64(c0, a);
      c1 = _mm_crc32_u64(c1, b);
      c2 = _mm_crc32_u64(c2, d);
    }
    const Shift& S = shift();
    c0 = S(S((uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t a;
    std::memcpy(&a, p, 8);
    c0 = _mm_crc32_u64(c0, a);
  }
  uint32_t r = (uint32_t)c0;
  for (; n; --n, ++p) r = _mm_crc32_u8(r, *p);
  return r;
}

bool have_sse42() {
  static const bool ok = __builtin_cpu_supports("sse4.2");
  return ok;
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(CFLOW_X86)
  if (have_sse42()) return ~hw(p, n, c);
#endif
  return ~sw(p, n, c);
}

uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc) {
  return ~sw(static_cast<const uint8_t*>(data), n, ~crc);
}

}  // namespace cflow
