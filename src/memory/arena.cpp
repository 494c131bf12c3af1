#include "memory/arena.h"

#include <sys/mman.h>

#include <fmt/format.h>
#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace memtune {

Arena::Arena(const MemoryPlan& plan, Backend* backend) : plan_(plan), backend_(backend) {
  MT_ASSERT(plan.finalized(), "arena needs a finalized plan");
  capacity_ = plan.peak_bytes();
  used_.assign(plan.buffers().size(), 0);
  if (capacity_ == 0) return;
  base_ = static_cast<std::byte*>(backend_ ? backend_->allocate(capacity_) : map_host_pages(capacity_));
  if (!backend_ || backend_->memory_in_host_pages()) meter_ = ResidencyMeter(base_, capacity_);
}

Arena::~Arena() {
  if (!base_) return;
  if (backend_)
    backend_->deallocate(base_, capacity_);
  else
    munmap(base_, capacity_);
}

void Arena::sample() {
  const ResidentSample now{current_rss_bytes(), meter_.resident_bytes()};
  samples_[static_cast<size_t>(phase_)].merge(now);
  if (now.arena_resident_bytes > peak_.arena_resident_bytes) peak_phase_ = phase_;
  peak_.merge(now);
}

void Arena::reset_usage() {
  std::fill(used_.begin(), used_.end(), uint8_t{0});
  samples_.fill({});
}

void Arena::enter_phase(Phase p, bool sample_left) {
  if (sample_left) sample();
  if (poison_) {
    for (const auto& b : plan_.buffers()) {
      if (!b.live_in(phase_) || b.live_in(p)) continue;
      if (backend_)
        backend_->fill_bytes(base_ + b.offset, 0xff, b.padded_bytes);  // NaN
      else
        std::memset(base_ + b.offset, 0xff, b.padded_bytes);
    }
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

Tensor Arena::view(BufferId id, DType dtype, std::initializer_list<int64_t> shape) {
  Tensor t(raw(id), dtype, shape);
  MT_ASSERT(t.bytes() <= plan_.buffer(id).bytes, fmt::format("a view of {} bytes of buffer {} ({} bytes)", t.bytes(),
                                                             plan_.buffer(id).name, plan_.buffer(id).bytes));
  return t;
}

std::array<size_t, kNumCategories> Arena::used_bytes(Phase p) const {
  std::array<size_t, kNumCategories> out{};
  const auto& buffers = plan_.buffers();
  for (size_t i = 0; i < buffers.size(); ++i)
    if (used_[i] && buffers[i].live_in(p)) out[static_cast<size_t>(buffers[i].category)] += buffers[i].padded_bytes;
  return out;
}

}  // namespace memtune
