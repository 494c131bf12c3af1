// What the host asks of a device per unit of work (a training step, an evaluation batch, an
// engine step of generation): the waits for the device (and of those, the ones after which the
// device still had work the host had submitted since), the command buffers submitted, the
// dispatches and the barriers between commands, each as min / max / mean over the units, from the backend's own counters
// (Backend::device_counters), and the dispatches by shader since counting began.
// memory.json's and generate's "device_work".
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "backend/backend.h"

namespace memtune {

class DeviceWork {
 public:
  // Counting begins: the dispatches by shader are taken from here on.
  explicit DeviceWork(const Backend& backend)
      : backend_(&backend), shaders_at_start_(backend.dispatches_by_shader()) {}
  // Around one unit; a begin() without its end() (a unit that did no work) is not counted. Three
  // counters read each time: nothing is allocated.
  void begin() { start_ = backend_->device_counters(); }
  void end();
  int64_t units() const { return units_; }
  // The sums over the units counted so far (the server's /metrics); none for a backend without
  // device counters.
  struct Totals {
    int64_t units = 0;
    uint64_t waits = 0, overlapped_waits = 0, submissions = 0, dispatches = 0, barriers = 0;
    uint64_t replayed_command_buffers = 0, replayed_dispatches = 0;
  };
  std::optional<Totals> totals() const;
  // {"unit", "units", "waits", "overlapped_waits", "submissions", "dispatches", "barriers",
  // "replayed_dispatches" (of the dispatches, those of recorded commands run again:
  // Backend::replay_commands), "replayed_command_buffers" (those commands' buffers): {"min", "max", "mean"},
  // "dispatches_by_shader" (since counting began)}; null for a backend without device counters.
  nlohmann::json to_json(const std::string& unit) const;

 private:
  struct Range {
    uint64_t min = UINT64_MAX, max = 0, total = 0;
    void add(uint64_t v);
    nlohmann::json to_json(int64_t units) const;
  };
  const Backend* backend_;
  std::map<std::string, uint64_t> shaders_at_start_;
  std::optional<DeviceCounters> start_;
  Range waits_, overlapped_waits_, submissions_, dispatches_, barriers_, replayed_command_buffers_, replayed_dispatches_;
  int64_t units_ = 0;
};

}  // namespace memtune
