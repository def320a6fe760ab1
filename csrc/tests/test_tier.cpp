// CRC-32C (both paths, every length class) and the ExpertTier against a file of known experts:
// sync and staged reads give the file's bytes, a damaged expert is an error naming it, the
// cache keeps its size, and hints never evict a pinned expert.
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cflow/crc32c.h"
#include "cflow/expert_tier.h"
#include "test_util.h"

using namespace cflow;

TEST(crc32c_check_value_and_chaining) {
  const char* s = "123456789";
  CHECK(crc32c(s, 9) == 0xE3069283u);
  CHECK(crc32c_portable(s, 9) == 0xE3069283u);
  std::mt19937 rng(7);
  std::vector<uint8_t> b(3 * 8192 * 2 + 1234);
  for (auto& x : b) x = (uint8_t)rng();
  for (size_t n : {0ul, 1ul, 7ul, 8ul, 8191ul, 3 * 8192ul, 3 * 8192ul + 9, b.size()}) {
    CHECK(crc32c(b.data(), n) == crc32c_portable(b.data(), n));
    const size_t h = n / 3;
    CHECK(crc32c(b.data() + h, n - h, crc32c(b.data(), h)) == crc32c(b.data(), n));
  }
}

namespace {

// n experts of `len` bytes each at 4096-aligned offsets, random bytes.
struct ExpertFile {
  std::string path;
  std::vector<TierEntry> entries;
  std::vector<std::vector<uint8_t>> bytes;
  ExpertFile(int n, size_t len) {
    char name[] = "/tmp/cflow_test_tier_XXXXXX";
    const int fd = mkstemp(name);
    CHECK(fd >= 0);
    path = name;
    std::mt19937 rng(3);
    const size_t stride = (len + 4095) / 4096 * 4096;
    std::vector<uint8_t> all(stride * n + 4096, 0);
    for (int e = 0; e < n; ++e) {
      std::vector<uint8_t> b(len);
      for (auto& x : b) x = (uint8_t)rng();
      std::memcpy(all.data() + 4096 + stride * e, b.data(), len);
      entries.push_back({0, e, 4096 + stride * e, len, crc32c(b.data(), len)});
      bytes.push_back(std::move(b));
    }
    CHECK(write(fd, all.data(), all.size()) == (ssize_t)all.size());
    close(fd);
  }
  ~ExpertFile() { unlink(path.c_str()); }
};

}  // namespace

TEST(tier_reads_what_the_file_holds) {
  ExpertFile f(10, 10000);
  for (IoBackend io : {IoBackend::Pread, IoBackend::Uring}) {
    TierOptions opt;
    opt.path = f.path;
    opt.cache_bytes = 3 * 12288;  // three slots
    opt.backend = io;
    ExpertTier tier(opt, f.entries, 2);
    CHECK(tier.slots() == 3);
    for (int round = 0; round < 2; ++round)
      for (int e = 0; e < 10; ++e) {
        int slot;
        const uint8_t* p = tier.acquire_sync(e, &slot);
        CHECK(std::memcmp(p, f.bytes[e].data(), 10000) == 0);
        tier.unpin(slot);
        const int a = tier.request((e + 5) % 10), b = tier.request((e + 6) % 10);  // two in flight
        CHECK(std::memcmp(tier.wait(a), f.bytes[(e + 5) % 10].data(), 10000) == 0);
        CHECK(std::memcmp(tier.wait(b), f.bytes[(e + 6) % 10].data(), 10000) == 0);
        tier.unpin(a);
        tier.unpin(b);
      }
    const TierStats st = tier.stats();
    CHECK(st.hits + st.misses == 60);
    CHECK(st.reads == st.misses);
    CHECK(st.bytes_read == st.reads * 12288);
  }
}

TEST(tier_hints_never_evict_pinned_experts) {
  ExpertFile f(6, 5000);
  TierOptions opt;
  opt.path = f.path;
  opt.cache_bytes = 2 * 8192;
  ExpertTier tier(opt, f.entries, 1);
  const int a = tier.request(0), b = tier.request(1);
  CHECK(!tier.hint(2));  // both slots pinned
  CHECK(std::memcmp(tier.wait(a), f.bytes[0].data(), 5000) == 0);
  tier.unpin(a);
  CHECK(tier.hint(2));   // takes the unpinned slot
  CHECK(std::memcmp(tier.wait(b), f.bytes[1].data(), 5000) == 0);
  const int c = tier.request(2);
  CHECK(std::memcmp(tier.wait(c), f.bytes[2].data(), 5000) == 0);
  CHECK(tier.stats().hinted_used == 1);
  tier.unpin(b);
  tier.unpin(c);
}

TEST(tier_damaged_expert_is_an_error_naming_it) {
  ExpertFile f(4, 3000);
  f.entries[2].crc32c ^= 1;  // as if the bytes on disk changed
  TierOptions opt;
  opt.path = f.path;
  opt.cache_bytes = 4 * 4096;
  ExpertTier tier(opt, f.entries, 1);
  for (int pass = 0; pass < 2; ++pass) {  // sync, then staged: each refuses, every time
    std::string msg;
    int slot = -1;
    try {
      if (pass == 0) {
        tier.acquire_sync(2, &slot);
      } else {
        slot = tier.request(2);
        tier.wait(slot);
      }
    } catch (const std::runtime_error& e) {
      msg = e.what();
    }
    CHECK(msg.find("expert (layer 0, expert 2)") != std::string::npos);
    CHECK(msg.find("checksum mismatch") != std::string::npos);
    if (slot >= 0) tier.unpin(slot);
  }
  int slot;
  CHECK(std::memcmp(tier.acquire_sync(1, &slot), f.bytes[1].data(), 3000) == 0);  // the others still read
  tier.unpin(slot);
}

TEST(tier_too_small_a_cache_is_refused) {
  ExpertFile f(4, 3000);
  TierOptions opt;
  opt.path = f.path;
  opt.cache_bytes = 4096;
  bool threw = false;
  try {
    ExpertTier tier(opt, f.entries, 2);
  } catch (const std::runtime_error& e) {
    threw = std::string(e.what()).find("raise the RAM budget") != std::string::npos;
  }
  CHECK(threw);
}
