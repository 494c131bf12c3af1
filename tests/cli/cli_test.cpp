// The memtune command as a user runs it: init-model + dump produce the promised files, and bad
// input gives a clear message, a non-zero exit and no half-written output.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "io/safetensors.h"
#include "support/run_command.h"
#include "support/test_util.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;

using Result = testing_support::CommandResult;
Result run(const std::string& args) {
  return testing_support::run_memtune(args);
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing_support::make_temp_dir("cli_test"); }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  void write(const std::string& name, const std::string& text) const { std::ofstream(path(name)) << text; }
  fs::path dir_;
};

TEST_F(CliTest, InitModelThenDumpWritesLogitsLossAndEveryGradient) {
  Result r = run("init-model --preset tiny --set tie_word_embeddings=false --torch_dtype bfloat16 --seed 3 --out " +
                 path("m"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("parameters"), std::string::npos);
  write("in.json", R"({"input_ids": [[1, 2, 3, 4], [5, 6, 7, 8]], "labels": [[1, -100, 3, 4], [5, 6, 7, 8]]})");
  r = run("dump --model " + path("m") + " --input " + path("in.json") + " --out " + path("d.safetensors"));
  ASSERT_EQ(r.status, 0) << r.output;
  SafetensorsFile f(path("d.safetensors"));
  ASSERT_NE(f.find("logits"), nullptr);
  EXPECT_EQ(f.find("logits")->shape, (std::vector<int64_t>{2, 4, 512}));
  ASSERT_NE(f.find("loss"), nullptr);
  EXPECT_TRUE(f.find("loss")->shape.empty());
  EXPECT_NE(f.find("grad.lm_head.weight"), nullptr);
  EXPECT_NE(f.find("grad.model.layers.1.self_attn.k_proj.bias"), nullptr);
  EXPECT_EQ(f.tensors().size(), 2u + 1 + 2 * 12 + 1 + 1);
}

TEST_F(CliTest, UnknownFlagAndMissingArgumentsFail) {
  Result r = run("init-model --preset tiny --out " + path("m") + " --no_such_flag 1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("no_such_flag"), std::string::npos) << r.output;
  r = run("init-model --out " + path("m"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--preset or --config"), std::string::npos) << r.output;
  r = run("init-model --preset qwen9 --out " + path("m"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("qwen9"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(path("m/model.safetensors")));
}

TEST_F(CliTest, BadInputsNameTheFileAndWriteNothing) {
  ASSERT_EQ(run("init-model --preset tiny --out " + path("m")).status, 0);
  write("ragged.json", R"({"input_ids": [[1, 2, 3], [4, 5]]})");
  Result r = run("dump --model " + path("m") + " --input " + path("ragged.json") + " --out " + path("d.safetensors"));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("ragged.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("row 1"), std::string::npos) << r.output;
  write("oov.json", R"({"input_ids": [[1, 2, 600]]})");
  r = run("dump --model " + path("m") + " --input " + path("oov.json") + " --out " + path("d.safetensors"));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("600"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(path("d.safetensors")));

  // A truncated checkpoint: the error names the file; nothing is written.
  write("ok.json", R"({"input_ids": [[1, 2, 3]]})");
  fs::resize_file(path("m/model.safetensors"), fs::file_size(path("m/model.safetensors")) - 100);
  r = run("dump --model " + path("m") + " --input " + path("ok.json") + " --out " + path("d.safetensors"));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("model.safetensors"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(path("d.safetensors")));

  // A config for another architecture is refused by name.
  write("m/config.json", R"({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64,
      "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 512})");
  r = run("dump --model " + path("m") + " --input " + path("ok.json") + " --out " + path("d.safetensors"));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("MistralForCausalLM"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace memtune
