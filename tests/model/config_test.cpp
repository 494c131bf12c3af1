// Tests for config.json parsing (Qwen2, Qwen3, Llama): the classic transformers-4 form as published for
// Qwen2.5, the transformers-5 form, every refusal (each naming the file and field), the presets
// (checked against published parameter counts) and the to_json -> parse round trip.
#include "model/config.h"
#include "model/parameters.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "support/test_util.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using testing_support::error_of;

// Qwen/Qwen2.5-0.5B-Instruct's config.json as published (transformers 4.x form).
json qwen25_05b_classic() {
  return json::parse(R"({
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
}

// The same model as transformers 5 writes it.
json qwen25_05b_v5() {
  json doc = qwen25_05b_classic();
  doc.erase("torch_dtype");
  doc.erase("rope_theta");
  doc.erase("rope_scaling");
  doc["dtype"] = "bfloat16";
  doc["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1000000.0}};
  doc["layer_types"] = json(std::vector<std::string>(24, "full_attention"));
  doc["sliding_window"] = nullptr;
  doc["transformers_version"] = "5.0.0";
  return doc;
}

void expect_qwen25_05b(const ModelConfig& c) {
  EXPECT_EQ(c.hidden_size, 896);
  EXPECT_EQ(c.intermediate_size, 4864);
  EXPECT_EQ(c.num_hidden_layers, 24);
  EXPECT_EQ(c.num_attention_heads, 14);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.torch_dtype, DType::BF16);
  EXPECT_EQ(c.head_dim(), 64);
  EXPECT_EQ(c.q_dim(), 896);
  EXPECT_EQ(c.kv_dim(), 128);
}

// The parse error for `doc` with `edit` applied; it must name the source and `field`.
template <class Edit>
std::string refusal(Edit edit, const std::string& field) {
  json doc = qwen25_05b_classic();
  edit(doc);
  std::string msg = error_of([&] { parse_model_config(doc, "ckpt/config.json"); });
  EXPECT_CONTAINS(msg, "ckpt/config.json");
  EXPECT_CONTAINS(msg, "\"" + field + "\"");
  return msg;
}

int64_t parameter_count(const ModelConfig& c) {
  const int64_t d = c.hidden_size, kv = c.kv_dim(), i = c.intermediate_size;
  const int64_t per_layer = (d * d + d) + 2 * (d * kv + kv) + d * d + 3 * d * i + 2 * d;
  const int64_t embeddings = c.vocab_size * d * (c.tie_word_embeddings ? 1 : 2);
  return embeddings + c.num_hidden_layers * per_layer + d;
}

TEST(ModelConfigTest, ParsesTheClassicForm) {
  expect_qwen25_05b(parse_model_config(qwen25_05b_classic(), "c.json"));
}

TEST(ModelConfigTest, ParsesTheTransformers5Form) {
  expect_qwen25_05b(parse_model_config(qwen25_05b_v5(), "c.json"));
}

TEST(ModelConfigTest, SlidingAttentionLayerTypesAreFullAttentionWhenTheWindowIsOff) {
  json doc = qwen25_05b_v5();
  doc["layer_types"][23] = "sliding_attention";
  EXPECT_EQ(parse_model_config(doc, "c.json").num_hidden_layers, 24);
}

TEST(ModelConfigTest, AppliesTransformersDefaults) {
  json doc = {{"model_type", "qwen2"},  {"hidden_size", 64},        {"intermediate_size", 128},
              {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"vocab_size", 100}};
  ModelConfig c = parse_model_config(doc, "c.json");
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.torch_dtype, DType::F32);

  doc["num_key_value_heads"] = nullptr;
  EXPECT_EQ(parse_model_config(doc, "c.json").num_key_value_heads, 4);
  doc["rope_scaling"] = {{"type", "default"}};
  EXPECT_DOUBLE_EQ(parse_model_config(doc, "c.json").rope_theta, 10000.0);
}

