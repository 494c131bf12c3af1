// Token-length statistics of a dataset, for choosing max_length before training (`memtune data
// stats`): percentiles, a histogram, the share of tokens that are loss targets, how many
// examples a given max_length would cut, and a suggested max_length.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/dataset.h"

namespace memtune {

struct LengthStats {
  struct Bin {
    int64_t lo = 0, hi = 0;  // lengths in [lo, hi)
    int64_t count = 0;
  };

  int64_t num_examples = 0;
  int64_t total_tokens = 0;
  int64_t target_tokens = 0;   // loss targets (Dataset::num_targets)
  double trainable_share = 0;  // target_tokens / total_tokens
  // Token lengths; percentiles by the nearest-rank rule: pN is the smallest length L such that
  // at least N% of the examples have length <= L.
  int64_t min = 0, p50 = 0, p90 = 0, p95 = 0, p99 = 0, max = 0;
  double mean = 0;
  // Equal-width bins covering [min, max]: width ceil((max - min + 1) / bins).
  std::vector<Bin> histogram;
  // With max_length > 0: examples longer than it, which training would delete (strategy
  // delete) or truncate (left, right).
  int64_t max_length = 0;
  int64_t over_max_length = 0;
  // p99 rounded up to a multiple of 64: what 99% of the examples fit in, on a GPU-friendly size.
  int64_t suggested_max_length = 0;
};

LengthStats compute_length_stats(const Dataset& dataset, int64_t max_length, int bins = 10);

// The statistics as JSON (the keys of `memtune data stats --json`):
// {"examples", "total_tokens", "target_tokens", "trainable_share",
//  "length": {"min", "mean", "p50", "p90", "p95", "p99", "max"},
//  "histogram": [{"lo", "hi", "count"}, ...], "max_length" (null when not given),
//  "over_max_length", "suggested_max_length"}
nlohmann::json length_stats_to_json(const LengthStats& stats);

// Classification data: examples per label (lines that do not parse, or whose "label" is absent or
// not a string, number or boolean, are not counted: the dataset reader reports them as bad lines), and the majority-class baseline accuracy: the share of the most common label.
struct LabelCounts {
  std::map<std::string, int64_t> counts;
  std::string majority;
  double majority_share = 0;
};
LabelCounts count_labels(const std::string& path);

}  // namespace memtune
