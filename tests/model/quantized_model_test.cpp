// Quantized models end to end: `memtune quantize` writes GPTQ / AWQ files that an independent
// numpy reader dequantizes to exactly the weights `memtune dequantize` writes; a quantized model
// computes what its dequantized float copy computes (logits, greedy tokens, LoRA gradients:
// QLoRA), trains LoRA adapters, and refuses what it cannot do with clear errors. The GPTQ
// algorithm is checked on its own claim: a smaller error of the layer's output on the
// calibration inputs than round-to-nearest.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "backend/registry.h"
#include "core/rng.h"
#include "data/synthetic_tokenizer.h"
#include "io/safetensors.h"
#include "model/load.h"
#include "model/quantize.h"
#include "support/numeric.h"
#include "support/run_command.h"
#include "support/test_util.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;
using testing_support::run_memtune;

class QuantizedModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = testing_support::make_temp_dir("quantized_model");
    // A tiny model with weights 8x Hugging Face's initialization, so greedy decoding does not
    // collapse to one repeated token and a different weight shows in the tokens.
    ModelConfig config = model_preset("tiny");
    config.vocab_size = 269;
    config.tie_word_embeddings = false;
    ModelOptions o;
    o.max_tokens = 1;
    o.with_grads = false;
    o.loss_workspace_bytes = 0;
    Decoder m(config, o);
    m.parameters().init_random(5);
    for (size_t i = 0; i < m.parameters().specs().size(); ++i) {
      if (m.parameters().specs()[i].shape.size() != 2) continue;
      std::vector<float> v = download_f32(m.backend(), m.parameters().param(i));
      for (float& x : v) x *= 8;
      upload_f32(m.backend(), m.parameters().param(i), v);
    }
    m.parameters().save(path("float"));
    testing_support::write_synthetic_tokenizer(dir_ / "float");
    std::ofstream(path("batch.json")) << R"({"input_ids": [[5, 17, 42, 99, 3, 250, 7, 64, 12, 1, 33, 180]]})";
    std::ofstream calibration(path("calibration.jsonl"));
    for (int i = 0; i < 24; ++i)
      calibration << nlohmann::json{{"text", "the quick brown fox " + std::to_string(i * 37) + " jumps over"}}.dump()
                  << "\n";
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  static std::string path(const std::string& name) { return (dir_ / name).string(); }
  // Quantizes the float model with `flags` into `name` and writes its float32 copy to name_f32.
  static void quantize(const std::string& name, const std::string& flags) {
    auto r = run_memtune("quantize --model " + path("float") + " --out " + path(name) + " " + flags);
    ASSERT_EQ(r.status, 0) << r.output;
    r = run_memtune("dequantize --model " + path(name) + " --out " + path(name + "_f32") + " --torch_dtype float32");
    ASSERT_EQ(r.status, 0) << r.output;
  }
  static std::vector<float> tensor(const std::string& file, const std::string& name) {
    const SafetensorsFile f(file);
    const TensorInfo* t = f.find(name);
    EXPECT_NE(t, nullptr) << name;
    std::vector<float> v(static_cast<size_t>(t->numel()));
    std::memcpy(v.data(), f.data(*t).data(), v.size() * 4);
    return v;
  }
  // QLoRA against its float copy: an adapter with nonzero A and B on every site of `float_copy`
  // (saved to `adapter`), then `dump --adapter` (with `flags`) on `quantized` and on `float_copy`,
  // every gradient within 1e-4 of the float copy's. Returns each gradient's name and whether the
  // float copy's is nonzero.
  static std::vector<std::pair<std::string, bool>> qlora_gradients_match(const std::string& quantized,
                                                                         const std::string& float_copy,
                                                                         const std::string& adapter,
                                                                         const std::string& flags = "") {
    {
      ModelOptions o;
      o.max_tokens = 8;
      o.with_grads = false;
      o.lora.rank = 4;
      o.lora.alpha = 8;
      o.lora.targets.fill(true);
      Decoder m(load_model_config(path(float_copy)), o);
      for (size_t i = 0; i < m.parameters().num_trainable(); ++i) {
        const Tensor t = m.parameters().trainable_value(i);
        std::vector<float> v(static_cast<size_t>(t.numel()));
        for (size_t j = 0; j < v.size(); ++j) v[j] = 0.1f * std::sin(static_cast<float>(3 * j + i));
        upload_f32(m.backend(), t, v);
      }
      m.parameters().save_adapter(path(adapter), path(float_copy));
    }
    std::ofstream(path("lora_batch.json"))
        << R"({"input_ids": [[5, 17, 42, 99, 3, 250, 7, 64], [9, 8, 7, 6, 5, 4, 3, 2]]})";
    for (const std::string& m : {quantized, float_copy}) {
      const auto r = run_memtune("dump --model " + path(m) + " --adapter " + path(adapter) + " --input " +
                                 path("lora_batch.json") + " --out " + path(m + ".lora.dump") + " " + flags);
      EXPECT_EQ(r.status, 0) << r.output;
      if (r.status != 0) return {};
    }
    std::vector<std::pair<std::string, bool>> grads;
    const SafetensorsFile dump(path(quantized + ".lora.dump"));
    for (const TensorInfo& t : dump.tensors()) {
      if (!t.name.starts_with("grad.")) continue;
      const auto q = tensor(path(quantized + ".lora.dump"), t.name), f = tensor(path(float_copy + ".lora.dump"), t.name);
      EXPECT_TRUE(testing_support::close(q, f, testing_support::relative_tolerance(1e-4))) << t.name;
      grads.emplace_back(t.name, testing_support::difference(f, std::vector<float>(f.size(), 0.0f)).worst > 0);
    }
    return grads;
  }
  static inline fs::path dir_;
};

