// `memtune plan --fit`: searches the levers users know (micro-batch with accumulation keeping the
// effective batch, gradient checkpointing, logits chunk, LoRA rank, bfloat16 storage, optimizer
// offload, ZeRO-1, a 4-bit base, and optionally a shorter max_length) for the configurations
// whose plan fits the device budget and whose process prediction fits the host budget, ranked by
// an estimated step time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cli/plan_training.h"

namespace memtune::cli {

// One configuration the search considers.
struct FitCandidate {
  int64_t batch, accumulation, max_length, lora_rank;
  bool checkpointing, bf16, offload;
  int zero_stage;
  size_t workspace;
  std::string quantization = {};  // a quantized base (LoRA): "gptq-int4"
  size_t peak = 0, process_peak = 0;
  double cost = 0;  // estimated step time, arbitrary units
  // The train command's flags for this configuration.
  std::string flags() const;
};

struct FitResult {
  std::vector<FitCandidate> fitting;     // fastest first
  std::optional<FitCandidate> smallest;  // the smallest peak found, fitting or not
};

// `eval`: the command line's evaluation model (planner.eval_options); `process`: its own
// prediction (its terms besides the model's are kept for every candidate). At least one of the
// budgets is given.
FitResult fit_search(const TrainingPlanner& planner, const ModelOptions& eval, const ProcessPlan& process,
                     std::optional<size_t> device_budget, std::optional<size_t> host_budget);

}  // namespace memtune::cli
