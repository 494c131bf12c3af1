// Micro-batches from a Dataset as flat token streams without padding: input_ids and labels of
// several sequences back to back, with cu_seqlens marking where each sequence starts, exactly
// the form of the model's TokenBatch. The order is a deterministic function of (seed, epoch).
//
// How batches are assembled (data-parallel training relies on this):
//  1. Units. Without packing a unit is one example. With packing, the epoch's examples (in
//     shuffled order) are packed first-fit into rows of at most max_length tokens, keeping up
//     to kOpenRows rows open; a unit is one row. No example is ever split, and each example
//     stays its own sequence in cu_seqlens (attention never crosses examples).
//  2. The epoch's units are taken in order, world_size * per_device_batch_size at a time: that
//     is global micro-batch k. Its n units are split into contiguous shares, rank r taking units
//     [n*r/world_size, n*(r+1)/world_size) of it. So the shares are disjoint, their union is the
//     global micro-batch, and it is the same units a single process with per_device_batch_size
//     = world_size * per_device_batch_size gets as its micro-batch k.
//  3. The last global micro-batch of an epoch may be short; it is split the same way (a rank
//     may get no unit: an empty micro-batch, zero sequences), or dropped with drop_last.
// Gradient accumulation groups consecutive global micro-batches; that is the trainer's business.
#pragma once

#include <cstdint>
#include <vector>

#include "data/dataset.h"

namespace memtune {

struct BatchOptions {
  int64_t per_device_batch_size = 1;  // units (examples, or packed rows) per micro-batch per rank
  bool packing = false;
  int64_t max_length = 0;  // with packing: the row length in tokens (required)
  bool shuffle = true;
  uint64_t seed = 42;
  bool drop_last = false;  // drop the epoch's last global micro-batch when it is short
  int rank = 0;
  int world_size = 1;
};

// One rank's micro-batch; the caller keeps it and next() refills it, reusing the capacity.
// TokenBatch{input_ids, labels, cu_seqlens} views it.
struct MicroBatch {
  std::vector<int32_t> input_ids, labels;
  std::vector<int32_t> cu_seqlens;  // num_sequences + 1 offsets: 0, ..., input_ids.size()
  int64_t num_targets = 0;          // labels that are loss targets (see Dataset::num_targets)
  // Position of its first sequence in the epoch's order (all ranks' shares together); without
  // shuffle or packing, the dataset index of that example.
  int64_t first_sequence = 0;
  int64_t num_sequences() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
};

class Batcher {
 public:
  // Keeps a reference to the dataset. Errors: an empty dataset, bad sizes or rank, packing
  // without max_length or with an example longer than it.
  Batcher(const Dataset& dataset, const BatchOptions& options);

  // Lays out epoch `epoch` (0-based): the shuffle is seeded by (seed, epoch), then packing.
  // next() starts from the epoch's first global micro-batch.
  void start_epoch(int64_t epoch);
  // Units and global micro-batches of the current epoch.
  int64_t num_units() const { return static_cast<int64_t>(unit_offsets_.size()) - 1; }
  int64_t num_batches() const;
  // Fills `out` with this rank's share of the next global micro-batch; false after the last.
  bool next(MicroBatch& out);
  // The most tokens a micro-batch of this rank can hold in any epoch (for memory planning).
  int64_t max_micro_batch_tokens() const;
  // The most loss targets a micro-batch of this rank can hold in any epoch (sizes the logits chunk).
  int64_t max_micro_batch_targets() const;

  static constexpr size_t kOpenRows = 64;

 private:
  void pack();

  const Dataset& dataset_;
  BatchOptions options_;
  std::vector<uint32_t> order_;        // example indices of the epoch, unit after unit
  std::vector<int64_t> unit_offsets_;  // unit u is order_[unit_offsets_[u], unit_offsets_[u+1])
  int64_t next_batch_ = 0;
};

}  // namespace memtune
