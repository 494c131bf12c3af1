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

namespace memtune::cli {

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
  return [a] {
    if (!a->vulkan_max_allocation.empty()) {
      if (a->run.backend != "vulkan") throw Error("--vulkan_max_allocation plans for a Vulkan device: add --backend vulkan");
      if (a->device_memory.empty() || a->device_memory == "auto")
        throw Error("--vulkan_max_allocation plans for a device that is not here: give its memory as --device_memory, "
                    "e.g. 24GiB");
      plan_for_absent_vulkan_device({.max_allocation_bytes = parse_bytes(a->vulkan_max_allocation, "--vulkan_max_allocation"),
                                     .heap_bytes = parse_bytes(a->device_memory, "--device_memory")});
    }
    // Measured before anything is loaded: what the binary, its libraries and the backend hold
    // (for an absent device, without its driver).
    const size_t startup_rss = startup_rss_bytes(a->run.backend);
    const TrainingPlanner planner(*a, startup_rss);
    const TrainingArguments& r = a->run;
    const ModelConfig& config = planner.config();
    const EvalData* eval_data = planner.eval_data();
    ProcessPlan process = planner.prepared_process();
    const ModelOptions train = planner.run_options(r.per_device_train_batch_size, r.max_length);
    Decoder train_model(config, train);
    const ModelOptions eval = planner.eval_options(train);
    const Decoder eval_model(config, eval);
    int64_t trainable = 0;
    for (size_t i = 0; i < train_model.parameters().num_trainable(); ++i)
      trainable += train_model.parameters().trainable_spec(i).numel();
    const size_t peak = train_model.plan().peak_bytes();
    add_planned_terms(process, train_model, planner.checkpoint_dtype(), a->world_size);
    if (a->world_size > 1) process.startup_bytes += kMpiInitBytes;  // a run measures it in its startup
    if (eval_data && r.eval_strategy != "no") process.evaluation_bytes = kEvaluationRuntimeBytes;
    // --predict_with_generate: the run's generation view of the model (KV cache, step buffers).
    std::optional<size_t> generation_bytes;
    if (r.predict_with_generate && r.eval_strategy != "no" && eval_data) {
      const GenerationEvalShape shape =
          generation_eval_shape(eval_data->tokens(), r.per_device_eval_batch_size, r.max_new_tokens, r.eval_file);
      const Decoder view(train_model, inference_model_options(config, shape.limits, nullptr, false));
      generation_bytes = view.plan().peak_bytes() + view.host_plan().peak_bytes();
      process.generation_arena_bytes = *generation_bytes;
    }
    // What Hugging Face Trainer's evaluation keeps with a custom compute_metrics: float32 logits
    // [batch, seq, vocab] per batch, accumulated over the eval set (on device, or on the host
    // with eval_accumulation_steps).
    const double hf_batch = 4.0 * static_cast<double>(r.per_device_eval_batch_size * r.max_length * config.vocab_size);
    const double hf_total = 4.0 * static_cast<double>(a->eval_sequences * r.max_length * config.vocab_size);

    nlohmann::json out = {
        {"parameters", model_parameter_count(config)},
        {"trainable_parameters", trainable},
        {"peak_bytes", peak},
        {"process_peak_bytes", process.peak_bytes()},
        {"process", process.to_json()},
        {"micro_batch_tokens", train.max_tokens},
        {"micro_batch_targets", train.max_targets},
        {"world_size", a->world_size},
        {"zero_stage", r.zero_stage},
        {"training", plan_to_json(train_model.plan())},
        {"evaluation", plan_to_json(eval_model.plan())},
        {"generation_arena_bytes", generation_bytes ? nlohmann::json(*generation_bytes) : nlohmann::json()},
        {"hf_eval_logits_bytes_per_batch", hf_batch},
        {"hf_eval_logits_bytes_accumulated", hf_total}};
    out["categories"] = out["training"]["categories"];
    out["phases"] = out["training"]["phases"];
    out["host_arena_bytes"] = train_model.host_plan().peak_bytes();
    // A device backend's fixed costs beside its arena (the CUDA backend's total will be arena +
    // these): named constants until they are measured on a GPU.
    out["cuda_fixed_costs"] = {{"context_bytes", kCudaContextBytes},
                               {"library_workspace_bytes", kCudaLibraryWorkspaceBytes},
                               {"measured", false}};
    // A device backend: the training arena as the device's allocations (cut where no buffer
    // crosses when one allocation cannot hold it).
    const std::optional<DeviceMemoryFigures> device = backend_named(r.backend).device_memory_figures();
    std::vector<size_t> allocations;
    std::string unsplittable;
    if (device) {
      try {
        for (const PlanSegment& s : plan_segments(train_model.plan(), device->max_allocation_bytes))
          allocations.push_back(s.bytes);
      } catch (const Error& e) {
        unsplittable = e.what();
      }
      out["device"] = {{"name", device->device},
                       {"device_heap_bytes", device->heap_bytes},
                       {"max_allocation_bytes", device->max_allocation_bytes},
                       {"allocations", allocations},
                       {"fits", unsplittable.empty() && peak <= device->available_bytes()}};
      if (!unsplittable.empty()) out["device"]["unsplittable"] = unsplittable;
    }
    std::optional<size_t> budget, host_budget;
    if (!a->device_memory.empty()) {
      std::string source;
      budget = device_memory_bytes(a->device_memory, r.backend, &source);
      out["device_memory_bytes"] = *budget;
      if (!source.empty()) out["device_memory_source"] = source;
      out["fits"] = std::max(peak, eval_model.plan().peak_bytes()) <= *budget;
    }
    if (!r.host_memory.empty()) {
      host_budget = parse_bytes(r.host_memory, "--host_memory");
      out["host_memory_bytes"] = *host_budget;
      out["fits_host"] = process.peak_bytes() <= *host_budget;
    }
    FitResult fit;
    if (a->fit) {
      if (!budget && !host_budget) throw Error("--fit needs --device_memory or --host_memory");
      fit = fit_search(planner, eval, process, budget, host_budget);
      const std::vector<FitCandidate>& fitting = fit.fitting;
      nlohmann::json candidates = nlohmann::json::array();
      for (const FitCandidate& k : fitting)
        candidates.push_back({{"flags", k.flags()},
                              {"quantization", k.quantization.empty() ? "none" : k.quantization},
                              {"peak_bytes", k.peak},
                              {"process_peak_bytes", k.process_peak},
                              {"relative_step_time", k.cost / fitting[0].cost}});
      out["fit"] = candidates;
      out["smallest_peak_bytes"] = fit.smallest->peak;
    }
    if (a->json) {
      std::cout << out.dump() << "\n";
      return;
    }
    std::cout << fmt::format(
        "{}: {} parameters, {} trainable ({}), {} storage; micro-batch {} tokens{} ({} x {}{}){}{}{}\n",
        a->preset.empty() ? r.model_name_or_path : a->preset, model_parameter_count(config), trainable,
        r.tuner_type == "lora" ? fmt::format("LoRA r={}", r.lora_rank) : std::string("full fine-tuning"),
        dtype_torch_name(config.torch_dtype), train.max_tokens,
        train.max_targets ? fmt::format(", {} loss targets", train.max_targets) : std::string(),
        r.per_device_train_batch_size, r.max_length, planner.has_train_data() ? ", from the data" : "",
        r.gradient_checkpointing ? ", gradient checkpointing" : "", r.optim_offload ? ", optimizer offloaded" : "",
        a->world_size > 1 ? fmt::format("; per rank of {}{}", a->world_size, r.zero_stage ? " with ZeRO-1" : "")
                          : std::string());
    std::cout << fmt::format(
        "bytes live per phase of a training step, and in evaluation (per_device_eval_batch_size {}, its peak):\n",
        r.per_device_eval_batch_size);
    std::cout << train_model.plan().summary(&eval_model.plan());
    std::cout << fmt::format("evaluation plan: peak {}\n", format_bytes(eval_model.plan().peak_bytes()));
    if (a->world_size > 1)
      std::cout << "communication buffers: none planned (gradients are reduced in place; MPI's own buffers are "
                   "counted in the process line)\n";
    if (r.optim_offload)
      std::cout << fmt::format(
          "optimizer offload: {} of optimizer state in host memory; on the cpu backend host and device are the same "
          "RAM, so this only moves bytes between two accounts (a device backend makes it real)\n",
          format_bytes(train_model.host_plan().peak_bytes()));
    std::cout << process.summary();
    if (device) {
      std::vector<std::string> sizes;
      for (const size_t b : allocations) sizes.push_back(format_bytes(b));
      std::cout << fmt::format("device {} ({}): the training arena is {} ({} one may hold; {} {}){}\n",
                               device->device, r.backend,
                               unsplittable.empty()
                                   ? fmt::format("{} allocation{} of {}", allocations.size(),
                                                 allocations.size() == 1 ? "" : "s", fmt::join(sizes, " + "))
                                   : unsplittable,
                               format_bytes(device->max_allocation_bytes),
                               device->budget_bytes ? "memory budget" : "device-local heap",
                               format_bytes(device->available_bytes()),
                               out["device"]["fits"].get<bool>() ? "" : ": does NOT fit");
    }
    if (budget) {
      const size_t need = std::max(peak, eval_model.plan().peak_bytes());
      std::cout << (need <= *budget
                        ? fmt::format("fits in {}: {} to spare\n", format_bytes(*budget), format_bytes(*budget - need))
                        : fmt::format("does NOT fit in {}: {} over\n", format_bytes(*budget),
                                      format_bytes(need - *budget)));
    }
    if (host_budget) {
      const size_t need = process.peak_bytes();
      std::cout << (need <= *host_budget ? fmt::format("process fits in {} of host memory: {} to spare\n",
                                                       format_bytes(*host_budget), format_bytes(*host_budget - need))
                                         : fmt::format("process does NOT fit in {} of host memory: {} over\n",
                                                       format_bytes(*host_budget), format_bytes(need - *host_budget)));
    }
    if (a->fit) {
      const std::string within = budget && host_budget ? fmt::format("{} (device) and {} (process)",
                                                                     format_bytes(*budget), format_bytes(*host_budget))
                                                       : format_bytes(budget ? *budget : *host_budget);
      const std::vector<FitCandidate>& fitting = fit.fitting;
      if (fitting.empty()) {
        std::cout << fmt::format(
            "--fit: nothing fits in {}. The smallest footprint found is {} ({}), of which the weights alone are {}.\n",
            within, format_bytes(fit.smallest->peak), fit.smallest->flags(),
            format_bytes(train_model.plan().live_bytes(Phase::Forward, Category::Weights)));
      } else {
        std::cout << fmt::format(
            "--fit: {} configurations fit in {}; the fastest (estimated step time, relative; arena, process):\n",
            fitting.size(), within);
        for (size_t i = 0; i < std::min<size_t>(8, fitting.size()); ++i)
          std::cout << fmt::format("  {:.2f}x  {:>12}  {:>12}  {}\n", fitting[i].cost / fitting[0].cost,
                                   format_bytes(fitting[i].peak), format_bytes(fitting[i].process_peak),
                                   fitting[i].flags());
      }
    }
    std::cout << fmt::format(
        "Hugging Face Trainer evaluation with compute_metrics would hold {} of float32 logits per eval batch "
        "({} x {} x {}), {} accumulated over {} sequences; memtune's evaluation holds a {}-row logits chunk.\n",
        format_bytes(static_cast<size_t>(hf_batch)), r.per_device_eval_batch_size, r.max_length, config.vocab_size,
        format_bytes(static_cast<size_t>(hf_total)), a->eval_sequences, eval_model.loss_chunk_rows());
  };
}

}  // namespace memtune::cli
