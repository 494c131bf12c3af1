// Round-to-nearest and GPTQ quantization, and the checkpoint writer of `memtune quantize`.
#include "model/quantize.h"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <tuple>
#include <numeric>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_reader.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/load.h"
#include "model/parameters.h"

// LAPACK (in OpenBLAS): Cholesky factorization and inverse of a symmetric positive definite matrix.
extern "C" {
void spotrf_(const char* uplo, const int* n, float* a, const int* lda, int* info);
void spotri_(const char* uplo, const int* n, float* a, const int* lda, int* info);
}

namespace memtune {

namespace {

// The scale and zero point of one group of one output row, as AutoGPTQ's quantizer forms them:
// the range always holds 0; symmetric ranges are centred (zero 2^(bits-1)), asymmetric ones have
// the zero that maps 0 to a code. The scale is rounded to float16 first (what the file stores),
// so codes are chosen against the scale that will be read back.
struct GroupParams {
  float scale = 1, zero = 0;
  uint16_t scale_f16 = 0;
  int maxq = 15;

  GroupParams(const float* x, int64_t n, int64_t stride, int bits, bool sym) : maxq((1 << bits) - 1) {
    float lo = 0, hi = 0;
    for (int64_t i = 0; i < n; ++i) {
      lo = std::min(lo, x[i * stride]);
      hi = std::max(hi, x[i * stride]);
    }
    if (sym) {
      hi = std::max(-lo, hi);
      lo = -hi;
    }
    if (lo == 0 && hi == 0) {
      lo = -1;
      hi = 1;
    }
    scale_f16 = f32_to_f16((hi - lo) / static_cast<float>(maxq));
    scale = f16_to_f32(scale_f16);
    if (scale == 0) scale_f16 = f32_to_f16(scale = 6.1e-5f);  // below float16's smallest normal
    zero = sym ? static_cast<float>((maxq + 1) / 2) : std::round(-lo / scale);
  }
  int code(float w) const { return static_cast<int>(std::clamp(std::round(w / scale) + zero, 0.0f, float(maxq))); }
  float dequantized(int q) const { return scale * (static_cast<float>(q) - zero); }
};

// A layer being filled: codes [out, in] as bytes, scale / zero per (row, group).
struct Codes {
  int64_t out, in, groups, group_size;
  std::vector<uint8_t> q;
  std::vector<uint16_t> scales, zeros;
  std::vector<int32_t> g_idx;

