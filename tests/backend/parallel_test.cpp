// parallel_for_balanced: every iteration runs exactly once, in ranges of at most `chunk`, whatever
// the thread count; each thread walks its own share front to back, and a thread done early takes
// the chunks a slow thread has not reached from the far end of that thread's share. The slow
// thread is made slow by an event, not a clock: it holds its first chunk until the other threads
// have run every other chunk, which they can only do by taking its share.
#include "backend/cpu/parallel.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <vector>

namespace memtune::cpu {
namespace {

TEST(ParallelForBalanced, RunsEveryIterationOnceAtAnyThreadCount) {
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3, 5}) {
    omp_set_num_threads(threads);
    SCOPED_TRACE(threads);
    for (int64_t n : {0, 1, 7, 16, 17, 100, 1000})
      for (int64_t chunk : {1, 3, 16}) {
        std::vector<std::atomic<int>> visits(static_cast<size_t>(n));
        parallel_for_balanced(n, chunk, [&](int64_t begin, int64_t end) {
          ASSERT_LT(begin, end);
          ASSERT_LE(end - begin, chunk);
          ASSERT_TRUE(begin % chunk == 0);
          for (int64_t i = begin; i < end; ++i) visits[static_cast<size_t>(i)].fetch_add(1);
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(visits[static_cast<size_t>(i)].load(), 1) << "iteration " << i;
      }
  }
  omp_set_num_threads(saved);
}

// Thread 0 blocks in its first chunk until every other chunk has run. Nothing but stealing lets
// the others finish thread 0's share, so (with more than one thread) the run ends with: thread 0
// ran chunk 0 alone; each thread's own chunks are the front of its share in order; every chunk of
// thread 0's share after the first was taken by another thread, each thief from the back down.
// Were there no stealing, thread 0 would wait for ever; the wait gives up after a minute so that
// such a failure is reported rather than hung.
TEST(ParallelForBalanced, ThreadsDoneEarlyTakeTheSlowThreadsChunksFromTheBack) {
  const int saved = omp_get_max_threads();
  for (int threads : {2, 3, 5}) {
    SCOPED_TRACE(threads);
    omp_set_num_threads(threads);
    const int64_t chunks = 64;
    std::vector<std::atomic<int>> visits(chunks);
    std::vector<std::vector<int64_t>> ran_by(static_cast<size_t>(threads));  // chunks, in each thread's order
    std::mutex mu;
    std::condition_variable all_others_done;
    int64_t others_done = 0;  // chunks other than 0 that have run (guarded by mu)
    bool gave_up = false;
    parallel_for_balanced(chunks, 1, [&](int64_t begin, int64_t end) {
      ASSERT_EQ(end, begin + 1);
      const int t = omp_get_thread_num();
      ran_by[static_cast<size_t>(t)].push_back(begin);
      visits[static_cast<size_t>(begin)].fetch_add(1);
      std::unique_lock lock(mu);
      if (begin != 0) {
        ++others_done;
        lock.unlock();
        all_others_done.notify_all();
      } else if (t == 0 && omp_get_num_threads() > 1) {
        gave_up = !all_others_done.wait_for(lock, std::chrono::minutes(1), [&] { return others_done == chunks - 1; });
      }
    });
    ASSERT_FALSE(gave_up) << "thread 0 held chunk 0 and no other thread took the rest of its share";
    for (int64_t c = 0; c < chunks; ++c) ASSERT_EQ(visits[static_cast<size_t>(c)].load(), 1) << "chunk " << c;
    // Thread 0 ran chunk 0 and nothing else (or nothing: a thread that starts late may find its
    // share taken), so every other chunk of its share ran on another thread.
    const std::vector<int64_t>& slow = ran_by[0];
    ASSERT_TRUE(slow.empty() || slow == std::vector<int64_t>{0})
        << "thread 0 ran more than the chunk it was held in: " << ::testing::PrintToString(slow);

    // The shares as the function cuts them: share s is [share_first(s), share_first(s + 1)).
    const auto share_first = [&](int s) { return chunks * s / threads; };
    const auto share_of = [&](int64_t c) {
      int s = 0;
      while (c >= share_first(s + 1)) ++s;
      return s;
    };
    for (int t = 0; t < threads; ++t) {
      SCOPED_TRACE(t);
      const std::vector<int64_t>& ran = ran_by[static_cast<size_t>(t)];
      // Its own share first, front to back from the share's start (a thread that starts late may
      // find all of it taken), then only chunks of other shares, each share's from the back down.
      size_t own = 0;
      while (own < ran.size() && ran[own] == share_first(t) + static_cast<int64_t>(own) && share_of(ran[own]) == t)
        ++own;
      for (size_t k = own; k < ran.size(); ++k) {
        EXPECT_NE(share_of(ran[k]), t) << "chunk " << ran[k] << " of its own share ran out of order";
        if (k > own && share_of(ran[k]) == share_of(ran[k - 1])) {
          EXPECT_LT(ran[k], ran[k - 1]) << "a thief took a share's chunks front to back";
        }
      }
    }
  }
  omp_set_num_threads(saved);
}

}  // namespace
}  // namespace memtune::cpu
