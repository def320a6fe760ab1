// MappedFile and the SIGBUS guard of mapped ranges (cflow/mapping.h).
#include "cflow/mapping.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace cflow {

#ifdef CFLOW_MAP_GUARD
namespace {

// A registered range. Registration writes end, then begin (release); the handler reads begin
// (acquire), then end. Unregistration clears begin first, so a fault racing it sees no range.
struct Guard {
  std::atomic<uintptr_t> begin{0}, end{0};
  std::atomic<bool> lost{false};
  std::atomic<bool> taken{false};
};
Guard g_guards[kMaxGuards];
uintptr_t g_page = 4096;

// The actions our handler chains to: each (re)installation saves the one it replaces in a new
// entry, and publishes it before installing, so a handler running meanwhile reads a whole one.
constexpr int kMaxInstalls = 8;
struct sigaction g_prev_store[kMaxInstalls];
std::atomic<const struct sigaction*> g_prev{nullptr};
int g_installs = 0;  // under g_install_mu
std::mutex g_install_mu;
std::atomic<bool> g_user_chained{false};

void to_default(int sig, const siginfo_t* si) {
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  // A fault: returning runs the faulting access again, which now gets the default action (the
  // core dump points at it). A signal sent with kill/raise: send it again, delivered on return.
  if (si == nullptr || si->si_code <= 0) raise(sig);
}

// A SIGBUS that is not ours: to the previous handler, as if we were not there. A signal sent
// by a process (si_code <= 0) goes there once: a handler that restores its predecessor (ours)
// and raises again, as Python's faulthandler does, would otherwise bounce it back forever.
void chain(int sig, siginfo_t* si, void* ctx) {
  const struct sigaction* prev = g_prev.load(std::memory_order_acquire);
  const bool user = si == nullptr || si->si_code <= 0;
  if (prev == nullptr || (user && g_user_chained.exchange(true))) return to_default(sig, si);
  if (prev->sa_flags & SA_SIGINFO) {
    if (prev->sa_sigaction != nullptr) return prev->sa_sigaction(sig, si, ctx);
  } else if (prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN) {
    return prev->sa_handler(sig);
  }
  to_default(sig, si);  // SIG_DFL, or SIG_IGN (a fault cannot be ignored: the access would repeat)
}

void on_sigbus(int sig, siginfo_t* si, void* ctx) {
  const int saved_errno = errno;
  if (si != nullptr && si->si_code > 0) {  // raised by the kernel: a fault at si_addr
    const uintptr_t a = reinterpret_cast<uintptr_t>(si->si_addr);
    for (Guard& g : g_guards) {
      const uintptr_t b = g.begin.load(std::memory_order_acquire);
      const uintptr_t e = g.end.load(std::memory_order_acquire);
      if (b == 0 || a < b || a >= e) continue;
      // Zero pages over the rest of the range: a truncated file loses its tail, so one fault
      // covers every later page; the pages before stay the file's. mmap is a plain system
      // call on Linux, safe here.
      const uintptr_t page = a & ~(g_page - 1);
      void* r = mmap(reinterpret_cast<void*>(page), e - page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                     -1, 0);
      if (r == MAP_FAILED) break;  // cannot repair: let it die as it would have
      g.lost.store(true);
      errno = saved_errno;
      return;
    }
  }
  chain(sig, si, ctx);
  errno = saved_errno;
}

// Installs the handler unless it is already the current SIGBUS action (under g_install_mu).
void install() {
  struct sigaction cur;
  if (sigaction(SIGBUS, nullptr, &cur) != 0) return;
  if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus) return;
  if (g_installs == kMaxInstalls) return;
  g_page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  g_prev_store[g_installs] = cur;
  g_prev.store(&g_prev_store[g_installs], std::memory_order_release);
  ++g_installs;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, nullptr);
}

}  // namespace

bool map_guard_supported() { return true; }

int guard_range(const void* addr, size_t length) {
  if (addr == nullptr || length == 0) return -1;
  std::lock_guard<std::mutex> lock(g_install_mu);
  install();
  const uintptr_t b = reinterpret_cast<uintptr_t>(addr) & ~(g_page - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(addr) + length + g_page - 1) & ~(g_page - 1);
  for (int i = 0; i < kMaxGuards; ++i) {
    Guard& g = g_guards[i];
    bool expected = false;
    if (!g.taken.compare_exchange_strong(expected, true)) continue;
    g.lost.store(false);
    g.end.store(e, std::memory_order_release);
    g.begin.store(b, std::memory_order_release);
    return i;
  }
  return -1;
}

void unguard_range(int id) {
  if (id < 0 || id >= kMaxGuards) return;
  Guard& g = g_guards[id];
  g.begin.store(0, std::memory_order_release);
  g.end.store(0, std::memory_order_release);
  g.taken.store(false, std::memory_order_release);
}

bool range_lost(int id) { return id >= 0 && id < kMaxGuards && g_guards[id].lost.load(); }

#else  // no guard: mappings are made, never repaired

bool map_guard_supported() { return false; }
int guard_range(const void*, size_t) { return -1; }
void unguard_range(int) {}
bool range_lost(int) { return false; }

#endif

namespace {

FileStat file_stat(const struct stat& st) {
  FileStat s;
  s.dev = static_cast<uint64_t>(st.st_dev);
  s.ino = static_cast<uint64_t>(st.st_ino);
  s.size = static_cast<uint64_t>(st.st_size);
#ifdef __APPLE__
  s.mtime_ns = static_cast<int64_t>(st.st_mtimespec.tv_sec) * 1000000000 + st.st_mtimespec.tv_nsec;
#else
  s.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
#endif
  return s;
}

[[noreturn]] void fail(const std::string& path, const char* what, int err) {
  throw std::runtime_error(path + ": cannot " + what + ": " + std::strerror(err));
}

}  // namespace

MappedFile::MappedFile(const std::string& path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail(path, "open", errno);
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    fail(path, "stat", err);
  }
  if (!S_ISREG(st.st_mode) || st.st_size <= 0) {
    ::close(fd_);
    throw std::runtime_error(path + (S_ISREG(st.st_mode) ? ": empty file" : ": not a regular file"));
  }
  opened_ = file_stat(st);
  size_ = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    ::close(fd_);
    fail(path, "map", err);
  }
  data_ = static_cast<const uint8_t*>(p);
  guard_ = guard_range(data_, size_);
}

MappedFile::~MappedFile() {
  unguard_range(guard_);  // before the range goes: a later mapping there is someone else's
  ::munmap(const_cast<uint8_t*>(data_), size_);
  ::close(fd_);
}

FileStat MappedFile::stat() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) return opened_;
  return file_stat(st);
}

}  // namespace cflow
