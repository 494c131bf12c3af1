// DeviceWork (see device_work.h).
#include "backend/device_work.h"

#include <algorithm>

namespace memtune {

void DeviceWork::Range::add(uint64_t v) {
  min = std::min(min, v);
  max = std::max(max, v);
  total += v;
}

nlohmann::json DeviceWork::Range::to_json(int64_t units) const {
  if (units == 0) return {{"min", 0}, {"max", 0}, {"mean", 0.0}};
  return {{"min", min}, {"max", max}, {"mean", static_cast<double>(total) / static_cast<double>(units)}};
}

void DeviceWork::end() {
  if (!start_) return;
  const std::optional<DeviceCounters> now = backend_->device_counters();
  if (!now) return;
  waits_.add(now->waits - start_->waits);
  overlapped_waits_.add(now->overlapped_waits - start_->overlapped_waits);
  submissions_.add(now->submissions - start_->submissions);
  dispatches_.add(now->dispatches - start_->dispatches);
  barriers_.add(now->barriers - start_->barriers);
  replayed_command_buffers_.add(now->replayed_command_buffers - start_->replayed_command_buffers);
  replayed_dispatches_.add(now->replayed_dispatches - start_->replayed_dispatches);
  ++units_;
  start_.reset();
}

std::optional<DeviceWork::Totals> DeviceWork::totals() const {
  if (!backend_->device_counters()) return std::nullopt;
  return Totals{units_,
                waits_.total,
                overlapped_waits_.total,
                submissions_.total,
                dispatches_.total,
                barriers_.total,
                replayed_command_buffers_.total,
                replayed_dispatches_.total};
}

nlohmann::json DeviceWork::to_json(const std::string& unit) const {
  if (!backend_->device_counters()) return nullptr;
  std::map<std::string, uint64_t> by_shader;
  for (const auto& [shader, n] : backend_->dispatches_by_shader()) {
    const auto before = shaders_at_start_.find(shader);
    const uint64_t added = n - (before == shaders_at_start_.end() ? 0 : before->second);
    if (added > 0) by_shader[shader] = added;
  }
  return {{"unit", unit},
          {"units", units_},
          {"waits", waits_.to_json(units_)},
          {"overlapped_waits", overlapped_waits_.to_json(units_)},
          {"submissions", submissions_.to_json(units_)},
          {"dispatches", dispatches_.to_json(units_)},
          {"barriers", barriers_.to_json(units_)},
          {"replayed_command_buffers", replayed_command_buffers_.to_json(units_)},
          {"replayed_dispatches", replayed_dispatches_.to_json(units_)},
          {"dispatches_by_shader", by_shader}};
}

}  // namespace memtune
