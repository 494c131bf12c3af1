#include "train/arguments.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_reader.h"

namespace memtune {

void add_training_arguments(CLI::App& app, TrainingArguments& a, ArgumentsFor use) {
  const bool required = use == ArgumentsFor::Train;
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--config", "run.json or run.yaml with the same keys as the flags (flags override it)");
  app.add_option("--model_name_or_path,--model", a.model_name_or_path, "Hugging Face model directory")
      ->required(required);
  app.add_option("--train_file", a.train_file, "training data, JSONL")->required(required);
  app.add_option("--eval_file", a.eval_file, "evaluation data, JSONL");
  app.add_option("--output_dir", a.output_dir, "where checkpoints, logs and the result go")->required(required);
  app.add_option("--tokenizer", a.tokenizer, "tokenizer directory (default: the model directory)");
  app.add_option("--backend", a.backend,
                 "where the model's memory lives and its ops run: cpu | reference (the slow "
                 "float64 oracle)")
      ->capture_default_str();
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
  app.add_option("--eval_strategy", a.eval_strategy, "no | steps | epoch")->capture_default_str();
  app.add_option("--eval_steps", a.eval_steps, "evaluate every N steps (default: logging_steps)");
  app.add_option("--metrics", a.metrics, "evaluation metrics: eval_loss, perplexity, token_accuracy, top{k}_accuracy")
      ->capture_default_str();
  app.add_flag("--load_best_model_at_end", a.load_best_model_at_end, "finish with the best checkpoint's weights");
  app.add_option("--metric_for_best_model", a.metric_for_best_model)->capture_default_str();
  app.add_option("--greater_is_better", a.greater_is_better, "default: false for losses, true otherwise");
  app.add_option("--logging_steps", a.logging_steps)->capture_default_str();
  app.add_option("--save_strategy", a.save_strategy, "steps | epoch | no")->capture_default_str();
  app.add_option("--save_steps", a.save_steps)->capture_default_str();
  app.add_option("--save_total_limit", a.save_total_limit, "keep at most this many checkpoints (0: all)");
  app.add_option("--resume_from_checkpoint", a.resume_from_checkpoint, "a checkpoint directory, or \"last\"");
  app.add_option("--seed", a.seed)->capture_default_str();
  app.add_option("--data_seed", a.data_seed, "seed of the data order (default: seed)");
  app.add_option("--torch_dtype", a.torch_dtype, "storage dtype of the base weights: float32 | bfloat16 | float16");
  app.add_flag("--bf16", a.bf16, "store weights in bfloat16 (compute stays float32)");
  app.add_flag("--fp16", a.fp16, "store weights in float16 (with dynamic loss scaling)");
  app.add_flag("--gradient_checkpointing", a.gradient_checkpointing, "keep layer inputs only, recompute in backward");
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
  app.add_option("--tuner_type", a.tuner_type, "lora | full")->capture_default_str();
  app.add_option("--lora_rank", a.lora_rank)->capture_default_str();
  app.add_option("--lora_alpha", a.lora_alpha)->capture_default_str();
  app.add_option("--lora_dropout", a.lora_dropout)->capture_default_str();
  app.add_option("--target_modules", a.target_modules, "module names or all-linear")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->delimiter(',');
  app.add_flag("--use_rslora", a.use_rslora, "scale adapters by alpha/sqrt(r)");
  app.add_option("--max_length", a.max_length)->capture_default_str();
  app.add_option("--truncation_strategy", a.truncation_strategy, "delete | left | right")->capture_default_str();
  app.add_flag("--packing", a.packing, "pack several examples into rows of max_length");
  app.add_flag("--train_on_prompt", a.train_on_prompt, "take the loss on prompt tokens too");
  app.add_option("--template", a.template_name, "qwen2_5 | chatml | plain (default: from the tokenizer)");
  app.add_option("--system", a.system, "system message for records without one");
  app.add_flag("--skip_bad_lines", a.skip_bad_lines, "skip malformed dataset lines (counted) instead of stopping");
}

namespace {

std::string value_text(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_array()) {
    std::string out;
    for (const auto& x : v) out += (out.empty() ? "" : ",") + value_text(x);
    return out;
  }
  return v.dump();
}

// A YAML file of flat `key: value` lines (comments and blank lines ignored).
nlohmann::json parse_flat_yaml(const std::string& text, const std::string& path) {
  nlohmann::json doc = nlohmann::json::object();
  std::istringstream in(text);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (const auto hash = line.find(" #"); hash != std::string::npos) line.erase(hash);
    const auto first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#') continue;
    const auto colon = line.find(':');
    if (first != 0 || colon == std::string::npos)
      throw Error(fmt::format("{}:{}: expected a flat `key: value` line", path, n));
    std::string key = line.substr(0, colon), value = line.substr(colon + 1);
    value.erase(0, value.find_first_not_of(" \t"));
    value.erase(value.find_last_not_of(" \t\r") + 1);
    if (value.size() >= 2 && (value.front() == '"' || value.front() == '\'') && value.back() == value.front())
      value = value.substr(1, value.size() - 2);
    doc[key] = value;
  }
  return doc;
}

}  // namespace

std::vector<std::string> expand_config_file(const std::vector<std::string>& argv) {
  std::vector<std::string> before, rest;  // the file's flags; the command line without --config
  std::string path;
  for (size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == "--config" && i + 1 < argv.size()) {
      path = argv[++i];
    } else if (argv[i].starts_with("--config=")) {
      path = argv[i].substr(9);
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (path.empty()) return argv;
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("--config {}: cannot open file", path));
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  nlohmann::json doc;
  if (path.ends_with(".json")) {
    doc = parse_json(text, path);
    if (!doc.is_object()) throw Error(fmt::format("{}: expected a JSON object of argument names", path));
  } else {
    doc = parse_flat_yaml(text, path);
  }
  for (const auto& [key, value] : doc.items()) before.push_back(fmt::format("--{}={}", key, value_text(value)));
  // After the subcommand name, before the command line's own flags.
  auto at = std::find_if(rest.begin(), rest.end(), [](const std::string& a) { return !a.starts_with("-"); });
  if (at != rest.end()) ++at;
  rest.insert(at, before.begin(), before.end());
  return rest;
}

void validate_training_arguments(const TrainingArguments& a) {
  auto positive = [](int64_t v, const char* name) {
    if (v <= 0) throw Error(fmt::format("--{} must be positive, got {}", name, v));
  };
  positive(a.per_device_train_batch_size, "per_device_train_batch_size");
  positive(a.per_device_eval_batch_size, "per_device_eval_batch_size");
  positive(a.gradient_accumulation_steps, "gradient_accumulation_steps");
  positive(a.max_length, "max_length");
  positive(a.logging_steps, "logging_steps");
  if (a.max_steps <= 0 && a.num_train_epochs <= 0)
    throw Error("nothing to train: --max_steps and --num_train_epochs are both <= 0");
  if (a.bf16 && a.fp16) throw Error("--bf16 and --fp16 are mutually exclusive");
  if (a.tuner_type != "lora" && a.tuner_type != "full")
    throw Error(fmt::format("--tuner_type must be lora or full, got \"{}\"", a.tuner_type));
  if (a.tuner_type == "lora" && a.lora_rank <= 0) throw Error("--lora_rank must be positive with --tuner_type lora");
  if (a.lora_dropout < 0 || a.lora_dropout >= 1) throw Error("--lora_dropout must be in [0, 1)");
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
  if (a.loss_workspace_bytes <= 0) throw Error("--loss_workspace_bytes must be positive");
}

}  // namespace memtune
