// The --fit search (see plan_fit.h).
#include "cli/plan_fit.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"
#include "model/decoder.h"
#include "model/load.h"

namespace memtune::cli {

std::string FitCandidate::flags() const {
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

namespace {

// Estimated step time: the step's matmul and attention FLOPs, each divided by an efficiency
// that falls for small GEMMs (few tokens per micro-batch, few logits rows per chunk). Only the
// ranking is used; the constants are rough fits to this project's CPU benchmarks.
double estimate_cost(const ModelConfig& c, const FitCandidate& k, int64_t chunk_rows, int64_t trainable) {
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

FitResult fit_search(const TrainingPlanner& planner, const ModelOptions& eval, const ProcessPlan& process,
                     std::optional<size_t> device_budget, std::optional<size_t> host_budget) {
  const PlanArgs& a = planner.args();
  const TrainingArguments& r = a.run;
  const ModelConfig& config = planner.config();
  const DType checkpoint_dtype = planner.checkpoint_dtype();
  FitResult result;
  const bool lora = r.tuner_type == "lora";
  std::vector<int64_t> batches, ranks = {lora ? r.lora_rank : 0}, lengths = {r.max_length};
  for (int64_t b = r.per_device_train_batch_size; b >= 1; b /= 2) batches.push_back(b);
  if (lora && r.lora_rank > 1) ranks.push_back(r.lora_rank / 2);
  if (a.allow_shorter_max_length && r.max_length > 1) lengths.push_back(r.max_length / 2);
  std::vector<size_t> workspaces = {static_cast<size_t>(r.loss_workspace_bytes)};
  if (static_cast<size_t>(r.loss_workspace_bytes) > (size_t{32} << 20)) workspaces.push_back(size_t{32} << 20);
  const bool bf16 = config.torch_dtype == DType::BF16;
  std::vector<bool> dtypes = {bf16}, offloads = {r.optim_offload};
  // Offloading needs an optimizer that reads host memory (not a device's: ModelParameters says so).
  const Backend* backend = planner.run_options(r.per_device_train_batch_size, r.max_length).backend;
  if (!r.optim_offload && (!backend || backend->host_addressable())) offloads.push_back(true);
  std::vector<int> zeros = {static_cast<int>(r.zero_stage)};
  if (a.world_size > 1 && r.zero_stage == 0) zeros.push_back(1);
  if (config.torch_dtype == DType::F32) dtypes.push_back(true);
  // LoRA on a float base may also run on its 4-bit copy (QLoRA) when nothing else fits.
  std::vector<std::string> quantizations = {""};
  if (lora && !config.quant.enabled()) {
    ModelConfig probe = config;
    try {
      apply_quantization(probe, "gptq-int4");  // the shapes take 4-bit groups of 128: checked once
      quantizations.push_back("gptq-int4");
    } catch (const Error&) {
    }
  }
  const int64_t effective = r.per_device_train_batch_size * r.gradient_accumulation_steps;
  for (int64_t b : batches)
    for (int64_t length : lengths) {
      const ModelOptions base = planner.run_options(b, length);
      const MicroBatch em = planner.eval_micro(std::min(r.per_device_eval_batch_size, b), length);
      for (bool ckpt : {false, true})
        for (size_t ws : workspaces)
          for (bool to_bf16 : dtypes)
            for (bool offload : offloads)
              for (int zero : zeros)
                for (int64_t rank : ranks)
                  for (const std::string& quantization : quantizations) {
                    FitCandidate k{b,           (effective + b - 1) / b, length, rank, ckpt, to_bf16, offload, zero, ws,
                                   quantization};
                    ModelConfig cc = config;
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
                    const Decoder tm(cc, t), em_model(cc, e);
                    k.peak = std::max(tm.plan().peak_bytes(), em_model.plan().peak_bytes());
                    ProcessPlan kp = process;
                    add_planned_terms(kp, tm, checkpoint_dtype, a.world_size);
                    k.process_peak = kp.peak_bytes();
                    int64_t k_trainable = 0;
                    for (size_t i = 0; i < tm.parameters().num_trainable(); ++i)
                      k_trainable += tm.parameters().trainable_spec(i).numel();
                    k.cost = estimate_cost(cc, k, tm.loss_chunk_rows(), k_trainable);
                    if (!result.smallest || k.peak < result.smallest->peak) result.smallest = k;
                    if ((!device_budget || k.peak <= *device_budget) &&
                        (!host_budget || k.process_peak <= *host_budget))
                      result.fitting.push_back(k);
                  }
    }
  // A 4-bit base costs quality: it is suggested only when no float base fits.
  if (std::any_of(result.fitting.begin(), result.fitting.end(),
                  [](const FitCandidate& k) { return k.quantization.empty(); }))
    std::erase_if(result.fitting, [](const FitCandidate& k) { return !k.quantization.empty(); });
  // Equal estimated times (ZeRO-1 moves as many bytes as ZeRO-0's allreduce): smaller first.
  std::sort(result.fitting.begin(), result.fitting.end(), [](const FitCandidate& x, const FitCandidate& y) {
    return x.cost != y.cost ? x.cost < y.cost : x.peak < y.peak;
  });
  return result;
}

}  // namespace memtune::cli
