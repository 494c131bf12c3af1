// Streaming evaluation. A metric sees each row of the fused LM head's logits once (only
// positions that have a target): the built-in ones through the row's RowStats (computed where the
// logits are), a custom one through the logits chunk itself. It reduces them to a small state
// (counts), and never keeps the chunk, so evaluation memory is the model's forward plan and nothing grows with the eval set.
// States merge (for data-parallel ranks). eval_loss is the global token mean: the sum of every
// target token's loss over the whole eval set divided by their count (Hugging Face Trainer's
// eval_loss is instead a mean of per-batch means, which weighs short batches more).
#pragma once

#include <functional>
#include <memory>
#include <ostream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "backend/chunk_loss.h"
#include "data/batcher.h"
#include "memory/process_memory.h"
#include "model/decoder.h"

namespace memtune {

class Communicator;

using MetricValues = std::vector<std::pair<std::string, double>>;

class Metric : public ChunkObserver {
 public:
  virtual void reset() = 0;
  // The state as numbers that add up across ranks (counts, sums); set_state() replaces it.
  // Data-parallel evaluation sums the states of all ranks, then compute() runs on the total.
  virtual std::vector<double> state() const = 0;
  virtual void set_state(std::span<const double> state) = 0;
  // Adds the state of another metric of the same kind.
  void merge(const Metric& other);
  virtual MetricValues compute() const = 0;
};

// Share of target tokens whose rank among the logits is below k; k = 1 is argmax accuracy
// (ties go to the lower token id, as torch.argmax does). Named token_accuracy or top{k}_accuracy.
class TopKAccuracy final : public Metric {
 public:
  explicit TopKAccuracy(int64_t k) : k_(k) {}
  bool needs_logits() const override { return false; }
  void observe_rows(const RowStatsChunk& rows) override;
  void reset() override { hits_ = count_ = 0; }
  std::vector<double> state() const override { return {static_cast<double>(hits_), static_cast<double>(count_)}; }
  void set_state(std::span<const double> s) override;
  MetricValues compute() const override;

 private:
  int64_t k_;
  int64_t hits_ = 0, count_ = 0;
};

// Parses --metrics (comma-separated): eval_loss, perplexity, token_accuracy, top{k}_accuracy.
// eval_loss and perplexity come from the loss itself; the others become Metric objects.
struct MetricSelection {
  bool eval_loss = false, perplexity = false;
  std::vector<std::unique_ptr<Metric>> metrics;
};
MetricSelection parse_metrics(const std::string& list);

// An observer that also sees the micro-batches whose rows it observes: start_batch before the
// batch's chunks (its sequences' bounds, input ids and unshifted labels), finish_batch after them.
// Predictions per sequence are built on it (--save_predictions, the Python package's
// EvalPrediction).
class BatchObserver : public ChunkObserver {
 public:
  virtual void start_batch(const MicroBatch& batch) = 0;
  virtual void finish_batch() {}
};

// What a caller in the same process (the Python package) adds to an evaluation: an observer of
// its batches, values computed once the eval set is done (a user's compute_metrics, named as it
// names them), and for `memtune eval` the results handed over instead of printed.
struct EvalHooks {
  BatchObserver* observer = nullptr;
  std::function<MetricValues()> metrics;
  std::function<void(const nlohmann::json& results)> on_result;
};

// --save_predictions: one JSON line per evaluated sequence, written as each micro-batch finishes
// ({"index", "loss" (mean over its targets), "num_targets", "argmax" (predicted ids at its target
// positions)}), so host memory is one micro-batch's worth.
class PredictionWriter final : public BatchObserver {
 public:
  explicit PredictionWriter(std::ostream& out) : out_(out) {}
  void start_batch(const MicroBatch& batch) override;
  bool needs_logits() const override { return false; }
  void observe_rows(const RowStatsChunk& rows) override;
  void finish_batch() override;

 private:
  std::ostream& out_;
  std::vector<int32_t> cu_;
  std::vector<std::vector<int32_t>> argmax_;  // per sequence of the batch
  std::vector<double> loss_;
  int64_t next_index_ = 0;
};

struct EvalResult {
  double loss_sum = 0;
  int64_t num_tokens = 0;  // target tokens
  int64_t num_sequences = 0;
  MetricValues values;  // in the order requested
  HeapAllocations heap_during_batches;  // measured, batches after the first: should be none
};

// Runs every micro-batch of the batcher's current epoch through the model, forward and loss
// only (a training model's gradients are not touched), with the metrics (and hooks.observer,
// when given) observing the chunks; hooks.metrics' values follow the selection's in the result.
// With a communicator each rank evaluates its share and the loss sums, counts and metric states
// are summed over ranks before the values are computed: every rank returns the global result.
EvalResult evaluate(Decoder& model, Batcher& batcher, MetricSelection& selection, const EvalHooks& hooks = {},
                    Communicator* comm = nullptr);

}  // namespace memtune