struct Case {
  const char* name;
  const char* flags;
};
const Case kCases[] = {
    {"gptq4", "--bits 4 --group_size 32"},
    {"gptq8", "--bits 8 --group_size 64"},
    {"awq4", "--format awq --bits 4 --group_size 16"},
    {"gptq4_actorder", "--bits 4 --group_size 32 --method gptq --act_order --calibration_file {}"},
};

std::string flags_of(const Case& c, const std::string& calibration) {
  std::string f = c.flags;
  if (const auto at = f.find("{}"); at != std::string::npos) f.replace(at, 2, calibration);
  return f;
}

TEST_F(QuantizedModelTest, FilesReadBackByAnIndependentReaderAndComputeLikeTheirFloatCopy) {
  std::ofstream prompts(path("prompts.jsonl"));
  for (int i = 0; i < 4; ++i) prompts << "{\"prompt_ids\": [" << 3 + i << ", " << 40 + 7 * i << ", 100, " << 200 - i << "]}\n";
  prompts.close();
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    quantize(c.name, flags_of(c, path("calibration.jsonl")));
    // The numpy reader (tests/io/quantized_vectors.py) dequantizes our files to the same weights.
    auto r = testing_support::run_command("/usr/bin/python3 " + testing_support::source_dir() + "/tests/io/quantized_vectors.py --check " +
                                          path(c.name) + " " + path(std::string(c.name) + "_f32"));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("14 quantized layers equal"), std::string::npos) << r.output;
    // Logits at every position: the packed kernels against float32 matmuls of the same weights.
    for (const std::string& m : {std::string(c.name), std::string(c.name) + "_f32"}) {
      r = run_memtune("dump --model " + path(m) + " --input " + path("batch.json") + " --out " + path(m + ".dump"));
      ASSERT_EQ(r.status, 0) << r.output;
    }
    const auto q = tensor(path(std::string(c.name) + ".dump"), "logits");
    const auto f = tensor(path(std::string(c.name) + "_f32.dump"), "logits");
    EXPECT_TRUE(testing_support::close(q, f, testing_support::relative_tolerance(1e-5)));
    // Greedy generation: the same tokens, and not one token repeated.
    for (const std::string& m : {std::string(c.name), std::string(c.name) + "_f32"}) {
      r = run_memtune("generate --model " + path(m) + " --tokenizer " + path("float") + " --input " +
                      path("prompts.jsonl") + " --output " + path(m + ".jsonl") +
                      " --max_new_tokens 40 --temperature 0 --ignore_eos");
      ASSERT_EQ(r.status, 0) << r.output;
    }
    const auto qa = testing_support::read_jsonl(path(std::string(c.name) + ".jsonl"));
    const auto fa = testing_support::read_jsonl(path(std::string(c.name) + "_f32.jsonl"));
    ASSERT_EQ(qa.size(), 4u);
    for (size_t i = 0; i < qa.size(); ++i) EXPECT_EQ(qa[i]["token_ids"], fa[i]["token_ids"]) << i;
    std::set<int> distinct;
    for (const auto& t : qa[0]["token_ids"]) distinct.insert(t.get<int>());
    EXPECT_GT(distinct.size(), 3u);
  }
  // The config says what the files hold.
  const nlohmann::json config = testing_support::read_json(dir_ / "gptq4_actorder" / "config.json");
  EXPECT_EQ(config["quantization_config"]["quant_method"], "gptq");
  EXPECT_EQ(config["quantization_config"]["desc_act"], true);
  EXPECT_EQ(config["quantization_config"]["bits"], 4);
}