TEST(ModelConfigTest, RefusesOtherArchitectures) {
  std::string msg = refusal([](json& d) { d["architectures"] = {"MistralForCausalLM"}; }, "architectures");
  EXPECT_CONTAINS(msg, "MistralForCausalLM");
  EXPECT_CONTAINS(msg, "Qwen2ForCausalLM");
  refusal([](json& d) { d["architectures"] = "Qwen2ForCausalLM"; }, "architectures");
  msg = refusal([](json& d) { d["model_type"] = "qwen3_moe"; }, "model_type");
  EXPECT_CONTAINS(msg, "qwen3_moe");
  msg = refusal([](json& d) { d["architectures"] = {"LlamaForCausalLM"}; }, "model_type");  // model_type qwen2
  EXPECT_CONTAINS(msg, "LlamaForCausalLM");
  refusal([](json& d) { d["model_type"] = 2; }, "model_type");

  json doc = qwen25_05b_classic();
  doc.erase("architectures");
  doc.erase("model_type");
  std::string missing = error_of([&] { parse_model_config(doc, "ckpt/config.json"); });
  EXPECT_CONTAINS(missing, "ckpt/config.json");
  EXPECT_CONTAINS(missing, "\"architectures\"");
  EXPECT_CONTAINS(missing, "\"model_type\"");
}

