#include "model/load.h"

#include <malloc.h>

#include <algorithm>
#include <filesystem>

#include "io/checkpoint.h"
#include "io/quantized.h"
#include "model/decoder_plan.h"
#include "model/lora.h"

namespace memtune {

void ConfigChanges::apply(ModelConfig& config) const {
  if (dtype) config.torch_dtype = *dtype;
  if (lm_head_bits) quantize_lm_head(config, lm_head_bits);
}

ModelConfig load_model_config(const std::string& dir, const ConfigChanges& changes) {
  ModelConfig config = load_config_json((std::filesystem::path(dir) / "config.json").string());
  changes.apply(config);
  return config;
}

std::unique_ptr<Decoder> load_model(const std::string& dir, ModelOptions options, const std::string& adapter,
                                       const ConfigChanges& changes) {
  const ModelConfig config = load_model_config(dir, changes);
  if (!adapter.empty()) options.lora = load_lora_adapter_config(adapter);
  auto model = std::make_unique<Decoder>(config, options);
  model->parameters().load(CheckpointReader(dir));
  if (!adapter.empty()) model->parameters().load_adapter(adapter);
  // The loading buffers (staging, dtype conversion) were freed; give their pages back too, so
  // they do not sit under the steps' peak.
  malloc_trim(0);
  return model;
}

void add_planned_terms(ProcessPlan& p, const Decoder& model, DType checkpoint_dtype, int world_size) {
  p.arena_bytes = model.plan().peak_bytes();
  p.arena_on_device = !model.backend().arena_in_host_memory();
  p.host_arena_bytes = model.host_plan().peak_bytes();
  // Weights are read in slices of kTransferBytes: one slice's file pages (dropped once copied)
  // and its staging copy at a time.
  int64_t largest = 0;
  for (const ParamSpec& s : model_parameter_specs(model.config())) largest = std::max(largest, s.numel());
  p.weights_mapping_bytes =
      std::min(static_cast<size_t>(largest) * dtype_size(checkpoint_dtype), kTransferBytes) +
      std::min(static_cast<size_t>(largest) * dtype_size(model.config().torch_dtype), kTransferBytes);
  // A packed layer is read whole: its file pages, the tensors read out of them, and the layer in
  // memtune's layout (io/quantized.h) before it is copied over.
  if (const QuantConfig& q = model.config().quant; q.enabled())
    for (const ParamSpec& s : model_parameter_specs(model.config()))
      if (const int bits = packed_bits(model.config(), s))
        p.weights_mapping_bytes = std::max(p.weights_mapping_bytes,
                                           3 * static_cast<size_t>(quantized_layer_bytes(bits, s.shape[1], s.shape[0],
                                                                                       q.groups(s.shape[1]), q.desc_act)));
  p.compute_runtime_bytes =
      (model.options().with_grads ? kTrainingRuntimeBytes : kForwardRuntimeBytes) + model.backend().runtime_bytes();
  if (sixteen_bit_operands(model.config(), model.options(), model.backend()))
    p.compute_runtime_bytes += model.backend().sixteen_bit_runtime_bytes();
  // With more than one rank, MPI's non-blocking allreduce (and ZeRO-1's reduce-scatter) copies
  // the gradients it reduces into buffers of its own while backward runs: about as many bytes as
  // the gradients themselves, so the term is their planned bytes (docs/benchmarks.md).
  p.communication_bytes = world_size > 1 ? model.plan().live_bytes(Phase::Optimizer, Category::Gradients) : 0;
}

}  // namespace memtune
