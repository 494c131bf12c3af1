// The training step. Loss functions return SUMS over their items (target tokens); the trainer
// accumulates the gradients of those sums over every micro-batch of a step, then divides once by
// num_items_in_batch, the number of items over all micro-batches (and, with data parallelism,
// all ranks). A per-micro-batch mean ("mean of means") can therefore never happen. Then the
// global gradient norm is taken (logged before clipping, as Hugging Face does), gradients are
// clipped, and AdamW updates the float32 masters; 16-bit weights are rounded from their masters.
#pragma once

#include <cstdint>
#include <span>

#include "model/qwen2.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace memtune {

struct TrainerConfig {
  double learning_rate = 5e-5;
  AdamWConfig adam;
  double max_grad_norm = 1.0;  // <= 0 disables clipping
  LrSchedule schedule;
};

struct StepResult {
  double loss_sum = 0;       // sum of per-token losses over the step
  int64_t num_items = 0;     // num_items_in_batch: target tokens over all micro-batches
  double grad_norm = 0;      // global norm of the normalized gradient, before clipping
  double learning_rate = 0;  // the rate this step used
  bool updated = false;      // false when the step had no target token at all
  double loss() const { return num_items ? loss_sum / static_cast<double>(num_items) : 0.0; }
};

class Trainer {
 public:
  // The model must be built with_optimizer. Masters are initialized from the weights and the
  // moments zeroed.
  Trainer(Qwen2Model& model, const TrainerConfig& config);

  // One optimizer step over the micro-batches of a gradient-accumulation cycle.
  StepResult step(std::span<const TokenBatch> micro_batches);
  int64_t global_step() const { return step_; }
  // Resuming: the step count the schedule and AdamW's bias correction continue from (the
  // moments and values are restored into the model's buffers by the caller).
  void restore_global_step(int64_t step) { step_ = step; }

 private:
  Qwen2Model& model_;
  TrainerConfig config_;
  int64_t step_ = 0;
};

}  // namespace memtune
