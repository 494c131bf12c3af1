// The sampler (see sampling.h).
#include "generate/sampling.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace memtune {

void validate_sampling(const SamplingParams& p) {
  auto refuse = [](const char* name, double value, const char* expected) {
    throw Error(fmt::format("--{} must be {}, got {}", name, expected, value));
  };
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature)) refuse("temperature", p.temperature, ">= 0");
  if (!(p.top_p > 0 && p.top_p <= 1)) refuse("top_p", p.top_p, "in (0, 1]");
  if (!(p.min_p >= 0 && p.min_p <= 1)) refuse("min_p", p.min_p, "in [0, 1]");
  if (!(p.repetition_penalty > 0) || !std::isfinite(p.repetition_penalty))
    refuse("repetition_penalty", p.repetition_penalty, "> 0");
  if (!std::isfinite(p.presence_penalty)) refuse("presence_penalty", p.presence_penalty, "finite");
  if (!std::isfinite(p.frequency_penalty)) refuse("frequency_penalty", p.frequency_penalty, "finite");
  if (p.top_k < -1) refuse("top_k", static_cast<double>(p.top_k), "-1, 0 (all) or a positive count");
}

TokenSampler::TokenSampler(const SamplingParams& params, std::span<const int32_t> prompt)
    : params_(params), rng_(params.seed ^ ((params.stream + 1) * 0x9e3779b97f4a7c15ull)) {
  validate_sampling(params);
  for (const int32_t id : prompt)
    if (in_prompt_.insert(id).second) seen_.push_back(id);
}

int32_t TokenSampler::sample(const float* logits, int64_t stride, SamplerScratch& scratch) {
  std::vector<float>& logits_ = scratch.logits;
  std::vector<double>& probs_ = scratch.probs;
  std::vector<int32_t>& order_ = scratch.order;
  const size_t V = logits_.size();
  for (size_t v = 0; v < V; ++v) logits_[v] = logits[v * static_cast<size_t>(stride)];
  const SamplingParams& p = params_;
  for (const int32_t id : seen_) {
    float& x = logits_[static_cast<size_t>(id)];
    if (p.repetition_penalty != 1.0) x = x > 0 ? x / float(p.repetition_penalty) : x * float(p.repetition_penalty);
    if (const auto it = output_counts_.find(id); it != output_counts_.end())
      x -= static_cast<float>(p.presence_penalty + p.frequency_penalty * it->second);
  }
  int32_t chosen = 0;
  if (p.temperature == 0) {
    chosen = static_cast<int32_t>(std::max_element(logits_.begin(), logits_.end()) - logits_.begin());
    std::fill(probs_.begin(), probs_.end(), 0.0);
    probs_[static_cast<size_t>(chosen)] = 1.0;
  } else {
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
        std::partial_sort(order_.begin(), order_.begin() + static_cast<std::ptrdiff_t>(keep), order_.end(),
                          more_likely);
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
    const double u = rng_.uniform();
    double cumulative = 0.0;
    chosen = -1;
    for (size_t v = 0; v < V; ++v) {
      if (probs_[v] == 0.0) continue;
      chosen = static_cast<int32_t>(v);
      cumulative += probs_[v];
      if (u < cumulative) break;
    }
    MT_ASSERT(chosen >= 0, "the sampling distribution is empty");
  }
  if (++output_counts_[chosen] == 1 && !in_prompt_.contains(chosen)) seen_.push_back(chosen);
  return chosen;
}

}  // namespace memtune
