// `memtune quantize` (a float checkpoint to Qwen's GPTQ / AWQ layout) and `memtune dequantize`
// (a quantized checkpoint back to float weights, e.g. to compare against the packed kernels).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <memory>

#include <nlohmann/json.hpp>

#include "backend/registry.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/json_reader.h"
#include "core/jsonl.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/load.h"
#include "options/arguments.h"
#include "model/quantize.h"
#include "tokenizer/tokenizer.h"

namespace memtune::cli {

namespace {

// Calibration text: JSONL lines with a "text" string, the first num_samples of them, each cut
// to max_length tokens.
std::vector<std::vector<int32_t>> read_calibration(const std::string& path, const Tokenizer& tokenizer,
                                                   int64_t num_samples, int64_t max_length) {
  JsonlReader reader(path);
  std::vector<std::vector<int32_t>> out;
  JsonlLine line;
  while (static_cast<int64_t>(out.size()) < num_samples && reader.next_line(line)) {
    std::string error;
    const std::optional<nlohmann::json> value = parse_json_line(line.text, error);
    if (!value) reader.bad_line(line.number, error);
    if (!value->is_object() || !value->contains("text") || !(*value)["text"].is_string())
      reader.bad_line(line.number, "expected an object with a \"text\" string");
    std::vector<int32_t> ids = tokenizer.encode((*value)["text"].get<std::string>());
    if (static_cast<int64_t>(ids.size()) > max_length) ids.resize(static_cast<size_t>(max_length));
    if (ids.size() < 2) continue;
    out.push_back(std::move(ids));
  }
  if (out.empty()) throw Error(fmt::format("{}: no calibration text of 2 tokens or more", path));
  return out;
}

}  // namespace

Action add_quantize(CLI::App& app) {
  struct Args {
    std::string model, out, method = "rtn", format = "gptq", calibration_file, tokenizer, backend = "cpu";
    int bits = 4, lm_head_bits = 0;
    int64_t group_size = 128, num_samples = 128, max_length = 512;
    bool act_order = false;
    double damp_percent = 0.01;
  };
  auto a = std::make_shared<Args>();
  app.add_option("--model,--model_name_or_path", a->model, "the float model directory")->required();
  app.add_option("--out", a->out, "where the quantized checkpoint goes")->required();
  app.add_option("--bits", a->bits, "4 | 8 (awq: 4)")->capture_default_str()->check(CLI::IsMember({4, 8}));
  app.add_option("--group_size", a->group_size, "inputs sharing one scale and zero; -1: one group per row")
      ->capture_default_str();
  app.add_option("--method", a->method, "rtn (round to nearest) | gptq (Hessian-based error compensation)")
      ->capture_default_str()
      ->check(CLI::IsMember({"rtn", "gptq"}));
  app.add_option("--format", a->format, "gptq (symmetric, Qwen's -GPTQ-Int4/-Int8 layout) | awq (4-bit, zero points)")
      ->capture_default_str()
      ->check(CLI::IsMember({"gptq", "awq"}));
  app.add_option("--lm_head_bits", a->lm_head_bits,
                 "GPTQ: pack the LM head too, with 8 or 4 bits (round to nearest, the layers' group size; a tied head "
                 "is untied, the embedding keeps its dtype); 0 keeps it in the model's dtype, as Qwen's files do")
      ->capture_default_str()
      ->check(CLI::IsMember({0, 4, 8}));
  app.add_flag("--act_order,--desc_act", a->act_order, "GPTQ: quantize columns by decreasing Hessian diagonal");
  app.add_option("--damp_percent", a->damp_percent, "GPTQ: diagonal dampening, fraction of its mean")
      ->capture_default_str();
  app.add_option("--calibration_file", a->calibration_file, "GPTQ: JSONL lines {\"text\": ...}");
  app.add_option("--num_samples", a->num_samples, "GPTQ: calibration lines used")->capture_default_str();
  app.add_option("--max_length", a->max_length, "GPTQ: tokens per calibration line at most")->capture_default_str();
  app.add_option("--tokenizer", a->tokenizer, "directory with tokenizer.json (default: the model's)");
  add_backend_option(app, a->backend);
  return [a] {
    QuantizeOptions o;
    o.target.method = a->format == "awq" ? QuantMethod::Awq : QuantMethod::Gptq;
    o.target.bits = a->bits;
    if (o.target.method == QuantMethod::Awq && a->bits != 4) throw Error("--format awq takes --bits 4");
    if (a->group_size == 0 || a->group_size < -1) throw Error("--group_size must be positive or -1");
    o.target.group_size = a->group_size;
    o.target.sym = o.target.method == QuantMethod::Gptq;
    o.target.desc_act = a->act_order;
    o.target.lm_head_bits = a->lm_head_bits;
    o.gptq = a->method == "gptq";
    o.damp_percent = a->damp_percent;
    if (a->damp_percent <= 0) throw Error("--damp_percent must be positive");
    std::vector<std::vector<int32_t>> calibration;
    if (o.gptq) {
      if (a->calibration_file.empty()) throw Error("--method gptq needs --calibration_file");
      if (a->num_samples < 1 || a->max_length < 2) throw Error("--num_samples must be >= 1 and --max_length >= 2");
      const Tokenizer tokenizer = Tokenizer::load(a->tokenizer.empty() ? a->model : a->tokenizer);
      calibration = read_calibration(a->calibration_file, tokenizer, a->num_samples, a->max_length);
    } else if (!a->calibration_file.empty()) {
      throw Error("--calibration_file is used by --method gptq only");
    }
    const auto t0 = std::chrono::steady_clock::now();
    const QuantizeSummary s = quantize_model(a->model, a->out, o, calibration, backend_named(a->backend));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cout << fmt::format("quantized {} linear layers to {}-bit {} (group {}{}, {}){}: {} -> {}\n", s.layers,
                             a->bits, a->format, a->group_size, a->act_order ? ", act-order" : "", a->method,
                             a->lm_head_bits ? fmt::format(", the LM head {}-bit", a->lm_head_bits) : "",
                             format_bytes(s.float_bytes), format_bytes(s.packed_bytes));
    if (o.gptq)
      std::cout << fmt::format("calibration: {} sequences, {} tokens, {} pass(es) over them{}\n", calibration.size(),
                               s.calibration_tokens, s.passes,
                               s.unreached_layers ? fmt::format("; {} experts' layers no calibration token reached "
                                                                "rounded to nearest",
                                                                s.unreached_layers)
                                                  : "");
    std::cout << fmt::format("mean squared weight error {:.3e}; {:.1f} s\nwrote {}\n", s.mean_squared_error, seconds,
                             a->out);
  };
}

Action add_dequantize(CLI::App& app) {
  struct Args {
    std::string model, out, torch_dtype, backend = "cpu";
  };
  auto a = std::make_shared<Args>();
  app.add_option("--model,--model_name_or_path", a->model, "a GPTQ or AWQ model directory")->required();
  app.add_option("--out", a->out, "where the float checkpoint goes")->required();
  app.add_option("--torch_dtype", a->torch_dtype, "storage dtype of the output (default: the model's torch_dtype)");
  add_backend_option(app, a->backend);
  return [a] {
    ModelOptions options;
    options.max_tokens = 1;
    options.with_grads = false;
    options.loss_workspace_bytes = 0;
    options.backend = &backend_named(a->backend);
    const std::unique_ptr<Decoder> model = load_model(a->model, options);
    const ModelParameters& params = model->parameters();
    const ModelConfig& c = model->config();
    if (!c.quant.enabled()) throw Error(a->model + ": the model is not quantized (no quantization_config)");
    const DType dtype = a->torch_dtype.empty() ? c.torch_dtype : parse_dtype(a->torch_dtype, "--torch_dtype");
    // One tensor at a time: each is formed (dequantized or widened) when the writer reaches it.
    std::vector<TensorToWrite> tensors;
    for (size_t i = 0; i < params.specs().size(); ++i) {
      const ParamSpec& s = params.specs()[i];
      TensorToWrite t{s.name, dtype, s.shape, nullptr, {}};
      auto cache = std::make_shared<std::vector<std::byte>>();
      t.fetch = [&params, &model, i, dtype, cache](size_t offset, std::span<std::byte> out) {
        if (offset == 0 || cache->empty()) {
          const std::vector<float> v = params.quantized(i) ? params.dequantized(i)
                                                           : download_f32(model->backend(), params.param(i));
          cache->resize(v.size() * dtype_size(dtype));
          convert_from_f32(v.data(), cache->data(), dtype, v.size());
        }
        std::copy_n(cache->data() + offset, out.size(), out.data());
        if (offset + out.size() == cache->size()) std::vector<std::byte>().swap(*cache);
      };
      tensors.push_back(std::move(t));
    }
    write_checkpoint(a->out, tensors);
    const std::string config_path = (std::filesystem::path(a->model) / "config.json").string();
    nlohmann::json doc = read_json_file(config_path);
    doc.erase("quantization_config");
    doc["torch_dtype"] = std::string(dtype_torch_name(dtype));
    doc.erase("dtype");
    write_file_atomically((std::filesystem::path(a->out) / "config.json").string(), doc.dump(2) + "\n");
    copy_model_side_files(a->model, a->out);
    std::cout << fmt::format("dequantized {} ({}-bit {}) to {}: wrote {}\n", a->model, c.quant.bits,
                             quant_method_name(c.quant.method), dtype_torch_name(dtype), a->out);
  };
}

}  // namespace memtune::cli
