// Length statistics (see stats.h): one pass over the example lengths, sorted for percentiles.
#include "data/stats.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "core/jsonl.h"
#include "data/formats.h"

namespace memtune {

namespace {

constexpr int64_t kSuggestedMultiple = 64;

// Nearest rank: the value at rank ceil(p/100 * n) (1-based) of the sorted lengths.
int64_t percentile(const std::vector<int64_t>& sorted, int p) {
  const auto n = static_cast<int64_t>(sorted.size());
  const int64_t rank = std::max<int64_t>(1, (p * n + 99) / 100);
  return sorted[rank - 1];
}

}  // namespace

LengthStats compute_length_stats(const Dataset& dataset, int64_t max_length, int bins) {
  MT_ASSERT(bins >= 1);
  LengthStats s;
  s.max_length = max_length;
  s.num_examples = static_cast<int64_t>(dataset.size());
  if (dataset.empty()) return s;
  std::vector<int64_t> lengths(dataset.size());
  for (size_t i = 0; i < dataset.size(); ++i) {
    lengths[i] = static_cast<int64_t>(dataset.length(i));
    s.target_tokens += dataset.num_targets(i);
    if (max_length > 0 && lengths[i] > max_length) ++s.over_max_length;
  }
  s.total_tokens = dataset.num_tokens();
  s.trainable_share = static_cast<double>(s.target_tokens) / static_cast<double>(s.total_tokens);
  std::sort(lengths.begin(), lengths.end());
  s.min = lengths.front();
  s.max = lengths.back();
  s.mean = static_cast<double>(s.total_tokens) / static_cast<double>(s.num_examples);
  s.p50 = percentile(lengths, 50);
  s.p90 = percentile(lengths, 90);
  s.p95 = percentile(lengths, 95);
  s.p99 = percentile(lengths, 99);
  s.suggested_max_length = (s.p99 + kSuggestedMultiple - 1) / kSuggestedMultiple * kSuggestedMultiple;

  const int64_t width = (s.max - s.min + bins) / bins;  // ceil((max - min + 1) / bins)
  // Only as many bins as it takes to reach max (narrow ranges need fewer than `bins`).
  const int64_t used = (s.max - s.min) / width + 1;
  for (int64_t b = 0; b < used; ++b) s.histogram.push_back({s.min + b * width, s.min + (b + 1) * width, 0});
  for (int64_t length : lengths) ++s.histogram[static_cast<size_t>((length - s.min) / width)].count;
  return s;
}

nlohmann::json length_stats_to_json(const LengthStats& s) {
  nlohmann::json histogram = nlohmann::json::array();
  for (const auto& bin : s.histogram) histogram.push_back({{"lo", bin.lo}, {"hi", bin.hi}, {"count", bin.count}});
  return {
      {"examples", s.num_examples},
      {"total_tokens", s.total_tokens},
      {"target_tokens", s.target_tokens},
      {"trainable_share", s.trainable_share},
      {"length",
       {{"min", s.min},
        {"mean", s.mean},
        {"p50", s.p50},
        {"p90", s.p90},
        {"p95", s.p95},
        {"p99", s.p99},
        {"max", s.max}}},
      {"histogram", histogram},
      {"max_length", s.max_length > 0 ? nlohmann::json(s.max_length) : nlohmann::json(nullptr)},
      {"over_max_length", s.over_max_length},
      {"suggested_max_length", s.suggested_max_length},
  };
}

LabelCounts count_labels(const std::string& path) {
  JsonlReader reader(path, BadLines::Skip);
  LabelCounts out;
  int64_t total = 0;
  for (nlohmann::json record; reader.next(record);) {
    // A line without a usable label is a bad line of the dataset, counted and reported there.
    if (!record.is_object() || !record.contains("label")) continue;
    const nlohmann::json& label = record["label"];
    if (!label.is_string() && !label.is_number() && !label.is_boolean()) continue;
    ++out.counts[label_text(label)];
    ++total;
  }
  for (const auto& [label, n] : out.counts)
    if (out.majority.empty() || n > out.counts[out.majority]) out.majority = label;
  if (total > 0) out.majority_share = static_cast<double>(out.counts[out.majority]) / static_cast<double>(total);
  return out;
}

}  // namespace memtune
