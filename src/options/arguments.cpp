#include "options/arguments.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string_view>

#include "core/error.h"
#include "memory/plan.h"  // parse_bytes

namespace memtune {

void add_backend_option(CLI::App& app, std::string& name) {
  app.add_option("--backend", name,
                 "where the model's memory lives and its ops run: cpu (fast) | reference (plain "
                 "float64 loops, the correctness oracle; slow) | vulkan (a Vulkan device: a GPU, or lavapipe on the "
                 "CPU; memtune devices lists them)")
      ->capture_default_str();
}

void add_max_shard_size_option(CLI::App& app, std::string& size) {
  app.add_option("--max_shard_size", size,
                 "write the model in safetensors shards of at most this size with model.safetensors.index.json "
                 "(e.g. 5GB, 200MB, 2GiB), as save_pretrained does")
      ->capture_default_str();
}

void add_quantized_model_options(CLI::App& app, std::string& activations, int& lm_head_bits) {
  app.add_option("--lm_head_bits", lm_head_bits,
                 "GPTQ / AWQ models: pack the LM head at load with 8 or 4 bits (round to nearest, the layers' group "
                 "size): decoding reads a quarter (8) or an eighth (4) of a 16-bit head's bytes; 0 keeps the "
                 "checkpoint's head")
      ->check(CLI::IsMember({0, 4, 8}))
      ->capture_default_str();
  app.add_option("--quantized_activations", activations,
                 "GPTQ / AWQ models, products of more than 16 rows (prompts, serving steps, evaluation; "
                 "decoding keeps float32 inputs): int8 rounds their input to int8 per block for integer dot "
                 "products; bf16 rounds the input and each dequantized weight tile to bfloat16 for the CPU's "
                 "matrix unit (oneDNN: AMX or AVX512-BF16); float keeps float32 inputs; auto takes bf16 where "
                 "the matrix unit is AMX tiles, int8 otherwise")
      ->check(CLI::IsMember({"auto", "int8", "bf16", "float"}))
      ->capture_default_str();
}

void add_training_arguments(CLI::App& app, TrainingArguments& a, ArgumentsFor use) {
  const bool required = use == ArgumentsFor::Train;
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--config",
                 "JSON or YAML with the flags' keys, or a Hugging Face / ms-swift / LLaMA-Factory config (flags "
                 "override it)");
  app.add_option("--model_name_or_path,--model", a.model_name_or_path, "Hugging Face model directory")
      ->required(required);
  app.add_option("--train_file,--dataset", a.train_file, "training data, a local JSONL file")->required(required);
  app.add_option("--eval_file,--val_dataset,--eval_dataset", a.eval_file, "evaluation data, a local JSONL file");
  app.add_option("--output_dir", a.output_dir, "where checkpoints, logs and the result go")->required(required);
  app.add_option("--tokenizer", a.tokenizer, "tokenizer directory (default: the model directory)");
  add_backend_option(app, a.backend);
  app.add_option("--per_device_train_batch_size", a.per_device_train_batch_size)->capture_default_str();
  app.add_option("--per_device_eval_batch_size", a.per_device_eval_batch_size)->capture_default_str();
  app.add_option("--gradient_accumulation_steps", a.gradient_accumulation_steps)->capture_default_str();
  app.add_option("--eval_accumulation_steps", a.eval_accumulation_steps,
                 "accepted for compatibility; evaluation never accumulates logits");
  app.add_option("--num_train_epochs", a.num_train_epochs)->capture_default_str();
  app.add_option("--max_steps", a.max_steps, "overrides num_train_epochs when > 0")->capture_default_str();
  app.add_option("--learning_rate", a.learning_rate)->capture_default_str();
  app.add_option("--weight_decay", a.weight_decay)->capture_default_str();
  app.add_option("--adam_beta1", a.adam_beta1)->capture_default_str();
  app.add_option("--adam_beta2", a.adam_beta2)->capture_default_str();
  app.add_option("--adam_epsilon", a.adam_epsilon)->capture_default_str();
  app.add_option("--max_grad_norm", a.max_grad_norm)->capture_default_str();
  app.add_option("--lr_scheduler_type", a.lr_scheduler_type,
                 "linear | cosine | cosine_with_min_lr | constant | constant_with_warmup")
      ->capture_default_str();
  app.add_option("--min_lr_rate", a.min_lr_rate, "cosine_with_min_lr floor, as a fraction of learning_rate");
  app.add_option("--warmup_steps", a.warmup_steps)->capture_default_str();
  app.add_option("--warmup_ratio", a.warmup_ratio)->capture_default_str();
  app.add_option("--label_smoothing_factor", a.label_smoothing_factor)->capture_default_str();
  app.add_option("--eval_strategy,--evaluation_strategy", a.eval_strategy, "no | steps | epoch")->capture_default_str();
  app.add_option("--eval_steps", a.eval_steps, "evaluate every N steps (default: logging_steps)");
  app.add_option("--metrics", a.metrics,
                 "evaluation metrics: eval_loss, perplexity, token_accuracy, top{k}_accuracy; label_accuracy, "
                 "macro_f1 (text+label data); with --predict_with_generate also exact_match, label_accuracy_generated")
      ->capture_default_str();
  app.add_flag("--predict_with_generate", a.predict_with_generate,
               "evaluation also generates each example's answer greedily (metrics exact_match, "
               "label_accuracy_generated)");
  app.add_option("--max_new_tokens", a.max_new_tokens,
                 "with --predict_with_generate: tokens generated per example (default: the longest answer + 8)");
  app.add_flag("--load_best_model_at_end", a.load_best_model_at_end, "finish with the best checkpoint's weights");
  app.add_option("--metric_for_best_model", a.metric_for_best_model)->capture_default_str();
  app.add_option("--greater_is_better", a.greater_is_better, "default: false for losses, true otherwise");
  app.add_option("--logging_steps", a.logging_steps)->capture_default_str();
  app.add_option("--report_to", a.report_to,
                 "integrations that also receive the logs, Hugging Face's names: tensorboard (event files in "
                 "--logging_dir), all (= tensorboard), none (the default); wandb, mlflow and Hugging Face's other "
                 "integrations are accepted and not written")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->delimiter(',');
  app.add_option("--logging_dir", a.logging_dir,
                 "where --report_to tensorboard writes event files (default: output_dir/runs/<Mon><DD>_<HH>-<MM>-<SS>_"
                 "<hostname>, as Hugging Face)");
  app.add_option("--save_strategy", a.save_strategy, "steps | epoch | no")->capture_default_str();
  app.add_option("--save_steps", a.save_steps)->capture_default_str();
  app.add_option("--save_total_limit", a.save_total_limit, "keep at most this many checkpoints (0: all)");
  add_max_shard_size_option(app, a.max_shard_size);
  app.add_option("--resume_from_checkpoint", a.resume_from_checkpoint, "a checkpoint directory, or \"last\"");
  app.add_flag("--overwrite_output_dir", a.overwrite_output_dir,
               "replace the outputs of an earlier run in --output_dir (checkpoints, model or adapter, logs), removed "
               "once this run has passed its checks; without it such a directory is refused unless resuming");
  app.add_flag("--ignore_data_mismatch", a.ignore_data_mismatch,
               "resume although the training file differs from the one the checkpoint was trained on");
  app.add_option("--seed", a.seed)->capture_default_str();
  app.add_option("--data_seed", a.data_seed, "seed of the data order (default: seed)");
  // What these say is what describe_arithmetic (model/decoder_plan.h) prints on the run's
  // arithmetic: line; PlanCommand.DtypeFlagsHelpSaysTheArithmeticTheRunPrints holds them to it.
  app.add_option("--torch_dtype", a.torch_dtype,
                 "storage dtype of the base weights: float32 | bfloat16 | float16 (default: the checkpoint's); the "
                 "arithmetic stays float32 (16-bit storage, widened as it is read), float16 storage trains with "
                 "dynamic loss scaling, and only --bf16 and --fp16 take 16-bit products");
  app.add_flag("--bf16", a.bf16,
               "mixed precision, as Hugging Face's --bf16: the weights are stored in bfloat16 and, where the backend "
               "has bfloat16 products (cpu: oneDNN's AVX512-BF16 or AMX kernels; reference), the linear layers' and "
               "the LM head's products take bfloat16 operands with float32 accumulation; norms, attention, softmax, "
               "losses, gradients, master weights and AdamW stay float32. Where the backend has no bfloat16 products "
               "(vulkan, other CPUs) or the weights are quantized: float32, not mixed precision, over the bfloat16 "
               "weights. train and plan print which on their arithmetic: line");
  app.add_flag("--fp16", a.fp16,
               "mixed precision, as Hugging Face's --fp16: the weights are stored in float16, training runs with "
               "dynamic loss scaling, and where the backend has float16 products (vulkan: cooperative matrices, "
               "where the device has them; cpu: oneDNN's AVX512-FP16 or AMX-FP16 kernels; reference) the linear "
               "layers' and the LM head's products take float16 operands with float32 accumulation (on vulkan's "
               "cooperative matrices attention's products too). Where it has none: float32, not mixed precision, "
               "over the float16 weights");
  app.add_flag("--gradient_checkpointing,--use_gradient_checkpointing", a.gradient_checkpointing,
               "keep layer inputs only, recompute in backward");
  app.add_option("--zero_stage", a.zero_stage,
                 "1: shard the AdamW state (and float32 masters) over the data-parallel ranks (ZeRO-1); 0: replicate")
      ->capture_default_str()
      ->check(CLI::Range(0, 1));
  app.add_flag("--optim_offload", a.optim_offload,
               "keep AdamW moments and float32 master weights in host memory; the optimizer step runs on the host");
  app.add_option("--loss_workspace_bytes", a.loss_workspace_bytes, "budget of the LM head's logits chunk")
      ->capture_default_str();
  app.add_option("--host_memory", a.host_memory,
                 "budget for the whole process (e.g. 16GiB): refuse to start when the prediction is above it");
  app.add_option("--tuner_type,--train_type,--sft_type,--finetuning_type", a.tuner_type, "lora | full")
      ->capture_default_str();
  app.add_option("--adapter_name_or_path,--adapter,--adapters", a.adapter,
                 "go on training this PEFT LoRA adapter (memtune's or PEFT's): its adapter_config.json sets rank, "
                 "alpha, dropout and targets, its weights replace the new adapter's initialization; the optimizer "
                 "starts fresh (--resume_from_checkpoint continues a memtune run with its optimizer)");
  app.add_option("--lora_rank", a.lora_rank)->capture_default_str();
  app.add_option("--lora_alpha", a.lora_alpha)->capture_default_str();
  app.add_option("--lora_dropout", a.lora_dropout)->capture_default_str();
  // ms-swift's and LLaMA-Factory's "all" / "ALL" mean every linear layer.
  app.add_option("--target_modules,--lora_target_modules,--lora_target", a.target_modules,
                 "module names or all-linear (all)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->delimiter(',')
      ->transform([](std::string name) { return name == "all" || name == "ALL" ? std::string("all-linear") : name; });
  app.add_flag("--use_rslora", a.use_rslora, "scale adapters by alpha/sqrt(r)");
  app.add_option("--max_length,--cutoff_len", a.max_length)->capture_default_str();
  app.add_flag("--ignore_max_position_embeddings", a.ignore_max_position_embeddings,
               "allow --max_length above the model's max_position_embeddings");
  app.add_option("--truncation_strategy", a.truncation_strategy, "delete | left | right")->capture_default_str();
  app.add_flag("--packing", a.packing, "pack several examples into rows of max_length");
  app.add_flag("--train_on_prompt", a.train_on_prompt, "take the loss on prompt tokens too");
  add_template_option(app, a.template_name);
  app.add_option("--system", a.system, "system message for records without one");
  app.add_flag("--skip_bad_lines", a.skip_bad_lines, "skip malformed dataset lines (counted) instead of stopping");
}

void add_template_option(CLI::App& app, std::string& name) {
  // LLaMA-Factory calls Qwen2.5's template "qwen".
  app.add_option("--template", name,
                 "qwen2_5 | chatml | plain | qwen3 | llama3 (default: from the tokenizer); qwen: qwen2_5")
      ->transform([](std::string t) { return t == "qwen" ? std::string("qwen2_5") : t; });
}

void refuse_non_finite_numbers(CLI::App& app) {
  const CLI::Validator finite(
      [](std::string& text) {
        char* end = nullptr;
        const double value = std::strtod(text.c_str(), &end);
        return end != text.c_str() && !std::isfinite(value) ? "expected a finite number, got " + text : std::string();
      },
      "");
  for (CLI::Option* option : app.get_options())
    if (option->get_type_name().find("FLOAT") != std::string::npos) option->check(finite);
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) refuse_non_finite_numbers(*sub);
}