TEST(ModelConfigTest, RefusesMissingRequiredFields) {
  for (const char* field :
       {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"}) {
    std::string msg = refusal([&](json& d) { d.erase(field); }, field);
    EXPECT_CONTAINS(msg, "missing required field");
  }
}

TEST(ModelConfigTest, RefusesWrongJsonTypes) {
  refusal([](json& d) { d["hidden_size"] = "896"; }, "hidden_size");
  refusal([](json& d) { d["hidden_size"] = 896.5; }, "hidden_size");
  refusal([](json& d) { d["num_key_value_heads"] = true; }, "num_key_value_heads");
  refusal([](json& d) { d["rms_norm_eps"] = "1e-6"; }, "rms_norm_eps");
  refusal([](json& d) { d["rope_theta"] = json::array(); }, "rope_theta");
  refusal([](json& d) { d["tie_word_embeddings"] = 1; }, "tie_word_embeddings");
  refusal([](json& d) { d["torch_dtype"] = 16; }, "torch_dtype");
  refusal([](json& d) { d["sliding_window"] = "none"; }, "sliding_window");
  refusal([](json& d) { d["layer_types"] = "full_attention"; }, "layer_types");
  refusal([](json& d) { d["rope_scaling"] = "linear"; }, "rope_scaling");
  std::string msg = error_of([] { parse_model_config(json::array(), "ckpt/config.json"); });
  EXPECT_CONTAINS(msg, "expected a JSON object");
}

TEST(ModelConfigTest, RefusesNonPositiveSizes) {
  refusal([](json& d) { d["hidden_size"] = 0; }, "hidden_size");
  refusal([](json& d) { d["vocab_size"] = -5; }, "vocab_size");
  refusal([](json& d) { d["num_key_value_heads"] = 0; }, "num_key_value_heads");
  refusal([](json& d) { d["max_position_embeddings"] = -1; }, "max_position_embeddings");
  refusal([](json& d) { d["rms_norm_eps"] = 0.0; }, "rms_norm_eps");
  refusal([](json& d) { d["rope_theta"] = -1.0; }, "rope_theta");
  refusal([](json& d) { d["hidden_size"] = 18446744073709551615u; }, "hidden_size");
}

TEST(ModelConfigTest, RefusesRopeScaling) {
  std::string msg = refusal([](json& d) { d["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}}; }, "rope_scaling");
  EXPECT_CONTAINS(msg, "yarn");
  refusal([](json& d) { d["rope_scaling"] = {{"factor", 4.0}}; }, "rope_scaling");
  json doc = qwen25_05b_v5();
  doc["rope_parameters"]["rope_type"] = "linear";
  msg = error_of([&] { parse_model_config(doc, "v5/config.json"); });
  EXPECT_CONTAINS(msg, "v5/config.json");
  EXPECT_CONTAINS(msg, "\"rope_parameters\"");
  EXPECT_CONTAINS(msg, "linear");
}

TEST(ModelConfigTest, RefusesConflictingDuplicates) {
  refusal(
      [](json& d) {
        d["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5.0}};
      },
      "rope_parameters.rope_theta");
  refusal([](json& d) { d["dtype"] = "float16"; }, "dtype");
  std::string msg = refusal([](json& d) { d["torch_dtype"] = "int8"; }, "torch_dtype");
  EXPECT_CONTAINS(msg, "int8");
}

TEST(ModelConfigTest, RefusesSlidingWindowAttention) {
  refusal([](json& d) { d["use_sliding_window"] = true; }, "use_sliding_window");
  json doc = qwen25_05b_v5();
  doc["use_sliding_window"] = true;
  doc["sliding_window"] = 4096;
  doc["layer_types"][0] = "sliding_attention";
  std::string msg = error_of([&] { parse_model_config(doc, "v5/config.json"); });
  EXPECT_CONTAINS(msg, "v5/config.json");
  EXPECT_CONTAINS(msg, "sliding");
}

TEST(ModelConfigTest, RefusesBadLayerTypes) {
  std::string msg =
      refusal([](json& d) { d["layer_types"] = json(std::vector<std::string>(3, "full_attention")); }, "layer_types");
  EXPECT_CONTAINS(msg, "num_hidden_layers is 24");
  refusal(
      [](json& d) {
        d["layer_types"] = json(std::vector<std::string>(24, "full_attention"));
        d["layer_types"][5] = "chunked_attention";
      },
      "layer_types[5]");
}

TEST(ModelConfigTest, RefusesInconsistentHeads) {
  std::string msg = refusal([](json& d) { d["num_attention_heads"] = 13; }, "hidden_size");
  EXPECT_CONTAINS(msg, "not divisible by num_attention_heads");
  msg = refusal([](json& d) { d["num_key_value_heads"] = 4; }, "num_attention_heads");
  EXPECT_CONTAINS(msg, "not divisible by num_key_value_heads");
  msg = refusal([](json& d) { d["hidden_size"] = 14 * 63; }, "hidden_size");
  EXPECT_CONTAINS(msg, "even");
  refusal([](json& d) { d["head_dim"] = 128; }, "head_dim");
  EXPECT_EQ(parse_model_config(
                [] {
                  json d = qwen25_05b_classic();
                  d["head_dim"] = 64;
                  return d;
                }(),
                "c")
                .head_dim(),
            64);
}

TEST(ModelConfigTest, RefusesOtherActivations) {
  refusal([](json& d) { d["hidden_act"] = "gelu"; }, "hidden_act");
}

class ModelConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing_support::make_temp_dir("config_test"); }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& text) {
    std::string p = (dir_ / "config.json").string();
    std::ofstream(p) << text;
    return p;
  }
  fs::path dir_;
};

TEST_F(ModelConfigFileTest, LoadsAFile) {
  expect_qwen25_05b(load_config_json(write(qwen25_05b_classic().dump(2))));
}

TEST_F(ModelConfigFileTest, MissingFileAndInvalidJson) {
  std::string absent = (dir_ / "absent.json").string();
  std::string msg = error_of([&] { load_config_json(absent); });
  EXPECT_CONTAINS(msg, absent);
  EXPECT_CONTAINS(msg, "cannot open");

  std::string p = write("{\n  \"hidden_size\": 896,\n  \"vocab_size\": }");
  msg = error_of([&] { load_config_json(p); });
  EXPECT_CONTAINS(msg, p);
  EXPECT_CONTAINS(msg, "invalid JSON");
  EXPECT_CONTAINS(msg, "line 3");

  msg = error_of([&] { load_config_json(dir_.string()); });
  EXPECT_CONTAINS(msg, "is a directory");

  json llama = qwen25_05b_classic();
  llama["model_type"] = "llama";
  p = write(llama.dump());
  msg = error_of([&] { load_config_json(p); });
  EXPECT_CONTAINS(msg, p);
  EXPECT_CONTAINS(msg, "\"model_type\"");
}

TEST_F(ModelConfigFileTest, NumberTooLargeForADoubleIsAnError) {
  const std::string p = write(R"({"model_type": "qwen2", "rms_norm_eps": 1e400})");
  const std::string msg = error_of([&] { load_config_json(p); });
  EXPECT_CONTAINS(msg, p + ": invalid JSON");
  EXPECT_CONTAINS(msg, "1e400");
}

TEST(ModelConfigTest, RefusesAttentionDropout) {
  std::string msg = refusal([](json& d) { d["attention_dropout"] = 0.1; }, "attention_dropout");
  EXPECT_CONTAINS(msg, "not supported");
  refusal([](json& d) { d["attention_dropout"] = "0"; }, "attention_dropout");
  json zero = qwen25_05b_classic();
  zero["attention_dropout"] = 0;
  EXPECT_NO_THROW(parse_model_config(zero, "config.json"));
}

TEST(ModelConfigTest, RefusesHeadsWiderThanTheAttentionKernels) {
  // 2 heads of 512: refused when the config is read, not at the first step.
  std::string msg = refusal(
      [](json& d) {
        d["hidden_size"] = 1024;
        d["num_attention_heads"] = 2;
        d["num_key_value_heads"] = 1;
      },
      "hidden_size");
  EXPECT_CONTAINS(msg, "head_dim 512");
  EXPECT_CONTAINS(msg, "at most 256");
}

TEST(ModelConfigTest, MaxLengthAboveMaxPositionEmbeddingsIsAnError) {
  const ModelConfig c = model_preset("tiny");  // max_position_embeddings 2048
  EXPECT_NO_THROW(check_max_length(c, 2048, "tiny/config.json"));
  EXPECT_NO_THROW(check_max_length(c, 0, "tiny/config.json"));
  const std::string msg = error_of([&] { check_max_length(c, 4096, "tiny/config.json"); });
  EXPECT_CONTAINS(msg, "--max_length 4096");
  EXPECT_CONTAINS(msg, "max_position_embeddings 2048");
  EXPECT_CONTAINS(msg, "tiny/config.json");
}

TEST(ModelConfigTest, ToJsonRoundTrips) {
  for (const char* name : {"tiny", "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-72b"}) {
    ModelConfig c = model_preset(name);
    json doc = config_to_json(c);
    EXPECT_EQ(doc["architectures"], json({"Qwen2ForCausalLM"}));
    EXPECT_EQ(doc["model_type"], "qwen2");
    EXPECT_EQ(doc["hidden_act"], "silu");
    EXPECT_EQ(doc["use_sliding_window"], false);
    EXPECT_TRUE(doc["sliding_window"].is_null());
    EXPECT_EQ(doc["torch_dtype"], dtype_torch_name(c.torch_dtype));
    ModelConfig back = parse_model_config(json::parse(doc.dump()), name);
    EXPECT_EQ(back.hidden_size, c.hidden_size);
    EXPECT_EQ(back.intermediate_size, c.intermediate_size);
    EXPECT_EQ(back.num_hidden_layers, c.num_hidden_layers);
    EXPECT_EQ(back.num_attention_heads, c.num_attention_heads);
    EXPECT_EQ(back.num_key_value_heads, c.num_key_value_heads);
    EXPECT_EQ(back.vocab_size, c.vocab_size);
    EXPECT_EQ(back.max_position_embeddings, c.max_position_embeddings);
    EXPECT_EQ(back.rms_norm_eps, c.rms_norm_eps);
    EXPECT_EQ(back.rope_theta, c.rope_theta);
    EXPECT_EQ(back.tie_word_embeddings, c.tie_word_embeddings);
    EXPECT_EQ(back.torch_dtype, c.torch_dtype);
  }
  EXPECT_EQ(config_to_json(model_preset("tiny"))["torch_dtype"], "float32");
}

TEST(ModelConfigTest, TinyPreset) {
  ModelConfig c = model_preset("tiny");
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.intermediate_size, 176);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.torch_dtype, DType::F32);
}