// A quantized model's products of more than 16 rows without gradients take int8 activations
// (int8_activations.h) where the group allows: the logits of a 40-token batch equal the reference
// backend's, which rounds the same way in float64, and with --quantized_activations float the
// float copy's; the two numerics differ by more than the comparisons' tolerance and by little.
// bfloat16 operands likewise, and the default takes one of the two by the CPU's matrix unit.
// (A group of 16 and act-order keep float32 inputs: the test above.)
TEST_F(QuantizedModelTest, ManyRowsTakeInt8ActivationsAsTheReferenceComputesThem) {
  std::string rows;
  for (int b = 0; b < 2; ++b) {
    rows += b ? ", [" : "[";
    for (int t = 0; t < 20; ++t) rows += (t ? ", " : "") + std::to_string((37 * t + 11 * b + 5) % 269);
    rows += "]";
  }
  std::ofstream(path("long_batch.json")) << "{\"input_ids\": [" << rows << "]}";
  auto worst = [](const std::vector<float>& a, const std::vector<float>& b) {
    return testing_support::difference(a, b).worst;  // NaN (failing every bound) where a value is not finite
  };
  for (const Case& c : {kCases[0], kCases[1]}) {
    SCOPED_TRACE(c.name);
    const std::string name = std::string(c.name) + "_rows";
    quantize(name, flags_of(c, ""));
    auto dump = [&](const std::string& model, const std::string& flags, const std::string& out) {
      const auto r = run_memtune("dump --model " + path(model) + " --input " + path("long_batch.json") + " --out " +
                                 path(out) + " " + flags);
      EXPECT_EQ(r.status, 0) << r.output;
      return tensor(path(out), "logits");
    };
    const auto int8 = dump(name, "--quantized_activations int8", name + ".int8.dump");
    const auto reference = dump(name, "--backend reference --quantized_activations int8", name + ".ref.dump");
    const auto floats = dump(name, "--quantized_activations float", name + ".float.dump");
    const auto copy = dump(name + "_f32", "", name + ".f32.dump");
    ASSERT_EQ(int8.size(), 40u * 269u);
    const double scale = testing_support::difference(copy, copy).scale;
    EXPECT_LE(worst(int8, reference), 1e-5 * scale);
    EXPECT_LE(worst(floats, copy), 1e-5 * scale);
    EXPECT_GT(worst(int8, floats), 1e-4 * scale);
    EXPECT_LT(worst(int8, floats), 5e-2 * scale);
    // bfloat16 operands (--quantized_activations bf16) where the cpu backend has bfloat16
    // products: near the reference's rounding of the same operands, and a third numerics. Not
    // within 1e-5: rounding each activation to bfloat16 (a step of 2^-8 of the value) turns the
    // backends' float32 summation-order differences upstream into a whole step where a value sits
    // at a rounding boundary, and this model's 8x weights carry that to the logits (2.9e-3 of the
    // scale measured at gptq4). The op table checks the products against exact rounding.
    Backend& cpu = backend_named("cpu");
    const auto bf16_reference =
        dump(name, "--backend reference --quantized_activations bf16", name + ".bf16ref.dump");
    std::vector<float> bf16;
    if (cpu.bf16_quantized_products().empty()) {
      const auto r = run_memtune("dump --model " + path(name) + " --input " + path("long_batch.json") + " --out " +
                                 path(name + ".bf16.dump") + " --quantized_activations bf16");
      EXPECT_NE(r.status, 0);
      EXPECT_NE(r.output.find("--quantized_activations bf16: the cpu backend has no bfloat16 products"),
                std::string::npos)
          << r.output;
    } else {
      bf16 = dump(name, "--quantized_activations bf16", name + ".bf16.dump");
      EXPECT_LE(worst(bf16, bf16_reference), 2e-2 * scale);
    }
    EXPECT_GT(worst(bf16_reference, floats), 1e-4 * scale);
    EXPECT_GT(worst(bf16_reference, int8), 1e-4 * scale);
    EXPECT_LT(worst(bf16_reference, floats), 5e-2 * scale);
    // The default (auto) is bf16 where the cpu backend prefers it (oneDNN's kernel is an AMX one),
    // int8 activations otherwise: bit for bit one of the two.
    const auto automatic = dump(name, "", name + ".auto.dump");
    EXPECT_EQ(automatic, cpu.prefers_bf16_quantized_products() ? bf16 : int8);
  }
}

