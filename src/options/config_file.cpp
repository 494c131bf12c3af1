#include "options/config_file.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string_view>

#include "core/error.h"
#include "core/json_reader.h"
#include "options/arguments.h"

namespace memtune {

namespace {

using nlohmann::json;

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Keys that do not change what a run computes: logging, hubs, dataloader workers, caches,
// distributed-launcher settings. Their values are not read (nested ones included).
const std::set<std::string, std::less<>>& ignored_keys() {
  static const std::set<std::string, std::less<>> keys = {
      // Hugging Face TrainingArguments
      "do_train", "do_eval", "do_predict", "prediction_loss_only", "torch_empty_cache_steps",
      "log_level", "log_level_replica", "log_on_each_node", "logging_strategy", "logging_first_step",
      "logging_nan_inf_filter", "save_safetensors", "save_on_each_node", "save_only_model",
      "restore_callback_states_from_checkpoint", "no_cuda", "use_cpu", "use_mps_device", "jit_mode_eval", "use_ipex",
      "fp16_opt_level", "half_precision_backend", "bf16_full_eval", "fp16_full_eval", "tf32", "local_rank",
      "ddp_backend", "tpu_num_cores", "tpu_metrics_debug", "debug", "dataloader_num_workers",
      "dataloader_prefetch_factor", "past_index", "run_name", "disable_tqdm", "remove_unused_columns", "label_names",
      "ignore_data_skip", "accelerator_config", "fsdp_config", "length_column_name",
      "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "dataloader_pin_memory",
      "dataloader_persistent_workers", "skip_memory_metrics", "use_legacy_prediction_loop", "push_to_hub",
      "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push", "hub_revision",
      "gradient_checkpointing_kwargs", "include_inputs_for_metrics", "include_for_metrics", "eval_do_concat_batches",
      "fp16_backend", "push_to_hub_model_id", "push_to_hub_organization", "push_to_hub_token", "mp_parameters",
      "full_determinism", "ray_scope", "ddp_timeout", "dispatch_batches", "split_batches", "include_tokens_per_second",
      "include_num_input_tokens_seen", "eval_on_start", "use_liger_kernel", "eval_use_gather_object",
      "average_tokens_across_devices", "batch_eval_metrics",
      // ms-swift
      "model_type", "model_revision", "attn_impl", "device_map", "max_memory", "template_backend", "dataset_num_proc",
      "streaming", "enable_cache", "download_mode", "strict", "model_name", "model_author", "use_hf", "tuner_backend",
      "add_version", "check_model", "create_checkpoint_symlink", "lazy_tokenize", "use_chat_template", "freeze_vit",
      "freeze_aligner", "max_pixels", "acc_strategy", "ignore_args_error", "temperature", "top_k",
      "top_p", "repetition_penalty", "num_beams", "stream",
      // LLaMA-Factory
      "trust_remote_code", "preprocessing_num_workers", "overwrite_cache", "plot_loss", "flash_attn", "use_unsloth",
      "enable_liger_kernel", "dataset_dir", "print_param_status", "compute_accuracy", "disable_gradient_checkpointing",
      "upcast_layernorm", "upcast_lmhead_output", "low_cpu_mem_usage", "mix_strategy", "buffer_size",
      "freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules"};
  return keys;
}

// Keys whose value may ask for something memtune does not do. Inactive values (null, false,
// 0, "", "none", an empty list or mapping, and the listed ones) are accepted and ignored; any
// other value stops with `instead`.
struct RefusedKey {
  std::vector<std::string_view> also_inactive;
  std::string_view instead;
};
const std::map<std::string, RefusedKey, std::less<>>& refused_keys() {
  static const std::string_view kDeepSpeed =
      "memtune shards and offloads by itself: --zero_stage 1 shards the AdamW state over data-parallel ranks, "
      "--optim_offload keeps it in host memory, and `mpirun -np N memtune train ...` runs N ranks";
  static const std::string_view kFsdp =
      "memtune's data parallelism is `mpirun -np N memtune train ...` with --zero_stage 1 for a sharded optimizer "
      "state";
  static const std::string_view kCompile = "memtune's kernels are compiled C++ already: drop the key";
  static const std::string_view kOptimizer =
      "memtune's optimizer is AdamW (adamw_torch); to shrink its state use --optim_offload or --zero_stage 1";
  static const std::string_view kQuantized =
      "memtune trains unquantized weights: --torch_dtype bfloat16 (or --bf16) halves their memory";
  static const std::string_view kHoldOut = "hold the evaluation lines out yourself and pass them as --eval_file FILE";
  static const std::string_view kTunerType = "memtune trains LoRA adapters or everything: --tuner_type lora | full";
  static const std::string_view kNoLora = "memtune's LoRA is plain LoRA (--lora_rank, --lora_alpha, --use_rslora)";
  static const std::map<std::string, RefusedKey, std::less<>> keys = {
      // Hugging Face TrainingArguments
      {"deepspeed", {{}, kDeepSpeed}},
      {"fsdp", {{}, kFsdp}},
      {"fsdp_min_num_params", {{}, kFsdp}},
      {"fsdp_transformer_layer_cls_to_wrap", {{}, kFsdp}},
      {"tp_size", {{"1"}, "memtune's parallelism is data parallel: `mpirun -np N memtune train ...`"}},
      {"torch_compile", {{}, kCompile}},
      {"torch_compile_backend", {{}, kCompile}},
      {"torch_compile_mode", {{}, kCompile}},
      {"torchdynamo", {{}, kCompile}},
      {"adafactor", {{}, kOptimizer}},
      {"optim", {{"adamw_torch", "adamw_hf", "adamw_torch_fused"}, kOptimizer}},
      {"optim_args", {{}, kOptimizer}},
      {"optim_target_modules", {{}, kOptimizer}},
      {"optimizer", {{}, kOptimizer}},
      {"per_gpu_train_batch_size", {{}, "use --per_device_train_batch_size"}},
      {"per_gpu_eval_batch_size", {{}, "use --per_device_eval_batch_size"}},
      {"auto_find_batch_size", {{}, "`memtune plan --fit` finds the batch size that fits before the run"}},
      {"neftune_noise_alpha", {{}, "memtune has no NEFTune embedding noise: drop the key"}},
      {"group_by_length", {{}, "memtune batches in the data_seed order: drop the key"}},
      {"dataloader_drop_last", {{}, "memtune trains on the last, partial batch too: drop the key"}},
      {"eval_delay", {{}, "memtune evaluates from the first eval step: drop the key"}},
      {"lr_scheduler_kwargs", {{}, "memtune reads only {\"min_lr_rate\": x} there (--min_lr_rate)"}},
      // ms-swift
      {"task_type", {{"causal_lm"}, "memtune fine-tunes causal language models (task_type causal_lm)"}},
      {"quant_method", {{}, kQuantized}},
      {"quant_bits", {{}, kQuantized}},
      {"split_dataset_ratio", {{}, kHoldOut}},
      {"sequence_parallel_size", {{"1"}, "memtune's parallelism is data parallel: `mpirun -np N memtune train ...`"}},
      {"use_dora", {{}, kNoLora}},
      {"lora_bias", {{}, kNoLora}},
      {"lora_dtype", {{}, kNoLora}},
      {"lorap_lr_ratio", {{}, kNoLora}},
      {"target_regex", {{}, "name the modules with --target_modules (q_proj, ..., all-linear)"}},
      {"modules_to_save", {{}, kNoLora}},
      {"freeze_parameters", {{}, kTunerType}},
      {"trainable_parameters", {{}, kTunerType}},
      {"loss_scale", {{"default"}, "the loss is on assistant tokens; --train_on_prompt adds the prompt tokens"}},
      {"resume_only_model", {{}, "use --resume_from_checkpoint DIR (model and optimizer state)"}},
      {"rope_scaling", {{}, "memtune reads rope scaling from the model's config.json only"}},
      // LLaMA-Factory
      {"stage", {{"sft"}, "memtune does supervised fine-tuning (stage: sft)"}},
      {"quantization_bit", {{}, kQuantized}},
      {"quantization_method", {{"bitsandbytes", "bnb"}, kQuantized}},
      {"val_size", {{}, kHoldOut}},
      {"max_samples", {{}, "cut the JSONL file to the lines you want"}},
      {"neat_packing", {{}, "use --packing"}},
      {"pissa_init", {{}, kNoLora}},
      {"loraplus_lr_ratio", {{}, kNoLora}},
      {"additional_target", {{}, kNoLora}},
      {"create_new_adapter", {{}, kNoLora}},
      {"mask_history", {{}, "the loss is on every assistant turn; drop the key"}},
      {"tokenized_path", {{}, "memtune tokenizes the JSONL file itself: pass it as --train_file"}},
  };
  return keys;
}

// The value as flag text: strings as written, lists comma-joined, integral numbers without ".0".
std::string value_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_null()) return "";
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::abs(d) < 1e15 && d == static_cast<double>(static_cast<int64_t>(d)))  // range first: the cast of a larger one is UB
      return std::to_string(static_cast<int64_t>(d));
  }
  if (v.is_array()) {
    std::string out;
    for (const auto& x : v) out += (out.empty() ? "" : ",") + value_text(x);
    return out;
  }
  return v.dump();
}