TEST(ModelConfigTest, Qwen25PresetsMatchThePublishedModels) {
  // Exact counts: 0.5B as published; 3B, 7B and 32B from the bf16 total_size of their
  // model.safetensors.index.json (6171877376, 15231233024, 65527752704 bytes).
  EXPECT_EQ(parameter_count(model_preset("qwen2.5-0.5b")), 494'032'768);
  EXPECT_EQ(parameter_count(model_preset("qwen2.5-3b")), 3'085'938'688);
  EXPECT_EQ(parameter_count(model_preset("qwen2.5-7b")), 7'615'616'512);
  EXPECT_EQ(parameter_count(model_preset("qwen2.5-32b")), 32'763'876'352);
  // The rest against their model cards: 1.54B, 14.7B, 72.7B.
  EXPECT_NEAR(parameter_count(model_preset("qwen2.5-1.5b")) / 1e9, 1.54, 0.005);
  EXPECT_NEAR(parameter_count(model_preset("qwen2.5-14b")) / 1e9, 14.7, 0.1);
  EXPECT_NEAR(parameter_count(model_preset("qwen2.5-72b")) / 1e9, 72.7, 0.05);
  for (const char* name :
       {"qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b"}) {
    ModelConfig c = model_preset(name);
    EXPECT_EQ(c.torch_dtype, DType::BF16) << name;
    EXPECT_DOUBLE_EQ(c.rope_theta, 1e6) << name;
    EXPECT_EQ(c.head_dim(), c.hidden_size == 896 ? 64 : 128) << name;
    EXPECT_NO_THROW(parse_model_config(config_to_json(c), name)) << name;
  }
  EXPECT_EQ(model_preset("Qwen2.5-7B").hidden_size, 3584);
}

// Qwen/Qwen3-0.6B's config.json as published.
json qwen3_06b() {
  return json::parse(R"({"architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936})");
}
// meta-llama/Llama-3.2-1B's config.json as published.
json llama32_1b() {
  return json::parse(R"({"architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
    "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256})");
}

void expect_same_shape(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.family, b.family);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.head_dim(), b.head_dim());
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_DOUBLE_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_DOUBLE_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.attention_bias, b.attention_bias);
  EXPECT_EQ(a.qk_norm, b.qk_norm);
  EXPECT_EQ(a.rope_scaling.llama3, b.rope_scaling.llama3);
  EXPECT_DOUBLE_EQ(a.rope_scaling.factor, b.rope_scaling.factor);
  EXPECT_DOUBLE_EQ(a.rope_scaling.low_freq_factor, b.rope_scaling.low_freq_factor);
  EXPECT_DOUBLE_EQ(a.rope_scaling.high_freq_factor, b.rope_scaling.high_freq_factor);
  EXPECT_EQ(a.rope_scaling.original_max_position_embeddings, b.rope_scaling.original_max_position_embeddings);
}

