// `memtune plan`: the whole memory bill of a training or evaluation run before it starts,
// computed from the same buffer declarations the run allocates (plan-only: nothing is allocated,
// so real-size models can be planned anywhere), checked against a device budget, next to what
// Hugging Face Trainer's evaluation with compute_metrics would hold in logits.
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
#include "memory/memory_files.h"
#include "model/qwen2.h"

namespace memtune::cli {

namespace {

// "24GiB", "24 GB", "1.5e9", "512MiB": binary and decimal units.
size_t parse_bytes(const std::string& text) {
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    throw Error(fmt::format("--device_memory \"{}\": expected a size such as 24GiB or 16GB", text));
  }
  std::string unit = text.substr(pos);
  unit.erase(0, unit.find_first_not_of(' '));
  const std::pair<const char*, double> units[] = {
      {"", 1},     {"B", 1},    {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
      {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9},     {"TB", 1e12}};
  for (const auto& [name, factor] : units)
    if (unit == name && value >= 0) return static_cast<size_t>(std::llround(value * factor));
  throw Error(fmt::format("--device_memory \"{}\": unknown unit (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)", text));
}

// One configuration the --fit search considers, with the levers users know.
struct Candidate {
  int64_t batch, accumulation, max_length, lora_rank;
  bool checkpointing, bf16, offload;
  int zero_stage;
  size_t workspace;
  size_t peak = 0;
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
    std::string model, preset, tuner_type = "lora", torch_dtype, device_memory;
    std::vector<std::string> target_modules = {"all-linear"};
    int64_t lora_rank = 8, batch = 8, eval_batch = 8, max_length = 2048, eval_sequences = 1000;
    int64_t loss_workspace_bytes = static_cast<int64_t>(kDefaultLossWorkspaceBytes);
    bool gradient_checkpointing = false, bf16 = false, json = false, fit = false, allow_shorter_max_length = false;
    bool optim_offload = false;
    int world_size = 1, zero_stage = 0;
    std::string train_file;
    int64_t gradient_accumulation_steps = 1;
  };
  auto a = std::make_shared<Args>();
  auto* model = app.add_option("--model", a->model, "model directory (its config.json)");
  auto* preset = app.add_option("--preset", a->preset, "qwen2.5-0.5b ... qwen2.5-72b, tiny");
  model->excludes(preset);
  app.add_option("--tuner_type", a->tuner_type, "lora | full")->capture_default_str();
  app.add_option("--lora_rank", a->lora_rank)->capture_default_str();
  app.add_option("--target_modules", a->target_modules, "module names or all-linear")->delimiter(',');
  app.add_option("--per_device_train_batch_size", a->batch)->capture_default_str();
  app.add_option("--per_device_eval_batch_size", a->eval_batch)->capture_default_str();
  app.add_option("--max_length", a->max_length)->capture_default_str();
  app.add_option("--eval_sequences", a->eval_sequences, "eval set size for the Hugging Face comparison")
      ->capture_default_str();
  app.add_option("--torch_dtype", a->torch_dtype, "storage dtype (default: the config's)");
  app.add_flag("--bf16", a->bf16, "store weights in bfloat16");
  app.add_flag("--gradient_checkpointing", a->gradient_checkpointing);
  app.add_option("--loss_workspace_bytes", a->loss_workspace_bytes)->capture_default_str();
  app.add_option("--device_memory", a->device_memory, "budget to check against, e.g. 24GiB");
  app.add_flag("--optim_offload", a->optim_offload, "AdamW state and float32 masters in host memory");
  app.add_option("--world_size", a->world_size, "data-parallel ranks (mpirun -np N): the plan is per rank")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--zero_stage", a->zero_stage, "1: optimizer state sharded over the ranks (ZeRO-1)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1));
  app.add_option("--train_file", a->train_file, "the training data, for the host-memory estimate of its token ids")
      ->check(CLI::ExistingFile);
  app.add_flag("--json", a->json, "print one JSON object");
  app.add_option("--gradient_accumulation_steps", a->gradient_accumulation_steps)->capture_default_str();
  app.add_flag("--fit", a->fit,
               "search the levers (micro-batch with accumulation keeping the effective batch, gradient "
               "checkpointing, logits chunk, LoRA rank, bfloat16 storage, optimizer offload) for configurations "
               "within --device_memory");
  app.add_flag("--allow_shorter_max_length", a->allow_shorter_max_length, "let --fit also halve max_length");
  return [a] {
    if (a->model.empty() == a->preset.empty()) throw Error("plan needs exactly one of --model or --preset");
    if (a->batch <= 0 || a->eval_batch <= 0 || a->max_length <= 0)
      throw Error("batch sizes and --max_length must be positive");
    if (a->tuner_type != "lora" && a->tuner_type != "full")
      throw Error(fmt::format("--tuner_type must be lora or full, got \"{}\"", a->tuner_type));
    Qwen2Config config = a->preset.empty()
                             ? load_qwen2_config((std::filesystem::path(a->model) / "config.json").string())
                             : qwen2_preset(a->preset);
    const DType checkpoint_dtype = config.torch_dtype;  // what the safetensors files hold
    if (a->bf16) config.torch_dtype = DType::BF16;
    if (!a->torch_dtype.empty()) config.torch_dtype = parse_dtype(a->torch_dtype, "--torch_dtype");

    // A micro-batch never holds more than batch x max_length tokens (padding-free or packed).
    ModelOptions train;
    train.allocate = false;
    train.max_tokens = a->batch * a->max_length;
    train.gradient_checkpointing = a->gradient_checkpointing;
    train.loss_workspace_bytes = static_cast<size_t>(a->loss_workspace_bytes);
    train.with_optimizer = true;
    train.optim_offload = a->optim_offload;
    train.zero_stage = a->zero_stage;
    // With ZeRO-1 rank r holds [n r / W, n (r + 1) / W) of each tensor: the last rank's block is
    // ceil(n / W) of every one, the largest, so its plan bounds every rank's.
    train.world_size = a->world_size;
    train.rank = a->world_size - 1;
    if (a->tuner_type == "lora") {
      train.lora.rank = a->lora_rank;
      set_lora_targets(train.lora, a->target_modules);
    }
    ModelOptions eval = train;
    eval.max_tokens = a->eval_batch * a->max_length;
    eval.with_grads = eval.with_optimizer = eval.optim_offload = false;
    eval.zero_stage = 0;
    eval.gradient_checkpointing = false;
    const Qwen2Model train_model(config, train), eval_model(config, eval);
    int64_t trainable = 0;
    for (size_t i = 0; i < train_model.parameters().num_trainable(); ++i)
      trainable += train_model.parameters().trainable_spec(i).numel();
    const size_t peak = train_model.plan().peak_bytes();
    // What Hugging Face Trainer's evaluation keeps with a custom compute_metrics: float32 logits
    // [batch, seq, vocab] per batch, accumulated over the eval set (on device, or on the host
    // with eval_accumulation_steps).
    const double hf_batch = 4.0 * static_cast<double>(a->eval_batch * a->max_length * config.vocab_size);
    const double hf_total = 4.0 * static_cast<double>(a->eval_sequences * a->max_length * config.vocab_size);

    nlohmann::json out = {{"parameters", qwen2_parameter_count(config)},
                          {"trainable_parameters", trainable},
                          {"peak_bytes", peak},
                          {"world_size", a->world_size},
                          {"zero_stage", a->zero_stage},
                          {"training", plan_to_json(train_model.plan())},
                          {"evaluation", plan_to_json(eval_model.plan())},
                          {"hf_eval_logits_bytes_per_batch", hf_batch},
                          {"hf_eval_logits_bytes_accumulated", hf_total}};
    out["categories"] = out["training"]["categories"];
    out["phases"] = out["training"]["phases"];
    // Host memory: the checkpoint's files are mmap'd while loading (page cache, reclaimable);
    // offloaded optimizer state is planned; the dataset keeps int32 ids and labels per token,
    // estimated from the file at one token per 3 bytes of JSONL.
    const size_t host_weights = static_cast<size_t>(qwen2_parameter_count(config)) * dtype_size(checkpoint_dtype);
    const size_t host_optimizer = train_model.host_plan().peak_bytes();
    const size_t host_dataset =
        a->train_file.empty() ? 0 : static_cast<size_t>(std::filesystem::file_size(a->train_file)) / 3 * 8;
    out["host"] = {{"mmapped_weights_bytes", host_weights},
                   {"optimizer_state_bytes", host_optimizer},
                   {"dataset_bytes", host_dataset},
                   {"total_bytes", host_weights + host_optimizer + host_dataset}};
    std::optional<size_t> budget;
    if (!a->device_memory.empty()) {
      budget = parse_bytes(a->device_memory);
      out["device_memory_bytes"] = *budget;
      out["fits"] = std::max(peak, eval_model.plan().peak_bytes()) <= *budget;
    }
    std::vector<Candidate> fitting;
    std::optional<Candidate> smallest;
    if (a->fit) {
      if (!budget) throw Error("--fit needs --device_memory");
      const bool lora = a->tuner_type == "lora";
      std::vector<int64_t> batches, ranks = {lora ? a->lora_rank : 0}, lengths = {a->max_length};
      for (int64_t b = a->batch; b >= 1; b /= 2) batches.push_back(b);
      if (lora && a->lora_rank > 1) ranks.push_back(a->lora_rank / 2);
      if (a->allow_shorter_max_length && a->max_length > 1) lengths.push_back(a->max_length / 2);
      std::vector<size_t> workspaces = {static_cast<size_t>(a->loss_workspace_bytes)};
      if (static_cast<size_t>(a->loss_workspace_bytes) > (size_t{32} << 20)) workspaces.push_back(size_t{32} << 20);
      std::vector<bool> dtypes = {a->bf16}, offloads = {a->optim_offload};
      if (!a->optim_offload) offloads.push_back(true);
      std::vector<int> zeros = {a->zero_stage};
      if (a->world_size > 1 && a->zero_stage == 0) zeros.push_back(1);
      if (!a->bf16 && config.torch_dtype == DType::F32) dtypes.push_back(true);
      const int64_t effective = a->batch * a->gradient_accumulation_steps;
      for (int64_t b : batches)
        for (bool ckpt : {false, true})
          for (size_t ws : workspaces)
            for (bool bf16 : dtypes)
              for (bool offload : offloads)
                for (int zero : zeros)
                  for (int64_t rank : ranks)
                    for (int64_t length : lengths) {
                      Candidate k{b, (effective + b - 1) / b, length, rank, ckpt, bf16, offload, zero, ws};
                      Qwen2Config cc = config;
                      if (bf16) cc.torch_dtype = DType::BF16;
                      ModelOptions t = train;
                      t.max_tokens = b * length;
                      t.gradient_checkpointing = ckpt;
                      t.loss_workspace_bytes = ws;
                      t.optim_offload = offload;
                      t.zero_stage = zero;
                      if (rank > 0) t.lora.rank = rank;
                      ModelOptions e = eval;
                      e.max_tokens = std::min(a->eval_batch, b) * length;
                      e.loss_workspace_bytes = ws;
                      if (rank > 0) e.lora.rank = rank;
                      const Qwen2Model tm(cc, t), em(cc, e);
                      k.peak = std::max(tm.plan().peak_bytes(), em.plan().peak_bytes());
                      int64_t k_trainable = 0;
                      for (size_t i = 0; i < tm.parameters().num_trainable(); ++i)
                        k_trainable += tm.parameters().trainable_spec(i).numel();
                      k.cost = estimate_cost(cc, k, tm.loss_chunk_rows(), k_trainable);
                      if (!smallest || k.peak < smallest->peak) smallest = k;
                      if (k.peak <= *budget) fitting.push_back(k);
                    }
      // Equal estimated times (ZeRO-1 moves as many bytes as ZeRO-0's allreduce): smaller first.
      std::sort(fitting.begin(), fitting.end(), [](const Candidate& x, const Candidate& y) {
        return x.cost != y.cost ? x.cost < y.cost : x.peak < y.peak;
      });
      nlohmann::json fit = nlohmann::json::array();
      for (const Candidate& k : fitting)
        fit.push_back({{"flags", k.flags()}, {"peak_bytes", k.peak}, {"relative_step_time", k.cost / fitting[0].cost}});
      out["fit"] = fit;
      out["smallest_peak_bytes"] = smallest->peak;
    }
    if (a->json) {
      std::cout << out.dump() << "\n";
      return;
    }
    std::cout << fmt::format(
        "{}: {} parameters, {} trainable ({}), {} storage; micro-batch {} x {} tokens{}{}{}\n",
        a->preset.empty() ? a->model : a->preset, qwen2_parameter_count(config), trainable,
        a->tuner_type == "lora" ? fmt::format("LoRA r={}", a->lora_rank) : std::string("full fine-tuning"),
        dtype_torch_name(config.torch_dtype), a->batch, a->max_length,
        a->gradient_checkpointing ? ", gradient checkpointing" : "", a->optim_offload ? ", optimizer offloaded" : "",
        a->world_size > 1 ? fmt::format("; per rank of {}{}", a->world_size, a->zero_stage ? " with ZeRO-1" : "")
                          : std::string());
    std::cout << fmt::format(
        "bytes live per phase of a training step, and in evaluation (per_device_eval_batch_size {}, its peak):\n",
        a->eval_batch);
    std::cout << train_model.plan().summary(&eval_model.plan());
    std::cout << fmt::format("evaluation plan: peak {}\n", format_bytes(eval_model.plan().peak_bytes()));
    if (a->world_size > 1)
      std::cout << "communication buffers: none planned (gradients are reduced in place; MPI's internal buffers "
                   "are outside the plan)\n";
    std::cout << fmt::format("host memory: {} checkpoint mmap'd while loading, {} offloaded optimizer state, {}\n",
                             format_bytes(host_weights), format_bytes(host_optimizer),
                             a->train_file.empty()
                                 ? std::string("dataset not given (--train_file)")
                                 : fmt::format("about {} of dataset token ids", format_bytes(host_dataset)));
    if (budget) {
      const size_t need = std::max(peak, eval_model.plan().peak_bytes());
      std::cout << (need <= *budget
                        ? fmt::format("fits in {}: {} to spare\n", format_bytes(*budget), format_bytes(*budget - need))
                        : fmt::format("does NOT fit in {}: {} over\n", format_bytes(*budget),
                                      format_bytes(need - *budget)));
    }
    if (a->fit) {
      if (fitting.empty()) {
        std::cout << fmt::format(
            "--fit: nothing fits in {}. The smallest footprint found is {} ({}), of which the weights alone are {}.\n",
            format_bytes(*budget), format_bytes(smallest->peak), smallest->flags(),
            format_bytes(train_model.plan().live_bytes(Phase::Forward, Category::Weights)));
      } else {
        std::cout << fmt::format("--fit: {} configurations fit in {}; the fastest (estimated step time, relative):\n",
                                 fitting.size(), format_bytes(*budget));
        for (size_t i = 0; i < std::min<size_t>(8, fitting.size()); ++i)
          std::cout << fmt::format("  {:.2f}x  {:>12}  {}\n", fitting[i].cost / fitting[0].cost,
                                   format_bytes(fitting[i].peak), fitting[i].flags());
      }
    }
    std::cout << fmt::format(
        "Hugging Face Trainer evaluation with compute_metrics would hold {} of float32 logits per eval batch "
        "({} x {} x {}), {} accumulated over {} sequences; memtune's evaluation holds a {}-row logits chunk.\n",
        format_bytes(static_cast<size_t>(hf_batch)), a->eval_batch, a->max_length, config.vocab_size,
        format_bytes(static_cast<size_t>(hf_total)), a->eval_sequences, eval_model.loss_chunk_rows());
  };
}

}  // namespace memtune::cli
