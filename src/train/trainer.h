// The training step. Loss functions return SUMS over their items (target tokens); the trainer
// accumulates the gradients of those sums over every micro-batch of a step, then divides once by
// num_items_in_batch, the number of items over all micro-batches (and, with data parallelism,
// all ranks). A per-micro-batch mean ("mean of means") can therefore never happen. Then the
// global gradient norm is taken (logged before clipping, as Hugging Face does), gradients are
// clipped, and AdamW updates the float32 masters; 16-bit weights are rounded from their masters.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/error.h"

#include "model/decoder.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace memtune {

class Communicator;

// Dynamic loss scaling as torch.cuda.amp.GradScaler does it: gradients are computed scaled by
// `scale`; a step whose gradients are not finite is skipped and the scale backs off; after
// growth_interval good steps in a row it grows.
struct LossScaling {
  bool enabled = false;
  double init_scale = 65536.0, growth_factor = 2.0, backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

struct TrainerConfig {
  double learning_rate = 5e-5;
  LossScaling loss_scaling;
  AdamWConfig adam;
  double max_grad_norm = 1.0;  // <= 0 disables clipping
  LrSchedule schedule;
  // Where the backend decides steps on its device (Backend::decides_steps), one process and no
  // loss scaling: step() records a step and returns before its gradient norm is known; finish()
  // reads it later (the host records the next step meanwhile). The same updates either way.
  bool decide_on_device = true;
};

struct StepResult {
  double loss_sum = 0;             // sum of per-token losses over the step
  int64_t num_items = 0;           // num_items_in_batch: target tokens over all micro-batches
  int64_t num_tokens = 0;          // input tokens over all micro-batches (and ranks)
  double grad_norm = 0;            // global norm of the normalized gradient, before clipping
  double learning_rate = 0;        // the rate this step used
  bool updated = false;            // false when the step had no target token or was skipped
  bool skipped_nonfinite = false;  // gradients were inf/nan: no update (the loss scale backed off)
  double loss_scale = 1.0;         // the scale this step's gradients were computed with
  bool pending = false;            // recorded on the device, not read yet: Trainer::finish() completes it
  double loss() const { return num_items ? loss_sum / static_cast<double>(num_items) : 0.0; }
};

class Trainer {
 public:
  // The model must be built with_optimizer. Masters are initialized from the weights and the
  // moments zeroed.
  // With a communicator of N ranks each rank passes its own micro-batches; gradients and item
  // counts are summed over ranks before the one division, so every rank makes the same update.
  Trainer(Decoder& model, const TrainerConfig& config, Communicator* comm = nullptr);
  ~Trainer();

  // One optimizer step over the micro-batches of a gradient-accumulation cycle. A step with
  // target tokens may come back `pending` (decides_on_device()): its loss, gradient norm,
  // learning rate and whether it counted are known once finish() has read it.
  StepResult step(std::span<const TokenBatch> micro_batches);
  // The oldest pending step, completed (it waits for the device only if that step is still
  // running there). At most one step may be pending when step() is called: record step N + 1,
  // then finish step N.
  StepResult finish();
  bool has_pending() const { return !pending_.empty(); }
  bool decides_on_device() const { return on_device_; }
  int64_t global_step() const { return step_; }
  // Resuming: the step count the schedule and AdamW's bias correction continue from (the
  // moments and values are restored into the model's buffers by the caller).
  void restore_global_step(int64_t step) {
    MT_ASSERT(pending_.empty(), "restoring a trainer with a step pending");
    step_ = step;
  }
  double loss_scale() const { return scale_; }
  int64_t good_steps() const { return good_steps_; }
  void restore_loss_scale(double scale, int64_t good_steps) {
    scale_ = scale;
    good_steps_ = good_steps;
  }

 private:
  Decoder& model_;
  ModelParameters& params_;
  Backend& backend_;
  TrainerConfig config_;
  std::unique_ptr<Communicator> own_comm_;  // a single process when none is given
  Communicator* comm_;
  // Gradient reduction buckets: the trainables of each decoder layer, then the rest (embedding,
  // final norm, untied head), in the order backward completes them.
  std::vector<std::vector<size_t>> layer_buckets_;
  std::vector<size_t> rest_bucket_;
  void start_bucket(const std::vector<size_t>& bucket);
  // A blocking collective on one tensor's bytes: in place inside Backend::collective, or, on a
  // backend whose memory the host cannot address, on its host copy in the parameters' collective
  // staging (download, op, upload).
  void on_tensor(const Tensor& t, const std::function<void(std::span<std::byte>)>& op);
  static std::span<float> floats(std::span<std::byte> bytes);
  std::vector<Tensor> shard_grads_;  // what each rank normalizes and takes the norm of, in order
  std::vector<Backend::AdamWTensor> adam_tensors_;  // a step's update of every trainable (reserved)
  int64_t step_ = 0;  // optimizer updates made (AdamW's t, the schedule's step), of finished steps
  bool on_device_ = false;
  std::vector<StepResult> pending_;  // recorded, not yet finished, oldest first
  // The schedule's rate, and AdamW's step, after `updates_before` updates.
  double learning_rate(int64_t updates_before) const;
  AdamWStep adam_step(int64_t updates_before, float clip) const;
  double scale_ = 1.0;
  int64_t good_steps_ = 0;
};

}  // namespace memtune
