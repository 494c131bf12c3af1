// What the commands that build a model share once their flags are parsed: how training flags
// tokenize data, the storage dtype the flags ask for, a training model's options, a command's
// model as its flags name it, and the whole process's prediction for that model, checked
// against --host_memory before anything is allocated. `memtune plan` calls the same functions
// as the run it plans, so the plan of a command line is that run's plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "memory/process_plan.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/parameters.h"
#include "options/arguments.h"

namespace memtune {

// How `memtune train` (and `plan` for it) tokenize the data.
DataOptions data_options(const TrainingArguments& args);

// The storage dtype --torch_dtype / --bf16 / --fp16 ask for (none: the checkpoint's); an Error
// when they contradict each other.
std::optional<DType> storage_dtype(const std::string& torch_dtype, bool bf16, bool fp16);

// A training model's options for micro-batches of at most `max_tokens` tokens and `max_targets`
// loss targets, on rank `rank` of `world_size`.
ModelOptions training_model_options(const TrainingArguments& args, int64_t max_tokens, int64_t max_targets, int rank,
                                    int world_size);

// The process's resident memory when a command starts, with its backend made first, so what the
// backend's runtime holds from its start (a Vulkan driver and its libraries) is measured there.
size_t startup_rss_bytes(const std::string& backend);

// --device_memory's bytes: a size ("24GiB"), or "auto": what the backend's device says a plan may
// take (its memory budget where the driver reports one, else its device-local heap), or for a
// backend in host memory the kernel's MemAvailable. `source` receives where "auto" came from.
size_t device_memory_bytes(const std::string& value, const std::string& backend, std::string* source = nullptr);

// A command's model as its flags name it.
struct ModelFlags {
  std::string model;         // a Hugging Face model directory, or
  std::string preset;        // a named shape (planning only)
  std::string quantization;  // plan the linear layers quantized (planning only)
  std::string torch_dtype;
  bool bf16 = false, fp16 = false;
  std::string backend = "cpu";
  std::string adapter;                    // one PEFT adapter directory
  std::vector<std::string> adapter_sets;  // adapter directories held at once (selected per request)
  std::string host_memory;                // --host_memory: a budget for the whole process
  std::string quantized_activations = "auto";  // --quantized_activations auto | int8 | bf16 | float

  int lm_head_bits = 0;                   // --lm_head_bits: the LM head packed at load (quantize_lm_head)
};

// The config the flags describe (the directory's or the preset's, in the storage dtype asked
// for, quantized when asked), and the dtype its checkpoint files hold.
// ModelOptions::int8_activations and bf16_quantized_products as --quantized_activations asks
// (auto | int8 | bf16 | float), on `backend` (auto: bf16 where the backend prefers it, int8
// otherwise); bf16 on a backend that has no such products is an error naming the flag.
void apply_quantized_activations(const std::string& quantized_activations, ModelOptions& options,
                                 const Backend& backend);

struct ModelChoice {
  ModelConfig config;
  DType checkpoint_dtype = DType::F32;
};
ModelChoice choose_model(const ModelFlags& flags);

// Adds a model's planned terms to `process` (the model planned with `options`, nothing
// allocated, with the flags' adapter) and refuses to start when the prediction is above
// --host_memory.
void predict_process(ProcessPlan& process, const ModelFlags& flags, const ModelChoice& model, ModelOptions options,
                     int world_size = 1);

// An inference command's model: its config, its options for `limits` (max_model_len 0: the
// model's max_position_embeddings) and the whole process's prediction (`startup_rss` > 0: the
// preparation so far is measured against it).
struct InferenceSetup {
  ModelChoice model;
  ModelOptions options;
  ProcessPlan process;
};
InferenceSetup inference_setup(const ModelFlags& flags, InferenceLimits limits, size_t startup_rss);

}  // namespace memtune
