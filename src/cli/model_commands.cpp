// `memtune init-model` and `memtune dump`: create a checkpoint, and inspect one numerically.
#include <fmt/format.h>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "backend/registry.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/json_reader.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/load.h"
#include "options/arguments.h"
#include "options/command_setup.h"
#include "model/config.h"

namespace memtune::cli {

namespace {

// `key=value`: value is taken as JSON (numbers, booleans, null) or else as a string.
void apply_override(nlohmann::json& doc, const std::string& assignment) {
  const auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) throw Error(fmt::format("--set {}: expected key=value", assignment));
  const std::string key = assignment.substr(0, eq), value = assignment.substr(eq + 1);
  doc[key] = nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false);
  if (doc[key].is_discarded()) doc[key] = value;
}

}  // namespace

Action add_init_model(CLI::App& app) {
  struct Args {
    std::string preset, config, out, torch_dtype, backend = "cpu", max_shard_size = "5GB";
    uint64_t seed = 42;
    std::vector<std::string> overrides;
  };
  auto args = std::make_shared<Args>();
  auto* preset = app.add_option("--preset", args->preset, model_preset_names());
  auto* config = app.add_option("--config", args->config, "a config.json to take the shapes from");
  preset->excludes(config);
  app.add_option("--out", args->out, "output directory")->required();
  app.add_option("--seed", args->seed, "initialization seed")->capture_default_str();
  app.add_option("--torch_dtype", args->torch_dtype, "storage dtype: float32 | bfloat16 | float16");
  app.add_option("--set", args->overrides, "override a config field, key=value (repeatable)");
  add_max_shard_size_option(app, args->max_shard_size);
  add_backend_option(app, args->backend);
  return [args] {
    if (args->preset.empty() == args->config.empty())
      throw Error("init-model needs exactly one of --preset or --config");
    nlohmann::json doc =
        args->preset.empty() ? read_json_file(args->config) : config_to_json(model_preset(args->preset));
    for (const auto& o : args->overrides) apply_override(doc, o);
    if (!args->torch_dtype.empty()) {
      doc["torch_dtype"] = std::string(dtype_torch_name(parse_dtype(args->torch_dtype, "--torch_dtype")));
      doc.erase("dtype");
    }
    const ModelConfig cfg = parse_model_config(doc, args->preset.empty() ? args->config : "--preset " + args->preset);
    ModelOptions options;
    options.max_tokens = 1;
    options.with_grads = false;
    options.loss_workspace_bytes = 0;
    options.backend = &backend_named(args->backend);
    Decoder model(cfg, options);
    model.parameters().init_random(args->seed);
    model.parameters().save(args->out, parse_bytes(args->max_shard_size, "--max_shard_size"));
    std::cout << fmt::format("wrote {} ({} parameters, {}, seed {})\n", args->out, model_parameter_count(cfg),
                             dtype_torch_name(cfg.torch_dtype), args->seed);
  };
}

