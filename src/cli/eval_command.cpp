// `memtune eval`: streaming evaluation of a model (optionally with a LoRA adapter) on a JSONL
// dataset. Forward only, logits only as the fused LM head's chunk workspace, so memory is the
// forward plan whatever the eval set size.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "backend/registry.h"
#include "cli/commands.h"
#include "core/error.h"
#include "data/batcher.h"
#include "data/dataset.h"
#include "eval/classification.h"
#include "eval/eval_data.h"
#include "eval/generation_eval.h"
#include "model/kv_cache.h"
#include "eval/metrics.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "memory/memory_files.h"
#include "memory/process_plan.h"
#include "model/load.h"
#include "model/lora.h"
#include "report/report.h"
#include "tokenizer/tokenizer.h"
#include "options/arguments.h"
#include "options/command_setup.h"

namespace memtune::cli {

namespace {

struct EvalArgs {
    ModelFlags flags;  // --model, --adapter, --backend, --torch_dtype, --bf16, --fp16, --host_memory, ...
    std::string eval_file, tokenizer, metrics = "eval_loss,perplexity,token_accuracy", templ, system;
    std::string truncation_strategy = "delete";
    int64_t batch_size = 8, max_length = 2048, eval_accumulation_steps = 0;
    bool json = false, batch_eval_metrics = false, predict_with_generate = false;
    int64_t max_new_tokens = 0;
    std::vector<std::string> labels;
    std::string save_predictions, output_dir;
};

// --predict_with_generate: the eval file's examples generated on an inference model planned for
// them (prompts up to their last answer, per_device_eval_batch_size sequences at a time).
void evaluate_generating(const EvalArgs& a, const std::string& metric_list, std::optional<DType> dtype,
                         size_t startup_rss) {
  const GenerationMetrics metrics = parse_generation_metrics(metric_list);
  const Tokenizer tokenizer = Tokenizer::load(a.tokenizer.empty() ? a.flags.model : a.tokenizer);
  DataOptions d;
  d.max_length = a.max_length;
  d.truncation_strategy = parse_truncation_strategy(a.truncation_strategy);
  d.chat_template = a.templ;
  if (!a.system.empty()) d.record.system = a.system;
  const Dataset data = load_dataset(a.eval_file, tokenizer, d);
  const GenerationEvalShape shape = generation_eval_shape(data, a.batch_size, a.max_new_tokens, a.eval_file);
  const int64_t max_new = shape.max_new_tokens;
  const std::vector<int32_t> stop_ids = model_stop_ids(a.flags.model, &tokenizer, /*chat=*/true);
  const InferenceSetup setup = inference_setup(a.flags, shape.limits, startup_rss);
  const ProcessPlan& process = setup.process;
  const std::unique_ptr<Decoder> model = load_model(a.flags.model, setup.options, a.flags.adapter, {dtype, a.flags.lm_head_bits});
  const GenerationEvalResult r =
      evaluate_by_generation(*model, tokenizer, data, metrics, a.labels, max_new, stop_ids);
  model->arena().sample();
  nlohmann::json out = generation_eval_to_json(r, metrics);
  out["arena_bytes"] = model->plan().peak_bytes();
  out["process_peak_rss_bytes"] = process_peak_rss_bytes(model->arena());
  out["process_predicted_peak_bytes"] = process.peak_bytes();
  if (!a.save_predictions.empty()) {
    std::ostringstream lines;
    write_generation_predictions(lines, r);
    write_file_atomically(a.save_predictions, lines.str());
  }
  if (!a.output_dir.empty()) {
    create_directory(a.output_dir, "--output_dir");
    write_file_atomically((std::filesystem::path(a.output_dir) / "eval_results.json").string(), out.dump(2) + "\n");
  }
  if (a.json) {
    std::cout << out.dump() << "\n";
    return;
  }
  std::cout << fmt::format("{}: {} examples generated (up to {} tokens each); arena {} (planned), process peak {} "
                           "(measured)\n",
                           a.eval_file, r.examples, max_new, format_bytes(model->plan().peak_bytes()),
                           format_bytes(process_peak_rss_bytes(model->arena())));
  if (metrics.exact_match) std::cout << fmt::format("{:<26} {:.6f}\n", "exact_match", r.exact_match);
  if (metrics.label_accuracy)
    std::cout << fmt::format("{:<26} {:.6f}\n", "label_accuracy_generated", r.label_accuracy_generated);
}

// What an evaluation writes beside its results with --output_dir: run_args.json at the start;
// eval_results.json, memory.json, memory.jsonl and report.html once the metrics are known.
class EvalOutputs {
 public:
  EvalOutputs(const EvalArgs& a, const CLI::App& app) : dir_(a.output_dir) {
    if (a.output_dir.empty()) return;
    create_directory(dir_.string(), "--output_dir");
    write_file_atomically((dir_ / "run_args.json").string(), arguments_json(app).dump(2) + "\n");
    std::filesystem::remove(dir_ / "memory.jsonl");
    timeline_.open((dir_ / "memory.jsonl").string());
  }
  // Adds the memory figures to `results` and, with --output_dir, writes the files.
  void write(Decoder& model, const ProcessPlan& process, nlohmann::json& results, const HeapAllocations& heap) {
    model.arena().sample();
    results["arena_bytes"] = model.plan().peak_bytes();
    results["process_peak_rss_bytes"] = process_peak_rss_bytes(model.arena());
    results["process_predicted_peak_bytes"] = process.peak_bytes();
    results["device_work"] = model.step_work().to_json("evaluation batch");
    if (dir_.empty()) return;
    static constexpr Phase kEvalPhases[] = {Phase::Forward, Phase::Loss};
    timeline_.record(model.arena(), 0, "eval", kEvalPhases);
    write_file_atomically((dir_ / "eval_results.json").string(), results.dump(2) + "\n");
    nlohmann::json memory = memory_json(model.plan(), model.arena(), model.host_plan(), heap);
    memory["device_work"] = results["device_work"];
    memory["process_plan"] = process.to_json();
    memory["process_predicted_peak_bytes"] = process.peak_bytes();
    write_file_atomically((dir_ / "memory.json").string(), memory.dump(2) + "\n");
    write_report(dir_);
  }

