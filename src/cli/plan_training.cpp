// The training run a command line describes, for `memtune plan` (see plan_training.h).
#include "cli/plan_training.h"

#include <fmt/format.h>
#include <malloc.h>

#include <algorithm>
#include <optional>

#include "core/error.h"
#include "data/batcher.h"
#include "eval/metrics.h"
#include "model/load.h"
#include "tokenizer/tokenizer.h"

namespace memtune::cli {

TrainingPlanner::TrainingPlanner(const PlanArgs& a, size_t startup_rss) : args_(a) {
  const TrainingArguments& r = a.run;
  if (r.model_name_or_path.empty() == a.preset.empty()) throw Error("plan needs exactly one of --model or --preset");
  validate_training_arguments(r);
  model_ = choose_model({.model = r.model_name_or_path,
                         .preset = a.preset,
                         .quantization = a.quantization,
                         .torch_dtype = r.torch_dtype,
                         .bf16 = r.bf16,
                         .fp16 = r.fp16,
                         .backend = r.backend,
                         .adapter = {},
                         .adapter_sets = {},
                         .host_memory = {}});
  // The data, tokenized as the run tokenizes it.
  process_.startup_bytes = startup_rss;
  if (r.train_file.empty()) return;
  if (r.tokenizer.empty() && !a.preset.empty())
    throw Error("--train_file with --preset needs --tokenizer (a directory with tokenizer.json)");
  std::optional<Tokenizer> tokenizer(Tokenizer::load(r.tokenizer.empty() ? r.model_name_or_path : r.tokenizer));
  const DataOptions d = data_options(r);
  train_data_ = load_dataset(r.train_file, *tokenizer, d);
  if (!r.eval_file.empty()) {
    BatchOptions e;
    e.per_device_batch_size = r.per_device_eval_batch_size;
    e.world_size = a.world_size;
    e.rank = a.world_size - 1;
    eval_data_ = std::make_unique<EvalData>(r.eval_file, *tokenizer, d, wants_classification_metrics(r.metrics),
                                            std::vector<std::string>{}, e);
  }
  // As the run does before its model; evaluation by generation keeps it to decode.
  if (!(r.predict_with_generate && r.eval_strategy != "no" && eval_data_)) {
    tokenizer.reset();
    malloc_trim(0);
  }
  process_.measure_preparation(startup_rss);
  if (train_data_.empty() || train_data_.num_targets() == 0)
    throw Error(fmt::format("{}: no example with a trainable token is left to train on", r.train_file));
}

MicroBatch TrainingPlanner::train_micro(int64_t batch, int64_t length) const {
  if (train_data_.empty()) return {batch * length, 0};
  BatchOptions b;
  b.per_device_batch_size = batch;
  b.packing = args_.run.packing;
  b.max_length = length;
  b.world_size = args_.world_size;
  b.rank = args_.world_size - 1;
  const Batcher batcher(train_data_, b);
  return {batcher.max_micro_batch_tokens(), batcher.max_micro_batch_targets()};
}

MicroBatch TrainingPlanner::eval_micro(int64_t batch, int64_t length) const {
  if (!eval_data_) return {batch * length, 0};
  return {eval_data_->batcher().max_micro_batch_tokens(), eval_data_->batcher().max_micro_batch_targets()};
}

ModelOptions TrainingPlanner::run_options(int64_t batch, int64_t length) const {
  const TrainingArguments& r = args_.run;
  MicroBatch m = train_micro(batch, length);
  if (eval_data_) {
    const MicroBatch e = eval_micro(std::min(r.per_device_eval_batch_size, batch), length);
    m = {std::max(m.tokens, e.tokens), std::max(m.targets, e.targets)};
  }
  // With ZeRO-1 rank r holds [n r / W, n (r + 1) / W) of each tensor: the last rank's block is
  // ceil(n / W) of every one, the largest, so its plan bounds every rank's.
  ModelOptions o = training_model_options(r, m.tokens, m.targets, args_.world_size - 1, args_.world_size);
  o.allocate = false;
  return o;
}

ModelOptions TrainingPlanner::eval_options(const ModelOptions& train) const {
  const TrainingArguments& r = args_.run;
  ModelOptions eval = train;
  const MicroBatch e = eval_micro(r.per_device_eval_batch_size, r.max_length);
  eval.max_tokens = e.tokens;
  eval.max_targets = e.targets;
  eval.with_grads = eval.with_optimizer = eval.optim_offload = false;
  eval.zero_stage = 0;
  eval.gradient_checkpointing = false;
  return eval;
}

}  // namespace memtune::cli
