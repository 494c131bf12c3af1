// `memtune train`: data -> plan -> training loop -> checkpoints and logs.
//
// Outputs in output_dir: log.jsonl (every log record), checkpoint-{step}/ (the model, or the
// LoRA adapter, plus optimizer.safetensors with AdamW moments and float32 masters,
// trainer_state.json with Hugging Face's fields, and memtune_state.json with the data position),
// and at the end the final model or adapter, trainer_state.json and memory.json (planned vs
// measured peak). Checkpoints are written into a temporary directory and renamed, so an
// interrupted save never replaces a complete one; save_total_limit deletes the oldest only after
// the new one is complete.
#pragma once

#include <iosfwd>

#include "train/arguments.h"

namespace memtune {

void run_training(const TrainingArguments& args, std::ostream& out);

}  // namespace memtune
