// The KV cache's planning and blocks (see kv_cache.h).
#include "model/kv_cache.h"

#include <fmt/format.h>

#include "core/error.h"

namespace memtune {

size_t kv_bytes_per_token(const ModelConfig& c) {
  return 2 * static_cast<size_t>(c.num_hidden_layers * c.kv_dim()) * dtype_size(c.torch_dtype);
}

int64_t kv_blocks_for(int64_t tokens, int64_t block_size) {
  return (tokens + block_size - 1) / block_size;
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
