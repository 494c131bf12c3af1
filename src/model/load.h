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

// What a command changes in a directory's config before planning: the storage dtype (--torch_dtype,
// --bf16, --fp16) and a quantized model's LM head packed at load (--lm_head_bits).
struct ConfigChanges {
  std::optional<DType> dtype;
  int lm_head_bits = 0;
  ConfigChanges(std::optional<DType> d = std::nullopt, int bits = 0) : dtype(d), lm_head_bits(bits) {}
  void apply(ModelConfig& config) const;
};

std::unique_ptr<Decoder> load_model(const std::string& dir, ModelOptions options, const std::string& adapter = "",
                                       const ConfigChanges& changes = {});

// Fills the planned terms of the process's prediction from a planned model (allocated or
// plan-only): its arenas, the weights' loading buffers (one slice of kTransferBytes of the
// checkpoint's file pages, stored as `checkpoint_dtype`, and its staging copy), the compute
// runtime, and MPI's reduction buffers with more than one rank. The
// measured terms are the caller's (ProcessPlan::measure_preparation).
void add_planned_terms(ProcessPlan& p, const Decoder& model, DType checkpoint_dtype, int world_size);

// The config of a model directory, with the command's changes.
ModelConfig load_model_config(const std::string& dir, const ConfigChanges& changes = {});

}  // namespace memtune
