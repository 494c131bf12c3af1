#include "train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include <fmt/format.h>

#include "core/error.h"

namespace memtune {

LrScheduleType parse_lr_schedule(const std::string& name) {
  if (name == "linear") return LrScheduleType::Linear;
  if (name == "cosine") return LrScheduleType::Cosine;
  if (name == "cosine_with_min_lr") return LrScheduleType::CosineWithMinLr;
  if (name == "constant") return LrScheduleType::Constant;
  if (name == "constant_with_warmup") return LrScheduleType::ConstantWithWarmup;
  throw Error(
      fmt::format("lr_scheduler_type: unknown schedule \"{}\" (expected linear, cosine, cosine_with_min_lr, constant, "
                  "constant_with_warmup)",
                  name));
}

double LrSchedule::multiplier(int64_t step) const {
  const double s = static_cast<double>(step), w = static_cast<double>(warmup_steps);
  if (type == LrScheduleType::Constant) return 1.0;
  if (step < warmup_steps) return s / std::max(1.0, w);
  if (type == LrScheduleType::ConstantWithWarmup) return 1.0;
  const double span = std::max(1.0, static_cast<double>(total_steps - warmup_steps));
  const double progress = (s - w) / span;
  if (type == LrScheduleType::Linear) return std::max(0.0, (static_cast<double>(total_steps) - s) / span);
  // Half a cosine period over the decay (num_cycles = 0.5).
  const double cosine = std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
  if (type == LrScheduleType::Cosine) return cosine;
  return cosine * (1.0 - min_lr_rate) + min_lr_rate;
}

int64_t warmup_steps_for(int64_t warmup_steps, double warmup_ratio, int64_t total_steps) {
  if (warmup_steps > 0) return warmup_steps;
  return static_cast<int64_t>(std::ceil(warmup_ratio * static_cast<double>(total_steps)));
}

}  // namespace memtune
