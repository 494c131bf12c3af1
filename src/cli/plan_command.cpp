// `memtune plan`: the whole memory bill of a training run before it starts. It takes every flag
// `memtune train` takes (swap the word and get that run's bill): with --train_file it tokenizes
// the data as the run does and sizes the micro-batches from it, then plans the same buffers the
// run allocates (plan-only: nothing is allocated, so real-size models can be planned anywhere),
// predicts the whole process around them, checks both against device and host budgets, and
// shows what Hugging Face Trainer's evaluation with compute_metrics would hold in logits.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/registry.h"
#include "backend/vulkan/vulkan_backend.h"
#include "cli/commands.h"
#include "cli/plan_fit.h"
#include "cli/plan_training.h"
#include "core/error.h"
#include "eval/generation_eval.h"
#include "memory/memory_files.h"
#include "memory/process_memory.h"
#include "memory/process_plan.h"
#include "model/decoder.h"
#include "model/load.h"
#include "options/command_setup.h"
#include "model/config.h"
#include "options/inference_options.h"

namespace memtune::cli {
namespace {

// --vulkan_max_allocation: the vulkan backend becomes a planning profile of a device that is not
// on this machine (nothing is opened).
void plan_for_absent_device(const PlanArgs& a) {
  if (a.vulkan_max_allocation.empty()) return;
  if (a.run.backend != "vulkan") throw Error("--vulkan_max_allocation plans for a Vulkan device: add --backend vulkan");
  if (a.device_memory.empty() || a.device_memory == "auto")
    throw Error("--vulkan_max_allocation plans for a device that is not here: give its memory as --device_memory, "
                "e.g. 24GiB");
  plan_for_absent_vulkan_device({.max_allocation_bytes = parse_bytes(a.vulkan_max_allocation, "--vulkan_max_allocation"),
                                 .heap_bytes = parse_bytes(a.device_memory, "--device_memory")});
}

// A device backend's view of the training arena: its allocations (cut where no buffer crosses
// when one allocation cannot hold it), or why it cannot be cut.
struct DeviceView {
  DeviceMemoryFigures figures;
  std::vector<size_t> allocations;
  std::string unsplittable;
  bool fits = false;
};

// Everything the bill reports, computed once; printed as JSON or as text.
struct TrainingBill {
  const PlanArgs& args;
  const TrainingPlanner& planner;
  ModelOptions train, eval;
  Decoder train_model, eval_model;
  ProcessPlan process;
  int64_t trainable = 0;
  size_t peak = 0;
  std::optional<size_t> generation_bytes;
  // What Hugging Face Trainer's evaluation keeps with a custom compute_metrics: float32 logits
  // [batch, seq, vocab] per batch, accumulated over the eval set.
  double hf_batch = 0, hf_total = 0;
  // What memtune.Trainer keeps for compute_metrics in Trainer's default protocol (the Python
  // package): an int64 prediction (argmax id) and an int64 label per position, [sequences,
  // max_length] each; batch_eval_metrics keeps one batch of them.
  double python_total = 0;
  std::optional<DeviceView> device;
  std::optional<size_t> budget, host_budget;
  std::string budget_source;
  FitResult fit;

