// Tests for Qwen2 config.json parsing: the classic transformers-4 form as published for
// Qwen2.5, the transformers-5 form, every refusal (each naming the file and field), the presets
// (checked against published parameter counts) and the to_json -> parse round trip.
#include "model/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

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

void expect_qwen25_05b(const Qwen2Config& c) {
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
  std::string msg = error_of([&] { parse_qwen2_config(doc, "ckpt/config.json"); });
  EXPECT_CONTAINS(msg, "ckpt/config.json");
  EXPECT_CONTAINS(msg, "\"" + field + "\"");
  return msg;
}

int64_t parameter_count(const Qwen2Config& c) {
  const int64_t d = c.hidden_size, kv = c.kv_dim(), i = c.intermediate_size;
  const int64_t per_layer = (d * d + d) + 2 * (d * kv + kv) + d * d + 3 * d * i + 2 * d;
  const int64_t embeddings = c.vocab_size * d * (c.tie_word_embeddings ? 1 : 2);
  return embeddings + c.num_hidden_layers * per_layer + d;
}

TEST(Qwen2ConfigTest, ParsesTheClassicForm) {
  expect_qwen25_05b(parse_qwen2_config(qwen25_05b_classic(), "c.json"));
}

TEST(Qwen2ConfigTest, ParsesTheTransformers5Form) {
  expect_qwen25_05b(parse_qwen2_config(qwen25_05b_v5(), "c.json"));
}

TEST(Qwen2ConfigTest, SlidingAttentionLayerTypesAreFullAttentionWhenTheWindowIsOff) {
  json doc = qwen25_05b_v5();
  doc["layer_types"][23] = "sliding_attention";
  EXPECT_EQ(parse_qwen2_config(doc, "c.json").num_hidden_layers, 24);
}

TEST(Qwen2ConfigTest, AppliesTransformersDefaults) {
  json doc = {{"model_type", "qwen2"},  {"hidden_size", 64},        {"intermediate_size", 128},
              {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"vocab_size", 100}};
  Qwen2Config c = parse_qwen2_config(doc, "c.json");
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.torch_dtype, DType::F32);

  doc["num_key_value_heads"] = nullptr;
  EXPECT_EQ(parse_qwen2_config(doc, "c.json").num_key_value_heads, 4);
  doc["rope_scaling"] = {{"type", "default"}};
  EXPECT_DOUBLE_EQ(parse_qwen2_config(doc, "c.json").rope_theta, 10000.0);
}

TEST(Qwen2ConfigTest, RefusesOtherArchitectures) {
  std::string msg = refusal([](json& d) { d["architectures"] = {"LlamaForCausalLM"}; }, "architectures");
  EXPECT_CONTAINS(msg, "LlamaForCausalLM");
  EXPECT_CONTAINS(msg, "Qwen2ForCausalLM");
  refusal([](json& d) { d["architectures"] = "Qwen2ForCausalLM"; }, "architectures");
  msg = refusal([](json& d) { d["model_type"] = "qwen3"; }, "model_type");
  EXPECT_CONTAINS(msg, "qwen3");
  refusal([](json& d) { d["model_type"] = 2; }, "model_type");

  json doc = qwen25_05b_classic();
  doc.erase("architectures");
  doc.erase("model_type");
  std::string missing = error_of([&] { parse_qwen2_config(doc, "ckpt/config.json"); });
  EXPECT_CONTAINS(missing, "ckpt/config.json");
  EXPECT_CONTAINS(missing, "\"architectures\"");
  EXPECT_CONTAINS(missing, "\"model_type\"");
}