// A packed LM head (--lm_head_bits): quantize writes it as lm_head.qweight that the numpy reader
// dequantizes to the head `dequantize` writes; logits (the loss head on cpu and reference) and
// greedy tokens (the decoding head) equal the float copy's; the same head packed at load from a
// model that keeps it in floats computes the very same logits; the file is smaller; and what
// cannot hold a packed head is refused.
TEST_F(QuantizedModelTest, APackedLmHeadComputesLikeItsFloatCopyWhetherWrittenOrPackedAtLoad) {
  // GPTQ files pack the head's zeros along its outputs, 4 per int32 at 8 bits: vocabulary 269 is
  // refused with the field named, and a tied model of vocabulary 272 is packed (and untied).
  auto r = run_memtune("quantize --model " + path("float") + " --out " + path("head269") + " --lm_head_bits 8");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("the LM head's 269 outputs do not split into int32 words"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "head269"));
  r = run_memtune("init-model --config " + path("float") + "/config.json --out " + path("tied") +
                  " --set vocab_size=272 --set tie_word_embeddings=true --seed 3");
  ASSERT_EQ(r.status, 0) << r.output;
  auto quantize_tied = [&](const std::string& name, const std::string& flags) {
    auto q = run_memtune("quantize --model " + path("tied") + " --out " + path(name) + " " + flags);
    ASSERT_EQ(q.status, 0) << q.output;
    q = run_memtune("dequantize --model " + path(name) + " --out " + path(name + "_f32") + " --torch_dtype float32");
    ASSERT_EQ(q.status, 0) << q.output;
  };
  quantize_tied("head8", "--bits 4 --group_size 32 --lm_head_bits 8");
  r = testing_support::run_command("/usr/bin/python3 " + testing_support::source_dir() + "/tests/io/quantized_vectors.py --check " +
                                        path("head8") + " " + path("head8_f32"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("15 quantized layers equal"), std::string::npos) << r.output;  // 14 layers and the head
  const nlohmann::json config = testing_support::read_json(dir_ / "head8" / "config.json");
  EXPECT_EQ(config["quantization_config"]["lm_head"], true);
  EXPECT_EQ(config["quantization_config"]["lm_head_bits"], 8);
  EXPECT_EQ(config["tie_word_embeddings"], false);
  quantize_tied("plain4", "--bits 4 --group_size 32");
  // A tied head is untied: the file grows by the packed head (8-bit codes, scales, zeros), a quarter
  // of a float32 head plus a little.
  const double grown = double(fs::file_size(dir_ / "head8" / "model.safetensors")) -
                       double(fs::file_size(dir_ / "plain4" / "model.safetensors"));
  EXPECT_GT(grown, 272.0 * 64);
  EXPECT_LT(grown, 1.25 * 272 * 64);

  auto dump = [&](const std::string& model, const std::string& flags) {
    const std::string out = path(model + std::to_string(std::hash<std::string>{}(flags)) + ".dump");
    const auto d = run_memtune("dump --model " + path(model) + " --input " + path("batch.json") + " --out " + out + " " + flags);
    EXPECT_EQ(d.status, 0) << d.output;
    return tensor(out, "logits");
  };
  const auto packed = dump("head8", ""), reference = dump("head8", "--backend reference"), copy = dump("head8_f32", "");
  const auto at_load = dump("plain4", "--lm_head_bits 8"), plain = dump("plain4", "");
  const auto tolerance = testing_support::relative_tolerance(1e-5);
  EXPECT_TRUE(testing_support::close(packed, copy, tolerance));
  EXPECT_TRUE(testing_support::close(reference, copy, tolerance));
  EXPECT_EQ(at_load, packed);    // the same codes whether written by quantize or packed at load
  // The packed head is not the float one, and an 8-bit head moves the logits by little.
  const testing_support::Difference moved = testing_support::difference(packed, plain);
  EXPECT_GT(moved.worst, 1e-5 * moved.scale) << moved.describe();
  EXPECT_LT(moved.worst, 2e-2 * moved.scale) << moved.describe();

  auto greedy = [&](const std::string& model, const std::string& flags) {
    const std::string out = path(model + ".greedy.jsonl");
    const auto g = run_memtune("generate --model " + path(model) + " --input " +
                               path("head_prompts.jsonl") + " --output " + out +
                               " --max_new_tokens 24 --temperature 0 --ignore_eos --skip_tokenizer_init " + flags);
    EXPECT_EQ(g.status, 0) << g.output;
    std::vector<nlohmann::json> tokens;
    for (const auto& line : testing_support::read_jsonl(out)) tokens.push_back(line["token_ids"]);
    return tokens;
  };
  std::ofstream(path("head_prompts.jsonl")) << "{\"prompt_ids\": [3, 40, 100, 200]}\n{\"prompt_ids\": [9, 61, 7]}\n";
  const auto packed_tokens = greedy("head8", "");
  ASSERT_EQ(packed_tokens.size(), 2u);
  EXPECT_EQ(packed_tokens, greedy("head8_f32", ""));
  EXPECT_EQ(packed_tokens, greedy("plain4", "--lm_head_bits 8"));

  // Refused: a float model at load, an AWQ file, a width other than 4 or 8.
  r = run_memtune("generate --model " + path("float") + " --input " + path("head_prompts.jsonl") + " --output " +
                  path("x.jsonl") + " --lm_head_bits 8");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--lm_head_bits 8: the model is not quantized"), std::string::npos) << r.output;
  r = run_memtune("quantize --model " + path("float") + " --out " + path("awq_head") + " --format awq --lm_head_bits 4");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("packed LM heads are written in GPTQ files"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "awq_head"));
  r = run_memtune("dump --model " + path("plain4") + " --input " + path("batch.json") + " --out " + path("x.dump") +
                  " --lm_head_bits 6");
  EXPECT_NE(r.status, 0);
}

