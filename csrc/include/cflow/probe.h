// STREAM-like read-bandwidth probe: the ceiling the GEMV benchmarks are measured against.
#pragma once
#include <cstddef>
#include <vector>

#include "cflow/cpu.h"

namespace cflow {

// Reads a buffer of `bytes` (allocated once, 2 MiB aligned, written before timing) with
// `threads` threads, each summing its contiguous share with the widest loads of `isa`
// (AVX-512, AVX2 or scalar), `repeats` times after one warm-up pass. Returns the read
// bandwidth of every timed pass in GB/s (1e9 bytes/s).
std::vector<double> probe_read(size_t bytes, int threads, int repeats, Isa isa);

// Sum of n floats (n % 64 == 0, p 64-byte aligned) with the loads of `isa` (the probe's body).
float read_sum(const float* p, size_t n, Isa isa);
namespace avx512 { float read_sum(const float* p, size_t n); }
namespace avx2 { float read_sum(const float* p, size_t n); }

}  // namespace cflow
