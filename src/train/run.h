// `memtune train`: data -> plan -> training loop -> checkpoints and logs.
//
// Outputs in output_dir: log.jsonl (every log record), checkpoint-{step}/ (the model, or the
// LoRA adapter, plus optimizer.safetensors with AdamW moments and float32 masters,
// trainer_state.json with Hugging Face's fields, and memtune_state.json with the data position),
// memory.jsonl (the memory timeline), run_args.json, and at the end the final model or adapter,
// trainer_state.json, memory.json (planned vs measured peak) and report.html (refreshed at every
// evaluation too). With --report_to tensorboard, rank 0 also writes every logged number to a
// TensorBoard event file in --logging_dir (report/tensorboard.h). Checkpoints are written into a temporary directory and renamed, so an
// interrupted save never replaces a complete one; save_total_limit deletes the oldest only after
// the new one is complete.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "eval/metrics.h"
#include "options/arguments.h"

namespace memtune {

// What a caller in the same process (the Python package's Trainer and its callbacks) hears of a
// run, on rank 0: every record as it is logged (after it joined log_history), the end of every
// optimizer step, every checkpoint once complete, and each evaluation's batches and extra values
// (EvalHooks; the values join the eval record as eval_<name>, so metric_for_best_model can name
// them). should_stop, asked after every step, ends training there as if it had reached max_steps
// (Trainer's control.should_training_stop). An exception thrown by a hook stops the run: a
// checkpoint being written is left out, earlier ones stay.
struct TrainingHooks {
  std::function<void(const nlohmann::json& record)> on_log;
  std::function<void(int64_t step, int64_t max_steps)> on_step_end;
  std::function<void(const std::string& checkpoint)> on_save;
  std::function<bool()> should_stop;
  EvalHooks eval;
};

// `arguments` (the command line as given, see cli::arguments_json) is written to
// output_dir/run_args.json for the run report.
void run_training(const TrainingArguments& args, std::ostream& out, const nlohmann::json& arguments,
                  const TrainingHooks& hooks = {});

}  // namespace memtune
