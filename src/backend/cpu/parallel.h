// Splitting a loop over the cpu kernels' threads.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace memtune::cpu {

// Runs body(begin, end) over [0, n) in chunks of `chunk` iterations on all threads. Each thread
// first walks its own contiguous share front to back, as a static schedule does (one sequential
// stream per thread, which the hardware prefetcher follows); a thread done early then takes chunks
// from the far end of the other shares. Why: on a shared machine the cores need not run at the
// same speed over the same memory-bound rows, and a static split makes the fast thread wait at
// the barrier; a dynamic schedule interleaves the threads' chunks and breaks both streams, which
// costs more than the wait (figures: docs/benchmarks.md).
template <class Body>
void parallel_for_balanced(int64_t n, int64_t chunk, Body body) {
  constexpr int kMaxShares = 64;
  const int shares_count = std::min(omp_get_max_threads(), kMaxShares);
  if (n <= 0) return;
  const int64_t chunks = (n + chunk - 1) / chunk;
  auto run = [&](int64_t c) { body(c * chunk, std::min(n, (c + 1) * chunk)); };
  if (shares_count <= 1 || chunks <= 1 || omp_in_parallel()) {
    for (int64_t c = 0; c < chunks; ++c) run(c);
    return;
  }
  struct alignas(64) Share {
    std::atomic<int64_t> claimed{0};  // chunks handed out, from either end
    std::atomic<int64_t> taken_back{0};
    int64_t first = 0, count = 0;
  };
  Share shares[kMaxShares];
  for (int s = 0; s < shares_count; ++s) {
    shares[s].first = chunks * s / shares_count;
    shares[s].count = chunks * (s + 1) / shares_count - shares[s].first;
  }
#pragma omp parallel num_threads(shares_count)
  {
    // Claims from both ends never overlap: each takes one of `count` tickets first. A share
    // without a thread (a smaller team than asked for) is left to the thieves.
    const int t = omp_get_thread_num();
    Share& own = shares[t];
    for (int64_t front = 0; own.claimed.fetch_add(1, std::memory_order_relaxed) < own.count; ++front)
      run(own.first + front);
    for (int k = 1; k < shares_count; ++k) {
      Share& other = shares[(t + k) % shares_count];
      while (other.claimed.fetch_add(1, std::memory_order_relaxed) < other.count)
        run(other.first + other.count - 1 - other.taken_back.fetch_add(1, std::memory_order_relaxed));
    }
  }
}

}  // namespace memtune::cpu
