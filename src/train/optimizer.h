// AdamW exactly as PyTorch's torch.optim.AdamW (which Hugging Face Trainer uses): decoupled
// weight decay applied to the parameter before the moment update, bias-corrected moments,
// eps added to the bias-corrected square root. Parameters are float32 masters.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

namespace memtune {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

// One update of `param` with `grad` (already normalized) times grad_scale (gradient clipping),
// moments m and v, at 1-based step t.
void adamw_update(std::span<float> param, std::span<const float> grad, std::span<float> m, std::span<float> v,
                  int64_t t, double lr, const AdamWConfig& config, bool decay, float grad_scale = 1.0f);

// Hugging Face's rule: no weight decay for biases and normalization weights.
bool takes_weight_decay(std::string_view parameter_name);

}  // namespace memtune
