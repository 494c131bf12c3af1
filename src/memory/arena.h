// The arena: one allocation of exactly the plan's peak (or, on a device that limits one
// allocation below it, as few allocations as the placement can be cut into), carved at the
// planned offsets. It is the
// only source of compute-path memory. Its memory comes from a backend (device memory: host code
// never dereferences it, it only passes views of it to the backend), or, for host plans such
// as offloaded optimizer state, from the process itself. It tracks the current phase, refuses
// to hand out a buffer outside its declared lifetime, records the high-water mark of the bytes
// handed out (the plan's arithmetic, not a measurement), samples at every phase change what
// the kernel says (the process's resident set, and the arena's resident pages when its memory
// is host pages: measurements from outside the plan), and (optionally, in tests) poisons a
// buffer with NaN when its lifetime ends so that a stale view used later shows up as NaN
// instead of silently reading reused memory.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "backend/backend.h"
#include "memory/plan.h"
#include "memory/process_memory.h"

namespace memtune {

// What the kernel reported while the arena was in a phase (the largest of the samples).
struct ResidentSample {
  size_t process_rss_bytes = 0;     // the whole process (current RSS)
  size_t arena_resident_bytes = 0;  // the arena's pages that are resident (mincore)
  void merge(const ResidentSample& o) {
    process_rss_bytes = std::max(process_rss_bytes, o.process_rss_bytes);
    arena_resident_bytes = std::max(arena_resident_bytes, o.arena_resident_bytes);
  }
};

class Arena {
 public:
  // Device memory of `backend`; host memory when backend is null. allocation_limit (> 0) caps one
  // allocation below what the device allows (tests of the cut arena).
  Arena(const MemoryPlan& plan, Backend* backend, size_t allocation_limit = 0);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Samples the phase being left (unless told not to), then enters p.
  void enter_phase(Phase p, bool sample_left = true);
  // Samples the current phase now (a step's end: nothing enters a phase after its last one).
  void sample();
  Phase phase() const { return phase_; }
  void set_poison_on_release(bool on) { poison_ = on; }

  // Address of buffer `id`, which must be live in the current phase. For a device arena it is
  // only ever handed to the backend, inside a view.
  void* raw(BufferId id);
  // A view of buffer `id` (or of its first elements) with the given dtype and shape.
  Tensor view(BufferId id, DType dtype, std::initializer_list<int64_t> shape);
  Tensor f32(BufferId id, std::initializer_list<int64_t> shape) { return view(id, DType::F32, shape); }
  Tensor i32(BufferId id, std::initializer_list<int64_t> shape) { return view(id, DType::I32, shape); }

  size_t capacity_bytes() const { return capacity_; }
  // The allocations the arena is made of: one, unless the backend's device limits an allocation
  // below the plan's extent (then cut where no buffer crosses, memory/plan.h plan_segments).
  struct Segment {
    size_t offset = 0, bytes = 0;
    std::byte* base = nullptr;
  };
  const std::vector<Segment>& segments() const { return segments_; }
  // Largest end offset of any buffer handed out so far (the plan's arithmetic).
  size_t high_water_bytes() const { return high_water_; }
  // Usage for the memory timeline: which buffers were handed out since the last reset_usage()
  // (a step, an evaluation), their bytes per category that are live in phase p, and the
  // kernel's figures sampled in phase p since then.
  void reset_usage();
  std::array<size_t, kNumCategories> used_bytes(Phase p) const;
  const ResidentSample& resident(Phase p) const { return samples_[static_cast<size_t>(p)]; }
  // The largest samples since the arena was made, and the phase of the largest arena residency.
  const ResidentSample& resident_peak() const { return peak_; }
  Phase resident_peak_phase() const { return peak_phase_; }
  const MemoryPlan& plan() const { return plan_; }
  // A device backend's own memory figures (Backend::device_memory_figures): before the arena
  // was allocated, right after, and the largest usage the samples saw; none for host memory.
  struct DeviceSamples {
    DeviceMemoryFigures before, after;
    uint64_t peak_usage_bytes = 0;
  };
  const std::optional<DeviceSamples>& device_samples() const { return device_; }
  Backend* backend() const { return backend_; }

 private:
  void release();
  std::byte* address(size_t offset);  // of the planned offset, in the segment that holds it
  const MemoryPlan& plan_;
  Backend* backend_;
  std::vector<Segment> segments_;
  std::optional<DeviceSamples> device_;
  std::byte* base_ = nullptr;
  size_t capacity_ = 0;
  size_t high_water_ = 0;
  Phase phase_ = Phase::Forward;
  bool poison_ = false;
  std::vector<uint8_t> used_;  // per buffer: handed out since reset_usage()
  ResidencyMeter meter_;       // over the arena when its memory is host pages
  std::array<ResidentSample, kNumPhases> samples_{};
  ResidentSample peak_;
  Phase peak_phase_ = Phase::Forward;
};

}  // namespace memtune
