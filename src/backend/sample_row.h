// Choosing one token from one row of logits: the arithmetic every backend implements, the way
// vLLM's sampler does it (penalties on the raw logits, then temperature, then the top-k / top-p /
// min-p filters, then one draw). What a request keeps between its tokens (its random stream, the
// tokens it has seen) is generate/sampling.h's; it hands each row over as a SampleRow.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/tensor.h"

namespace memtune {

// One row to sample. temperature 0 is greedy: the argmax of the penalized logits (the lowest id
// on ties); otherwise the row's distribution softmax(z / temperature) is cut by top-k, then
// top-p on what top-k kept (renormalized), then min-p relative to the most likely token, and
// `uniform` picks the token walking the kept distribution in id order.
struct SampleRow {
  double temperature = 1.0;
  int64_t top_k = 0;  // <= 0 or >= V: all
  double top_p = 1.0, min_p = 0.0;
  // repetition_penalty p divides a positive logit of a listed token by p and multiplies a
  // negative one; presence + frequency * count is subtracted for a token the output holds.
  double repetition_penalty = 1.0, presence_penalty = 0.0, frequency_penalty = 0.0;
  uint32_t penalty_begin = 0, penalty_count = 0;  // this row's entries of the penalty list
  double uniform = 0.0;                           // the row's draw, in [0, 1)
};
// A token of the prompt or the output of a row's request: output_count times in the output.
struct PenaltyToken {
  int32_t id = 0;
  int32_t output_count = 0;
};

// Vocabulary-sized host memory of the host sampler (one row at a time): the penalized logits,
// the probabilities, the candidate order.
struct SamplerScratch {
  std::vector<float> logits;
  std::vector<double> probs;  // after sample_row(): the distribution the draw used, for tests
  std::vector<int32_t> order;
  explicit SamplerScratch(int64_t vocab)
      : logits(static_cast<size_t>(vocab)), probs(static_cast<size_t>(vocab)), order(static_cast<size_t>(vocab)) {}
};

// The host sampler: the token for logits[v * stride] = logit(v), v < scratch's vocabulary, in
// float64 with exact sorting (ties: lower id first).
int32_t sample_row(const float* logits, int64_t stride, const SampleRow& row, std::span<const PenaltyToken> penalties,
                   SamplerScratch& scratch);

struct SampleArgs;
// The host sampler over every row of args.logits, which the host must be able to read.
void sample_rows_on_host(const SampleArgs& args);

// Backend::sample_tokens: rows R of logits [R, V] float32 in device memory (the backend may
// overwrite them); tokens[r] receives row r's token. The device_* views are planned device
// memory a backend that samples on the device uploads the rows and penalties into and writes
// the tokens to; host_scratch serves a backend that samples on the host.
struct SampleArgs {
  Tensor logits;
  std::span<const SampleRow> rows;
  std::span<const PenaltyToken> penalties;
  std::span<int32_t> tokens;
  SamplerScratch* host_scratch = nullptr;
  Tensor device_rows;       // i32, at least R * kSampleRowWords
  Tensor device_penalties;  // i32, at least 3 * penalties.size()
  Tensor device_tokens;     // i32 [R]
};
inline constexpr int64_t kSampleRowWords = 10;

}  // namespace memtune