  TrainingBill(const PlanArgs& a, const TrainingPlanner& p)
      : args(a),
        planner(p),
        train(p.run_options(a.run.per_device_train_batch_size, a.run.max_length)),
        eval(p.eval_options(train)),
        train_model(p.config(), train),
        eval_model(p.config(), eval),
        process(p.prepared_process()) {}
  size_t device_need() const { return std::max(peak, eval_model.plan().peak_bytes()); }
};

void plan_process_and_model(TrainingBill& b) {
  const TrainingArguments& r = b.args.run;
  const ModelConfig& config = b.planner.config();
  const EvalData* eval_data = b.planner.eval_data();
  for (size_t i = 0; i < b.train_model.parameters().num_trainable(); ++i)
    b.trainable += b.train_model.parameters().trainable_spec(i).numel();
  b.peak = b.train_model.plan().peak_bytes();
  add_planned_terms(b.process, b.train_model, b.planner.checkpoint_dtype(), b.args.world_size);
  if (b.args.world_size > 1) b.process.startup_bytes += kMpiInitBytes;  // a run measures it in its startup
  if (eval_data && r.eval_strategy != "no") b.process.evaluation_bytes = kEvaluationRuntimeBytes;
  // --predict_with_generate: the run's generation view of the model (KV cache, step buffers).
  if (r.predict_with_generate && r.eval_strategy != "no" && eval_data) {
    const GenerationEvalShape shape =
        generation_eval_shape(eval_data->tokens(), r.per_device_eval_batch_size, r.max_new_tokens, r.eval_file);
    const Decoder view(b.train_model, inference_model_options(config, shape.limits, nullptr, false));
    b.generation_bytes = view.plan().peak_bytes() + view.host_plan().peak_bytes();
    b.process.generation_arena_bytes = *b.generation_bytes;
  }
  b.hf_batch = 4.0 * static_cast<double>(r.per_device_eval_batch_size * r.max_length * config.vocab_size);
  b.hf_total = 4.0 * static_cast<double>(b.args.eval_sequences * r.max_length * config.vocab_size);
  b.python_total = 16.0 * static_cast<double>(b.args.eval_sequences * r.max_length);
}

void plan_budgets(TrainingBill& b, Backend& backend) {
  const TrainingArguments& r = b.args.run;
  if (const std::optional<DeviceMemoryFigures> figures = backend.device_memory_figures()) {
    DeviceView d;
    d.figures = *figures;
    try {
      for (const PlanSegment& s : plan_segments(b.train_model.plan(), figures->max_allocation_bytes))
        d.allocations.push_back(s.bytes);
    } catch (const Error& e) {
      d.unsplittable = e.what();
    }
    d.fits = d.unsplittable.empty() && b.peak <= figures->available_bytes();
    b.device = d;
  }
  if (!b.args.device_memory.empty()) b.budget = device_memory_bytes(b.args.device_memory, r.backend, &b.budget_source);
  if (!r.host_memory.empty()) b.host_budget = parse_bytes(r.host_memory, "--host_memory");
  if (b.args.fit) {
    if (!b.budget && !b.host_budget) throw Error("--fit needs --device_memory or --host_memory");
    b.fit = fit_search(b.planner, b.eval, b.process, b.budget, b.host_budget);
  }
}

nlohmann::json bill_json(const TrainingBill& b) {
  const TrainingArguments& r = b.args.run;
  nlohmann::json out = {
      {"parameters", model_parameter_count(b.planner.config())},
      {"trainable_parameters", b.trainable},
      {"peak_bytes", b.peak},
      {"process_peak_bytes", b.process.peak_bytes()},
      {"process", b.process.to_json()},
      {"micro_batch_tokens", b.train.max_tokens},
      {"micro_batch_targets", b.train.max_targets},
      {"world_size", b.args.world_size},
      {"zero_stage", r.zero_stage},
      {"training", plan_to_json(b.train_model.plan())},
      {"evaluation", plan_to_json(b.eval_model.plan())},
      {"generation_arena_bytes", b.generation_bytes ? nlohmann::json(*b.generation_bytes) : nlohmann::json()},
      {"hf_eval_logits_bytes_per_batch", b.hf_batch},
      {"hf_eval_logits_bytes_accumulated", b.hf_total},
      {"python_eval_predictions_bytes_accumulated", b.python_total}};
  out["categories"] = out["training"]["categories"];
  out["phases"] = out["training"]["phases"];
  out["host_arena_bytes"] = b.train_model.host_plan().peak_bytes();
  out["arithmetic"] = describe_arithmetic(b.planner.config(), b.train_model.options(), b.train_model.backend());
  // The usual sizes of a CUDA device's context and library workspaces: unmeasured, added to no
  // prediction.
  out["cuda_fixed_costs"] = {{"context_bytes", kCudaContextBytes},
                             {"library_workspace_bytes", kCudaLibraryWorkspaceBytes},
                             {"measured", false}};
  if (b.device) {
    out["device"] = {{"name", b.device->figures.device},
                     {"device_heap_bytes", b.device->figures.heap_bytes},
                     {"max_allocation_bytes", b.device->figures.max_allocation_bytes},
                     {"allocations", b.device->allocations},
                     {"fits", b.device->fits}};
    if (!b.device->unsplittable.empty()) out["device"]["unsplittable"] = b.device->unsplittable;
  }
  if (b.budget) {
    out["device_memory_bytes"] = *b.budget;
    if (!b.budget_source.empty()) out["device_memory_source"] = b.budget_source;
    out["fits"] = b.device_need() <= *b.budget;
  }
  if (b.host_budget) {
    out["host_memory_bytes"] = *b.host_budget;
    out["fits_host"] = b.process.peak_bytes() <= *b.host_budget;
  }
  if (b.args.fit) {
    const std::vector<FitCandidate>& fitting = b.fit.fitting;
    nlohmann::json candidates = nlohmann::json::array();
    for (const FitCandidate& k : fitting)
      candidates.push_back({{"flags", k.flags()},
                            {"quantization", k.quantization.empty() ? "none" : k.quantization},
                            {"peak_bytes", k.peak},
                            {"process_peak_bytes", k.process_peak},
                            {"relative_step_time", k.cost / fitting[0].cost}});
    out["fit"] = candidates;
    out["smallest_peak_bytes"] = b.fit.smallest->peak;
  }
  return out;
}

void print_fit(const TrainingBill& b) {
  const std::string within = b.budget && b.host_budget
                                 ? fmt::format("{} (device) and {} (process)", format_bytes(*b.budget),
                                               format_bytes(*b.host_budget))
                                 : format_bytes(b.budget ? *b.budget : *b.host_budget);
  const std::vector<FitCandidate>& fitting = b.fit.fitting;
  if (fitting.empty()) {
    std::cout << fmt::format(
        "--fit: nothing fits in {}. The smallest footprint found is {} ({}), of which the weights alone are {}.\n",
        within, format_bytes(b.fit.smallest->peak), b.fit.smallest->flags(),
        format_bytes(b.train_model.plan().live_bytes(Phase::Forward, Category::Weights)));
    return;
  }
  std::cout << fmt::format(
      "--fit: {} configurations fit in {}; the fastest (estimated step time, relative; arena, process):\n",
      fitting.size(), within);
  for (size_t i = 0; i < std::min<size_t>(8, fitting.size()); ++i)
    std::cout << fmt::format("  {:.2f}x  {:>12}  {:>12}  {}\n", fitting[i].cost / fitting[0].cost,
                             format_bytes(fitting[i].peak), format_bytes(fitting[i].process_peak), fitting[i].flags());
}

void print_bill(const TrainingBill& b) {
  const PlanArgs& a = b.args;
  const TrainingArguments& r = a.run;
  const ModelConfig& config = b.planner.config();
  std::cout << fmt::format(
      "{}: {} parameters, {} trainable ({}), {} storage; micro-batch {} tokens{} ({} x {}{}){}{}{}\n",
      a.preset.empty() ? r.model_name_or_path : a.preset, model_parameter_count(config), b.trainable,
      r.tuner_type == "lora" ? fmt::format("LoRA r={}", r.lora_rank) : std::string("full fine-tuning"),
      dtype_torch_name(config.torch_dtype), b.train.max_tokens,
      b.train.max_targets ? fmt::format(", {} loss targets", b.train.max_targets) : std::string(),
      r.per_device_train_batch_size, r.max_length, b.planner.has_train_data() ? ", from the data" : "",
      r.gradient_checkpointing ? ", gradient checkpointing" : "", r.optim_offload ? ", optimizer offloaded" : "",
      a.world_size > 1 ? fmt::format("; per rank of {}{}", a.world_size, r.zero_stage ? " with ZeRO-1" : "")
                       : std::string());
  std::cout << "arithmetic: " << describe_arithmetic(config, b.train_model.options(), b.train_model.backend()) << "\n";
  std::cout << fmt::format(
      "bytes live per phase of a training step, and in evaluation (per_device_eval_batch_size {}, its peak):\n",
      r.per_device_eval_batch_size);
  std::cout << b.train_model.plan().summary(&b.eval_model.plan());
  std::cout << fmt::format("evaluation plan: peak {}\n", format_bytes(b.eval_model.plan().peak_bytes()));
  if (a.world_size > 1)
    std::cout << "communication buffers: none planned (gradients are reduced in place; MPI's own buffers are "
                 "counted in the process line)\n";
  if (r.optim_offload)
    std::cout << fmt::format(
        "optimizer offload: {} of optimizer state in host memory; on the cpu backend host and device are the same "
        "RAM, so this only moves bytes between two accounts (a device backend makes it real)\n",
        format_bytes(b.train_model.host_plan().peak_bytes()));
  std::cout << b.process.summary();
  if (b.device) {
    const DeviceView& d = *b.device;
    std::vector<std::string> sizes;
    for (const size_t bytes : d.allocations) sizes.push_back(format_bytes(bytes));
    std::cout << fmt::format("device {} ({}): the training arena is {} ({} one may hold; {} {}){}\n",
                             d.figures.device, r.backend,
                             d.unsplittable.empty()
                                 ? fmt::format("{} allocation{} of {}", d.allocations.size(),
                                               d.allocations.size() == 1 ? "" : "s", fmt::join(sizes, " + "))
                                 : d.unsplittable,
                             format_bytes(d.figures.max_allocation_bytes),
                             d.figures.budget_bytes ? "memory budget" : "device-local heap",
                             format_bytes(d.figures.available_bytes()), d.fits ? "" : ": does NOT fit");
  }
  if (b.budget) {
    const size_t need = b.device_need(), budget = *b.budget;
    std::cout << (need <= budget
                      ? fmt::format("fits in {}: {} to spare\n", format_bytes(budget), format_bytes(budget - need))
                      : fmt::format("does NOT fit in {}: {} over\n", format_bytes(budget), format_bytes(need - budget)));
  }
  if (b.host_budget) {
    const size_t need = b.process.peak_bytes(), budget = *b.host_budget;
    std::cout << (need <= budget ? fmt::format("process fits in {} of host memory: {} to spare\n",
                                               format_bytes(budget), format_bytes(budget - need))
                                 : fmt::format("process does NOT fit in {} of host memory: {} over\n",
                                               format_bytes(budget), format_bytes(need - budget)));
  }
  if (a.fit) print_fit(b);
  std::cout << fmt::format(
      "Hugging Face Trainer evaluation with compute_metrics would hold {} of float32 logits per eval batch "
      "({} x {} x {}), {} accumulated over {} sequences; memtune's evaluation holds a {}-row logits chunk, and "
      "memtune.Trainer's compute_metrics keeps {} of argmax ids and labels over them.\n",
      format_bytes(static_cast<size_t>(b.hf_batch)), r.per_device_eval_batch_size, r.max_length, config.vocab_size,
      format_bytes(static_cast<size_t>(b.hf_total)), a.eval_sequences, b.eval_model.loss_chunk_rows(),
      format_bytes(static_cast<size_t>(b.python_total)));
}

// The command: the planner loads the config and the data as the run would, the bill plans the
// run's models and process against the budgets, and is printed.
void run_plan(const PlanArgs& a) {
  plan_for_absent_device(a);
  // Measured before anything is loaded: what the binary, its libraries and the backend hold
  // (for an absent device, without its driver).
  const size_t startup_rss = startup_rss_bytes(a.run.backend);
  const TrainingPlanner planner(a, startup_rss);
  TrainingBill bill(a, planner);
  plan_process_and_model(bill);
  plan_budgets(bill, backend_named(a.run.backend));
  if (a.json)
    std::cout << bill_json(bill).dump() << "\n";
  else
    print_bill(bill);
}

}  // namespace

Action add_plan(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  add_training_arguments(app, a->run, ArgumentsFor::Plan);
  app.add_option("--preset", a->preset, model_preset_names() + " (instead of --model)")
      ->excludes(app.get_option("--model_name_or_path"));
  app.add_option("--quantization", a->quantization,
                 "plan the base's linear layers quantized (QLoRA): gptq-int4 | gptq-int8 | awq (group 128)");
  app.add_option("--eval_sequences", a->eval_sequences, "eval set size for the Hugging Face comparison")
      ->capture_default_str();
  app.add_option("--device_memory", a->device_memory,
                 "budget of the device part (the arena), e.g. 24GiB, or auto: the --backend device's budget or heap");
  app.add_option("--vulkan_max_allocation", a->vulkan_max_allocation,
                 "with --backend vulkan: plan for a Vulkan device that is not on this machine, whose one allocation "
                 "holds at most this (maxMemoryAllocationSize, e.g. 4GiB; vulkaninfo shows it) and whose memory is "
                 "--device_memory; no device is opened");
  app.add_option("--world_size", a->world_size, "data-parallel ranks (mpirun -np N): the plan is per rank")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag("--json", a->json, "print one JSON object");
  app.add_flag("--fit", a->fit,
               "search the levers (micro-batch with accumulation keeping the effective batch, gradient "
               "checkpointing, logits chunk, LoRA rank, bfloat16 storage, optimizer offload) for configurations "
               "within --device_memory and --host_memory");
  app.add_flag("--allow_shorter_max_length", a->allow_shorter_max_length, "let --fit also halve max_length");
  return [a] { run_plan(*a); };
}

}  // namespace memtune::cli