std::optional<double> as_number(const std::string& text) {
  double d = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), d);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) return std::nullopt;
  return d;
}

bool is_inactive(const json& v, const RefusedKey& rule) {
  if (v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_structured() && v.empty())) return true;
  if (v.is_structured()) return false;
  const std::string text = lower(value_text(v));
  if (text.empty() || text == "false" || text == "none" || text == "null" || text == "no") return true;
  const auto number = as_number(text);
  if (number && *number == 0) return true;
  for (const auto inactive : rule.also_inactive) {
    if (text == inactive) return true;
    const auto other = as_number(std::string(inactive));
    if (number && other && *number == *other) return true;
  }
  return false;
}

// Hugging Face's boolean words (transformers' string_to_bool), for `--flag VALUE`.
std::optional<bool> boolean_word(const std::string& word) {
  const std::string w = lower(word);
  if (w == "true" || w == "yes" || w == "t" || w == "y" || w == "1") return true;
  if (w == "false" || w == "no" || w == "f" || w == "n" || w == "0") return false;
  return std::nullopt;
}

// A YAML plain scalar as JSON: YAML's booleans and nulls; anything else stays the text written
// (numbers too: they become flag text again, exactly as the user wrote them).
json plain_scalar(const std::string& text) {
  if (text == "true" || text == "True" || text == "TRUE") return true;
  if (text == "false" || text == "False" || text == "FALSE") return false;
  if (text.empty() || text == "~" || text == "null" || text == "Null" || text == "NULL") return nullptr;
  return text;
}