// QLoRA: the adapters' gradients on a quantized base equal those on its dequantized float copy,
// and a short LoRA run on the quantized base lowers the loss as one on the float copy does.
TEST_F(QuantizedModelTest, LoraOnAQuantizedBaseHasTheGradientsOfItsFloatCopy) {
  quantize("qlora", "--bits 4 --group_size 32");
  const auto grads = qlora_gradients_match("qlora", "qlora_f32", "adapter");
  for (const auto& [name, nonzero] : grads) EXPECT_TRUE(nonzero) << name;
  EXPECT_EQ(grads.size(), 2u * 7 * 2);  // A and B of 7 sites in 2 layers

  std::ofstream data(path("train.jsonl"));
  for (int i = 0; i < 16; ++i) data << "{\"text\": \"abc abc abc " << i % 3 << " abc abc\"}\n";
  data.close();
  std::vector<double> first, last;
  for (const std::string& m : {std::string("qlora"), std::string("qlora_f32")}) {
    const auto r = run_memtune("train --model_name_or_path " + path(m) + " --tokenizer " + path("float") +
                               " --train_file " + path("train.jsonl") + " --output_dir " + path(m + "_run") +
                               " --tuner_type lora --lora_rank 8 --learning_rate 1e-2 --max_steps 12 "
                               "--per_device_train_batch_size 4 --logging_steps 1 --save_strategy no");
    ASSERT_EQ(r.status, 0) << r.output;
    const auto log = testing_support::read_jsonl(path(m + "_run/log.jsonl"));
    ASSERT_GE(log.size(), 12u);
    first.push_back(log.front()["loss"].get<double>());
    last.push_back(log[11]["loss"].get<double>());
  }
  EXPECT_LT(last[0], 0.8 * first[0]);             // the quantized base learns
  EXPECT_NEAR(last[0], last[1], 0.05 * last[1]);  // like its float copy
}

