#include "train/metrics.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "core/error.h"

namespace memtune {

void TopKAccuracy::observe(const cpu::LogitsChunk& c) {
  int64_t hits = 0;
#pragma omp parallel for schedule(static) reduction(+ : hits)
  for (int64_t r = 0; r < c.rows; ++r) {
    const float* z = c.logits + r * c.V;
    const int32_t t = c.targets[r];
    const float zt = z[t];
    // Rank of the target: tokens scoring higher, plus equal ones with a lower id.
    int64_t above = 0;
#pragma omp simd reduction(+ : above)
    for (int64_t v = 0; v < c.V; ++v) above += (z[v] > zt) | ((z[v] == zt) & (v < t));
    hits += above < k_;
  }
  hits_ += hits;
  count_ += c.rows;
}

void TopKAccuracy::merge(const Metric& other) {
  const auto& o = dynamic_cast<const TopKAccuracy&>(other);
  MT_ASSERT(o.k_ == k_);
  hits_ += o.hits_;
  count_ += o.count_;
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

namespace {
// Hands each chunk to every selected metric.
class FanOut final : public cpu::ChunkObserver {
 public:
  explicit FanOut(MetricSelection& s) : s_(s) {}
  void observe(const cpu::LogitsChunk& chunk) override {
    for (auto& m : s_.metrics) m->observe(chunk);
  }

 private:
  MetricSelection& s_;
};
}  // namespace

EvalResult evaluate(Qwen2Model& model, Batcher& batcher, MetricSelection& selection) {
  for (auto& m : selection.metrics) m->reset();
  FanOut fan_out(selection);
  model.set_observer(&fan_out);
  EvalResult r;
  MicroBatch mb;
  try {
    while (batcher.next(mb)) {
      if (mb.input_ids.empty()) continue;
      const cpu::LossSum part = model.forward_loss({mb.input_ids, mb.labels, mb.cu_seqlens});
      r.loss_sum += part.sum;
      r.num_tokens += part.count;
      r.num_sequences += mb.num_sequences();
    }
  } catch (...) {
    model.set_observer(nullptr);
    throw;
  }
  model.set_observer(nullptr);
  const double mean =
      r.num_tokens ? r.loss_sum / static_cast<double>(r.num_tokens) : std::numeric_limits<double>::quiet_NaN();
  if (selection.eval_loss) r.values.emplace_back("eval_loss", mean);
  if (selection.perplexity) r.values.emplace_back("perplexity", std::exp(mean));
  for (const auto& m : selection.metrics)
    for (auto& v : m->compute()) r.values.push_back(std::move(v));
  return r;
}

}  // namespace memtune
