// Command lines and config files written for Hugging Face Trainer, ms-swift and LLaMA-Factory:
// boolean flag values, aliases, the --config reader's key classes (applied, ignored with a notice,
// refused with memtune's equivalent, unknown), and whole runs of `memtune train` and `memtune
// plan` from a TrainingArguments dump, an ms-swift YAML, a LLaMA-Factory YAML and a guide's
// command line on a tiny model.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "data/synthetic_tokenizer.h"
#include "support/run_command.h"
#include "support/test_util.h"
#include "options/arguments.h"
#include "options/config_file.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing_support::error_of;

// Splits a command line on spaces (the tests' arguments hold none).
std::vector<std::string> words(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// `memtune train ARGS` parsed in-process as main() does: prepare_arguments, then CLI11.
struct Parsed {
  TrainingArguments args;
  std::vector<std::string> ignored;
};
Parsed parse_train(const std::string& line) {
  CLI::App app;
  CLI::App* train = app.add_subcommand("train");
  Parsed out;
  add_training_arguments(*train, out.args, ArgumentsFor::Plan);
  PreparedArguments prepared = prepare_arguments(words("train " + line), 1, *train, true);
  out.ignored = prepared.ignored;
  std::reverse(prepared.args.begin(), prepared.args.end());
  app.parse(prepared.args);
  return out;
}

TEST(CompatArguments, BooleanFlagsTakeHuggingFaceValues) {
  Parsed p = parse_train("--gradient_checkpointing True --bf16 true --packing 0 --train_on_prompt=yes --use_rslora");
  EXPECT_TRUE(p.args.gradient_checkpointing);
  EXPECT_TRUE(p.args.bf16);
  EXPECT_FALSE(p.args.packing);
  EXPECT_TRUE(p.args.train_on_prompt);
  EXPECT_TRUE(p.args.use_rslora);
  p = parse_train("--use_gradient_checkpointing false --fp16 False --packing 1 --skip_bad_lines=no");
  EXPECT_FALSE(p.args.gradient_checkpointing);
  EXPECT_FALSE(p.args.fp16);
  EXPECT_TRUE(p.args.packing);
  EXPECT_FALSE(p.args.skip_bad_lines);
  p = parse_train("--packing --lora_rank 4");
  EXPECT_TRUE(p.args.packing);
  EXPECT_EQ(p.args.lora_rank, 4);
  // A word that is not a boolean stays an argument of its own, which train does not take.
  EXPECT_THROW(parse_train("--packing maybe"), CLI::ParseError);
}

TEST(CompatArguments, MsSwiftAndLlamaFactorySpellingsAreAliases) {
  Parsed p = parse_train(
      "--model m --dataset d.jsonl --val_dataset v.jsonl --train_type full --cutoff_len 512 --lora_target all");
  EXPECT_EQ(p.args.model_name_or_path, "m");
  EXPECT_EQ(p.args.train_file, "d.jsonl");
  EXPECT_EQ(p.args.eval_file, "v.jsonl");
  EXPECT_EQ(p.args.tuner_type, "full");
  EXPECT_EQ(p.args.max_length, 512);
  EXPECT_EQ(p.args.target_modules, std::vector<std::string>{"all-linear"});
  p = parse_train("--finetuning_type lora --lora_target_modules q_proj,v_proj --template qwen --sft_type lora");
  EXPECT_EQ(p.args.target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(p.args.template_name, "qwen2_5");
  p = parse_train("--target_modules ALL --evaluation_strategy epoch");
  EXPECT_EQ(p.args.target_modules, std::vector<std::string>{"all-linear"});
  EXPECT_EQ(p.args.eval_strategy, "epoch");
  // Two spellings of one setting with two values contradict each other.
  EXPECT_CONTAINS(error_of([] { parse_train("--max_length 1024 --cutoff_len 2048"); }), "--max_length 1024");
  EXPECT_CONTAINS(error_of([] { parse_train("--gradient_checkpointing --use_gradient_checkpointing false"); }),
                  "two values");
  EXPECT_EQ(parse_train("--lora_rank 4 --lora_rank 8").args.lora_rank, 8) << "one spelling repeated: the last wins";
  EXPECT_CONTAINS(error_of([] { parse_train("--dataset a.jsonl b.jsonl"); }),
                  "--dataset takes one value, got \"a.jsonl\" and \"b.jsonl\"");
  EXPECT_EQ(parse_train("--target_modules q_proj v_proj").args.target_modules,
            (std::vector<std::string>{"q_proj", "v_proj"}));
}

TEST(CompatArguments, ValuesMemtuneCannotHonourAreErrors) {
  Parsed p = parse_train("--finetuning_type freeze");
  EXPECT_CONTAINS(error_of([&] { validate_training_arguments(p.args); }), "freeze");
  p = parse_train("--dataset alpaca_en_demo");
  const std::string hub = error_of([&] { validate_training_arguments(p.args); });
  EXPECT_CONTAINS(hub, "alpaca_en_demo");
  EXPECT_CONTAINS(hub, "local JSONL");
  p = parse_train("--min_lr_rate 0.1");
  EXPECT_CONTAINS(error_of([&] { validate_training_arguments(p.args); }), "cosine_with_min_lr");
  // Command-line keys of the other tools: ignored when they change nothing, refused when active.
  p = parse_train("--do_train --report_to none --logging_dir runs --deepspeed none --torch_compile false");
  EXPECT_EQ(p.ignored, (std::vector<std::string>{"deepspeed", "do_train", "torch_compile"}));
  // report_to and logging_dir are memtune's options (TensorBoard event files).
  EXPECT_EQ(p.args.report_to, std::vector<std::string>{"none"});
  EXPECT_EQ(p.args.logging_dir, "runs");
  EXPECT_EQ(parse_train("--report_to wandb tensorboard").args.report_to,
            (std::vector<std::string>{"wandb", "tensorboard"}));
  EXPECT_EQ(parse_train("--report_to=wandb,tensorboard").args.report_to,
            (std::vector<std::string>{"wandb", "tensorboard"}));
  EXPECT_CONTAINS(error_of([] { parse_train("--deepspeed ds_z2.json"); }), "--zero_stage 1");
  EXPECT_CONTAINS(error_of([] { parse_train("--torch_compile"); }), "--torch_compile");
  EXPECT_CONTAINS(error_of([] { parse_train("--optim adamw_8bit"); }), "--optim_offload");
  EXPECT_TRUE(parse_train("--optim adamw_torch").ignored == std::vector<std::string>{"optim"});
  EXPECT_EQ(parse_train("--lr_scheduler_type cosine_with_min_lr --lr_scheduler_kwargs {\"min_lr_rate\":0.1}")
                .args.min_lr_rate,
            0.1);
}

json plan_json(const std::string& args) {
  const auto r = testing_support::run_memtune("plan --json " + args);
  EXPECT_EQ(r.status, 0) << r.output;
  return r.status == 0 ? json::parse(r.output) : json::object();
}

TEST(CompatArguments, BooleanValuesReachThePlan) {
  const std::string base = "--preset qwen2.5-0.5b --per_device_train_batch_size 1 --max_length 512";
  const json on = plan_json(base + " --gradient_checkpointing True --bf16 true --packing 0");
  const json off = plan_json(base + " --use_gradient_checkpointing false --bf16=False --packing=no");
  ASSERT_TRUE(on.contains("categories") && off.contains("categories"));
  EXPECT_LT(on["categories"]["saved_activations"].get<double>(), off["categories"]["saved_activations"].get<double>());
  EXPECT_LT(on["peak_bytes"].get<double>(), off["peak_bytes"].get<double>());
}

class ConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing_support::make_temp_dir("config_compat_test"); }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(dir_ / name) << text;
    return (dir_ / name).string();
  }
  fs::path dir_;
};