  Codes(int64_t out, int64_t in, const QuantConfig& t)
      : out(out),
        in(in),
        groups(t.groups(in)),
        group_size(t.group_size_for(in)),
        q(static_cast<size_t>(out * in)),
        scales(static_cast<size_t>(out * groups)),
        zeros(static_cast<size_t>(out * groups)) {}
  void set_group(int64_t n, int64_t g, const GroupParams& p) {
    scales[static_cast<size_t>(n * groups + g)] = p.scale_f16;
    zeros[static_cast<size_t>(n * groups + g)] = f32_to_f16(p.zero);
  }
  QuantizedLayer layer(int bits) const {
    QuantizedLayer l{bits, in, out, group_size, groups, {}, scales, zeros, g_idx};
    const int per_word = 32 / bits;
    if (in % per_word != 0) throw Error(fmt::format("{} inputs do not fill {}-bit words", in, bits));
    l.codes.assign(static_cast<size_t>(out * (in / per_word)), 0);
    for (int64_t n = 0; n < out; ++n)
      for (int64_t k = 0; k < in; ++k) {
        auto& word = l.codes[static_cast<size_t>(n * (in / per_word) + k / per_word)];
        word = static_cast<int32_t>(static_cast<uint32_t>(word) |
                                    (static_cast<uint32_t>(q[static_cast<size_t>(n * in + k)]) << (bits * (k % per_word))));
      }
    return l;
  }
};

}  // namespace

QuantizedLayer quantize_rtn(std::span<const float> w, int64_t out, int64_t in, const QuantConfig& t) {
  MT_ASSERT(static_cast<int64_t>(w.size()) == out * in);
  Codes c(out, in, t);
  for (int64_t n = 0; n < out; ++n)
    for (int64_t g = 0; g < c.groups; ++g) {
      const int64_t k0 = g * c.group_size, k1 = std::min(in, k0 + c.group_size);
      const GroupParams p(w.data() + n * in + k0, k1 - k0, 1, t.bits, t.sym);
      c.set_group(n, g, p);
      for (int64_t k = k0; k < k1; ++k)
        c.q[static_cast<size_t>(n * in + k)] = static_cast<uint8_t>(p.code(w[static_cast<size_t>(n * in + k)]));
    }
  return c.layer(t.bits);
}

QuantizedLayer quantize_gptq(std::span<const float> w_in, int64_t out, int64_t in, const QuantConfig& t,
                             std::vector<float>& H, double damp_percent) {
  MT_ASSERT(static_cast<int64_t>(w_in.size()) == out * in && static_cast<int64_t>(H.size()) == in * in);
  auto h = [&](int64_t i, int64_t j) -> float& { return H[static_cast<size_t>(i * in + j)]; };
  // Columns in the order GPTQ takes them: by decreasing Hessian diagonal with act-order.
  std::vector<int64_t> perm(static_cast<size_t>(in));
  std::iota(perm.begin(), perm.end(), 0);
  if (t.desc_act)
    std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) { return h(a, a) > h(b, b); });
  // W [out, in] and H [in, in] in that order; inputs never seen (zero diagonal) get weight 0.
  std::vector<float> W(static_cast<size_t>(out * in)), Hp(static_cast<size_t>(in * in));
  for (int64_t i = 0; i < in; ++i) {
    const bool dead = h(perm[i], perm[i]) == 0;
    for (int64_t j = 0; j < in; ++j) Hp[static_cast<size_t>(i * in + j)] = h(perm[i], perm[j]);
    if (dead) Hp[static_cast<size_t>(i * in + i)] = 1;
    for (int64_t n = 0; n < out; ++n) W[static_cast<size_t>(n * in + i)] = dead ? 0 : w_in[static_cast<size_t>(n * in + perm[i])];
  }
  double mean_diag = 0;
  for (int64_t i = 0; i < in; ++i) mean_diag += Hp[static_cast<size_t>(i * in + i)];
  mean_diag /= static_cast<double>(in);
  for (int64_t i = 0; i < in; ++i) Hp[static_cast<size_t>(i * in + i)] += static_cast<float>(damp_percent * mean_diag);
  // U upper triangular with U^T U = H^-1. LAPACK is column-major: on this symmetric row-major
  // matrix its "L" works in our upper triangle.
  const int n_ = static_cast<int>(in);
  int info = 0;
  spotrf_("L", &n_, Hp.data(), &n_, &info);
  if (info != 0) throw Error(fmt::format("the Hessian is not positive definite (LAPACK spotrf info {}): raise --damp_percent", info));
  spotri_("L", &n_, Hp.data(), &n_, &info);
  if (info != 0) throw Error(fmt::format("the Hessian cannot be inverted (LAPACK spotri info {})", info));
  for (int64_t i = 0; i < in; ++i)
    for (int64_t j = 0; j < i; ++j) Hp[static_cast<size_t>(i * in + j)] = Hp[static_cast<size_t>(j * in + i)];
  spotrf_("L", &n_, Hp.data(), &n_, &info);
  if (info != 0) throw Error(fmt::format("the inverse Hessian is not positive definite (LAPACK spotrf info {})", info));
  for (int64_t i = 0; i < in; ++i)
    for (int64_t j = 0; j < i; ++j) Hp[static_cast<size_t>(i * in + j)] = 0;
  const float* U = Hp.data();

  Codes c(out, in, t);
  std::vector<GroupParams> params;
  constexpr int64_t kBlock = 128;
  std::vector<float> err(static_cast<size_t>(out * kBlock));
  for (int64_t b0 = 0; b0 < in; b0 += kBlock) {
    const int64_t b1 = std::min(in, b0 + kBlock), nb = b1 - b0;
    for (int64_t i = b0; i < b1; ++i) {
      if (i % c.group_size == 0) {  // a new group: its parameters from the weights as updated so far
        const int64_t width = std::min(c.group_size, in - i);
        params.clear();
        for (int64_t n = 0; n < out; ++n) params.emplace_back(W.data() + n * in + i, width, 1, t.bits, t.sym);
      }
      const float d = U[i * in + i];
      for (int64_t n = 0; n < out; ++n) {
        float& wv = W[static_cast<size_t>(n * in + i)];
        const GroupParams& p = params[static_cast<size_t>(n)];
        const int q = p.code(wv);
        c.q[static_cast<size_t>(n * in + perm[i])] = static_cast<uint8_t>(q);
        const float e = (wv - p.dequantized(q)) / d;
        err[static_cast<size_t>(n * kBlock + (i - b0))] = e;
        // The error goes to this block's remaining columns now, to later blocks below.
        for (int64_t j = i + 1; j < b1; ++j) W[static_cast<size_t>(n * in + j)] -= e * U[i * in + j];
      }
      if (i % c.group_size == 0 || i == 0)
        for (int64_t n = 0; n < out; ++n) c.set_group(n, i / c.group_size, params[static_cast<size_t>(n)]);
    }
    if (b1 < in)  // W[:, b1:] -= Err [out, nb] @ U[b0:b1, b1:]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(out), static_cast<int>(in - b1),
                  static_cast<int>(nb), -1.0f, err.data(), static_cast<int>(kBlock), U + b0 * in + b1,
                  static_cast<int>(in), 1.0f, W.data() + b1, static_cast<int>(in));
  }
  if (t.desc_act) {  // input k belongs to the group of its place in the order
    c.g_idx.resize(static_cast<size_t>(in));
    for (int64_t i = 0; i < in; ++i) c.g_idx[static_cast<size_t>(perm[i])] = static_cast<int32_t>(i / c.group_size);
  }
  return c.layer(t.bits);
}

