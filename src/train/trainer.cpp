#include "train/trainer.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "core/error.h"
#include "dist/communicator.h"

namespace memtune {

Trainer::Trainer(Qwen2Model& model, const TrainerConfig& config, Communicator* comm)
    : model_(model),
      config_(config),
      own_comm_(comm ? nullptr : make_single_process_communicator()),
      comm_(comm ? comm : own_comm_.get()),
      scale_(config.loss_scaling.enabled ? config.loss_scaling.init_scale : 1.0) {
  MT_ASSERT(model.options().with_optimizer, "the trainer needs a model planned with optimizer state");
  model_.arena().enter_phase(Phase::Optimizer);
  for (size_t i = 0; i < model_.num_trainable(); ++i) {
    const size_t n = model_.optimizer_shard(i).size();
    std::fill_n(model_.adam_m(i), n, 0.0f);
    std::fill_n(model_.adam_v(i), n, 0.0f);
  }
  model_.load_masters();
  model_.arena().enter_phase(Phase::Forward);
}

Trainer::~Trainer() = default;

StepResult Trainer::step(std::span<const TokenBatch> micro_batches) {
  StepResult r;
  r.loss_scale = scale_;
  model_.set_grad_scale(static_cast<float>(scale_));
  model_.zero_grads();
  for (const TokenBatch& mb : micro_batches) {
    const cpu::LossSum part = model_.forward_backward(mb);
    r.loss_sum += part.sum;
    r.num_items += part.count;
  }
  r.learning_rate = config_.learning_rate * config_.schedule.multiplier(step_);
  const size_t P = model_.num_trainable();
  Arena& arena = model_.arena();
  const bool sharded = model_.options().shards_optimizer();
  if (comm_->world_size() > 1) {
    // num_items_in_batch and the logged loss are global: summed over ranks before the division.
    std::array<double, 2> totals{r.loss_sum, static_cast<double>(r.num_items)};
    comm_->allreduce_sum(totals);
    r.loss_sum = totals[0];
    r.num_items = static_cast<int64_t>(totals[1]);
    if (r.num_items == 0) return r;
    // Gradient SUMS over ranks, each tensor in place, last layers first (the order backward
    // finished them in). ZeRO-1 needs only this rank's block of each: a reduce-scatter.
    arena.enter_phase(Phase::Optimizer);
    for (size_t i = P; i-- > 0;) {
      const std::span<float> g{model_.trainable_grad(i), static_cast<size_t>(model_.trainable_spec(i).numel())};
      if (sharded) {
        comm_->reduce_scatter_sum(g);
      } else {
        comm_->allreduce_sum(g);
      }
    }
  }
  if (r.num_items == 0) return r;  // nothing to learn from: no update, the step is not counted

  arena.enter_phase(Phase::Optimizer);
  // The one division by num_items_in_batch (and by the loss scale), and the global norm. Each
  // rank normalizes the elements it updates (all, or its ZeRO-1 shard); with shards the squared
  // norm is summed over ranks.
  const float inv_items = static_cast<float>(1.0 / (static_cast<double>(r.num_items) * scale_));
  double sumsq = 0.0;
  for (size_t i = 0; i < P; ++i) {
    const Shard shard = model_.optimizer_shard(i);
    float* g = model_.trainable_grad(i) + shard.begin;
    const int64_t n = static_cast<int64_t>(shard.size());
    double local = 0.0;
#pragma omp parallel for simd reduction(+ : local) schedule(static) if (n > 32768)
    for (int64_t j = 0; j < n; ++j) {
      g[j] *= inv_items;
      local += static_cast<double>(g[j]) * g[j];
    }
    sumsq += local;
  }
  if (sharded) {
    std::array<double, 1> total{sumsq};
    comm_->allreduce_sum(total);
    sumsq = total[0];
  }
  r.grad_norm = std::sqrt(sumsq);
  if (!std::isfinite(r.grad_norm)) {
    r.skipped_nonfinite = true;
    if (config_.loss_scaling.enabled) scale_ *= config_.loss_scaling.backoff_factor;
    good_steps_ = 0;
    arena.enter_phase(Phase::Forward);
    return r;
  }
  if (config_.loss_scaling.enabled && ++good_steps_ == config_.loss_scaling.growth_interval) {
    scale_ *= config_.loss_scaling.growth_factor;
    good_steps_ = 0;
  }
  // torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1
  // (applied inside the update, the same float product as clipping the gradient first).
  const double clip = config_.max_grad_norm > 0 ? std::min(1.0, config_.max_grad_norm / (r.grad_norm + 1e-6)) : 1.0;

  ++step_;
  for (size_t i = 0; i < P; ++i) {
    const auto& spec = model_.trainable_spec(i);
    const Shard shard = model_.optimizer_shard(i);
    const size_t n = shard.size();
    adamw_update({model_.shard_value(i), n}, {model_.trainable_grad(i) + shard.begin, n}, {model_.adam_m(i), n},
                 {model_.adam_v(i), n}, step_, r.learning_rate, config_.adam, takes_weight_decay(spec.name),
                 static_cast<float>(clip));
    model_.store_trainable(i);
    // ZeRO-1: every rank updated its block; all of them get the whole tensor back.
    if (sharded) {
      const std::span<std::byte> storage = model_.trainable_storage(i);
      comm_->allgather(storage, storage.size() / static_cast<size_t>(spec.numel()));
    }
  }
  arena.enter_phase(Phase::Forward);
  r.updated = true;
  return r;
}

}  // namespace memtune
