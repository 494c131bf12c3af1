// The KV cache of an inference model, in one place: its layout, its planning, its blocks.
//
// Layout: for every layer a K and a V buffer of `blocks` x `block_size` token slots, each slot
// kv_dim values in the storage dtype. A sequence owns whole blocks, listed in order in its block
// table; token t of a sequence lives in slot table[t / block_size] * block_size + t % block_size.
// So sequences of any length share the pool without fragmentation (vLLM's paged attention).
//
// Planning: the pool holds max_num_seqs sequences of max_model_len, or, with a device budget
// (vLLM's gpu_memory_utilization), as many blocks as the budget leaves after the weights and the
// step's workspace. The buffers are declared in the model's MemoryPlan like every other buffer.
//
// Allocation: KvBlockPool hands whole blocks out and takes them back; the generation engine
// reserves a request's prompt + max_new_tokens at admission, so a running sequence never waits
// for a block and nothing is evicted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "memory/plan.h"
#include "model/config.h"

namespace memtune {

class Backend;
struct ModelOptions;

// The pool's shape, fixed by the plan (ModelOptions::kv_cache).
struct KvCacheOptions {
  int64_t blocks = 0;              // 0: a training / evaluation model
  int64_t block_size = 16;         // tokens per block (vLLM's default)
  int64_t max_seqs = 1;            // sequences one step holds (max_num_seqs)
  int64_t max_model_len = 16;      // the most tokens (prompt + output) one sequence may hold
  int64_t max_blocks_per_seq = 1;  // ceil(max_model_len / block_size)
};

// What a command asks of inference, as vLLM's flags say it.
struct InferenceLimits {
  int64_t max_model_len = 0;             // the most tokens (prompt + output) of one sequence
  int64_t max_num_seqs = 8;              // sequences one step holds
  int64_t max_num_batched_tokens = 512;  // tokens one step computes (prefill chunks + decode tokens)
  int64_t block_size = 16;               // tokens per KV block
  size_t device_memory = 0;              // > 0: size the pool from device_memory x memory_fraction
  double memory_fraction = 0.9;
};

// KV cache bytes one token takes: K and V of every layer in the storage dtype.
size_t kv_bytes_per_token(const ModelConfig& config);

// Blocks that hold `tokens` tokens.
int64_t kv_blocks_for(int64_t tokens, int64_t block_size);

// Declares each layer's K and V buffers (persistent, Category::KvCache) into `plan`.
void declare_kv_cache(const ModelConfig& config, const KvCacheOptions& kv, MemoryPlan& plan, std::vector<BufferId>& k,
                      std::vector<BufferId>& v);

// The free blocks of the pool. Blocks are handed out lowest first and taken back in any order.
class KvBlockPool {
 public:
  explicit KvBlockPool(int64_t blocks);
  // Appends `count` blocks to `table` and returns true, or returns false and takes none.
  bool reserve(int64_t count, std::vector<int32_t>& table);
  // Returns the table's blocks to the pool and clears it.
  void release(std::vector<int32_t>& table);
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }

 private:
  std::vector<int32_t> free_;  // a stack: the next block handed out is at the back
};

}  // namespace memtune
