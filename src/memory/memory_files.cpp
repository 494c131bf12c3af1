#include "memory/memory_files.h"

#include <fmt/format.h>

#include "core/error.h"

namespace memtune {

using nlohmann::json;

json plan_to_json(const MemoryPlan& plan) {
  json categories = json::object(), phases = json::object(), table = json::object();
  for (size_t c = 0; c < kNumCategories; ++c)
    categories[std::string(category_name(static_cast<Category>(c)))] =
        plan.live_bytes(plan.peak_phase(), static_cast<Category>(c));
  for (size_t p = 0; p < kNumPhases; ++p) {
    const Phase phase = static_cast<Phase>(p);
    phases[std::string(phase_name(phase))] = plan.live_bytes(phase);
    json row = json::object();
    for (size_t c = 0; c < kNumCategories; ++c)
      row[std::string(category_name(static_cast<Category>(c)))] = plan.live_bytes(phase, static_cast<Category>(c));
    table[std::string(phase_name(phase))] = row;
  }
  return {{"peak_bytes", plan.peak_bytes()},
          {"peak_phase", std::string(phase_name(plan.peak_phase()))},
          {"categories", categories},
          {"phases", phases},
          {"table", table}};
}

size_t process_peak_rss_bytes(const Arena& arena) {
  return std::max(peak_rss_bytes(), arena.resident_peak().process_rss_bytes);
}

json memory_json(const MemoryPlan& plan, const Arena& arena, const MemoryPlan& host_plan,
                 const HeapAllocations& during_steps) {
  json out = plan_to_json(plan);
  json result = {{"arena_bytes", plan.peak_bytes()}, {"arena_high_water_bytes", arena.high_water_bytes()}};
  for (const char* key : {"peak_phase", "categories", "phases", "table"}) result[key] = out[key];
  result["host_arena_bytes"] = host_plan.peak_bytes();
  result["process_peak_rss_bytes"] = process_peak_rss_bytes(arena);
  result["arena_resident_bytes"] = arena.resident_peak().arena_resident_bytes;
  result["arena_resident_phase"] = phase_name(arena.resident_peak_phase());
  result["heap_allocations_during_steps"] = {{"count", during_steps.count}, {"bytes", during_steps.bytes}};
  if (const auto& d = arena.device_samples()) {
    // The device's own figures beside the plan. Without VK_EXT_memory_budget there are none:
    // a device in this process's memory (lavapipe) is then measured by the process's RSS.
    const auto now = arena.backend()->device_memory_figures();
    json device = {{"name", d->after.device}, {"device_heap_bytes", d->after.heap_bytes}};
    if (d->after.usage_bytes && now && now->usage_bytes) {
      device["device_usage_bytes"] = {{"before_arena", d->before.usage_bytes.value_or(0)},
                                      {"after_arena", *d->after.usage_bytes},
                                      {"peak", std::max(d->peak_usage_bytes, *now->usage_bytes)},
                                      {"end", *now->usage_bytes}};
      device["device_budget_bytes"] = d->before.budget_bytes.value_or(0);
      device["measurement"] = "device_usage_bytes (the driver's VK_EXT_memory_budget figures)";
    } else {
      device["measurement"] =
          "process_peak_rss_bytes (no VK_EXT_memory_budget; a CPU device such as lavapipe allocates this process's "
          "memory)";
    }
    result["device"] = device;
  }
  return result;
}

void MemoryTimeline::open(const std::string& path) {
  out_.open(path, std::ios::app);
  if (!out_) throw Error(fmt::format("{}: cannot write the memory timeline", path));
}

void MemoryTimeline::record(const Arena& arena, int64_t step, std::string_view stage, std::span<const Phase> phases) {
  if (!out_.is_open()) return;
  for (Phase p : phases) {
    const auto used = arena.used_bytes(p);
    json bytes = json::object();
    size_t total = 0;
    for (size_t c = 0; c < kNumCategories; ++c) {
      bytes[std::string(category_name(static_cast<Category>(c)))] = used[c];
      total += used[c];
    }
    const ResidentSample& r = arena.resident(p);
    out_ << json{{"step", step},
                 {"stage", stage},
                 {"phase", phase_name(p)},
                 {"bytes", bytes},
                 {"arena_used_bytes", total},
                 {"rss_bytes", r.process_rss_bytes},
                 {"arena_resident_bytes", r.arena_resident_bytes}}
                .dump()
         << "\n";
  }
  out_.flush();
}

}  // namespace memtune
