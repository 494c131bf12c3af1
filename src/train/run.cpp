#include "train/run.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <ostream>

#include <nlohmann/json.hpp>

#include "backend/device_work.h"
#include "backend/products.h"
#include "core/error.h"
#include "core/json_reader.h"
#include "data/batcher.h"
#include "data/dataset.h"
#include "distributed/communicator.h"
#include "eval/classification.h"
#include "eval/eval_data.h"
#include "eval/generation_eval.h"
#include "eval/metrics.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "memory/memory_files.h"
#include "memory/process_plan.h"
#include "generate/generator.h"
#include "model/load.h"
#include "options/command_setup.h"
#include "report/report.h"
#include "report/tensorboard.h"
#include "tokenizer/tokenizer.h"
#include "train/training_checkpoint.h"
#include "core/console.h"
#include "train/trainer.h"
#include "options/inference_options.h"

namespace memtune {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Everything that changes as training goes and must survive a resume.
struct Progress {
  int64_t global_step = 0;
  std::optional<double> best_metric;
  std::optional<int64_t> best_global_step;
  std::string best_model_checkpoint;
  int64_t epoch = 0;             // current epoch index
  int64_t batches_in_epoch = 0;  // micro-batches of the current epoch already consumed
  int64_t num_input_tokens_seen = 0;
  json log_history = json::array();
};

class TrainingRun {
 public:
  TrainingRun(const TrainingArguments& args, std::ostream& out, const json& arguments, Communicator& comm,
              const TrainingHooks& hooks)
      : args_(args), out_(out), arguments_(arguments), comm_(comm), root_(comm.is_root()), hooks_(hooks) {}
  void run();

 private:
  void load_data();
  void build_model();
  void resume();
  RunIdentity run_identity() const;
  // Returns true when Ctrl-C stopped it (on any rank).
  bool train_loop(InterruptRequests& interrupts);
  void log(json record, std::optional<int64_t> step = std::nullopt);  // at the current step by default
  void save_checkpoint();
  void save_final();
  void write_model_files(const fs::path& dir) const;
  json trainer_state() const;

  void check_output_dir() const;
  void prepare_output_dir() const;
  void show_progress(const StepResult& r, double elapsed);
  void run_evaluation();
  bool is_best_step(int64_t step) const { return progress_.best_global_step == step; }
  int64_t eval_every() const { return args_.eval_steps > 0 ? args_.eval_steps : args_.logging_steps; }

  void write_memory_and_report() const;

