// What a run writes about its memory: memory.json (the arena's plan, and beside it what was
// measured from outside the plan: the process's peak resident memory, the arena's resident
// pages, heap allocations during steps) and memory.jsonl (a timeline: per step and phase, the
// bytes per category of the buffers the step actually used, and the resident figures sampled in
// that phase). `memtune plan --json` and the run report read the same shapes.
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
#include "memory/process_memory.h"

namespace memtune {

// {"peak_bytes", "peak_phase", "categories": bytes per category at the peak phase,
//  "phases": bytes live per phase, "table": {phase: {category: bytes}}}.
nlohmann::json plan_to_json(const MemoryPlan& plan);

// The process's peak resident memory: the kernel's high-water mark, or the largest resident set
// the arena sampled if the kernel's lazily updated mark is behind it.
size_t process_peak_rss_bytes(const Arena& arena);

// memory.json. The plan's figures: arena_bytes (what the arena allocates: the plan's peak),
// arena_high_water_bytes (the largest end offset handed out: the plan's arithmetic), peak_phase,
// categories, phases, table, host_arena_bytes (offloaded optimizer state). Measured:
// process_peak_rss_bytes (getrusage), arena_resident_bytes and arena_resident_phase (mincore,
// at its largest), heap_allocations_during_steps {count, bytes} (operator new calls inside
// steps after the first, given by the caller).
nlohmann::json memory_json(const MemoryPlan& plan, const Arena& arena, const MemoryPlan& host_plan,
                           const HeapAllocations& during_steps);

// memory.jsonl, appended one line per phase of each recorded step or evaluation:
// {"step", "stage": "train"|"eval", "phase", "bytes": {category: n}, "arena_used_bytes",
//  "rss_bytes", "arena_resident_bytes"} (the last two sampled by the arena in that phase).
class MemoryTimeline {
 public:
  void open(const std::string& path);
  // Does nothing until opened (ranks other than 0 never open it).
  void record(const Arena& arena, int64_t step, std::string_view stage, std::span<const Phase> phases);

 private:
  std::ofstream out_;
};

}  // namespace memtune