// Mixtures of experts (tiny-qwen3-moe, tiny-qwen2-moe with its shared expert): round to nearest
// packs every expert's projections and leaves the router and the shared expert's gate as stored,
// as Qwen's GPTQ MoE checkpoints do; the numpy reader dequantizes the files to `dequantize`'s
// weights; the quantized model's logits, on cpu and on vulkan, equal its float copy's; LoRA on
// attention and every expert (QLoRA) has the float copy's gradients. GPTQ calibrates each expert
// on its routed rows.
TEST_F(QuantizedModelTest, MixturesOfExpertsPackTheirExpertsAndTrainLoraOnThem) {
  for (const std::string preset : {"tiny-qwen3-moe", "tiny-qwen2-moe"}) {
    SCOPED_TRACE(preset);
    const std::string name = preset.substr(5);  // qwen3-moe, qwen2-moe
    auto r = run_memtune("init-model --preset " + preset + " --out " + path(name) +
                         " --torch_dtype float32 --set vocab_size=269 --seed 7");
    ASSERT_EQ(r.status, 0) << r.output;
    testing_support::write_synthetic_tokenizer(dir_ / name);
    r = run_memtune("quantize --model " + path(name) + " --out " + path(name + "_q4") + " --bits 4 --group_size 32");
    ASSERT_EQ(r.status, 0) << r.output;
    r = run_memtune("dequantize --model " + path(name + "_q4") + " --out " + path(name + "_q4_f32") +
                    " --torch_dtype float32");
    ASSERT_EQ(r.status, 0) << r.output;
    const ModelConfig config = load_model_config(path(name + "_q4"));
    int64_t packed = 0;  // the layers' linear weights but the routers and shared-expert gates
    for (const ParamSpec& s : model_parameter_specs(config))
      packed += s.shape.size() == 2 && s.name.starts_with("model.layers.") && !s.name.ends_with("mlp.gate.weight") &&
                !s.name.ends_with("shared_expert_gate.weight");
    EXPECT_GT(packed, 2 * 4 + 3 * config.moe.num_experts);
    r = testing_support::run_command("/usr/bin/python3 " + testing_support::source_dir() + "/tests/io/quantized_vectors.py --check " +
                                     path(name + "_q4") + " " + path(name + "_q4_f32"));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find(fmt::format("{} quantized layers equal", packed)), std::string::npos) << r.output;
    const SafetensorsFile file(path(name + "_q4") + "/model.safetensors");
    EXPECT_NE(file.find("model.layers.1.mlp.experts.3.down_proj.qweight"), nullptr);
    EXPECT_NE(file.find("model.layers.1.mlp.gate.weight"), nullptr);  // the router as stored
    if (config.moe.shared_expert_intermediate_size > 0) {
      EXPECT_NE(file.find("model.layers.1.mlp.shared_expert_gate.weight"), nullptr);
    }
    for (const std::string backend : {"cpu", "vulkan"}) {
      const std::vector<std::string_view> built = backend_list();
      if (std::find(built.begin(), built.end(), backend) == built.end()) continue;
      std::vector<std::vector<float>> logits;
      for (const std::string& m : {name + "_q4", name + "_q4_f32"}) {
        r = run_memtune("dump --model " + path(m) + " --input " + path("batch.json") + " --out " + path(m + ".dump") +
                        " --backend " + backend);
        ASSERT_EQ(r.status, 0) << r.output;
        logits.push_back(tensor(path(m + ".dump"), "logits"));
      }
      EXPECT_TRUE(testing_support::close(logits[0], logits[1], testing_support::relative_tolerance(1e-5))) << backend;
    }
    // QLoRA: its gradients on the packed experts, through a checkpointed layer.
    const auto grads =
        qlora_gradients_match(name + "_q4", name + "_q4_f32", name + "_adapter", "--gradient_checkpointing");
    EXPECT_EQ(static_cast<int64_t>(grads.size()), packed * 2);  // A and B of every packed layer
    EXPECT_TRUE(std::any_of(grads.begin(), grads.end(), [](const auto& g) {
      return g.second && g.first.find(".mlp.experts.") != std::string::npos;
    }));  // routed experts with a gradient

    // GPTQ: each expert's projections over the Hessian of the rows routed to it. The file reads
    // back as `dequantize`'s weights, and the model's logits are nearer the float model's than
    // round-to-nearest's (GPTQ's claim, at the model's output).
    r = run_memtune("quantize --model " + path(name) + " --out " + path(name + "_gptq") +
                    " --bits 4 --group_size 32 --method gptq --calibration_file " + path("calibration.jsonl"));
    ASSERT_EQ(r.status, 0) << r.output;
    r = run_memtune("dequantize --model " + path(name + "_gptq") + " --out " + path(name + "_gptq_f32") +
                    " --torch_dtype float32");
    ASSERT_EQ(r.status, 0) << r.output;
    r = testing_support::run_command("/usr/bin/python3 " + testing_support::source_dir() + "/tests/io/quantized_vectors.py --check " +
                                     path(name + "_gptq") + " " + path(name + "_gptq_f32"));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find(fmt::format("{} quantized layers equal", packed)), std::string::npos) << r.output;
    // Held-out lines of the calibration's kind (GPTQ fits the layers to the inputs it saw).
    std::ofstream(path("held_out.jsonl")) << "\"the quick brown fox 185 jumps over\"\n"
                                             "\"the quick brown fox 296 jumps over\"\n";
    r = run_memtune("tokenize --tokenizer " + path(name) + " --input " + path("held_out.jsonl"));
    ASSERT_EQ(r.status, 0) << r.output;
    nlohmann::json held_out = nlohmann::json::array();
    for (std::istringstream lines(r.output); std::getline(lines, r.output);)
      if (r.output.starts_with("[")) held_out.push_back(nlohmann::json::parse(r.output));
    ASSERT_EQ(held_out.size(), 2u);
    std::ofstream(path("held_out.json")) << nlohmann::json{{"input_ids", held_out}}.dump();
    std::map<std::string, std::vector<float>> logits;
    for (const std::string& m : {name, name + "_q4", name + "_gptq"}) {
      r = run_memtune("dump --model " + path(m) + " --input " + path("held_out.json") + " --out " + path(m + ".dump"));
      ASSERT_EQ(r.status, 0) << r.output;
      logits[m] = tensor(path(m + ".dump"), "logits");
    }
    auto distance = [&](const std::string& m) {
      double d = 0;
      for (size_t i = 0; i < logits[name].size(); ++i)
        d += double(logits[m][i] - logits[name][i]) * (logits[m][i] - logits[name][i]);
      return std::sqrt(d);
    };
    EXPECT_LT(distance(name + "_gptq"), distance(name + "_q4"));
    std::printf("%s: logits' distance from the float model: gptq %.4g, round to nearest %.4g\n", name.c_str(),
                distance(name + "_gptq"), distance(name + "_q4"));
  }
}

