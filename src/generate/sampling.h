// A request's sampling settings and state. The arithmetic of choosing a token from a row of
// logits is backend/sample_row.h's (every backend runs it where the logits are); what stays here
// is the request's side, the way vLLM's sampler keeps it: one draw per token from the
// request's own random stream (so a request's tokens depend on its seed only, never on
// which requests shared its batch). temperature 0 is greedy: the argmax of the penalized logits
// (the lowest id on ties).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "backend/sample_row.h"
#include "core/rng.h"

namespace memtune {

struct SamplingParams {
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // keep the k most likely tokens; 0 or -1: all
  double top_p = 1.0;        // keep the smallest set whose probability reaches top_p
  double min_p = 0.0;        // keep tokens at least min_p times as likely as the most likely one
  // repetition_penalty p > 1 makes every token already in the prompt or the output less likely
  // (a positive logit is divided by p, a negative one multiplied); presence and frequency
  // penalties subtract presence + frequency * count for each token the output already holds.
  double repetition_penalty = 1.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  uint64_t seed = 0;
  // Separates the random streams of requests that share a seed (memtune generate: the input
  // line); a request's tokens depend on (seed, stream) only, not on what shares its batch.
  uint64_t stream = 0;
};

// An Error naming the field unless every value is in its range (temperature >= 0, top_p in
// (0, 1], min_p in [0, 1], repetition_penalty > 0, top_k >= -1).
void validate_sampling(const SamplingParams& params);

// What a request's sampler remembers between its tokens: its random stream and the tokens seen
// (kept sparse: a running request costs its distinct tokens, not the vocabulary). Each token is
// chosen by the backend (Backend::sample_tokens) from the row this hands it.
class TokenSampler {
 public:
  TokenSampler(const SamplingParams& params, std::span<const int32_t> prompt);
  // The row for the next token (drawing from the request's stream when it samples), its
  // penalty tokens appended to `penalties`.
  SampleRow next_row(std::vector<PenaltyToken>& penalties);
  // Records the chosen token as part of the output.
  void accept(int32_t token);
  // next_row, the host sampler, accept: the next token from logits[v * stride] = logit(v).
  int32_t sample(const float* logits, int64_t stride, SamplerScratch& scratch);

 private:
  SamplingParams params_;
  Rng rng_;
  std::unordered_set<int32_t> in_prompt_;
  std::unordered_map<int32_t, int32_t> output_counts_;
  std::vector<int32_t> seen_;  // distinct ids of the prompt and the output, for the penalties
  std::vector<PenaltyToken> own_penalties_;  // sample()'s penalty list
};

}  // namespace memtune
