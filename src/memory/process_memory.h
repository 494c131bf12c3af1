// Measurements of this process's memory from outside the plan: what the kernel says is resident
// (getrusage, /proc/self/statm, mincore) and what the C++ heap handed out (every operator new of
// the process is counted). These are the figures the plan is checked against; the arena's own
// high-water mark is the plan's arithmetic and is never called a measurement.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace memtune {

// Peak resident set size of this process so far (getrusage ru_maxrss).
size_t peak_rss_bytes();
// Resident set size now (/proc/self/statm). Allocates nothing, so it may be sampled mid-step.
size_t current_rss_bytes();
// The memory the kernel says new allocations can have without swapping (/proc/meminfo
// MemAvailable); 0 when it cannot be read.
size_t available_host_memory_bytes();

// Operator new calls and the bytes they asked for since the process started (all threads).
struct HeapAllocations {
  uint64_t count = 0, bytes = 0;
  HeapAllocations operator-(const HeapAllocations& o) const { return {count - o.count, bytes - o.bytes}; }
  HeapAllocations& operator+=(const HeapAllocations& o) {
    count += o.count;
    bytes += o.bytes;
    return *this;
  }
};
HeapAllocations heap_allocations();

// Heap allocations inside repeated steps (training steps, evaluation batches), the first one
// excluded: it may size what later steps reuse. Every later step must allocate nothing.
class StepAllocations {
 public:
  void begin() { start_ = heap_allocations(); }
  void end() {
    if (steps_++ > 0) total_ += heap_allocations() - start_;
  }
  const HeapAllocations& total() const { return total_; }

 private:
  HeapAllocations start_, total_;
  int64_t steps_ = 0;
};

// Resident bytes of a page-aligned host mapping (mincore), with its per-page scratch sized once
// so that sampling allocates nothing.
class ResidencyMeter {
 public:
  ResidencyMeter() = default;
  ResidencyMeter(const void* base, size_t bytes);
  size_t resident_bytes();

 private:
  const void* base_ = nullptr;
  size_t bytes_ = 0;
  std::vector<unsigned char> pages_;
};

}  // namespace memtune
