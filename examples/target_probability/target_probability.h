// Example of a user-written streaming metric: the mean probability the model gives the target
// token (a calibration-flavoured companion to accuracy). Copy this file, change observe() and
// compute(), and add an instance to MetricSelection::metrics before calling evaluate(). The
// contract (src/train/metrics.h): observe() sees each logits chunk once and keeps only a small
// state, exposed as additive numbers by state()/set_state() so ranks can sum it; compute() returns named values. Its
// test against a direct computation on materialized logits is tests/examples/target_probability_test.cpp.
#pragma once

#include <cmath>
#include <limits>

#include "backend/chunk_loss.h"
#include "eval/metrics.h"

namespace memtune::examples {

class TargetProbability final : public Metric {
 public:
  void observe(const LogitsChunk& c) override {
    double sum = 0;
#pragma omp parallel for schedule(static) reduction(+ : sum)
    for (int64_t r = 0; r < c.rows; ++r) {
      const float* z = c.logits + r * c.V;
      sum += std::exp(static_cast<double>(z[c.targets[r]] - row_logsumexp(z, c.V)));
    }
    sum_ += sum;
    count_ += c.rows;
  }
  void reset() override {
    sum_ = 0, count_ = 0;
  }
  std::vector<double> state() const override {
    return {sum_, static_cast<double>(count_)};
  }
  void set_state(std::span<const double> s) override {
    sum_ = s[0];
    count_ = static_cast<int64_t>(s[1]);
  }
  MetricValues compute() const override {
    return {
        {"target_probability", count_ ? sum_ / static_cast<double>(count_) : std::numeric_limits<double>::quiet_NaN()}};
  }

 private:
  double sum_ = 0;
  int64_t count_ = 0;
};

}  // namespace memtune::examples
