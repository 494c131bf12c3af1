#include "eval/metrics.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <typeinfo>

#include "core/error.h"
#include "distributed/communicator.h"

namespace memtune {

void TopKAccuracy::observe_rows(const RowStatsChunk& c) {
  for (int64_t r = 0; r < c.rows; ++r) hits_ += c.stats[r].target_rank < k_;
  count_ += c.rows;
}

void Metric::merge(const Metric& other) {
  MT_ASSERT(typeid(*this) == typeid(other), "merging metrics of different kinds");
  std::vector<double> mine = state();
  const std::vector<double> theirs = other.state();
  MT_ASSERT(mine.size() == theirs.size());
  for (size_t i = 0; i < mine.size(); ++i) mine[i] += theirs[i];
  set_state(mine);
}

void TopKAccuracy::set_state(std::span<const double> s) {
  MT_ASSERT(s.size() == 2);
  hits_ = static_cast<int64_t>(s[0]);
  count_ = static_cast<int64_t>(s[1]);
}

MetricValues TopKAccuracy::compute() const {
  const std::string name = k_ == 1 ? "token_accuracy" : fmt::format("top{}_accuracy", k_);
  return {{name, count_ ? static_cast<double>(hits_) / static_cast<double>(count_)
                        : std::numeric_limits<double>::quiet_NaN()}};
}

MetricSelection parse_metrics(const std::string& list) {
  MetricSelection s;
  std::stringstream in(list);
  for (std::string name; std::getline(in, name, ',');) {
    if (name.empty()) continue;
    if (name == "eval_loss" || name == "loss") {
      s.eval_loss = true;
    } else if (name == "perplexity") {
      s.perplexity = true;
    } else if (name == "token_accuracy" || name == "accuracy") {
      s.metrics.push_back(std::make_unique<TopKAccuracy>(1));
    } else if (name.starts_with("top") && name.ends_with("_accuracy")) {
      int64_t k = 0;
      try {
        k = std::stoll(name.substr(3, name.size() - 3 - 9));
      } catch (const std::exception&) {
      }
      if (k <= 0) throw Error(fmt::format("--metrics: \"{}\" needs a positive k, e.g. top5_accuracy", name));
      s.metrics.push_back(std::make_unique<TopKAccuracy>(k));
    } else {
      throw Error(fmt::format(
          "--metrics: unknown metric \"{}\" (expected eval_loss, perplexity, token_accuracy, top{{k}}_accuracy)",
          name));
    }
  }
  return s;
}

void PredictionWriter::start_batch(const MicroBatch& batch) {
  cu_.assign(batch.cu_seqlens.begin(), batch.cu_seqlens.end());
  argmax_.assign(cu_.size() - 1, {});
  loss_.assign(cu_.size() - 1, 0.0);
}

void PredictionWriter::observe_rows(const RowStatsChunk& c) {
  for (int64_t r = 0; r < c.rows; ++r) {
    const size_t seq = static_cast<size_t>(std::upper_bound(cu_.begin(), cu_.end(), c.positions[r]) - cu_.begin() - 1);
    argmax_[seq].push_back(c.stats[r].argmax);
    loss_[seq] += static_cast<double>(c.stats[r].logsumexp) - c.stats[r].target_logit;
  }
}

void PredictionWriter::finish_batch() {
  for (size_t s = 0; s < argmax_.size(); ++s) {
    const size_t n = argmax_[s].size();
    const nlohmann::json line = {{"index", next_index_++},
                                 {"loss", n ? loss_[s] / static_cast<double>(n) : 0.0},
                                 {"num_targets", n},
                                 {"argmax", argmax_[s]}};
    out_ << line.dump() << "\n";
  }
  out_.flush();
}

namespace {
// Hands each chunk to every selected metric and to the prediction writer.
class FanOut final : public ChunkObserver {
 public:
  FanOut(MetricSelection& s, BatchObserver* batches) : s_(s), predictions_(batches) {}
  bool needs_logits() const override {
    return std::any_of(s_.metrics.begin(), s_.metrics.end(), [](const auto& m) { return m->needs_logits(); }) ||
           (predictions_ && predictions_->needs_logits());
  }
  void observe_rows(const RowStatsChunk& rows) override {
    for (auto& m : s_.metrics) m->observe_rows(rows);
    if (predictions_) predictions_->observe_rows(rows);
  }
  void observe(const LogitsChunk& chunk) override {
    for (auto& m : s_.metrics)
      if (m->needs_logits()) m->observe(chunk);
    if (predictions_ && predictions_->needs_logits()) predictions_->observe(chunk);
  }

 private:
  MetricSelection& s_;
  BatchObserver* predictions_;
};
}  // namespace

EvalResult evaluate(Decoder& model, Batcher& batcher, MetricSelection& selection, const EvalHooks& hooks,
                    Communicator* comm) {
  BatchObserver* const predictions = hooks.observer;
  for (auto& m : selection.metrics) m->reset();
  FanOut fan_out(selection, predictions);
  model.set_observer(&fan_out);
  EvalResult r;
  MicroBatch mb;
  StepAllocations heap;
  try {
    while (batcher.next(mb)) {
      if (mb.input_ids.empty()) continue;
      if (predictions) predictions->start_batch(mb);
      heap.begin();
      const LossSum part = model.forward_loss({mb.input_ids, mb.labels, mb.cu_seqlens});
      heap.end();
      if (predictions) predictions->finish_batch();
      r.loss_sum += part.sum;
      r.num_tokens += part.count;
      r.num_sequences += mb.num_sequences();
    }
  } catch (...) {
    model.set_observer(nullptr);
    throw;
  }
  model.set_observer(nullptr);
  r.heap_during_batches = heap.total();
  if (comm && comm->world_size() > 1) {
    std::vector<double> totals = {r.loss_sum, static_cast<double>(r.num_tokens), static_cast<double>(r.num_sequences)};
    for (const auto& m : selection.metrics) {
      const std::vector<double> s = m->state();
      totals.insert(totals.end(), s.begin(), s.end());
    }
    comm->allreduce_sum(totals);
    r.loss_sum = totals[0];
    r.num_tokens = static_cast<int64_t>(totals[1]);
    r.num_sequences = static_cast<int64_t>(totals[2]);
    size_t at = 3;
    for (const auto& m : selection.metrics) {
      const size_t n = m->state().size();
      m->set_state(std::span<const double>(totals).subspan(at, n));
      at += n;
    }
  }
  const double mean =
      r.num_tokens ? r.loss_sum / static_cast<double>(r.num_tokens) : std::numeric_limits<double>::quiet_NaN();
  if (selection.eval_loss) r.values.emplace_back("eval_loss", mean);
  if (selection.perplexity) r.values.emplace_back("perplexity", std::exp(mean));
  for (const auto& m : selection.metrics)
    for (auto& v : m->compute()) r.values.push_back(std::move(v));
  if (hooks.metrics)
    for (auto& v : hooks.metrics()) r.values.push_back(std::move(v));
  return r;
}

}  // namespace memtune
