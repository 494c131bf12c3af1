// The sampler: reproducible per seed and request, the filters' distributions checked by
// chi-square on a small vocabulary, the penalties against a hand-computed example.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "generate/sampling.h"
#include "support/test_util.h"

namespace memtune {
namespace {

const std::vector<float> kLogits = {1.0f, 2.5f, 0.3f, 2.0f, -1.0f, 1.7f, 0.0f, 2.2f};

std::vector<int32_t> draws(const SamplingParams& p, uint64_t stream, int n) {
  SamplerScratch scratch(static_cast<int64_t>(kLogits.size()));
  SamplingParams with_stream = p;
  with_stream.stream = stream;
  TokenSampler s(with_stream, {});
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(s.sample(kLogits.data(), 1, scratch));
  return out;
}

TEST(Sampling, ReproducibleForASeedAndIndependentAcrossRequests) {
  SamplingParams p;
  p.seed = 42;
  EXPECT_EQ(draws(p, 0, 50), draws(p, 0, 50));
  EXPECT_NE(draws(p, 0, 50), draws(p, 1, 50));
  SamplingParams other = p;
  other.seed = 43;
  EXPECT_NE(draws(p, 0, 50), draws(other, 0, 50));
}

// The expected distribution, written from the definitions: softmax(logits / T), then keep the
// top k, then the smallest prefix (by probability) whose renormalized mass reaches top_p, then
// the tokens at least min_p times the most likely one.
std::vector<double> expected_distribution(const SamplingParams& p) {
  const size_t V = kLogits.size();
  std::vector<double> probs(V);
  double sum = 0;
  for (size_t v = 0; v < V; ++v) sum += probs[v] = std::exp(kLogits[v] / p.temperature);
  for (double& x : probs) x /= sum;
  std::vector<size_t> order(V);
  for (size_t v = 0; v < V; ++v) order[v] = v;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return probs[a] > probs[b]; });
  size_t keep = p.top_k > 0 ? static_cast<size_t>(p.top_k) : V;
  double mass = 0, cumulative = 0;
  for (size_t i = 0; i < keep; ++i) mass += probs[order[i]];
  for (size_t i = 0; i < keep; ++i)
    if ((cumulative += probs[order[i]] / mass) >= p.top_p) {
      keep = i + 1;
      break;
    }
  size_t min_keep = 1;
  while (min_keep < keep && probs[order[min_keep]] >= p.min_p * probs[order[0]]) ++min_keep;
  keep = min_keep;
  std::vector<double> out(V, 0.0);
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += probs[order[i]];
  for (size_t i = 0; i < keep; ++i) out[order[i]] = probs[order[i]] / kept;
  return out;
}

void check_distribution(const SamplingParams& p, size_t expected_support) {
  const int n = 40000;
  const std::vector<double> expected = expected_distribution(p);
  size_t support = 0;
  for (double x : expected) support += x > 0;
  ASSERT_EQ(support, expected_support) << "the example does not exercise the filter";
  std::vector<int> counts(kLogits.size(), 0);
  for (int32_t t : draws(p, 0, n)) ++counts[static_cast<size_t>(t)];
  double chi2 = 0;
  for (size_t v = 0; v < kLogits.size(); ++v) {
    if (expected[v] == 0) {
      EXPECT_EQ(counts[v], 0) << "token " << v << " was filtered out";
      continue;
    }
    const double e = expected[v] * n;
    chi2 += (counts[v] - e) * (counts[v] - e) / e;
  }
  // Chi-square critical values at p = 0.001 for support - 1 degrees of freedom.
  const std::map<size_t, double> critical = {{2, 10.83}, {3, 13.82}, {4, 16.27}, {5, 18.47}, {8, 24.32}};
  EXPECT_LT(chi2, critical.at(support)) << "draws do not follow the filtered distribution";
}

TEST(Sampling, FiltersDrawFromTheFilteredDistribution) {
  struct Case {
    const char* name;
    double temperature = 1.0, top_p = 1.0, min_p = 0.0;
    int64_t top_k = 0;
    size_t support;  // tokens the filters keep in this example
  };
  const Case cases[] = {{.name = "temperature 0.7", .temperature = 0.7, .support = 8},
                        {.name = "top_k 3", .top_k = 3, .support = 3},
                        {.name = "top_p 0.6", .top_p = 0.6, .support = 3},
                        {.name = "min_p 0.4", .min_p = 0.4, .support = 4},
                        {.name = "top_k 4, top_p 0.5, temperature 1.3", .temperature = 1.3, .top_p = 0.5, .top_k = 4,
                         .support = 2}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    SamplingParams p;
    p.temperature = c.temperature;
    p.top_p = c.top_p;
    p.min_p = c.min_p;
    p.top_k = c.top_k;
    check_distribution(p, c.support);
  }
}

TEST(Sampling, PenaltiesAsComputedByHand) {
  // logits [2, -1, 0.5, 3]; token 1 is in the prompt; repetition 2, presence 0.5, frequency 0.25.
  const std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f};
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 2.0;
  p.presence_penalty = 0.5;
  p.frequency_penalty = 0.25;
  SamplerScratch scratch(4);
  TokenSampler s(p, std::vector<int32_t>{1});
  // 1: [2, -2, 0.5, 3] -> 3.  2: token 3 seen once: 3/2 - 0.75 = 0.75 -> [2, -2, 0.5, 0.75] -> 0.
  // 3: token 0: 2/2 - 0.75 = 0.25 -> [0.25, -2, 0.5, 0.75] -> 3.
  // 4: token 3 twice: 1.5 - 1.0 = 0.5 -> [0.25, -2, 0.5, 0.5] -> 2 (the lower id of a tie).
  std::vector<int32_t> got;
  for (int i = 0; i < 4; ++i) got.push_back(s.sample(logits.data(), 1, scratch));
  EXPECT_EQ(got, (std::vector<int32_t>{3, 0, 3, 2}));
  EXPECT_EQ(scratch.logits, (std::vector<float>{0.25f, -2.0f, 0.5f, 0.5f}));
}

TEST(Sampling, StridedLogitsAreReadByColumn) {
  // Column 1 of a [V=3, R=2] matrix.
  const std::vector<float> logits = {9.0f, 0.0f, 0.0f, 5.0f, 9.0f, 1.0f};
  SamplingParams p;
  p.temperature = 0;
  SamplerScratch scratch(3);
  TokenSampler s(p, {});
  EXPECT_EQ(s.sample(logits.data() + 1, 2, scratch), 1);
}

TEST(Sampling, OutOfRangeValuesNameTheFlag) {
  SamplingParams p;
  p.top_p = 0;
  EXPECT_EQ(testing_support::error_of([&] { validate_sampling(p); }), "--top_p must be in (0, 1], got 0");
  p = {};
  p.temperature = -1;
  EXPECT_EQ(testing_support::error_of([&] { validate_sampling(p); }), "--temperature must be >= 0, got -1");
}

}  // namespace
}  // namespace memtune