namespace {

// Distinct inputs of a decoder layer's linear sites: q/k/v share one, gate/up another.
constexpr LinearSite kInputSites[] = {LinearSite::Q, LinearSite::O, LinearSite::Gate, LinearSite::Down};
LinearSite input_site(LinearSite s) {
  switch (s) {
    case LinearSite::K:
    case LinearSite::V:
      return LinearSite::Q;
    case LinearSite::Up:
      return LinearSite::Gate;
    default:
      return s;
  }
}

}  // namespace

namespace {

// The quantized model's config: the source's with the target's quantization; a packed head is a
// tensor of its own (lm_head.qweight), so the embedding keeps the tied weights.
ModelConfig quantized_config(const ModelConfig& source, const QuantizeOptions& o,
                             const std::vector<std::vector<int32_t>>& calibration, const std::string& config_path) {
  if (source.quant.enabled())
    throw Error(fmt::format("{}: the model is already quantized ({}-bit {})", config_path, source.quant.bits,
                            quant_method_name(source.quant.method)));
  ModelConfig target = source;
  target.quant = o.target;
  if (o.target.lm_head_bits) {
    if (o.target.method != QuantMethod::Gptq) throw Error("--lm_head_bits: packed LM heads are written in GPTQ files");
    target.tie_word_embeddings = false;
  }
  // The writer's checks (whole words, AWQ's whole groups) on this model's shapes.
  parse_model_config(config_to_json(target), "the quantized model's config");
  if (o.target.desc_act && !o.gptq) throw Error("act-order (desc_act) needs the GPTQ method");
  if (o.gptq && calibration.empty()) throw Error("the GPTQ method needs calibration data (--calibration_file)");
  return target;
}

// The layers of one model quantized, by rounding or by GPTQ, with what they cost in error.
class LayerQuantizer {
 public:
  LayerQuantizer(const std::string& model_dir, const ModelConfig& source, const ModelConfig& target,
                 const QuantizeOptions& o)
      : checkpoint_(model_dir), source_(source), target_(target), o_(o) {}