TEST_F(ConfigFileTest, YamlIsReadByAYamlParser) {
  const std::string path = write("a.yaml",
                                 "# comment\n"
                                 "system: \"Answer #1\"  # a trailing comment\n"
                                 "target_modules: [q_proj, v_proj]\n"
                                 "learning_rate: 1.0e-4\n"
                                 "eval_steps: null\n"
                                 "bf16: True\n"
                                 "template: 'plain'\n");
  Parsed p = parse_train("--config " + path + " --lora_rank 3");
  EXPECT_EQ(p.args.system, "Answer #1");
  EXPECT_EQ(p.args.target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_DOUBLE_EQ(p.args.learning_rate, 1e-4);
  EXPECT_EQ(p.args.eval_steps, 0) << "null means not set";
  EXPECT_TRUE(p.args.bf16);
  EXPECT_EQ(p.args.template_name, "plain");
  EXPECT_EQ(p.args.lora_rank, 3);
  // The command line overrides the file, whatever the spelling.
  EXPECT_FALSE(parse_train("--config " + path + " --bf16 false").args.bf16);
  EXPECT_EQ(parse_train("--config " + path + " --lora_target all").args.target_modules,
            std::vector<std::string>{"all-linear"});

  EXPECT_CONTAINS(error_of([&] { parse_train("--config " + write("b.yaml", "lora_rank: 4\nlearning_rat: 0.1\n")); }),
                  "b.yaml: key \"learning_rat\": unknown key");
  EXPECT_CONTAINS(error_of([&] { parse_train("--config " + write("c.yaml", "lora_rank:\n  r: 4\n")); }),
                  "c.yaml: key \"lora_rank\": expected a value or a list of values");
  EXPECT_CONTAINS(error_of([&] { parse_train("--config " + write("d.yaml", "lora_rank: [4, 8]\n")); }),
                  "expected one value");
  EXPECT_CONTAINS(error_of([&] { parse_train("--config " + write("e.yaml", "a: [1\nb: 2\n")); }), "e.yaml:");
  EXPECT_CONTAINS(error_of([&] { parse_train("--config " + write("f.yaml", "deepspeed: zero2\n")); }),
                  "f.yaml: key \"deepspeed\": \"zero2\"");
  EXPECT_CONTAINS(error_of([&] { parse_train("--config " + write("g.yaml", "- lora_rank\n")); }), "mapping");
  EXPECT_CONTAINS(error_of([&] { parse_train("--config " + write("h.yaml", "bf16: 1\nbf16: 0\n")); }), "twice");
  EXPECT_CONTAINS(error_of([&] { parse_train("--config " + write("i.json", "[1]")); }), "JSON object");
  EXPECT_CONTAINS(error_of([&] { parse_train("--config " + write("k.json", R"({"learning_rate": 1e400})")); }),
                  "k.json: invalid JSON");
  EXPECT_CONTAINS(error_of([&] { parse_train("--config " + write("j.yaml", "packing: sometimes\n")); }),
                  "expected true or false");
  EXPECT_CONTAINS(error_of([&] { parse_train("--config " + (dir_ / "missing.yaml").string()); }), "missing.yaml");
}

TEST_F(ConfigFileTest, ReportToAndLoggingDirAreRead) {
  Parsed p = parse_train("--config " + write("r.yaml", "report_to: [wandb, tensorboard]\nlogging_dir: tb\n"));
  EXPECT_EQ(p.args.report_to, (std::vector<std::string>{"wandb", "tensorboard"}));
  EXPECT_EQ(p.args.logging_dir, "tb");
  EXPECT_TRUE(p.ignored.empty());
  EXPECT_EQ(parse_train("--config " + write("s.yaml", "report_to: none\n")).args.report_to,
            std::vector<std::string>{"none"});
  // An empty list is "not set" (no integration, the default) and takes no flag after it.
  const std::string empty = write("t.json", R"({"report_to": [], "logging_steps": 3})");
  p = parse_train("--config " + empty);
  EXPECT_TRUE(p.args.report_to.empty());
  EXPECT_EQ(p.args.logging_steps, 3);
  EXPECT_EQ(parse_train("--config " + empty + " --report_to tensorboard").args.report_to,
            std::vector<std::string>{"tensorboard"});
}

// A Hugging Face TrainingArguments.to_json_string() dump (transformers 4.46's fields, defaults
// except the settings below), as users save it next to their runs.
std::string hugging_face_dump(const std::string& output_dir) {
  json d = json::parse(R"({
  "output_dir": "OUT", "overwrite_output_dir": false, "do_train": false, "do_eval": false, "do_predict": false,
  "eval_strategy": "no", "prediction_loss_only": false, "per_device_train_batch_size": 4,
  "per_device_eval_batch_size": 8, "per_gpu_train_batch_size": null, "per_gpu_eval_batch_size": null,
  "gradient_accumulation_steps": 1, "eval_accumulation_steps": null, "eval_delay": 0,
  "torch_empty_cache_steps": null, "learning_rate": 5e-05, "weight_decay": 0.0, "adam_beta1": 0.9,
  "adam_beta2": 0.999, "adam_epsilon": 1e-08, "max_grad_norm": 1.0, "num_train_epochs": 3.0, "max_steps": 2,
  "lr_scheduler_type": "linear", "lr_scheduler_kwargs": {}, "warmup_ratio": 0.0, "warmup_steps": 0,
  "log_level": "passive", "log_level_replica": "warning", "log_on_each_node": true,
  "logging_dir": "OUT/runs/Dec01_22-40-00_host", "logging_strategy": "steps", "logging_first_step": false,
  "logging_steps": 1, "logging_nan_inf_filter": true, "save_strategy": "steps", "save_steps": 500,
  "save_total_limit": null, "save_safetensors": true, "save_on_each_node": false, "save_only_model": false,
  "restore_callback_states_from_checkpoint": false, "no_cuda": false, "use_cpu": false, "use_mps_device": false,
  "seed": 42, "data_seed": null, "jit_mode_eval": false, "use_ipex": false, "bf16": false, "fp16": false,
  "fp16_opt_level": "O1", "half_precision_backend": "auto", "bf16_full_eval": false, "fp16_full_eval": false,
  "tf32": null, "local_rank": 0, "ddp_backend": null, "tpu_num_cores": null, "tpu_metrics_debug": false,
  "debug": [], "dataloader_drop_last": false, "eval_steps": null, "dataloader_num_workers": 0,
  "dataloader_prefetch_factor": null, "past_index": -1, "run_name": "OUT", "disable_tqdm": false,
  "remove_unused_columns": true, "label_names": null, "load_best_model_at_end": false,
  "metric_for_best_model": null, "greater_is_better": null, "ignore_data_skip": false, "fsdp": [],
  "fsdp_min_num_params": 0,
  "fsdp_config": {"min_num_params": 0, "xla": false, "xla_fsdp_v2": false, "xla_fsdp_grad_ckpt": false},
  "fsdp_transformer_layer_cls_to_wrap": null,
  "accelerator_config": {"split_batches": false, "dispatch_batches": null, "even_batches": true,
                         "use_seedable_sampler": true, "non_blocking": false, "gradient_accumulation_kwargs": null},
  "deepspeed": null, "label_smoothing_factor": 0.0, "optim": "adamw_torch", "optim_args": null,
  "adafactor": false, "group_by_length": false, "length_column_name": "length", "report_to": ["tensorboard"],
  "ddp_find_unused_parameters": null, "ddp_bucket_cap_mb": null, "ddp_broadcast_buffers": null,
  "dataloader_pin_memory": true, "dataloader_persistent_workers": false, "skip_memory_metrics": true,
  "use_legacy_prediction_loop": false, "push_to_hub": false, "resume_from_checkpoint": null, "hub_model_id": null,
  "hub_strategy": "every_save", "hub_token": "<HUB_TOKEN>", "hub_private_repo": false, "hub_always_push": false,
  "gradient_checkpointing": true, "gradient_checkpointing_kwargs": {"use_reentrant": false},
  "include_inputs_for_metrics": false, "include_for_metrics": [], "eval_do_concat_batches": true,
  "fp16_backend": "auto", "evaluation_strategy": null, "push_to_hub_model_id": null,
  "push_to_hub_organization": null, "push_to_hub_token": "<PUSH_TO_HUB_TOKEN>", "mp_parameters": "",
  "auto_find_batch_size": false, "full_determinism": false, "torchdynamo": null, "ray_scope": "last",
  "ddp_timeout": 1800, "torch_compile": false, "torch_compile_backend": null, "torch_compile_mode": null,
  "dispatch_batches": null, "split_batches": null, "include_tokens_per_second": false,
  "include_num_input_tokens_seen": false, "neftune_noise_alpha": null, "optim_target_modules": null,
  "batch_eval_metrics": false, "eval_on_start": false, "use_liger_kernel": false, "eval_use_gather_object": false,
  "average_tokens_across_devices": false
})");
  d["output_dir"] = output_dir;
  d["logging_dir"] = output_dir + "/runs/Dec01_22-40-00_host";
  d["run_name"] = output_dir;
  return d.dump(2);
}

