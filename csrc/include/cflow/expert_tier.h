// The expert tier on disk (docs/ENGINE.md, "Experts on disk").
//
// A mixture-of-experts model larger than its RAM budget keeps attention, dense and head weights
// mapped and reads experts from the .cflow file into a bounded pool of 4096-aligned buffers
// (slots), bypassing the page cache with O_DIRECT (a file system that refuses it gets buffered
// reads, and direct() says so). Each expert is one aligned read of its range (the writer pads
// every expert range to 4096 bytes), checked against the CRC-32C of the expert offset table
// before anyone uses it: a mismatch is an error naming the expert, never wrong output.
//
// The slots are a cache of hot experts: a slot keeps its expert until it is the least recently
// used of the unpinned ones and another expert needs a slot. A pinned slot (pins > 0: an expert a
// layer will use) is never evicted, nor one whose read is in flight.
//
// Two ways to read (the policies of the engine, EngineOptions::tier):
//   sync  : acquire_sync() reads a missing expert on the calling thread, one read at a time, when
//           the layer needs it;
//   staged: request() queues the read for the I/O threads (io_threads preads in flight) as soon
//           as the router has chosen, and returns at once; wait() blocks until the expert is in
//           and checked. hint() queues a read of an expert that is only predicted (not pinned,
//           and only into a slot that is free or holds an unpinned expert).
// Thread-safe: any thread may call anything; the engine serializes forwards that use a tier.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace cflow {

// How the staged reads reach the disk: a pool of threads each in a blocking pread, or one thread
// keeping the reads in flight on an io_uring (raw syscalls; where the kernel refuses io_uring the
// pool runs instead, and stats().backend says which ran).
enum class IoBackend : int { Pread = 0, Uring = 1 };

struct TierOptions {
  std::string path;          // the mapped .cflow file, opened again for the reads
  uint64_t cache_bytes = 0;  // RAM for the slots (their count: cache_bytes / the largest expert, rounded)
  int io_threads = 4;        // staged: reads in flight (pread threads, or the io_uring's depth)
  bool direct = true;        // O_DIRECT where the file system allows it
  IoBackend backend = IoBackend::Pread;
};

// Where one expert lies and what its bytes must check to.
struct TierEntry {
  int layer = 0, expert = 0;
  uint64_t offset = 0, length = 0;  // offset 4096-aligned; align_up(length, 4096) bytes are read
  uint32_t crc32c = 0;
};

struct TierStats {
  uint64_t hits = 0;            // pinned requests served from a slot without a new read
  uint64_t misses = 0;          // pinned requests that read
  uint64_t hinted_reads = 0;    // reads started by hint()
  uint64_t hinted_used = 0;     // pinned requests served by a hinted read
  uint64_t reads = 0, bytes_read = 0;
  double read_s = 0;            // seconds inside preads (summed over the I/O threads)
  double busy_s = 0;            // wall seconds with at least one read in flight
  double wait_s = 0;            // seconds the engine waited for experts (acquire_sync's reads included)
  int slots = 0;
  bool direct = false;          // the reads bypass the page cache
  IoBackend backend = IoBackend::Pread;
};

class ExpertTier {
 public:
  // Opens opt.path; throws std::runtime_error when it cannot, or when cache_bytes holds fewer
  // than min_slots of the largest expert.
  ExpertTier(const TierOptions& opt, std::vector<TierEntry> entries, int min_slots);
  ~ExpertTier();
  ExpertTier(const ExpertTier&) = delete;
  ExpertTier& operator=(const ExpertTier&) = delete;

  // Entry `key` (index into entries) pinned in a slot, its read queued if it is not there;
  // returns the slot. Blocks while every slot is pinned or being read.
  int request(int key);
  // The slot's bytes once its read finished and checked; throws std::runtime_error naming the
  // expert when the read failed or the checksum does not match (the slot is freed).
  const uint8_t* wait(int slot);
  bool ready(int slot) const;  // wait() would not block
  // Entry `key` pinned in a slot and read on this thread if missing (sync policy); throws as wait().
  const uint8_t* acquire_sync(int key, int* slot);
  void unpin(int slot);
  // Queues a read of a predicted expert into a free or unpinned slot; false when it is already
  // there or no slot can take it now.
  bool hint(int key);
  TierStats stats() const;
  int slots() const { return (int)slots_.size(); }

 private:
  enum class St { Empty, Loading, Ready, Failed };
  struct Slot {
    int key = -1;
    St st = St::Empty;
    int pins = 0;
    bool hinted = false;  // filled by hint() and not yet used by a pinned request
    uint64_t used = 0;    // LRU clock
    uint8_t* buf = nullptr;
    std::string err;
  };
  int victim_locked() const;  // a slot to fill: empty, else the least recently used unpinned one; -1: none
  int claim_locked(int key, std::unique_lock<std::mutex>& lk, bool block);
  void read_into(int slot);   // the pread and the check, without the lock; sets st
  void begin_read();           // busy-time bookkeeping of a read that starts now (under the lock)
  void finish_read(int slot, size_t got, double secs, std::string err);  // the check, the state (no lock held)
  void io_loop();
  void uring_loop();           // the io_uring backend's one thread
  struct Uring;
  std::unique_ptr<Uring> uring_;
  std::string name(int key) const;

  TierOptions opt_;
  std::vector<TierEntry> entries_;
  std::vector<int> slot_of_;  // per key: its slot or -1
  std::vector<Slot> slots_;
  size_t slot_bytes_ = 0;
  int fd_ = -1;
  bool direct_ = false;
  mutable std::mutex mu_;
  std::condition_variable changed_;  // a slot became ready, failed or unpinned; work was queued
  std::deque<int> queue_;            // slots waiting for an I/O thread
  bool stop_ = false;
  uint64_t clock_ = 0;
  int inflight_ = 0;  // reads running now; busy_since_: when the first of them started
  std::chrono::steady_clock::time_point busy_since_;
  std::vector<std::thread> io_;
  TierStats st_;
};

}  // namespace cflow
