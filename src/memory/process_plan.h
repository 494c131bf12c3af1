// The whole process's memory, predicted before the planned memory exists. The arena is the
// plan's; around it a run holds what the plan does not allocate: the binary and its libraries,
// the tokenizer while it is alive, the tokenized data, the checkpoint's file pages while the
// weights are read, the compute library's buffers. The terms that exist before the model are
// measured in the process that predicts (the run itself, or `memtune plan`, which loads the
// same tokenizer and data the same way); the rest are the plans' bytes and named constants.
//
// A run goes through three stages and its peak is the largest of them:
//   preparing  the tokenizer parses its files and tokenizes the data (measured peak)
//   loading    prepared data + both arenas (committed when made) + the checkpoint's mapped files
//   running    prepared data + both arenas + the compute runtime (+ MPI's buffers per rank)
#pragma once

#include <cstddef>
#include <string>

#include <nlohmann/json.hpp>

namespace memtune {

// What the compute runtime (OpenBLAS, OpenMP, code pages, the first step's own small buffers)
// touches once steps run, beyond the arena: the most measured over thread counts for training
// steps (float32 full fine-tuning touches the most) and for forward-only evaluation, each rounded
// up (see docs/benchmarks.md).
constexpr size_t kTrainingRuntimeBytes = size_t{22} << 20;
constexpr size_t kForwardRuntimeBytes = size_t{4} << 20;
// Evaluation inside a training run (its batches' results, metrics and records, beyond the
// arena): what the demo's training with evaluation peaked above its prediction without this
// term, rounded up (see docs/benchmarks.md).
constexpr size_t kEvaluationRuntimeBytes = size_t{20} << 20;
// Open MPI's initialization in each rank of a data-parallel run (libraries, shared-memory
// segments), as measured with 2 ranks on one machine (see docs/benchmarks.md). A run measures it
// in its startup; `memtune plan`, which does not start MPI, adds it.
constexpr size_t kMpiInitBytes = size_t{8} << 20;
// A device backend's fixed costs beside its arena. Not yet measured: these are the commonly
// reported sizes for CUDA 12+ with lazy module loading on a Hopper GPU and must be replaced by
// figures measured on a GPU when the CUDA backend lands.
constexpr size_t kCudaContextBytes = size_t{512} << 20;           // the context and loaded kernels
constexpr size_t kCudaLibraryWorkspaceBytes = size_t{32} << 20;   // cuBLAS workspace (Hopper)

struct ProcessPlan {
  // Measured in the predicting process.
  size_t startup_bytes = 0;            // resident when the command started (binary, libraries)
  size_t preparation_peak_bytes = 0;   // peak while the tokenizer and the data were loaded
  size_t prepared_bytes = 0;           // resident above startup once prepared (data, live tokenizer)
  bool data_measured = false;          // false: no data was given, the two above are not counted
  // Planned and modelled.
  size_t arena_bytes = 0;              // the device plan (host pages on the cpu backends)
  bool arena_on_device = false;        // the arena is a discrete GPU's memory: not counted here
  size_t host_arena_bytes = 0;         // the host plan (offloaded optimizer state, staging)
  size_t weights_mapping_bytes = 0;    // the checkpoint's mapped pages and staging while the weights are read
  size_t compute_runtime_bytes = kTrainingRuntimeBytes;
  size_t evaluation_bytes = 0;         // evaluation during training (kEvaluationRuntimeBytes)
  size_t generation_arena_bytes = 0;   // evaluation by generation in training: the generation view's plan
  size_t communication_bytes = 0;      // MPI's reduction buffers, with more than one rank

  // Takes the measured terms from this process's counters: call once the tokenizer and the data
  // are loaded (and the tokenizer released, when the command releases it before the model).
  void measure_preparation(size_t startup_rss_bytes);

  // The arena's bytes in this process's memory: arena_bytes, or 0 when it is on the device.
  size_t arena_host_bytes() const { return arena_on_device ? 0 : arena_bytes; }
  size_t loading_bytes() const;
  size_t running_bytes() const;
  size_t peak_bytes() const;
  const char* peak_stage() const;

  nlohmann::json to_json() const;
  // One line: "process: X predicted peak (stage): ...terms".
  std::string summary() const;
};

// The whole-process budget check: an Error with the prediction, its terms and the budget.
void check_host_budget(const ProcessPlan& plan, size_t budget_bytes, const std::string& flag);

}  // namespace memtune
