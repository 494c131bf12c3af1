// Model weights at a scale where a small error in any product shows in the logits, the loss and
// every gradient: matrices and biases of N(0, 0.1), norm weights 1 + N(0, 0.1). (The
// initializer's std 0.02 with zero biases gives logits so small and attention so uniform that a
// 1% error in a product, or a missing rounding point, hides below any sensible tolerance.)
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "core/rng.h"
#include "model/decoder.h"

namespace memtune::testing_support {

inline void init_visible_weights(Decoder& m, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = 0; i < m.parameters().specs().size(); ++i) {
    const ParamSpec& spec = m.parameters().specs()[i];
    std::vector<float> values(static_cast<size_t>(spec.numel()));
    const float center = spec.name.ends_with("norm.weight") ? 1.0f : 0.0f;
    for (float& v : values) v = center + 0.1f * static_cast<float>(rng.normal());
    upload_f32(m.backend(), m.parameters().param(i), values);
  }
}

}  // namespace memtune::testing_support
