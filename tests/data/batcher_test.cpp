// Batching: micro-batches as flat streams with consistent cu_seqlens, seeded shuffles that repeat
// per (seed, epoch) and change across epochs, packing that never splits an example nor overfills
// a row, and rank shares that are disjoint and add up to the single-process global batch.
#include "data/batcher.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "support/test_util.h"

namespace memtune {
namespace {

using testing_support::error_of;

// Example i has length lengths[i]; its tokens are all i (so a token names its example) and its
// labels are i except the first, which is ignored.
Dataset make_dataset(const std::vector<int>& lengths) {
  Dataset d;
  for (size_t i = 0; i < lengths.size(); ++i) {
    std::vector<int32_t> ids(static_cast<size_t>(lengths[i]), static_cast<int32_t>(i));
    std::vector<int32_t> labels = ids;
    labels[0] = kIgnoreIndex;
    d.add(ids, labels);
  }
  return d;
}

std::vector<int> varied_lengths(int n) {
  std::vector<int> lengths;
  for (int i = 0; i < n; ++i) lengths.push_back(1 + (i * 37) % 29);
  return lengths;
}

// The example of each sequence of the micro-batch, checking the batch is well formed.
std::vector<int32_t> examples_of(const MicroBatch& b, const Dataset& d) {
  EXPECT_EQ(b.input_ids.size(), b.labels.size());
  EXPECT_FALSE(b.cu_seqlens.empty());
  EXPECT_EQ(b.cu_seqlens.front(), 0);
  EXPECT_EQ(b.cu_seqlens.back(), static_cast<int32_t>(b.input_ids.size()));
  std::vector<int32_t> examples;
  int64_t targets = 0;
  for (int64_t s = 0; s < b.num_sequences(); ++s) {
    const int32_t begin = b.cu_seqlens[s], end = b.cu_seqlens[s + 1];
    EXPECT_LT(begin, end);
    const int32_t example = b.input_ids[begin];
    EXPECT_EQ(static_cast<size_t>(end - begin), d.length(example)) << "a sequence is exactly one whole example";
    for (int32_t t = begin; t < end; ++t) EXPECT_EQ(b.input_ids[t], example);
    EXPECT_EQ(b.labels[begin], kIgnoreIndex);
    examples.push_back(example);
    targets += d.num_targets(example);
  }
  EXPECT_EQ(b.num_targets, targets);
  return examples;
}

// Every micro-batch of the epoch, as lists of examples.
std::vector<std::vector<int32_t>> epoch_batches(Batcher& batcher, const Dataset& d, int64_t epoch) {
  batcher.start_epoch(epoch);
  std::vector<std::vector<int32_t>> batches;
  MicroBatch b;
  while (batcher.next(b)) batches.push_back(examples_of(b, d));
  EXPECT_EQ(static_cast<int64_t>(batches.size()), batcher.num_batches());
  return batches;
}

std::vector<int32_t> flatten(const std::vector<std::vector<int32_t>>& batches) {
  std::vector<int32_t> all;
  for (const auto& b : batches) all.insert(all.end(), b.begin(), b.end());
  return all;
}

TEST(Batcher, MicroBatchesHoldPerDeviceSequencesAndCoverTheEpochOnce) {
  const Dataset d = make_dataset(varied_lengths(23));
  BatchOptions options;
  options.per_device_batch_size = 4;
  Batcher batcher(d, options);
  const auto batches = epoch_batches(batcher, d, 0);
  ASSERT_EQ(batches.size(), 6u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(batches[i].size(), 4u);
  EXPECT_EQ(batches[5].size(), 3u);
  auto all = flatten(batches);
  std::sort(all.begin(), all.end());
  for (int32_t i = 0; i < 23; ++i) EXPECT_EQ(all[i], i);

  options.drop_last = true;
  Batcher dropping(d, options);
  EXPECT_EQ(epoch_batches(dropping, d, 0).size(), 5u);
}

TEST(Batcher, ShuffleRepeatsPerSeedAndEpochAndVariesAcrossThem) {
  const Dataset d = make_dataset(varied_lengths(50));
  BatchOptions options;
  options.per_device_batch_size = 3;
  Batcher a(d, options), b(d, options);
  const auto epoch0 = flatten(epoch_batches(a, d, 0));
  EXPECT_EQ(epoch0, flatten(epoch_batches(b, d, 0)));
  const auto epoch1 = flatten(epoch_batches(a, d, 1));
  EXPECT_NE(epoch0, epoch1);
  EXPECT_EQ(epoch1, flatten(epoch_batches(b, d, 1)));
  EXPECT_EQ(epoch0, flatten(epoch_batches(a, d, 0)));  // going back reproduces it
  options.seed = 7;
  Batcher c(d, options);
  EXPECT_NE(epoch0, flatten(epoch_batches(c, d, 0)));
  options.shuffle = false;
  Batcher in_order(d, options);
  const auto ordered = flatten(epoch_batches(in_order, d, 3));
  for (int32_t i = 0; i < 50; ++i) EXPECT_EQ(ordered[i], i);
}

TEST(Batcher, PackingKeepsExamplesWholeAndRowsWithinMaxLength) {
  const Dataset d = make_dataset(varied_lengths(400));
  BatchOptions options;
  options.packing = true;
  options.max_length = 64;
  options.per_device_batch_size = 1;  // one row per micro-batch
  Batcher batcher(d, options);
  for (int64_t epoch : {0, 1}) {
    const auto rows = epoch_batches(batcher, d, epoch);
    std::vector<int32_t> all;
    int64_t tokens = 0;
    for (const auto& row : rows) {
      int64_t length = 0;
      for (int32_t e : row) length += static_cast<int64_t>(d.length(e));
      EXPECT_LE(length, 64);
      tokens += length;
      all.insert(all.end(), row.begin(), row.end());
    }
    std::sort(all.begin(), all.end());
    ASSERT_EQ(all.size(), 400u);
    for (int32_t i = 0; i < 400; ++i) ASSERT_EQ(all[i], i);
    // First-fit over open rows wastes little: the rows are nearly full.
    EXPECT_GT(static_cast<double>(tokens) / (static_cast<double>(rows.size()) * 64), 0.95);
  }
  EXPECT_EQ(batcher.max_micro_batch_tokens(), 64);
  options.max_length = 10;
  EXPECT_CONTAINS(error_of([&] { Batcher batcher(d, options); }), "more than the packing max_length 10");
  options.max_length = 0;
  EXPECT_CONTAINS(error_of([&] { Batcher batcher(d, options); }), "packing needs max_length");
}

// For world sizes 1..4, with and without packing: each global micro-batch's rank shares are
// disjoint and their union (in rank order) is the single-process batch of the same global size.
TEST(Batcher, RankSharesPartitionTheSingleProcessGlobalBatch) {
  const Dataset d = make_dataset(varied_lengths(37));
  for (bool packing : {false, true}) {
    for (int world : {1, 2, 3, 4}) {
      BatchOptions options;
      options.packing = packing;
      options.max_length = 48;
      options.per_device_batch_size = 2;
      options.world_size = world;
      BatchOptions single = options;
      single.world_size = 1;
      single.per_device_batch_size = 2 * world;
      Batcher whole(d, single);
      const auto expected = epoch_batches(whole, d, 1);
      std::vector<Batcher> ranks;
      for (int r = 0; r < world; ++r) {
        options.rank = r;
        ranks.emplace_back(d, options);
        ranks.back().start_epoch(1);
      }
      for (const auto& global : expected) {
        std::vector<int32_t> united;
        for (auto& rank : ranks) {
          MicroBatch b;
          ASSERT_TRUE(rank.next(b));
          const auto share = examples_of(b, d);
          united.insert(united.end(), share.begin(), share.end());
        }
        EXPECT_EQ(united, global) << "packing " << packing << " world " << world;
        EXPECT_EQ(std::set<int32_t>(united.begin(), united.end()).size(), united.size());
      }
      for (auto& rank : ranks) {
        MicroBatch b;
        EXPECT_FALSE(rank.next(b));
      }
    }
  }
}

TEST(Batcher, AShortLastBatchCanLeaveARankEmpty) {
  const Dataset d = make_dataset({3, 4, 5, 6, 7});
  BatchOptions options;
  options.per_device_batch_size = 2;
  options.world_size = 4;
  options.rank = 0;
  Batcher rank0(d, options);
  MicroBatch b;
  ASSERT_TRUE(rank0.next(b));
  EXPECT_EQ(b.num_sequences(), 1);  // 5 units over 4 ranks: shares of 1, 1, 1, 2
  EXPECT_FALSE(rank0.next(b));
  options.per_device_batch_size = 1;
  options.world_size = 8;
  options.rank = 2;
  Batcher rank2(d, options);
  ASSERT_TRUE(rank2.next(b));
  EXPECT_EQ(b.num_sequences(), 0);
  EXPECT_EQ(b.cu_seqlens, std::vector<int32_t>{0});
  EXPECT_TRUE(b.input_ids.empty());
}

TEST(Batcher, MaxMicroBatchTokensBoundsEveryBatch) {
  const Dataset d = make_dataset(varied_lengths(60));
  BatchOptions options;
  options.per_device_batch_size = 5;
  Batcher batcher(d, options);
  const int64_t bound = batcher.max_micro_batch_tokens();
  int64_t largest = 0;
  for (int64_t epoch = 0; epoch < 5; ++epoch) {
    batcher.start_epoch(epoch);
    MicroBatch b;
    while (batcher.next(b)) largest = std::max<int64_t>(largest, static_cast<int64_t>(b.input_ids.size()));
  }
  EXPECT_LE(largest, bound);
  EXPECT_EQ(bound, 29 + 29 + 28 + 28 + 27);  // the five longest examples of varied_lengths(60)
}

TEST(Batcher, RefusesBadSetups) {
  const Dataset empty;
  EXPECT_CONTAINS(error_of([&] { Batcher batcher(empty, {}); }), "no examples");
  const Dataset d = make_dataset({3});
  BatchOptions options;
  options.rank = 2;
  options.world_size = 2;
  EXPECT_CONTAINS(error_of([&] { Batcher batcher(d, options); }), "rank 2 of world_size 2");
  options = {};
  options.per_device_batch_size = 0;
  EXPECT_CONTAINS(error_of([&] { Batcher batcher(d, options); }), "per_device_batch_size");
}

}  // namespace
}  // namespace memtune
