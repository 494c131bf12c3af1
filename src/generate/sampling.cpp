// The sampler (see sampling.h).
#include "generate/sampling.h"

#include <fmt/format.h>

#include <cmath>

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

SampleRow TokenSampler::next_row(std::vector<PenaltyToken>& penalties) {
  const SamplingParams& p = params_;
  SampleRow row{.temperature = p.temperature,
                .top_k = p.top_k,
                .top_p = p.top_p,
                .min_p = p.min_p,
                .repetition_penalty = p.repetition_penalty,
                .presence_penalty = p.presence_penalty,
                .frequency_penalty = p.frequency_penalty,
                .penalty_begin = static_cast<uint32_t>(penalties.size())};
  if (p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0)
    for (const int32_t id : seen_) {
      const auto it = output_counts_.find(id);
      penalties.push_back({id, it == output_counts_.end() ? 0 : it->second});
    }
  row.penalty_count = static_cast<uint32_t>(penalties.size() - row.penalty_begin);
  if (p.temperature != 0) row.uniform = rng_.uniform();
  return row;
}

void TokenSampler::accept(int32_t token) {
  if (++output_counts_[token] == 1 && !in_prompt_.contains(token)) seen_.push_back(token);
}

int32_t TokenSampler::sample(const float* logits, int64_t stride, SamplerScratch& scratch) {
  own_penalties_.clear();
  const SampleRow row = next_row(own_penalties_);
  const int32_t token = sample_row(logits, stride, row, own_penalties_, scratch);
  accept(token);
  return token;
}

}  // namespace memtune
