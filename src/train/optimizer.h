// AdamW's configuration (backend/backend.h: AdamWConfig, the update itself is a backend op) and
// Hugging Face's rule for which parameters take weight decay.
#pragma once

#include <string_view>

#include "backend/backend.h"

namespace memtune {

// Hugging Face's rule: no weight decay for biases and normalization weights.
bool takes_weight_decay(std::string_view parameter_name);

}  // namespace memtune
