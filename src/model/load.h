// Opening a model, the one way every command does it: config.json from a Hugging Face directory
// (its torch_dtype replaced when the command says so), the plan for the command's options, the
// weights, and a PEFT adapter when one is given (its adapter_config.json sets options.lora).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "memory/process_plan.h"
#include "model/decoder.h"

namespace memtune {

std::unique_ptr<Decoder> load_model(const std::string& dir, ModelOptions options, const std::string& adapter = "",
                                       std::optional<DType> dtype = std::nullopt);

// Fills the planned terms of the process's prediction from a planned model (allocated or
// plan-only): its arenas, the weights' loading buffers (one slice of kTransferBytes of the
// checkpoint's file pages, stored as `checkpoint_dtype`, and its staging copy), the compute
// runtime, and MPI's reduction buffers with more than one rank. The
// measured terms are the caller's (ProcessPlan::measure_preparation).
void add_planned_terms(ProcessPlan& p, const Decoder& model, DType checkpoint_dtype, int world_size);

// The config of a model directory, with an optional storage dtype override.
ModelConfig load_model_config(const std::string& dir, std::optional<DType> dtype = std::nullopt);

}  // namespace memtune
