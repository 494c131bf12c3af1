// Length statistics on sets whose answers are known by hand: nearest-rank percentiles, the
// histogram, the trainable share, examples over max_length, and the suggested max_length.
#include "data/stats.h"

#include <gtest/gtest.h>

namespace memtune {
namespace {

// Lengths as given; in each example only the first label is ignored.
Dataset with_lengths(const std::vector<int>& lengths) {
  Dataset d;
  for (int n : lengths) {
    std::vector<int32_t> ids(static_cast<size_t>(n), 7);
    std::vector<int32_t> labels = ids;
    labels[0] = kIgnoreIndex;
    d.add(ids, labels);
  }
  return d;
}

TEST(LengthStats, OneToAHundred) {
  std::vector<int> lengths;
  for (int n = 100; n >= 1; --n) lengths.push_back(n);
  const LengthStats s = compute_length_stats(with_lengths(lengths), 80);
  EXPECT_EQ(s.num_examples, 100);
  EXPECT_EQ(s.total_tokens, 5050);
  EXPECT_EQ(s.target_tokens, 4950);
  EXPECT_DOUBLE_EQ(s.trainable_share, 4950.0 / 5050.0);
  EXPECT_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.mean, 50.5);
  EXPECT_EQ(s.p50, 50);
  EXPECT_EQ(s.p90, 90);
  EXPECT_EQ(s.p95, 95);
  EXPECT_EQ(s.p99, 99);
  EXPECT_EQ(s.max, 100);
  EXPECT_EQ(s.over_max_length, 20);
  EXPECT_EQ(s.suggested_max_length, 128);
  // Ten bins of width ceil(100 / 10) = 10 over [1, 101).
  ASSERT_EQ(s.histogram.size(), 10u);
  EXPECT_EQ(s.histogram[0].lo, 1);
  EXPECT_EQ(s.histogram[0].hi, 11);
  for (const auto& bin : s.histogram) EXPECT_EQ(bin.count, 10);
  EXPECT_EQ(s.histogram[9].lo, 91);
  EXPECT_EQ(s.histogram[9].hi, 101);

  const nlohmann::json j = length_stats_to_json(s);
  EXPECT_EQ(j["length"]["p95"], 95);
  EXPECT_EQ(j["max_length"], 80);
  EXPECT_EQ(j["histogram"].size(), 10u);
  EXPECT_EQ(j["suggested_max_length"], 128);
}

TEST(LengthStats, SmallSetsAndNoMaxLength) {
  const LengthStats s = compute_length_stats(with_lengths({5, 1, 3}), 0);
  EXPECT_EQ(s.p50, 3);  // rank ceil(0.5 * 3) = 2
  EXPECT_EQ(s.p90, 5);
  EXPECT_EQ(s.p99, 5);
  EXPECT_EQ(s.over_max_length, 0);
  EXPECT_EQ(s.suggested_max_length, 64);
  EXPECT_TRUE(length_stats_to_json(s)["max_length"].is_null());
  int64_t counted = 0;
  for (const auto& bin : s.histogram) counted += bin.count;
  EXPECT_EQ(counted, 3);

  const LengthStats none = compute_length_stats(Dataset{}, 512);
  EXPECT_EQ(none.num_examples, 0);
  EXPECT_TRUE(none.histogram.empty());
}

}  // namespace
}  // namespace memtune