TEST(ModelConfigTest, ParsesQwen3AndLlama3Configs) {
  const ModelConfig q = parse_model_config(qwen3_06b(), "qwen3/config.json");
  EXPECT_EQ(q.family, ModelFamily::Qwen3);
  EXPECT_EQ(q.head_dim(), 128);  // not 1024 / 16
  EXPECT_EQ(q.q_dim(), 2048);
  EXPECT_FALSE(q.attention_bias);
  EXPECT_TRUE(q.qk_norm);
  expect_same_shape(q, model_preset("qwen3-0.6b"));
  const ModelConfig l = parse_model_config(llama32_1b(), "llama/config.json");
  EXPECT_EQ(l.family, ModelFamily::Llama);
  EXPECT_TRUE(l.rope_scaling.llama3);
  EXPECT_DOUBLE_EQ(l.rope_scaling.factor, 32.0);
  expect_same_shape(l, model_preset("llama-3.2-1b"));
  // Round trips through the config.json memtune writes.
  for (const char* name : {"qwen3-4b", "llama-3.1-8b", "tiny-qwen3", "tiny-llama"})
    expect_same_shape(parse_model_config(config_to_json(model_preset(name)), name), model_preset(name));
  // Qwen3Config's default head_dim is 128, LlamaConfig's hidden / heads.
  json doc = qwen3_06b();
  doc.erase("head_dim");
  EXPECT_EQ(parse_model_config(doc, "c.json").head_dim(), 128);
  doc = llama32_1b();
  doc.erase("head_dim");
  EXPECT_EQ(parse_model_config(doc, "c.json").head_dim(), 64);
  doc["attention_bias"] = true;
  EXPECT_TRUE(parse_model_config(doc, "c.json").attention_bias);
}