  // Every packed layer rounded to nearest (one tensor read at a time).
  void round_all(const std::vector<ParamSpec>& specs) {
    for (const ParamSpec& s : specs)
      if (packed_bits(target_, s)) round(s);
  }
  // The decoder layers by GPTQ over `calibration` run through the float model on `backend`, a
  // pass per group of layers whose Hessians fit the budget; a packed head rounds to nearest.
  void gptq_all(const std::string& model_dir, const std::vector<ParamSpec>& specs,
                const std::vector<std::vector<int32_t>>& calibration, Backend& backend) {
    int64_t longest = 0;
    for (const auto& seq : calibration) {
      longest = std::max<int64_t>(longest, static_cast<int64_t>(seq.size()));
      summary_.calibration_tokens += static_cast<int64_t>(seq.size());
    }
    ModelOptions options;
    options.max_tokens = longest;
    options.with_grads = false;
    options.loss_workspace_bytes = size_t{16} << 20;
    options.backend = &backend;
    const std::unique_ptr<Decoder> model = load_model(model_dir, options);
    ModelParameters& params = model->parameters();
    const ModelConfig& c = model->config();
    // A Hessian per distinct input: (layer, expert, input site), expert kDense for a dense
    // layer's site (and attention's), -1 for the shared expert.
    constexpr int64_t kDense = -2;
    using Key = std::tuple<int64_t, int64_t, LinearSite>;
    auto keys_of = [&](int64_t l) {
      std::vector<std::pair<Key, int64_t>> keys;  // with the input's width
      const bool sparse = c.moe.sparse(l);
      for (const LinearSite s : kInputSites)
        if (!sparse || linear_site_block(s) != "mlp") keys.push_back({{l, kDense, s}, params.linear(l, s).in});
      if (!sparse) return keys;
      auto expert = [&](int64_t e, int64_t width) {
        keys.push_back({{l, e, LinearSite::Gate}, c.hidden_size});
        keys.push_back({{l, e, LinearSite::Down}, width});
      };
      for (int64_t e = 0; e < c.moe.num_experts; ++e) expert(e, c.moe.expert_intermediate_size);
      if (c.moe.shared_expert_intermediate_size > 0) expert(-1, c.moe.shared_expert_intermediate_size);
      return keys;
    };
    auto layer_bytes = [&](int64_t l) {
      size_t bytes = 0;
      for (const auto& [key, in] : keys_of(l)) bytes += static_cast<size_t>(in * in) * 4;
      return bytes;
    };
    for (int64_t l0 = 0; l0 < c.num_hidden_layers;) {
      // As many layers as the budget holds, at least one (a layer of many experts may exceed it).
      int64_t l1 = l0 + 1;
      for (size_t bytes = layer_bytes(l0); l1 < c.num_hidden_layers && bytes + layer_bytes(l1) <= o_.hessian_budget_bytes;
           ++l1)
        bytes += layer_bytes(l1);
      // Hessians of layers l0..l1 (upper triangles, summed over calibration tokens).
      std::map<Key, std::vector<float>> hessians;
      for (int64_t l = l0; l < l1; ++l)
        for (const auto& [key, in] : keys_of(l)) hessians[key].assign(static_cast<size_t>(in * in), 0.0f);
      auto observe = [&](const Key& key, const Tensor& x) {
        const auto it = hessians.find(key);
        if (it == hessians.end()) return;
        const std::vector<float> rows = download_f32(backend, x);
        const int64_t n = x.rows(), in = x.cols();
        cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, static_cast<int>(in), static_cast<int>(n), 1.0f,
                    rows.data(), static_cast<int>(in), 1.0f, it->second.data(), static_cast<int>(in));
      };
      model->set_linear_input_observer([&](int64_t l, LinearSite s, std::optional<int64_t> e, const Tensor& x) {
        observe({l, e.value_or(kDense), s}, x);
      });
      for (const auto& seq : calibration) {
        const std::vector<int32_t> cu = {0, static_cast<int32_t>(seq.size())};
        model->forward_loss({seq, seq, cu});
      }
      model->set_linear_input_observer(nullptr);
      ++summary_.passes;
      // One linear layer by GPTQ over its input's Hessian; an expert no calibration token reached
      // has none and rounds to nearest.
      auto quantize = [&](const ModelParameters::Linear& lin, const Key& input) {
        const ParamSpec& spec = params.specs()[lin.weight];
        std::vector<float> H = hessians.at(input);  // a copy: GPTQ changes it
        if (std::all_of(H.begin(), H.end(), [](float v) { return v == 0.0f; })) {
          ++summary_.unreached_layers;
          round(spec);
          return;
        }
        const int64_t in = lin.in;  // the upper triangle mirrored
        for (int64_t i = 0; i < in; ++i)
          for (int64_t j = 0; j < i; ++j) H[static_cast<size_t>(i * in + j)] = H[static_cast<size_t>(j * in + i)];
        const std::vector<float> w = download_f32(backend, params.param(lin.weight));
        record(spec, w, quantize_gptq(w, lin.out, lin.in, o_.target, H, o_.damp_percent));
      };
      for (int64_t l = l0; l < l1; ++l) {
        const ModelParameters::LayerParams& p = params.layer(l);
        for (size_t si = 0; si < kNumLinearSites; ++si) {
          const LinearSite s = static_cast<LinearSite>(si);
          if (p.moe && linear_site_block(s) == "mlp") continue;
          quantize(params.linear(l, s), {l, kDense, input_site(s)});
        }
        if (!p.moe) continue;
        for (int64_t e = params.first_expert(); e < c.moe.num_experts; ++e)
          for (const LinearSite s : {LinearSite::Gate, LinearSite::Up, LinearSite::Down})
            quantize(params.expert_linear(l, e, s), {l, e, input_site(s)});
      }
      l0 = l1;
    }
    for (const ParamSpec& s : specs)
      if (s.name == "lm_head.weight" && packed_bits(target_, s)) round(s);
  }

