#include "train/trainer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <string>

#include "core/error.h"
#include "distributed/communicator.h"

namespace memtune {

Trainer::Trainer(Decoder& model, const TrainerConfig& config, Communicator* comm)
    : model_(model),
      params_(model.parameters()),
      backend_(model.backend()),
      config_(config),
      own_comm_(comm ? nullptr : make_single_process_communicator()),
      comm_(comm ? comm : own_comm_.get()),
      scale_(config.loss_scaling.enabled ? config.loss_scaling.init_scale : 1.0) {
  MT_ASSERT(model.options().with_optimizer, "the trainer needs a model planned with optimizer state");
  model_.arena().enter_phase(Phase::Optimizer);
  for (size_t i = 0; i < params_.num_trainable(); ++i) {
    backend_.fill(params_.adam_m(i), 0.0f);
    backend_.fill(params_.adam_v(i), 0.0f);
  }
  params_.load_masters();
  model_.arena().enter_phase(Phase::Forward);
  for (size_t i = 0; i < params_.num_trainable(); ++i) shard_grads_.push_back(params_.shard_grad(i));
  adam_tensors_.reserve(params_.num_trainable());
  pending_.reserve(2);  // no allocation during steps
  // One process: the loss sums may stay on the device and come back with the gradient norm
  // (with several, they are summed over ranks before it).
  model_.set_defer_loss_sum(comm_->world_size() == 1);
  on_device_ = config.decide_on_device && backend_.decides_steps() && comm_->world_size() == 1 &&
               !config.loss_scaling.enabled;
  // Buckets by name: "...layers.{l}." belongs to layer l (base weights and LoRA adapters alike).
  layer_buckets_.resize(static_cast<size_t>(model_.config().num_hidden_layers));
  for (size_t i = 0; i < params_.num_trainable(); ++i) {
    const std::string& name = params_.trainable_spec(i).name;
    const size_t at = name.find(".layers.");
    if (at == std::string::npos) {
      rest_bucket_.push_back(i);
      continue;
    }
    layer_buckets_.at(std::stoul(name.substr(at + 8))).push_back(i);
  }
}

void Trainer::on_tensor(const Tensor& t, const std::function<void(std::span<std::byte>)>& op) {
  if (std::byte* host = params_.collective_staging()) {
    backend_.copy_to_host(host, t);
    op({host, t.bytes()});
    backend_.copy_to_device(t, host);
    return;
  }
  backend_.collective([&] { op({t.as<std::byte>(), t.bytes()}); });
}

std::span<float> Trainer::floats(std::span<std::byte> bytes) {
  return {reinterpret_cast<float*>(bytes.data()), bytes.size() / sizeof(float)};
}

void Trainer::start_bucket(const std::vector<size_t>& bucket) {
  if (params_.collective_staging()) {  // blocking, one tensor at a time through the host copy
    for (size_t i : bucket)
      on_tensor(params_.trainable_grad(i), [&](std::span<std::byte> g) {
        comm_->start_allreduce_sum(floats(g));
        comm_->wait_all();
      });
    return;
  }
  backend_.collective([&] {
    for (size_t i : bucket) {
      const Tensor g = params_.trainable_grad(i);
      comm_->start_allreduce_sum({g.as<float>(), static_cast<size_t>(g.numel())});
    }
  });
}

Trainer::~Trainer() {
  try {
    while (!pending_.empty()) finish();  // the backend keeps no read of this trainer's
  } catch (...) {
  }
}

double Trainer::learning_rate(int64_t updates_before) const {
  return config_.learning_rate * config_.schedule.multiplier(updates_before);
}

AdamWStep Trainer::adam_step(int64_t updates_before, float clip) const {
  return {.t = updates_before + 1,
          .learning_rate = learning_rate(updates_before),
          .config = config_.adam,
          .decay = true,
          .grad_scale = clip};
}

StepResult Trainer::finish() {
  MT_ASSERT(!pending_.empty(), "Trainer::finish without a pending step");
  StepResult r = pending_.front();
  pending_.erase(pending_.begin());
  const Backend::StepReadback b = backend_.take_step();
  r.pending = false;
  r.loss_sum += b.loss_sum;
  r.grad_norm = std::sqrt(b.sum_squares);
  r.learning_rate = learning_rate(step_);  // every earlier step is finished
  if (!b.counted) {
    r.skipped_nonfinite = true;
    good_steps_ = 0;
    return r;
  }
  ++step_;
  r.updated = true;
  return r;
}

StepResult Trainer::step(std::span<const TokenBatch> micro_batches) {
  StepResult r;
  r.loss_scale = scale_;
  model_.set_grad_scale(static_cast<float>(scale_));
  params_.zero_grads();
  const bool sharded = model_.options().shards_optimizer();
  // Data parallel without sharding: each layer's gradients are summed over ranks as soon as the
  // rank's last backward has finished them, while backward continues with the layers below.
  // Every rank starts the same reductions in the same order; a rank without data this step
  // starts them all at once (its gradients are zero).
  const bool overlap = comm_->world_size() > 1 && !sharded;
  bool deferred = false;
  // Backends that cannot leave a collective in flight while they compute reduce after backward.
  const bool during_backward = overlap && backend_.overlaps_collectives();
  for (size_t k = 0; k < micro_batches.size(); ++k) {
    if (during_backward && k + 1 == micro_batches.size())
      model_.set_layer_grads_ready([this](int64_t l) {
        start_bucket(layer_buckets_[static_cast<size_t>(l)]);
        backend_.collective([&] { comm_->progress(); });
      });
    LossSum part;
    try {
      part = model_.forward_backward(micro_batches[k]);
    } catch (...) {
      model_.set_layer_grads_ready(nullptr);
      throw;
    }
    model_.set_layer_grads_ready(nullptr);
    r.loss_sum += part.sum;
    deferred |= part.deferred;
    r.num_items += part.count;
    r.num_tokens += static_cast<int64_t>(micro_batches[k].input_ids.size());
  }
  if (overlap)
    backend_.collective([&] {
      if (micro_batches.empty() || !during_backward)
        for (size_t l = layer_buckets_.size(); l-- > 0;) start_bucket(layer_buckets_[l]);
      start_bucket(rest_bucket_);
      if (!during_backward) comm_->wait_all();  // nothing stays in flight outside collective()
    });
  r.learning_rate = learning_rate(step_);  // a pending step's is known once the one before it is
  const size_t P = params_.num_trainable();
  Arena& arena = model_.arena();
  if (comm_->world_size() > 1) {
    // num_items_in_batch, the logged loss and the token count are global: summed over ranks
    // before the division.
    std::array<double, 3> totals{r.loss_sum, static_cast<double>(r.num_items), static_cast<double>(r.num_tokens)};
    comm_->allreduce_sum(totals);
    r.loss_sum = totals[0];
    r.num_items = static_cast<int64_t>(totals[1]);
    r.num_tokens = static_cast<int64_t>(totals[2]);
    backend_.collective([&] { comm_->wait_all(); });  // the gradient sums started during backward
  }
  if (r.num_items == 0) return r;  // nothing to learn from: no update, the step is not counted

  arena.enter_phase(Phase::Optimizer);
  // ZeRO-1 needs only this rank's block of each gradient: a reduce-scatter per tensor.
  if (sharded)
    for (size_t i = P; i-- > 0;)
      on_tensor(params_.trainable_grad(i), [&](std::span<std::byte> g) { comm_->reduce_scatter_sum(floats(g)); });
  // The one division by num_items_in_batch (and by the loss scale), and the global norm. Each
  // rank normalizes the elements it updates (all, or its ZeRO-1 shard); with shards the squared
  // norm is summed over ranks.
  const float inv_items = static_cast<float>(1.0 / (static_cast<double>(r.num_items) * scale_));
  // The views are taken here, in the optimizer phase, where the arena's timeline records their use.
  adam_tensors_.clear();
  for (size_t i = 0; i < P; ++i)
    adam_tensors_.push_back({params_.shard_value(i), params_.shard_grad(i), params_.adam_m(i), params_.adam_v(i),
                             takes_weight_decay(params_.trainable_spec(i).name), params_.master_storage(i)});
  if (on_device_) {
    // The device decides from the norm; AdamW's t and learning rate depend on whether the step
    // still pending (if any) counts, so both candidates go with it.
    MT_ASSERT(pending_.size() <= 1, "Trainer::step with two steps pending: finish the older first");
    const int64_t known = step_;
    const bool unknown = !pending_.empty();
    backend_.decide_and_update(shard_grads_, inv_items, adam_tensors_,
                               {.max_grad_norm = config_.max_grad_norm,
                                .if_previous_skipped = adam_step(known, 1.0f),
                                .if_previous_counted = adam_step(unknown ? known + 1 : known, 1.0f)});
    backend_.read_step();
    arena.enter_phase(Phase::Forward);
    r.pending = true;
    pending_.push_back(r);
    return r;
  }
  double sumsq = backend_.scale_and_sum_squares(shard_grads_, inv_items);
  if (deferred) r.loss_sum += backend_.take_deferred_loss_sum();  // read with the norm
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

  const AdamWStep adam_step = this->adam_step(step_++, static_cast<float>(clip));
  // Every tensor in one call (one dispatch on a device), their 16-bit storage with them.
  if (!sharded) backend_.adamw_update_group(adam_tensors_, adam_step);
  // ZeRO-1: every rank updates its block of each tensor; all of them get the whole tensor back.
  for (size_t i = 0; sharded && i < P; ++i) {
    backend_.adamw_update_group(std::span(&adam_tensors_[i], 1), adam_step);
    const Tensor storage = params_.trainable_storage(i);
    on_tensor(storage, [&](std::span<std::byte> bytes) { comm_->allgather(bytes, dtype_size(storage.dtype)); });
  }
  arena.enter_phase(Phase::Forward);
  r.updated = true;
  return r;
}

}  // namespace memtune