json yaml_to_json(const YAML::Node& node, const std::string& name, int depth) {
  if (depth > 32) throw Error(fmt::format("{}:{}: nested deeper than 32 levels", name, node.Mark().line + 1));
  switch (node.Type()) {
    case YAML::NodeType::Scalar:
      return node.Tag() == "!" ? json(node.Scalar()) : plain_scalar(node.Scalar());
    case YAML::NodeType::Sequence: {
      json out = json::array();
      for (const auto& item : node) out.push_back(yaml_to_json(item, name, depth + 1));
      return out;
    }
    case YAML::NodeType::Map: {
      json out = json::object();
      for (const auto& item : node) {
        if (!item.first.IsScalar())
          throw Error(fmt::format("{}:{}: a key must be a plain name", name, item.first.Mark().line + 1));
        out[item.first.Scalar()] = yaml_to_json(item.second, name, depth + 1);
      }
      return out;
    }
    default:
      return nullptr;
  }
}

ConfigEntries parse_yaml(const std::string& text, const std::string& name) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw Error(fmt::format("{}:{}: invalid YAML: {}", name, e.mark.line + 1, e.msg));
  }
  ConfigEntries out;
  if (root.IsNull()) return out;
  if (!root.IsMap()) throw Error(fmt::format("{}: expected a mapping of argument names (`key: value` lines)", name));
  std::set<std::string> seen;
  try {
    for (const auto& item : root) {
      const int line = item.first.Mark().line + 1;
      if (!item.first.IsScalar()) throw Error(fmt::format("{}:{}: a key must be a plain name", name, line));
      const std::string key = item.first.Scalar();
      if (!seen.insert(key).second) throw Error(fmt::format("{}:{}: key \"{}\" given twice", name, line, key));
      out.emplace_back(key, yaml_to_json(item.second, name, 1));
    }
  } catch (const YAML::Exception& e) {
    throw Error(fmt::format("{}:{}: invalid YAML: {}", name, e.mark.line + 1, e.msg));
  }
  return out;
}

}  // namespace

ConfigEntries parse_config_text(const std::string& text, const std::string& name) {
  const auto first = text.find_first_not_of(" \t\r\n");
  if (name.ends_with(".json") || (first != std::string::npos && text[first] == '{')) {
    json doc;
    try {
      doc = parse_json(text, name);
    } catch (const json::exception& e) {  // e.g. a number that overflows a double: 1e400
      throw Error(fmt::format("{}: invalid JSON: {}", name, json_error_text(e)));
    }
    if (!doc.is_object()) throw Error(fmt::format("{}: expected a JSON object of argument names", name));
    ConfigEntries out;
    for (const auto& [key, value] : doc.items()) out.emplace_back(key, value);
    return out;
  }
  return parse_yaml(text, name);
}

ConfigEntries read_config_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("--config {}: cannot open file", path));
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  return parse_config_text(text, path);
}

