// `memtune tokenize` and `memtune data stats` as a user runs them, on a synthetic tokenizer
// written to a temporary directory: ids per line, decode round trip, chat rendering, stats in
// both output forms, and bad lines reported as FILE:LINE with a non-zero exit.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "data/synthetic_tokenizer.h"
#include "support/run_command.h"
#include "support/test_util.h"
#include "tokenizer/chat_template.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;

using Result = testing_support::CommandResult;
Result memtune(const std::string& args) {
  return testing_support::run_memtune(args);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

class DataCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_support::make_temp_dir("data_cli_test");
    testing_support::write_synthetic_tokenizer(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  void write(const std::string& name, const std::string& text) const { std::ofstream(path(name)) << text; }
  std::string tok() const { return "--tokenizer " + dir_.string(); }
  fs::path dir_;
};

TEST_F(DataCliTest, TokenizeEncodesEachLineAndDecodesBack) {
  write("in.jsonl", "\"hello world\"\n\n\"Hi<|im_end|>\"\n");
  Result r = memtune("tokenize " + tok() + " --input " + path("in.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  const Tokenizer tokenizer = testing_support::synthetic_tokenizer();
  const auto lines = lines_of(r.output);
  ASSERT_EQ(lines.size(), 2u) << r.output;
  EXPECT_EQ(lines[0], nlohmann::json(tokenizer.encode("hello world")).dump());
  EXPECT_EQ(lines[1], nlohmann::json(tokenizer.encode("Hi<|im_end|>")).dump());

  write("ids.jsonl", r.output);
  r = memtune("tokenize " + tok() + " --decode < " + path("ids.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, "\"hello world\"\n\"Hi<|im_end|>\"\n");
}

TEST_F(DataCliTest, TokenizeChatRendersTheTemplateWithAGenerationPrompt) {
  write("chat.jsonl", R"({"messages": [{"role": "user", "content": "Hi"}]})"
                      "\n");
  Result r = memtune("tokenize " + tok() + " --chat --input " + path("chat.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  const Tokenizer tokenizer = testing_support::synthetic_tokenizer();
  const auto ids = nlohmann::json::parse(r.output).get<std::vector<int32_t>>();
  EXPECT_EQ(tokenizer.decode(ids),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
            "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  r = memtune("tokenize " + tok() + " --chat --template chatml --input " + path("chat.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(tokenizer.decode(nlohmann::json::parse(r.output).get<std::vector<int32_t>>()),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST_F(DataCliTest, TokenizeBadLinesNameFileAndLine) {
  write("in.jsonl", "\"ok\"\n{\"not\": \"a string\"}\n");
  Result r = memtune("tokenize " + tok() + " --input " + path("in.jsonl"));
  EXPECT_EQ(r.status, 1);
  EXPECT_CONTAINS(r.output, "in.jsonl:2: expected a JSON string, got object");
  write("ids.jsonl", "[1, 99999999]\n");
  r = memtune("tokenize " + tok() + " --decode --input " + path("ids.jsonl"));
  EXPECT_EQ(r.status, 1);
  EXPECT_CONTAINS(r.output, "ids.jsonl:1: token id 99999999 is outside the vocabulary");
  write("chat.jsonl", R"({"messages": [{"role": "assistant", "content": "x"}]})"
                      "\n");
  r = memtune("tokenize " + tok() + " --chat --input " + path("chat.jsonl"));
  EXPECT_EQ(r.status, 1);
  EXPECT_CONTAINS(r.output, "chat.jsonl:1: message 0: expected the conversation to start with a user message");
  EXPECT_NE(memtune("tokenize " + tok() + " --chat --decode").status, 0);
  write("broken.jsonl", "\"ok\"\n\n{broken\n");
  r = memtune("tokenize " + tok() + " --input " + path("broken.jsonl"));
  EXPECT_EQ(r.status, 1);
  EXPECT_CONTAINS(r.output, "broken.jsonl:3: invalid JSON: parse error at line 1");
  EXPECT_CONTAINS(r.output, "; expected a JSON string");
}

TEST_F(DataCliTest, TokenizeDropsAByteOrderMarkOnItsOwnLine) {
  // The byte order mark is dropped before the blank-line check, as for every JSONL file, so a
  // first line holding only the mark is blank, not invalid JSON.
  write("bom.jsonl", "\xEF\xBB\xBF\n\"hello world\"\n");
  const Result r = memtune("tokenize " + tok() + " --input " + path("bom.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, nlohmann::json(testing_support::synthetic_tokenizer().encode("hello world")).dump() + "\n");
}

TEST_F(DataCliTest, DataStatsPrintsATableOrJson) {
  std::string data;
  for (int i = 0; i < 20; ++i)
    data += fmt::format(R"({{"query": "q", "response": "{}"}})"
                        "\n",
                        std::string(static_cast<size_t>(i), 'x'));
  data += "broken\n";
  write("train.jsonl", data);
  Result r = memtune("data stats " + tok() + " --file " + path("train.jsonl") + " --max_length 30 --json");
  EXPECT_EQ(r.status, 1);
  EXPECT_CONTAINS(r.output, "train.jsonl:21: invalid JSON");

  r = memtune("data stats " + tok() + " --file " + path("train.jsonl") + " --max_length 30 --skip_bad_lines --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["examples"], 20);
  EXPECT_EQ(j["format"], "query_response");
  EXPECT_EQ(j["bad_lines"], 1);
  EXPECT_EQ(j["max_length"], 30);
  EXPECT_EQ(j["histogram"].size(), 10u);
  for (const char* key : {"file", "dropped_no_targets", "total_tokens", "target_tokens", "trainable_share",
                          "over_max_length", "suggested_max_length", "bad_line_reasons"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_TRUE(j["length"].contains("p99"));

  r = memtune("data stats " + tok() + " --file " + path("train.jsonl") + " --skip_bad_lines");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "20 examples (format query_response)");
  EXPECT_CONTAINS(r.output, "skipped " + path("train.jsonl") + ":21");
  EXPECT_CONTAINS(r.output, "suggested max_length: ");

  r = memtune("data " + tok());
  EXPECT_NE(r.status, 0);
}

TEST_F(DataCliTest, DataStatsCountsClassificationLabelsAndTheMajorityBaseline) {
  std::string data;
  const char* labels[] = {"net", "libs", "net", "doc", "net", "libs", "7"};
  for (const char* label : labels) data += nlohmann::json{{"text", "some text"}, {"label", label}}.dump() + "\n";
  data += R"({"text": "numeric label", "label": 7})"
          "\n";
  write("cls.jsonl", data);
  Result r = memtune("data stats " + tok() + " --file " + path("cls.jsonl") + " --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["format"], "classification");
  EXPECT_EQ(j["labels"], (nlohmann::json{{"net", 3}, {"libs", 2}, {"doc", 1}, {"7", 2}}));
  EXPECT_EQ(j["majority_label"], "net");
  EXPECT_DOUBLE_EQ(j["majority_baseline"].get<double>(), 3.0 / 8.0);
  r = memtune("data stats " + tok() + " --file " + path("cls.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "labels: 4 classes (7 2, doc 1, libs 2, net 3)");
  EXPECT_CONTAINS(r.output, "majority-class baseline accuracy: 0.3750 (always \"net\")");
}

TEST_F(DataCliTest, DataStatsSkipsALineWithAnUnusableLabelAndReportsIt) {
  // The dataset reader skips and reports the line; the label counts must skip it too, not stop
  // the command with an unlocated error after the statistics were printed.
  write("cls.jsonl", R"({"text": "good film", "label": "pos"})"
                     "\n"
                     R"({"text": "bad film", "label": ["neg"]})"
                     "\n"
                     R"({"text": "fine film", "label": "neg"})"
                     "\n");
  Result r = memtune("data stats " + tok() + " --file " + path("cls.jsonl") + " --skip_bad_lines");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "2 examples (format classification), 0 dropped without a loss target, 1 bad lines skipped");
  EXPECT_CONTAINS(r.output, "skipped " + path("cls.jsonl") + ":2: field \"label\"");
  EXPECT_CONTAINS(r.output, "labels: 2 classes (neg 1, pos 1)");
  r = memtune("data stats " + tok() + " --file " + path("cls.jsonl") + " --skip_bad_lines --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["bad_lines"], 1);
  EXPECT_EQ(j["labels"], (nlohmann::json{{"neg", 1}, {"pos", 1}}));
}

}  // namespace
}  // namespace memtune
