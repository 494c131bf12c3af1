// Example of a user-written token-level loss: focal loss (Lin et al., 2017) for language
// modelling, FL = -(1 - p_t)^gamma * log p_t, which down-weights tokens the model already
// predicts well. Copy this file, change chunk(), and hand an instance to the model with
// Qwen2Model::set_loss. The contract (see src/backend/chunk_loss.h): return the SUM over the
// chunk's rows and, when asked, overwrite the logits with d(sum)/d(logits). Never divide by a
// count: the trainer normalizes once by num_items_in_batch. Its gradient is checked against
// finite differences in tests/examples/focal_loss_test.cpp.
#pragma once

#include <cmath>

#include "backend/chunk_loss.h"

namespace memtune::examples {

class FocalLoss final : public ChunkLoss {
 public:
  explicit FocalLoss(float gamma) : gamma_(gamma) {}

  double chunk(float* logits, const int32_t* targets, int64_t rows, int64_t V, bool gradient) const override {
    double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t r = 0; r < rows; ++r) {
      float* z = logits + r * V;
      const int32_t t = targets[r];
      const float lse = row_logsumexp(z, V);
      const float log_pt = z[t] - lse;
      const float pt = std::exp(log_pt);
      const float one_minus = 1.0f - pt;
      total += -std::pow(one_minus, gamma_) * log_pt;
      if (gradient) {
        // dFL/dz_v = g * ([v == t] - p_v) with g = gamma p_t (1-p_t)^(gamma-1) log p_t - (1-p_t)^gamma
        const float g = gamma_ * pt * std::pow(one_minus, gamma_ - 1.0f) * log_pt - std::pow(one_minus, gamma_);
        for (int64_t v = 0; v < V; ++v) z[v] = -g * fast_exp(z[v] - lse);
        z[t] += g;
      }
    }
    return total;
  }

 private:
  float gamma_;
};

}  // namespace memtune::examples