std::string ignored_keys_notice(const std::vector<std::string>& ignored) {
  if (ignored.empty()) return "";
  std::string list;
  for (const auto& key : ignored) list += (list.empty() ? "" : ", ") + key;
  return fmt::format("memtune: note: accepted and ignored (no effect on the result): {}", list);
}

namespace {

// Which keys `memtune train` knows, for `memtune eval` given a training config; built once
// (only its option names are read).
const CLI::App& training_flags() {
  static const CLI::App& training = []() -> const CLI::App& {
    static CLI::App app;
    static TrainingArguments args;
    add_training_arguments(app, args, ArgumentsFor::Plan);
    return app;
  }();
  return training;
}

// prepare_arguments in its phases: the command line read (flags, --config, compatibility keys),
// the config file's keys, then the compatibility keys classified, and the arguments assembled.
class ArgumentPreparer {
 public:
  ArgumentPreparer(const CLI::App& command, bool compatible) : command_(command), compatible_(compatible) {}

  void read_command_line(const std::vector<std::string>& argv, size_t command_at) {
    for (size_t i = command_at; i < argv.size(); ++i) {
      std::string arg = argv[i];
      if (!arg.starts_with("--") || arg == "--") {
        tail_.push_back(arg);
        continue;
      }
      const size_t eq = arg.find('=');
      const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      const bool inline_value = eq != std::string::npos;
      if (compatible_ && name == "config") {
        if (inline_value) {
          config_path_ = arg.substr(eq + 1);
        } else if (i + 1 < argv.size()) {
          config_path_ = argv[++i];
        } else {
          throw Error("--config needs a file name");
        }
        continue;
      }
      if (const CLI::Option* opt = command_.get_option_no_throw("--" + name)) {
        on_command_line_.insert(opt);
        if (opt->get_items_expected_max() == 0) {  // a flag: `--flag VALUE` and `--flag=VALUE`
          std::optional<bool> value = true;
          if (inline_value) {
            value = boolean_word(arg.substr(eq + 1));
            if (value) arg = fmt::format("--{}={}", name, *value ? "true" : "false");
          } else if (i + 1 < argv.size() && boolean_word(argv[i + 1])) {
            value = boolean_word(argv[++i]);
            arg = fmt::format("--{}={}", name, *value ? "true" : "false");
          }
          if (value) remember(opt, name, *value ? "true" : "false");
        } else if (inline_value) {
          remember(opt, name, arg.substr(eq + 1));
        } else if (i + 1 < argv.size()) {
          remember(opt, name, argv[i + 1]);
          // ms-swift takes lists with spaces (--dataset a.jsonl b.jsonl); these commands take no
          // positional arguments, so a second word names what went wrong.
          if (compatible_ && opt->get_items_expected_max() == 1 && i + 2 < argv.size() && !argv[i + 2].starts_with("-"))
            throw Error(fmt::format("--{} takes one value, got \"{}\" and \"{}\"", name, argv[i + 1], argv[i + 2]));
        }
        tail_.push_back(arg);
        continue;
      }
      if (compatible_ && (ignored_keys().contains(name) || refused_keys().contains(name))) {
        // Its values: the inline one, or every word up to the next flag (these commands take no
        // positional arguments).
        json value;
        if (inline_value) {
          value = plain_scalar(arg.substr(eq + 1));
        } else {
          std::vector<std::string> words;
          while (i + 1 < argv.size() && !argv[i + 1].starts_with("--")) words.push_back(argv[++i]);
          if (words.empty())
            value = true;
          else if (words.size() == 1)
            value = plain_scalar(words[0]);
          else
            value = words;
        }
        from_command_line_.emplace_back(name, value);
        continue;
      }
      tail_.push_back(arg);  // CLI11 names it if it is unknown
    }
  }

  void read_config_file_keys() {
    if (config_path_.empty()) return;
    for (const auto& [key, value] : read_config_file(config_path_)) {
      if (key == "config")
        throw Error(fmt::format("{}: key \"config\": a config file cannot name another", config_path_));
      const CLI::Option* opt = command_.get_option_no_throw("--" + key);
      if (!opt) {
        classify(key, value, config_path_, true);  // a null there is inactive, but must be a key memtune knows
        continue;
      }
      // "Not set", as a Hugging Face dump writes unset fields: null, or [] for a list (report_to: []
      // is no integration, memtune's default).
      if (value.is_null() || (value.is_array() && value.empty())) continue;
      const std::string origin = fmt::format("{}: key \"{}\"", config_path_, key);
      if (value.is_object())
        throw Error(fmt::format("{}: expected a value or a list of values, got a mapping", origin));
      if (value.is_array()) {
        for (const auto& item : value)
          if (item.is_structured()) throw Error(fmt::format("{}: expected a list of plain values", origin));
        if (opt->get_items_expected_max() <= 1 && value.size() != 1)
          throw Error(fmt::format("{}: expected one value, got a list of {}", origin, value.size()));
      }
      std::string text = value_text(value);
      if (opt->get_items_expected_max() == 0) {
        const auto b = boolean_word(text);
        if (!b) throw Error(fmt::format("{}: expected true or false, got {}", origin, json_excerpt(value)));
        text = *b ? "true" : "false";
      }
      // The command line wins (for list options too, which would otherwise collect both).
      if (!on_command_line_.contains(opt)) from_file_.push_back(fmt::format("--{}={}", key, text));
    }
  }

