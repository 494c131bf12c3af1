// LoRA with PEFT semantics: config and names, B = 0 starts at the base model, adapter gradients
// against finite differences (with and without dropout, with checkpointing), merge == adapter,
// frozen base (no gradient or optimizer memory for it), and adapter files round-trip.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "backend/registry.h"
#include "core/rng.h"
#include "model/decoder.h"
#include "memory/process_memory.h"
#include "support/test_util.h"

namespace memtune {
namespace {

LoraConfig lora(int64_t rank, std::vector<std::string> targets, double dropout = 0.0, bool rslora = false) {
  LoraConfig c;
  c.rank = rank;
  c.alpha = 8.0;
  c.dropout = dropout;
  c.use_rslora = rslora;
  set_lora_targets(c, targets);
  return c;
}

struct Batch {
  std::vector<int32_t> ids, labels, cu;
  TokenBatch view() const { return {ids, labels, cu}; }
};

Batch make_batch(uint64_t seed) {
  Rng rng(seed);
  Batch b;
  b.cu = {0, 13, 30};
  for (int i = 0; i < 30; ++i) {
    b.ids.push_back(static_cast<int32_t>(rng.next_u64() % 512));
    b.labels.push_back(i % 7 == 3 ? -100 : b.ids.back());
  }
  return b;
}

// Random, nonzero adapters (PEFT's B = 0 would make A's gradient vanish and hide bugs).
void randomize_adapters(Decoder& m, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = 0; i < m.parameters().num_trainable(); ++i) {
    std::vector<float> v(static_cast<size_t>(m.parameters().trainable_spec(i).numel()));
    for (float& x : v) x = static_cast<float>(0.1 * rng.normal());
    upload_f32(m.backend(), m.parameters().trainable_value(i), v);
  }
}


// Every pair of sites' dropout masks at the same step (two layers, seven sites, three seeds) is
// independent: the share dropped in both, also with one mask shifted by up to 3 elements, is p^2
// within 6 standard deviations. Keys that differ by a multiple of the golden ratio (the unmixed
// keys of the past) give one mask shifted against the other, and fail at that shift.
TEST(LoraDropout, MasksOfDifferentSitesAtTheSameStepAreIndependent) {
  Backend& be = backend_named("cpu");
  const int64_t n = int64_t{1} << 15;
  const float p = 0.5f;
  std::vector<float> ones(static_cast<size_t>(n), 1.0f);
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  void* xb = be.allocate(bytes);
  void* ob = be.allocate(bytes);
  const Tensor x(xb, DType::F32, {n}), out(ob, DType::F32, {n});
  be.copy_to_device(x, ones.data());
  auto dropped = [&](uint64_t key) {
    be.dropout_forward(out, x, key, p);
    std::vector<float> v(static_cast<size_t>(n));
    be.copy_to_host(v.data(), out);
    std::vector<bool> d(v.size());
    for (size_t i = 0; i < v.size(); ++i) d[i] = v[i] == 0.0f;
    return d;
  };
  const double q = double(p) * p, N = double(n - 3), sigma = std::sqrt(N * q * (1 - q));
  int pairs = 0;
  for (const uint64_t seed : {uint64_t{0}, uint64_t{1}, uint64_t{0xfeedbeef}}) {
    std::vector<std::pair<std::string, std::vector<bool>>> masks;
    for (int64_t layer = 0; layer < 2; ++layer)
      for (size_t s = 0; s < kNumLinearSites; ++s)
        masks.emplace_back(fmt::format("layer {} {}", layer, linear_site_name(static_cast<LinearSite>(s))),
                           dropped(lora_dropout_key(seed, layer, static_cast<LinearSite>(s))));
    for (size_t a = 0; a < masks.size(); ++a)
      for (size_t b = a + 1; b < masks.size(); ++b) {
        for (int64_t shift = -3; shift <= 3; ++shift) {
          int64_t both = 0;
          for (int64_t i = 3; i < n - 3; ++i)
            both += masks[a].second[static_cast<size_t>(i)] && masks[b].second[static_cast<size_t>(i + shift)];
          ASSERT_NEAR(double(both), N * q, 6 * sigma)
              << "seed " << seed << ": " << masks[a].first << " and " << masks[b].first << " shifted by " << shift;
        }
        ++pairs;
      }
  }
  EXPECT_EQ(pairs, 3 * 91);
  be.deallocate(xb, bytes);
  be.deallocate(ob, bytes);
}
TEST(LoraConfig, TargetsNamesAndAdapterConfig) {
  LoraConfig c = lora(8, {"all-linear"});
  EXPECT_EQ(c.target_names().size(), 7u);
  EXPECT_DOUBLE_EQ(c.scaling(), 1.0);
  c.use_rslora = true;
  EXPECT_DOUBLE_EQ(c.scaling(), 8.0 / std::sqrt(8.0));
  EXPECT_EQ(lora_tensor_name(3, LinearSite::Q, false),
            "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(lora_tensor_name(0, LinearSite::Down, true), "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight");
  EXPECT_CONTAINS(testing_support::error_of([&] { set_lora_targets(c, {"qkv_proj"}); }), "qkv_proj");
  const nlohmann::json doc = lora_adapter_config_json(lora(4, {"q_proj", "v_proj"}, 0.05), "Qwen/Qwen2.5-0.5B");
  EXPECT_EQ(doc["peft_type"], "LORA");
  EXPECT_EQ(doc["task_type"], "CAUSAL_LM");
  EXPECT_EQ(doc["r"], 4);
  EXPECT_EQ(doc["bias"], "none");
  const LoraConfig back = parse_lora_adapter_config(doc, "adapter_config.json");
  EXPECT_EQ(back.rank, 4);
  EXPECT_EQ(back.target_names(), (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_DOUBLE_EQ(back.dropout, 0.05);
  nlohmann::json bad = doc;
  bad["bias"] = "all";
  EXPECT_CONTAINS(testing_support::error_of([&] { parse_lora_adapter_config(bad, "x.json"); }), "bias");
  // Every field is type-checked, the optional ones too.
  bad = doc;
  bad["lora_dropout"] = "0.05";
  EXPECT_EQ(testing_support::error_of([&] { parse_lora_adapter_config(bad, "x.json"); }),
            "x.json: field \"lora_dropout\": expected a number, got \"0.05\"");
  bad = doc;
  bad["use_rslora"] = "yes";
  EXPECT_EQ(testing_support::error_of([&] { parse_lora_adapter_config(bad, "x.json"); }),
            "x.json: field \"use_rslora\": expected true or false, got \"yes\"");
  bad = doc;
  bad["r"] = 0;
  EXPECT_EQ(testing_support::error_of([&] { parse_lora_adapter_config(bad, "x.json"); }),
            "x.json: field \"r\": expected a positive integer, got 0");
}

TEST(LoraConfig, AdapterConfigRefusesNonPositiveAlphaAndDropoutOutsideZeroToOne) {
  const nlohmann::json doc = lora_adapter_config_json(lora(4, {"q_proj"}), "base");
  auto error = [&](const char* field, const nlohmann::json& value) {
    nlohmann::json bad = doc;
    bad[field] = value;
    return testing_support::error_of([&] { parse_lora_adapter_config(bad, "adapter/adapter_config.json"); });
  };
  EXPECT_EQ(error("lora_alpha", 0),
            "adapter/adapter_config.json: field \"lora_alpha\": expected a positive number, got 0");
  EXPECT_CONTAINS(error("lora_alpha", -16), "field \"lora_alpha\"");
  EXPECT_EQ(error("lora_dropout", 1.5),
            "adapter/adapter_config.json: field \"lora_dropout\": expected a probability in [0, 1), got 1.5");
  EXPECT_CONTAINS(error("lora_dropout", -0.1), "field \"lora_dropout\"");
  EXPECT_CONTAINS(error("peft_type", 3), "field \"peft_type\": expected a string");
  EXPECT_CONTAINS(error("bias", false), "field \"bias\": expected a string");
}

TEST(Lora, FreshAdaptersLeaveTheBaseModelUnchanged) {
  ModelOptions base_opt, lora_opt;
  base_opt.max_tokens = lora_opt.max_tokens = 30;
  lora_opt.lora = lora(4, {"all-linear"});
  Decoder base(model_preset("tiny"), base_opt), adapted(model_preset("tiny"), lora_opt);
  base.parameters().init_random(1);
  adapted.parameters().init_random(1);
  adapted.parameters().init_lora(2);
  const Batch b = make_batch(3);
  EXPECT_EQ(base.forward_backward(b.view()).sum, adapted.forward_backward(b.view()).sum);
}

struct GradCase {
  bool checkpointing;
  double dropout;
  DType dtype;
};
class LoraGradTest : public ::testing::TestWithParam<GradCase> {};

TEST_P(LoraGradTest, AdapterGradientsMatchFiniteDifferences) {
  const auto [checkpointing, dropout, dtype] = GetParam();
  ModelConfig cfg = model_preset("tiny");
  cfg.torch_dtype = dtype;
  ModelOptions o;
  o.max_tokens = 30;
  o.gradient_checkpointing = checkpointing;
  o.lora = lora(3, {"q_proj", "k_proj", "o_proj", "up_proj", "down_proj"}, dropout);
  Decoder m(cfg, o);
  m.arena().set_poison_on_release(true);
  m.parameters().init_random(4);
  randomize_adapters(m, 5);
  m.set_dropout_seed(dropout > 0 ? std::optional<uint64_t>(77) : std::nullopt);
  const Batch b = make_batch(6);
  m.parameters().zero_grads();
  m.forward_backward(b.view());
  std::vector<std::vector<float>> grads;
  for (size_t i = 0; i < m.parameters().num_trainable(); ++i)
    grads.push_back(download_f32(m.backend(), m.parameters().trainable_grad(i)));
  // Directional derivative along a random direction per adapter tensor, against central differences.
  Rng rng(8);
  for (size_t i = 0; i < m.parameters().num_trainable(); ++i) {
    const int64_t n = m.parameters().trainable_spec(i).numel();
    std::vector<float> dir(n), saved = download_f32(m.backend(), m.parameters().trainable_value(i));
    double norm = 0, analytic = 0;
    for (int64_t j = 0; j < n; ++j) {
      dir[j] = static_cast<float>(rng.normal());
      norm += double(dir[j]) * dir[j];
    }
    for (int64_t j = 0; j < n; ++j) {
      dir[j] = static_cast<float>(dir[j] / std::sqrt(norm));  // a unit step, small next to the adapter
      analytic += double(dir[j]) * grads[i][j];
    }
    const float h = 1e-2f;
    auto loss_at = [&](float t) {
      std::vector<float> moved(n);
      for (int64_t j = 0; j < n; ++j) moved[j] = saved[j] + t * dir[j];
      upload_f32(m.backend(), m.parameters().trainable_value(i), moved);
      return m.forward_backward(b.view()).sum;
    };
    const double fd = (loss_at(h) - loss_at(-h)) / (2 * h);
    loss_at(0);
    EXPECT_NEAR(analytic, fd, 0.01 * std::abs(fd) + 5e-3) << m.parameters().trainable_spec(i).name;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, LoraGradTest,
                         ::testing::Values(GradCase{false, 0.0, DType::F32}, GradCase{true, 0.0, DType::BF16},
                                           GradCase{false, 0.3, DType::F32}, GradCase{true, 0.3, DType::F32}),
                         [](const auto& info) {
                           return std::string(info.param.checkpointing ? "checkpointing" : "saved") +
                                  (info.param.dropout > 0 ? "_dropout_" : "_") +
                                  std::string(dtype_safetensors_name(info.param.dtype));
                         });

TEST(Lora, FrozenBaseHasNoGradientOrOptimizerMemoryAndStaysInThePlan) {
  ModelConfig cfg = model_preset("tiny");
  cfg.torch_dtype = DType::BF16;
  ModelOptions o;
  o.max_tokens = 30;
  o.with_optimizer = true;
  o.lora = lora(4, {"all-linear"}, 0.1);
  Decoder m(cfg, o);
  m.parameters().init_random(1);
  m.parameters().init_lora(2);
  m.set_dropout_seed(9);
  EXPECT_FALSE(m.parameters().base_trainable());
  // Gradients and moments exist only for the adapters: 2 layers x 7 sites x (A + B).
  EXPECT_EQ(m.parameters().num_trainable(), 28u);
  int64_t adapter_elems = 0;
  for (size_t i = 0; i < m.parameters().num_trainable(); ++i) adapter_elems += m.parameters().trainable_spec(i).numel();
  const size_t grad_bytes = m.plan().live_bytes(Phase::Optimizer, Category::Gradients);
  EXPECT_GE(grad_bytes, static_cast<size_t>(adapter_elems) * 4);
  EXPECT_LT(grad_bytes, static_cast<size_t>(adapter_elems) * 4 + 28 * 64);
  EXPECT_EQ(m.plan().live_bytes(Phase::Optimizer, Category::OptimizerState), 2 * grad_bytes);
  // The base stays bfloat16.
  EXPECT_LT(m.plan().live_bytes(Phase::Forward, Category::Weights),
            static_cast<size_t>(model_parameter_count(cfg)) * 2 + 64 * m.parameters().specs().size());
  const Batch b = make_batch(3);
  m.parameters().zero_grads();
  m.forward_backward(b.view());
  const HeapAllocations heap_before = heap_allocations();
  m.forward_backward(b.view());
  EXPECT_EQ((heap_allocations() - heap_before).count, 0);
  EXPECT_EQ(m.arena().high_water_bytes(), m.plan().peak_bytes());
}

TEST(Lora, MergedWeightsEqualTheAdapterAndFilesRoundTrip) {
  ModelOptions o;
  o.max_tokens = 30;
  o.lora = lora(4, {"v_proj", "o_proj", "gate_proj"}, 0.0, true);
  Decoder m(model_preset("tiny"), o);
  m.parameters().init_random(1);
  randomize_adapters(m, 2);
  const Batch b = make_batch(3);
  const double with_adapter = m.forward_backward(b.view()).sum;

  const auto dir = testing_support::make_temp_dir("lora_test");
  m.parameters().save_adapter(dir.string(), "tiny-base");
  const auto cfg = nlohmann::json::parse(std::ifstream(dir / "adapter_config.json"));
  EXPECT_EQ(cfg["base_model_name_or_path"], "tiny-base");
  Decoder reloaded(model_preset("tiny"), o);
  reloaded.parameters().init_random(1);
  reloaded.parameters().load_adapter(dir.string());
  EXPECT_EQ(reloaded.forward_backward(b.view()).sum, with_adapter);
  // A model planned for other targets refuses the file by tensor name.
  ModelOptions other = o;
  other.lora = lora(4, {"q_proj"});
  Decoder wrong(model_preset("tiny"), other);
  EXPECT_CONTAINS(testing_support::error_of([&] { wrong.parameters().load_adapter(dir.string()); }), "q_proj.lora_A");
  std::filesystem::remove_all(dir);

  m.parameters().merge_lora();
  ModelOptions plain;
  plain.max_tokens = 30;
  Decoder merged(model_preset("tiny"), plain);
  for (size_t i = 0; i < m.parameters().specs().size(); ++i)
    upload_f32(merged.backend(), merged.parameters().param(i), download_f32(m.backend(), m.parameters().param(i)));
  EXPECT_NEAR(merged.forward_backward(b.view()).sum, with_adapter, 1e-5 * std::abs(with_adapter));
}

}  // namespace
}  // namespace memtune