TEST_F(QuantizedModelTest, RefusesWhatAQuantizedModelCannotDoWithClearErrors) {
  quantize("errors", "--bits 4 --group_size 32");
  auto r = run_memtune("train --model_name_or_path " + path("errors") + " --tokenizer " + path("float") +
                       " --train_file " + path("calibration.jsonl") + " --output_dir " + path("full_run") +
                       " --tuner_type full --max_steps 1");
  EXPECT_NE(r.status, 0);
  EXPECT_CONTAINS(r.output, "a 4-bit gptq model cannot be fine-tuned in full");
  // A missing packed tensor is named.
  fs::create_directories(dir_ / "broken");
  fs::copy_file(dir_ / "errors" / "config.json", dir_ / "broken" / "config.json");
  {
    const SafetensorsFile f(path("errors/model.safetensors"));
    std::vector<TensorToWrite> keep;
    for (const TensorInfo& t : f.tensors())
      if (t.name != "model.layers.1.mlp.up_proj.qzeros")
        keep.push_back({t.name, t.dtype, t.shape, f.data(t).data(), {}});
    write_safetensors(path("broken/model.safetensors"), keep);
  }
  r = run_memtune("dump --model " + path("broken") + " --input " + path("batch.json") + " --out " + path("x.dump"));
  EXPECT_NE(r.status, 0);
  EXPECT_CONTAINS(r.output, "missing tensor \"model.layers.1.mlp.up_proj.qzeros\" of the 4-bit gptq layer");
  // Unsupported quantization configs name the field.
  nlohmann::json config = testing_support::read_json(dir_ / "errors" / "config.json");
  config["quantization_config"]["quant_method"] = "bitsandbytes";
  std::ofstream(dir_ / "broken" / "config.json") << config.dump();
  r = run_memtune("dump --model " + path("broken") + " --input " + path("batch.json") + " --out " + path("x.dump"));
  EXPECT_NE(r.status, 0);
  EXPECT_CONTAINS(r.output, "field \"quantization_config.quant_method\": is \"bitsandbytes\"");
  config["quantization_config"]["quant_method"] = "gptq";
  config["quantization_config"]["bits"] = 3;
  std::ofstream(dir_ / "broken" / "config.json") << config.dump();
  r = run_memtune("dump --model " + path("broken") + " --input " + path("batch.json") + " --out " + path("x.dump"));
  EXPECT_NE(r.status, 0);
  EXPECT_CONTAINS(r.output, "is 3; GPTQ layers of 4 or 8 bits are supported");
  // Quantizing twice, and AWQ at 8 bits.
  r = run_memtune("quantize --model " + path("errors") + " --out " + path("twice"));
  EXPECT_NE(r.status, 0);
  EXPECT_CONTAINS(r.output, "the model is already quantized (4-bit gptq)");
  r = run_memtune("quantize --model " + path("float") + " --out " + path("awq8") + " --format awq --bits 8");
  EXPECT_NE(r.status, 0);
  EXPECT_CONTAINS(r.output, "--format awq takes --bits 4");
  EXPECT_FALSE(fs::exists(dir_ / "awq8"));
}

