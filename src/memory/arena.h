// The arena: one allocation of exactly the plan's peak, carved at the planned offsets. It is the
// only source of compute-path memory. Its memory comes from a backend (device memory: host code
// never dereferences it, it only passes views of it to the backend), or, for host plans such
// as offloaded optimizer state, from the process itself. It tracks the current phase, refuses
// to hand out a buffer outside its declared lifetime, records the high-water mark of the bytes
// handed out (the plan's arithmetic, not a measurement), and (optionally, in tests) poisons a
// buffer with NaN when its lifetime ends so that a stale view used later shows up as NaN
// instead of silently reading reused memory.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "backend/backend.h"
#include "memory/plan.h"

namespace memtune {

class Arena {
 public:
  // Device memory of `backend`; host memory when backend is null.
  Arena(const MemoryPlan& plan, Backend* backend);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  void enter_phase(Phase p);
  Phase phase() const { return phase_; }
  void set_poison_on_release(bool on) { poison_ = on; }
  MemorySpace space() const { return backend_ ? MemorySpace::Device : MemorySpace::Host; }

  // Address of buffer `id`, which must be live in the current phase. For a device arena it is
  // only ever handed to the backend, inside a view.
  void* raw(BufferId id);
  // A view of buffer `id` (or of its first elements) with the given dtype and shape.
  Tensor view(BufferId id, DType dtype, std::initializer_list<int64_t> shape);
  Tensor f32(BufferId id, std::initializer_list<int64_t> shape) { return view(id, DType::F32, shape); }
  Tensor i32(BufferId id, std::initializer_list<int64_t> shape) { return view(id, DType::I32, shape); }

  size_t capacity_bytes() const { return capacity_; }
  // Largest end offset of any buffer handed out so far.
  size_t high_water_bytes() const { return high_water_; }
  // Usage for the memory timeline: which buffers were handed out since the last reset_usage()
  // (a step, an evaluation), and their bytes per category that are live in phase p.
  void reset_usage() { std::fill(used_.begin(), used_.end(), uint8_t{0}); }
  std::array<size_t, kNumCategories> used_bytes(Phase p) const;
  const MemoryPlan& plan() const { return plan_; }

 private:
  const MemoryPlan& plan_;
  Backend* backend_;
  std::byte* base_ = nullptr;
  size_t capacity_ = 0;
  size_t high_water_ = 0;
  Phase phase_ = Phase::Forward;
  bool poison_ = false;
  std::vector<uint8_t> used_;  // per buffer: handed out since reset_usage()
};

}  // namespace memtune
