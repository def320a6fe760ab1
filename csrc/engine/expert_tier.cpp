// ExpertTier: the slots, their LRU, the I/O threads (cflow/expert_tier.h).
#include "cflow/expert_tier.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__linux__) && __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#define CFLOW_URING 1
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "cflow/crc32c.h"
#include "cflow/threadpool.h"

namespace cflow {

constexpr size_t kAlign = 4096;
static size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
static double secs_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A minimal io_uring over raw syscalls: one submission and one completion ring, reads only.
struct ExpertTier::Uring {
#ifdef CFLOW_URING
  int fd = -1;
  unsigned depth = 0;
  void *sq = nullptr, *cq = nullptr;
  size_t sq_len = 0, cq_len = 0, sqe_len = 0;
  io_uring_sqe* sqes = nullptr;
  unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
  io_uring_cqe* cqes = nullptr;

  bool open(int n) {
    io_uring_params p{};
    fd = (int)syscall(__NR_io_uring_setup, (unsigned)n, &p);
    if (fd < 0) return false;
    depth = p.sq_entries;
    sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_len = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    sqe_len = p.sq_entries * sizeof(io_uring_sqe);
    sq = mmap(nullptr, sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    cq = mmap(nullptr, cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
    void* e = mmap(nullptr, sqe_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (sq == MAP_FAILED || cq == MAP_FAILED || e == MAP_FAILED) {
      if (sq != MAP_FAILED) munmap(sq, sq_len);
      if (cq != MAP_FAILED) munmap(cq, cq_len);
      if (e != MAP_FAILED) munmap(e, sqe_len);
      sq = cq = nullptr;
      ::close(fd);
      fd = -1;
      return false;
    }
    sqes = static_cast<io_uring_sqe*>(e);
    auto at = [](void* base, unsigned off) { return reinterpret_cast<unsigned*>(static_cast<char*>(base) + off); };
    sq_head = at(sq, p.sq_off.head), sq_tail = at(sq, p.sq_off.tail), sq_mask = at(sq, p.sq_off.ring_mask);
    sq_array = at(sq, p.sq_off.array);
    cq_head = at(cq, p.cq_off.head), cq_tail = at(cq, p.cq_off.tail), cq_mask = at(cq, p.cq_off.ring_mask);
    cqes = reinterpret_cast<io_uring_cqe*>(static_cast<char*>(cq) + p.cq_off.cqes);
    return true;
  }
  // Queues a read of n bytes at off into buf, tagged; the caller keeps at most depth in flight.
  void push(int tfd, void* buf, unsigned n, uint64_t off, uint64_t tag) {
    const unsigned tail = *sq_tail, i = tail & *sq_mask;
    io_uring_sqe& q = sqes[i];
    std::memset(&q, 0, sizeof q);
    q.opcode = IORING_OP_READ;
    q.fd = tfd;
    q.addr = (uint64_t)(uintptr_t)buf;
    q.len = n;
    q.off = off;
    q.user_data = tag;
    sq_array[i] = i;
    __atomic_store_n(sq_tail, tail + 1, __ATOMIC_RELEASE);
  }
  // Submits what was pushed and waits for at least `wait` completions; -errno on failure.
  int enter(unsigned submit, unsigned wait) {
    for (;;) {
      const int r = (int)syscall(__NR_io_uring_enter, fd, submit, wait, wait ? IORING_ENTER_GETEVENTS : 0u, nullptr, 0);
      if (r >= 0 || errno != EINTR) return r < 0 ? -errno : r;
    }
  }
  // The next completion, if any: (tag, result).
  bool pop(uint64_t* tag, int* res) {
    const unsigned head = *cq_head;
    if (head == __atomic_load_n(cq_tail, __ATOMIC_ACQUIRE)) return false;
    const io_uring_cqe& c = cqes[head & *cq_mask];
    *tag = c.user_data;
    *res = c.res;
    __atomic_store_n(cq_head, head + 1, __ATOMIC_RELEASE);
    return true;
  }
  ~Uring() {
    if (fd < 0) return;
    munmap(sqes, sqe_len);
    munmap(sq, sq_len);
    munmap(cq, cq_len);
    ::close(fd);
  }
#else
  bool open(int) { return false; }
#endif
};

ExpertTier::ExpertTier(const TierOptions& opt, std::vector<TierEntry> entries, int min_slots)
    : opt_(opt), entries_(std::move(entries)), slot_of_(entries_.size(), -1) {
  for (const TierEntry& e : entries_) {
    if (e.offset % kAlign) throw std::runtime_error(name((int)(&e - entries_.data())) + ": offset not 4096-aligned");
    slot_bytes_ = std::max(slot_bytes_, align_up(e.length));
  }
  if (entries_.empty() || !slot_bytes_) throw std::runtime_error("expert tier: the model has no experts");
  const uint64_t n = opt_.cache_bytes / slot_bytes_;
  if (n < (uint64_t)std::max(1, min_slots))
    throw std::runtime_error("expert tier: " + std::to_string(opt_.cache_bytes >> 20) + " MiB of expert cache holds " +
                             std::to_string(n) + " experts of " + std::to_string(slot_bytes_ >> 10) +
                             " KiB; the model needs at least " + std::to_string(min_slots) +
                             " (the experts of the layers in flight): raise the RAM budget");
  const size_t count = (size_t)std::min<uint64_t>(n, entries_.size());
#ifdef O_DIRECT
  if (opt_.direct) {
    fd_ = ::open(opt_.path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    direct_ = fd_ >= 0;
  }
#endif
  if (fd_ < 0) fd_ = ::open(opt_.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw std::runtime_error("expert tier: cannot open " + opt_.path + ": " + std::strerror(errno));
  slots_.resize(count);
  for (Slot& s : slots_) {
    s.buf = static_cast<uint8_t*>(std::aligned_alloc(kAlign, slot_bytes_));
    if (!s.buf) {
      for (Slot& t : slots_) std::free(t.buf);
      ::close(fd_);
      throw std::runtime_error("expert tier: out of memory for " + std::to_string(count) + " expert buffers");
    }
  }
  st_.slots = (int)count;
  st_.direct = direct_;
  if (opt_.backend == IoBackend::Uring) {
    uring_ = std::make_unique<Uring>();
    if (uring_->open(std::max(1, opt_.io_threads))) {
      st_.backend = IoBackend::Uring;
      io_.emplace_back([this] { uring_loop(); });
      return;
    }
    uring_.reset();  // the kernel refused io_uring: the pool
  }
  for (int i = 0; i < std::max(1, opt_.io_threads); ++i) io_.emplace_back([this] { io_loop(); });
}

ExpertTier::~ExpertTier() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  changed_.notify_all();
  for (std::thread& t : io_) t.join();
  for (Slot& s : slots_) std::free(s.buf);
  if (fd_ >= 0) ::close(fd_);
}

std::string ExpertTier::name(int key) const {
  const TierEntry& e = entries_[key];
  return "expert (layer " + std::to_string(e.layer) + ", expert " + std::to_string(e.expert) + ")";
}

int ExpertTier::victim_locked() const {
  int best = -1;
  for (int i = 0; i < (int)slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.st == St::Empty) return i;
    if (s.pins || s.st == St::Loading) continue;
    if (best < 0 || s.used < slots_[best].used) best = i;
  }
  return best;
}

// A slot for key, emptied of what it held and marked Loading (the caller reads or queues it);
// -1 when none is free and block is false.
int ExpertTier::claim_locked(int key, std::unique_lock<std::mutex>& lk, bool block) {
  int v;
  while ((v = victim_locked()) < 0) {
    if (!block) return -1;
    changed_.wait(lk);
    if (slot_of_[key] >= 0) return -2;  // someone else brought it meanwhile
  }
  Slot& s = slots_[v];
  if (s.key >= 0) slot_of_[s.key] = -1;
  s.key = key;
  s.st = St::Loading;
  s.err.clear();
  s.hinted = false;
  slot_of_[key] = v;
  return v;
}

int ExpertTier::request(int key) {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    int i = slot_of_[key];
    if (i >= 0 && slots_[i].st == St::Failed && !slots_[i].pins) {  // an earlier read failed: read again
      slots_[i].st = St::Loading;
      slots_[i].err.clear();
      queue_.push_back(i);
      changed_.notify_all();
    }
    if (i >= 0) {
      Slot& s = slots_[i];
      ++s.pins;
      s.used = ++clock_;
      ++st_.hits;
      if (s.hinted) {
        ++st_.hinted_used;
        s.hinted = false;
      }
      return i;
    }
    i = claim_locked(key, lk, true);
    if (i == -2) continue;
    ++slots_[i].pins;
    slots_[i].used = ++clock_;
    ++st_.misses;
    queue_.push_back(i);
    changed_.notify_all();
    return i;
  }
}

bool ExpertTier::hint(int key) {
  std::unique_lock<std::mutex> lk(mu_);
  if (slot_of_[key] >= 0) return false;
  const int i = claim_locked(key, lk, false);
  if (i < 0) return false;
  slots_[i].hinted = true;
  slots_[i].used = ++clock_;
  ++st_.hinted_reads;
  queue_.push_back(i);
  changed_.notify_all();
  return true;
}

bool ExpertTier::ready(int slot) const {
  std::lock_guard<std::mutex> lk(mu_);
  return slots_[slot].st != St::Loading;
}

const uint8_t* ExpertTier::wait(int slot) {
  std::unique_lock<std::mutex> lk(mu_);
  Slot& s = slots_[slot];
  if (s.st == St::Loading) {
    const auto t0 = std::chrono::steady_clock::now();
    changed_.wait(lk, [&] { return s.st != St::Loading; });
    st_.wait_s += secs_since(t0);
  }
  if (s.st == St::Failed) throw std::runtime_error(s.err);
  return s.buf;
}

const uint8_t* ExpertTier::acquire_sync(int key, int* slot) {
  std::unique_lock<std::mutex> lk(mu_);
  int i;
  for (;;) {
    i = slot_of_[key];
    if (i >= 0 && slots_[i].st == St::Failed && !slots_[i].pins) slots_[i].st = St::Empty, slot_of_[key] = -1, i = -1;
    if (i >= 0) {
      ++slots_[i].pins;
      slots_[i].used = ++clock_;
      ++st_.hits;
      lk.unlock();
      *slot = i;
      return wait(i);
    }
    i = claim_locked(key, lk, true);
    if (i != -2) break;
  }
  ++slots_[i].pins;
  slots_[i].used = ++clock_;
  ++st_.misses;
  *slot = i;
  lk.unlock();
  const auto t0 = std::chrono::steady_clock::now();
  read_into(i);
  lk.lock();
  st_.wait_s += secs_since(t0);
  changed_.notify_all();
  if (slots_[i].st == St::Failed) throw std::runtime_error(slots_[i].err);
  return slots_[i].buf;
}

void ExpertTier::unpin(int slot) {
  std::lock_guard<std::mutex> lk(mu_);
  Slot& s = slots_[slot];
  if (s.pins > 0) --s.pins;
  if (!s.pins && s.st == St::Failed) {  // never reuse bytes that failed their check
    slot_of_[s.key] = -1;
    s.key = -1;
    s.st = St::Empty;
  }
  changed_.notify_all();
}

void ExpertTier::begin_read() {
  if (!inflight_++) busy_since_ = std::chrono::steady_clock::now();
}

// Reads slot's expert (its key is fixed while Loading) on this thread and checks it.
void ExpertTier::read_into(int slot) {
  const TierEntry& e = entries_[slots_[slot].key];
  uint8_t* buf = slots_[slot].buf;
  const size_t n = align_up(e.length);
  {
    std::lock_guard<std::mutex> lk(mu_);
    begin_read();
  }
  const auto t0 = std::chrono::steady_clock::now();
  size_t got = 0;
  std::string err;
  while (got < n) {
    const ssize_t r = ::pread(fd_, buf + got, n - got, (off_t)(e.offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      err = std::strerror(errno);
      break;
    }
    if (r == 0) break;
    got += (size_t)r;
  }
  finish_read(slot, got, secs_since(t0), std::move(err));
}

// After a read of `got` bytes into slot: the checksum, then the slot's state under the lock.
void ExpertTier::finish_read(int slot, size_t got, double secs, std::string err) {
  const int key = slots_[slot].key;
  const TierEntry& e = entries_[key];
  if (err.empty() && got < e.length)
    err = "short read: " + std::to_string(got) + " of " + std::to_string(e.length) + " bytes (the file was truncated?)";
  if (err.empty()) {
    const uint32_t c = crc32c(slots_[slot].buf, e.length);
    if (c != e.crc32c) {
      char msg[96];
      std::snprintf(msg, sizeof msg, "checksum mismatch (crc32c %08x, the expert table says %08x)", c, e.crc32c);
      err = msg;
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (!--inflight_) st_.busy_s += secs_since(busy_since_);
  ++st_.reads;
  st_.bytes_read += got;
  st_.read_s += secs;
  Slot& s = slots_[slot];
  if (err.empty()) {
    s.st = St::Ready;
  } else {
    s.st = St::Failed;
    s.err = name(key) + " of " + opt_.path + ": " + err + ": the model file is damaged (cflow verify checks it)";
  }
}

void ExpertTier::io_loop() {
  set_thread_name("cflow-io");
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    changed_.wait(lk, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const int slot = queue_.front();
    queue_.pop_front();
    lk.unlock();
    read_into(slot);
    changed_.notify_all();
    lk.lock();
  }
}

// The io_uring backend: one thread keeps up to depth reads in flight, submitting queued slots as
// reads complete; a short read finishes with pread on this thread (O_DIRECT reads of aligned
// whole experts are not expected to come back short).
void ExpertTier::uring_loop() {
  set_thread_name("cflow-io");
#ifdef CFLOW_URING
  Uring& u = *uring_;
  struct Flight {
    std::chrono::steady_clock::time_point t0;
  };
  std::vector<Flight> flight(slots_.size());
  std::vector<int> flying;  // the slots read now
  unsigned inflight = 0;
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    if (!inflight) changed_.wait(lk, [&] { return stop_ || !queue_.empty(); });
    if (stop_ && !inflight) return;
    unsigned pushed = 0;
    while (!stop_ && !queue_.empty() && inflight + pushed < u.depth) {
      const int slot = queue_.front();
      queue_.pop_front();
      begin_read();
      const TierEntry& e = entries_[slots_[slot].key];
      flight[slot].t0 = std::chrono::steady_clock::now();
      u.push(fd_, slots_[slot].buf, (unsigned)align_up(e.length), e.offset, (uint64_t)slot);
      flying.push_back(slot);
      ++pushed;
    }
    lk.unlock();
    const int r = u.enter(pushed, inflight + pushed ? 1 : 0);
    inflight += pushed;
    uint64_t tag;
    int res;
    while (u.pop(&tag, &res)) {
      --inflight;
      const int slot = (int)tag;
      flying.erase(std::find(flying.begin(), flying.end(), slot));
      const TierEntry& e = entries_[slots_[slot].key];
      size_t got = res > 0 ? (size_t)res : 0;
      std::string err = res < 0 ? std::strerror(-res) : "";
      while (err.empty() && got < align_up(e.length)) {  // the rest, the slow way
        const ssize_t n = ::pread(fd_, slots_[slot].buf + got, align_up(e.length) - got, (off_t)(e.offset + got));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          if (n < 0) err = std::strerror(errno);
          break;
        }
        got += (size_t)n;
      }
      finish_read(slot, got, secs_since(flight[slot].t0), std::move(err));
      changed_.notify_all();
    }
    if (r < 0) {  // the ring failed under us: its reads fail with the reason, the pool's loop goes on
      for (int slot : flying) finish_read(slot, 0, 0, std::string("io_uring: ") + std::strerror(-r));
      changed_.notify_all();
      return io_loop();
    }
    lk.lock();
  }
#endif
}

TierStats ExpertTier::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return st_;
}

}  // namespace cflow