  const TrainingArguments& args_;
  std::ostream& out_;
  const json& arguments_;
  Communicator& comm_;
  const bool root_;        // rank 0 alone prints, logs and writes files
  const TrainingHooks& hooks_;
  bool terminal_ = false;  // a live progress line on a terminal, plain log lines otherwise
  fs::path output_dir_;
  std::optional<Tokenizer> tokenizer_;  // alive while the data is tokenized
  int64_t tokenizer_vocab_size_ = 0;
  ProcessPlan process_;  // the whole process, predicted before the model's memory is made
  fs::path tokenizer_dir_;
  Dataset train_;
  std::string train_data_fingerprint_;
  std::unique_ptr<Batcher> batcher_;
  std::unique_ptr<EvalData> eval_;
  MetricSelection metrics_;
  bool classification_ = false;  // --metrics label_accuracy/macro_f1: score candidate labels
  // --predict_with_generate: the generation metrics, the eval set's generation shape, the stop
  // ids, and the generation view of model_ (its KV cache and step buffers, its own arena).
  std::optional<GenerationMetrics> generation_;
  GenerationEvalShape generation_shape_;
  std::vector<int32_t> generation_stop_ids_;
  std::unique_ptr<Decoder> generation_model_;
  std::string best_key_;         // the log key metric_for_best_model names, e.g. eval_loss
  bool greater_is_better_ = false;
  std::unique_ptr<Decoder> model_;
  std::unique_ptr<CrossEntropyLoss> loss_;
  std::unique_ptr<Trainer> trainer_;
  int64_t steps_per_epoch_ = 0, total_steps_ = 0;
  Progress progress_;
  int64_t first_step_ = 0, first_tokens_ = 0;  // where this process started (after a resume)
  std::ofstream log_file_;
  ReportTo report_to_;
  std::optional<TensorBoardWriter> tensorboard_;  // --report_to tensorboard, on rank 0 (as Hugging Face)
  MemoryTimeline timeline_;
  json rank_peaks_;         // per rank: the arena and the measured peak RSS (filled at the end)
  StepAllocations heap_;    // heap allocations inside training steps
  HeapAllocations eval_heap_;  // and inside evaluation batches
  std::optional<DeviceWork> device_work_;  // what each step asked of the device (once the model exists)
};

void TrainingRun::run() {
  validate_training_arguments(args_);
  report_to_ = parse_report_to(args_.report_to);
  if (const std::string note = report_to_note(report_to_); !note.empty()) out_ << note << "\n";
  classification_ = wants_classification_metrics(args_.metrics);
  if (args_.predict_with_generate) {
    if (classification_)
      throw Error("--predict_with_generate scores generated answers: use --metrics label_accuracy_generated instead "
                  "of label_accuracy / macro_f1");
    const GenerationMetricSplit split = split_generation_metrics(args_.metrics);
    if (args_.eval_strategy != "no") generation_ = split.generation;  // (validated: there is an eval file)
    metrics_ = parse_metrics(split.token_metrics);
  } else if (!classification_) {
    metrics_ = parse_metrics(args_.metrics);
  }
  metrics_.eval_loss = true;  // always reported, as Hugging Face does
  best_key_ = args_.metric_for_best_model.starts_with("eval_") ? args_.metric_for_best_model
                                                               : "eval_" + args_.metric_for_best_model;
  greater_is_better_ = args_.greater_is_better.value_or(!best_key_.ends_with("loss"));
  output_dir_ = args_.output_dir;
  check_output_dir();
  const size_t startup_rss = startup_rss_bytes(args_.backend);
  load_data();
  process_.measure_preparation(startup_rss);
  build_model();
  if (!args_.resume_from_checkpoint.empty()) resume();
  // Every check has passed: only now is anything written into the output directory.
  if (root_) prepare_output_dir();
  comm_.barrier();  // the output directory exists before any rank writes into it
  if (root_) {
    log_file_.open(output_dir_ / "log.jsonl", std::ios::app);
    if (!log_file_) throw Error(fmt::format("{}: cannot write log.jsonl", output_dir_.string()));
    timeline_.open((output_dir_ / "memory.jsonl").string());
    if (report_to_.tensorboard) {
      tensorboard_.emplace(args_.logging_dir.empty() ? default_logging_dir(args_.output_dir, std::time(nullptr))
                                                     : args_.logging_dir);
      out_ << fmt::format("tensorboard: writing {}\n", tensorboard_->path().string());
    }
  }
  terminal_ = progress_line_on_terminal(out_, comm_.world_size());
  bool interrupted = false;
  {
    InterruptRequests interrupts;  // Ctrl-C: stop after the current step and save a checkpoint
    interrupted = train_loop(interrupts);
  }
  // The last epoch ends with the last step, before the loop sees the epoch boundary.
  if (!interrupted && progress_.global_step > 0 && progress_.batches_in_epoch > 0) {
    if (args_.eval_strategy == "epoch") run_evaluation();
    if (args_.save_strategy == "epoch") save_checkpoint();
  }
  if (interrupted) {
    save_checkpoint();
    throw Interrupted(fmt::format("interrupted at step {}: saved {}; continue with --resume_from_checkpoint last",
                                  progress_.global_step,
                                  (output_dir_ / fmt::format("checkpoint-{}", progress_.global_step)).string()));
  }
  save_final();
}

// A directory holding an earlier run's outputs (or a model) is refused unless this run resumes
// from it or replaces them: a new run's files mixed with another run's would describe neither.
void TrainingRun::check_output_dir() const {
  if (!args_.resume_from_checkpoint.empty() || args_.overwrite_output_dir) return;
  const std::vector<std::string> earlier = earlier_run_outputs(output_dir_);
  if (earlier.empty()) return;
  throw Error(fmt::format(
      "--output_dir {} holds the outputs of an earlier run or a model ({}): continue that run with "
      "--resume_from_checkpoint last, replace its outputs with --overwrite_output_dir, or choose another directory",
      output_dir_.string(), fmt::join(earlier, ", ")));
}

void TrainingRun::prepare_output_dir() const {
  create_directory(output_dir_.string(), "--output_dir");
  if (args_.overwrite_output_dir && args_.resume_from_checkpoint.empty()) {
    remove_earlier_run_outputs(output_dir_);
  } else {
    // A save interrupted by a crash leaves only a tmp-checkpoint-N behind; it was never complete.
    for (const auto& e : fs::directory_iterator(output_dir_))
      if (e.path().filename().string().starts_with("tmp-checkpoint-")) fs::remove_all(e.path());
  }
  json recorded = arguments_;
  recorded["world_size"] = comm_.world_size();
  write_file_atomically((output_dir_ / "run_args.json").string(), recorded.dump(2) + "\n");
}

void TrainingRun::show_progress(const StepResult& r, double elapsed) {
  if (!terminal_) return;
  const double per_step = elapsed / static_cast<double>(std::max<int64_t>(1, progress_.global_step - first_step_));
  const double eta = per_step * static_cast<double>(total_steps_ - progress_.global_step);
  out_ << fmt::format("\r\x1b[2Kstep {}/{} | loss {:.4f} | lr {:.2e} | {:.0f} tok/s | ETA {} | memory {}",
                      progress_.global_step, total_steps_, r.loss(), r.learning_rate,
                      static_cast<double>(progress_.num_input_tokens_seen - first_tokens_) / std::max(elapsed, 1e-9),
                      format_duration(eta), format_bytes(model_->plan().peak_bytes()))
       << std::flush;
}

void TrainingRun::load_data() {
  tokenizer_dir_ = args_.tokenizer.empty() ? fs::path(args_.model_name_or_path) : fs::path(args_.tokenizer);
  tokenizer_.emplace(Tokenizer::load(tokenizer_dir_.string()));
  const DataOptions d = data_options(args_);
  train_ = load_dataset(args_.train_file, *tokenizer_, d);
  train_data_fingerprint_ = file_fingerprint(args_.train_file);
  if (!args_.eval_file.empty()) {
    if (args_.eval_strategy == "no")
      out_ << "note: --eval_file is evaluated only with --eval_strategy steps or epoch (as in Hugging Face)\n";
    BatchOptions e;
    e.per_device_batch_size = args_.per_device_eval_batch_size;
    e.rank = comm_.rank();
    e.world_size = comm_.world_size();
    eval_ = std::make_unique<EvalData>(args_.eval_file, *tokenizer_, d, classification_, std::vector<std::string>{}, e);
  }
  const DatasetCounts& c = train_.counts();
  out_ << fmt::format(
      "data: {} examples, {} tokens, {} target tokens from {} lines ({} dropped without targets, {} truncated, {} "
      "deleted as longer than max_length {}, {} bad lines skipped)\n",
      train_.size(), train_.num_tokens(), train_.num_targets(), c.lines, c.dropped_no_targets, c.truncated,
      c.deleted_too_long, args_.max_length, c.bad_lines);
  // The tokenizer (vocabulary, merges, caches) is not needed once the data is tokenized; give
  // its memory back to the system before the model's memory is made. Evaluation by generation
  // decodes with it, so there it stays (and counts as prepared data).
  tokenizer_vocab_size_ = tokenizer_->vocab_size();
  if (generation_) {
    generation_stop_ids_ = model_stop_ids(args_.model_name_or_path, &*tokenizer_, /*chat=*/true);
  } else {
    tokenizer_.reset();
    malloc_trim(0);
  }
  if (train_.empty() || train_.num_targets() == 0)
    throw Error(fmt::format("{}: no example with a trainable token is left to train on", args_.train_file));
  BatchOptions b;
  b.per_device_batch_size = args_.per_device_train_batch_size;
  b.packing = args_.packing;
  b.max_length = args_.max_length;
  b.seed = args_.data_seed.value_or(args_.seed);
  b.rank = comm_.rank();
  b.world_size = comm_.world_size();
  batcher_ = std::make_unique<Batcher>(train_, b);
  batcher_->start_epoch(0);
  // Hugging Face: the last accumulation step of an epoch takes the micro-batches that are left.
  steps_per_epoch_ = std::max<int64_t>(
      1, (batcher_->num_batches() + args_.gradient_accumulation_steps - 1) / args_.gradient_accumulation_steps);
  total_steps_ = args_.max_steps > 0 ? args_.max_steps
                                     : static_cast<int64_t>(std::ceil(args_.num_train_epochs * steps_per_epoch_));
}

void TrainingRun::build_model() {
  const std::optional<DType> dtype = storage_dtype(args_.torch_dtype, args_.bf16, args_.fp16);
  const ModelConfig config = load_model_config(args_.model_name_or_path, dtype);
  if (!args_.ignore_max_position_embeddings)
    check_max_length(config, args_.max_length, (fs::path(args_.model_name_or_path) / "config.json").string());
  if (tokenizer_vocab_size_ > config.vocab_size)
    throw Error(fmt::format("the tokenizer has {} ids but the model's vocab_size is {}", tokenizer_vocab_size_,
                            config.vocab_size));
  // One plan serves training and evaluation: the larger micro-batch of the two.
  ModelOptions o = training_model_options(
      args_, std::max(batcher_->max_micro_batch_tokens(), eval_ ? eval_->batcher().max_micro_batch_tokens() : 0),
      std::max(batcher_->max_micro_batch_targets(), eval_ ? eval_->batcher().max_micro_batch_targets() : 0),
      comm_.rank(), comm_.world_size());
  {
    // The whole process, predicted from the plan before any of its memory exists.
    ModelOptions planned = o;
    planned.allocate = false;
    Decoder preview(config, planned);
    add_planned_terms(process_, preview, load_model_config(args_.model_name_or_path).torch_dtype, comm_.world_size());
    if (eval_ && args_.eval_strategy != "no") process_.evaluation_bytes = kEvaluationRuntimeBytes;
    if (generation_) {
      generation_shape_ = generation_eval_shape(eval_->tokens(), args_.per_device_eval_batch_size,
                                                args_.max_new_tokens, args_.eval_file);
      const Decoder view(preview, inference_model_options(config, generation_shape_.limits, o.backend, false));
      process_.generation_arena_bytes = view.plan().peak_bytes() + view.host_plan().peak_bytes();
    }
    if (!args_.host_memory.empty()) {
      // Every rank decides on the largest prediction of all ranks, so they stop together.
      const size_t budget = parse_bytes(args_.host_memory, "--host_memory");
      std::vector<int64_t> peaks(static_cast<size_t>(comm_.world_size()), 0);
      peaks[static_cast<size_t>(comm_.rank())] = static_cast<int64_t>(process_.peak_bytes());
      comm_.allreduce_sum(peaks);
      const auto worst = std::max_element(peaks.begin(), peaks.end());
      if (*worst == peaks[static_cast<size_t>(comm_.rank())]) check_host_budget(process_, budget, "--host_memory");
      if (static_cast<size_t>(*worst) > budget)
        throw Error(fmt::format("--host_memory {}: rank {} is predicted to need {}, so the run does not start",
                                format_bytes(budget), worst - peaks.begin(), format_bytes(static_cast<size_t>(*worst))));
    }
  }
  model_ = load_model(args_.model_name_or_path, o, "", dtype);
  device_work_.emplace(model_->backend());
  if (!args_.adapter.empty())
    model_->parameters().load_adapter(args_.adapter);
  else if (o.lora.enabled())
    model_->parameters().init_lora(args_.seed);
  if (generation_)
    generation_model_ =
        std::make_unique<Decoder>(*model_, inference_model_options(config, generation_shape_.limits, o.backend, true));
  loss_ = std::make_unique<CrossEntropyLoss>(static_cast<float>(args_.label_smoothing_factor));
  model_->set_loss(*loss_);

  TrainerConfig tc;
  tc.learning_rate = args_.learning_rate;
  tc.adam = {args_.adam_beta1, args_.adam_beta2, args_.adam_epsilon, args_.weight_decay};
  tc.max_grad_norm = args_.max_grad_norm;
  // float16 storage trains with dynamic loss scaling, as Hugging Face does with fp16.
  tc.loss_scaling.enabled = config.torch_dtype == DType::F16;
  tc.schedule.type = parse_lr_schedule(args_.lr_scheduler_type);
  tc.schedule.total_steps = total_steps_;
  tc.schedule.warmup_steps = warmup_steps_for(args_.warmup_steps, args_.warmup_ratio, total_steps_);
  tc.schedule.min_lr_rate = args_.min_lr_rate;
  trainer_ = std::make_unique<Trainer>(*model_, tc, &comm_);

  int64_t trainable = 0;
  for (size_t i = 0; i < model_->parameters().num_trainable(); ++i)
    trainable += model_->parameters().trainable_spec(i).numel();
  out_ << fmt::format(
      "model: {} parameters ({}), {} trainable ({}), micro-batch up to {} tokens, {} steps ({} per epoch)\n",
      model_parameter_count(config), dtype_torch_name(config.torch_dtype), trainable,
      o.lora.enabled() ? fmt::format("LoRA r={} on {}", o.lora.rank, fmt::join(o.lora.target_names(), ","))
                       : std::string("full fine-tuning"),
      o.max_tokens, total_steps_, steps_per_epoch_);
  out_ << "arithmetic: " << describe_arithmetic(config, o, model_->backend()) << "\n";
  if (comm_.world_size() > 1)
    out_ << fmt::format("data parallel: {} ranks{}, {} sequences per optimizer step ({} per rank x {} accumulation)\n",
                        comm_.world_size(), o.shards_optimizer() ? " with ZeRO-1" : "",
                        args_.per_device_train_batch_size * args_.gradient_accumulation_steps * comm_.world_size(),
                        args_.per_device_train_batch_size, args_.gradient_accumulation_steps);
  out_ << "memory plan:\n" << model_->plan().summary();
  if (generation_model_)
    out_ << fmt::format("generation for evaluation (up to {} new tokens, {} sequences at once): {} arena\n",
                        generation_shape_.max_new_tokens, generation_shape_.limits.max_num_seqs,
                        format_bytes(generation_model_->plan().peak_bytes()))
         << generation_model_->plan().summary();
  out_ << process_.summary();
}

void TrainingRun::write_model_files(const fs::path& dir) const {
  if (model_->options().lora.enabled()) {
    model_->parameters().save_adapter(dir.string(), args_.model_name_or_path);
  } else {
    model_->parameters().save(dir.string(), parse_bytes(args_.max_shard_size, "--max_shard_size"));
  }
  for (const char* name : {"tokenizer.json", "tokenizer_config.json"})
    if (fs::exists(tokenizer_dir_ / name))
      fs::copy_file(tokenizer_dir_ / name, dir / name, fs::copy_options::overwrite_existing);
}

json TrainingRun::trainer_state() const {
  return {{"global_step", progress_.global_step},
          {"epoch", static_cast<double>(progress_.global_step) / static_cast<double>(steps_per_epoch_)},
          {"max_steps", total_steps_},
          {"logging_steps", args_.logging_steps},
          {"eval_steps", args_.eval_strategy == "steps" ? json(eval_every()) : json(nullptr)},
          {"save_steps", args_.save_steps},
          {"train_batch_size", args_.per_device_train_batch_size},
          {"num_train_epochs", static_cast<int64_t>(std::ceil(static_cast<double>(total_steps_) / steps_per_epoch_))},
          {"num_input_tokens_seen", progress_.num_input_tokens_seen},
          {"log_history", progress_.log_history},
          {"best_metric", progress_.best_metric ? json(*progress_.best_metric) : json(nullptr)},
          {"best_global_step", progress_.best_global_step ? json(*progress_.best_global_step) : json(nullptr)},
          {"best_model_checkpoint",
           progress_.best_model_checkpoint.empty() ? json(nullptr) : json(progress_.best_model_checkpoint)},
          {"is_local_process_zero", true},
          {"is_world_process_zero", true},
          {"total_flos", 0}};
}

void TrainingRun::save_checkpoint() {
  // Checkpoints do not depend on the world size: the optimizer state is saved whole. Every rank
  // holds the same model; with ZeRO-1 each rank's shards of the moments and masters are gathered
  // on rank 0 first (every rank takes part), otherwise rank 0 writes its own copy.
  const fs::path final_dir = output_dir_ / fmt::format("checkpoint-{}", progress_.global_step);
  const fs::path tmp = output_dir_ / fmt::format("tmp-checkpoint-{}", progress_.global_step);
  try {
    if (root_) {
      fs::remove_all(tmp);
      fs::create_directories(tmp);
      write_model_files(tmp);
    }
    write_optimizer_state(model_->parameters(), model_->arena(), comm_, tmp / "optimizer.safetensors");
    if (!root_) return;
    write_file_atomically((tmp / "trainer_state.json").string(), trainer_state().dump(2) + "\n");
    json position = {{"global_step", progress_.global_step},
                     {"optimizer_steps", trainer_->global_step()},
                     {"loss_scale", trainer_->loss_scale()},
                     {"good_steps", trainer_->good_steps()},
                     {"epoch", progress_.epoch},
                     {"batches_in_epoch", progress_.batches_in_epoch},
                     {"num_input_tokens_seen", progress_.num_input_tokens_seen}};
    position.update(run_identity_json(run_identity()));
    write_file_atomically((tmp / "memtune_state.json").string(), position.dump(2) + "\n");
    remove_checkpoint(final_dir);
    fs::rename(tmp, final_dir);
    if (is_best_step(progress_.global_step)) {
      progress_.best_model_checkpoint = final_dir.string();
      write_file_atomically((final_dir / "trainer_state.json").string(), trainer_state().dump(2) + "\n");
    }
    rotate_checkpoints(output_dir_, args_.save_total_limit, progress_.best_model_checkpoint);
    out_ << (terminal_ ? "\r\x1b[2K" : "") << fmt::format("saved {}\n", final_dir.string());
  } catch (...) {
    // A save that failed (a full disk, say) leaves nothing behind; the earlier checkpoints stay.
    if (root_) {
      std::error_code ignored;
      fs::remove_all(tmp, ignored);
    }
    throw;
  }
  if (root_ && hooks_.on_save) hooks_.on_save(final_dir.string());
}

void TrainingRun::resume() {
  fs::path dir = args_.resume_from_checkpoint;
  if (args_.resume_from_checkpoint == "last") {
    const auto all = list_checkpoints(output_dir_);
    if (all.empty())
      throw Error(fmt::format("--resume_from_checkpoint last: no checkpoint-* in {}", output_dir_.string()));
    dir = all.back().second;
  }
  const json position_json = read_json_file(dir / "memtune_state.json");
  const json state_json = read_json_file(dir / "trainer_state.json");
  const JsonReader position(position_json, (dir / "memtune_state.json").string());
  const JsonReader state(state_json, (dir / "trainer_state.json").string());
  const SavedPosition saved = read_saved_position(position, run_identity(), args_.ignore_data_mismatch);
  model_->parameters().restore(dir.string());
  read_optimizer_state(model_->parameters(), model_->arena(), dir / "optimizer.safetensors");
  progress_.global_step = saved.global_step;
  progress_.epoch = saved.epoch;
  progress_.batches_in_epoch = saved.batches_in_epoch;
  progress_.num_input_tokens_seen = saved.num_input_tokens_seen;
  if (const std::optional<JsonReader> history = state.optional_array("log_history"))
    progress_.log_history = history->value();
  progress_.best_metric = state.optional_number("best_metric");
  progress_.best_global_step = state.optional_integer("best_global_step", 0);
  progress_.best_model_checkpoint = state.optional_string("best_model_checkpoint").value_or("");
  trainer_->restore_global_step(saved.optimizer_steps);
  trainer_->restore_loss_scale(saved.loss_scale.value_or(trainer_->loss_scale()), saved.good_steps);
  out_ << fmt::format("resumed from {} at step {}\n", dir.string(), progress_.global_step);
}

RunIdentity TrainingRun::run_identity() const {
  return {
      .global_batch_size = args_.per_device_train_batch_size * args_.gradient_accumulation_steps * comm_.world_size(),
      .seed = args_.seed,
      .data_seed = args_.data_seed.value_or(args_.seed),
      .max_length = args_.max_length,
      .packing = args_.packing,
      .train_data_fingerprint = train_data_fingerprint_};
}

void TrainingRun::run_evaluation() {
  const auto start = std::chrono::steady_clock::now();
  eval_->batcher().start_epoch(0);
  json record = {{"epoch", static_cast<double>(progress_.global_step) / static_cast<double>(steps_per_epoch_)}};
  model_->arena().reset_usage();
  if (classification_) {
    const ClassificationResult r =
        evaluate_classification(*model_, eval_->batcher(), eval_->classification_set(), &comm_);
    record["eval_loss"] = r.eval_loss;
    record["eval_label_accuracy"] = r.label_accuracy;
    record["eval_macro_f1"] = r.macro_f1;
    record["eval_examples"] = r.examples;
    eval_heap_ += r.heap_during_batches;
  } else {
    const EvalResult r = evaluate(*model_, eval_->batcher(), metrics_, hooks_.eval, &comm_);
    record["eval_tokens"] = r.num_tokens;
    eval_heap_ += r.heap_during_batches;
    for (const auto& [name, value] : r.values) record[name.starts_with("eval_") ? name : "eval_" + name] = value;
  }
  if (generation_model_) {
    GenerationEvalResult g =
        evaluate_by_generation(*generation_model_, *tokenizer_, eval_->tokens(), *generation_, {},
                               generation_shape_.max_new_tokens, generation_stop_ids_, comm_.rank(), comm_.world_size());
    std::vector<int64_t> counts = {g.examples, g.exact_matches, g.label_matches};
    comm_.allreduce_sum(counts);
    g.examples = counts[0];
    g.exact_matches = counts[1];
    g.label_matches = counts[2];
    g.finish();
    if (generation_->exact_match) record["eval_exact_match"] = g.exact_match;
    if (generation_->label_accuracy) record["eval_label_accuracy_generated"] = g.label_accuracy_generated;
    record["eval_generated_examples"] = g.examples;
  }
  model_->arena().sample();
  record["eval_runtime"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  static constexpr Phase kEvalPhases[] = {Phase::Forward, Phase::Loss};
  timeline_.record(model_->arena(), progress_.global_step, "eval", kEvalPhases);
  if (!record.contains(best_key_))
    throw Error(fmt::format("--metric_for_best_model {}: not among the evaluated metrics (--metrics {})",
                            args_.metric_for_best_model, args_.metrics));
  const double value = record[best_key_].get<double>();
  if (!progress_.best_metric ||
      (greater_is_better_ ? value > *progress_.best_metric : value < *progress_.best_metric)) {
    progress_.best_metric = value;
    progress_.best_global_step = progress_.global_step;
  }
  log(record);
  if (root_) write_memory_and_report();
}

void TrainingRun::log(json record, std::optional<int64_t> step) {
  const int64_t at = step.value_or(progress_.global_step);
  // Hugging Face's TensorBoardCallback.on_log: the record's numbers, at the global step.
  if (tensorboard_) tensorboard_->add_scalars(at, tensorboard_scalars(record));
  record["step"] = at;
  progress_.log_history.push_back(record);
  if (!root_) return;
  log_file_ << record.dump() << "\n";
  log_file_.flush();
  out_ << (terminal_ ? "\r\x1b[2K" : "") << record.dump() << "\n";
  if (hooks_.on_log) hooks_.on_log(record);
}

bool TrainingRun::train_loop(InterruptRequests& interrupts) {
  using Clock = std::chrono::steady_clock;
  const int64_t ga = args_.gradient_accumulation_steps;
  std::vector<MicroBatch> micro(static_cast<size_t>(ga));
  std::vector<TokenBatch> views;
  double window_loss = 0, window_grad_norm = 0;
  int64_t window_items = 0, window_steps = 0, window_tokens = 0;
  // Steps in a row whose gradients were not finite although loss scaling (if any) could no longer
  // help: the run is ruined (a learning rate that blew the weights up, corrupt weights), and
  // saving it as a success would hide that.
  static constexpr int64_t kMaxNonFiniteSteps = 10;
  int64_t nonfinite_in_a_row = 0;
  auto window_start = Clock::now();
  const auto run_start = Clock::now();
  batcher_->start_epoch(progress_.epoch);
  for (int64_t skip = 0; skip < progress_.batches_in_epoch; ++skip) batcher_->next(micro[0]);
  first_step_ = progress_.global_step;
  first_tokens_ = progress_.num_input_tokens_seen;

  // What happens after a step, once its result is known: the skip rule, the progress line, the
  // log. `step` is the step's number and `tokens_seen` the tokens up to it: with the trainer
  // deciding steps on the device, a step is accounted after the next one has been recorded.
  auto account = [&](const StepResult& r, int64_t step, int64_t tokens_seen) {
    if (r.skipped_nonfinite) {
      // fp16's loss scale backs off from 65536 by halving: only steps at a scale of 1 or below count.
      if (r.loss_scale <= 1.0 && ++nonfinite_in_a_row >= kMaxNonFiniteSteps)
        throw Error(fmt::format(
            "training stopped at step {}: the gradients of the last {} steps were not finite (nan or inf), so "
            "nothing was updated; the weights or the learning rate ({}) have diverged. Nothing was saved for "
            "these steps; earlier checkpoints in {} are intact",
            step, kMaxNonFiniteSteps, args_.learning_rate, args_.output_dir));
      // Counted as a step like Hugging Face does, but nothing was updated.
      log({{"skipped", "non-finite gradients"},
           {"loss_scale", r.loss_scale},
           {"next_loss_scale", trainer_->loss_scale()}},
          step);
      return;
    }
    nonfinite_in_a_row = 0;
    window_loss += r.loss_sum;
    window_items += r.num_items;
    window_grad_norm += r.grad_norm;
    window_tokens += r.num_tokens;
    ++window_steps;
    show_progress(r, std::chrono::duration<double>(Clock::now() - run_start).count());
    if (step % args_.logging_steps != 0 && step != total_steps_) return;
    const double seconds = std::chrono::duration<double>(Clock::now() - window_start).count();
    const StepTimings& phases = model_->last_step_timings();  // the step's last micro-batch
    log({{"loss", window_loss / static_cast<double>(window_items)},
         {"grad_norm", window_grad_norm / static_cast<double>(window_steps)},
         {"learning_rate", r.learning_rate},
         {"epoch", static_cast<double>(step) / static_cast<double>(steps_per_epoch_)},
         {"num_input_tokens_seen", tokens_seen},
         {"tokens_per_second", static_cast<double>(window_tokens) / std::max(seconds, 1e-9)},
         {"memory_arena_bytes", model_->plan().peak_bytes()},
         {"memory_rss_bytes", current_rss_bytes()},
         {"elapsed_seconds", std::chrono::duration<double>(Clock::now() - run_start).count()},
         {"loss_scale", r.loss_scale},
         {"world_size", comm_.world_size()},
         {"comm_payload_bytes", comm_.payload_bytes()},
         {"forward_seconds", phases.forward},
         {"loss_seconds", phases.loss},
         {"backward_seconds", phases.backward},
         {"phase_clock", phases.device ? "device" : "host"}},
        step);
    window_loss = window_grad_norm = 0;
    window_items = window_steps = window_tokens = 0;
    window_start = Clock::now();
  };
  // A step recorded on the device whose result is not read yet: read it and account for it.
  struct Pending {
    int64_t step, tokens_seen;
  };
  std::optional<Pending> pending;
  auto settle = [&] {
    if (!pending) return;
    const Pending p = *pending;
    pending.reset();
    account(trainer_->finish(), p.step, p.tokens_seen);
  };

  while (progress_.global_step < total_steps_) {
    // Ctrl-C reaches every rank at a slightly different moment: they agree to stop together.
    if (comm_.allreduce_max(interrupts.requested() ? 1 : 0) != 0) {
      settle();
      return true;
    }
    views.clear();
    int64_t global_batches = 0;
    for (int64_t k = 0; k < ga; ++k) {
      // next() is false for every rank at once (global micro-batches); a rank's share of the
      // last one may be empty, and that rank still takes part in the step.
      if (!batcher_->next(micro[static_cast<size_t>(k)])) break;
      ++progress_.batches_in_epoch;
      ++global_batches;
      const MicroBatch& mb = micro[static_cast<size_t>(k)];
      if (mb.input_ids.empty()) continue;
      views.push_back({mb.input_ids, mb.labels, mb.cu_seqlens});
    }
    if (global_batches == 0) {  // the epoch is over
      ++progress_.epoch;
      progress_.batches_in_epoch = 0;
      batcher_->start_epoch(progress_.epoch);
      if (args_.eval_strategy == "epoch" || args_.save_strategy == "epoch") settle();
      if (args_.eval_strategy == "epoch" && progress_.global_step > 0) run_evaluation();
      if (args_.save_strategy == "epoch" && progress_.global_step > 0) save_checkpoint();
      continue;
    }
    // LoRA dropout masks: a function of the seed and the step, so a resumed run draws the same.
    model_->set_dropout_seed(args_.seed * 0x100000001b3ull + static_cast<uint64_t>(progress_.global_step));
    model_->arena().reset_usage();
    heap_.begin();
    device_work_->begin();
    const StepResult r = trainer_->step(views);
    heap_.end();
    model_->arena().sample();
    if (!r.updated && !r.skipped_nonfinite && !r.pending) continue;  // no target token at all: not a step
    ++progress_.global_step;
    progress_.num_input_tokens_seen += r.num_tokens;
    static constexpr Phase kStepPhases[] = {Phase::Forward, Phase::Loss, Phase::Backward, Phase::Optimizer};
    timeline_.record(model_->arena(), progress_.global_step, "train", kStepPhases);
    settle();  // the step before this one, now that this one is on its way
    if (r.pending)
      pending = Pending{progress_.global_step, progress_.num_input_tokens_seen};
    else
      account(r, progress_.global_step, progress_.num_input_tokens_seen);
    const bool evaluate = args_.eval_strategy == "steps" && progress_.global_step % eval_every() == 0;
    const bool save = args_.save_strategy == "steps" && progress_.global_step % args_.save_steps == 0;
    if (evaluate || save || progress_.global_step == total_steps_) settle();
    device_work_->end();  // the step with its logging (which reads the device's timestamps)
    // Evaluation and checkpoint time is not training time: the throughput window skips it.
    const auto pause = Clock::now();
    if (evaluate) run_evaluation();
    if (save) save_checkpoint();
    window_start += Clock::now() - pause;
    if (root_ && hooks_.on_step_end) hooks_.on_step_end(progress_.global_step, total_steps_);
    if (hooks_.should_stop && comm_.allreduce_max(root_ && hooks_.should_stop() ? 1 : 0) != 0) {
      settle();
      total_steps_ = progress_.global_step;  // the run ends here, as at max_steps
    }
  }
  return false;
}

void TrainingRun::save_final() {
  // Each rank's own arena (ranks plan for their own micro-batches and shards) and measured peak.
  const size_t W = static_cast<size_t>(comm_.world_size()), me = static_cast<size_t>(comm_.rank());
  std::vector<int64_t> peaks(3 * W, 0);
  peaks[3 * me] = static_cast<int64_t>(model_->plan().peak_bytes());
  peaks[3 * me + 1] = static_cast<int64_t>(model_->arena().high_water_bytes());
  peaks[3 * me + 2] = static_cast<int64_t>(process_peak_rss_bytes(model_->arena()));
  comm_.allreduce_sum(peaks);
  rank_peaks_ = json::array();
  for (size_t r = 0; r < W; ++r)
    rank_peaks_.push_back({{"rank", r},
                           {"arena_bytes", peaks[3 * r]},
                           {"arena_high_water_bytes", peaks[3 * r + 1]},
                           {"process_peak_rss_bytes", peaks[3 * r + 2]}});
  if (!root_) return;
  if (terminal_) out_ << "\n";
  if (args_.load_best_model_at_end && !progress_.best_model_checkpoint.empty()) {
    model_->parameters().restore(progress_.best_model_checkpoint);
    out_ << fmt::format("loaded the best checkpoint {} ({} = {})\n", progress_.best_model_checkpoint, best_key_,
                        *progress_.best_metric);
  }
  write_model_files(output_dir_);
  write_file_atomically((output_dir_ / "trainer_state.json").string(), trainer_state().dump(2) + "\n");
  write_memory_and_report();
  out_ << fmt::format("done: {} steps; arena {} (planned), process peak {} (measured); wrote {} (report: {})\n",
                      progress_.global_step, format_bytes(model_->plan().peak_bytes()),
                      format_bytes(process_peak_rss_bytes(model_->arena())),
                      output_dir_.string(), (output_dir_ / "report.html").string());
}

void TrainingRun::write_memory_and_report() const {
  HeapAllocations during_steps = heap_.total();
  during_steps += eval_heap_;
  json memory = memory_json(model_->plan(), model_->arena(), model_->host_plan(), during_steps);
  memory["world_size"] = comm_.world_size();
  memory["process_plan"] = process_.to_json();
  memory["process_predicted_peak_bytes"] = process_.peak_bytes();
  if (!rank_peaks_.empty()) memory["ranks"] = rank_peaks_;
  memory["device_work"] = device_work_ ? device_work_->to_json("training step") : nlohmann::json(nullptr);
  memory["products"] = products_json();
  write_file_atomically((output_dir_ / "memory.json").string(), memory.dump(2) + "\n");
  write_report(output_dir_);
}

}  // namespace

void run_training(const TrainingArguments& args, std::ostream& out, const json& arguments,
                  const TrainingHooks& hooks) {
  Communicator& comm = world();
  if (comm.is_root()) {
    TrainingRun(args, out, arguments, comm, hooks).run();
    return;
  }
  std::ostream silent(nullptr);  // other ranks print nothing
  TrainingRun(args, silent, arguments, comm, hooks).run();
}

}  // namespace memtune