void check_local_dataset(const std::string& path, const char* flags) {
  if (path.empty() || std::filesystem::exists(path)) return;
  throw Error(
      fmt::format("{} {}: no such file; memtune reads local JSONL files (a dataset name from the Hugging "
                  "Face or ModelScope hub, or a LLaMA-Factory dataset_info.json name, is not downloaded: "
                  "give the path of a JSONL file)",
                  flags, path));
}

namespace {

// Hugging Face's reporting integrations (transformers' INTEGRATION_TO_CALLBACK) but tensorboard.
constexpr std::string_view kIntegrationsNotWritten[] = {"azure_ml", "clearml", "codecarbon", "comet_ml",
                                                        "dagshub", "dvclive", "flyte", "mlflow",
                                                        "neptune", "swanlab", "wandb"};

}  // namespace

ReportTo parse_report_to(const std::vector<std::string>& names) {
  ReportTo out;
  for (const std::string& name : names)
    if (!name.empty()) out.names.push_back(name);  // `report_to: []` in a config file is no name
  for (const std::string& name : out.names) {
    if (name == "none" || name == "all") {
      if (out.names.size() > 1)
        throw Error(fmt::format("--report_to {}: {} stands alone, not beside other names", fmt::join(out.names, " "),
                                name));
      out.tensorboard = name == "all";  // every integration memtune has
    } else if (name == "tensorboard") {
      out.tensorboard = true;
    } else if (std::find(std::begin(kIntegrationsNotWritten), std::end(kIntegrationsNotWritten), name) !=
               std::end(kIntegrationsNotWritten)) {
      if (std::find(out.not_written.begin(), out.not_written.end(), name) == out.not_written.end())
        out.not_written.push_back(name);
    } else {
      throw Error(fmt::format(
          "--report_to {}: not a reporting integration; valid: none, all, tensorboard (written), or Hugging Face's {} "
          "(accepted, not written)",
          name, fmt::join(kIntegrationsNotWritten, ", ")));
    }
  }
  return out;
}

