// What a run writes about its memory: memory.json (the plan against what the arena handed out,
// and the process's peak resident memory) and memory.jsonl (a timeline: per step and phase, the
// bytes per category of the buffers the step actually used). `memtune plan --json` and the run
// report read the same shapes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <span>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "memory/arena.h"
#include "memory/plan.h"

namespace memtune {

// {"peak_bytes", "peak_phase", "categories": bytes per category at the peak phase,
//  "phases": bytes live per phase, "table": {phase: {category: bytes}}}.
nlohmann::json plan_to_json(const MemoryPlan& plan);

// Peak resident set size of this process so far (getrusage).
size_t process_peak_rss_bytes();

// memory.json: planned_peak_bytes, measured_peak_bytes (the arena's high-water mark), peak_phase,
// categories, phases, table, host_planned_bytes (offloaded optimizer state) and
// process_peak_rss_bytes.
nlohmann::json memory_json(const MemoryPlan& plan, const Arena& arena, const MemoryPlan& host_plan);

// memory.jsonl, appended one line per phase of each recorded step or evaluation:
// {"step", "stage": "train"|"eval", "phase", "bytes": {category: n}, "total"}.
class MemoryTimeline {
 public:
  void open(const std::string& path);
  // Does nothing until opened (ranks other than 0 never open it).
  void record(const Arena& arena, int64_t step, std::string_view stage, std::span<const Phase> phases);

 private:
  std::ofstream out_;
};

}  // namespace memtune