TEST(Qwen2ConfigTest, RefusesMissingRequiredFields) {
  for (const char* field :
       {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"}) {
    std::string msg = refusal([&](json& d) { d.erase(field); }, field);
    EXPECT_CONTAINS(msg, "missing required field");
  }
}

TEST(Qwen2ConfigTest, RefusesWrongJsonTypes) {
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
  std::string msg = error_of([] { parse_qwen2_config(json::array(), "ckpt/config.json"); });
  EXPECT_CONTAINS(msg, "expected a JSON object");
}

TEST(Qwen2ConfigTest, RefusesNonPositiveSizes) {
  refusal([](json& d) { d["hidden_size"] = 0; }, "hidden_size");
  refusal([](json& d) { d["vocab_size"] = -5; }, "vocab_size");
  refusal([](json& d) { d["num_key_value_heads"] = 0; }, "num_key_value_heads");
  refusal([](json& d) { d["max_position_embeddings"] = -1; }, "max_position_embeddings");
  refusal([](json& d) { d["rms_norm_eps"] = 0.0; }, "rms_norm_eps");
  refusal([](json& d) { d["rope_theta"] = -1.0; }, "rope_theta");
  refusal([](json& d) { d["hidden_size"] = 18446744073709551615u; }, "hidden_size");
}

TEST(Qwen2ConfigTest, RefusesRopeScaling) {
  std::string msg = refusal([](json& d) { d["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}}; }, "rope_scaling");
  EXPECT_CONTAINS(msg, "yarn");
  refusal([](json& d) { d["rope_scaling"] = {{"factor", 4.0}}; }, "rope_scaling");
  json doc = qwen25_05b_v5();
  doc["rope_parameters"]["rope_type"] = "linear";
  msg = error_of([&] { parse_qwen2_config(doc, "v5/config.json"); });
  EXPECT_CONTAINS(msg, "v5/config.json");
  EXPECT_CONTAINS(msg, "\"rope_parameters\"");
  EXPECT_CONTAINS(msg, "linear");
}

TEST(Qwen2ConfigTest, RefusesConflictingDuplicates) {
  refusal(
      [](json& d) {
        d["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5.0}};
      },
      "rope_parameters.rope_theta");
  refusal([](json& d) { d["dtype"] = "float16"; }, "dtype");
  std::string msg = refusal([](json& d) { d["torch_dtype"] = "int8"; }, "torch_dtype");
  EXPECT_CONTAINS(msg, "int8");
}

TEST(Qwen2ConfigTest, RefusesSlidingWindowAttention) {
  refusal([](json& d) { d["use_sliding_window"] = true; }, "use_sliding_window");
  json doc = qwen25_05b_v5();
  doc["use_sliding_window"] = true;
  doc["sliding_window"] = 4096;
  doc["layer_types"][0] = "sliding_attention";
  std::string msg = error_of([&] { parse_qwen2_config(doc, "v5/config.json"); });
  EXPECT_CONTAINS(msg, "v5/config.json");
  EXPECT_CONTAINS(msg, "sliding");
}

TEST(Qwen2ConfigTest, RefusesBadLayerTypes) {
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

TEST(Qwen2ConfigTest, RefusesInconsistentHeads) {
  std::string msg = refusal([](json& d) { d["num_attention_heads"] = 13; }, "hidden_size");
  EXPECT_CONTAINS(msg, "not divisible by num_attention_heads");
  msg = refusal([](json& d) { d["num_key_value_heads"] = 4; }, "num_attention_heads");
  EXPECT_CONTAINS(msg, "not divisible by num_key_value_heads");
  msg = refusal([](json& d) { d["hidden_size"] = 14 * 63; }, "hidden_size");
  EXPECT_CONTAINS(msg, "even");
  refusal([](json& d) { d["head_dim"] = 128; }, "head_dim");
  EXPECT_EQ(parse_qwen2_config(
                [] {
                  json d = qwen25_05b_classic();
                  d["head_dim"] = 64;
                  return d;
                }(),
                "c")
                .head_dim(),
            64);
}

TEST(Qwen2ConfigTest, RefusesOtherActivations) {
  refusal([](json& d) { d["hidden_act"] = "gelu"; }, "hidden_act");
}

class Qwen2ConfigFileTest : public ::testing::Test {
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

TEST_F(Qwen2ConfigFileTest, LoadsAFile) {
  expect_qwen25_05b(load_qwen2_config(write(qwen25_05b_classic().dump(2))));
}

TEST_F(Qwen2ConfigFileTest, MissingFileAndInvalidJson) {
  std::string absent = (dir_ / "absent.json").string();
  std::string msg = error_of([&] { load_qwen2_config(absent); });
  EXPECT_CONTAINS(msg, absent);
  EXPECT_CONTAINS(msg, "cannot open");

  std::string p = write("{\n  \"hidden_size\": 896,\n  \"vocab_size\": }");
  msg = error_of([&] { load_qwen2_config(p); });
  EXPECT_CONTAINS(msg, p);
  EXPECT_CONTAINS(msg, "invalid JSON");
  EXPECT_CONTAINS(msg, "line 3");

  msg = error_of([&] { load_qwen2_config(dir_.string()); });
  EXPECT_CONTAINS(msg, "is a directory");

  json llama = qwen25_05b_classic();
  llama["model_type"] = "llama";
  p = write(llama.dump());
  msg = error_of([&] { load_qwen2_config(p); });
  EXPECT_CONTAINS(msg, p);
  EXPECT_CONTAINS(msg, "\"model_type\"");
}

TEST_F(Qwen2ConfigFileTest, NumberTooLargeForADoubleIsAnError) {
  const std::string p = write(R"({"model_type": "qwen2", "rms_norm_eps": 1e400})");
  const std::string msg = error_of([&] { load_qwen2_config(p); });
  EXPECT_CONTAINS(msg, p + ": invalid JSON");
  EXPECT_CONTAINS(msg, "1e400");
}

TEST(Qwen2ConfigTest, RefusesAttentionDropout) {
  std::string msg = refusal([](json& d) { d["attention_dropout"] = 0.1; }, "attention_dropout");
  EXPECT_CONTAINS(msg, "not supported");
  refusal([](json& d) { d["attention_dropout"] = "0"; }, "attention_dropout");
  json zero = qwen25_05b_classic();
  zero["attention_dropout"] = 0;
  EXPECT_NO_THROW(parse_qwen2_config(zero, "config.json"));
}

TEST(Qwen2ConfigTest, RefusesHeadsWiderThanTheAttentionKernels) {
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

TEST(Qwen2ConfigTest, MaxLengthAboveMaxPositionEmbeddingsIsAnError) {
  const Qwen2Config c = qwen2_preset("tiny");  // max_position_embeddings 2048
  EXPECT_NO_THROW(check_max_length(c, 2048, "tiny/config.json"));
  EXPECT_NO_THROW(check_max_length(c, 0, "tiny/config.json"));
  const std::string msg = error_of([&] { check_max_length(c, 4096, "tiny/config.json"); });
  EXPECT_CONTAINS(msg, "--max_length 4096");
  EXPECT_CONTAINS(msg, "max_position_embeddings 2048");
  EXPECT_CONTAINS(msg, "tiny/config.json");
}

TEST(Qwen2ConfigTest, ToJsonRoundTrips) {
  for (const char* name : {"tiny", "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-72b"}) {
    Qwen2Config c = qwen2_preset(name);
    json doc = qwen2_config_to_json(c);
    EXPECT_EQ(doc["architectures"], json({"Qwen2ForCausalLM"}));
    EXPECT_EQ(doc["model_type"], "qwen2");
    EXPECT_EQ(doc["hidden_act"], "silu");
    EXPECT_EQ(doc["use_sliding_window"], false);
    EXPECT_TRUE(doc["sliding_window"].is_null());
    EXPECT_EQ(doc["torch_dtype"], dtype_torch_name(c.torch_dtype));
    Qwen2Config back = parse_qwen2_config(json::parse(doc.dump()), name);
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
  EXPECT_EQ(qwen2_config_to_json(qwen2_preset("tiny"))["torch_dtype"], "float32");
}

TEST(Qwen2ConfigTest, TinyPreset) {
  Qwen2Config c = qwen2_preset("tiny");
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

TEST(Qwen2ConfigTest, Qwen25PresetsMatchThePublishedModels) {
  // Exact counts: 0.5B as published; 3B, 7B and 32B from the bf16 total_size of their
  // model.safetensors.index.json (6171877376, 15231233024, 65527752704 bytes).
  EXPECT_EQ(parameter_count(qwen2_preset("qwen2.5-0.5b")), 494'032'768);
  EXPECT_EQ(parameter_count(qwen2_preset("qwen2.5-3b")), 3'085'938'688);
  EXPECT_EQ(parameter_count(qwen2_preset("qwen2.5-7b")), 7'615'616'512);
  EXPECT_EQ(parameter_count(qwen2_preset("qwen2.5-32b")), 32'763'876'352);
  // The rest against their model cards: 1.54B, 14.7B, 72.7B.
  EXPECT_NEAR(parameter_count(qwen2_preset("qwen2.5-1.5b")) / 1e9, 1.54, 0.005);
  EXPECT_NEAR(parameter_count(qwen2_preset("qwen2.5-14b")) / 1e9, 14.7, 0.1);
  EXPECT_NEAR(parameter_count(qwen2_preset("qwen2.5-72b")) / 1e9, 72.7, 0.05);
  for (const char* name :
       {"qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b"}) {
    Qwen2Config c = qwen2_preset(name);
    EXPECT_EQ(c.torch_dtype, DType::BF16) << name;
    EXPECT_DOUBLE_EQ(c.rope_theta, 1e6) << name;
    EXPECT_EQ(c.head_dim(), c.hidden_size == 896 ? 64 : 128) << name;
    EXPECT_NO_THROW(parse_qwen2_config(qwen2_config_to_json(c), name)) << name;
  }
  EXPECT_EQ(qwen2_preset("Qwen2.5-7B").hidden_size, 3584);
}

TEST(Qwen2ConfigTest, UnknownPresetListsTheValidNames) {
  std::string msg = error_of([] { qwen2_preset("qwen2.5-8b"); });
  EXPECT_CONTAINS(msg, "qwen2.5-8b");
  EXPECT_CONTAINS(msg, "tiny");
  EXPECT_CONTAINS(msg, "qwen2.5-0.5b");
  EXPECT_CONTAINS(msg, "qwen2.5-72b");
}

}  // namespace
}  // namespace memtune
