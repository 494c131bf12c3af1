// The arena: one allocation of exactly the plan's peak, carved at the planned offsets. It is the
// only source of compute-path memory. It tracks the current phase, refuses to hand out a buffer
// outside its declared lifetime, records the high-water mark of the bytes actually handed out,
// and (optionally, in tests) poisons a buffer with NaN when its lifetime ends so that a stale
// pointer used later shows up as NaN instead of silently reading reused memory.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "memory/plan.h"

namespace memtune {

class Arena {
 public:
  explicit Arena(const MemoryPlan& plan);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  void enter_phase(Phase p);
  Phase phase() const { return phase_; }
  void set_poison_on_release(bool on) { poison_ = on; }

  // Bytes of buffer `id`; the buffer must be live in the current phase, unless `persistent`
  // access is requested for buffers that live in every phase.
  void* raw(BufferId id);
  template <class T>
  T* get(BufferId id) {
    return static_cast<T*>(raw(id));
  }
  template <class T>
  std::span<T> span(BufferId id) {
    return {get<T>(id), plan_.buffer(id).bytes / sizeof(T)};
  }

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
  std::byte* base_ = nullptr;
  size_t capacity_ = 0;
  size_t high_water_ = 0;
  Phase phase_ = Phase::Forward;
  bool poison_ = false;
  std::vector<uint8_t> used_;  // per buffer: handed out since reset_usage()
};

}  // namespace memtune
