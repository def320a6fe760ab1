// ExpertTier: the slots, their LRU, the I/O threads (cflow/expert_tier.h).
#include "cflow/expert_tier.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "cflow/crc32c.h"

namespace cflow {

constexpr size_t kAlign = 4096;
static size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
static double secs_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

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

// Reads slot's expert (its key is fixed while Loading) and checks it; publishes the state under
// the lock.
void ExpertTier::read_into(int slot) {
  const int key = slots_[slot].key;
  const TierEntry& e = entries_[key];
  uint8_t* buf = slots_[slot].buf;
  const size_t n = align_up(e.length);
  auto t0 = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!inflight_++) busy_since_ = t0;
  }
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
  const double dt = secs_since(t0);
  if (err.empty() && got < e.length)
    err = "short read: " + std::to_string(got) + " of " + std::to_string(e.length) + " bytes (the file was truncated?)";
  if (err.empty()) {
    const uint32_t c = crc32c(buf, e.length);
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
  st_.read_s += dt;
  Slot& s = slots_[slot];
  if (err.empty()) {
    s.st = St::Ready;
  } else {
    s.st = St::Failed;
    s.err = name(key) + " of " + opt_.path + ": " + err + ": the model file is damaged (cflow verify checks it)";
  }
}

void ExpertTier::io_loop() {
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

TierStats ExpertTier::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return st_;
}

}  // namespace cflow
