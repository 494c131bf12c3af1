// `memtune train` arguments, named and defaulted like Hugging Face TrainingArguments and ms-swift
// so a user's existing flags mean what they mean there; ms-swift's and LLaMA-Factory's other
// spellings of the same settings are aliases (--use_gradient_checkpointing, --train_type,
// --finetuning_type, --lora_target, --dataset, --val_dataset, --cutoff_len, --model). Flags come
// from the command line and optionally a --config file (config_file.h); the command line wins.
// An unknown key or an impossible combination is an Error before any work.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "model/decoder.h"

namespace memtune {

// --backend NAME on a command that builds a model: where its memory lives and its ops run.
void add_backend_option(CLI::App& app, std::string& name);
// --max_shard_size SIZE on a command that writes a model (save_pretrained's meaning: "5GB",
// "200MB", "2GiB"; a tensor larger than the limit gets a shard of its own).
void add_max_shard_size_option(CLI::App& app, std::string& size);
// The options of a quantized model that runs without gradients: --quantized_activations int8 |
// float (int8_activations.h: how products of many rows take their input) and --lm_head_bits 4 | 8
// (the LM head packed at load, model/config.h: quantize_lm_head; 0 keeps the checkpoint's head).
void add_quantized_model_options(CLI::App& app, std::string& activations, int& lm_head_bits);

struct TrainingArguments {
  // Where things are.
  std::string model_name_or_path, train_file, eval_file, output_dir, tokenizer;
  std::string backend = "cpu";  // where the model's memory lives and its ops run
  // Batches and steps.
  int64_t per_device_train_batch_size = 8;
  int64_t per_device_eval_batch_size = 8;
  int64_t gradient_accumulation_steps = 1;
  int64_t eval_accumulation_steps = 0;  // accepted for compatibility: evaluation streams anyway
  double num_train_epochs = 3.0;
  int64_t max_steps = -1;
  // Optimizer and schedule.
  double learning_rate = 5e-5;
  double weight_decay = 0.0;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_epsilon = 1e-8;
  double max_grad_norm = 1.0;
  std::string lr_scheduler_type = "linear";
  double min_lr_rate = 0.0;  // cosine_with_min_lr
  int64_t warmup_steps = 0;
  double warmup_ratio = 0.0;
  double label_smoothing_factor = 0.0;
  // Evaluation during training.
  std::string eval_strategy = "no";  // no | steps | epoch
  int64_t eval_steps = 0;            // 0: logging_steps, as in Hugging Face
  std::string metrics = "eval_loss,token_accuracy";
  bool load_best_model_at_end = false;
  std::string metric_for_best_model = "loss";
  std::optional<bool> greater_is_better;  // default: false for losses, true otherwise
  // Evaluation by generation (Seq2SeqTrainer's predict_with_generate): each eval example's last
  // answer generated greedily and compared with the reference (exact_match,
  // label_accuracy_generated), beside the loss pass.
  bool predict_with_generate = false;
  int64_t max_new_tokens = 0;  // 0: the eval set's longest answer + 8
  // Logging and checkpoints.
  int64_t logging_steps = 500;
  std::vector<std::string> report_to;  // Hugging Face integration names; empty: none (parse_report_to)
  std::string logging_dir;             // TensorBoard event files; empty: Hugging Face's default
  std::string save_strategy = "steps";  // steps | epoch | no
  int64_t save_steps = 500;
  int64_t save_total_limit = 0;        // 0: keep all
  std::string max_shard_size = "5GB";  // the saved model's shard limit (save_pretrained's max_shard_size)
  std::string resume_from_checkpoint;  // a checkpoint dir, or "last"
  bool ignore_data_mismatch = false;   // resume although the training file changed
  bool overwrite_output_dir = false;   // replace an earlier run's outputs in output_dir (else refused)
  uint64_t seed = 42;
  std::optional<uint64_t> data_seed;
  // Precision and memory.
  std::string torch_dtype;  // storage dtype; empty: the checkpoint's
  bool bf16 = false, fp16 = false;
  bool gradient_checkpointing = false;
  bool optim_offload = false;  // AdamW state (and float32 masters) in host memory
  int64_t zero_stage = 0;      // 1: optimizer state sharded over data-parallel ranks
  int64_t loss_workspace_bytes = static_cast<int64_t>(kDefaultLossWorkspaceBytes);
  std::string host_memory;  // a budget for the whole process, e.g. 16GiB: refuse to start above it
  // Tuning.
  std::string tuner_type = "lora";  // lora | full (ms-swift's default is lora)
  std::string adapter;              // a PEFT LoRA adapter to go on training (its config sets rank, alpha, targets)
  int64_t lora_rank = 8;
  double lora_alpha = 32;
  double lora_dropout = 0.05;
  std::vector<std::string> target_modules = {"all-linear"};
  bool use_rslora = false;
  // Data.
  int64_t max_length = 2048;
  bool ignore_max_position_embeddings = false;  // allow max_length above the config's positions
  std::string truncation_strategy = "delete";
  bool packing = false;
  bool train_on_prompt = false;
  std::string template_name;  // --template
  std::string system;
  bool skip_bad_lines = false;
};

// Registers every argument on `app` (names as above, --template for template_name) and
// --config. Run prepare_arguments (config_file.h) on argv first so the file's keys are flags.
// `memtune plan` registers the same arguments with none required (it may plan a --preset, with
// or without data).
enum class ArgumentsFor { Train, Plan };
void add_training_arguments(CLI::App& app, TrainingArguments& args, ArgumentsFor use = ArgumentsFor::Train);

// --template, shared with `memtune eval`: LLaMA-Factory's "qwen" is qwen2_5.
void add_template_option(CLI::App& app, std::string& name);

// A dataset flag's value must be an existing local file; `flags` names the flag and its aliases.
void check_local_dataset(const std::string& path, const char* flags);

// Every floating-point option of `app` and its subcommands refuses nan and inf (a flag or a
// --config key alike): "--learning_rate: expected a finite number, got nan".
void refuse_non_finite_numbers(CLI::App& app);

// Refuses impossible combinations, naming the flags.
void validate_training_arguments(const TrainingArguments& args);

// --report_to with Hugging Face's names. tensorboard, and all (every integration memtune has:
// tensorboard), write event files; none or no name writes nothing (memtune's default). Hugging
// Face's other integrations (wandb, mlflow, ...) are accepted and not written; any other name, or
// none / all beside other names, is an Error naming it and the valid names.
struct ReportTo {
  std::vector<std::string> names;        // as given (empty values left out)
  bool tensorboard = false;
  std::vector<std::string> not_written;  // the Hugging Face integrations among them that memtune does not write
};
ReportTo parse_report_to(const std::vector<std::string>& names);
// One line for the names given that are not written ("" when there are none): "memtune: note:
// --report_to wandb: memtune writes tensorboard event files only; wandb is not written".
std::string report_to_note(const ReportTo& report_to);

}  // namespace memtune
