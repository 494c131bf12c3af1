// The one ignore label of the whole code base: a label (or target) equal to kIgnoreIndex takes
// no loss, as in PyTorch's cross_entropy(ignore_index=-100) and Hugging Face's data collators.
#pragma once

#include <cstdint>

namespace memtune {

inline constexpr int32_t kIgnoreIndex = -100;

}  // namespace memtune
