// parallel_for_balanced: every iteration runs exactly once, in ranges of at most `chunk`, whatever
// the thread count and however unevenly the threads progress.
#include "backend/cpu/parallel.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace memtune::cpu {
namespace {

void check_covers_once(int64_t n, int64_t chunk, bool slow_first_share) {
  std::vector<std::atomic<int>> visits(static_cast<size_t>(n));
  std::atomic<int> ranges_on_other_threads{0};
  parallel_for_balanced(n, chunk, [&](int64_t begin, int64_t end) {
    ASSERT_LT(begin, end);
    ASSERT_LE(end - begin, chunk);
    ASSERT_TRUE(begin % chunk == 0);
    // The first share's owner is slowed down, so the others must take its chunks from the back.
    if (slow_first_share) {
      if (omp_get_thread_num() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      if (omp_get_thread_num() != 0 && begin < n / omp_get_num_threads()) ranges_on_other_threads.fetch_add(1);
    }
    for (int64_t i = begin; i < end; ++i) visits[static_cast<size_t>(i)].fetch_add(1);
  });
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(visits[static_cast<size_t>(i)].load(), 1) << "iteration " << i;
  if (slow_first_share && omp_get_max_threads() > 1) {
    EXPECT_GT(ranges_on_other_threads.load(), 0) << "no chunk of the slow share was taken by another thread";
  }
}

TEST(ParallelForBalanced, RunsEveryIterationOnceAtAnyThreadCount) {
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3, 5}) {
    omp_set_num_threads(threads);
    SCOPED_TRACE(threads);
    for (int64_t n : {0, 1, 7, 16, 17, 100, 1000})
      for (int64_t chunk : {1, 3, 16}) check_covers_once(n, chunk, false);
  }
  omp_set_num_threads(saved);
}

TEST(ParallelForBalanced, ThreadsDoneEarlyTakeTheSlowThreadsChunks) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  check_covers_once(64, 1, true);
  omp_set_num_threads(saved);
}

}  // namespace
}  // namespace memtune::cpu