TEST_F(ConfigFileTest, AHuggingFaceDumpAppliesItsSettingsAndListsTheRestOnce) {
  const std::string dump = hugging_face_dump("out");
  EXPECT_GE(json::parse(dump).size(), 115u);
  Parsed p = parse_train("--config " + write("training_args.json", dump));
  EXPECT_EQ(p.args.output_dir, "out");
  EXPECT_EQ(p.args.max_steps, 2);
  EXPECT_TRUE(p.args.gradient_checkpointing);
  EXPECT_EQ(p.args.per_device_train_batch_size, 4);
  EXPECT_EQ(p.args.eval_steps, 0);
  for (const char* key : {"deepspeed", "fsdp", "fsdp_config", "torch_compile", "optim", "hub_token"})
    EXPECT_NE(std::find(p.ignored.begin(), p.ignored.end(), key), p.ignored.end()) << key;
  EXPECT_EQ(p.args.report_to, std::vector<std::string>{"tensorboard"});
  EXPECT_EQ(p.args.logging_dir, "out/runs/Dec01_22-40-00_host");
  const std::string notice = ignored_keys_notice(p.ignored);
  EXPECT_EQ(std::count(notice.begin(), notice.end(), '\n'), 0);
  // Active values of the same keys stop the run with memtune's equivalent.
  json d = json::parse(dump);
  d["fsdp"] = "full_shard auto_wrap";
  EXPECT_CONTAINS(error_of([&] { parse_train("--config " + write("fsdp.json", d.dump())); }), "mpirun -np N");
  d = json::parse(dump);
  d["torch_compile"] = true;
  EXPECT_CONTAINS(error_of([&] { parse_train("--config " + write("compile.json", d.dump())); }),
                  "key \"torch_compile\"");
  d = json::parse(dump);
  d["adafactor"] = true;
  EXPECT_CONTAINS(error_of([&] { parse_train("--config " + write("adafactor.json", d.dump())); }), "AdamW");
}

