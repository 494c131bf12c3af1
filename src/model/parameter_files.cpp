// Parameters to and from files: random initialization, Hugging Face checkpoints (float and
// GPTQ / AWQ packed layers), and saving (see parameters.h).
#include "model/parameters.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/rng.h"
#include "io/checkpoint.h"
#include "io/quantized.h"
#include "io/safetensors.h"
#include "model/quantize.h"

namespace memtune {

TensorToWrite device_tensor_to_write(Backend& backend, const std::string& name, const std::vector<int64_t>& shape,
                                     const Tensor& tensor) {
  TensorToWrite t{name, tensor.dtype, shape, nullptr, {}};
  const Tensor flat = tensor.flat_range(0, tensor.numel());
  t.fetch = [&backend, flat](size_t offset, std::span<std::byte> out) {
    const size_t element = dtype_size(flat.dtype);
    MT_ASSERT(offset % element == 0 && out.size() % element == 0, "fetch of a partial element");
    backend.copy_to_host(out.data(), flat.flat_range(static_cast<int64_t>(offset / element),
                                                     static_cast<int64_t>(out.size() / element)));
  };
  return t;
}

void ModelParameters::init_random(uint64_t seed) {
  if (config_.quant.enabled()) throw Error("a quantized model is made by memtune quantize, not initialized at random");
  ++values_version_;
  std::vector<float> values;
  for (size_t i = 0; i < specs_.size(); ++i) {
    const auto& s = specs_[i];
    values.assign(static_cast<size_t>(s.numel()), 0.0f);
    if (s.name.ends_with("norm.weight")) {
      std::fill(values.begin(), values.end(), 1.0f);
    } else if (s.name.ends_with(".weight")) {
      Rng rng(seed, s.name);
      for (float& v : values) v = static_cast<float>(config_.initializer_range * rng.normal());
    }
    upload_f32(*backend_, param(i), values);
  }
}

void ModelParameters::load(const CheckpointReader& checkpoint) {
  ++values_version_;
  std::set<std::string> expected;
  std::vector<std::byte> staging;
  for (size_t i = 0; i < specs_.size(); ++i) {
    const auto& s = specs_[i];
    if (quantized(i)) {
      load_quantized(checkpoint, i, expected);
      continue;
    }
    expected.insert(s.name);
    if (!checkpoint.contains(s.name))
      throw Error(fmt::format("checkpoint is missing tensor \"{}\" required by the config", s.name));
    // Through host staging in bounded slices: the file's bytes, converted, then copied over.
    const Tensor dst = param(i);
    const int64_t n = dst.numel();
    const int64_t slice = std::max<int64_t>(1, static_cast<int64_t>(kTransferBytes / dtype_size(dst.dtype)));
    staging.resize(static_cast<size_t>(std::min(n, slice)) * dtype_size(dst.dtype));
    for (int64_t begin = 0; begin < n; begin += slice) {
      const int64_t count = std::min(slice, n - begin);
      checkpoint.read_into(s.name, s.shape, staging.data(), dst.dtype, static_cast<size_t>(begin),
                           static_cast<size_t>(count));
      backend_->copy_to_device(dst.flat_range(begin, count), staging.data());
    }
  }
  for (const auto& name : checkpoint.tensor_names()) {
    if (expected.contains(name)) continue;
    // A tied checkpoint may still carry lm_head.weight (transformers ignores it); old ones carry
    // RoPE's inv_freq buffer. Anything else means the checkpoint does not match the config.
    if (name.ends_with("rotary_emb.inv_freq")) continue;
    if (name == "lm_head.weight" && config_.tie_word_embeddings) continue;
    throw Error(fmt::format("checkpoint tensor \"{}\" (in {}) is not a parameter of this {} config", name,
                            checkpoint.file_of(name).path(), model_family_name(config_.family)));
  }
}

// A packed layer X.weight is read from X.qweight, X.qzeros, X.scales (and GPTQ's X.g_idx), converted
// into memtune's layout on the host, one layer at a time, and copied over.
void ModelParameters::load_quantized(const CheckpointReader& checkpoint, size_t i, std::set<std::string>& expected) {
  const ParamSpec& s = specs_[i];
  const std::string base = s.name.substr(0, s.name.size() - std::string_view(".weight").size());
  const QuantConfig& q = config_.quant;
  const int bits = quant_.at(i)->bits;
  // A head packed at load (--lm_head_bits) where the file holds it in floats (or tied).
  if (s.name == "lm_head.weight" && !checkpoint.contains(base + ".qweight")) {
    const std::string source = checkpoint.contains(s.name) ? s.name : "model.embed_tokens.weight";
    if (!checkpoint.contains(source))
      throw Error(fmt::format("checkpoint has neither lm_head.qweight, lm_head.weight nor {} to pack the LM head from",
                              source));
    expected.insert(source);
    pack_from_float(checkpoint, i, source);
    return;
  }
  const int64_t out = s.shape[0], in = s.shape[1], groups = q.groups(in), per_word = 32 / bits;
  auto read = [&]<class T>(const std::string& suffix, std::vector<int64_t> shape, DType dtype, std::vector<T>& dst) {
    const std::string name = base + suffix;
    expected.insert(name);
    if (!checkpoint.contains(name))
      throw Error(fmt::format("checkpoint is missing tensor \"{}\" of the {}-bit {} layer {}", name, bits,
                              quant_method_name(q.method), base));
    if (checkpoint.info(name).dtype != dtype)
      throw Error(fmt::format("checkpoint tensor \"{}\" (in {}) is {}, expected {}", name,
                              checkpoint.file_of(name).path(), dtype_safetensors_name(checkpoint.info(name).dtype),
                              dtype_safetensors_name(dtype)));
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    dst.resize(static_cast<size_t>(n));
    checkpoint.read_into(name, shape, dst.data(), dtype);
  };
  std::vector<int32_t> qweight, qzeros, g_idx;
  std::vector<uint16_t> scales;
  QuantizedLayer layer;
  try {
    read(".scales", {groups, out}, DType::F16, scales);
    if (q.method == QuantMethod::Gptq) {
      read(".qweight", {in / per_word, out}, DType::I32, qweight);
      read(".qzeros", {groups, out / per_word}, DType::I32, qzeros);
      if (checkpoint.contains(base + ".g_idx") || q.desc_act) read(".g_idx", {in}, DType::I32, g_idx);
      layer = gptq_to_layer({qweight, qzeros, g_idx, scales}, bits, in, out, groups, q.group_size);
    } else {
      read(".qweight", {in, out / 8}, DType::I32, qweight);
      read(".qzeros", {groups, out / 8}, DType::I32, qzeros);
      layer = awq_to_layer({qweight, qzeros, scales}, in, out, q.group_size);
    }
  } catch (const Error& e) {
    throw Error(fmt::format("{}: {}", base, e.what()));
  }
  const QuantizedWeight w = quantized_param(i);
  backend_->copy_to_device(w.codes, layer.codes.data());
  backend_->copy_to_device(w.scales, layer.scales.data());
  backend_->copy_to_device(w.zeros, layer.zeros.data());
  if (w.g_idx) {
    // Act-order files keep their g_idx even where it is the plain k / group_size.
    if (layer.g_idx.empty())
      for (int64_t k = 0; k < in; ++k) layer.g_idx.push_back(static_cast<int32_t>(k / w.group_size));
    backend_->copy_to_device(w.g_idx, layer.g_idx.data());
  } else if (!layer.g_idx.empty()) {
    throw Error(
        fmt::format("{}.g_idx reorders the inputs (act-order) but quantization_config says desc_act false", base));
  }
}

// Packs weight i from a float tensor of the checkpoint, rounded to nearest (GPTQ's symmetric codes,
// the model's group size) a slice of rows at a time, so no float copy of the whole tensor exists.
void ModelParameters::pack_from_float(const CheckpointReader& checkpoint, size_t i, const std::string& source) {
  const ParamSpec& s = specs_[i];
  const QuantizedWeight w = quantized_param(i);
  const int64_t out = s.shape[0], in = s.shape[1];
  const QuantConfig target{QuantMethod::Gptq, w.bits, config_.quant.group_size, false, true};
  const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(kTransferBytes / 4) / in);
  std::vector<float> values;
  for (int64_t r0 = 0; r0 < out; r0 += rows) {
    const int64_t n = std::min(rows, out - r0);
    values.resize(static_cast<size_t>(n * in));
    checkpoint.read_into(source, s.shape, values.data(), DType::F32, static_cast<size_t>(r0 * in),
                         static_cast<size_t>(n * in));
    const QuantizedLayer layer = quantize_rtn(values, n, in, target);
    auto rows_of = [&](const Tensor& t) { return t.flat_range(r0 * t.cols(), n * t.cols()); };
    backend_->copy_to_device(rows_of(w.codes), layer.codes.data());
    backend_->copy_to_device(rows_of(w.scales), layer.scales.data());
    backend_->copy_to_device(rows_of(w.zeros), layer.zeros.data());
  }
}

void ModelParameters::restore(const std::string& dir) {
  if (options_.lora.enabled())
    load_adapter(dir);
  else
    load(CheckpointReader(dir));
}

void ModelParameters::save(const std::string& dir, size_t max_shard_bytes) const {
  if (config_.quant.enabled())
    throw Error(dir + ": a quantized base is not written back; memtune quantize writes quantized models");
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < specs_.size(); ++i)
    tensors.push_back(device_tensor_to_write(*backend_, specs_[i].name, specs_[i].shape, param(i)));
  write_checkpoint(dir, tensors, max_shard_bytes);
  write_file_atomically((std::filesystem::path(dir) / "config.json").string(), config_to_json(config_).dump(2) + "\n");
}

}  // namespace memtune