// GPTQ's claim, layer by layer: with H = X^T X of the calibration inputs, its codes leave a
// smaller output error ||(W - Q) X^T|| than rounding to nearest (with and without act-order).
TEST(Gptq, LeavesASmallerLayerOutputErrorThanRoundingToNearest) {
  const int64_t out = 48, in = 128, tokens = 512;
  Rng rng(3);
  std::vector<float> w(static_cast<size_t>(out * in)), x(static_cast<size_t>(tokens * in));
  for (float& v : w) v = static_cast<float>(0.05 * rng.normal());
  // Correlated inputs of uneven scale, as a layer's activations are: 16 underlying factors mixed
  // into the 128 inputs, a few inputs 5x larger, and a little independent noise.
  const int64_t factors = 16;
  std::vector<float> mix(static_cast<size_t>(in * factors));
  for (float& v : mix) v = static_cast<float>(rng.normal());
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> z(static_cast<size_t>(factors));
    for (double& v : z) v = rng.normal();
    for (int64_t k = 0; k < in; ++k) {
      double s = 0.1 * rng.normal();
      for (int64_t j = 0; j < factors; ++j) s += mix[static_cast<size_t>(k * factors + j)] * z[static_cast<size_t>(j)];
      x[static_cast<size_t>(t * in + k)] = static_cast<float>(s * (k % 7 == 0 ? 5.0 : 1.0));
    }
  }
  std::vector<float> H(static_cast<size_t>(in * in), 0.0f);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t i = 0; i < in; ++i)
      for (int64_t j = 0; j < in; ++j)
        H[static_cast<size_t>(i * in + j)] += x[static_cast<size_t>(t * in + i)] * x[static_cast<size_t>(t * in + j)];
  auto output_error = [&](const QuantizedLayer& layer) {
    const std::vector<float> q = dequantize_layer(layer);
    double e = 0;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t n = 0; n < out; ++n) {
        double d = 0;
        for (int64_t k = 0; k < in; ++k)
          d += double(w[static_cast<size_t>(n * in + k)] - q[static_cast<size_t>(n * in + k)]) * x[static_cast<size_t>(t * in + k)];
        e += d * d;
      }
    return e;
  };
  for (const int bits : {4, 8})
    for (const bool act_order : {false, true}) {
      QuantConfig t{QuantMethod::Gptq, bits, 32, act_order, true};
      std::vector<float> h = H;
      const double rtn = output_error(quantize_rtn(w, out, in, t));
      const double gptq = output_error(quantize_gptq(w, out, in, t, h, 0.01));
      EXPECT_LT(gptq, 0.3 * rtn) << bits << "-bit, act-order " << act_order << ": " << gptq << " vs " << rtn;
    }
}

}  // namespace
}  // namespace memtune
