// A command's model, plan and process prediction from its flags (see command_setup.h).
#include "options/command_setup.h"

#include <fmt/format.h>

#include "backend/backend.h"
#include "backend/registry.h"
#include "core/error.h"
#include "memory/process_memory.h"
#include "model/decoder.h"
#include "model/load.h"
#include "model/lora.h"
#include "options/inference_options.h"

namespace memtune {

DataOptions data_options(const TrainingArguments& args) {
  DataOptions d;
  d.max_length = args.max_length;
  d.truncation_strategy = parse_truncation_strategy(args.truncation_strategy);
  d.train_on_prompt = args.train_on_prompt;
  d.skip_bad_lines = args.skip_bad_lines;
  d.chat_template = args.template_name;
  if (!args.system.empty()) d.record.system = args.system;
  return d;
}

size_t startup_rss_bytes(const std::string& backend) {
  backend_named(backend);
  return current_rss_bytes();
}

size_t device_memory_bytes(const std::string& value, const std::string& backend, std::string* source) {
  if (value != "auto") return parse_bytes(value, "--device_memory");
  if (const auto figures = backend_named(backend).device_memory_figures()) {
    if (source)
      *source = fmt::format("{} of {} ({})", figures->budget_bytes ? "the memory budget" : "the device-local heap",
                            figures->device, backend);
    return figures->available_bytes();
  }
  const size_t available = available_host_memory_bytes();
  if (available == 0) throw Error("--device_memory auto: /proc/meminfo has no MemAvailable; give a size, e.g. 24GiB");
  if (source) *source = fmt::format("the host's available memory (MemAvailable; --backend {} runs in it)", backend);
  return available;
}

std::optional<DType> storage_dtype(const std::string& torch_dtype, bool bf16, bool fp16) {
  if (bf16 && fp16) throw Error("--bf16 and --fp16 are mutually exclusive");
  std::optional<DType> dtype;
  if (bf16) dtype = DType::BF16;
  if (fp16) dtype = DType::F16;
  if (!torch_dtype.empty()) {
    const DType asked = parse_dtype(torch_dtype, "--torch_dtype");
    if (dtype && *dtype != asked)
      throw Error(
          fmt::format("--torch_dtype {} contradicts --{}: give one of them", torch_dtype, bf16 ? "bf16" : "fp16"));
    dtype = asked;
  }
  return dtype;
}

ModelOptions training_model_options(const TrainingArguments& args, int64_t max_tokens, int64_t max_targets, int rank,
                                    int world_size) {
  ModelOptions o;
  o.max_tokens = max_tokens;
  o.max_targets = max_targets;
  o.gradient_checkpointing = args.gradient_checkpointing;
  o.loss_workspace_bytes = static_cast<size_t>(args.loss_workspace_bytes);
  o.with_optimizer = true;
  o.optim_offload = args.optim_offload;
  o.zero_stage = static_cast<int>(args.zero_stage);
  o.rank = rank;
  o.world_size = world_size;
  o.backend = &backend_named(args.backend);
  // --bf16 and --fp16 are Hugging Face's mixed precision (torch.autocast's products) where the
  // backend has such products (Backend::sixteen_bit_products); --torch_dtype alone stores the
  // weights in 16 bits and computes in float32.
  if (args.bf16) o.compute_dtype = DType::BF16;
  if (args.fp16) o.compute_dtype = DType::F16;
  if (args.tuner_type == "lora") {
    o.lora.rank = args.lora_rank;
    o.lora.alpha = args.lora_alpha;
    o.lora.dropout = args.lora_dropout;
    o.lora.use_rslora = args.use_rslora;
    set_lora_targets(o.lora, args.target_modules);
    if (!args.adapter.empty()) o.lora = load_lora_adapter_config(args.adapter);
  }
  return o;
}

ModelChoice choose_model(const ModelFlags& flags) {
  const std::optional<DType> dtype = storage_dtype(flags.torch_dtype, flags.bf16, flags.fp16);
  ModelChoice m;
  m.config = flags.preset.empty() ? load_model_config(flags.model) : model_preset(flags.preset);
  m.checkpoint_dtype = m.config.torch_dtype;
  if (dtype) m.config.torch_dtype = *dtype;
  if (!flags.quantization.empty()) apply_quantization(m.config, flags.quantization);
  if (flags.lm_head_bits) quantize_lm_head(m.config, flags.lm_head_bits);
  return m;
}

void predict_process(ProcessPlan& process, const ModelFlags& flags, const ModelChoice& model, ModelOptions options,
                     int world_size) {
  options.allocate = false;
  if (!flags.adapter.empty()) options.lora = load_lora_adapter_config(flags.adapter);
  add_planned_terms(process, Decoder(model.config, options), model.checkpoint_dtype, world_size);
  if (!flags.host_memory.empty())
    check_host_budget(process, parse_bytes(flags.host_memory, "--host_memory"), "--host_memory");
}

void apply_quantized_activations(const std::string& a, ModelOptions& options, const Backend& backend) {
  if (a == "bf16" && backend.bf16_quantized_products().empty())
    throw Error(fmt::format("--quantized_activations bf16: the {} backend has no bfloat16 products here (the cpu "
                            "backend has them on CPUs with AVX512-BF16 or AMX); use auto, int8 or float",
                            backend.name()));
  options.bf16_quantized_products = a == "bf16" || (a == "auto" && backend.prefers_bf16_quantized_products());
  options.int8_activations = !options.bf16_quantized_products && (a == "int8" || a == "auto");
}

InferenceSetup inference_setup(const ModelFlags& flags, InferenceLimits limits, size_t startup_rss) {
  InferenceSetup s;
  s.model = choose_model(flags);
  if (limits.max_model_len == 0) limits.max_model_len = s.model.config.max_position_embeddings;
  s.options = inference_model_options(s.model.config, limits, &backend_named(flags.backend));
  apply_quantized_activations(flags.quantized_activations, s.options, *s.options.backend);
  for (const std::string& dir : flags.adapter_sets) s.options.adapter_sets.push_back(load_lora_adapter_config(dir));
  if (startup_rss > 0) s.process.measure_preparation(startup_rss);
  predict_process(s.process, flags, s.model, s.options);
  return s;
}

}  // namespace memtune
