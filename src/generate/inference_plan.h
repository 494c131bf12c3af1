// Sizing an inference model: the KV cache pool from max_model_len x max_num_seqs, or from a
// memory budget (vLLM's gpu_memory_utilization: the pool is what the budget leaves after the
// weights and the step's workspace), as ModelOptions for Qwen2Model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "model/config.h"
#include "model/parameters.h"

namespace memtune {

struct InferenceLimits {
  int64_t max_model_len = 0;            // the most tokens (prompt + output) of one sequence
  int64_t max_num_seqs = 8;             // sequences one step holds
  int64_t max_num_batched_tokens = 512; // tokens one step computes (prefill chunks + decode tokens)
  int64_t block_size = 16;              // tokens per KV block
  size_t device_memory = 0;             // > 0: size the pool from device_memory x memory_fraction
  double memory_fraction = 0.9;
};

// KV cache bytes one token takes: K and V of every layer in the storage dtype.
size_t kv_bytes_per_token(const Qwen2Config& config);

// The options of an inference model for these limits. Without a budget the pool holds
// max_num_seqs sequences of max_model_len; with one, as many blocks as fit after everything
// else the plan holds. Errors name the flag: limits that are not positive, max_model_len beyond
// max_position_embeddings, max_num_batched_tokens below max_num_seqs, a budget that cannot hold
// the model plus one sequence of max_model_len.
ModelOptions inference_model_options(const Qwen2Config& config, const InferenceLimits& limits, Backend* backend,
                                     bool allocate = true);

}  // namespace memtune