TEST(ModelConfigTest, RefusesWhatQwen3AndLlamaDoNotSupport) {
  auto refused = [](json doc, const std::string& field) {
    const std::string msg = error_of([&] { parse_model_config(doc, "ckpt/config.json"); });
    EXPECT_CONTAINS(msg, "ckpt/config.json");
    EXPECT_CONTAINS(msg, "\"" + field + "\"");
    return msg;
  };
  json doc = llama32_1b();
  doc["rope_scaling"]["rope_type"] = "yarn";
  EXPECT_CONTAINS(refused(doc, "rope_scaling"), "yarn");
  doc = llama32_1b();
  doc["rope_scaling"].erase("low_freq_factor");
  refused(doc, "rope_scaling.low_freq_factor");
  doc = llama32_1b();
  doc["mlp_bias"] = true;
  refused(doc, "mlp_bias");
  doc = qwen3_06b();  // llama3 scaling belongs to Llama
  doc["rope_scaling"] = llama32_1b()["rope_scaling"];
  EXPECT_CONTAINS(refused(doc, "rope_scaling"), "llama3");
  doc = qwen3_06b();
  doc["use_sliding_window"] = true;
  refused(doc, "use_sliding_window");
  doc = qwen3_06b();
  doc["head_dim"] = 127;
  refused(doc, "head_dim");
  doc = qwen3_06b();  // a mixture of experts needs its own keys
  doc["model_type"] = "qwen3_moe";
  doc["architectures"] = {"Qwen3MoeForCausalLM"};
  refused(doc, "num_experts");
}

