// How n elements split over `world` ranks: rank r owns the block [n r / world, n (r+1) / world)
// (contiguous, sizes differ by at most one). ZeRO-1's optimizer shards and the collectives that
// serve them use this one rule.
#pragma once

#include <cstddef>

namespace memtune {

struct Shard {
  size_t begin = 0, end = 0;
  size_t size() const { return end - begin; }
};

inline Shard shard_of(size_t n, int rank, int world) {
  return {n * static_cast<size_t>(rank) / static_cast<size_t>(world),
          n * static_cast<size_t>(rank + 1) / static_cast<size_t>(world)};
}

}  // namespace memtune
