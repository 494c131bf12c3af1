// `memtune plan` for a training command line: the run's data tokenized as the run tokenizes it
// (when --train_file is given), the micro-batches it makes, and the options of the run's
// training and evaluation models for any batch size and length, so that both the plan of the
// command line and the --fit search (cli/plan_fit.h) plan exactly what the run would allocate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "data/dataset.h"
#include "eval/eval_data.h"
#include "memory/process_plan.h"
#include "options/command_setup.h"

namespace memtune::cli {

struct PlanArgs {
  TrainingArguments run;
  std::string preset, device_memory, quantization;
  std::string vulkan_max_allocation;  // plan for an absent Vulkan device with this allocation limit
  int64_t eval_sequences = 1000;
  bool json = false, fit = false, allow_shorter_max_length = false;
  int world_size = 1;
};

// The most tokens and loss targets one rank's micro-batch holds.
struct MicroBatch {
  int64_t tokens = 0, targets = 0;
};

class TrainingPlanner {
 public:
  // Loads the config (or the preset) and the data, and measures the preparation against
  // `startup_rss`.
  TrainingPlanner(const PlanArgs& args, size_t startup_rss);

  const PlanArgs& args() const { return args_; }
  const ModelConfig& config() const { return model_.config; }
  DType checkpoint_dtype() const { return model_.checkpoint_dtype; }
  // The startup and preparation terms; the planned terms are the caller's (add_planned_terms).
  const ProcessPlan& prepared_process() const { return process_; }
  bool has_train_data() const { return !train_data_.empty(); }
  const EvalData* eval_data() const { return eval_data_.get(); }

  // Without data a micro-batch is batch x length tokens (the most a padding-free or packed
  // micro-batch can hold).
  MicroBatch train_micro(int64_t batch, int64_t length) const;
  MicroBatch eval_micro(int64_t batch, int64_t length) const;
  // The run's one plan serves training and, with an eval file, evaluation: the larger
  // micro-batch of the two. Plan-only (nothing allocated).
  ModelOptions run_options(int64_t batch, int64_t length) const;
  // The evaluation model beside the training model `train` (run_options of the flags' batch
  // size and length).
  ModelOptions eval_options(const ModelOptions& train) const;

 private:
  const PlanArgs& args_;
  ModelChoice model_;
  ProcessPlan process_;
  Dataset train_data_;
  std::unique_ptr<EvalData> eval_data_;
};

}  // namespace memtune::cli
