#include "model/load.h"

#include <filesystem>

#include "io/checkpoint.h"
#include "model/lora.h"

namespace memtune {

Qwen2Config load_model_config(const std::string& dir, std::optional<DType> dtype) {
  Qwen2Config config = load_qwen2_config((std::filesystem::path(dir) / "config.json").string());
  if (dtype) config.torch_dtype = *dtype;
  return config;
}

std::unique_ptr<Qwen2Model> load_model(const std::string& dir, ModelOptions options, const std::string& adapter,
                                       std::optional<DType> dtype) {
  const Qwen2Config config = load_model_config(dir, dtype);
  if (!adapter.empty()) options.lora = load_lora_adapter_config(adapter);
  auto model = std::make_unique<Qwen2Model>(config, options);
  model->parameters().load(CheckpointReader(dir));
  if (!adapter.empty()) model->parameters().load_adapter(adapter);
  return model;
}

}  // namespace memtune
