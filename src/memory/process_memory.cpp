#include "memory/process_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>

namespace memtune {

size_t peak_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  // The kernel updates its high-water mark lazily (when the resident set shrinks), so the
  // resident set now can be above it.
  return std::max(static_cast<size_t>(ru.ru_maxrss) * 1024, current_rss_bytes());
}

size_t current_rss_bytes() {
  // "size resident shared text lib data dt", in pages.
  const int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char text[128];
  const ssize_t n = read(fd, text, sizeof(text) - 1);
  close(fd);
  if (n <= 0) return 0;
  text[n] = '\0';
  char* end = nullptr;
  std::strtoull(text, &end, 10);                    // size
  const unsigned long long resident = std::strtoull(end, nullptr, 10);
  return static_cast<size_t>(resident) * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

size_t available_host_memory_bytes() {
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return 0;
  char line[256];
  unsigned long long kib = 0;
  while (std::fgets(line, sizeof(line), f))
    if (std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
  std::fclose(f);
  return static_cast<size_t>(kib) * 1024;
}

ResidencyMeter::ResidencyMeter(const void* base, size_t bytes) : base_(base), bytes_(bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  pages_.resize((bytes + page - 1) / page);
}

size_t ResidencyMeter::resident_bytes() {
  if (!base_ || pages_.empty()) return 0;
  if (mincore(const_cast<void*>(base_), bytes_, pages_.data()) != 0) return 0;
  size_t resident = 0;
  for (unsigned char p : pages_) resident += p & 1u;
  return resident * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

namespace {
std::atomic<uint64_t> heap_count{0}, heap_bytes{0};
}  // namespace

HeapAllocations heap_allocations() {
  return {heap_count.load(std::memory_order_relaxed), heap_bytes.load(std::memory_order_relaxed)};
}

}  // namespace memtune

// The process's operator new and delete, counting every allocation. Every form is replaced so
// that allocation and release always pair malloc with free (the sanitizers check the pairing).
namespace {

void* counted_alloc(std::size_t n, std::size_t align) {
  memtune::heap_count.fetch_add(1, std::memory_order_relaxed);
  memtune::heap_bytes.fetch_add(n, std::memory_order_relaxed);
  if (n == 0) n = 1;
  if (align <= alignof(std::max_align_t)) return std::malloc(n);
  return std::aligned_alloc(align, (n + align - 1) / align * align);
}

void* checked(void* p) {
  if (!p) throw std::bad_alloc();
  return p;
}

}  // namespace

void* operator new(std::size_t n) {
  return checked(counted_alloc(n, 0));
}
void* operator new[](std::size_t n) {
  return checked(counted_alloc(n, 0));
}
void* operator new(std::size_t n, std::align_val_t a) {
  return checked(counted_alloc(n, static_cast<std::size_t>(a)));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return checked(counted_alloc(n, static_cast<std::size_t>(a)));
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return counted_alloc(n, 0);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return counted_alloc(n, 0);
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return counted_alloc(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return counted_alloc(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  std::free(p);
}
