#include "memory/arena.h"

#include <sys/mman.h>

#include <fmt/format.h>
#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace memtune {

Arena::Arena(const MemoryPlan& plan) : plan_(plan) {
  MT_ASSERT(plan.finalized(), "arena needs a finalized plan");
  capacity_ = plan.peak_bytes();
  used_.assign(plan.buffers().size(), 0);
  if (capacity_ == 0) return;
  // Anonymous mapping: page aligned, zero filled, and pages cost nothing until touched.
  void* p = mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw Error(fmt::format("cannot reserve the planned {} ({} bytes) of memory", format_bytes(capacity_), capacity_));
  base_ = static_cast<std::byte*>(p);
}

Arena::~Arena() {
  if (base_) munmap(base_, capacity_);
}

void Arena::enter_phase(Phase p) {
  if (poison_) {
    for (const auto& b : plan_.buffers())
      if (b.live_in(phase_) && !b.live_in(p)) std::memset(base_ + b.offset, 0xff, b.padded_bytes);  // NaN
  }
  phase_ = p;
}

void* Arena::raw(BufferId id) {
  const BufferDecl& b = plan_.buffer(id);
  MT_ASSERT(b.live_in(phase_), fmt::format("buffer {} used in phase {} outside its lifetime {}..{}", b.name,
                                           phase_name(phase_), phase_name(b.first), phase_name(b.last)));
  high_water_ = std::max(high_water_, b.offset + b.padded_bytes);
  used_[id] = 1;
  return base_ + b.offset;
}

std::array<size_t, kNumCategories> Arena::used_bytes(Phase p) const {
  std::array<size_t, kNumCategories> out{};
  const auto& buffers = plan_.buffers();
  for (size_t i = 0; i < buffers.size(); ++i)
    if (used_[i] && buffers[i].live_in(p)) out[static_cast<size_t>(buffers[i].category)] += buffers[i].padded_bytes;
  return out;
}

}  // namespace memtune
