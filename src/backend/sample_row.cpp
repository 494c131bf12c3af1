// The host sampler (see sample_row.h).
#include "backend/sample_row.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace memtune {

int32_t sample_row(const float* logits, int64_t stride, const SampleRow& p, std::span<const PenaltyToken> penalties,
                   SamplerScratch& scratch) {
  std::vector<float>& logits_ = scratch.logits;
  std::vector<double>& probs_ = scratch.probs;
  std::vector<int32_t>& order_ = scratch.order;
  const size_t V = logits_.size();
  for (size_t v = 0; v < V; ++v) logits_[v] = logits[v * static_cast<size_t>(stride)];
  for (const PenaltyToken& t : penalties.subspan(p.penalty_begin, p.penalty_count)) {
    float& x = logits_[static_cast<size_t>(t.id)];
    if (p.repetition_penalty != 1.0) x = x > 0 ? x / float(p.repetition_penalty) : x * float(p.repetition_penalty);
    if (t.output_count > 0) x -= static_cast<float>(p.presence_penalty + p.frequency_penalty * t.output_count);
  }
  if (p.temperature == 0) {
    const auto chosen = static_cast<int32_t>(std::max_element(logits_.begin(), logits_.end()) - logits_.begin());
    std::fill(probs_.begin(), probs_.end(), 0.0);
    probs_[static_cast<size_t>(chosen)] = 1.0;
    return chosen;
  }
  // Softmax of logits / temperature in double.
  const double inv_t = 1.0 / p.temperature;
  const float top = *std::max_element(logits_.begin(), logits_.end());
  double sum = 0.0;
  for (size_t v = 0; v < V; ++v) sum += (probs_[v] = std::exp((double(logits_[v]) - top) * inv_t));
  for (double& x : probs_) x /= sum;
  // Candidates by decreasing probability (ties: lower id first), cut by top-k, then top-p on
  // what top-k kept (renormalized), then min-p relative to the most likely token.
  size_t keep = V;
  const bool filters = (p.top_k > 0 && static_cast<size_t>(p.top_k) < V) || p.top_p < 1.0 || p.min_p > 0.0;
  if (filters) {
    std::iota(order_.begin(), order_.end(), 0);
    auto more_likely = [&](int32_t a, int32_t b) {
      return probs_[static_cast<size_t>(a)] > probs_[static_cast<size_t>(b)] ||
             (probs_[static_cast<size_t>(a)] == probs_[static_cast<size_t>(b)] && a < b);
    };
    if (p.top_k > 0 && static_cast<size_t>(p.top_k) < V) {
      keep = static_cast<size_t>(p.top_k);
      std::partial_sort(order_.begin(), order_.begin() + static_cast<std::ptrdiff_t>(keep), order_.end(), more_likely);
    } else {
      std::sort(order_.begin(), order_.end(), more_likely);
    }
    if (p.top_p < 1.0) {
      double kept_mass = 0.0;
      for (size_t i = 0; i < keep; ++i) kept_mass += probs_[static_cast<size_t>(order_[i])];
      double cumulative = 0.0;
      size_t n = 0;
      while (n < keep) {
        cumulative += probs_[static_cast<size_t>(order_[n++])] / kept_mass;
        if (cumulative >= p.top_p) break;
      }
      keep = n;
    }
    if (p.min_p > 0.0) {
      const double threshold = p.min_p * probs_[static_cast<size_t>(order_[0])];
      size_t n = 1;
      while (n < keep && probs_[static_cast<size_t>(order_[n])] >= threshold) ++n;
      keep = n;
    }
    std::vector<double>& kept = probs_;
    double mass = 0.0;
    for (size_t i = 0; i < keep; ++i) mass += kept[static_cast<size_t>(order_[i])];
    for (size_t i = keep; i < V; ++i) kept[static_cast<size_t>(order_[i])] = 0.0;
    for (size_t i = 0; i < keep; ++i) kept[static_cast<size_t>(order_[i])] /= mass;
  }
  // One uniform draw over the kept distribution, walked in id order.
  double cumulative = 0.0;
  int32_t chosen = -1;
  for (size_t v = 0; v < V; ++v) {
    if (probs_[v] == 0.0) continue;
    chosen = static_cast<int32_t>(v);
    cumulative += probs_[v];
    if (p.uniform < cumulative) break;
  }
  MT_ASSERT(chosen >= 0, "the sampling distribution is empty");
  return chosen;
}

void sample_rows_on_host(const SampleArgs& a) {
  MT_ASSERT(a.host_scratch, "the host sampler needs its vocabulary-sized scratch");
  const int64_t V = a.logits.cols();
  for (size_t r = 0; r < a.rows.size(); ++r)
    a.tokens[r] = sample_row(a.logits.f32() + static_cast<int64_t>(r) * V, 1, a.rows[r], a.penalties, *a.host_scratch);
}

}  // namespace memtune
