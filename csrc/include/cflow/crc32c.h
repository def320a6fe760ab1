// CRC-32C (Castagnoli), the checksum of each expert's bytes in the expert offset table
// (docs/FORMAT.md 3.3). Chains like zlib's crc32: crc32c(b, crc32c(a)) == crc32c(a + b).
// SSE4.2's crc32 instruction where the CPU has it (about 8 bytes a cycle from three
// interleaved streams), a table otherwise; both give the same value.
#pragma once
#include <cstddef>
#include <cstdint>

namespace cflow {

uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc = 0);  // the table path alone (tests)

}  // namespace cflow