  const CheckpointReader& checkpoint() const { return checkpoint_; }
  const std::map<std::string, QuantizedLayer>& layers() const { return layers_; }
  QuantizeSummary summary() const {
    QuantizeSummary s = summary_;
    s.layers = static_cast<int64_t>(layers_.size());
    s.mean_squared_error = elements_ > 0 ? squared_error_ / elements_ : 0;
    return s;
  }

 private:
  // Where a tensor's float values are: a tied source's head is its embedding.
  std::string source_name(const ParamSpec& s) const {
    return s.name == "lm_head.weight" && source_.tie_word_embeddings ? std::string("model.embed_tokens.weight")
                                                                      : s.name;
  }
  // The layers round with the target's settings; the head with its own bits.
  void round(const ParamSpec& s) {
    std::vector<float> w(static_cast<size_t>(s.numel()));
    checkpoint_.read_into(source_name(s), s.shape, w.data(), DType::F32);
    QuantConfig t = o_.target;
    t.bits = packed_bits(target_, s);
    if (s.name == "lm_head.weight") t.desc_act = false;
    QuantizedLayer layer = quantize_rtn(w, s.shape[0], s.shape[1], t);
    record(s, w, std::move(layer));
  }
  void record(const ParamSpec& s, const std::vector<float>& w, QuantizedLayer layer) {
    const std::vector<float> back = dequantize_layer(layer);
    for (size_t k = 0; k < w.size(); ++k) squared_error_ += double(back[k] - w[k]) * (back[k] - w[k]);
    elements_ += static_cast<double>(w.size());
    summary_.float_bytes += static_cast<size_t>(s.numel()) * dtype_size(checkpoint_.info(source_name(s)).dtype);
    layers_.emplace(s.name, std::move(layer));
  }

  const CheckpointReader checkpoint_;
  const ModelConfig& source_;
  const ModelConfig& target_;
  const QuantizeOptions& o_;
  std::map<std::string, QuantizedLayer> layers_;  // by spec name
  QuantizeSummary summary_;
  double squared_error_ = 0, elements_ = 0;
};