 private:
  std::filesystem::path dir_;
  MemoryTimeline timeline_;
};

// The eval file, tokenized and batched as the flags say (classification keeps its label set).
EvalData load_eval_data(const EvalArgs& a, const Tokenizer& tokenizer, bool classification) {
  DataOptions d;
  d.max_length = a.max_length;
  d.truncation_strategy = parse_truncation_strategy(a.truncation_strategy);
  d.chat_template = a.templ;
  if (!a.system.empty()) d.record.system = a.system;
  BatchOptions b;
  b.per_device_batch_size = a.batch_size;
  return EvalData(a.eval_file, tokenizer, d, classification, a.labels, b);
}

std::ofstream open_predictions(const EvalArgs& a) {
  std::ofstream file;
  if (a.save_predictions.empty()) return file;
  file.open(a.save_predictions);
  if (!file) throw Error(fmt::format("--save_predictions {}: cannot write the file", a.save_predictions));
  return file;
}

void evaluate_labels(const EvalArgs& a, Decoder& model, EvalData& eval, const ProcessPlan& process,
                     EvalOutputs& outputs, std::ofstream& predictions) {
  const ClassificationSet& set = eval.classification_set();
  const ClassificationResult r = evaluate_classification(model, eval.batcher(), set);
  if (predictions.is_open()) write_classification_predictions(predictions, r, set);
  nlohmann::json out = classification_to_json(r, set.labels);
  outputs.write(model, process, out, r.heap_during_batches);
  if (a.json) {
    std::cout << out.dump() << "\n";
    return;
  }
  std::cout << fmt::format("{}: {} examples x {} candidate labels; arena {} (planned), process peak {} (measured)\n",
                           a.eval_file, r.examples, set.labels.size(), format_bytes(model.plan().peak_bytes()),
                           format_bytes(process_peak_rss_bytes(model.arena())));
  std::cout << fmt::format(
      "{:<16} {:.6f}\n{:<16} {:.6f}\n{:<16} {:.6f}\nconfusion matrix (rows: true, columns: predicted):\n",
      "label_accuracy", r.label_accuracy, "macro_f1", r.macro_f1, "eval_loss", r.eval_loss);
  for (size_t i = 0; i < set.labels.size(); ++i)
    std::cout << fmt::format("  {:<14} {}\n", set.labels[i], fmt::join(r.confusion[i], " "));
}

void evaluate_tokens(const EvalArgs& a, Decoder& model, EvalData& eval, MetricSelection& selection,
                     const ProcessPlan& process, EvalOutputs& outputs, std::ofstream& predictions,
                     const EvalHooks& hooks) {
  std::optional<PredictionWriter> writer;
  if (predictions.is_open()) writer.emplace(predictions);
  if (writer && hooks.observer) throw Error("--save_predictions: this evaluation's predictions go to its caller");
  EvalHooks with_writer = hooks;
  if (writer) with_writer.observer = &*writer;
  const EvalResult r = evaluate(model, eval.batcher(), selection, with_writer);
  nlohmann::json out = {{"eval_examples", r.num_sequences}, {"eval_tokens", r.num_tokens}};
  for (const auto& [name, value] : r.values) out[name] = value;
  outputs.write(model, process, out, r.heap_during_batches);
  if (hooks.on_result) {
    out["memory_arena_bytes"] = model.plan().peak_bytes();
    out["memory_peak_rss_bytes"] = process_peak_rss_bytes(model.arena());
    hooks.on_result(out);
    return;
  }
  if (a.json) {
    std::cout << out.dump() << "\n";
    return;
  }
  std::cout << fmt::format("{}: {} examples, {} target tokens; arena {} (planned), process peak {} (measured)\n",
                           a.eval_file, r.num_sequences, r.num_tokens, format_bytes(model.plan().peak_bytes()),
                           format_bytes(process_peak_rss_bytes(model.arena())));
  for (const auto& [name, value] : r.values) std::cout << fmt::format("{:<16} {:.6f}\n", name, value);
}

// The command: the data, the model planned for its largest micro-batch (and the process
// predicted before the model's memory exists), then the metrics.
void run_eval(const EvalArgs& a, const CLI::App& app, const EvalHooks& hooks) {
  const size_t startup_rss = startup_rss_bytes(a.flags.backend);
  if (a.batch_size <= 0) throw Error("--per_device_eval_batch_size must be positive");
  const std::optional<DType> dtype = storage_dtype(a.flags.torch_dtype, a.flags.bf16, a.flags.fp16);
  check_max_length(load_model_config(a.flags.model), a.max_length,
                   (std::filesystem::path(a.flags.model) / "config.json").string());
  if ((hooks.observer || hooks.metrics) && (a.predict_with_generate || wants_classification_metrics(a.metrics)))
    throw Error("--metrics " + a.metrics + ": a caller's predictions and compute_metrics take token metrics, not "
                "generation or label scoring");
  if (a.predict_with_generate) {
    evaluate_generating(a, app.count("--metrics") ? a.metrics : "exact_match", dtype, startup_rss);
    return;
  }
  // label_accuracy / macro_f1 select classification scoring; the rest are token metrics.
  const bool classification = wants_classification_metrics(a.metrics);
  MetricSelection selection;
  if (!classification) selection = parse_metrics(a.metrics);
  const Tokenizer tokenizer = Tokenizer::load(a.tokenizer.empty() ? a.flags.model : a.tokenizer);
  EvalData eval = load_eval_data(a, tokenizer, classification);

  ModelOptions o;
  o.max_tokens = eval.batcher().max_micro_batch_tokens();
  o.max_targets = eval.batcher().max_micro_batch_targets();
  o.with_grads = false;
  o.backend = &backend_named(a.flags.backend);
  apply_quantized_activations(a.flags.quantized_activations, o, *o.backend);
  // The whole process, predicted before the model's memory exists (the tokenizer stays alive
  // for --save_predictions, so it is part of the prepared data).
  ProcessPlan process;
  process.measure_preparation(startup_rss);
  predict_process(process, a.flags, choose_model(a.flags), o);
  const std::unique_ptr<Decoder> model = load_model(a.flags.model, o, a.flags.adapter, {dtype, a.flags.lm_head_bits});
  EvalOutputs outputs(a, app);
  std::ofstream predictions = open_predictions(a);
  if (classification)
    evaluate_labels(a, *model, eval, process, outputs, predictions);
  else
    evaluate_tokens(a, *model, eval, selection, process, outputs, predictions, hooks);
}

}  // namespace

Action add_eval(CLI::App& app, const EvalHooks& hooks) {
  auto a = std::make_shared<EvalArgs>();
  app.add_option("--config",
                 "JSON or YAML with the flags' keys, or a Hugging Face / ms-swift / LLaMA-Factory config (flags "
                 "override it; training-only keys are ignored)");
  app.add_option("--model_name_or_path,--model", a->flags.model, "Hugging Face model directory")->required();
  app.add_option("--adapter", a->flags.adapter, "PEFT LoRA adapter directory");
  add_backend_option(app, a->flags.backend);
  add_quantized_model_options(app, a->flags.quantized_activations, a->flags.lm_head_bits);
  app.add_option("--eval_file,--val_dataset,--eval_dataset,--dataset", a->eval_file,
                 "evaluation data, a local JSONL file")
      ->required();
  app.add_option("--tokenizer", a->tokenizer, "tokenizer directory (default: the model directory)");
  app.add_option("--metrics", a->metrics,
                 "comma-separated: eval_loss, perplexity, token_accuracy, top{k}_accuracy; or for text+label data "
                 "label_accuracy, macro_f1 (with eval_loss and the confusion matrix)")
      ->capture_default_str();
  app.add_option("--labels", a->labels, "classification: the candidate labels (default: the eval file's labels)")
      ->delimiter(',');
  app.add_option("--per_device_eval_batch_size", a->batch_size)->capture_default_str();
  app.add_option("--max_length,--cutoff_len", a->max_length)->capture_default_str();
  app.add_option("--truncation_strategy", a->truncation_strategy, "delete | left | right")->capture_default_str();
  add_template_option(app, a->templ);
  app.add_option("--system", a->system, "system message for records without one");
  app.add_option("--eval_accumulation_steps", a->eval_accumulation_steps,
                 "accepted for compatibility: metrics stream, nothing accumulates");
  app.add_flag("--batch_eval_metrics", a->batch_eval_metrics, "accepted for compatibility: metrics always stream");
  app.add_flag("--predict_with_generate", a->predict_with_generate,
               "generate each example's answer (greedy, over a planned KV cache) and compare the text: --metrics "
               "exact_match,label_accuracy_generated");
  app.add_option("--max_new_tokens,--generation_max_length", a->max_new_tokens,
                 "with --predict_with_generate: tokens generated per example (default: the longest answer + 8)");
  app.add_flag("--json", a->json, "print the results as one JSON object");
  app.add_option("--torch_dtype", a->flags.torch_dtype,
                 "storage dtype of the weights: float32 | bfloat16 | float16 (default: the checkpoint's); the losses "
                 "and metrics compute in float32 (16-bit weights are widened to it); --predict_with_generate "
                 "generates as generate does, a bfloat16 model's prompts taking bfloat16 products where the backend "
                 "has them");
  app.add_flag("--bf16", a->flags.bf16, "the same as --torch_dtype bfloat16");
  app.add_flag("--fp16", a->flags.fp16, "the same as --torch_dtype float16");
  app.add_option("--host_memory", a->flags.host_memory,
                 "budget for the whole process (e.g. 16GiB): refuse to start when the prediction is above it");
  app.add_option("--save_predictions", a->save_predictions,
                 "stream per-example results (loss, argmax ids or predicted label) to this JSONL file");
  app.add_option("--output_dir", a->output_dir,
                 "write eval_results.json, memory.json, memory.jsonl, run_args.json and report.html here");
  app.parse_complete_callback([a] { check_local_dataset(a->eval_file, "--eval_file (--val_dataset, --dataset)"); });
  return [a, &app, &hooks] { run_eval(*a, app, hooks); };
}

}  // namespace memtune::cli
