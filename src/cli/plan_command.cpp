// `memtune plan`: the whole memory bill of a training run before it starts. It takes every flag
// `memtune train` takes (swap the word and get that run's bill): with --train_file it tokenizes
// the data as the run does and sizes the micro-batches from it, then plans the same buffers the
// run allocates (plan-only: nothing is allocated, so real-size models can be planned anywhere),
// predicts the whole process around them, checks both against device and host budgets, and
// shows what Hugging Face Trainer's evaluation with compute_metrics would hold in logits.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include <malloc.h>

#include "data/batcher.h"
#include "eval/eval_data.h"
#include "eval/generation_eval.h"
#include "eval/metrics.h"
#include "memory/memory_files.h"
#include "memory/process_memory.h"
#include "memory/process_plan.h"
#include "model/load.h"
#include "tokenizer/tokenizer.h"
#include "train/run.h"
#include "model/qwen2.h"

namespace memtune::cli {

namespace {

// One configuration the --fit search considers, with the levers users know.
struct Candidate {
  int64_t batch, accumulation, max_length, lora_rank;
  bool checkpointing, bf16, offload;
  int zero_stage;
  size_t workspace;
  std::string quantization = {};  // a quantized base (LoRA): "gptq-int4"
  size_t peak = 0, process_peak = 0;
  double cost = 0;  // estimated step time, arbitrary units
  std::string flags() const {
    std::string f = fmt::format("--per_device_train_batch_size {} --gradient_accumulation_steps {} --max_length {}",
                                batch, accumulation, max_length);
    if (lora_rank > 0) f += fmt::format(" --lora_rank {}", lora_rank);
    if (checkpointing) f += " --gradient_checkpointing";
    if (bf16) f += " --bf16";
    if (offload) f += " --optim_offload";
    if (zero_stage > 0) f += fmt::format(" --zero_stage {}", zero_stage);
    f += fmt::format(" --loss_workspace_bytes {}", workspace);
    if (!quantization.empty()) f += fmt::format(" (on a {} base: memtune quantize --bits 4)", quantization);
    return f;
  }
};

// Estimated step time: the step's matmul and attention FLOPs, each divided by an efficiency
// that falls for small GEMMs (few tokens per micro-batch, few logits rows per chunk). Only the
// ranking is used; the constants are rough fits to this project's CPU benchmarks.
double estimate_cost(const Qwen2Config& c, const Candidate& k, int64_t chunk_rows, int64_t trainable) {
  const double tokens = static_cast<double>(k.batch * k.accumulation * k.max_length);
  const double D = static_cast<double>(c.hidden_size), I = static_cast<double>(c.intermediate_size);
  const double layer_params = D * (c.q_dim() + 2.0 * c.kv_dim()) + c.q_dim() * D + 3.0 * D * I;
  const double attention = 2.0 * c.head_dim() * c.num_attention_heads * static_cast<double>(k.max_length);
  const double layer_fwd = c.num_hidden_layers * (2.0 * layer_params + attention);
  const double head_fwd = 2.0 * static_cast<double>(c.vocab_size) * D;
  const bool full = k.lora_rank == 0;
  // Backward: input gradients always, weight gradients only when the base is trained.
  const double layer = layer_fwd * ((full ? 3.0 : 2.0) + (k.checkpointing ? 1.0 : 0.0));
  const double head = head_fwd * (full ? 3.0 : 2.0);
  const double micro_tokens = static_cast<double>(k.batch * k.max_length);
  const double layer_eff = micro_tokens / (micro_tokens + 256.0);
  const double head_eff = static_cast<double>(chunk_rows) / (static_cast<double>(chunk_rows) + 64.0);
  // Optimizer offload moves each float32 gradient to the host and the updated parameter back
  // every optimizer step, and runs AdamW there: counted as FLOP-equivalents per byte moved (a
  // device does a few hundred FLOPs in the time a host link moves one byte).
  constexpr double kFlopsPerHostByte = 300.0;
  const double offload = k.offload ? kFlopsPerHostByte * 8.0 * static_cast<double>(trainable) : 0.0;
  return tokens * (layer / layer_eff + head / head_eff) + offload;
}

}  // namespace

Action add_plan(CLI::App& app) {
  struct Args {
    TrainingArguments run;
    std::string preset, device_memory, quantization;
    int64_t eval_sequences = 1000;
    bool json = false, fit = false, allow_shorter_max_length = false;
    int world_size = 1;
  };
  auto a = std::make_shared<Args>();
  add_training_arguments(app, a->run, ArgumentsFor::Plan);
  app.add_option("--preset", a->preset, "qwen2.5-0.5b ... qwen2.5-72b, tiny (instead of --model)")
      ->excludes(app.get_option("--model_name_or_path"));
  app.add_option("--quantization", a->quantization,
                 "plan the base's linear layers quantized (QLoRA): gptq-int4 | gptq-int8 | awq (group 128)");
  app.add_option("--eval_sequences", a->eval_sequences, "eval set size for the Hugging Face comparison")
      ->capture_default_str();
  app.add_option("--device_memory", a->device_memory, "budget of the device part (the arena), e.g. 24GiB");
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
    // Measured before anything is loaded: what the binary and its libraries hold.
    const size_t startup_rss = current_rss_bytes();
    const TrainingArguments& r = a->run;
    if (r.model_name_or_path.empty() == a->preset.empty()) throw Error("plan needs exactly one of --model or --preset");
    validate_training_arguments(r);
    const std::optional<DType> dtype = storage_dtype(r.torch_dtype, r.bf16, r.fp16);
    Qwen2Config config = a->preset.empty() ? load_model_config(r.model_name_or_path) : qwen2_preset(a->preset);
    const DType checkpoint_dtype = config.torch_dtype;  // what the safetensors files hold
    if (dtype) config.torch_dtype = *dtype;
    if (!a->quantization.empty()) apply_quantization(config, a->quantization);

    // The data, tokenized as the run tokenizes it; without it a micro-batch is batch x max_length
    // tokens (the most a padding-free or packed micro-batch can hold).
    ProcessPlan process;
    process.startup_bytes = startup_rss;
    Dataset train_data;
    std::unique_ptr<EvalData> eval_data;
    if (!r.train_file.empty()) {
      if (r.tokenizer.empty() && a->preset.empty() == false)
        throw Error("--train_file with --preset needs --tokenizer (a directory with tokenizer.json)");
      std::optional<Tokenizer> tokenizer(Tokenizer::load(r.tokenizer.empty() ? r.model_name_or_path : r.tokenizer));
      const DataOptions d = data_options(r);
      train_data = load_dataset(r.train_file, *tokenizer, d);
      if (!r.eval_file.empty()) {
        BatchOptions e;
        e.per_device_batch_size = r.per_device_eval_batch_size;
        e.world_size = a->world_size;
        e.rank = a->world_size - 1;
        eval_data = std::make_unique<EvalData>(r.eval_file, *tokenizer, d, wants_classification_metrics(r.metrics),
                                               std::vector<std::string>{}, e);
      }
      // As the run does before its model; evaluation by generation keeps it to decode.
      if (!(r.predict_with_generate && r.eval_strategy != "no" && eval_data)) {
        tokenizer.reset();
        malloc_trim(0);
      }
      process.measure_preparation(startup_rss);
      if (train_data.empty() || train_data.num_targets() == 0)
        throw Error(fmt::format("{}: no example with a trainable token is left to train on", r.train_file));
    }
    // The most tokens and loss targets of one rank's training and evaluation micro-batches.
    struct Micro {
      int64_t tokens, targets;
    };
    auto train_micro = [&](int64_t batch, int64_t length) -> Micro {
      if (train_data.empty()) return {batch * length, 0};
      BatchOptions b;
      b.per_device_batch_size = batch;
      b.packing = r.packing;
      b.max_length = length;
      b.world_size = a->world_size;
      b.rank = a->world_size - 1;
      const Batcher batcher(train_data, b);
      return {batcher.max_micro_batch_tokens(), batcher.max_micro_batch_targets()};
    };
    auto eval_micro = [&](int64_t batch, int64_t length) -> Micro {
      if (!eval_data) return {batch * length, 0};
      return {eval_data->batcher().max_micro_batch_tokens(), eval_data->batcher().max_micro_batch_targets()};
    };
    // The run's one plan serves training and, with an eval file, evaluation: the larger micro-batch.
    auto run_options = [&](int64_t batch, int64_t length) {
      Micro m = train_micro(batch, length);
      if (eval_data) {
        const Micro e = eval_micro(std::min(r.per_device_eval_batch_size, batch), length);
        m = {std::max(m.tokens, e.tokens), std::max(m.targets, e.targets)};
      }
      ModelOptions o = training_model_options(r, m.tokens, m.targets, a->world_size - 1, a->world_size);
      o.allocate = false;
      // With ZeRO-1 rank r holds [n r / W, n (r + 1) / W) of each tensor: the last rank's block is
      // ceil(n / W) of every one, the largest, so its plan bounds every rank's.
      return o;
    };
    const ModelOptions train = run_options(r.per_device_train_batch_size, r.max_length);
    ModelOptions eval = train;
    {
      const Micro e = eval_micro(r.per_device_eval_batch_size, r.max_length);
      eval.max_tokens = e.tokens;
      eval.max_targets = e.targets;
    }
    eval.with_grads = eval.with_optimizer = eval.optim_offload = false;
    eval.zero_stage = 0;
    eval.gradient_checkpointing = false;
    Qwen2Model train_model(config, train);
    const Qwen2Model eval_model(config, eval);
    int64_t trainable = 0;
    for (size_t i = 0; i < train_model.parameters().num_trainable(); ++i)
      trainable += train_model.parameters().trainable_spec(i).numel();
    const size_t peak = train_model.plan().peak_bytes();
    add_planned_terms(process, train_model, checkpoint_dtype, a->world_size);
    if (a->world_size > 1) process.startup_bytes += kMpiInitBytes;  // a run measures it in its startup
    if (eval_data && r.eval_strategy != "no") process.evaluation_bytes = kEvaluationRuntimeBytes;
    // --predict_with_generate: the run's generation view of the model (KV cache, step buffers).
    std::optional<size_t> generation_bytes;
    if (r.predict_with_generate && r.eval_strategy != "no" && eval_data) {
      const GenerationEvalShape shape =
          generation_eval_shape(eval_data->tokens(), r.per_device_eval_batch_size, r.max_new_tokens, r.eval_file);
      const Qwen2Model view(train_model, inference_model_options(config, shape.limits, nullptr, false));
      generation_bytes = view.plan().peak_bytes() + view.host_plan().peak_bytes();
      process.generation_arena_bytes = *generation_bytes;
    }
    // What Hugging Face Trainer's evaluation keeps with a custom compute_metrics: float32 logits
    // [batch, seq, vocab] per batch, accumulated over the eval set (on device, or on the host
    // with eval_accumulation_steps).
    const double hf_batch =
        4.0 * static_cast<double>(r.per_device_eval_batch_size * r.max_length * config.vocab_size);
    const double hf_total = 4.0 * static_cast<double>(a->eval_sequences * r.max_length * config.vocab_size);

    nlohmann::json out = {{"parameters", qwen2_parameter_count(config)},
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
    std::optional<size_t> budget, host_budget;
    if (!a->device_memory.empty()) {
      budget = parse_bytes(a->device_memory, "--device_memory");
      out["device_memory_bytes"] = *budget;
      out["fits"] = std::max(peak, eval_model.plan().peak_bytes()) <= *budget;
    }
    if (!r.host_memory.empty()) {
      host_budget = parse_bytes(r.host_memory, "--host_memory");
      out["host_memory_bytes"] = *host_budget;
      out["fits_host"] = process.peak_bytes() <= *host_budget;
    }
    std::vector<Candidate> fitting;
    std::optional<Candidate> smallest;
    if (a->fit) {
      if (!budget && !host_budget) throw Error("--fit needs --device_memory or --host_memory");
      const bool lora = r.tuner_type == "lora";
      std::vector<int64_t> batches, ranks = {lora ? r.lora_rank : 0}, lengths = {r.max_length};
      for (int64_t b = r.per_device_train_batch_size; b >= 1; b /= 2) batches.push_back(b);
      if (lora && r.lora_rank > 1) ranks.push_back(r.lora_rank / 2);
      if (a->allow_shorter_max_length && r.max_length > 1) lengths.push_back(r.max_length / 2);
      std::vector<size_t> workspaces = {static_cast<size_t>(r.loss_workspace_bytes)};
      if (static_cast<size_t>(r.loss_workspace_bytes) > (size_t{32} << 20)) workspaces.push_back(size_t{32} << 20);
      const bool bf16 = config.torch_dtype == DType::BF16;
      std::vector<bool> dtypes = {bf16}, offloads = {r.optim_offload};
      if (!r.optim_offload) offloads.push_back(true);
      std::vector<int> zeros = {static_cast<int>(r.zero_stage)};
      if (a->world_size > 1 && r.zero_stage == 0) zeros.push_back(1);
      if (config.torch_dtype == DType::F32) dtypes.push_back(true);
      // LoRA on a float base may also run on its 4-bit copy (QLoRA) when nothing else fits.
      std::vector<std::string> quantizations = {""};
      if (lora && !config.quant.enabled()) {
        Qwen2Config probe = config;
        try {
          apply_quantization(probe, "gptq-int4");  // the shapes take 4-bit groups of 128: checked once
          quantizations.push_back("gptq-int4");
        } catch (const Error&) {
        }
      }
      const int64_t effective = r.per_device_train_batch_size * r.gradient_accumulation_steps;
      for (int64_t b : batches)
        for (int64_t length : lengths) {
          const ModelOptions base = run_options(b, length);
          const Micro em = eval_micro(std::min(r.per_device_eval_batch_size, b), length);
          for (bool ckpt : {false, true})
            for (size_t ws : workspaces)
              for (bool to_bf16 : dtypes)
                for (bool offload : offloads)
                  for (int zero : zeros)
                    for (int64_t rank : ranks)
                      for (const std::string& quantization : quantizations) {
                      Candidate k{b, (effective + b - 1) / b, length, rank, ckpt, to_bf16, offload, zero, ws, quantization};
                      Qwen2Config cc = config;
                      if (to_bf16) cc.torch_dtype = DType::BF16;
                      if (!quantization.empty()) cc.quant = parse_quantization_name(quantization);
                      ModelOptions t = base;
                      t.gradient_checkpointing = ckpt;
                      t.loss_workspace_bytes = ws;
                      t.optim_offload = offload;
                      t.zero_stage = zero;
                      if (rank > 0) t.lora.rank = rank;
                      ModelOptions e = eval;
                      e.max_tokens = em.tokens;
                      e.max_targets = em.targets;
                      e.loss_workspace_bytes = ws;
                      if (rank > 0) e.lora.rank = rank;
                      const Qwen2Model tm(cc, t), em_model(cc, e);
                      k.peak = std::max(tm.plan().peak_bytes(), em_model.plan().peak_bytes());
                      ProcessPlan kp = process;
                      add_planned_terms(kp, tm, checkpoint_dtype, a->world_size);
                      k.process_peak = kp.peak_bytes();
                      int64_t k_trainable = 0;
                      for (size_t i = 0; i < tm.parameters().num_trainable(); ++i)
                        k_trainable += tm.parameters().trainable_spec(i).numel();
                      k.cost = estimate_cost(cc, k, tm.loss_chunk_rows(), k_trainable);
                      if (!smallest || k.peak < smallest->peak) smallest = k;
                      if ((!budget || k.peak <= *budget) && (!host_budget || k.process_peak <= *host_budget))
                        fitting.push_back(k);
                    }
        }
      // A 4-bit base costs quality: it is suggested only when no float base fits.
      if (std::any_of(fitting.begin(), fitting.end(), [](const Candidate& k) { return k.quantization.empty(); }))
        std::erase_if(fitting, [](const Candidate& k) { return !k.quantization.empty(); });
      // Equal estimated times (ZeRO-1 moves as many bytes as ZeRO-0's allreduce): smaller first.
      std::sort(fitting.begin(), fitting.end(), [](const Candidate& x, const Candidate& y) {
        return x.cost != y.cost ? x.cost < y.cost : x.peak < y.peak;
      });
      nlohmann::json fit = nlohmann::json::array();
      for (const Candidate& k : fitting)
        fit.push_back({{"flags", k.flags()},
                       {"quantization", k.quantization.empty() ? "none" : k.quantization},
                       {"peak_bytes", k.peak},
                       {"process_peak_bytes", k.process_peak},
                       {"relative_step_time", k.cost / fitting[0].cost}});
      out["fit"] = fit;
      out["smallest_peak_bytes"] = smallest->peak;
    }
    if (a->json) {
      std::cout << out.dump() << "\n";
      return;
    }
    std::cout << fmt::format(
        "{}: {} parameters, {} trainable ({}), {} storage; micro-batch {} tokens{} ({} x {}{}){}{}{}\n",
        a->preset.empty() ? r.model_name_or_path : a->preset, qwen2_parameter_count(config), trainable,
        r.tuner_type == "lora" ? fmt::format("LoRA r={}", r.lora_rank) : std::string("full fine-tuning"),
        dtype_torch_name(config.torch_dtype), train.max_tokens,
        train.max_targets ? fmt::format(", {} loss targets", train.max_targets) : std::string(),
        r.per_device_train_batch_size, r.max_length, train_data.empty() ? "" : ", from the data",
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
    if (budget) {
      const size_t need = std::max(peak, eval_model.plan().peak_bytes());
      std::cout << (need <= *budget ? fmt::format("fits in {}: {} to spare\n", format_bytes(*budget),
                                                  format_bytes(*budget - need))
                                    : fmt::format("does NOT fit in {}: {} over\n", format_bytes(*budget),
                                                  format_bytes(need - *budget)));
    }
    if (host_budget) {
      const size_t need = process.peak_bytes();
      std::cout << (need <= *host_budget
                        ? fmt::format("process fits in {} of host memory: {} to spare\n", format_bytes(*host_budget),
                                      format_bytes(*host_budget - need))
                        : fmt::format("process does NOT fit in {} of host memory: {} over\n",
                                      format_bytes(*host_budget), format_bytes(need - *host_budget)));
    }
    if (a->fit) {
      const std::string within =
          budget && host_budget
              ? fmt::format("{} (device) and {} (process)", format_bytes(*budget), format_bytes(*host_budget))
              : format_bytes(budget ? *budget : *host_budget);
      if (fitting.empty()) {
        std::cout << fmt::format(
            "--fit: nothing fits in {}. The smallest footprint found is {} ({}), of which the weights alone are {}.\n",
            within, format_bytes(smallest->peak), smallest->flags(),
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
