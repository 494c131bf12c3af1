// Batcher (see batcher.h): per-epoch seeded shuffle, first-fit packing into rows, and the split
// of every global micro-batch into contiguous per-rank shares.
#include "data/batcher.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"

namespace memtune {

Batcher::Batcher(const Dataset& dataset, const BatchOptions& options) : dataset_(dataset), options_(options) {
  if (dataset.empty()) throw Error("the dataset has no examples to train on");
  if (options.per_device_batch_size < 1)
    throw Error(fmt::format("per_device_batch_size must be >= 1, got {}", options.per_device_batch_size));
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size)
    throw Error(
        fmt::format("rank {} of world_size {}: expected 0 <= rank < world_size", options.rank, options.world_size));
  if (options.packing) {
    if (options.max_length < 1) throw Error("packing needs max_length (the length of a packed row)");
    for (size_t i = 0; i < dataset.size(); ++i)
      if (static_cast<int64_t>(dataset.length(i)) > options.max_length)
        throw Error(
            fmt::format("example {} has {} tokens, more than the packing max_length {}: load the data with "
                        "the same max_length",
                        i, dataset.length(i), options.max_length));
  }
  start_epoch(0);
}

void Batcher::start_epoch(int64_t epoch) {
  order_.resize(dataset_.size());
  std::iota(order_.begin(), order_.end(), 0u);
  if (options_.shuffle) {
    // Fisher-Yates from a stream keyed by the epoch: the same (seed, epoch) gives the same order
    // on every rank and every run.
    Rng rng(options_.seed, fmt::format("data.shuffle.epoch.{}", epoch));
    for (size_t i = order_.size() - 1; i > 0; --i) {
      const auto j = static_cast<size_t>((static_cast<unsigned __int128>(rng.next_u64()) * (i + 1)) >> 64);
      std::swap(order_[i], order_[j]);
    }
  }
  if (options_.packing) {
    pack();
  } else {
    unit_offsets_.resize(order_.size() + 1);
    std::iota(unit_offsets_.begin(), unit_offsets_.end(), int64_t{0});
  }
  next_batch_ = 0;
}

// First-fit over the open rows, in the epoch's order: an example goes into the oldest open row
// with room, else opens a new row. A row is closed when full or when more than kOpenRows are
// open (the oldest goes), so rows come out in a deterministic order close to the shuffled one.
void Batcher::pack() {
  struct Row {
    int64_t free;
    std::vector<uint32_t> examples;
  };
  std::vector<uint32_t> packed;
  packed.reserve(order_.size());
  unit_offsets_.assign(1, 0);
  auto close = [&](Row& row) {
    packed.insert(packed.end(), row.examples.begin(), row.examples.end());
    unit_offsets_.push_back(static_cast<int64_t>(packed.size()));
  };
  std::vector<Row> open;
  for (uint32_t example : order_) {
    const auto length = static_cast<int64_t>(dataset_.length(example));
    auto row = std::find_if(open.begin(), open.end(), [&](const Row& r) { return r.free >= length; });
    if (row == open.end()) {
      open.push_back({options_.max_length, {}});
      row = open.end() - 1;
    }
    row->free -= length;
    row->examples.push_back(example);
    if (row->free == 0) {
      close(*row);
      open.erase(row);
    } else if (open.size() > kOpenRows) {
      close(open.front());
      open.erase(open.begin());
    }
  }
  for (Row& row : open) close(row);
  order_ = std::move(packed);
}

int64_t Batcher::num_batches() const {
  const int64_t global = options_.per_device_batch_size * options_.world_size;
  return options_.drop_last ? num_units() / global : (num_units() + global - 1) / global;
}

bool Batcher::next(MicroBatch& out) {
  if (next_batch_ >= num_batches()) return false;
  const int64_t global = options_.per_device_batch_size * options_.world_size;
  const int64_t first = next_batch_ * global;
  const int64_t n = std::min(global, num_units() - first);
  const int64_t begin = first + n * options_.rank / options_.world_size;
  const int64_t end = first + n * (options_.rank + 1) / options_.world_size;
  ++next_batch_;

  out.input_ids.clear();
  out.labels.clear();
  out.cu_seqlens.assign(1, 0);
  out.num_targets = 0;
  out.first_sequence = unit_offsets_[begin];
  for (int64_t i = unit_offsets_[begin]; i < unit_offsets_[end]; ++i) {
    const uint32_t example = order_[i];
    const auto ids = dataset_.input_ids(example);
    const auto labels = dataset_.labels(example);
    out.input_ids.insert(out.input_ids.end(), ids.begin(), ids.end());
    out.labels.insert(out.labels.end(), labels.begin(), labels.end());
    out.cu_seqlens.push_back(static_cast<int32_t>(out.input_ids.size()));
    out.num_targets += dataset_.num_targets(example);
  }
  return true;
}

namespace {

// The sum of the k largest values: the most a micro-batch of k examples can hold, whatever the order.
int64_t sum_of_largest(std::vector<int64_t> values, int64_t k) {
  const auto n = static_cast<std::ptrdiff_t>(std::min<size_t>(static_cast<size_t>(k), values.size()));
  std::partial_sort(values.begin(), values.begin() + n, values.end(), std::greater<>());
  return std::accumulate(values.begin(), values.begin() + n, int64_t{0});
}

}  // namespace

int64_t Batcher::max_micro_batch_tokens() const {
  // A rank's share of a global micro-batch is at most ceil(global / world_size) = per_device units.
  if (options_.packing) return options_.per_device_batch_size * options_.max_length;
  std::vector<int64_t> lengths(dataset_.size());
  for (size_t i = 0; i < dataset_.size(); ++i) lengths[i] = static_cast<int64_t>(dataset_.length(i));
  return sum_of_largest(std::move(lengths), options_.per_device_batch_size);
}

int64_t Batcher::max_micro_batch_targets() const {
  if (options_.packing) return std::min(max_micro_batch_tokens(), dataset_.num_targets());
  std::vector<int64_t> targets(dataset_.size());
  for (size_t i = 0; i < dataset_.size(); ++i) targets[i] = dataset_.num_targets(i);
  return sum_of_largest(std::move(targets), options_.per_device_batch_size);
}

}  // namespace memtune
