// MappedFile and its SIGBUS guard: a file truncated while mapped reads zeros past its new end
// (and the mapping says it is lost) instead of killing the process.
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "cflow/mapping.h"
#include "test_util.h"

namespace {

std::string temp_file(size_t n, uint8_t fill) {
  char name[] = "/tmp/cflow_test_mapping_XXXXXX";
  const int fd = mkstemp(name);
  CHECK(fd >= 0);
  std::vector<uint8_t> b(n, fill);
  CHECK(write(fd, b.data(), n) == (ssize_t)n);
  close(fd);
  return name;
}

uint64_t sum(const uint8_t* p, size_t n) {
  uint64_t s = 0;
  for (size_t i = 0; i < n; ++i) s += reinterpret_cast<const volatile uint8_t*>(p)[i];
  return s;
}

}  // namespace

TEST(mapping_reads_the_file) {
  const std::string path = temp_file(3 * 4096 + 100, 7);
  {
    cflow::MappedFile f(path);
    CHECK(f.size() == 3 * 4096 + 100);
    CHECK(sum(f.data(), f.size()) == 7u * f.size());
    CHECK(!f.lost());
    CHECK(f.stat().size == f.opened().size && f.stat().ino == f.opened().ino);
  }
  unlink(path.c_str());
  bool threw = false;
  try {
    cflow::MappedFile missing(path);
  } catch (const std::exception&) {
    threw = true;
  }
  CHECK(threw);
}

TEST(mapping_survives_truncation) {
  if (!cflow::map_guard_supported()) return;
  const size_t page = (size_t)sysconf(_SC_PAGESIZE), n = 64 * page;
  const std::string path = temp_file(n, 1);
  cflow::MappedFile f(path);
  CHECK(f.guarded());
  CHECK(sum(f.data(), n) == n);  // every page in
  CHECK(truncate(path.c_str(), 8 * page) == 0);
  // Pages past the new end are gone: without the guard this read is a SIGBUS.
  CHECK(sum(f.data(), n) == 8 * page);
  CHECK(f.lost());
  CHECK(f.stat().size == 8 * page && f.opened().size == n);
  unlink(path.c_str());
}

TEST(mapping_guards_are_per_range) {
  if (!cflow::map_guard_supported()) return;
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const std::string a = temp_file(4 * page, 2), b = temp_file(4 * page, 3);
  cflow::MappedFile fa(a), fb(b);
  CHECK(truncate(a.c_str(), 0) == 0);
  CHECK(sum(fa.data(), fa.size()) == 0);
  CHECK(fa.lost() && !fb.lost());
  CHECK(sum(fb.data(), fb.size()) == 3 * 4 * page);
  unlink(a.c_str());
  unlink(b.c_str());
}
