#include "memory/process_plan.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"
#include "memory/plan.h"
#include "memory/process_memory.h"

namespace memtune {

void ProcessPlan::measure_preparation(size_t startup_rss_bytes) {
  startup_bytes = startup_rss_bytes;
  preparation_peak_bytes = peak_rss_bytes();
  const size_t now = current_rss_bytes();
  prepared_bytes = now > startup_rss_bytes ? now - startup_rss_bytes : 0;
  data_measured = true;
}

size_t ProcessPlan::loading_bytes() const {
  return startup_bytes + prepared_bytes + arena_host_bytes() + host_arena_bytes + weights_mapping_bytes;
}

size_t ProcessPlan::running_bytes() const {
  return startup_bytes + prepared_bytes + arena_host_bytes() + host_arena_bytes + compute_runtime_bytes +
         evaluation_bytes + generation_arena_bytes + communication_bytes;
}

size_t ProcessPlan::peak_bytes() const {
  return std::max({preparation_peak_bytes, loading_bytes(), running_bytes()});
}

const char* ProcessPlan::peak_stage() const {
  const size_t peak = peak_bytes();
  if (peak == loading_bytes()) return "loading";
  if (peak == running_bytes()) return "running";
  return "preparing";
}

nlohmann::json ProcessPlan::to_json() const {
  return {{"process_peak_bytes", peak_bytes()},
          {"peak_stage", peak_stage()},
          {"stages", {{"preparing", preparation_peak_bytes}, {"loading", loading_bytes()}, {"running", running_bytes()}}},
          {"terms",
           {{"startup_bytes", startup_bytes},
            {"prepared_data_bytes", prepared_bytes},
            {"arena_bytes", arena_bytes},
            {"arena_on_device", arena_on_device},  // then arena_bytes is the device's, not in the stages
            {"host_arena_bytes", host_arena_bytes},
            {"weights_mapping_bytes", weights_mapping_bytes},
            {"compute_runtime_bytes", compute_runtime_bytes},
            {"evaluation_bytes", evaluation_bytes},
            {"generation_arena_bytes", generation_arena_bytes},
            {"communication_bytes", communication_bytes}}},
          {"data_measured", data_measured}};
}

std::string ProcessPlan::summary() const {
  std::string s = fmt::format(
      "process: {} predicted peak ({}): startup {} + {} + {}{} + {} while loading the weights, "
      "or + compute runtime {}{}{}{} while running",
      format_bytes(peak_bytes()), peak_stage(), format_bytes(startup_bytes),
      data_measured ? fmt::format("prepared data {} (preparing peaked at {})", format_bytes(prepared_bytes),
                                  format_bytes(preparation_peak_bytes))
                    : std::string("data not counted (none given)"),
      arena_on_device ? fmt::format("arena 0 (its {} are the device's)", format_bytes(arena_bytes))
                      : fmt::format("arena {}", format_bytes(arena_bytes)),
      host_arena_bytes ? fmt::format(" + host arena {}", format_bytes(host_arena_bytes)) : std::string(),
      fmt::format("checkpoint mapping {}", format_bytes(weights_mapping_bytes)), format_bytes(compute_runtime_bytes),
      evaluation_bytes ? fmt::format(" + evaluation {}", format_bytes(evaluation_bytes)) : std::string(),
      generation_arena_bytes ? fmt::format(" + generation arena {}", format_bytes(generation_arena_bytes))
                             : std::string(),
      communication_bytes ? fmt::format(" + MPI {}", format_bytes(communication_bytes)) : std::string());
  return s + "\n";
}

void check_host_budget(const ProcessPlan& plan, size_t budget_bytes, const std::string& flag) {
  if (plan.peak_bytes() <= budget_bytes) return;
  throw Error(fmt::format("{} {}: the process is predicted to need {} ({} over), so the run does not start. {}",
                          flag, format_bytes(budget_bytes), format_bytes(plan.peak_bytes()),
                          format_bytes(plan.peak_bytes() - budget_bytes), plan.summary()));
}

}  // namespace memtune