// A tiny model with the synthetic tokenizer and a few JSONL lines, as the demo uses.
class ConfigRunTest : public ConfigFileTest {
 protected:
  void SetUp() override {
    ConfigFileTest::SetUp();
    ASSERT_EQ(testing_support::run_memtune("init-model --preset tiny --seed 1 --out " + path("model")).status, 0);
    testing_support::write_synthetic_tokenizer(dir_ / "model");
    std::ofstream data(dir_ / "train.jsonl");
    const char* colours[] = {"red", "green", "blue", "cyan", "amber", "teal"};
    for (int i = 0; i < 6; ++i)
      data << json{{"messages",
                    {{{"role", "user"}, {"content", "colour " + std::to_string(i)}},
                     {{"role", "assistant"}, {"content", colours[i]}}}}}
                  .dump()
           << "\n";
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // train, then plan with the same arguments; both must succeed.
  void train_and_plan(const std::string& args, const std::string& out) {
    const auto trained = testing_support::run_memtune("train " + args + " --output_dir " + path(out));
    ASSERT_EQ(trained.status, 0) << trained.output;
    EXPECT_TRUE(fs::exists(dir_ / out / "trainer_state.json")) << trained.output;
    train_output = trained.output;
    const auto planned = testing_support::run_memtune("plan " + args + " --output_dir " + path(out));
    ASSERT_EQ(planned.status, 0) << planned.output;
    EXPECT_CONTAINS(planned.output, "total");
  }
  std::string train_output;
};

TEST_F(ConfigRunTest, HuggingFaceDumpTrainsAndPlans) {
  const std::string config = write("training_args.json", hugging_face_dump(path("ignored")));
  train_and_plan(
      "--config " + config + " --model_name_or_path " + path("model") + " --train_file " + path("train.jsonl"), "hf");
  EXPECT_CONTAINS(train_output, "accepted and ignored");
  EXPECT_CONTAINS(train_output, "hub_token");
  // The dump's report_to ["tensorboard"] and logging_dir are followed, as the Trainer would.
  EXPECT_CONTAINS(train_output, "events.out.tfevents.");
  EXPECT_TRUE(fs::is_directory(dir_ / "ignored/runs/Dec01_22-40-00_host")) << train_output;
  size_t notices = 0;
  for (size_t at = train_output.find("accepted and ignored"); at != std::string::npos;
       at = train_output.find("accepted and ignored", at + 1))
    ++notices;
  EXPECT_EQ(notices, 1u) << "one notice line";
  const json state = testing_support::read_json(dir_ / "hf/trainer_state.json");
  EXPECT_EQ(state["global_step"], 2);
}

TEST_F(ConfigRunTest, MsSwiftYamlTrainsAndPlans) {
  const std::string config = write("swift_sft.yaml",
                                   "# swift sft --config\n"
                                   "model: " +
                                       path("model") +
                                       "\n"
                                       "model_type: qwen2_5\n"
                                       "train_type: lora\n"
                                       "dataset: " +
                                       path("train.jsonl") +
                                       "\n"
                                       "split_dataset_ratio: 0\n"
                                       "torch_dtype: bfloat16\n"
                                       "num_train_epochs: 1\n"
                                       "max_steps: 2\n"
                                       "per_device_train_batch_size: 2\n"
                                       "learning_rate: 1e-4\n"
                                       "lora_rank: 4\n"
                                       "lora_alpha: 16\n"
                                       "target_modules: all-linear\n"
                                       "gradient_accumulation_steps: 2\n"
                                       "gradient_checkpointing: true\n"
                                       "save_steps: 50\n"
                                       "save_total_limit: 2\n"
                                       "logging_steps: 1\n"
                                       "max_length: 256\n"
                                       "warmup_ratio: 0.05\n"
                                       "dataloader_num_workers: 4\n"
                                       "system: \"You are a helpful assistant. #1\"\n"
                                       "model_author: swift\n"
                                       "model_name: swift-robot\n"
                                       "report_to: [tensorboard]\n");
  train_and_plan("--config " + config, "swift");
  EXPECT_TRUE(fs::is_directory(dir_ / "swift/runs")) << "report_to: [tensorboard] writes under output_dir/runs";
  const json adapter = testing_support::read_json(dir_ / "swift/adapter_config.json");
  EXPECT_EQ(adapter["r"], 4);
  EXPECT_EQ(adapter["lora_alpha"], 16);
}

TEST_F(ConfigRunTest, LlamaFactoryYamlTrainsAndPlans) {
  const std::string config = write("llama3_lora_sft.yaml",
                                   "### model\n"
                                   "model_name_or_path: " +
                                       path("model") +
                                       "\n"
                                       "trust_remote_code: true\n\n"
                                       "### method\n"
                                       "stage: sft\n"
                                       "do_train: true\n"
                                       "finetuning_type: lora\n"
                                       "lora_rank: 8\n"
                                       "lora_target: all\n\n"
                                       "### dataset\n"
                                       "dataset: " +
                                       path("train.jsonl") +
                                       "\n"
                                       "template: qwen\n"
                                       "cutoff_len: 256\n"
                                       "overwrite_cache: true\n"
                                       "preprocessing_num_workers: 16\n\n"
                                       "### output\n"
                                       "output_dir: saves/qwen2_5/lora/sft\n"
                                       "logging_steps: 1\n"
                                       "save_steps: 500\n"
                                       "plot_loss: true\n"
                                       "overwrite_output_dir: true\n"
                                       "report_to: none  # choices: [none, wandb, tensorboard]\n\n"
                                       "### train\n"
                                       "per_device_train_batch_size: 1\n"
                                       "gradient_accumulation_steps: 2\n"
                                       "learning_rate: 1.0e-4\n"
                                       "num_train_epochs: 3.0\n"
                                       "max_steps: 2\n"
                                       "lr_scheduler_type: cosine\n"
                                       "warmup_ratio: 0.1\n"
                                       "bf16: true\n"
                                       "ddp_timeout: 180000000\n"
                                       "resume_from_checkpoint: null\n");
  train_and_plan("--config " + config, "llamafactory");
  EXPECT_EQ(testing_support::read_json(dir_ / "llamafactory/adapter_config.json")["r"], 8);
  EXPECT_FALSE(fs::exists(dir_ / "llamafactory/runs")) << "report_to: none writes no event file";
  std::ofstream(config, std::ios::app) << "quantization_bit: 4\n";
  const auto refused = testing_support::run_memtune("train --config " + config);
  EXPECT_EQ(refused.status, 1);
  EXPECT_CONTAINS(refused.output, "quantization_bit");
  EXPECT_CONTAINS(refused.output, "--torch_dtype bfloat16");
}

TEST_F(ConfigRunTest, GuideCommandLineTrainsAndPlans) {
  train_and_plan("--model " + path("model") + " --dataset " + path("train.jsonl") +
                     " --torch_dtype float16 --per_device_train_batch_size 1 --gradient_accumulation_steps 32"
                     " --max_length 1024 --lora_rank 4 --lora_alpha 16 --use_gradient_checkpointing true"
                     " --num_train_epochs 5 --max_steps 2",
                 "guide");
  EXPECT_EQ(testing_support::read_json(dir_ / "guide/trainer_state.json")["global_step"], 2);
}

TEST_F(ConfigRunTest, AnUnknownReportToStopsBeforeAnyWork) {
  for (const std::string command : {"train", "plan"}) {
    const auto r = testing_support::run_memtune(command + " --model " + path("model") + " --dataset " +
                                                path("train.jsonl") + " --output_dir " + path("bad") +
                                                " --report_to wandb tensorbord");
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_CONTAINS(r.output, "--report_to tensorbord");
    EXPECT_CONTAINS(r.output, "none, all, tensorboard");
    EXPECT_FALSE(fs::exists(dir_ / "bad")) << command;
  }
}

TEST_F(ConfigRunTest, BooleanValuesReachTheRun) {
  const auto r = testing_support::run_memtune("train --model " + path("model") + " --dataset " + path("train.jsonl") +
                                              " --output_dir " + path("bool") +
                                              " --gradient_checkpointing True --bf16 true --packing 0 --max_steps 1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "bfloat16");
  const json args = testing_support::read_json(dir_ / "bool/run_args.json");
  // run_args.json holds each option's value as parsed.
  EXPECT_EQ(args["packing"], "false");
  EXPECT_EQ(args["gradient_checkpointing"], "true");
  EXPECT_EQ(args["bf16"], "true");
}

TEST_F(ConfigRunTest, EvalTakesTheEvaluationFlagsAndTheirSpellings) {
  const auto r =
      testing_support::run_memtune("eval --model " + path("model") + " --val_dataset " + path("train.jsonl") +
                                   " --cutoff_len 256 --bf16 true --per_device_eval_batch_size 2 "
                                   "--eval_accumulation_steps 4 --template qwen --json");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "eval_loss");
  const std::string config = write("eval.yaml", "learning_rate: 1e-4\nreport_to: none\ncutoff_len: 128\n");
  const auto from_file = testing_support::run_memtune("eval --config " + config + " --model " + path("model") +
                                                      " --dataset " + path("train.jsonl"));
  ASSERT_EQ(from_file.status, 0) << from_file.output;
  EXPECT_CONTAINS(from_file.output, "learning_rate");
  const auto hub = testing_support::run_memtune("eval --model " + path("model") + " --dataset alpaca_en_demo");
  EXPECT_EQ(hub.status, 1);
  EXPECT_CONTAINS(hub.output, "local JSONL");
}

TEST_F(ConfigRunTest, InitModelConfigIsAModelConfig) {
  const auto r =
      testing_support::run_memtune("init-model --config " + path("model/config.json") + " --out " + path("copy"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir_ / "copy/config.json"));
}

}  // namespace
}  // namespace memtune
