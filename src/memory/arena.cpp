#include "memory/arena.h"

#include <sys/mman.h>

#include <fmt/format.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>

#include "core/error.h"

namespace memtune {

Arena::Arena(const MemoryPlan& plan, Backend* backend, size_t allocation_limit) : plan_(plan), backend_(backend) {
  MT_ASSERT(plan.finalized(), "arena needs a finalized plan");
  capacity_ = plan.peak_bytes();
  used_.assign(plan.buffers().size(), 0);
  if (capacity_ == 0) return;
  const auto before = backend_ ? backend_->device_memory_figures() : std::nullopt;
  // A device limits one allocation: the plan is cut where no buffer crosses (plan_segments).
  size_t limit = before ? before->max_allocation_bytes : SIZE_MAX;
  if (allocation_limit > 0) limit = std::min(limit, allocation_limit);
  for (const PlanSegment& s : plan_segments(plan, limit)) {
    try {
      void* base = backend_ ? backend_->allocate(s.bytes) : map_host_pages(s.bytes);
      segments_.push_back({s.offset, s.bytes, static_cast<std::byte*>(base)});
    } catch (...) {
      release();
      throw;
    }
  }
  base_ = segments_.front().base;
  if (before) {
    device_ = DeviceSamples{.before = *before, .after = *backend_->device_memory_figures()};
    device_->peak_usage_bytes = device_->after.usage_bytes.value_or(0);
  }
  if ((!backend_ || backend_->memory_in_host_pages()) && segments_.size() == 1)
    meter_ = ResidencyMeter(base_, capacity_);
}

Arena::~Arena() { release(); }

void Arena::release() {
  for (const Segment& s : segments_) {
    if (backend_)
      backend_->deallocate(s.base, s.bytes);
    else
      munmap(s.base, s.bytes);
  }
  segments_.clear();
  base_ = nullptr;
}

std::byte* Arena::address(size_t offset) {
  if (segments_.size() <= 1) return base_ + offset;
  const auto it = std::upper_bound(segments_.begin(), segments_.end(), offset,
                                   [](size_t o, const Segment& s) { return o < s.offset; });
  return std::prev(it)->base + (offset - std::prev(it)->offset);
}

void Arena::sample() {
  const ResidentSample now{current_rss_bytes(), meter_.resident_bytes()};
  if (device_ && device_->after.usage_bytes)  // only a device that reports its usage is asked again
    if (const auto figures = backend_->device_memory_figures(); figures && figures->usage_bytes)
      device_->peak_usage_bytes = std::max(device_->peak_usage_bytes, *figures->usage_bytes);
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
        backend_->fill_bytes(address(b.offset), 0xff, b.padded_bytes);  // NaN
      else
        std::memset(address(b.offset), 0xff, b.padded_bytes);
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
  return address(b.offset);
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
