// Learning-rate schedules with Hugging Face's exact formulas (transformers' get_scheduler):
// the multiplier for optimizer step `step` (0-based, the value the lambda sees before
// scheduler.step()), so the first step of a warmup trains with learning rate 0 exactly as HF does.
#pragma once

#include <cstdint>
#include <string>

namespace memtune {

enum class LrScheduleType { Linear, Cosine, CosineWithMinLr, Constant, ConstantWithWarmup };

LrScheduleType parse_lr_schedule(const std::string& name);

struct LrSchedule {
  LrScheduleType type = LrScheduleType::Linear;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_lr_rate = 0.0;  // cosine_with_min_lr: floor as a fraction of the peak
  double multiplier(int64_t step) const;
};

// warmup_steps wins when positive; otherwise ceil(warmup_ratio * total_steps), as in HF.
int64_t warmup_steps_for(int64_t warmup_steps, double warmup_ratio, int64_t total_steps);

}  // namespace memtune