// The file: every tensor in the source's order, quantized layers as their packed tensors
// (`packed` keeps their bytes alive until written). Adds the packed bytes to `summary`.
std::vector<TensorToWrite> tensors_to_write(const std::vector<ParamSpec>& specs, const ModelConfig& target,
                                            const QuantizeOptions& o, const LayerQuantizer& q,
                                            std::vector<PackedTensors>& packed, QuantizeSummary& summary) {
  const CheckpointReader& checkpoint = q.checkpoint();
  const std::map<std::string, QuantizedLayer>& layers = q.layers();
  packed.reserve(layers.size());  // the tensors point into its elements
  std::vector<TensorToWrite> tensors;
  for (const ParamSpec& s : specs) {
    if (!packed_bits(target, s)) {
      const TensorInfo& info = checkpoint.info(s.name);
      TensorToWrite t{s.name, info.dtype, s.shape, nullptr, {}};
      t.fetch = [&checkpoint, name = s.name, shape = s.shape, dtype = info.dtype](size_t offset, std::span<std::byte> out) {
        const size_t element = dtype_size(dtype);
        checkpoint.read_into(name, shape, out.data(), dtype, offset / element, out.size() / element);
      };
      tensors.push_back(std::move(t));
      continue;
    }
    const QuantizedLayer& layer = layers.at(s.name);
    packed.push_back(o.target.method == QuantMethod::Gptq ? layer_to_gptq(layer) : layer_to_awq(layer));
    const PackedTensors& p = packed.back();
    const std::string base = s.name.substr(0, s.name.size() - std::string_view(".weight").size());
    const int64_t in = layer.in, out = layer.out, per_word = 32 / layer.bits;
    if (o.target.method == QuantMethod::Gptq) {
      tensors.push_back({base + ".qweight", DType::I32, {in / per_word, out}, p.qweight.data(), {}});
      tensors.push_back({base + ".qzeros", DType::I32, {layer.groups, out / per_word}, p.qzeros.data(), {}});
      tensors.push_back({base + ".scales", DType::F16, {layer.groups, out}, p.scales.data(), {}});
      tensors.push_back({base + ".g_idx", DType::I32, {in}, p.g_idx.data(), {}});
    } else {
      tensors.push_back({base + ".qweight", DType::I32, {in, out / 8}, p.qweight.data(), {}});
      tensors.push_back({base + ".qzeros", DType::I32, {layer.groups, out / 8}, p.qzeros.data(), {}});
      tensors.push_back({base + ".scales", DType::F16, {layer.groups, out}, p.scales.data(), {}});
    }
    for (size_t k = tensors.size() - (o.target.method == QuantMethod::Gptq ? 4 : 3); k < tensors.size(); ++k)
      summary.packed_bytes += tensors[k].nbytes();
  }
  return tensors;
}

}  // namespace

QuantizeSummary quantize_model(const std::string& model_dir, const std::string& out_dir, const QuantizeOptions& o,
                               const std::vector<std::vector<int32_t>>& calibration, Backend& backend) {
  const std::string config_path = (std::filesystem::path(model_dir) / "config.json").string();
  nlohmann::json doc = read_json_file(config_path);
  const ModelConfig source = parse_model_config(doc, config_path);
  const ModelConfig target = quantized_config(source, o, calibration, config_path);
  const std::vector<ParamSpec> specs = model_parameter_specs(target);
  LayerQuantizer q(model_dir, source, target, o);
  if (o.gptq)
    q.gptq_all(model_dir, specs, calibration, backend);
  else
    q.round_all(specs);
  std::vector<PackedTensors> packed;
  QuantizeSummary summary = q.summary();
  const std::vector<TensorToWrite> tensors = tensors_to_write(specs, target, o, q, packed, summary);
  write_checkpoint(out_dir, tensors);
  doc["quantization_config"] = config_to_json(target)["quantization_config"];
  doc["tie_word_embeddings"] = target.tie_word_embeddings;
  write_file_atomically((std::filesystem::path(out_dir) / "config.json").string(), doc.dump(2) + "\n");
  copy_model_side_files(model_dir, out_dir);
  return summary;
}

}  // namespace memtune
