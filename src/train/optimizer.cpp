#include "train/optimizer.h"

#include <cmath>

#include "core/error.h"

namespace memtune {

void adamw_update(std::span<float> param, std::span<const float> grad, std::span<float> m, std::span<float> v,
                  int64_t t, double lr, const AdamWConfig& c, bool decay, float grad_scale) {
  MT_ASSERT(param.size() == grad.size() && m.size() == param.size() && v.size() == param.size() && t >= 1);
  const float b1 = static_cast<float>(c.beta1), b2 = static_cast<float>(c.beta2);
  const double bias1 = 1.0 - std::pow(c.beta1, static_cast<double>(t));
  const double bias2 = 1.0 - std::pow(c.beta2, static_cast<double>(t));
  const float step_size = static_cast<float>(lr / bias1);
  const float inv_sqrt_bias2 = static_cast<float>(1.0 / std::sqrt(bias2));
  const float eps = static_cast<float>(c.eps);
  const float keep = decay ? static_cast<float>(1.0 - lr * c.weight_decay) : 1.0f;
  const int64_t n = static_cast<int64_t>(param.size());
#pragma omp parallel for simd schedule(static) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * grad_scale;
    m[i] = b1 * m[i] + (1.0f - b1) * g;
    v[i] = b2 * v[i] + (1.0f - b2) * g * g;
    const float denom = std::sqrt(v[i]) * inv_sqrt_bias2 + eps;
    param[i] = param[i] * keep - step_size * m[i] / denom;
  }
}

bool takes_weight_decay(std::string_view name) {
  return !(name.ends_with(".bias") || name.find("norm") != std::string_view::npos);
}

}  // namespace memtune
