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

#include <iosfwd>

#include <nlohmann/json_fwd.hpp>

#include "options/arguments.h"

namespace memtune {

// `arguments` (the command line as given, see cli::arguments_json) is written to
// output_dir/run_args.json for the run report.
void run_training(const TrainingArguments& args, std::ostream& out, const nlohmann::json& arguments);

}  // namespace memtune
