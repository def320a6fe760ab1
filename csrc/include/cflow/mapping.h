// Read-only file mappings that survive the file changing under them (docs/ENGINE.md, "Model
// file changed on disk").
//
// A MAP_SHARED mapping of a file that is truncated while mapped raises SIGBUS on the next read
// of a page past the new end: without help, the process dies. MappedFile maps a file and
// registers the mapping's address range with a process-wide SIGBUS handler (Linux): a fault
// inside a registered range maps anonymous zero pages over the rest of the range, marks the
// range lost and returns, so the read goes on with zeros; the owner checks lost() after each
// use of the bytes and refuses the results. Faults anywhere else go to the handler installed
// before (or the default action: the process dies as it would have). A handler installed after
// the last guard_range (Python's faulthandler.enable() then, say) sees guarded faults first.
//
// Elsewhere (or with CFLOW_NO_MAP_GUARD) the mapping is made but not guarded: guarded() is
// false and a read past a shrunk file's end still kills the process.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#if defined(__linux__) && !defined(CFLOW_NO_MAP_GUARD)
#define CFLOW_MAP_GUARD 1
#endif

namespace cflow {

// Registers [addr, addr + length) (widened to whole pages) with the SIGBUS handler, installing
// it on first use (and again on top if another handler replaced it since). Returns a guard id,
// or -1 where guarding is not supported or every slot is taken (kMaxGuards).
int guard_range(const void* addr, size_t length);
void unguard_range(int id);     // before the range is unmapped; id -1 is ignored
bool range_lost(int id);        // a read of the range faulted: its pages from there on read as zeros
bool map_guard_supported();
constexpr int kMaxGuards = 256;

// Identity of a file as fstat sees it: a change of size or modification time under the same
// inode means the file was truncated or written in place.
struct FileStat {
  uint64_t dev = 0, ino = 0, size = 0;
  int64_t mtime_ns = 0;
};

class MappedFile {
 public:
  // Maps path read-only, whole; throws std::runtime_error naming the path and the OS error.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool guarded() const { return guard_ >= 0; }
  bool lost() const { return range_lost(guard_); }
  FileStat opened() const { return opened_; }  // the file when it was mapped
  FileStat stat() const;                        // the mapped file now (its inode, whatever its path names now)

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;  // kept open: stat() looks at the mapped inode itself
  int guard_ = -1;
  FileStat opened_;
};

}  // namespace cflow