Action add_dump(CLI::App& app) {
  struct Args {
    std::string model, input, out, adapter, backend = "cpu", quantized_activations = "auto";
    int lm_head_bits = 0;
    bool gradient_checkpointing = false;
    size_t loss_workspace_bytes = kDefaultLossWorkspaceBytes;
    std::optional<uint64_t> dropout_seed;
  };
  auto args = std::make_shared<Args>();
  app.add_option("--model", args->model, "model directory (config.json + safetensors)")->required();
  app.add_option("--input", args->input, "JSON {\"input_ids\": [[...]], \"labels\": [[...]]}")->required();
  app.add_option("--out", args->out, "output .safetensors")->required();
  app.add_option("--adapter", args->adapter,
                 "a PEFT LoRA adapter dir: the base is frozen and gradients are the adapter's");
  app.add_flag("--gradient_checkpointing", args->gradient_checkpointing, "recompute layer activations in backward");
  app.add_option("--loss_workspace_bytes", args->loss_workspace_bytes, "budget for the LM head's logits chunk")
      ->capture_default_str();
  app.add_option("--dropout_seed", args->dropout_seed,
                 "apply the adapter's lora_dropout as training does, its masks drawn from this seed (the mask of "
                 "layer l, site s is keyed by mix64(seed ^ ((l * 7 + s + 1) * 0x9e3779b97f4a7c15)), core/rng.h)");
  add_backend_option(app, args->backend);
  add_quantized_model_options(app, args->quantized_activations, args->lm_head_bits);
  return [args] {
    const nlohmann::json doc = read_json_file(args->input);
    auto rows_of = [&](const char* key) {
      if (!doc.contains(key)) return std::vector<std::vector<int32_t>>{};
      try {
        return doc.at(key).get<std::vector<std::vector<int32_t>>>();
      } catch (const nlohmann::json::exception&) {
        throw Error(fmt::format("{}: \"{}\" must be a list of lists of integers", args->input, key));
      }
    };
    const auto ids = rows_of("input_ids");
    auto labels = doc.contains("labels") ? rows_of("labels") : ids;
    if (ids.empty() || ids[0].empty())
      throw Error(fmt::format("{}: \"input_ids\" must hold at least one non-empty row", args->input));
    const size_t B = ids.size(), T = ids[0].size();
    if (labels.size() != B)
      throw Error(fmt::format("{}: \"labels\" has {} rows, \"input_ids\" has {}", args->input, labels.size(), B));
    std::vector<int32_t> flat_ids, flat_labels, cu{0};
    for (size_t b = 0; b < B; ++b) {
      if (ids[b].size() != T || labels[b].size() != T)
        throw Error(fmt::format("{}: row {} has a different length than row 0 ({} tokens); rows must be equal",
                                args->input, b, T));
      flat_ids.insert(flat_ids.end(), ids[b].begin(), ids[b].end());
      flat_labels.insert(flat_labels.end(), labels[b].begin(), labels[b].end());
      cu.push_back(static_cast<int32_t>(flat_ids.size()));
    }

    ModelOptions options;
    options.max_tokens = static_cast<int64_t>(B * T);
    options.gradient_checkpointing = args->gradient_checkpointing;
    options.loss_workspace_bytes = args->loss_workspace_bytes;
    options.backend = &backend_named(args->backend);
    // A quantized base has no gradients of its own: without an adapter, logits and loss only.
    // So has a mixture-of-experts model on a backend that runs only its forward pass
    // (Backend::trains_mixture_of_experts).
    const ModelConfig stored = load_model_config(args->model);
    options.with_grads = (!args->adapter.empty() || !stored.quant.enabled()) &&
                         (!stored.moe.enabled() || options.backend->trains_mixture_of_experts());
    apply_quantized_activations(args->quantized_activations, options, *options.backend);
    const std::unique_ptr<Decoder> model = load_model(args->model, options, args->adapter, {std::nullopt, args->lm_head_bits});
    const ModelConfig& cfg = model->config();
    if (args->dropout_seed) {
      if (args->adapter.empty()) throw Error("--dropout_seed applies an adapter's lora_dropout: give --adapter");
      model->set_dropout_seed(*args->dropout_seed);
    }
    model->parameters().zero_grads();
    std::vector<float> logits(B * T * static_cast<size_t>(cfg.vocab_size));
    const TokenBatch batch{flat_ids, flat_labels, cu};
    const LossSum loss = options.with_grads ? model->forward_backward(batch, logits.data())
                                            : model->forward_loss(batch, logits.data());
    // The HF mean; an all-ignored batch gives NaN exactly like torch's mean over nothing.
    const float mean = static_cast<float>(loss.sum / static_cast<double>(loss.count));
    const float inv_count = 1.0f / static_cast<float>(loss.count);

    std::vector<TensorToWrite> tensors;
    tensors.push_back({"logits", DType::F32, {int64_t(B), int64_t(T), cfg.vocab_size}, logits.data()});
    tensors.push_back({"loss", DType::F32, {}, &mean});
    std::vector<std::vector<float>> grads;
    for (size_t i = 0; options.with_grads && i < model->parameters().num_trainable(); ++i) {
      const auto& p = model->parameters().trainable_spec(i);
      grads.push_back(download_f32(model->backend(), model->parameters().trainable_grad(i)));
      for (float& v : grads.back()) v *= inv_count;
      tensors.push_back({"grad." + p.name, DType::F32, p.shape, grads.back().data()});
    }
    write_safetensors(args->out, tensors);
    std::cout << fmt::format("loss {:.6f} over {} target tokens ({} sequences x {} tokens)\n", mean, loss.count, B, T);
    std::cout << fmt::format("memory plan: arena {}, {} of it handed out, logits chunk {} rows\n",
                             format_bytes(model->plan().peak_bytes()), format_bytes(model->arena().high_water_bytes()),
                             model->loss_chunk_rows());
    std::cout << model->plan().summary();
    std::cout << "wrote " << args->out << "\n";
  };
}

Action add_merge(CLI::App& app) {
  struct Args {
    std::string model, adapter, out, backend = "cpu", max_shard_size = "5GB";
  };
  auto args = std::make_shared<Args>();
  app.add_option("--model", args->model, "base model directory")->required();
  app.add_option("--adapter", args->adapter, "PEFT LoRA adapter directory")->required();
  app.add_option("--out", args->out, "where the merged checkpoint goes")->required();
  add_max_shard_size_option(app, args->max_shard_size);
  add_backend_option(app, args->backend);
  return [args] {
    ModelOptions options;
    options.max_tokens = 1;
    options.with_grads = false;
    options.loss_workspace_bytes = 0;
    options.backend = &backend_named(args->backend);
    const std::unique_ptr<Decoder> model = load_model(args->model, options, args->adapter);
    model->parameters().merge_lora();  // W += scaling * B A, rounded to the base's storage dtype
    model->parameters().save(args->out, parse_bytes(args->max_shard_size, "--max_shard_size"));
    copy_model_side_files(args->model, args->out);
    const LoraConfig& lora = model->options().lora;
    std::cout << fmt::format("merged {} (r={}, {}) into {}: wrote {}\n", args->adapter, lora.rank,
                             fmt::join(lora.target_names(), ","), args->model, args->out);
  };
}

}  // namespace memtune::cli