TEST(ModelConfigTest, Qwen3AndLlama3PresetsMatchThePublishedModels) {
  // Model cards: Qwen3 0.6B / 1.7B / 4.0B / 8.2B / 14.8B / 32.8B parameters; Llama 3.2 1.23B and
  // 3.21B (the 1B has 1,235,814,400: its card truncates), Llama 3.1 8.03B and 70.6B.
  const std::pair<const char*, double> published[] = {
      {"qwen3-0.6b", 0.6},   {"qwen3-1.7b", 1.7},     {"qwen3-4b", 4.0},       {"qwen3-8b", 8.2},
      {"qwen3-14b", 14.8},   {"qwen3-32b", 32.8},     {"llama-3.2-1b", 1.23},  {"llama-3.2-3b", 3.21},
      {"llama-3.1-8b", 8.03}, {"llama-3.1-70b", 70.6}};
  for (const auto& [name, billions] : published) {
    const double digits = billions < 1.0 || std::string(name).starts_with("qwen3") || billions > 50 ? 0.05 : 0.01;
    EXPECT_NEAR(static_cast<double>(model_parameter_count(model_preset(name))) / 1e9, billions, digits) << name;
  }
  // Exactly, from the bf16 total_size of meta-llama/Llama-3.1-8B's model.safetensors.index.json
  // (16060522496 bytes).
  EXPECT_EQ(model_parameter_count(model_preset("llama-3.1-8b")), 8'030'261'248);
  // Qwen3 adds q_norm and k_norm (head_dim each) per layer and drops the q/k/v biases.
  const ModelConfig q = model_preset("qwen3-0.6b");
  const int64_t attention = 2 * q.hidden_size * q.q_dim() + 2 * q.hidden_size * q.kv_dim() + 2 * q.head_dim();
  const int64_t mlp = 3 * q.hidden_size * q.intermediate_size;
  EXPECT_EQ(model_parameter_count(q),
            q.vocab_size * q.hidden_size + q.num_hidden_layers * (attention + mlp + 2 * q.hidden_size) + q.hidden_size);
}

// Model cards: Qwen3-30B-A3B 30.5B parameters, 3.3B activated (3.35B counted here, the embedding
// and the head included); Qwen3-235B-A22B 235B, 22B; Qwen2-57B-A14B 57B, 14B; Qwen1.5-MoE-A2.7B
// 14.3B, 2.7B.
TEST(ModelConfigTest, MixtureOfExpertsPresetsMatchThePublishedModels) {
  const std::tuple<const char*, double, double, double> published[] = {
      {"qwen3-30b-a3b", 30.5, 3.3, 0.06},     {"qwen3-235b-a22b", 235.0, 22.0, 0.5},
      {"qwen2-57b-a14b", 57.0, 14.0, 0.5},    {"qwen1.5-moe-a2.7b", 14.3, 2.7, 0.05}};
  for (const auto& [name, total, active, digits] : published) {
    const ModelConfig c = model_preset(name);
    EXPECT_TRUE(c.moe.enabled()) << name;
    EXPECT_NEAR(static_cast<double>(model_parameter_count(c)) / 1e9, total, digits) << name;
    EXPECT_NEAR(static_cast<double>(model_active_parameter_count(c)) / 1e9, active, digits) << name;
  }
  // A dense model's parameters are all active.
  EXPECT_EQ(model_active_parameter_count(model_preset("qwen3-8b")), model_parameter_count(model_preset("qwen3-8b")));
  // Qwen3-30B-A3B's layer by hand: attention (no biases, q/k norms), the router, 128 experts.
  const ModelConfig q = model_preset("qwen3-30b-a3b");
  const int64_t D = q.hidden_size, Ie = q.moe.expert_intermediate_size;
  const int64_t attention = 2 * D * q.q_dim() + 2 * D * q.kv_dim() + 2 * q.head_dim();
  const int64_t layer = attention + 128 * D + 128 * 3 * D * Ie + 2 * D;
  EXPECT_EQ(model_parameter_count(q), 2 * q.vocab_size * D + q.num_hidden_layers * layer + D);
}

TEST(ModelConfigTest, MixtureOfExpertsConfigsRoundTripAndSayWhichLayersAreSparse) {
  for (const char* name : {"tiny-qwen3-moe", "tiny-qwen2-moe", "qwen3-30b-a3b", "qwen2-57b-a14b"}) {
    const ModelConfig c = model_preset(name);
    const json doc = config_to_json(c);
    const ModelConfig back = parse_model_config(json::parse(doc.dump()), name);
    EXPECT_EQ(back.family, c.family) << name;
    EXPECT_EQ(back.attention_bias, c.attention_bias) << name;
    EXPECT_EQ(back.head_dim(), c.head_dim()) << name;
    EXPECT_EQ(back.moe.num_experts, c.moe.num_experts) << name;
    EXPECT_EQ(back.moe.experts_per_token, c.moe.experts_per_token) << name;
    EXPECT_EQ(back.moe.expert_intermediate_size, c.moe.expert_intermediate_size) << name;
    EXPECT_EQ(back.moe.shared_expert_intermediate_size, c.moe.shared_expert_intermediate_size) << name;
    EXPECT_EQ(back.moe.norm_topk_prob, c.moe.norm_topk_prob) << name;
    EXPECT_EQ(back.moe.decoder_sparse_step, c.moe.decoder_sparse_step) << name;
    EXPECT_EQ(model_parameter_count(back), model_parameter_count(c)) << name;
  }
  EXPECT_EQ(config_to_json(model_preset("qwen2-57b-a14b"))["architectures"], json({"Qwen2MoeForCausalLM"}));
  EXPECT_EQ(config_to_json(model_preset("qwen3-30b-a3b"))["model_type"], "qwen3_moe");
  // transformers' rule: sparse unless in mlp_only_layers or (l + 1) % decoder_sparse_step != 0.
  json doc = config_to_json(model_preset("tiny-qwen3-moe"));
  doc["num_hidden_layers"] = 6;
  doc["decoder_sparse_step"] = 2;
  doc["mlp_only_layers"] = {3};
  const ModelConfig c = parse_model_config(doc, "config.json");
  std::vector<bool> sparse;
  for (int64_t l = 0; l < 6; ++l) sparse.push_back(c.moe.sparse(l));
  EXPECT_EQ(sparse, (std::vector<bool>{false, true, false, false, false, true}));
  // Qwen2-MoE's attention biases come from qkv_bias, default true.
  json q2 = config_to_json(model_preset("tiny-qwen2-moe"));
  q2.erase("qkv_bias");
  EXPECT_TRUE(parse_model_config(q2, "config.json").attention_bias);
  q2["qkv_bias"] = false;
  EXPECT_FALSE(parse_model_config(q2, "config.json").attention_bias);
}

TEST(ModelConfigTest, RefusesWhatMixtureOfExpertsConfigsCannotHold) {
  auto error = [](json doc) {
    try {
      parse_model_config(doc, "moe/config.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  json doc = config_to_json(model_preset("tiny-qwen3-moe"));
  json more = doc;
  more["num_experts_per_tok"] = 9;  // of 8 experts
  EXPECT_NE(error(more).find("num_experts_per_tok"), std::string::npos) << error(more);
  more = doc;
  more.erase("moe_intermediate_size");
  EXPECT_NE(error(more).find("moe_intermediate_size"), std::string::npos) << error(more);
  more = doc;
  more["mlp_only_layers"] = {2};  // of 2 layers
  EXPECT_NE(error(more).find("mlp_only_layers"), std::string::npos) << error(more);
  // A quantized mixture of experts reads (its experts packed: quantized_model_test.cpp).
  more = doc;
  more["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}, {"group_size", 32}};
  EXPECT_EQ(error(more), "accepted");
  // What memtune writes for a quantized MoE names every expert's projections and not the router
  // (optimum's modules_in_block_to_quantize), and reads back; a list naming the router or leaving
  // an expert out is refused, naming the field and the module.
  ModelConfig packed = model_preset("tiny-qwen2-moe");
  packed.quant = parse_quantization_name("gptq-int4");
  packed.quant.group_size = 32;
  json written = config_to_json(packed);
  const json listed = written["quantization_config"]["modules_in_block_to_quantize"];
  ASSERT_EQ(listed.size(), 4u);
  EXPECT_EQ(listed[0], json({"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}));
  // Its dense layer's MLP (decoder_sparse_step 2), 6 experts and the shared expert, gate and up.
  EXPECT_EQ(listed[2].size(), 2u * (1 + 6 + 1));
  EXPECT_EQ(listed[3][1], "mlp.experts.0.down_proj");
  EXPECT_EQ(listed[3].back(), "mlp.shared_expert.down_proj");
  EXPECT_EQ(error(written), "accepted");
  json router = written;
  router["quantization_config"]["modules_in_block_to_quantize"][1].push_back("mlp.gate");
  EXPECT_NE(error(router).find("modules_in_block_to_quantize\": names \"mlp.gate\""), std::string::npos)
      << error(router);
  json missing = written;
  missing["quantization_config"]["modules_in_block_to_quantize"][3].erase(1);
  EXPECT_NE(error(missing).find("leaves out \"mlp.experts.0.down_proj\""), std::string::npos) << error(missing);
}

TEST(ModelConfigTest, Llama3RopeScalingKeepsHighFrequenciesAndSlowsLowOnes) {
  const ModelConfig plain = [] {
    ModelConfig c = model_preset("llama-3.1-8b");
    c.rope_scaling.llama3 = false;
    return c;
  }();
  const std::vector<float> base = rope_inv_freq(plain), scaled = rope_inv_freq(model_preset("llama-3.1-8b"));
  ASSERT_EQ(base.size(), 64u);
  const double pi = 3.14159265358979323846;
  int kept = 0, divided = 0, between = 0;
  for (size_t i = 0; i < base.size(); ++i) {
    const double wavelen = 2 * pi / base[i];
    if (wavelen < 8192.0 / 4) {  // high frequencies: unchanged
      EXPECT_FLOAT_EQ(scaled[i], base[i]) << i;
      ++kept;
    } else if (wavelen > 8192.0) {  // low frequencies: divided by factor 8
      EXPECT_FLOAT_EQ(scaled[i], base[i] / 8) << i;
      ++divided;
    } else {
      EXPECT_LT(scaled[i], base[i]) << i;
      EXPECT_GT(scaled[i], base[i] / 8) << i;
      ++between;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(between, 0);
}

TEST(ModelConfigTest, UnknownPresetListsTheValidNames) {
  std::string msg = error_of([] { model_preset("qwen2.5-8b"); });
  EXPECT_CONTAINS(msg, "qwen2.5-8b");
  EXPECT_CONTAINS(msg, "tiny");
  EXPECT_CONTAINS(msg, "qwen2.5-0.5b");
  EXPECT_CONTAINS(msg, "qwen2.5-72b");
}

}  // namespace
}  // namespace memtune
