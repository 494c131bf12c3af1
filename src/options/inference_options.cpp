#include "options/inference_options.h"

#include <fmt/format.h>

#include "core/error.h"

namespace memtune {

ModelOptions inference_model_options(const ModelConfig& config, const InferenceLimits& limits, Backend* backend,
                                     bool allocate) {
  auto positive = [](const char* flag, int64_t value) {
    if (value <= 0) throw Error(fmt::format("--{} must be positive, got {}", flag, value));
  };
  positive("max_model_len", limits.max_model_len);
  positive("max_num_seqs", limits.max_num_seqs);
  positive("max_num_batched_tokens", limits.max_num_batched_tokens);
  positive("block_size", limits.block_size);
  check_max_length(config, limits.max_model_len, "config.json");
  if (limits.max_num_batched_tokens < limits.max_num_seqs)
    throw Error(
        fmt::format("--max_num_batched_tokens {} is below --max_num_seqs {}: every running sequence needs a "
                    "token in each decode step",
                    limits.max_num_batched_tokens, limits.max_num_seqs));
  if (!(limits.memory_fraction > 0 && limits.memory_fraction <= 1))
    throw Error(fmt::format("--memory_fraction must be in (0, 1], got {}", limits.memory_fraction));

  ModelOptions o;
  o.max_tokens = limits.max_num_batched_tokens;
  o.with_grads = false;
  o.loss_workspace_bytes = 0;
  // A bfloat16 model computes as Hugging Face and vLLM compute it: steps of many rows (prefill)
  // take bfloat16 operands with float32 accumulation where the backend has such products.
  if (config.torch_dtype == DType::BF16) o.compute_dtype = DType::BF16;
  o.backend = backend;
  o.allocate = allocate;
  KvCacheOptions& kv = o.kv_cache;
  kv.block_size = limits.block_size;
  kv.max_seqs = limits.max_num_seqs;
  kv.max_model_len = limits.max_model_len;
  kv.max_blocks_per_seq = kv_blocks_for(limits.max_model_len, limits.block_size);
  kv.blocks = kv.max_seqs * kv.max_blocks_per_seq;
  if (limits.device_memory == 0) return o;

  // The budget: plan with one block to learn everything else, then give the pool the rest.
  const size_t budget = static_cast<size_t>(static_cast<double>(limits.device_memory) * limits.memory_fraction);
  ModelOptions probe = o;
  probe.allocate = false;
  probe.kv_cache.blocks = 1;
  const Decoder one_block(config, probe);
  const size_t per_block = kv_bytes_per_token(config) * static_cast<size_t>(kv.block_size);
  const size_t rest = one_block.plan().peak_bytes() - one_block.plan().live_bytes(Phase::Forward, Category::KvCache);
  const size_t least = rest + per_block * static_cast<size_t>(kv.max_blocks_per_seq);
  if (budget < least)
    throw Error(
        fmt::format("--device_memory {} x --memory_fraction {} = {} bytes cannot hold the model and its step "
                    "workspace ({} bytes) plus one sequence of --max_model_len {} ({} bytes of KV cache)",
                    limits.device_memory, limits.memory_fraction, budget, rest, limits.max_model_len,
                    per_block * static_cast<size_t>(kv.max_blocks_per_seq)));
  kv.blocks = static_cast<int64_t>((budget - rest) / per_block);
  // Each layer's K and V are padded to the plan's alignment: step down until the plan fits.
  for (;;) {
    ModelOptions check = o;
    check.allocate = false;
    if (Decoder(config, check).plan().peak_bytes() <= budget || kv.blocks <= kv.max_blocks_per_seq) break;
    --kv.blocks;
  }
  return o;
}

}  // namespace memtune
