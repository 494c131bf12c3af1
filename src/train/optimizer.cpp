#include "train/optimizer.h"

namespace memtune {

bool takes_weight_decay(std::string_view name) {
  return !(name.ends_with(".bias") || name.find("norm") != std::string_view::npos);
}

}  // namespace memtune