  void classify_command_line_keys() {
    for (const auto& [key, value] : from_command_line_) classify(key, value, "", false);
  }

  // The subcommand's name, then the file's flags, then the command line's, which win.
  PreparedArguments finish(const std::vector<std::string>& argv, size_t command_at) {
    out_.args.assign(argv.begin(), argv.begin() + static_cast<std::ptrdiff_t>(command_at));
    out_.args.insert(out_.args.end(), from_file_.begin(), from_file_.end());
    out_.args.insert(out_.args.end(), tail_.begin(), tail_.end());
    std::sort(out_.ignored.begin(), out_.ignored.end());
    out_.ignored.erase(std::unique(out_.ignored.begin(), out_.ignored.end()), out_.ignored.end());
    return std::move(out_);
  }

 private:
  // Values of single-valued options per option, to refuse two spellings with two values.
  void remember(const CLI::Option* opt, const std::string& name, const std::string& value) {
    if (!compatible_ || opt->get_items_expected_max() > 1) return;
    auto [it, fresh] = given_.try_emplace(opt, name, value);
    if (!fresh && it->second.first != name && it->second.second != value)
      throw Error(fmt::format("--{} {} and --{} {} are the same setting with two values: give one", it->second.first,
                              it->second.second, name, value));
    it->second = {name, value};
  }

  // A key that is no flag of the command: applied (lr_scheduler_kwargs), ignored, refused when
  // active, a training key `memtune eval` skips, or unknown.
  void classify(const std::string& key, const json& value, const std::string& where, bool in_file) {
    const std::string origin = in_file ? fmt::format("{}: key \"{}\"", where, key) : "--" + key;
    if (key == "lr_scheduler_kwargs") {
      json kwargs = value;
      if (kwargs.is_string()) kwargs = json::parse(kwargs.get<std::string>(), nullptr, /*allow_exceptions=*/false);
      if (kwargs.is_object() && kwargs.size() == 1 && kwargs.contains("min_lr_rate") &&
          kwargs["min_lr_rate"].is_number() && command_.get_option_no_throw("--min_lr_rate")) {
        (in_file ? from_file_ : tail_).push_back("--min_lr_rate=" + value_text(kwargs["min_lr_rate"]));
        return;
      }
    }
    if (ignored_keys().contains(key)) {
      out_.ignored.push_back(key);
    } else if (const auto rule = refused_keys().find(key); rule != refused_keys().end()) {
      if (!is_inactive(value, rule->second))
        throw Error(
            fmt::format("{}: {} is not something memtune does; {}", origin, json_excerpt(value), rule->second.instead));
      out_.ignored.push_back(key);
    } else if (in_file && training_flags().get_option_no_throw("--" + key)) {
      out_.ignored.push_back(key);  // a training key read by `memtune eval`
    } else {
      throw Error(
          fmt::format("{}: unknown key (not a memtune flag, nor a Hugging Face, ms-swift or LLaMA-Factory "
                      "argument memtune accepts; see `memtune {} --help`)",
                      origin, command_.get_name()));
    }
  }

  const CLI::App& command_;
  const bool compatible_;
  PreparedArguments out_;
  std::vector<std::string> tail_;    // the command line after the subcommand name
  ConfigEntries from_command_line_;  // compatibility keys given as flags
  std::string config_path_;
  std::map<const CLI::Option*, std::pair<std::string, std::string>> given_;
  std::set<const CLI::Option*> on_command_line_;  // the file's value of these is not used
  std::vector<std::string> from_file_;
};

}  // namespace

PreparedArguments prepare_arguments(const std::vector<std::string>& argv, size_t command_at, const CLI::App& command,
                                    bool compatible) {
  ArgumentPreparer p(command, compatible);
  p.read_command_line(argv, command_at);
  p.read_config_file_keys();
  p.classify_command_line_keys();
  return p.finish(argv, command_at);
}

}  // namespace memtune
