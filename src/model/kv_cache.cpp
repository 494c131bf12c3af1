// The KV cache's planning and blocks (see kv_cache.h).
#include "model/kv_cache.h"

#include <fmt/format.h>

#include "core/error.h"
#include "model/decoder.h"

namespace memtune {

size_t kv_bytes_per_token(const ModelConfig& c) {
  return 2 * static_cast<size_t>(c.num_hidden_layers * c.kv_dim()) * dtype_size(c.torch_dtype);
}

int64_t kv_blocks_for(int64_t tokens, int64_t block_size) {
  return (tokens + block_size - 1) / block_size;
}

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

void declare_kv_cache(const ModelConfig& c, const KvCacheOptions& kv, MemoryPlan& plan, std::vector<BufferId>& k,
                      std::vector<BufferId>& v) {
  const size_t bytes =
      static_cast<size_t>(kv.blocks * kv.block_size) * static_cast<size_t>(c.kv_dim()) * dtype_size(c.torch_dtype);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    k.push_back(plan.declare_persistent(fmt::format("kv.layer{}.k", l), Category::KvCache, bytes));
    v.push_back(plan.declare_persistent(fmt::format("kv.layer{}.v", l), Category::KvCache, bytes));
  }
}

KvBlockPool::KvBlockPool(int64_t blocks) : free_(static_cast<size_t>(blocks)) {
  for (int64_t b = 0; b < blocks; ++b) free_[static_cast<size_t>(b)] = static_cast<int32_t>(blocks - 1 - b);
}

bool KvBlockPool::reserve(int64_t count, std::vector<int32_t>& table) {
  if (count > free_blocks()) return false;
  for (int64_t b = 0; b < count; ++b) {
    table.push_back(free_.back());
    free_.pop_back();
  }
  return true;
}

void KvBlockPool::release(std::vector<int32_t>& table) {
  free_.insert(free_.end(), table.rbegin(), table.rend());
  table.clear();
}

}  // namespace memtune
