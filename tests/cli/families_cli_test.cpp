// Qwen3 and Llama 3 through every command a user runs on them: init-model, train (LoRA on the
// seven projections with q_norm / k_norm frozen, and full fine-tuning that trains them), merge,
// eval, plan, generate with the adapter applied unmerged and merged. The numerics themselves are
// checked against PyTorch in tests/reference; this checks that the commands carry the families.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "data/synthetic_tokenizer.h"
#include "io/safetensors.h"
#include "support/run_command.h"
#include "support/test_util.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;
using testing_support::run_memtune;

class FamiliesCliTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    dir_ = testing_support::make_temp_dir("families_cli");
    std::ofstream data(dir_ / "train.jsonl");
    for (int i = 0; i < 8; ++i)
      data << nlohmann::json{{"messages",
                              {{{"role", "user"}, {"content", "hello " + std::to_string(i)}},
                               {{"role", "assistant"}, {"content", "world " + std::to_string(i % 3)}}}}}
                  .dump()
           << "\n";
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  void ok(const std::string& args) {
    const auto r = run_memtune(args);
    ASSERT_EQ(r.status, 0) << args << "\n" << r.output;
    last_output_ = r.output;
  }
  fs::path dir_;
  std::string last_output_;
};

TEST_P(FamiliesCliTest, EveryCommandRunsTheFamily) {
  const std::string preset = GetParam(), model = path("model");
  ok("init-model --preset " + preset + " --set vocab_size=269 --seed 4 --out " + model);
  testing_support::write_synthetic_tokenizer(dir_ / "model");
  const nlohmann::json config = nlohmann::json::parse(std::ifstream(path("model/config.json")));
  EXPECT_EQ(config["model_type"], preset == "tiny-qwen3" ? "qwen3" : "llama");

  const std::string train = "train --model " + model + " --train_file " + path("train.jsonl") +
                            " --max_steps 3 --per_device_train_batch_size 4 --save_strategy no";
  // A learning rate at which the adapter changes the greedy tokens (checked below), so that the
  // merged model's tokens equal the adapter's for a reason.
  ok(train + " --learning_rate 0.05 --output_dir " + path("lora"));
  const SafetensorsFile adapter(path("lora/adapter_model.safetensors"));
  for (const TensorInfo& t : adapter.tensors()) EXPECT_EQ(t.name.find("norm"), std::string::npos) << t.name;
  EXPECT_NE(adapter.find("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"), nullptr);
  ok(train + " --learning_rate 0.01 --tuner_type full --output_dir " + path("full"));
  const SafetensorsFile full(path("full/model.safetensors"));
  if (preset == "tiny-qwen3") {
    EXPECT_NE(full.find("model.layers.1.self_attn.k_norm.weight"), nullptr);
    EXPECT_EQ(full.find("model.layers.1.self_attn.k_proj.bias"), nullptr);
  }

  ok("eval --model " + path("full") + " --eval_file " + path("train.jsonl") + " --json");
  const nlohmann::json eval = nlohmann::json::parse(last_output_.substr(last_output_.find('{')));
  EXPECT_GT(eval["eval_loss"].get<double>(), 0);
  ok("plan --model " + model + " --json");
  EXPECT_GT(nlohmann::json::parse(last_output_)["parameters"].get<int64_t>(), 0);

  // The adapter unmerged, merged at load, and merged into a checkpoint: the same greedy tokens.
  std::ofstream(path("p.jsonl")) << R"({"messages": [{"role": "user", "content": "hello 1"}]})" << "\n";
  const std::string generate = " --input " + path("p.jsonl") + " --max_new_tokens 6 --temperature 0 --ignore_eos --json";
  ok("generate --model " + model + " --adapter " + path("lora") + generate);
  const std::string unmerged = last_output_.substr(0, last_output_.find('\n'));
  ok("generate --model " + model + " --adapter " + path("lora") + " --merge_adapter" + generate);
  EXPECT_EQ(last_output_.substr(0, last_output_.find('\n')), unmerged);
  ok("generate --model " + model + generate);
  EXPECT_NE(nlohmann::json::parse(last_output_.substr(0, last_output_.find('\n')))["token_ids"],
            nlohmann::json::parse(unmerged)["token_ids"])
      << "the adapter does not change the output: a merge that dropped it would pass";
  ok("merge --model " + model + " --adapter " + path("lora") + " --out " + path("merged"));
  ok("generate --model " + path("merged") + generate);
  EXPECT_EQ(nlohmann::json::parse(last_output_.substr(0, last_output_.find('\n')))["token_ids"],
            nlohmann::json::parse(unmerged)["token_ids"]);
}

INSTANTIATE_TEST_SUITE_P(Presets, FamiliesCliTest, ::testing::Values("tiny-qwen3", "tiny-llama"),
                         [](const auto& info) { return std::string(info.param).substr(5); });

}  // namespace
}  // namespace memtune