std::string report_to_note(const ReportTo& r) {
  if (r.not_written.empty()) return "";
  return fmt::format("memtune: note: --report_to {}: memtune writes tensorboard event files only; {} {} not written",
                     fmt::join(r.names, " "), fmt::join(r.not_written, ", "), r.not_written.size() == 1 ? "is" : "are");
}

void validate_training_arguments(const TrainingArguments& a) {
  parse_report_to(a.report_to);
  auto positive = [](int64_t v, const char* name) {
    if (v <= 0) throw Error(fmt::format("--{} must be positive, got {}", name, v));
  };
  check_local_dataset(a.train_file, "--train_file (--dataset)");
  check_local_dataset(a.eval_file, "--eval_file (--val_dataset)");
  positive(a.per_device_train_batch_size, "per_device_train_batch_size");
  positive(a.per_device_eval_batch_size, "per_device_eval_batch_size");
  positive(a.gradient_accumulation_steps, "gradient_accumulation_steps");
  positive(a.max_length, "max_length");
  positive(a.logging_steps, "logging_steps");
  if (a.max_steps == 0 || a.max_steps < -1)
    throw Error(fmt::format("--max_steps must be positive, or -1 (train --num_train_epochs), got {}", a.max_steps));
  if (a.num_train_epochs < 0) throw Error(fmt::format("--num_train_epochs must not be negative, got {}", a.num_train_epochs));
  if (a.max_steps < 0 && a.num_train_epochs == 0)
    throw Error("nothing to train: --num_train_epochs is 0 and --max_steps is not set");
  auto not_negative = [](double v, const char* name) {
    if (v < 0) throw Error(fmt::format("--{} must not be negative, got {}", name, v));
  };
  not_negative(a.learning_rate, "learning_rate");
  not_negative(a.weight_decay, "weight_decay");
  not_negative(a.adam_epsilon, "adam_epsilon");
  not_negative(static_cast<double>(a.warmup_steps), "warmup_steps");
  not_negative(static_cast<double>(a.save_total_limit), "save_total_limit");
  not_negative(static_cast<double>(a.eval_steps), "eval_steps");
  for (const auto& [beta, name] : {std::pair{a.adam_beta1, "adam_beta1"}, std::pair{a.adam_beta2, "adam_beta2"}})
    if (beta < 0 || beta >= 1) throw Error(fmt::format("--{} must be in [0, 1), got {}", name, beta));
  if (a.bf16 && a.fp16) throw Error("--bf16 and --fp16 are mutually exclusive");
  if (a.tuner_type != "lora" && a.tuner_type != "full")
    throw Error(
        fmt::format("--tuner_type (--train_type, --sft_type, --finetuning_type) must be lora or full, got "
                    "\"{}\"; memtune trains LoRA adapters or every weight, not {}",
                    a.tuner_type, a.tuner_type == "freeze" ? "frozen layers (freeze)" : "that method"));
  if (a.tuner_type == "lora" && a.lora_rank <= 0) throw Error("--lora_rank must be positive with --tuner_type lora");
  if (a.tuner_type == "lora" && a.lora_alpha <= 0) throw Error("--lora_alpha must be positive with --tuner_type lora");
  if (a.lora_dropout < 0 || a.lora_dropout >= 1) throw Error("--lora_dropout must be in [0, 1)");
  if (!a.adapter.empty() && a.tuner_type != "lora")
    throw Error(fmt::format("--adapter {} goes on training a LoRA adapter: it needs --tuner_type lora, got {}",
                            a.adapter, a.tuner_type));
  parse_bytes(a.max_shard_size, "--max_shard_size");
  if (a.save_strategy != "steps" && a.save_strategy != "epoch" && a.save_strategy != "no")
    throw Error(fmt::format("--save_strategy must be steps, epoch or no, got \"{}\"", a.save_strategy));
  if (a.save_strategy == "steps") positive(a.save_steps, "save_steps");
  if (a.warmup_ratio < 0 || a.warmup_ratio >= 1) throw Error("--warmup_ratio must be in [0, 1)");
  if (a.eval_strategy != "no" && a.eval_strategy != "steps" && a.eval_strategy != "epoch")
    throw Error(fmt::format("--eval_strategy must be no, steps or epoch, got \"{}\"", a.eval_strategy));
  if (a.eval_strategy != "no" && a.eval_file.empty())
    throw Error(fmt::format("--eval_strategy {} needs --eval_file", a.eval_strategy));
  if (a.load_best_model_at_end) {
    if (a.eval_strategy == "no") throw Error("--load_best_model_at_end needs --eval_strategy steps or epoch");
    if (a.save_strategy != a.eval_strategy)
      throw Error(fmt::format("--load_best_model_at_end needs save_strategy == eval_strategy (got {} and {})",
                              a.save_strategy, a.eval_strategy));
    const int64_t eval_every = a.eval_steps > 0 ? a.eval_steps : a.logging_steps;
    if (a.save_strategy == "steps" && a.save_steps % eval_every != 0)
      throw Error(fmt::format("--load_best_model_at_end needs save_steps ({}) to be a multiple of eval_steps ({})",
                              a.save_steps, eval_every));
  }
  if (a.label_smoothing_factor < 0 || a.label_smoothing_factor >= 1)
    throw Error("--label_smoothing_factor must be in [0, 1)");
  if (a.min_lr_rate != 0 && a.lr_scheduler_type != "cosine_with_min_lr")
    throw Error(fmt::format("--min_lr_rate {} has no effect with --lr_scheduler_type {}: use cosine_with_min_lr",
                            a.min_lr_rate, a.lr_scheduler_type));
  if (a.loss_workspace_bytes <= 0) throw Error("--loss_workspace_bytes must be positive");
}

}  // namespace memtune
